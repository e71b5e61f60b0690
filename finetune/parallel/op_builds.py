"""DeepSpeed's just-in-time op builds, the folder they go to, and the lock a killed build leaves behind.

DeepSpeed builds the ops it was not installed with when a launch first needs them (on the CPU accelerator the
shared-memory all-reduce ``deepspeed_shm_comm``, inside ``deepspeed.init_distributed``; ``cpu_adam`` for optimizer
offload; ``fused_adam`` and others on GPUs) with ``torch.utils.cpp_extension.load``, into ``<root>/<op>/``: ``<root>``
is ``TORCH_EXTENSIONS_DIR`` when set, else ``~/.cache/torch_extensions/py<XY>_<cpu|cu<version>|rocm<version>>``
(torch's ``_get_build_directory``; :func:`extensions_root`). The builder first creates ``<root>/<op>/lock``
(``torch.utils.file_baton.FileBaton``: ``O_CREAT | O_EXCL``; the descriptor stays open for the whole build; the file is
removed at its end), and every other process that needs the op polls for the file to go away, without a timeout and
without a word. A process killed during the build (a Slurm time limit, an out-of-memory kill, Ctrl-C at the wrong
moment) leaves the file behind, and every later launch waits forever in ``init_distributed``, before its run folder
exists. On a cluster whose home directory every job shares, that hangs the jobs of everyone who builds there.

* :func:`watch` (started by :func:`finetune.parallel.distributed.init`, on local rank 0 of each node) looks at the
  root's locks every :data:`POLL_S` seconds; a lock that no process on this host holds open (``/proc/<pid>/fd``:
  the builder keeps its descriptor for the whole build) for :data:`STALE_AFTER_S` seconds in a row is reported once,
  in one line on stderr naming the file and the ``rm`` command. The launch keeps waiting: once the file is removed,
  DeepSpeed's wait ends and the launch builds the op and goes on.
* :func:`stale_locks` is what ``finetune doctor`` reports.
* ``train.op_build_dir`` (:func:`use_build_dir`) gives the builds of a launch a folder of their own
  (``TORCH_EXTENSIONS_DIR``), e.g. one per Slurm job on the node's local disk: a job killed midway then leaves its
  lock where no other job looks, at the cost of one build per job.

A build on another host that shares the folder (a home directory on NFS) is not visible from here; the line says
so, with the lock's age (a build takes minutes; a lock hours old is stale wherever its builder ran).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import get_default_build_root

from finetune.errors import ConfigError

POLL_S = 2.0
"""Seconds between two looks at the build folder's locks."""
STALE_AFTER_S = 10.0
"""A lock that no process on this host holds for this long, seen at every look, is reported. The builder holds its
lock's descriptor from the lock's creation to its removal, so a live build on this host is never without a holder."""
LIKELY_STALE_S = 15 * 60.0
"""``finetune doctor``: an unheld lock older than this is a blocker (no build runs that long); a younger one may belong
to a build on another host and is a warning."""


def extensions_root() -> Path:
    """The folder under which ``torch.utils.cpp_extension.load`` builds each op in a folder of its name: the rule of
    torch's ``_get_build_directory`` (``TORCH_EXTENSIONS_DIR``, else torch's per-user cache with the
    ``py<XY>_<accelerator>`` folder)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env is not None:
        return Path(env)
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def build_dir(setting: str) -> Path:
    """The build root ``train.op_build_dir`` names (``~`` expanded, ``{job}`` replaced by ``SLURM_JOB_ID``, ``local``
    outside Slurm); :func:`extensions_root` when it is empty. Creates nothing."""
    if not setting:
        return extensions_root()
    return Path(setting.replace("{job}", os.environ.get("SLURM_JOB_ID") or "local")).expanduser().absolute()


def use_build_dir(setting: str) -> Path:
    """Apply ``train.op_build_dir``: ``TORCH_EXTENSIONS_DIR`` of this process becomes :func:`build_dir` of
    ``setting``, created if missing. An empty ``setting`` changes nothing. Call before DeepSpeed builds an op (before
    ``init_distributed``).

    Returns:
        The root the op builds of this process use (:func:`extensions_root`).

    Raises:
        ConfigError: the folder cannot be created or written.
    """
    if setting:
        path = build_dir(setting)
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError("not writable")
        except OSError as e:
            raise ConfigError(f"train.op_build_dir: cannot create or write '{path}' ({e}); choose a writable folder, "
                              f"e.g. /tmp/torch_extensions_{{job}}, or leave it empty for torch's default") from e
        os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    return extensions_root()


def locks(root: Path) -> list[Path]:
    """The build locks under ``root`` (``<root>/<op>/lock``), sorted."""
    try:
        return sorted(p for p in root.glob("*/lock") if p.is_file())
    except OSError:
        return []


def holders(lock: Path) -> list[int] | None:
    """The processes on this host with ``lock`` open (from ``/proc/<pid>/fd``; processes of other users cannot be
    read and count as not holding it). None where there is no ``/proc`` to read (not Linux)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    found = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) == target:
                        found.append(int(entry.name))
                        break
                except OSError:
                    continue
    return found


def _age(lock: Path) -> float | None:
    try:
        return max(0.0, time.time() - lock.stat().st_mtime)
    except OSError:
        return None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def stale_message(lock: Path, age: float | None) -> str:
    """The one line that reports an unheld ``lock``."""
    created = f" (created {_duration(age)} ago)" if age is not None else ""
    return (f"DeepSpeed's op build waits for the lock {lock}{created}, which no process on this host holds: a build "
            f"killed midway left it behind, and every launch that needs the op waits until it is gone. Remove it "
            f"(rm {lock}) unless a job on another host builds there now; train.op_build_dir gives each job a build "
            f"folder of its own")


def stale_locks(root: Path) -> list[tuple[Path, float | None]]:
    """The locks under ``root`` that no process on this host holds, with their ages in seconds (one look; a build on
    this host that ends between the two reads is not counted, since its lock is gone by then). Empty where holders
    cannot be seen."""
    out = []
    for lock in locks(root):
        held = holders(lock)
        if held is None or held:
            continue
        if lock.exists():
            out.append((lock, _age(lock)))
    return out


class LockWatch:
    """The thread of :func:`watch`: reports each lock under ``root`` that stays unheld for ``after`` seconds, once,
    through ``report`` (a function of one line)."""

    def __init__(self, root: Path, report, after: float = STALE_AFTER_S, poll: float = POLL_S):
        self.root, self.report, self.after, self.poll = root, report, after, poll
        self.reported: list[Path] = []
        self._unheld_since: dict[Path, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="finetune-op-build-lock", daemon=True)

    def start(self) -> LockWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (it ends with the process otherwise: a daemon)."""
        self._stop.set()
        self._thread.join(timeout=5 * self.poll)

    def check(self, now: float) -> None:
        """One look: note the locks without a holder, report those unheld for ``after`` seconds."""
        unheld = {lock for lock, _ in stale_locks(self.root)}
        self._unheld_since = {lock: self._unheld_since.get(lock, now) for lock in unheld}
        for lock, since in self._unheld_since.items():
            if now - since >= self.after and lock not in self.reported:
                self.reported.append(lock)
                self.report(stale_message(lock, _age(lock)))

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001  (a diagnosis must never take the launch down)
                continue


def _to_stderr(line: str) -> None:
    print(f"finetune: {line}", file=sys.stderr, flush=True)


_watches: dict[Path, LockWatch] = {}


def watch(root: Path | None = None, report=_to_stderr) -> LockWatch | None:
    """Start a :class:`LockWatch` on ``root`` (default :func:`extensions_root`) for the life of this process (one per
    root however often it is called), on local rank 0 only (the ranks of a node share the build folder: one line per
    node). None on other ranks and where ``/proc`` cannot be read."""
    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0 or holders(Path("/nonexistent")) is None:
        return None
    root = root or extensions_root()
    if root not in _watches:
        _watches[root] = LockWatch(root, report).start()
    return _watches[root]
