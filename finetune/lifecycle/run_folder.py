"""The run folder: which folder a launch writes to, the lock that keeps two launches out of it, and the
record every launch leaves.

**Which folder.** ``output_dir`` names the run folder exactly (a folder that already holds checkpoints
is refused unless ``--resume``). With ``output_dir`` empty, ``output_root`` is a parent of runs: every
launch gets a new folder ``<output_root>/<YYYYmmdd-HHMMSS>[-job<SLURM_JOB_ID>]`` (rank 0 creates it
and broadcasts its name), so running a shipped config twice never meets the old run; ``--resume``
continues the newest run under the root that holds a complete checkpoint, and a requeued Slurm job
(``SLURM_RESTART_COUNT`` > 0) continues the newest run *of its own job id*, never a newer one started
by someone else. :func:`resolve_output_dir` turns the root into a folder before validation wherever the
folder is already known (resume, requeue); :func:`open_run` does the rest after the process group exists.

**The lock.** Rank 0 holds ``<run>/.lock`` (JSON: host, pid, Slurm job id, start time) for the
launch's life, created with ``O_EXCL`` so two launches cannot both take it, and touched every minute.
A lock whose process is gone (same host: the pid no longer exists; same Slurm job id: a requeued
job's earlier incarnation; another host: not touched for :data:`STALE_AFTER_S`) is stale and replaced.

**The records.** Each launch writes ``launches/<n>/`` (``run_config.yaml``, ``ds_config.json``,
``meta.json``: resolved configs, command line, world size, versions) and nothing else of the past is
rewritten; the run folder's top-level ``run_config.yaml``/``ds_config.json``/``meta.json`` are the
first launch's. A refused launch writes nothing.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import transformers

from finetune.parallel import distributed as dist_utils
from finetune.lifecycle.checkpoint import checkpoints_dir, complete_checkpoints
from finetune.config import config_to_dict, dump_yaml
from finetune.errors import ConfigError

LOCK = ".lock"
LAUNCHES = "launches"
MODEL_META = "model_config"
"""Folder of the run folder with the model config and tokenizer the export is built from (written once)."""
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
"""The files of a multimodal model's processor beside its tokenizer's (transformers' ``ProcessorMixin``): copied as
they are into :data:`MODEL_META` and from there into every export, so that ``AutoProcessor.from_pretrained`` loads the
export (copied, not loaded and saved: Qwen2.5-VL's processor cannot be built without torchvision)."""
STALE_AFTER_S = 300.0
"""A lock of another host that has not been touched for this long (seconds) belongs to a dead launch."""
_TOUCH_EVERY_S = 60.0


def slurm_job_id() -> str | None:
    """``SLURM_JOB_ID`` of this process (the same in a requeued job), or None outside Slurm."""
    return os.environ.get("SLURM_JOB_ID") or None


def restart_counts() -> dict[str, int]:
    """``{SLURM_RESTART_COUNT: n, TORCHELASTIC_RESTART_COUNT: n}`` restricted to the ones above 0."""
    counts = {k: int(os.environ.get(k) or 0) for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")}
    return {k: v for k, v in counts.items() if v > 0}


def runs_under(root: str | Path) -> list[Path]:
    """Run folders directly under ``root`` (a ``launches`` or ``checkpoints`` folder inside), oldest first.

    Names start with the launch time (``YYYYmmdd-HHMMSS``), so the name order is the time order.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and ((p / LAUNCHES).is_dir() or (p / "checkpoints").is_dir())]
    return sorted(found, key=lambda p: p.name)


def _with_checkpoint(runs: list[Path]) -> list[Path]:
    return [r for r in runs if complete_checkpoints(checkpoints_dir(r))]


def resolve_output_dir(cfg, resume: str | None) -> tuple[str | None, str | None]:
    """Turn ``output_root`` into ``cfg.output_dir`` where the folder is already known; decide auto-resume.

    Called on every rank before validation (file-system reads only, the same on every rank). Sets
    ``cfg.output_dir`` when ``output_root`` is used and the launch resumes: ``--resume`` (``latest``)
    takes the newest run under the root with a complete checkpoint, ``--resume <path>`` the run folder of
    that path; a restarted launch (requeued Slurm job, restarted torchrun worker group) without
    ``--resume`` takes its own newest run (Slurm: the newest named ``*-job<SLURM_JOB_ID>``) and resumes it
    when it holds a complete checkpoint. A fresh launch under a root keeps ``cfg.output_dir`` empty:
    :func:`open_run` names the new folder.

    Returns:
        ``(resume, note)``: the ``--resume`` value to use (``"latest"`` when a restart auto-resumes) and a
        line for the console (or None).
    """
    restarts = restart_counts()
    note = None
    if not cfg.output_dir and cfg.output_root:
        root = Path(cfg.output_root)
        if resume == "latest":
            found = _with_checkpoint(runs_under(root))
            if found:  # else output_dir stays empty and validation reports that nothing can be resumed
                cfg.output_dir = str(found[-1])
        elif resume is not None:
            p = Path(resume)
            cfg.output_dir = str(p.parent.parent if p.name.startswith("step") else
                                 p.parent if p.name == "checkpoints" else p)
        elif restarts:
            job = slurm_job_id()
            mine = [r for r in runs_under(root) if job and r.name.endswith(f"-job{job}")] if \
                "SLURM_RESTART_COUNT" in restarts else runs_under(root)
            if mine:
                cfg.output_dir = str(mine[-1])
    if resume is None and restarts and cfg.output_dir and complete_checkpoints(checkpoints_dir(cfg.output_dir)):
        why = ", ".join(f"{k}={v}" for k, v in restarts.items())
        resume = "latest"
        note = f"restarted ({why}): resuming from the latest complete checkpoint in {cfg.output_dir}"
    return resume, note


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------


def _holder_info() -> dict:
    return {"host": platform.node(), "pid": os.getpid(), "slurm_job_id": slurm_job_id(), "since": time.time(),
            "since_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lock(run_dir: str | Path) -> dict | None:
    """The holder recorded in ``run_dir/.lock`` (with ``"age_s"``, seconds since last touched), or None."""
    path = Path(run_dir) / LOCK
    try:
        info = json.loads(path.read_text())
        info["age_s"] = time.time() - path.stat().st_mtime
        return info
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # being written right now: a live holder
        return {"host": "?", "pid": -1, "age_s": 0.0}


def is_stale(info: dict) -> bool:
    """True when the lock's holder is gone (see the module docstring for the rules)."""
    if info.get("host") == platform.node() and info.get("pid", -1) > 0:
        return not _pid_alive(int(info["pid"]))
    job = slurm_job_id()
    if job and info.get("slurm_job_id") == job:
        return True  # an earlier incarnation of this requeued job
    return info.get("age_s", 0.0) > STALE_AFTER_S


def lock_problem(run_dir: str | Path) -> str | None:
    """A one-line problem when a live launch holds ``run_dir``'s lock, else None (checked in validation)."""
    info = read_lock(run_dir)
    if info is None or is_stale(info):
        return None
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return (f"output_dir: '{run_dir}' is in use by another launch (host {info.get('host')}, pid {info.get('pid')}"
            f"{job}, since {info.get('since_utc', '?')} UTC); wait for it to end or choose another output_dir")


class RunLock:
    """Rank 0's exclusive lock on a run folder, kept fresh by a daemon thread until :meth:`release`."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock. Returns None on success, else the one-line problem (a live holder)."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                problem = lock_problem(self.path.parent)
                if problem:
                    return problem
                stale = self.path.with_name(f"{LOCK}.stale.{os.getpid()}")
                try:  # rename first: of two launches replacing the same stale lock only one succeeds
                    os.replace(self.path, stale)
                    stale.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(_holder_info(), f)
            self._thread = threading.Thread(target=self._touch, name="finetune-lock", daemon=True)
            self._thread.start()
            return None
        return f"output_dir: could not take the lock '{self.path}' (another launch keeps replacing it)"

    def _touch(self) -> None:
        while not self._stop.wait(_TOUCH_EVERY_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Stop touching and remove the lock if it is still ours."""
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


# ---------------------------------------------------------------------------------------------
# Opening the run (after the process group exists)
# ---------------------------------------------------------------------------------------------


@dataclass
class OpenRun:
    """What :func:`open_run` settled: the folder, this launch's number and (rank 0) the held lock."""

    run_dir: Path
    launch: int
    lock: RunLock | None


def _new_run_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    job = slurm_job_id()
    base = time.strftime("%Y%m%d-%H%M%S") + (f"-job{job}" if job else "")
    for k in range(1, 1000):
        candidate = root / (base if k == 1 else f"{base}-{k}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise OSError(f"no free run folder name under {root}")


def next_launch(run_dir: Path) -> int:
    """Number of the next launch record (1 for a new run)."""
    d = run_dir / LAUNCHES
    numbers = [int(p.name) for p in d.iterdir() if p.name.isdigit()] if d.is_dir() else []
    return max(numbers, default=0) + 1


def open_run(cfg) -> OpenRun:
    """Choose/create the run folder and take its lock (rank 0), then tell every rank. All ranks call it.

    Sets ``cfg.output_dir`` to the folder (so the launch records name it).

    Raises:
        ConfigError: the folder cannot be created or written, or another live launch holds it.
    """
    result: list = [None, None, 0]  # [run_dir, problem, launch number]
    lock = None
    if dist_utils.is_main():
        try:
            run_dir = Path(cfg.output_dir) if cfg.output_dir else _new_run_dir(Path(cfg.output_root))
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir)
            problem = lock.acquire()
            if problem:
                lock = None
            result = [str(run_dir), problem, next_launch(run_dir)]
        except OSError as e:
            where = cfg.output_dir or cfg.output_root
            key = "output_dir" if cfg.output_dir else "output_root"
            result = [None, f"{key}: cannot create or write the run folder under '{where}' ({e.strerror or e}); "
                            f"choose a writable folder", 0]
    if dist_utils.world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    run_dir, problem, launch = result
    if problem:
        raise ConfigError(problem)
    cfg.output_dir = run_dir
    return OpenRun(run_dir=Path(run_dir), launch=launch, lock=lock)


def write_launch_record(run_dir: Path, launch: int, files: dict[str, str]) -> Path:
    """Write ``files`` (name -> text) into ``launches/<launch>/``; the first launch's also at the top level.

    Top-level copies are written only when absent: the first launch's settings are never rewritten.
    Returns the launch folder.
    """
    folder = run_dir / LAUNCHES / str(launch)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
        top = run_dir / name
        if not top.exists():
            top.write_text(text)
    return folder


def _git_hash() -> str:
    """Commit of the finetune source tree (``-dirty`` with uncommitted changes), or ``unknown``."""
    try:
        root = Path(__file__).resolve().parents[2]  # finetune/lifecycle/run_folder.py -> the source folder
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_launch(run_dir: Path, launch: int, cfg, ds: dict, tokenizer, model_config, launcher: str,
                 precision: dict, world_size: int) -> None:
    """Rank 0: this launch's record (``launches/<n>/``: run config, DeepSpeed config, meta: command, git commit,
    launcher, world size, host, versions) and, for a new run, the model config and tokenizer the export is built
    from (``model_config/``). Nothing an earlier launch wrote is rewritten."""
    meta = {"launch": launch, "command": shlex.join([sys.executable] + sys.argv), "cwd": os.getcwd(),
            "git": _git_hash(), "launcher": launcher, "world_size": world_size, "host": platform.node(),
            "pid": os.getpid(), "slurm_job_id": slurm_job_id(), "precision": precision,
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()}}
    write_launch_record(run_dir, launch, {"run_config.yaml": dump_yaml(config_to_dict(cfg)),
                                          "ds_config.json": json.dumps(ds, indent=2),
                                          "meta.json": json.dumps(meta, indent=2)})
    if not (run_dir / MODEL_META / "config.json").is_file():
        model_config.save_pretrained(run_dir / MODEL_META)
        tokenizer.save_pretrained(run_dir / MODEL_META)
        copy_processor_files(Path(cfg.model.tokenizer_path or cfg.model.path), run_dir / MODEL_META)


def copy_processor_files(source: Path, dest: Path) -> list[str]:
    """Copy the :data:`PROCESSOR_FILES` that ``source`` has into ``dest``; returns their names."""
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
            copied.append(name)
    return copied
