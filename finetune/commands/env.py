"""``finetune env [--json]``: what a bug report needs to know about this machine, one ``- key: value`` line each.

In the spirit of ``trl env`` (``trl/scripts/env.py``) and ``transformers env``: the platform and Python, the versions
of finetune and the libraries it trains with, the devices torch and DeepSpeed see, torch's CUDA/cuDNN/NCCL builds, and
the launcher and library variables of the environment that are set (those :mod:`finetune.parallel.distributed` reads
to wire the ranks, Slurm's, MPI's, NCCL's, ...). Paste it into the report as it is; ``--json`` prints the same as one
JSON object.

It only asks: no process group is started and no tensor is put on a device (``torch.cuda.is_available``, the device
count and names, DeepSpeed's accelerator name). Variables whose name suggests a secret (:data:`SECRET`: ``*TOKEN*``,
``*KEY*``, ``*SECRET*``, ``*PASSWORD*``, ``*_PASS``, ``*_PWD``, ``*_PSK``, ...) are never printed, and in every value
printed the user-info of a URL (``https://user:token@host``: ``https://***@host``) and the value of a query
parameter whose name suggests a secret (``?token=...``) are replaced by ``***`` (:func:`redact`), whatever the
variable's name (``HF_ENDPOINT``, ``WANDB_BASE_URL``, the proxies).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import finetune

LIBRARIES = ("torch", "deepspeed", "transformers", "peft", "datasets", "huggingface_hub", "tokenizers",
             "safetensors", "accelerate", "gguf", "trl", "mpi4py", "liger-kernel", "flash-attn", "xllamacpp")
"""Distributions whose versions are listed (``not installed`` when absent): finetune's dependencies, then the
optional ones it uses (``mpi4py``, ``liger-kernel``, ``flash-attn``, ``xllamacpp``) and the neighbours a report
often involves."""

ENV_NAMES = ("CROSS_RANK", "CROSS_SIZE", "GLIBC_TUNABLES", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE",
             "LD_PRELOAD", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
             "all_proxy", "no_proxy")
"""Variables listed by name when set, besides the rendezvous and the local sizes that finetune reads
(:data:`finetune.parallel.distributed.RANK_VARS`, :data:`~finetune.parallel.distributed.LOCAL_SIZE_VARS`): the
allocator and tokenizer settings, and the proxies the Hub client goes through (their credentials redacted)."""

ENV_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_", "TORCHELASTIC_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "CUDA_",
                "DS_", "OMP_", "MALLOC_", "HF_", "FINETUNE_", "WANDB_")
"""Prefixes of the variables listed when set: launchers (Slurm, Open MPI, MPICH/Intel MPI, torchrun), collectives,
torch and CUDA, DeepSpeed (``DS_ACCELERATOR``), threads and allocator, Hugging Face (offline mode, caches), finetune's
cache, offline W&B."""

SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|CREDS|AUTH|COOKIE"
                    r"|(?:^|[_.-])(?:PASS|PWD|PSK)(?:[_.-]|$)", re.I)
"""Names never printed, whatever their prefix (``HF_TOKEN``, ``WANDB_API_KEY``, ``NCCL_SOCKET_PASS``, ``SLURM_DB_PWD``,
``*_PSK``): anywhere in the name for the long words, as a whole ``_``-separated part for ``PASS``, ``PWD`` and ``PSK``
(so that ``BYPASS`` or ``PASSTHROUGH`` names stay). Names that say nothing of a secret (``PATH``, ``MASTER_ADDR``)
are printed, their values through :func:`redact`."""

_URL_AUTHORITY = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#\s,;]*)")
_BARE_USERINFO = re.compile(r"(?P<start>^|[\s,;])(?P<info>[^\s,;/?#@:]+:[^\s,;/?#]*)@(?=[^\s,;@]+)")
_SECRET_QUERY = re.compile(r"(?P<name>[?&;][^=&#\s]*(?:token|key|secret|pass|pwd|password|signature|sig|auth|"
                           r"credential)[^=&#\s]*=)(?P<value>[^&#\s]*)", re.I)


def redact(value: str) -> str:
    """``value`` with the credentials a URL can carry replaced by ``***``: the user-info of every URL in it
    (``https://user:token@host`` and ``https://token@host`` -> ``https://***@host``; RFC 3986 section 3.2.1: the
    user-info ends at the authority's last ``@``), a scheme-less ``user:password@host`` (how curl and pip also take a
    proxy), and the values of query parameters whose names suggest a secret (``?token=...``, ``&sig=...``). A value
    may hold several URLs (``NO_PROXY``'s comma-separated list); everything else is kept as it is."""
    def authority(m: re.Match) -> str:
        auth = m["authority"]
        return m["scheme"] + ("***@" + auth.rsplit("@", 1)[1] if "@" in auth else auth)

    value = _URL_AUTHORITY.sub(authority, value)
    value = _BARE_USERINFO.sub(lambda m: m["start"] + "***@", value)
    return _SECRET_QUERY.sub(lambda m: m["name"] + "***", value)


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def finetune_version() -> str:
    """finetune's version, with the commit of its source folder when it runs from a git checkout (``-dirty`` with
    uncommitted changes), as the launch records' ``git``."""
    root = Path(finetune.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return finetune.__version__
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return finetune.__version__
    if head.returncode != 0:
        return finetune.__version__
    return f"{finetune.__version__} (git {head.stdout.strip()}{'-dirty' if dirty else ''}, {root})"


def devices() -> dict:
    """What torch and DeepSpeed see, without starting anything: ``cuda_available``, ``gpus`` (count and names) or the
    CPU cores (all, and those this process may run on), torch's CUDA/HIP, cuDNN and NCCL builds (those present), and
    DeepSpeed's accelerator (``DS_ACCELERATOR`` or detected)."""
    # imported here, under main's redirection: DeepSpeed's import logs its accelerator choice to stdout
    import torch
    from deepspeed.accelerator import get_accelerator

    found: dict = {"cuda_available": torch.cuda.is_available()}
    if found["cuda_available"]:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        found["gpus"] = f"{len(names)}: " + ", ".join(names)
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    found["cpu_cores"] = f"{cores}" + (f" ({usable} usable by this process)" if usable != cores else "")
    if torch.version.cuda:
        found["torch_cuda"] = torch.version.cuda
    if getattr(torch.version, "hip", None):
        found["torch_hip"] = torch.version.hip
    if found["cuda_available"] and torch.backends.cudnn.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    if (torch.version.cuda or getattr(torch.version, "hip", None)) and torch.distributed.is_nccl_available():
        nccl = torch.cuda.nccl.version()
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    found["deepspeed_accelerator"] = get_accelerator().device_name()
    return found


def launch_environment(environ: dict | None = None) -> dict[str, str]:
    """The set variables of :data:`~finetune.parallel.distributed.RANK_VARS`, ``LOCAL_SIZE_VARS``, :data:`ENV_NAMES` and
    :data:`ENV_PREFIXES`, sorted by name, secrets (:data:`SECRET`) left out and every value through :func:`redact`
    (the credentials of URLs). ``environ`` defaults to ``os.environ``."""
    from finetune.parallel.distributed import LOCAL_SIZE_VARS, RANK_VARS  # imports DeepSpeed: see devices()

    environ = os.environ if environ is None else environ
    names = (*RANK_VARS, *LOCAL_SIZE_VARS, *ENV_NAMES)
    return {k: redact(environ[k]) for k in sorted(environ)
            if (k in names or k.startswith(ENV_PREFIXES)) and not SECRET.search(k)}


def collect() -> dict:
    """Everything ``finetune env`` prints, in order: ``platform``, ``python``, ``finetune``, one key per
    :data:`LIBRARIES` entry, :func:`devices`' keys, and ``environment`` (:func:`launch_environment`)."""
    return {"platform": platform.platform(), "python": f"{platform.python_version()} ({sys.executable})",
            "finetune": finetune_version(), **{name: _version(name) for name in LIBRARIES}, **devices(),
            "environment": launch_environment()}


def render(info: dict) -> str:
    """``info`` as Markdown ``- key: value`` lines; a nested mapping (the environment) as indented lines under its
    key (``none set`` when empty)."""
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"- {key}:" + ("" if value else " none set"))
            lines += [f"  - {k}: {v}" for k, v in value.items()]
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``finetune env [--json]``: print the report (Markdown lines, or JSON with ``--json``); returns 0."""
    p = argparse.ArgumentParser(prog="finetune env", description="Print the platform, versions, devices and launcher "
                                "variables, for a bug report.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of Markdown lines")
    args = p.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; stdout is the report's alone
        info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("Copy-paste this into your bug report:\n")
        print(render(info))
    return 0
