"""Rank/world discovery for every launcher, process-group start-up and small collective helpers.

PyTorch's ``env://`` rendezvous needs ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. :func:`export_rank_env` makes sure all five are set, whichever launcher started the
process, so ``deepspeed.init_distributed`` never falls back to its mpi4py discovery (which aborts in
``MPI_Init`` under ``srun`` with an OpenMPI built without Slurm's PMI, and defaults to port 29500):

===============================================  ===========  ==============================================
launcher                                         name         where the five variables come from
===============================================  ===========  ==============================================
``deepspeed --num_gpus N`` / ``--hostfile``      deepspeed    the launcher sets all five
``torchrun --nproc_per_node N``                  torchrun     the launcher sets all five
``mpirun -np N`` (OpenMPI)                       mpi          ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}``;
                                                              address and port: rank 0's host and a free
                                                              port broadcast with mpi4py (``pip install
                                                              .[mpi]``), else ``127.0.0.1`` (one node) and a
                                                              port derived from the MPI job id
``mpiexec`` (MPICH, Intel MPI: ``PMI_RANK``)     mpi          ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``
``srun`` (also ``deepspeed --launcher slurm``)   srun         ``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``/
                                                              ``SLURM_LOCALID``; head node of
                                                              ``SLURM_JOB_NODELIST``; port from the job id
``python finetune/run.py``                       single       a world of one on a free port
===============================================  ===========  ==============================================

``MASTER_ADDR``/``MASTER_PORT`` already in the environment always win (``mpirun -x MASTER_PORT=...``,
``export MASTER_PORT=...`` before ``srun``). A partial set (say ``RANK`` without ``WORLD_SIZE``) outside
these launchers is an error rather than a guess.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch.distributed import distributed_c10d

from finetune import patches
from finetune.errors import ConfigError
from finetune.parallel import op_builds

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_PORT_BASE, _PORT_SPAN = 20000, 10000  # derived ports stay below Linux's ephemeral range (32768-60999)
_launcher: str | None = None


def slurm_head_node() -> str:
    """First host of the job's node list (``scontrol show hostnames``), ``127.0.0.1`` outside Slurm."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    # no scontrol here: expand the first entry of a list like "gpu[01-04,07],cpu3" by hand
    first = nodelist.split(",")[0]
    if "[" in first:
        prefix, rng = first.split("[", 1)
        return prefix + rng.split(",")[0].split("-")[0].rstrip("]")
    return first


FREE_PORTS = (30000, 32768)
"""Where :func:`free_port` looks: below Linux's ephemeral range (32768-60999, ``ip_local_port_range``), so no
outgoing connection (gloo opens many) can take the port between the pick and the master's ``listen``, and above the
ports derived from a job id (``_PORT_BASE`` + ``_PORT_SPAN``)."""


def free_port(lo: int = FREE_PORTS[0], hi: int = FREE_PORTS[1]) -> int:
    """A TCP port in ``[lo, hi)`` that nothing listens on now, starting from a random one.

    The kernel's own pick (``bind(("", 0))``) is an ephemeral port: released at once, it can be handed to another
    process's outgoing connection before the master binds it (``EADDRINUSE`` in ``TCPStore``). A port below the
    ephemeral range is only ever taken by a process that asks for it by number; launches side by side (pytest-xdist
    workers) pass disjoint ranges.

    Raises:
        RuntimeError: every port of the range is taken.
    """
    start = random.SystemRandom().randrange(lo, hi)
    for i in range(hi - lo):
        port = lo + (start - lo + i) % (hi - lo)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{lo}, {hi})")


def _derived_port(key: int) -> int:
    return _PORT_BASE + key % _PORT_SPAN


def _mpi_rendezvous(env) -> None:
    """MASTER_ADDR/MASTER_PORT for an MPI launch: broadcast from rank 0 when mpi4py is there."""
    local_size = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("MPI_LOCALNRANKS", "0")) or 0)
    one_node = local_size == int(env["WORLD_SIZE"])
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is not None:
        comm = MPI.COMM_WORLD
        mine = ("127.0.0.1" if one_node else socket.gethostname(), str(free_port()))
        addr, port = comm.bcast(mine if comm.Get_rank() == 0 else None, root=0)
        env.setdefault("MASTER_ADDR", addr)
        env.setdefault("MASTER_PORT", port)
        return
    if not one_node and "MASTER_ADDR" not in env:
        if "SLURM_JOB_NODELIST" not in env:
            raise ConfigError("mpirun across nodes: install mpi4py (pip install '.[mpi]') or pass "
                               "-x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> to mpirun")
        env["MASTER_ADDR"] = slurm_head_node()
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMI_JOBID") or env.get("SLURM_JOB_ID") or "0"
    env.setdefault("MASTER_PORT", str(_derived_port(int("".join(c for c in job if c.isdigit()) or 0))))


def export_rank_env() -> str:
    """Make sure ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` are set.

    Returns:
        The launcher the variables came from: ``deepspeed``, ``torchrun``, ``env`` (another launcher that
        set all five), ``mpi``, ``srun`` or ``single``. :func:`launcher` returns it later.

    Raises:
        ConfigError: some but not all of ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set and no launcher
            that explains the rest is recognised (a world size guessed wrong would hang).
    """
    global _launcher
    env = os.environ
    if all(k in env for k in RANK_VARS):
        if "TORCHELASTIC_RUN_ID" in env:
            _launcher = "torchrun"
        elif "CROSS_RANK" in env and "LOCAL_SIZE" in env:
            _launcher = "deepspeed"
        else:
            _launcher = "env"
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        ompi = "OMPI_COMM_WORLD_RANK" in env
        env.setdefault("RANK", env["OMPI_COMM_WORLD_RANK" if ompi else "PMI_RANK"])
        env.setdefault("WORLD_SIZE", env["OMPI_COMM_WORLD_SIZE" if ompi else "PMI_SIZE"])
        env.setdefault("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK" if ompi else "MPI_LOCALRANKID", "0"))
        _mpi_rendezvous(env)
        _launcher = "mpi"
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # a task of srun (the batch script has no step id)
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_ADDR", slurm_head_node())
        job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0") or 0)
        env.setdefault("MASTER_PORT", str(_derived_port(job * 7 + step)))
        _launcher = "srun"
    elif any(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and env.get("WORLD_SIZE", "1") != "1":
        missing = [k for k in RANK_VARS if k not in env]
        raise ConfigError(f"incomplete rank environment: {', '.join(missing)} not set (launch with deepspeed, "
                           f"torchrun, mpirun or srun, or set all of {', '.join(RANK_VARS)})")
    else:
        env.setdefault("RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
        _launcher = "single"
    return _launcher


def launcher() -> str:
    """The launcher :func:`export_rank_env` recognised (``unknown`` before it ran)."""
    return _launcher or "unknown"


def describe() -> str:
    """One line with this process's place in the world, for every rank's log (tests parse it).

    ``wiring: rank R of W, local rank L, launcher X, host H, pid P, master ADDR:PORT``
    """
    env = os.environ
    return (f"wiring: rank {rank()} of {world_size()}, local rank {local_rank()}, launcher {launcher()}, "
            f"host {socket.gethostname()}, pid {os.getpid()}, master {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}")


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


LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                    "SLURM_NTASKS_PER_NODE")
"""Where launchers put the number of ranks on this node: torchrun, DeepSpeed's launcher, Open MPI, MPICH, Slurm."""


def local_world_size() -> int:
    """Ranks on this node, from the launcher's variables (:data:`LOCAL_SIZE_VARS`); the world size when none says."""
    for key in LOCAL_SIZE_VARS:
        value = os.environ.get(key, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world_size()


def set_cpu_threads() -> str:
    """CPU ranks: give each rank its share of this process's cores for torch's intra-op threads.

    ``torch.set_num_threads(max(1, cores // local ranks))``, with ``cores`` the CPUs this process may run on
    (``os.sched_getaffinity``). Left alone when ``OMP_NUM_THREADS`` is set (the user's or the launcher's choice
    wins). Without it every rank starts as many threads as the node has cores, so ``n`` ranks oversubscribe the
    node ``n`` times over and spin against each other (PyTorch's CPU performance guide: one thread pool per core).

    Returns:
        What was done, for the log.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return f"torch threads per rank: {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local_world_size())
    torch.set_num_threads(threads)
    return f"torch threads per rank: {threads} ({cores} cores / {local_world_size()} ranks on this node)"


def on_cpu() -> bool:
    """True when DeepSpeed's accelerator is the CPU (``DS_ACCELERATOR=cpu``, or no GPU found): the ranks train in
    host memory, over gloo."""
    return get_accelerator().device_name() == "cpu"


_TIMEOUT_WHY = ("DeepSpeed creates its groups with dist.new_group() without a timeout, which takes torch's module default "
                "(30 min for gloo, 10 for NCCL) instead of init_process_group's; no upstream issue filed")


def init(timeout_minutes: float, op_build_dir: str = "") -> None:
    """Start the process group through DeepSpeed (NCCL on GPUs, gloo on the CPU accelerator).

    DeepSpeed may build an op first (the CPU accelerator's shared-memory all-reduce): the build folder is
    ``op_build_dir`` when given, and a build lock that a killed build left there is reported in one line while the
    launch waits for it (:mod:`finetune.parallel.op_builds`).

    Args:
        timeout_minutes: collective timeout (``train.dist_timeout_minutes``), for the default group and
            for every group created later: a rank that hangs makes the others raise after this long. (A
            rank that exits is noticed at once: its sockets close, and the launcher ends the others.)
        op_build_dir: ``train.op_build_dir`` (empty: ``TORCH_EXTENSIONS_DIR`` or torch's default).

    Raises:
        ConfigError: ``op_build_dir`` cannot be created or written.
    """
    op_builds.watch(op_builds.use_build_dir(op_build_dir))
    timeout = timedelta(minutes=timeout_minutes)
    # DeepSpeed creates its own groups (ZeRO's data-parallel group, ...) with dist.new_group(), which takes
    # torch's built-in default timeout (30 min for gloo, 10 min for NCCL), not the one init_process_group got.
    # Make that default ours, so a hung rank stops a launch after train.dist_timeout_minutes.
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(distributed_c10d, name, None), timedelta):
            patches.apply(patches.module_global(distributed_c10d, name, timeout, _TIMEOUT_WHY))
    if get_accelerator().device_name() == "cuda":
        get_accelerator().set_device(local_rank())
    deepspeed.init_distributed(timeout=timeout, auto_mpi_discovery=False)
    if on_cpu():
        _unlink_shm_buffer()


def _unlink_shm_buffer() -> None:
    """Free DeepSpeed's CPU all-reduce buffer when the ranks exit, however they exit.

    Under the ``deepspeed`` launcher (``LOCAL_SIZE`` = world size) every rank of the CPU backend creates a
    ~70 MB ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` and maps every other rank's;
    nothing ever unlinks them, so each launch would leave ``2 x 70 MB x ranks`` of RAM behind in /dev/shm.
    Once every rank has mapped all buffers (``init_distributed`` returned everywhere: the barrier), each
    rank unlinks its own name; the mappings stay valid and the memory is released with the last rank.
    """
    env = os.environ
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
            f"{env.get('MASTER_PORT', '')}_{rank()}")
    barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


def barrier() -> None:
    """All ranks wait here (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def data_group(timeout_minutes: float):
    """A gloo process group of every rank for the data preparation's exchanges, whose timeout is
    ``timeout_minutes`` (``data.tokenize_timeout_minutes``): a long first-time tokenization is not cut short by
    ``train.dist_timeout_minutes``, the timeout of the training collectives. None without a process group or
    with one rank. Every rank must call it (``new_group`` is collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))


def checked_step(group, fn):
    """Run ``fn()`` on this rank, then tell every rank of ``group`` how it ended everywhere.

    The ranks meet after the step (``all_gather_object``), so a rank whose work is long (tokenizing) keeps the
    others waiting on ``group``'s timeout, and a rank that dies ends the wait at once (its connections close).
    When ``fn`` raised on any rank, every rank raises: the failing rank its own exception, the others the
    same :class:`ConfigError` (only rank 0 prints it) or a ``RuntimeError`` naming the failed rank and its log.

    Args:
        group: a group from :func:`data_group`, or None (one process: ``fn`` runs alone).
        fn: the step, without arguments; its result must be picklable.

    Returns:
        Every rank's result (list indexed by rank; ``[fn()]`` without a group).
    """
    if group is None:
        return [fn()]
    error = None
    try:
        outcome = ("ok", fn())
    except ConfigError as e:
        error, outcome = e, ("config", e.problems)
    except Exception as e:  # noqa: BLE001  (told to the others, then raised again below)
        error, outcome = e, ("error", f"{type(e).__name__}: {e}")
    outcomes = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    if error is not None:
        raise error
    for r, (kind, detail) in enumerate(outcomes):
        if kind == "config":
            raise ConfigError(detail)
        if kind == "error":
            raise RuntimeError(f"rank {r} failed while preparing the data ({detail}); see logs/rank{r}.log")
    return [detail for _, detail in outcomes]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks; returns ``t``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shared_memory_gradients(engine) -> bool:
    """Whether :func:`all_reduce_gradients` replaces DeepSpeed's stage-0 gradient all-reduce on this run.

    DeepSpeed's CPU backend maps a shared-memory all-reduce in ``init_distributed`` when every rank is on this
    node (``LOCAL_SIZE`` = the world size): ``deepspeed.comm.inference_all_reduce``, the kernel of its AutoTP
    inference on CPU. It sums a tensor in place through the mapped pages, where DeepSpeed's training path
    flattens every gradient into one buffer, all-reduces it over gloo's sockets and copies it back (the step
    time saved: docs/performance.md, "Token classification").

    It applies where DeepSpeed's own path is its plain average: ZeRO stage 0 in fp32 (no fp16/bf16 optimizer
    wrapper), the default averaging (no ``prescale_gradients``, ``gradient_predivide_factor`` 1, fp32
    communication), one data-parallel group of every rank (no model-parallel unit: no sequence, tensor or
    pipeline parallelism) and no MoE layers.
    """
    return (on_cpu() and dist.is_initialized() and dist.get_world_size() > 1
            and os.environ.get("LOCAL_SIZE") == str(dist.get_world_size())
            and hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")
            and engine.zero_optimization_stage() == 0 and engine.mpu is None
            and not getattr(engine, "pipeline_parallelism", False) and not engine.has_moe_layers
            and not (engine.fp16_enabled() or engine.bfloat16_enabled())
            and engine.gradient_average and engine.postscale_gradients()
            and engine.gradient_predivide_factor() == 1.0 and engine.communication_data_type == torch.float32)


SHM_BLOCK = 1 << 17
"""Elements (float32: 512 KiB) per call of the shared-memory all-reduce. DeepSpeed's kernel sums a buffer under
1 MiB through two 1 MiB slots per rank; a larger one goes through a 64 MiB double buffer in two phases (each rank
reduces a slice, then gathers the others'). In blocks, the sum touches 2 MiB of shared memory per rank instead of
up to 66 MiB (each rank's resident set counts the pages it touches, its peers' too), and takes no longer."""


def all_reduce_gradients(engine) -> None:
    """Average every parameter's gradient over the ranks in place, as DeepSpeed's stage-0 ``allreduce_gradients``
    does (the sum, then x 1/ranks; a trainable parameter without a gradient gets zeros, so that every rank reduces
    the same tensors), in blocks of :data:`SHM_BLOCK` elements through DeepSpeed's shared-memory all-reduce
    (:func:`shared_memory_gradients` says when). A sparse gradient is made dense first (the optimizers take dense
    ones); one that is not float32 goes through the process group's all-reduce, on every rank alike.
    """
    from deepspeed import comm as ds_dist

    scale = 1.0 / dist.get_world_size()
    for p in engine.module.parameters():
        if not p.requires_grad or p.numel() == 0:
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad
        g = g.to_dense() if g.is_sparse else g.contiguous()  # the kernel sums a dense buffer (no copy when it is)
        if g is not p.grad:
            p.grad = g
        if g.dtype == torch.float32:
            for block in g.view(-1).split(SHM_BLOCK):  # contiguous views: summed in place
                ds_dist.inference_all_reduce(block)
        else:
            dist.all_reduce(g)
        g.mul_(scale)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on at least one rank (one all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_sum(t).item() > 0)


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` without a process group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def shutdown() -> None:
    """End this process's process group, if any, through DeepSpeed's ``deepspeed.comm.destroy_process_group``: it
    also drops DeepSpeed's cached groups (``deepspeed.utils.groups``: the clone of the world group, the data-parallel
    and sequence-parallel groups), which ``torch.distributed.destroy_process_group`` alone leaves pointing at the
    destroyed group, so a later process group in the same process (an in-process ``evaluate`` after another) would
    fail in ``deepspeed.initialize`` ("Group ... is not registered"). Best effort: never raises."""
    if not dist.is_initialized():
        return
    try:
        deepspeed.comm.destroy_process_group()
    except Exception:  # noqa: BLE001  (best effort at shutdown; fall back to torch's own)
        if dist.is_initialized():
            dist.destroy_process_group()
