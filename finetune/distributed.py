"""Rank/world discovery for every launcher, process-group start-up and small collective helpers.

``deepspeed`` and ``torchrun`` export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. ``srun`` and ``mpirun`` do not: :func:`export_rank_env` derives the five variables from
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (head node from ``SLURM_JOB_NODELIST``) or from
OpenMPI's ``OMPI_COMM_WORLD_*``, so ``deepspeed.init_distributed`` never falls back to mpi4py discovery
(which aborts under a Slurm-less OpenMPI). A plain ``python finetune/run.py`` becomes a world of one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
        return out[0] if out else "127.0.0.1"
    except (OSError, subprocess.SubprocessError):
        return nodelist.split(",")[0].split("[")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_rank_env() -> str:
    """Make sure ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` are set.

    Returns:
        The launcher the variables came from: ``env`` (deepspeed/torchrun), ``slurm``, ``mpi`` or ``single``.
    """
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return "env"
    if "OMPI_COMM_WORLD_RANK" in env:
        env.setdefault("RANK", env["OMPI_COMM_WORLD_RANK"])
        env.setdefault("WORLD_SIZE", env["OMPI_COMM_WORLD_SIZE"])
        env.setdefault("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        env.setdefault("MASTER_ADDR", _first_slurm_host() if "SLURM_JOB_NODELIST" in env else "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        return "mpi"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_ADDR", _first_slurm_host())
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
        return "slurm"
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    return "single"


def rank() -> int:
    """Global rank (0 before the process group exists)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of ranks (from the environment before the process group exists)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """Rank on this node."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    """True on global rank 0, the rank that prints, writes TensorBoard and the run folder's shared files."""
    return rank() == 0


def init(timeout_minutes: float) -> None:
    """Start the process group through DeepSpeed (NCCL on GPUs, gloo on the CPU accelerator).

    Args:
        timeout_minutes: collective timeout; a rank that died makes the others raise after this long.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cuda":
        get_accelerator().set_device(local_rank())
    deepspeed.init_distributed(timeout=timedelta(minutes=timeout_minutes), auto_mpi_discovery=False)


def barrier() -> None:
    """All ranks wait here (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_process_first():
    """Rank 0 runs the body first (e.g. tokenizes and writes the cache); the others wait, then run it (cache hit)."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks; returns ``t``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on at least one rank (one all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_sum(t).item() > 0)
