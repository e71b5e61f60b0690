"""Parquet rows -> tokenized cache entries, on every core of every node.

* :class:`ParquetRows` reads the rows of a list of parquet files lazily, one row group at a time (only the
  columns a recipe reads): nothing of the corpus is converted or copied before tokenization.
* A split's rows are cut into shards whose bounds are multiples of :data:`MAP_BATCH` rows
  (:func:`shard_bounds`), and each shard is tokenized batch by batch (the recipe's batched map function,
  :data:`MAP_BATCH` rows a call, as ``datasets.Dataset.map(batched=True)``) into an Arrow file written by
  ``datasets``' ``ArrowWriter``. A recipe that packs or drops rows does so per batch, so the tokenized rows do
  not depend on the number of shards, processes or nodes: ``data.num_proc=2`` writes the rows of
  ``data.num_proc=1``.
* Shards run in a pool of forked processes (``data.num_proc``, :func:`default_num_proc`), and on a multi-node
  run whose cache folder is shared by the nodes (:func:`shared_between_leaders` finds out), each node's local
  rank 0 tokenizes every N-th shard. With a node-local cache folder each node tokenizes everything, in
  parallel with the others.
* An entry is a folder ``<recipe>-<split>-<key>/`` of ``shard-NNNNN.arrow`` files and ``info.json`` (rows in
  and out, what the recipe counted, time, processes). It is assembled in a private ``.partial-*`` folder and
  renamed into place when every shard is there, so a killed tokenization never leaves an entry a later run
  could read; :func:`clean_dead_partials` removes what dead runs left.

What grows with the corpus while tokenizing: the tokenized shards on disk, and in memory one row group of the
input per process plus the row index of the split (8 bytes a row); a row group is the unit parquet writers
choose (often 10^4-10^6 rows), so very large row groups cost memory here.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
from datasets.arrow_writer import ArrowWriter, SchemaInferenceError

from finetune.parallel import distributed as dist_utils
from finetune.logs import logger

MAP_BATCH = 1000
"""Rows per call of a recipe's map function (``datasets.Dataset.map``'s default ``batch_size``)."""

PARTIAL_PREFIX = ".partial-"
"""Tokenization in progress writes ``<cache>/tokenized/.partial-<random>/`` (with ``owner.json``), never the entry."""


SOURCE_DIR = "__source_dir__"
"""A key of every batch :meth:`ParquetRows.take` returns besides the columns: each row's parquet file's folder
(a file path in a row is relative to it: :mod:`finetune.data.images`)."""

SOURCE_ROW = "__source_row__"
"""Another such key: where each row is, ``'<parquet file>' row <n>`` (``n`` counted from 0 within its file), for a
map function's errors about one row (:mod:`finetune.data.images`)."""


class ParquetRows:
    """The rows of ``files`` (in order), columns ``columns`` only, read lazily by row group.

    Args:
        files: parquet paths; their row groups are concatenated in order.
        columns: the columns to read (each file must have them; checked before, by the data checks).

    ``len()`` is the total row count (from the footers). :meth:`take` reads the row groups that hold the
    asked rows and keeps the last one read, so reading ascending rows batch by batch reads each row group once. Its
    batches hold :data:`SOURCE_DIR` and :data:`SOURCE_ROW` too.
    """

    def __init__(self, files: list[str], columns: list[str]):
        self.files, self.columns = list(files), list(columns)
        groups, starts, total, self.file_starts = [], [], 0, []
        for f in self.files:
            meta = pq.ParquetFile(f).metadata
            first = total
            for g in range(meta.num_row_groups):
                groups.append((f, g))
                starts.append(total)
                self.file_starts.append(first)
                total += meta.row_group(g).num_rows
        self.groups, self.starts, self.total = groups, np.asarray(starts + [total], dtype=np.int64), total
        self._cached: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return self.total

    def _group(self, g: int) -> dict:
        if self._cached is None or self._cached[0] != g:
            f, index = self.groups[g]
            table = pq.ParquetFile(f).read_row_group(index, columns=self.columns)
            self._cached = (g, {c: table.column(c).to_pylist() for c in self.columns})
        return self._cached[1]

    def take(self, rows: np.ndarray) -> dict[str, list]:
        """The rows ``rows`` (ascending int indices into all files' rows) as ``{column: [values]}``."""
        out: dict[str, list] = {c: [] for c in self.columns}
        out[SOURCE_DIR], out[SOURCE_ROW] = [], []
        rows = np.asarray(rows, dtype=np.int64)
        where = np.searchsorted(self.starts, rows, side="right") - 1
        for g in np.unique(where):
            values = self._group(int(g))
            local = (rows[where == g] - self.starts[g]).tolist()
            for c in self.columns:
                column = values[c]
                out[c] += [column[i] for i in local]
            f = self.groups[int(g)][0]
            out[SOURCE_DIR] += [str(Path(f).parent)] * len(local)
            out[SOURCE_ROW] += [f"'{f}' row {int(r) - self.file_starts[int(g)]}" for r in rows[where == g]]
        return out


def shard_bounds(n_rows: int, shards: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of at most ``shards`` non-empty shards covering ``n_rows`` rows, each bound a
    multiple of :data:`MAP_BATCH` (but the last), as even in batches as possible."""
    batches = -(-n_rows // MAP_BATCH)
    shards = max(1, min(shards, batches))
    cuts = [round(i * batches / shards) * MAP_BATCH for i in range(shards + 1)]
    return [(a, min(b, n_rows)) for a, b in zip(cuts, cuts[1:]) if a < min(b, n_rows)]


def default_num_proc() -> int:
    """Processes a node's tokenizing rank uses when ``data.num_proc`` is 0: the CPUs it may run on
    (``os.sched_getaffinity``, which honours Slurm's and taskset's limits), at most 32. The node's other ranks
    wait meanwhile, so their cores are free."""
    return max(1, min(32, len(os.sched_getaffinity(0))))


@dataclass
class ShardJob:
    """One split to tokenize: ``rows`` (indices into ``source``) through ``fn`` into ``folder`` shard by shard.

    ``fn`` is the batched map function (``{column: [values]}`` -> ``{column: [values]}``); when it has a
    ``counts`` attribute (a ``Counter``: the recipes that count what they drop) it is reset per shard with
    ``reset()`` and the shards' counts are summed.
    """

    source: ParquetRows
    rows: np.ndarray
    fn: object
    bounds: list[tuple[int, int]] = field(default_factory=list)


def _run_shard(job: ShardJob, i: int, folder: Path) -> dict:
    """Tokenize shard ``i`` of ``job`` into ``folder/shard-<i>.arrow`` (renamed into place when complete);
    returns its counts (``rows_in``, ``rows_out`` and the map function's own)."""
    start, end = job.bounds[i]
    fn = job.fn
    if hasattr(fn, "reset"):
        fn.reset()
    tmp = folder / f".shard-{i:05d}.{os.getpid()}.tmp"
    writer = ArrowWriter(path=str(tmp))
    for a in range(start, end, MAP_BATCH):
        writer.write_batch(fn(job.source.take(job.rows[a:min(a + MAP_BATCH, end)])))
    try:
        written, _ = writer.finalize()
        os.replace(tmp, folder / f"shard-{i:05d}.arrow")
    except SchemaInferenceError:  # no row written, so no schema: the shard is empty (not a file)
        written = 0
        tmp.unlink(missing_ok=True)
    counts = Counter(getattr(fn, "counts", {}))
    counts.update({"rows_in": end - start, "rows_out": written, "dropped": getattr(fn, "dropped", 0)})
    if hasattr(fn, "dropped"):
        fn.dropped = 0
    return dict(counts)


_POOL_STATE: tuple[ShardJob, Path] | None = None
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}


def _pool_start() -> None:
    """In each forked process: one tokenizer thread (and no warning about it), die with the parent (a killed
    rank leaves no process writing into its partial folder), and the default signal handlers: the rank's
    preemption handler (:class:`finetune.lifecycle.preemption.StopSignal`) is the rank's, not the worker's (the pool
    ends its workers with ``SIGTERM``; a Ctrl-C reaches the whole process group, and the rank decides)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by run_shards around the fork
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: the process ends when it asks the pool for work
        pass


def _pool_shard(i: int) -> dict:
    job, folder = _POOL_STATE
    return _run_shard(job, i, folder)


def run_shards(job: ShardJob, shards: list[int], folder: Path, num_proc: int) -> dict:
    """Tokenize ``shards`` (indices into ``job.bounds``) into ``folder`` with ``num_proc`` forked processes
    (in this process when 1); returns the summed counts."""
    global _POOL_STATE
    total: Counter = Counter()
    if num_proc <= 1 or len(shards) <= 1:
        for i in shards:
            total.update(_run_shard(job, i, folder))
        return dict(total)
    _POOL_STATE = (job, folder)
    try:
        with fork_pool(min(num_proc, len(shards))) as pool:
            for counts in pool.imap_unordered(_pool_shard, shards):
                total.update(counts)
    finally:
        _POOL_STATE = None
    return dict(total)


def fork_pool(processes: int):
    """A ``fork`` pool of ``processes`` workers started by :func:`_pool_start`. The stop signals are blocked while
    the workers are forked, so a worker that gets one before its initializer has reset the rank's handlers keeps it
    pending and then ends by the default action (no ``StopRequested`` traceback from a worker); the rank gets any
    that arrived meanwhile once they are unblocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        return multiprocessing.get_context("fork").Pool(processes, _pool_start)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def new_partial(parent: Path, entry: str) -> Path:
    """A private ``.partial-*`` folder in ``parent`` marked with this host, PID namespace and pid."""
    parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=parent))
    (partial / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                    "pid_namespace": _pid_namespace(), "entry": entry}))
    return partial


def finish_entry(partial: Path, entry: Path, info: dict) -> None:
    """Write ``info.json`` into ``partial`` and rename it to ``entry`` (an entry that appeared meanwhile, from
    another run, is kept and ``partial`` removed)."""
    (partial / "owner.json").unlink(missing_ok=True)
    (partial / "info.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    try:
        os.replace(partial, entry)
    except OSError:
        if not (entry / "info.json").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def load_entry(entry: Path) -> tuple[datasets.Dataset, dict]:
    """The tokenized rows of a complete entry (its shards memory-mapped and concatenated in order) and its
    ``info.json``. An entry whose every shard was empty gives a dataset of 0 rows."""
    info = json.loads((entry / "info.json").read_text())
    shards = [datasets.Dataset.from_file(str(p)) for p in sorted(entry.glob("shard-*.arrow"))]
    if not shards:
        return datasets.Dataset.from_dict({"input_ids": []}), info
    return (shards[0] if len(shards) == 1 else datasets.concatenate_datasets(shards)), info


def is_entry(path: Path) -> bool:
    """True when ``path`` is a complete entry (renamed into place with its ``info.json``)."""
    return (path / "info.json").is_file()


def tokenize_here(job: ShardJob, entry: Path, num_proc: int) -> dict:
    """Tokenize every shard of ``job`` in this process's pool and place ``entry``; returns its info."""
    start = time.monotonic()
    partial = new_partial(entry.parent, entry.name)
    try:
        counts = run_shards(job, list(range(len(job.bounds))), partial, num_proc)
        info = {"counts": counts, "seconds": round(time.monotonic() - start, 3), "num_proc": num_proc,
                "nodes": 1, "shards": len(job.bounds)}
        finish_entry(partial, entry, info)
        return info
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def shared_between_leaders(group, folder: Path, leaders: list[int]) -> bool:
    """True when every node's local rank 0 (``leaders``, global ranks) sees the same ``folder``: global rank 0
    writes a probe file there and the others look for it (a shared file system, or node-local folders).

    Every rank of ``group`` must call it."""
    me = dist_utils.rank()
    probe = folder / f".probe-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    name = dist_utils.checked_step(group, lambda: probe.touch() or probe.name if me == 0 else None)[0]
    seen = dist_utils.checked_step(group, lambda: (folder / name).exists() if me in leaders else True)
    dist_utils.checked_step(group, lambda: probe.unlink(missing_ok=True) if me == 0 else None)
    return all(seen)


def tokenize_across_nodes(group, job: ShardJob, entry: Path, leaders: list[int], num_proc: int) -> dict:
    """Tokenize ``job`` into ``entry`` in a cache folder that every node shares: global rank 0 makes the partial
    folder, node ``n``'s local rank 0 (``leaders[n]``) tokenizes shards ``n, n + N, ...`` (``N`` nodes, each with
    ``num_proc`` processes) into it, and rank 0 renames it to ``entry`` once every node is done. Every rank of
    ``group`` must call it; returns the entry's info."""
    start = time.monotonic()
    me, nodes = dist_utils.rank(), len(leaders)
    job.bounds = shard_bounds(len(job.rows), num_proc * nodes)
    partial = Path(dist_utils.checked_step(
        group, lambda: str(new_partial(entry.parent, entry.name)) if me == 0 else None)[0])

    def work():
        if me not in leaders:
            return {}
        node = leaders.index(me)
        return run_shards(job, [i for i in range(len(job.bounds)) if i % nodes == node], partial, num_proc)

    try:
        counts = sum((Counter(c) for c in dist_utils.checked_step(group, work)), Counter())
        info = {"counts": dict(counts), "seconds": round(time.monotonic() - start, 3), "num_proc": num_proc,
                "nodes": nodes, "shards": len(job.bounds)}
        dist_utils.checked_step(group, lambda: finish_entry(partial, entry, info) if me == 0 else None)
    finally:
        if me == 0:
            shutil.rmtree(partial, ignore_errors=True)
    return info


def _pid_namespace() -> int | None:
    """Inode of this process's PID namespace (containers on one host may share a host name, not pids)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_dead_partials(folder: Path, stale_hours: float = 168.0) -> list[Path]:
    """Remove partial tokenizations of dead processes from ``folder`` (``<cache>/tokenized``).

    A ``.partial-*`` folder is removed when its ``owner.json`` names this host (and PID namespace) and a pid
    that no longer runs, or when it is older than ``stale_hours`` (a live run on another host cannot be told
    from a dead one, so those stay until then). Every node's local rank 0 calls it before tokenizing.
    Returns the removed folders.
    """
    removed = []
    now = time.time()
    for p in sorted(folder.glob(PARTIAL_PREFIX + "*")) if folder.is_dir() else []:
        try:
            owner = json.loads((p / "owner.json").read_text())
            dead = (owner["host"] == socket.gethostname() and owner.get("pid_namespace") == _pid_namespace()
                    and not _pid_alive(int(owner["pid"])))
        except (OSError, ValueError, KeyError, TypeError):
            dead = False
        try:
            stale = now - p.stat().st_mtime > stale_hours * 3600
        except OSError:
            continue
        if dead or stale:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            logger.info(f"removed the partial tokenization of a dead run: {p}")
    return removed
