# shellcheck shell=bash
# Install the wheelhouse on the lent GPU machine (no network there) and make finetune importable, without
# `pip install -e .` and without touching the image's own packages. Meant to be SOURCED, from the repository root:
#
#   . scripts/gpu_install.sh [DIR]          DIR: the wheelhouse, default .whl/ (built by scripts/gpu_wheels.sh)
#
# (From a script that has arguments of its own, name DIR: `.` passes the caller's arguments on when given none.)
# It installs every wheel of DIR with `pip install --no-index --no-deps --target` into a folder of its own
# (GPU_SITE, default /tmp/gpu_site), then exports PYTHONPATH=<GPU_SITE>:<repo root>:$PYTHONPATH, so the
# wheelhouse's versions shadow the image's (its transformers 5.17 gives way to our 5.23, and so on) and
# `python3 -m finetune ...` runs from the checkout; <GPU_SITE>/bin (deepspeed's launcher, ...) goes on PATH.
# torch is never installed nor upgraded: a wheelhouse holding torch, torchvision, torchaudio, triton or nvidia-*
# is refused, and the check below fails if the torch that imports is not the image's.
# After installing, it checks that deepspeed, transformers, datasets, peft, trl and loguru import, from
# GPU_SITE, at the wheelhouse's versions, prints them with torch's version and whether CUDA is available, and
# warns (one line each) where the image's version of a package does not meet a wheel's requirement (e.g. pyarrow
# for datasets). Returns 1 with one line naming the problem when the wheelhouse is missing or the check fails.
# A second run with the same wheelhouse skips the install (GPU_SITE/.gpu_site records what was installed).
#
# Run as `bash scripts/gpu_install.sh [DIR]` it installs and checks the same way and prints the two export
# lines to paste (or eval) instead.
#
# Environment: GPU_SITE (the install folder, default /tmp/gpu_site), GPU_PYTHON (else PYTHON, else python3: on the
# GPU machine, /opt/torch/.venv's Python 3.12, the one with CUDA torch).

_gpu_install() {
    local root dir site py stamp f base name wheels=()
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    dir="${1:-$root/.whl}"
    site="${GPU_SITE:-/tmp/gpu_site}"
    py="${GPU_PYTHON:-${PYTHON:-python3}}"

    if [[ ! -d "$dir" ]] || ! compgen -G "$dir/*.whl" >/dev/null; then
        echo "gpu_install: error: no wheelhouse at $dir (no *.whl there): build it with 'bash scripts/gpu_wheels.sh' on a machine that reaches the package index and carry it here" >&2
        return 1
    fi
    dir="$(cd "$dir" && pwd)"
    for f in "$dir"/*.whl; do
        base="${f##*/}"
        name="$(echo "${base%%-*}" | tr 'A-Z_.' 'a-z--')"
        case "$name" in
            torch | torchvision | torchaudio | triton | nvidia-*)
                echo "gpu_install: error: $dir holds $base: the GPU image's own torch (and triton, nvidia-*) is never replaced; remove it and rebuild with scripts/gpu_wheels.sh" >&2
                return 1 ;;
        esac
        wheels+=("$f")
    done
    if ! command -v "$py" >/dev/null 2>&1; then
        echo "gpu_install: error: no '$py' here (set GPU_PYTHON to the Python that has the machine's torch)" >&2
        return 1
    fi

    stamp="$(for f in "${wheels[@]}"; do printf '%s %s\n' "${f##*/}" "$(stat -c %s "$f")"; done)"
    if [[ -f "$site/.gpu_site" && "$(cat "$site/.gpu_site")" == "$stamp" ]]; then
        echo "gpu_install: $site already holds the ${#wheels[@]} wheels of $dir"
    else
        if [[ -e "$site" && ! -f "$site/.gpu_site" ]] && [[ -n "$(ls -A "$site" 2>/dev/null)" ]]; then
            echo "gpu_install: error: $site exists and was not made by gpu_install.sh: remove it or set GPU_SITE to another folder" >&2
            return 1
        fi
        rm -rf "$site"
        mkdir -p "$site" || return 1
        echo "gpu_install: installing ${#wheels[@]} wheels of $dir into $site (no index, no dependencies, torch left alone)"
        if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
                --upgrade --target "$site" "${wheels[@]}"; then
            echo "gpu_install: error: pip install --target $site failed (above)" >&2
            return 1
        fi
        if compgen -G "$site/torch*" >/dev/null || compgen -G "$site/nvidia*" >/dev/null \
                || compgen -G "$site/triton*" >/dev/null; then
            echo "gpu_install: error: $site holds torch, triton or nvidia-* after the install: the image's own must stay" >&2
            return 1
        fi
        printf '%s\n' "$stamp" >"$site/.gpu_site"
    fi

    case ":${PYTHONPATH:-}:" in
        ":$site:$root:"*) ;;
        *) export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    if [[ -d "$site/bin" ]]; then
        case ":$PATH:" in
            *":$site/bin:"*) ;;
            *) export PATH="$site/bin:$PATH" ;;
        esac
    fi

    GPU_SITE="$site" "$py" - <<'PYEOF' || { echo "gpu_install: error: the check after the install failed (above)" >&2; return 1; }
import importlib
import importlib.metadata as md
import os
import sys

site = os.path.realpath(os.environ["GPU_SITE"])
ours = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions(path=[site])}


def inside(path):
    return path is not None and os.path.realpath(path).startswith(site + os.sep)


errors, warnings, found = [], [], []
# (module, distribution, required): the optional ones only warn (finetune runs without them)
for module, dist, required in [("deepspeed", "deepspeed", True), ("transformers", "transformers", True),
                               ("datasets", "datasets", True), ("peft", "peft", True), ("trl", "trl", True),
                               ("loguru", "loguru", True), ("rouge_score", "rouge-score", False),
                               ("liger_kernel", "liger-kernel", False)]:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        (errors if required else warnings).append(f"import {module}: {type(e).__name__}: {e}")
        continue
    version = md.version(dist)
    if not inside(getattr(mod, "__file__", None)):
        (errors if required else warnings).append(
            f"{module} imports from {mod.__file__}, not from {site} (PYTHONPATH={os.environ.get('PYTHONPATH')})")
    elif dist in ours and version != ours[dist]:
        errors.append(f"{dist}: the metadata found first says {version}, {site} holds {ours[dist]}")
    found.append(f"{dist} {version}")

import torch  # noqa: E402 - after the others: deepspeed, trl and peft import it anyway

cuda = torch.cuda.is_available()
if inside(torch.__file__):
    errors.append(f"torch imports from {torch.__file__}, inside {site}: the image's own torch must be used")
gpu = f", {torch.cuda.get_device_name(0)}" if cuda else ""
found.append(f"torch {torch.__version__} (the image's, CUDA available: {cuda}{gpu})")
if not cuda:
    warnings.append("torch.cuda.is_available() is False")

# every requirement of what was installed, against what imports now (the image's packages behind ours)
try:
    from packaging.requirements import Requirement
except ImportError:
    warnings.append("no 'packaging' module: requirements not checked")
else:
    for d in md.distributions(path=[site]):
        for line in d.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                warnings.append(f"{d.metadata['Name']} {d.version} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                warnings.append(f"{d.metadata['Name']} {d.version} needs {req}; found {req.name} {have}")

print(f"gpu_install: {len(ours)} packages from {site}: " + ", ".join(found))
for w in warnings:
    print(f"gpu_install: warning: {w}")
for e in errors:
    print(f"gpu_install: error: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PYEOF
    echo "gpu_install: ok: PYTHONPATH=$PYTHONPATH"
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    _gpu_install "$@"
    _gpu_install_rc=$?
    unset -f _gpu_install
    eval "unset _gpu_install_rc; return $_gpu_install_rc"
fi
if _gpu_install "$@"; then
    # executed rather than sourced: the exports end with this process, so say what to export
    echo "export PYTHONPATH=$PYTHONPATH"
    [[ -d "${GPU_SITE:-/tmp/gpu_site}/bin" ]] && echo "export PATH=${GPU_SITE:-/tmp/gpu_site}/bin:\$PATH"
    exit 0
fi
exit 1
