"""Which rank failed: per-rank heartbeat and exit-status files, and ``faulthandler`` dumps in each rank's log.

When one rank dies, the others only see a collective fail ("Connection closed by peer"), and DeepSpeed's
``launch.py`` names the last rank it started rather than the one that died. So every rank keeps a small
JSON record in the run folder (``<folder>/rank<r>.json``, written atomically: a temporary file, then
``os.replace``; no fsync)::

    {"launch": "<id shared by the ranks of this launch>", "rank": 1, "host": "node07", "pid": 4242,
     "started": 1732270000.1, "time": 1732270060.3, "beat": 12, "state": "running",
     "where": "finetune/training/trainer.py:171 fit > torch/distributed/distributed_c10d.py:2805 all_reduce"}

* A background thread rewrites it every :data:`HEARTBEAT_S` seconds (``time``, ``beat``, and ``where``:
  the main thread's innermost ``finetune`` frame and innermost frame, so a hung rank shows where it hangs).
  Cost: one small file write every few seconds per rank; nothing per step.
* On the way out the rank writes ``state``: ``exited`` with ``exit_code``, or ``failed`` with ``error``
  (and ``peer_failure: true`` when it only failed because a collective broke under it).
* Rank 0's heartbeat thread, when it finds the main thread inside a collective at two beats in a row, reads
  the other records too (and keeps reading them while the wait lasts): a rank found gone (the forms below) is
  logged at once and kept in rank 0's record as ``waiting_for``, before any collective timeout, so a lost node
  is named even when the job is killed while the survivors still wait (Slurm ending a job whose node failed).
  Cost: nothing while the collectives return; while one waits, one read of each record per beat.
* A rank whose collective broke calls :func:`diagnose`, which reads the other ranks' records and names the
  culprit: ``rank R (host H, pid P) failed at T: <error>``, ``... exited with status S at T``, ``... died
  at about T without an exit status`` (same host: its pid is gone, so it was killed by a signal such as
  SIGKILL or the out-of-memory killer) or ``... stopped heartbeating at T`` (another host: its record has
  not changed for :data:`STALE_S` seconds). It waits at most :data:`DIAGNOSE_S` seconds for the evidence.
* Host memory of the rank (Linux ``/proc/self/status``, MiB): ``rss_mib`` (now) and ``peak_rss_mib`` (``VmHWM``:
  the peak since the process started, or since the model was about to be built) in every write;
  :func:`memory_mark` adds ``rss_before_model_mib`` (just before the model is built; the peak is reset there)
  and ``peak_rss_train_mib`` (the peak from then to the end of training, before the export), which
  ``finetune plan``'s figures are checked against (tests/test_train.py). Before the model is built, every rank
  gives start-up's freed heap back (:func:`release_host_memory`), and CPU ranks set glibc's malloc thresholds so a
  step's tensors are not faulted back in at every step (:func:`tune_cpu_allocator`); after training, what the
  training freed goes back the same way, before the export and the report.

``faulthandler`` writes to the rank's own log file: a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE,
SIGILL) leaves the Python stack of every thread there, and ``kill -USR2 <pid>`` dumps them on demand
(a hung rank: its pid is in the ``wiring:`` line and in its record), without stopping the rank.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

HEARTBEAT_S = 5.0
"""Seconds between heartbeat writes."""
STALE_S = 2 * HEARTBEAT_S + 2.0
"""A record unchanged this long (by the reader's clock) belongs to a rank that stopped heartbeating."""
DIAGNOSE_S = STALE_S + 3.0
"""The longest :func:`diagnose` waits for a failed rank's record or its heartbeat to go stale."""
DUMP_SIGNAL = signal.SIGUSR2
"""``kill -USR2 <pid>`` writes every thread's Python stack to the rank's log (``faulthandler.register``)."""

_PEER_GONE = ("closed by peer", "Connection reset", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited", "timed out", "Timed out", "Timeout", "Connection refused")


def is_peer_failure(e: BaseException) -> bool:
    """True when ``e`` looks like a collective that broke because another rank went away or hung."""
    return any(p in str(e) for p in _PEER_GONE)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _short(frame: traceback.FrameSummary) -> str:
    parts = Path(frame.filename).parts
    tail = "/".join(parts[-2:]) if len(parts) >= 2 else frame.filename
    return f"{tail}:{frame.lineno} {frame.name}"


def _where(thread_id: int) -> str:
    """``finetune/training/trainer.py:171 fit > torch/...:2805 all_reduce``: where a thread is (no source lines read)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    stack = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)  # innermost first
    ours = next((f for f in stack if f"{os.sep}finetune{os.sep}" in f.filename), None)
    inner = stack[0] if len(stack) else None
    if ours is None or ours is inner:
        return _short(inner) if inner else ""
    return f"{_short(ours)} > {_short(inner)}"


class RankHealth:
    """This rank's record (heartbeat thread, exit status) and the reading of the other ranks' records.

    Args:
        folder: where every rank of the launch writes ``rank<r>.json`` (shared by all nodes).
        rank: this rank.
        world: world size.
        launch: an id the ranks of this launch share (records of an earlier launch in ``folder`` are ignored).
    """

    def __init__(self, folder: Path, rank: int, world: int, launch: str):
        self.folder = Path(folder)
        self.rank, self.world, self.launch = rank, world, launch
        self.record = {"launch": launch, "rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                       "create_time": _create_time(os.getpid()), "started": time.time(), "time": time.time(),
                       "beat": 0, "state": "running", "where": ""}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None
        self._watch_seen: dict[int, tuple[int, float]] = {}

    def path(self, rank: int) -> Path:
        """``<folder>/rank<r>.json``."""
        return self.folder / f"rank{rank}.json"

    def _write(self) -> None:
        self.record.update(_memory())
        tmp = self.folder / f".rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.path(self.rank))

    def start(self) -> "RankHealth":
        """Write the first record and start the heartbeat thread (daemon)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._write()
        self._thread = threading.Thread(target=self._beat, name="finetune-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        in_collective = 0  # consecutive beats that found the main thread inside torch.distributed
        since = 0.0
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if self._stop.is_set():
                    return
                where = _where(self._main)
                if "distributed_c10d" in where:
                    in_collective, since = in_collective + 1, since if in_collective else time.time()
                else:
                    in_collective = 0
                    self._watch_seen.clear()
                if in_collective >= 2 and self.rank == 0 and self.world > 1:
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        self._watch(where, since)
                self.record.update(time=time.time(), beat=self.record["beat"] + 1, where=where)
                with contextlib.suppress(OSError):  # a full or vanished file system must not kill the rank
                    self._write()

    def _final(self, **fields) -> None:
        self._stop.set()
        with self._lock:
            if self.record["state"] != "running":  # the first outcome stays (failed, then exit code 1)
                if "exit_code" in fields:
                    self.record["exit_code"] = fields["exit_code"]
            else:  # ("where" stays the last heartbeat's: here it would only name this function)
                self.record.update(time=time.time(), **fields)
            with contextlib.suppress(OSError):
                self._write()

    def finish(self, exit_code: int) -> None:
        """Record that this rank is exiting with ``exit_code``; stop the heartbeat."""
        self._final(state="exited", exit_code=exit_code)

    def failed(self, e: BaseException) -> None:
        """Record that this rank failed with ``e`` (``peer_failure`` when a collective broke under it)."""
        self._final(state="failed", error=f"{type(e).__name__}: {e}"[:500], peer_failure=is_peer_failure(e))

    def _read(self, rank: int) -> dict | None:
        try:
            rec = json.loads(self.path(rank).read_text())
        except (OSError, ValueError):
            return None
        return rec if rec.get("launch") == self.launch else None

    def _scan(self, seen: dict[int, tuple[int, float]]) -> tuple[list, list, list, list]:
        """One reading of the other ranks' records: ``(culprits, victims, alive, missing)``.

        ``seen`` (rank -> (beat, when this reader first saw that beat)) carries over between readings: a record
        whose beat has not changed for :data:`STALE_S` seconds of this reader's clock is a rank that stopped
        heartbeating (clocks of other nodes are never compared with this one).
        """
        now, host = time.time(), socket.gethostname()
        culprits, victims, alive, missing = [], [], [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            rec = self._read(r)
            if rec is None:
                missing.append(r)
                continue
            who = f"rank {r} (host {rec['host']}, pid {rec['pid']})"
            if rec["state"] == "failed":
                line = f"{who} failed at {_when(rec['time'])}: {rec.get('error', '?')}"
                (victims if rec.get("peer_failure") else culprits).append(line)
            elif rec["state"] == "exited":
                culprits.append(f"{who} exited with status {rec.get('exit_code')} at {_when(rec['time'])}")
            elif rec["host"] == host and not _alive(rec["pid"], rec.get("create_time")):
                culprits.append(f"{who} died at about {_when(now)} without an exit status (killed by a signal: "
                                f"SIGKILL, the out-of-memory killer, a crash; last heartbeat "
                                f"{_when(rec['time'])}{', in ' + rec['where'] if rec.get('where') else ''})")
            else:
                beat, since = seen.setdefault(r, (rec["beat"], now))
                if rec["beat"] != beat:
                    seen[r] = (rec["beat"], now)
                elif now - since > STALE_S:
                    culprits.append(f"{who} stopped heartbeating at {_when(rec['time'])} (no exit status: "
                                    f"killed, or its node failed)")
                    continue
                alive.append((r, who, rec))
        return culprits, victims, alive, missing

    def _watch(self, where: str, in_collective_since: float) -> None:
        """Rank 0, while its main thread has waited in a collective for two heartbeats: read the other records
        (kept between beats) and, once a rank is found gone, log it and write it into this rank's record
        (``waiting_for``): a lost node is named while the survivors still wait (a collective on a dead peer
        may block until the timeout, and a job killed before that would otherwise leave no name behind)."""
        culprits = self._scan(self._watch_seen)[0]
        line = "; ".join(culprits)
        if culprits and line != self.record.get("waiting_for"):
            self.record["waiting_for"] = line
            from finetune.logs import logger

            logger.warning(f"rank {self.rank} has waited in a collective since {_when(in_collective_since)} "
                           f"({where}): {line}")

    def diagnose(self, wait_s: float = DIAGNOSE_S) -> str:
        """Name the rank(s) whose failure broke this rank's collective, from their records.

        Polls the other ranks' records (and, on this host, their pids) for up to ``wait_s`` seconds, and
        returns as soon as a rank that failed, exited or died on its own is found; ranks that only failed
        because of another rank are named last. Without any, says which ranks still heartbeat and where
        their main threads are (a hang), and asks those on this host for a stack dump in their logs.

        Returns:
            One line for the log, e.g. ``rank 1 (host node07, pid 4242) died at about 10:31:21
            without an exit status (killed by a signal: SIGKILL, the out-of-memory killer, a crash)``.
        """
        t0 = time.time()
        seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, when this rank first saw that beat)
        host = socket.gethostname()
        while True:
            culprits, victims, alive, missing = self._scan(seen)
            if culprits or time.time() - t0 > wait_s:
                break
            time.sleep(0.2)
        if culprits or victims:
            return "; ".join(culprits + victims)
        parts = []
        for r, who, rec in alive:
            dumped = ""
            if rec["host"] == host:
                with contextlib.suppress(OSError):
                    os.kill(rec["pid"], DUMP_SIGNAL)
                    dumped = f"; its stacks: logs/rank{r}.log"
            parts.append(f"{who} still heartbeats, main thread in {rec.get('where') or '?'}{dumped}")
        if missing:
            parts.append(f"no record of rank(s) {', '.join(map(str, missing))} in {self.folder}")
        return "no other rank failed or exited: " + "; ".join(parts) if parts else "no other rank failed or exited"


def _memory() -> dict:
    """``{"rss_mib": ..., "peak_rss_mib": ...}`` of this process from ``/proc/self/status`` (VmRSS, VmHWM);
    empty where that file does not exist (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return {"rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
                "peak_rss_mib": round(int(fields["VmHWM"].split()[0]) / 1024, 1)}
    except (OSError, KeyError, ValueError):
        return {}


def release_host_memory() -> None:
    """Give freed heap back to the OS: ``gc.collect()``, then glibc's ``malloc_trim(0)``.

    Validation, tokenizer loading and (on rank 0) tokenization leave freed but still resident heap behind; the
    trim hands it back before the model is built. ``finetune train`` calls it again after training, when the CPU
    ranks' allocator settings keep the last step's freed activations resident (figures: docs/performance.md). A
    no-op where libc has no ``malloc_trim`` (musl, macOS).
    """
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


CPU_MALLOC_OPTIONS = {"M_MMAP_THRESHOLD": (-3, 32 << 20), "M_TRIM_THRESHOLD": (-1, 128 << 20)}
"""glibc ``mallopt`` settings of :func:`tune_cpu_allocator`: name -> (``malloc.h`` parameter number, bytes)."""


def tune_cpu_allocator() -> str:
    """On CPU ranks, stop glibc from handing tensor memory back to the OS after every step.

    A CPU training step allocates and frees the same activations and gradient buffers every step. glibc's
    defaults (a dynamic ``mmap`` threshold from 128 KiB, a heap trimmed whenever 128 KiB-256 MiB lie free at
    its top) return much of that memory at each free, and the next step faults it back in page by page, thousands
    of minor page faults per step and rank, an order of magnitude more than with :data:`CPU_MALLOC_OPTIONS`
    (docs/performance.md). The same settings as the environment
    variables ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728`` (glibc's ``mallopt(3)``;
    PyTorch's CPU performance guide makes the same point with jemalloc/tcmalloc). Blocks above 32 MiB are still
    ``mmap``-ed and returned; the price is a somewhat higher peak resident set (the heap keeps what it reached).

    Call it once, before the model is built, on CPU ranks only (through :func:`prepare_host_memory`; on GPU ranks
    the tensors live on the device). It is skipped when the environment already tunes glibc's malloc
    (``GLIBC_TUNABLES`` naming ``glibc.malloc``, or any ``MALLOC_*_`` variable): the user's choice wins.

    Returns:
        What was done, for the log: ``"mallopt M_MMAP_THRESHOLD=33554432 M_TRIM_THRESHOLD=134217728"``, or why
        not (``"left to the environment (...)"``, ``"no glibc mallopt"``).
    """
    import ctypes

    mine = [k for k in os.environ if k.startswith("MALLOC_") and k.endswith("_")]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        mine.append("GLIBC_TUNABLES")
    if mine:
        return f"left to the environment ({', '.join(sorted(mine))})"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "no glibc mallopt"
    done = [f"{name}={value}" for name, (param, value) in CPU_MALLOC_OPTIONS.items() if mallopt(param, value) == 1]
    return "mallopt " + " ".join(done)


def prepare_host_memory(on_cpu: bool) -> str | None:
    """Before the model is built: :func:`release_host_memory`, then on CPU ranks :func:`tune_cpu_allocator`.

    Returns:
        The allocator line for the log on CPU ranks (see :func:`tune_cpu_allocator`), None on GPU ranks.
    """
    release_host_memory()
    return tune_cpu_allocator() if on_cpu else None


def memory_mark(when: str) -> None:
    """Record host memory at a point of the run in this rank's record (no-op before :func:`start`).

    ``when="before_model"``: ``rss_before_model_mib`` = RSS now, and the kernel's peak-RSS mark is reset
    (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0); ``when="trained"``: ``peak_rss_train_mib`` = the peak
    RSS since that reset (``VmHWM``), i.e. what building the engine and training added at their highest; on a
    GPU also ``peak_gpu_allocated_mib`` (``torch.cuda.max_memory_allocated`` of the run so far).
    """
    if _current is None:
        return
    with _current._lock:
        mem = _memory()
        if not mem:
            return
        if when == "before_model":
            _current.record["rss_before_model_mib"] = mem["rss_mib"]
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
        elif when == "trained":
            _current.record["peak_rss_train_mib"] = mem["peak_rss_mib"]
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                _current.record["peak_gpu_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        with contextlib.suppress(OSError):
            _current._write()


def _create_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001  (psutil missing or the process gone: the pid check is then plain)
        return None


def _alive(pid: int, create_time: float | None) -> bool:
    """True while ``pid`` is the same running process (not gone, not a zombie, not a reused pid)."""
    try:
        import psutil

        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 1e-3:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except ImportError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    except Exception:  # noqa: BLE001  (NoSuchProcess, AccessDenied on a vanished pid)
        return False


def install_faulthandler(log_file: Path) -> None:
    """Fatal signals and ``kill -USR2 <pid>`` write every thread's Python stack to ``log_file`` (appended)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    f = open(log_file, "a")  # noqa: SIM115  (kept open for the life of the process: faulthandler writes to its fd)
    faulthandler.enable(file=f, all_threads=True)
    if hasattr(faulthandler, "register"):
        faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    _FAULT_FILES.append(f)


_FAULT_FILES: list = []
_current: RankHealth | None = None


def start(folder: Path, log_file: Path | None = None) -> RankHealth:
    """Start this rank's heartbeat in ``folder`` and install ``faulthandler`` into ``log_file``.

    Every rank must call it (rank 0 broadcasts the launch id once the process group exists).
    """
    global _current
    from finetune.parallel import distributed as dist_utils

    if log_file is not None:
        install_faulthandler(log_file)
    launch = [f"{socket.gethostname()}:{os.getpid()}:{time.time()}"]
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(launch, src=0)
    _current = RankHealth(folder, dist_utils.rank(), dist_utils.world_size(), launch[0]).start()
    return _current


def finish(exit_code: int) -> int:
    """Record this rank's exit status (no-op before :func:`start`); returns ``exit_code``."""
    if _current is not None:
        _current.finish(exit_code)
    return exit_code


_exit_code: int | None = None


def exit_process(code: int) -> NoReturn:
    """End this process with ``code``: the interpreter's clean-up runs, its teardown does not.

    ``sys.exit(code)`` as usual: non-daemon threads are joined and every ``atexit`` handler runs (loguru
    closes its log files, ``multiprocessing`` ends DataLoader workers, wandb finishes its files, ...). Then
    the handler this module registers when it is first imported ends the process with ``os._exit(code)``,
    skipping the interpreter's finalisation: the last garbage collection and the teardown of every module
    and C++ static (torch, transformers, DeepSpeed), which costs a CPU launch more than a second at its end.
    ``finetune/run.py`` imports this module before anything else, so that the handler runs after every
    library's. A process that does not call this function (an exception escapes) exits the usual way.

    Raises:
        SystemExit: always (``sys.exit``).
    """
    global _exit_code
    _exit_code = int(code)
    sys.exit(_exit_code)


def _end_without_teardown() -> None:
    """Last ``atexit`` handler: flush Python's standard streams and ``os._exit`` after :func:`exit_process`."""
    if _exit_code is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _finalize_mpi()
    os._exit(_exit_code)


def _finalize_mpi() -> None:
    """``MPI_Finalize`` when mpi4py initialised MPI in this process (the MPI launch's port broadcast,
    ``finetune.parallel.distributed``). mpi4py finalises during the interpreter's teardown, which ``os._exit`` skips, and
    ``mpirun`` counts a rank that initialised MPI without finalising it as failed (exit 1 after a finished run)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    with contextlib.suppress(Exception):
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()


atexit.register(_end_without_teardown)  # registered first (run.py imports this module first): runs last


def failed(e: BaseException) -> None:
    """Record that this rank failed with ``e`` (no-op before :func:`start`)."""
    if _current is not None:
        _current.failed(e)


def diagnose(wait_s: float = DIAGNOSE_S) -> str:
    """:meth:`RankHealth.diagnose` of this rank ("" before :func:`start`)."""
    return _current.diagnose(wait_s) if _current is not None else ""


def failure_hint(e: BaseException) -> str:
    """Extra words for a failed rank's log line when a collective broke because another rank went away: which
    rank, from the ranks' heartbeat/exit-status records (:func:`diagnose`; waits up to ``DIAGNOSE_S``)."""
    if not is_peer_failure(e):
        return ""
    who = diagnose() or "another rank probably died or hung (no rank records yet); see the launcher's output"
    return f" (a collective failed because of another rank: {who})"
