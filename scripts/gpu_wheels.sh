#!/usr/bin/env bash
# Build the wheelhouse that the lent GPU machine installs finetune's dependencies from (no network there).
#
#   bash scripts/gpu_wheels.sh [DIR]        DIR defaults to .whl/ (git-ignored)
#
# Runs on a CPU machine that reaches the package index. It fetches manylinux x86_64 wheels for CPython 3.12
# (the GPU image's Python is 3.12.3) with `pip download --no-deps`, builds the two pins that PyPI has as source
# archives only (deepspeed, with DS_BUILD_OPS=0 so that it is a pure-Python wheel whose ops JIT-compile on the
# GPU machine, and rouge-score), and checks the result:
#   - every wheel installs on CPython 3.12, manylinux x86_64;
#   - one wheel per distribution (two versions of one stop the whole install there);
#   - no torch, torchvision, torchaudio, triton or nvidia-* wheel (the image's CUDA torch is never replaced);
#   - every requirement of every wheel (extras left out, markers evaluated for the GPU machine) is met by a wheel
#     here (at a version its specifier accepts) or by a package the GPU image has (GPU_IMAGE_HAS, below; where
#     GPU_IMAGE_VERSIONS knows the image's version, the specifier is checked against it);
#   - the total is at most 60 MiB (the device tool carries 64 MiB of working tree a call).
# Wheels in DIR that the table below does not name are removed (keep one version of each). The GPU half is
# scripts/gpu_install.sh; docs/gpu-check.md, "The wheelhouse", says how the two fit together.
#
# Environment (for testing these scripts elsewhere; the defaults are the GPU machine's):
#   PYTHON            the interpreter that runs pip and builds deepspeed (default: the repo's .venv, else python3)
#   GPU_PY            the target Python version (default 3.12)
set -euo pipefail

# ---------------------------------------------------------------------------------------------------------------
# The wheelhouse: one pinned version of each. The versions are the ones installed in the project's tested
# environment (pip list in .venv; pyproject.toml's pins where it has one, liger-kernel from its `gpu` extra).
# Carried: finetune's own pins, what they need that the GPU image lacks (hjson, pydantic, dill, multiprocess,
# httpx2, nltk, ...), and small pure-Python packages whose required version is capped or recent while the image's
# version is not known here (fsspec <=2026.9.0 for datasets; typing-extensions >=4.16 for pydantic; anyio, idna,
# h11 for httpx2). Not carried: torch and what comes with it, and pyarrow (42 MiB; datasets 5.2.0 asks for
# >=24.0.0, which gpu_install.sh checks against the image's pyarrow on the machine itself).
# `build` = built here from its source archive (pip wheel); `wheel` = downloaded as a wheel.
WHEELS="
deepspeed==0.19.8           build
rouge-score==0.1.2          build
transformers==5.23.0        wheel
datasets==5.2.0             wheel
peft==0.21.2                wheel
trl==1.16.0                 wheel
accelerate==1.15.0          wheel
huggingface-hub==2.4.0      wheel
loguru==0.7.3               wheel
liger-kernel==0.8.5         wheel
hjson==3.1.0                wheel
pydantic==2.14.4            wheel
pydantic-core==2.50.5       wheel
annotated-types==0.8.0      wheel
typing-inspection==0.4.5    wheel
typing-extensions==4.16.0   wheel
dill==0.4.1                 wheel
multiprocess==0.70.19       wheel
fsspec==2026.9.0            wheel
httpx2==2.16.2              wheel
httpcore2==2.16.2           wheel
truststore==0.10.5          wheel
anyio==4.16.0               wheel
idna==3.20                  wheel
h11==0.16.0                 wheel
nltk==3.10.4                wheel
defusedxml==0.7.1           wheel
"

# Python packages on the GPU machine's image ('cuda'), as listed in the device tool's KINDS.md (2026-11-17).
GPU_IMAGE_HAS="
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
"
# The image's versions where known: read there (KINDS.md's pip list), or the least that the image's own
# huggingface_hub 1.33.0 and transformers 5.17.0 require (click, hf-xet, regex). Specifiers are checked against
# these; a requirement on an image package whose version is not known here is checked by name only (and on the
# machine itself by gpu_install.sh).
GPU_IMAGE_VERSIONS="
torch==2.11.0 triton==3.6.0 numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2 accelerate==1.15.0
huggingface-hub==1.33.0 transformers==5.17.0 sentencepiece==0.2.2 tiktoken==0.14.0
click>=8.4.2 hf-xet>=1.6.0 regex>=2025.10.22
"
MAX_MIB=60
PLATFORMS="manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64"
# ---------------------------------------------------------------------------------------------------------------

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
GPU_PY="${GPU_PY:-3.12}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

say() { echo "gpu_wheels: $*"; }
fail() { echo "gpu_wheels: error: $*" >&2; exit 1; }
# pip with its output kept in $LOG; shown (less the notes about unreadable extra index folders) when it fails
pip_quiet() {
    if ! "$PYTHON" -m pip "$@" >"$LOG" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$LOG" >&2 || true
        fail "pip $1 failed (above)"
    fi
}

"$PYTHON" -c 'import packaging.requirements' 2>/dev/null \
    || fail "$PYTHON has no 'packaging' module (set PYTHON to an interpreter with pip and packaging)"

build=() download=()
while read -r spec how; do
    [[ -z "$spec" ]] && continue
    case "$how" in
        build) build+=("$spec") ;;
        wheel) download+=("$spec") ;;
        *) fail "table: '$spec $how': the second column is build or wheel" ;;
    esac
done <<<"$WHEELS"

plat_args=()
for p in $PLATFORMS; do plat_args+=(--platform "$p"); done
say "downloading ${#download[@]} wheels for CPython $GPU_PY into $DIR"
pip_quiet download --no-deps --only-binary=:all: --python-version "$GPU_PY" --implementation cp "${plat_args[@]}" \
    -d "$DIR" "${download[@]}"

for spec in "${build[@]}"; do
    name="${spec%%==*}" version="${spec##*==}"
    stem="$(echo "$name" | tr '-' '_')-$version-"
    if compgen -G "$DIR/$stem*.whl" >/dev/null; then
        say "$spec: wheel already built"
        continue
    fi
    say "$spec: building its wheel from the source archive (DS_BUILD_OPS=0: pure Python, no DeepSpeed op compiled)"
    DS_BUILD_OPS=0 pip_quiet wheel --no-deps --no-build-isolation --no-cache-dir -w "$DIR" "$spec"
    compgen -G "$DIR/${stem}py3-none-any.whl" >/dev/null || compgen -G "$DIR/${stem}py2.py3-none-any.whl" >/dev/null \
        || fail "$spec: the wheel built is not pure Python (py3-none-any): $(cd "$DIR" && ls "$stem"*.whl)"
done

say "checking $DIR"
WHEELS="$WHEELS" GPU_IMAGE_HAS="$GPU_IMAGE_HAS" GPU_IMAGE_VERSIONS="$GPU_IMAGE_VERSIONS" \
    "$PYTHON" - "$DIR" "$GPU_PY" "$MAX_MIB" <<'PYEOF'
import os
import re
import sys
import zipfile
from email.parser import BytesParser
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

wheel_dir, py, max_mib = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
table = {}
for line in os.environ["WHEELS"].split("\n"):
    if line.strip():
        req = Requirement(line.split()[0])
        table[canonicalize_name(req.name)] = str(req.specifier)[2:]
image_has = {canonicalize_name(n) for n in os.environ["GPU_IMAGE_HAS"].split()}
image_versions = {}
for item in os.environ["GPU_IMAGE_VERSIONS"].split():
    req = Requirement(item)
    image_versions[canonicalize_name(req.name)] = req.specifier
problems = []

# which Pythons and platforms the GPU machine installs
major, minor = (int(x) for x in py.split("."))
plats = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
cp = f"cp{major}{minor}"
supported = set(tags.cpython_tags((major, minor), abis=[cp, "abi3", "none"], platforms=plats))
supported |= set(tags.compatible_tags((major, minor), cp, plats))

# which wheels are ours: remove the rest (an older version, a wheel for another Python, one put there by hand)
wheels = {}
for path in sorted(wheel_dir.glob("*.whl")):
    name, version, _, wheel_tags = parse_wheel_filename(path.name)
    if table.get(name) != str(version):
        print(f"gpu_wheels: removing {path.name}: not in the table at the top of scripts/gpu_wheels.sh")
        path.unlink()
        continue
    if not wheel_tags & supported:
        print(f"gpu_wheels: removing {path.name}: it does not install on CPython {py}, manylinux x86_64")
        path.unlink()
        continue
    if name in wheels:
        problems.append(f"two wheels of {name}: {wheels[name][0].name}, {path.name}")
    wheels[name] = (path, version, wheel_tags)
for name in sorted(set(table) - set(wheels)):
    problems.append(f"no wheel of {name}=={table[name]} in {wheel_dir}")

# never torch (nor what is built with it): the image's CUDA build stays
for name, (path, _, _) in wheels.items():
    if name in {"torch", "torchvision", "torchaudio", "triton"} or name.startswith("nvidia-"):
        problems.append(f"{path.name}: the GPU image's own {name} is never replaced")

# every requirement is met, by a wheel here or by the image
env = {"python_version": py, "python_full_version": py + ".3", "platform_machine": "x86_64",
       "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
notes, unknown = [], {}
for name, (path, version, _) in sorted(wheels.items()):
    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = BytesParser().parsebytes(z.read(meta_name))
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        who = f"{name} {version} needs {req.name}{req.specifier}"
        if dep in wheels:
            if not req.specifier.contains(wheels[dep][1], prereleases=True):
                problems.append(f"{who}; the wheelhouse has {dep} {wheels[dep][1]}")
        elif dep in image_has:
            known = image_versions.get(dep)
            if known is None:
                if str(req.specifier):
                    unknown.setdefault(dep, set()).add(str(req.specifier))
            elif len(known) == 1 and next(iter(known)).operator == "==":
                image_version = next(iter(known)).version
                if not req.specifier.contains(image_version, prereleases=True):
                    problems.append(f"{who}; the GPU image has {dep} {image_version}: add a wheel of it")
            else:
                lowest = [s.version for s in known if s.operator == ">="]
                if lowest and str(req.specifier) and not req.specifier.contains(lowest[0], prereleases=True):
                    notes.append(f"{who}: the image has {dep}{known} (gpu_install.sh checks it there)")
        else:
            problems.append(f"{who}: neither in the wheelhouse nor on the GPU image: add it to the table")

# the list, and the size
total = 0
print(f"gpu_wheels: {len(wheels)} wheels in {wheel_dir}:")
for name, (path, _, _) in sorted(wheels.items(), key=lambda kv: -kv[1][0].stat().st_size):
    size = path.stat().st_size
    total += size
    print(f"  {size / 2**20:8.2f} MiB  {path.name}")
print(f"  {total / 2**20:8.2f} MiB  in all (limit {max_mib} MiB)")
if total > max_mib * 2**20:
    problems.append(f"the wheelhouse is {total / 2**20:.2f} MiB, over {max_mib} MiB")
if unknown:
    notes.append("the image's version is not known here (gpu_install.sh checks it on the machine) of: "
                 + ", ".join(f"{dep}{' '.join(sorted(specs))}" for dep, specs in sorted(unknown.items())))
for note in notes:
    print(f"gpu_wheels: note: {note}")
for problem in problems:
    print(f"gpu_wheels: error: {problem}", file=sys.stderr)
if problems:
    sys.exit(1)
print(f"gpu_wheels: ok: one wheel per distribution, all for CPython {py} manylinux x86_64, no torch, "
      "every requirement met")
PYEOF
