"""Checkpoints: DeepSpeed's ``save_checkpoint``/``load_checkpoint`` plus what exact resume needs.

Layout: ``<output_dir>/checkpoints/step<N>/`` holds DeepSpeed's files (model states, ZeRO optimizer
shards, ``zero_to_fp32.py``), ``rng_state_rank<r>.pt`` per rank (Python, NumPy, torch CPU and
accelerator generators, as in HF Trainer), ``recipe_state_rank<r>.pt`` per rank when the recipe keeps state
between steps (``grpo``'s reused generation batch) and, last, ``COMPLETE``: a JSON marker rank 0 writes after a
barrier that follows every rank's writes. Only folders with the marker count as checkpoints, so a
run killed mid-save leaves nothing a resume would load.

Integrity: before the marker, rank 0 writes ``manifest.json``, the size and SHA-256 of every file of the folder,
each file hashed by the rank that wrote it (all ranks in parallel; :func:`writer_rank`), and the marker records
the manifest's own SHA-256. A resume checks the sizes before any model is built (:func:`resolve_resume`, every
rank alike) and the hashes once the process group exists (:func:`verify`, each rank its own files, then agreed);
a damaged checkpoint is named and ``--resume`` falls back to the newest one that verifies
(:func:`finetune.lifecycle.resume.settle`). The idea is the one of package managers and of ``sha256sum -c``: a
file's recorded digest, checked before it is trusted. Checkpoints saved before manifests existed load unverified
(a note says so).

Weights that are not finite are never saved (:func:`save` raises :class:`TrainingDiverged` first), so every
complete checkpoint holds finite weights.

Another world size or ZeRO stage: ZeRO shards are per rank, so a resume on another layout loads a
*universal* copy of the checkpoint (DeepSpeed's ``ds_to_universal``: one file per parameter and optimizer
state, any layout can load it) from the sibling folder ``step<N>.universal/``. Rank 0 converts once
(into a temporary folder renamed into place, with its own ``COMPLETE`` marker) and later resumes reuse
it; DeepSpeed loads it with ``checkpoint.load_universal``. See :func:`resume_layout` for what is allowed.

Deleting: only :func:`prune` (``train.keep_last_checkpoints``) removes checkpoints, on rank 0, after a
newer one is complete. A resume from an older step moves the later checkpoints of the abandoned lineage aside
(:func:`set_aside`, renamed, never deleted), so ``latest`` is always this lineage's newest.

The loop's position travels as DeepSpeed ``client_state`` (optimizer step, epoch, micro-batches
consumed in the epoch, tokens seen).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from deepspeed.accelerator import get_accelerator

from finetune import patches
from finetune.lifecycle import safe_load
from finetune.parallel import distributed as dist_utils
from finetune.config import dump_yaml
from finetune.engine import pipeline
from finetune.engine.ds_config import engine_precision, zero_stage
from finetune.errors import ConfigError, RunFailure, TrainingDiverged
from finetune.logs import logger

MARKER = "COMPLETE"
_TAG = re.compile(r"^step(\d+)$")


@dataclass
class TrainState:
    """Where the loop is: the part of a checkpoint that is ours rather than DeepSpeed's.

    The position in the epoch is kept in global terms (rows of the epoch's global order consumed by all
    ranks together), not per-rank micro-batches, so a resume with another micro batch or accumulation
    split (same global batch) continues at exactly the next row.
    """

    step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Current epoch (0-based)."""
    samples_in_epoch: int = 0
    """Rows of the current epoch consumed, summed over ranks (a multiple of the world size)."""
    tokens_seen: int = 0
    """Non-pad tokens trained on, summed over ranks."""
    bad_steps: int = 0
    """Optimizer steps skipped because the loss or the gradient norm was not finite (whole run)."""
    early_best: float | None = None
    """``train.early_stopping``: the best value of its metric so far (None before the first evaluation)."""
    early_waited: int = 0
    """``train.early_stopping``: evaluations in a row without an improvement."""
    early_stopped: bool = False
    """The run ended because ``train.early_stopping`` ran out of patience."""
    best_value: float | None = None
    """``train.keep_best``: the best value of its metric so far."""
    best_step: int = -1
    """``train.keep_best``: the step of that evaluation (its checkpoint is kept and exported); -1: none yet."""


CONFIG_FILE = "run_config.yaml"
"""Each checkpoint keeps the resolved run config it was trained with (``<ckpt>/run_config.yaml``)."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    """``<output_dir>/checkpoints``."""
    return Path(output_dir) / "checkpoints"


def is_complete(ckpt: Path) -> bool:
    """True when ``ckpt`` has the completion marker."""
    return (ckpt / MARKER).is_file()


def complete_checkpoints(ckdir: Path) -> list[Path]:
    """Complete checkpoint folders under ``ckdir``, oldest step first."""
    if not ckdir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckdir.iterdir() if (m := _TAG.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


MANIFEST = "manifest.json"
"""Each checkpoint's list of its files: ``{"format": 1, "algorithm": "sha256", "files": {name: {"size": bytes,
"sha256": hex}}}`` (names relative to the checkpoint folder), written by rank 0 before the ``COMPLETE`` marker."""
_NOT_LISTED = {MARKER, f".{MARKER}.tmp", MANIFEST, f".{MANIFEST}.tmp"}
_RANK_IN_NAME = re.compile(r"rank_?(\d+)")
_HASH_CHUNK = 8 << 20


def writer_rank(name: str, world: int) -> int:
    """The rank that hashes file ``name`` of a checkpoint on ``world`` ranks: the first ``rank<r>``/``rank_<r>`` in the
    name (``zero_pp_rank_1_mp_rank_00_optim_states.pt``: 1, ``rng_state_rank1.pt``: 1, ``mp_rank_00_model_states.pt``:
    0), modulo ``world``; rank 0 for names without one (``run_config.yaml``, ``zero_to_fp32.py``). At a save these are
    the ranks that wrote them (DeepSpeed's and finetune's per-rank names), so each rank reads back what its own node
    just wrote; at a resume on another world size the same rule spreads the files over the ranks there are."""
    m = _RANK_IN_NAME.search(name)
    return int(m.group(1)) % max(world, 1) if m else 0


def _files(folder: Path) -> list[str]:
    """The checkpoint's files (relative POSIX names, sorted) that a manifest lists: all but the marker and itself."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name not in _NOT_LISTED)


def duration(seconds: float) -> str:
    """``seconds`` for the log: ``3.2 ms`` below one second, else ``1.25 s``."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _hash(folder: Path, names: list[str]) -> dict[str, dict]:
    """``name -> {"size", "sha256"}`` of ``names`` under ``folder``, in a few threads (``hashlib`` releases the GIL on
    large buffers, so the threads of one rank read and hash in parallel)."""
    if not names:
        return {}
    threads = max(1, min(len(names), 8, (os.cpu_count() or 1) // max(dist_utils.local_world_size(), 1)))
    with ThreadPoolExecutor(threads) as pool:
        digests = list(pool.map(lambda n: _sha256(folder / n), names))
    return {n: {"size": (folder / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}


def _write_replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``.<name>.tmp`` beside it and ``os.replace``.

    Raises:
        RunFailure: the write failed (disk full, read-only folder): one line naming the folder and its free space;
            the temporary file is removed, and the checkpoint stays without its ``COMPLETE`` marker.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        raise RunFailure(f"checkpoint: writing '{path}' failed ({type(e).__name__}: {e}); {free / 2**30:.2f} GiB free "
                          f"in '{path.parent}': free space or move output_dir (the checkpoint has no {MARKER} marker "
                          f"and is never loaded)") from e


def write_manifest(ckpt: Path) -> dict:
    """Hash ``ckpt``'s files, each rank those :func:`writer_rank` gives it, and (rank 0) write :data:`MANIFEST`.

    All ranks call it, after every rank's writes (a barrier). Each rank lists the folder itself (it sees the files its
    own node wrote) and sends its digests to rank 0 (one ``all_gather_object``).

    Returns:
        On rank 0, what the ``COMPLETE`` marker records of it: ``{"file", "sha256", "files", "bytes", "seconds"}``
        (``seconds``: the slowest rank's hashing); ``{}`` on the other ranks.

    Raises:
        RunFailure: rank 0 could not write the manifest (disk full): the folder and its free space, in one line.
    """
    t0 = time.perf_counter()
    world, me = dist_utils.world_size(), dist_utils.rank()
    mine = _hash(ckpt, [n for n in _files(ckpt) if writer_rank(n, world) == me])
    parts = dist_utils.all_gather_object((mine, time.perf_counter() - t0))
    if not dist_utils.is_main():
        return {}
    files = {n: e for part, _ in parts for n, e in part.items()}
    text = json.dumps({"format": 1, "algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1)
    _write_replace(ckpt / MANIFEST, text)
    return {"file": MANIFEST, "sha256": hashlib.sha256(text.encode()).hexdigest(), "files": len(files),
            "bytes": sum(e["size"] for e in files.values()), "seconds": round(max(s for _, s in parts), 6)}


def read_manifest(ckpt: Path) -> dict | None:
    """``ckpt``'s manifest (``name -> {"size", "sha256"}``), or None for a checkpoint saved before manifests existed
    (its marker names none).

    Raises:
        ValueError: the marker names a manifest that is missing, unreadable, or not the one it recorded (its SHA-256
            differs); the message says which.
    """
    recorded = marker(ckpt).get("manifest")
    if not recorded:
        return None
    name = str(recorded.get("file", MANIFEST))
    if not _inside(name):
        raise ValueError(f"its {MARKER} marker names the manifest '{name}', which is not a file inside the checkpoint")
    path = ckpt / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path.name} is missing or unreadable ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != recorded.get("sha256"):
        raise ValueError(f"{path.name} is not the manifest its {MARKER} marker records (SHA-256 differs)")
    files = json.loads(data)["files"]
    outside = [n for n in files if not _inside(n)]
    if outside:
        raise ValueError(f"{path.name} names '{outside[0]}', which is not a file inside the checkpoint (a manifest "
                         f"finetune writes lists the folder's own files only)")
    return files


def _inside(name: str) -> bool:
    """True when manifest entry ``name`` is a relative path that stays inside the checkpoint folder."""
    p = Path(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts


def size_problem(ckpt: Path) -> str | None:
    """What is wrong with ``ckpt`` that file sizes show (a truncated, grown or missing file, a damaged manifest), or
    None. Reads the manifest and stats the files: cheap, the same on every rank, before any process group. A
    checkpoint without a manifest has no problem here (:func:`read_manifest`)."""
    try:
        files = read_manifest(ckpt)
    except (ValueError, OSError) as e:
        return str(e)
    for name, entry in (files or {}).items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} is {size:,} bytes, its manifest says {entry['size']:,}"
    return None


@dataclass
class Verification:
    """What :func:`verify` found: the same on every rank."""

    problems: list[str] = field(default_factory=list)
    """One line per file that does not match the manifest (its name, what differs); empty when all match."""
    files: int = 0
    """Files checked (0: the checkpoint has no manifest, nothing was verified)."""
    bytes: int = 0
    """Their total size."""
    seconds: float = 0.0
    """The slowest rank's wall time (each rank hashes its own files in parallel with the others)."""
    manifest: bool = True
    """False for a checkpoint saved before manifests existed (loaded unverified)."""
    code: list[str] = field(default_factory=list)
    """One line per ``.pt`` file whose pickle names code rather than checkpoint data
    (:func:`finetune.lifecycle.safe_load.code_in`), checked with or without a manifest; also in :attr:`problems`."""


def verify(ckpt: Path, alone: bool = False) -> Verification:
    """Check every file of ``ckpt`` against its manifest: each rank hashes the files :func:`writer_rank` gives it
    (all ranks in parallel), then the ranks agree (one ``all_gather_object``). Every ``.pt`` file's pickle is also
    scanned for code (:func:`finetune.lifecycle.safe_load.code_in`), manifest or not: a file someone else wrote and
    hashed passes the manifest. All ranks call it, unless ``alone``: this process checks every file itself and
    makes no collective call (an export on one rank of a launch, ``finetune export``).

    Returns:
        :class:`Verification` (identical on every rank).
    """
    t0 = time.perf_counter()
    try:
        files = read_manifest(ckpt)
    except (ValueError, OSError) as e:
        return Verification([str(e)])
    world, me = (1, 0) if alone else (dist_utils.world_size(), dist_utils.rank())
    problems = []
    for name in sorted(files or {}):
        if writer_rank(name, world) != me:
            continue
        entry, path = files[name], ckpt / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} is {path.stat().st_size:,} bytes, its manifest says {entry['size']:,}")
        elif _sha256(path) != entry["sha256"]:
            problems.append(f"{name} does not match its SHA-256 in the manifest (same size, other bytes)")
    code = [safe_load.refusal(path, names) for path in sorted(ckpt.rglob("*.pt"))
            if writer_rank(str(path.relative_to(ckpt)), world) == me and (names := safe_load.code_in(path))]
    mine = (problems, code, time.perf_counter() - t0)
    parts = [mine] if alone else dist_utils.all_gather_object(mine)
    problems = sorted(p for part, _, _ in parts for p in part)
    code = sorted(c for _, part, _ in parts for c in part)
    if files is None:
        return Verification(code, manifest=False, code=code)
    return Verification(problems + code, len(files), sum(e["size"] for e in files.values()),
                        max(s for _, _, s in parts), code=code)


def falls_back(resume: str | None) -> bool:
    """True when ``--resume resume`` may fall back to an older checkpoint if the newest is damaged: ``latest`` or a
    run (or ``checkpoints``) folder; a checkpoint folder named by path is refused instead."""
    return resume is not None and not _TAG.match(Path(resume).name)


def _newest_sound(found: list[Path]) -> tuple[Path | None, list[str]]:
    """The newest of ``found`` (oldest first) whose sizes match its manifest, and one ``stepN: problem`` per newer
    one that does not."""
    skipped = []
    for ckpt in reversed(found):
        problem = size_problem(ckpt)
        if problem is None:
            return ckpt, skipped
        skipped.append(f"{ckpt.name}: {problem}")
    return None, skipped


def resolve_resume(resume: str, output_dir: str) -> tuple[Path | None, str | None, list[str]]:
    """Find the checkpoint ``--resume`` names, checking its files' sizes against its manifest (:func:`size_problem`).

    Args:
        resume: ``latest`` (newest complete checkpoint in ``output_dir``), a checkpoint folder, a
            ``checkpoints`` folder or a run folder.
        output_dir: the run's output folder.

    Returns:
        ``(checkpoint_folder, None, notes)`` or ``(None, problem, [])``. A damaged checkpoint named by path is a
        problem; otherwise the newest checkpoint whose sizes match is taken and one note names the damaged newer ones.
        A checkpoint without a manifest gets a note that it loads unverified. The hashes are checked once the process
        group exists (:func:`verify`).
    """
    if resume == "latest":
        found = complete_checkpoints(checkpoints_dir(output_dir))
        where = checkpoints_dir(output_dir)
        if not found:
            return None, (f"--resume: no complete checkpoint in '{checkpoints_dir(output_dir)}' (a checkpoint counts "
                          f"once its '{MARKER}' marker exists); drop --resume to start a new run"), []
    else:
        p = Path(resume)
        if not p.exists():
            return None, f"--resume: '{p}' does not exist", []
        if _TAG.match(p.name):
            if not is_complete(p):
                return None, f"--resume: '{p}' is incomplete (no '{MARKER}' marker: its save was interrupted)", []
            problem = size_problem(p)
            if problem:
                return None, (f"--resume: '{p}' is damaged: {problem}; resume another checkpoint (--resume with its "
                              f"run folder takes the newest that verifies)"), []
            return p, None, _unverified(p)
        where, found = p, []
        for candidate in (p / "checkpoints", p):
            found = complete_checkpoints(candidate)
            if found:
                where = candidate
                break
        if not found:
            return None, f"--resume: no complete checkpoint under '{p}'", []
    ckpt, skipped = _newest_sound(found)
    if ckpt is None:
        return None, (f"--resume: no complete checkpoint in '{where}' verifies ({'; '.join(skipped)}); resume "
                      f"another run, or drop --resume to start a new one"), []
    notes = [fallback_note(skipped, ckpt)] if skipped else []
    return ckpt, None, notes + _unverified(ckpt)


def fallback_note(skipped: list[str], ckpt: Path) -> str:
    """The one line that says which damaged checkpoints ``--resume`` passed over, and what it resumes instead."""
    return (f"--resume: damaged checkpoint{'s' if len(skipped) > 1 else ''} passed over ({'; '.join(skipped)}): "
            f"resuming {ckpt}, the newest checkpoint that verifies")


def _unverified(ckpt: Path) -> list[str]:
    if "manifest" in marker(ckpt):
        return []
    return [f"--resume: '{ckpt}' has no {MANIFEST} (saved before checkpoints recorded their files' SHA-256): it loads "
            f"unverified"]


def _rng_state() -> dict:
    acc = get_accelerator()
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if acc.device_name() != "cpu":
        state["accelerator"] = acc.get_rng_state()
    return state


def restore_rng_state(ckpt: Path) -> None:
    """Restore this rank's generators from ``ckpt/rng_state_rank<r>.pt``.

    A rank the checkpoint did not have (resume on more ranks) keeps its freshly seeded generators
    (a warning says so: dropout then draws other masks than an uninterrupted run would).
    """
    path = ckpt / f"rng_state_rank{dist_utils.rank()}.pt"
    if not path.is_file():
        logger.warning(f"{ckpt} has no random-generator state for rank {dist_utils.rank()} (saved on fewer ranks): "
                       f"this rank keeps its seeded generators")
        return
    state = safe_load.load(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


RECIPE_STATE = "recipe_state_rank{rank}.pt"
"""Per-rank file of the recipe's own state (its ``rank_state`` hook; ``grpo``'s reused generation batch)."""


def load_rank_state(ckpt: Path):
    """This rank's recipe state saved in ``ckpt`` (:data:`RECIPE_STATE`), or None when there is none. Read with
    ``torch.load(weights_only=True)``: tensors and plain containers only, nothing that runs code."""
    path = ckpt / RECIPE_STATE.format(rank=dist_utils.rank())
    return safe_load.load(path) if path.is_file() else None


def non_finite_weights(engine) -> list[str]:
    """Names of the parameters that hold a NaN or an infinity on any rank (empty when every weight is finite). All
    ranks call it.

    Each rank sums its own share of every parameter in float32 (``ds_tensor``: a ZeRO-3 partition; else the tensor it
    holds), so no full-size temporary is made and one all-reduce of a count settles it; a NaN or an infinity makes the
    sum non-finite, finite weights never reach float32's overflow. The names are gathered only when something is
    wrong.
    """
    sums, names = [], []
    for name, p in engine.module.named_parameters():
        t = getattr(p, "ds_tensor", None)
        t = p.data if t is None else t
        if t.numel() and t.is_floating_point():
            sums.append(t.sum(dtype=torch.float32).to(engine.device))
            names.append(name)
    flags = ~torch.isfinite(torch.stack(sums)) if sums else torch.zeros(0, dtype=torch.bool, device=engine.device)
    count = dist_utils.all_reduce_sum(flags.sum().to(torch.float64).reshape(1))
    if count.item() == 0:
        return []
    mine = [n for n, bad in zip(names, flags.tolist()) if bad]
    return list(dict.fromkeys(n for part in dist_utils.all_gather_object(mine) for n in part))  # the model's order


def save(engine, output_dir: str | Path, state: TrainState, config: dict | None = None, keep_last: int = 0,
         protect: list | None = None, rank_state=None) -> Path:
    """Save a checkpoint on all ranks; mark it complete after every rank has written and its manifest is written.

    Must be called by every rank. The weights are checked first (:func:`non_finite_weights`): a NaN or an infinity is
    never saved. Over an existing ``step<N>/`` (a leftover of an interrupted save) rank 0 removes its old ``COMPLETE``
    marker and manifest before any rank writes. ``config`` (the resolved run config as a dict) is written to
    ``<ckpt>/run_config.yaml`` so a resume can tell what changed. Then every rank hashes the files it wrote and rank 0
    writes :data:`MANIFEST` (:func:`write_manifest`) and, last, the marker, which records the manifest's SHA-256. Once
    the new checkpoint is complete,
    rank 0 removes older ones beyond the newest ``keep_last`` (:func:`prune`; 0 keeps all), never those in
    ``protect`` (the checkpoint this launch resumed from, the best one of ``train.keep_best``). Returns the
    checkpoint folder. ``rank_state``: the recipe's state of this rank (its ``rank_state`` hook), saved as
    :data:`RECIPE_STATE` when not None.

    Raises:
        TrainingDiverged: a weight is not finite (the message names up to 3 parameters and the last complete
            checkpoint); nothing is written.
        RunFailure: the disk filled up or the folder cannot be written (the message names the folder and
            its free space; the checkpoint stays without its ``COMPLETE`` marker, so nothing loads it).
    """
    ckdir = checkpoints_dir(output_dir)
    tag = f"step{state.step}"
    t0 = time.perf_counter()
    bad = non_finite_weights(engine)
    if bad:
        last = complete_checkpoints(ckdir)
        raise TrainingDiverged(
            f"training diverged: the weights are not finite after step {state.step} (NaN or inf in "
            f"{', '.join(bad[:3])}{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}); nothing was saved or "
            f"exported from this state; last complete checkpoint: {last[-1] if last else 'none'}; lower train.lr "
            f"(train.muon_lr with Muon) or check the optimizer settings and the data")
    if dist_utils.is_main() and (ckdir / tag).is_dir():  # an older save of this step: no longer complete, first
        (ckdir / tag / MARKER).unlink(missing_ok=True)
        (ckdir / tag / MANIFEST).unlink(missing_ok=True)
    dist_utils.barrier()
    try:
        engine.save_checkpoint(str(ckdir), tag=tag, client_state={"train_state": asdict(state)}, save_latest=True)
        torch.save(_rng_state(), ckdir / tag / f"rng_state_rank{dist_utils.rank()}.pt")
        if rank_state is not None:
            torch.save(rank_state, ckdir / tag / RECIPE_STATE.format(rank=dist_utils.rank()))
        if dist_utils.is_main() and config is not None:
            (ckdir / tag / CONFIG_FILE).write_text(dump_yaml(config))
        if dist_utils.is_main() and pipeline.is_pipeline(engine):  # how the layer files join into one model
            pipeline.write_layers_file(engine, ckdir / tag)
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "unexpected pos" not in str(e) and "write" not in str(e).lower():
            raise
        free = shutil.disk_usage(ckdir).free if ckdir.exists() else 0
        raise RunFailure(f"checkpoint: writing '{ckdir / tag}' failed ({type(e).__name__}: {e}); "
                          f"{free / 2**30:.2f} GiB free there: free space or move output_dir "
                          f"(the partial checkpoint has no {MARKER} marker and is never loaded)") from e
    dist_utils.barrier()
    manifest = write_manifest(ckdir / tag)
    if dist_utils.is_main():
        shutil.rmtree(universal_folder(ckdir / tag), ignore_errors=True)  # a copy of an older save of this step
        par = (config or {}).get("parallel", {})
        _write_replace(ckdir / tag / MARKER, json.dumps({
            "step": state.step, "world_size": dist_utils.world_size(), "zero_stage": engine.zero_optimization_stage(),
            "sequence_parallel_size": par.get("sequence_parallel_size", 1),
            "tensor_parallel_size": par.get("tensor_parallel_size", 1),
            "expert_parallel_size": par.get("expert_parallel_size", 1),
            "pipeline_parallel_size": par.get("pipeline_parallel_size", 1), "time": time.time(),
            "manifest": manifest}))
        if keep_last > 0:
            try:
                prune(ckdir, keep_last, protect)
            except OSError as e:  # a checkpoint that cannot be removed is no reason to stop training
                logger.warning(f"train.keep_last_checkpoints: could not remove an old checkpoint ({e})")
        logger.info(f"checkpoint saved: {ckdir / tag} ({time.perf_counter() - t0:.1f}s; {manifest['files']} files, "
                    f"{manifest['bytes'] / 2**20:.1f} MiB, SHA-256 in {duration(manifest['seconds'])})")
    dist_utils.barrier()
    return ckdir / tag


def marker(ckpt: Path) -> dict:
    """The ``COMPLETE`` marker's contents: ``step``, ``world_size``, ``zero_stage``, ``sequence_parallel_size``,
    ``tensor_parallel_size``, ``expert_parallel_size``, ``pipeline_parallel_size`` (absent from older checkpoints: 1),
    ``time`` and ``manifest``
    (:data:`MANIFEST`'s ``file``, ``sha256``, ``files``, ``bytes`` and hashing ``seconds``; absent from checkpoints
    saved before manifests existed)."""
    return json.loads((ckpt / MARKER).read_text())


def saved_layout(ckpt: Path) -> tuple[int, int, int, int]:
    """``(world size, ZeRO stage, sequence-parallel size, tensor-parallel size)`` that ``ckpt`` was saved with."""
    meta = marker(ckpt)
    return (meta.get("world_size"), meta.get("zero_stage"), meta.get("sequence_parallel_size", 1),
            meta.get("tensor_parallel_size", 1))


_UNIVERSAL_WHY = ("DeepSpeed reads universal checkpoints only when the engine was built with load_universal_checkpoint; "
                  "train.keep_best loads one into an engine built for its own layout (no public setter)")


@contextlib.contextmanager
def universal_loading(engine):
    """Within the block ``engine.load_checkpoint`` reads universal checkpoints, as if the engine had been built with
    ``checkpoint.load_universal`` (``train.keep_best``'s best checkpoint of another layout, loaded at the end of a
    launch that resumed on its own layout). The engine's flag is put back on leaving.

    Raises:
        RunFailure: the engine has no such flag (DeepSpeed's ``engine._config.load_universal_checkpoint``, read by
            ``engine.load_universal_checkpoint()``): another DeepSpeed version.
    """
    config = getattr(engine, "_config", None)
    if not isinstance(getattr(config, "load_universal_checkpoint", None), bool):
        raise RunFailure("checkpoint: this DeepSpeed engine has no load_universal_checkpoint setting to load a "
                         "universal checkpoint with; use the DeepSpeed version finetune pins")
    with patches.applied(patches.Patch(config, "load_universal_checkpoint", True, _UNIVERSAL_WHY)):
        yield


UNIVERSAL = ".universal"
"""Suffix of the universal copy of a checkpoint: ``step<N>.universal/`` beside ``step<N>/``."""


def universal_folder(ckpt: Path) -> Path:
    """``<ckpt>.universal``: where the universal copy of ``ckpt`` lives (whether or not it exists yet)."""
    return ckpt.with_name(ckpt.name + UNIVERSAL)


def is_sharded(ckpt: Path) -> bool:
    """True when ``ckpt`` holds per-rank optimizer shards (ZeRO 1-3, DeepSpeed's bf16 optimizer).

    A ZeRO-0 fp32 checkpoint keeps the whole model and optimizer in ``mp_rank_00_model_states.pt``,
    which any world size loads as it is.
    """
    return any(ckpt.glob("*optim_states.pt"))


def resume_layout(ckpt: Path, world_size: int, ds: dict, pp: int = 1) -> tuple[list[str], list[str], bool]:
    """Can ``ckpt`` be resumed on this launch's layout (world size, ZeRO stage, offload), and how.

    Read from the ``COMPLETE`` marker and the file names, before any model is built.

    * Same world size and ZeRO stage: loaded as it is.
    * ZeRO-0 fp32 checkpoint (no shards) on ZeRO 0 with any world size: loaded as it is.
    * ZeRO 1/2 checkpoint on ZeRO 1/2, or ZeRO-3 on ZeRO-3, with another world size or stage: through the
      universal copy (:func:`to_universal`); exact (the continuation's losses equal the uninterrupted run's;
      :func:`load` repairs two things DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong).
    * Expert parallelism (AutoEP) on either side: only the same world size, ZeRO stage and expert-parallel size.
    * Pipeline parallelism (``pp``: this launch's ``parallel.pipeline_parallel_size``) on either side: only the same
      world size, ZeRO stage and number of stages (the weights are one file per pipeline layer, which DeepSpeed's
      ``ds_to_universal`` does not convert).
    * Refused: between ZeRO-3 and ZeRO 0-2 (the universal copy keeps the model-state files of its
      source stage, which the other stages do not read), from ZeRO 0 to ZeRO 1-3 (nothing to convert:
      ``ds_to_universal`` reads ZeRO shards), from shards to ZeRO 0 (DeepSpeed loads universal
      checkpoints into its ZeRO optimizers only), and onto NVMe offload (DeepSpeed copies each rank's
      swapped tensors back as they were saved).

    Returns:
        ``(problems, notes, universal)``: one-line refusals, lines for the log, and True when the launch
        must load the universal copy.
    """
    meta = marker(ckpt)
    stage = zero_stage(ds)
    old_world, old_stage = meta.get("world_size", world_size), meta.get("zero_stage", stage)
    old_ep, ep = meta.get("expert_parallel_size", 1), (ds.get("expert_parallel") or {}).get("autoep_size", 1)
    if max(old_ep, ep) > 1 and (old_world, old_stage, old_ep) != (world_size, stage, ep):
        return [f"--resume: '{ckpt}' was saved with world size {old_world}, ZeRO stage {old_stage} and expert-parallel "
                f"size {old_ep}, this launch has {world_size}, {stage} and {ep}: an AutoEP checkpoint holds each "
                f"expert-parallel rank's experts in its own files, and finetune does not convert them to another "
                f"layout (DeepSpeed's ds_to_universal expert conversion is not checked here); resume with "
                f"{old_world} ranks, ZeRO stage {old_stage} and parallel.expert_parallel_size={old_ep}, or export it "
                f"(the end-of-run export gathers the experts) and start a new run from the export"], [], False
    old_pp = meta.get("pipeline_parallel_size", 1)
    if max(old_pp, pp) > 1 and (old_world, old_stage, old_pp) != (world_size, stage, pp):
        return [f"--resume: '{ckpt}' was saved with world size {old_world}, ZeRO stage {old_stage} and "
                f"{old_pp} pipeline stage(s), this launch has {world_size}, {stage} and {pp}: a pipeline checkpoint "
                f"holds one file per pipeline layer, which DeepSpeed's universal checkpoint does not convert; resume "
                f"with {old_world} ranks, ZeRO stage {old_stage} and parallel.pipeline_parallel_size={old_pp}, or "
                f"export it (finetune export {ckpt} <dir>) and start a new run from the export"], [], False
    if (old_world, old_stage) == (world_size, stage):
        return [], [], False
    change = (f"'{ckpt}' was saved with world size {old_world} and ZeRO stage {old_stage}, this launch has world "
              f"size {world_size} and ZeRO stage {stage}")
    same = f"resume with ds.zero_optimization.stage={old_stage}"
    export = f"or export it (finetune export {ckpt} <dir>) and start a new run from the export"
    zo = ds.get("zero_optimization", {})
    nvme = "nvme" in (zo.get("offload_optimizer", {}).get("device"), zo.get("offload_param", {}).get("device"))
    converting = (f"--resume: {change}: loading its universal copy ({universal_folder(ckpt).name}, converted "
                  f"once)")
    if not is_sharded(ckpt):
        if stage == 0:
            return [], [], False
        why = "a ZeRO-0 checkpoint has no ZeRO shards to convert"
    elif stage == 0:
        why = "DeepSpeed loads a universal checkpoint only into its ZeRO 1-3 optimizers"
    elif (old_stage == 3) != (stage == 3):
        why = "universal checkpoints do not carry over between ZeRO-3 and ZeRO 1/2"
    elif nvme:
        why = "NVMe offload restores each rank's swapped optimizer tensors as they were saved"
        same = f"resume with {old_world} ranks and the same ZeRO stage, or without NVMe offload"
    else:
        return [], [converting], True
    return [f"--resume: {change}: {why}; {same}, {export}"], [], False


def to_universal(ckpt: Path) -> Path:
    """The universal copy of ``ckpt`` (``step<N>.universal/``), converting it once. All ranks call it.

    Rank 0 runs DeepSpeed's converter (``python -m deepspeed.checkpoint.ds_to_universal
    --inject_missing_state``: Hugging Face models carry no universal-checkpoint metadata of their own)
    into a temporary folder beside ``ckpt``, writes its ``COMPLETE`` marker and renames it into place, so
    an interrupted conversion leaves nothing that counts; a copy that is already complete is reused.
    The other ranks wait for rank 0's answer.

    Raises:
        RunFailure: the conversion failed (the converter's last output lines are in the message).
    """
    target = universal_folder(ckpt)
    result: list = [None]
    if dist_utils.is_main():
        if is_complete(target):
            logger.info(f"reusing the universal copy {target} (converted by an earlier resume)")
        else:
            try:
                _convert(ckpt, target)
            except RunFailure as e:
                result = [str(e)]
            except OSError as e:  # answer the other ranks (waiting below) instead of leaving them to time out
                result = [f"--resume: writing the universal copy '{target}' failed ({type(e).__name__}: {e}); "
                          f"free space in or make '{ckpt.parent}' writable"]
    if dist_utils.world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    if result[0]:
        raise RunFailure(result[0])
    return target


def _convert(ckpt: Path, target: Path) -> None:
    if not os.access(ckpt.parent, os.W_OK | os.X_OK):
        raise RunFailure(f"--resume: '{ckpt.parent}' is read-only, so the universal copy that another world size "
                          f"or ZeRO stage needs cannot be written beside '{ckpt.name}'; copy the run folder somewhere "
                          f"writable and resume from there, or resume with the checkpoint's layout ({marker(ckpt)})")
    for old in ckpt.parent.glob(f".{target.name}.tmp*"):  # left by an interrupted conversion (we hold the run lock)
        shutil.rmtree(old, ignore_errors=True)
    tmp = ckpt.parent / f".{target.name}.tmp{os.getpid()}"
    out = tmp / target.name  # the converter writes 'latest_universal' beside its output: keep it inside tmp
    workers = max(1, min(4, (os.cpu_count() or 2) // 2))
    # the converter reads every file with torch.load(weights_only=False): run it under safe_load's weights_only
    cmd = [sys.executable, "-m", "finetune.lifecycle.safe_load", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(ckpt),
           "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", str(workers),
           "--num_merge_workers", str(max(1, workers // 2))]
    t0 = time.perf_counter()
    logger.info(f"converting {ckpt} to a universal checkpoint: {' '.join(cmd)}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = proc.stdout.strip().splitlines()
        # the exception's own line, not the traceback above it
        tail = next((line.strip() for line in reversed(lines) if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", line)),
                    lines[-1].strip() if lines else "no output")
        raise RunFailure(f"--resume: converting '{ckpt}' to a universal checkpoint for the new layout failed "
                          f"(ds_to_universal exit {proc.returncode}: {tail}); resume with the checkpoint's world "
                          f"size and ZeRO stage ({marker(ckpt)})")
    meta = marker(ckpt)
    (out / MARKER).write_text(json.dumps({"source": ckpt.name, "step": meta.get("step"),
                                          "world_size": meta.get("world_size"), "zero_stage": meta.get("zero_stage"),
                                          "time": time.time()}))
    if target.exists():  # without a marker: not a copy anyone loads
        shutil.rmtree(target)
    os.replace(out, target)
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info(f"universal checkpoint {target} written ({time.perf_counter() - t0:.1f}s)")


def prune(ckdir: Path, keep_last: int, protect: list | Path | None = None) -> list[Path]:
    """Remove complete checkpoints older than the newest ``keep_last`` (``train.keep_last_checkpoints``).

    Rank 0 only, right after a new checkpoint got its marker. Never removed: the newest ``keep_last``,
    ``protect`` (a folder or a list of them: the checkpoint this launch resumed from, the best one), the checkpoint the run's export came from
    (``<run>/export/finetune_export.json``) and any folder without a ``COMPLETE`` marker (one being
    written, or a leftover no resume loads). A removed checkpoint's universal copy goes with it; the
    marker is removed first, so an interrupted removal leaves a folder that no longer counts.

    Returns:
        The removed checkpoint folders.
    """
    found = complete_checkpoints(ckdir)
    keep = {p.resolve() for p in found[-keep_last:]}
    for p in [protect] if isinstance(protect, (str, Path)) else protect or []:
        if p is not None:
            keep.add(Path(p).resolve())
    provenance = ckdir.parent / "export" / "finetune_export.json"
    if provenance.is_file():
        try:
            keep.add(Path(json.loads(provenance.read_text())["checkpoint"]).resolve())
        except (ValueError, KeyError, OSError):
            pass
    removed = []
    for ckpt in found:
        if ckpt.resolve() in keep:
            continue
        (ckpt / MARKER).unlink(missing_ok=True)
        shutil.rmtree(universal_folder(ckpt), ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        removed.append(ckpt)
    if removed:
        logger.info(f"train.keep_last_checkpoints={keep_last}: removed {', '.join(p.name for p in removed)}")
    return removed


def set_aside(ckdir: Path, after: int, dest: Path) -> list[str]:
    """Move every ``step<M>/`` folder of ``ckdir`` with ``M > after`` (complete or not) and its universal copy into
    ``dest`` under the same names: the checkpoints of a lineage a resume from step ``after`` abandons, which
    ``latest`` and :func:`prune` must no longer see. Renamed, never deleted (resume one by its path, or move it
    back). Rank 0 only, holding the run lock.

    Returns:
        The moved folders' names, oldest step first.
    """
    later = sorted((int(m.group(1)), p) for p in ckdir.iterdir() if (m := _TAG.match(p.name)) and int(m.group(1)) > after) \
        if ckdir.is_dir() else []
    moved = []
    for _, ckpt in later:
        dest.mkdir(parents=True, exist_ok=True)
        for folder in (ckpt, universal_folder(ckpt)):
            if folder.exists():
                os.replace(folder, dest / folder.name)
                moved.append(folder.name)
    return moved


def saved_config(ckpt: Path) -> dict | None:
    """The run config ``ckpt`` was trained with (its own copy, else the run folder's first launch's)."""
    for p in (ckpt / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
        if p.is_file():
            return yaml.safe_load(p.read_text())
    return None


def load(engine, ckpt: Path, universal: Path | None = None, what: str = "resumed from") -> TrainState:
    """Load model, optimizer, LR-schedule and loop state from ``ckpt`` (all ranks).

    ``universal``: load DeepSpeed's files from this universal copy of ``ckpt`` instead (another layout;
    the engine was built with ``checkpoint.load_universal``). The loop position is global (optimizer
    step, rows of the epoch consumed by all ranks), so it holds on any world size.

    Raises:
        RunFailure: DeepSpeed could not load it.
    """
    src = universal or ckpt
    decay = [g.get("weight_decay") for g in engine.optimizer.param_groups] if universal is not None else []
    with safe_load.weights_only():  # DeepSpeed passes weights_only=False
        path, client = engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    if universal is not None:
        # DeepSpeed 0.19.8's ZeRO-3 universal load gives every parameter group the hyper-parameters of group 0,
        # which would put weight decay on the no-decay group (biases, norms; finetune.engine.model.param_groups)
        for g, wd in zip(engine.optimizer.param_groups, decay):
            g["weight_decay"] = wd
        # ... and group 0's learning rate: under LoRA+ (peft's create_loraplus_optimizer groups, lr x ratio for the
        # B matrices) the first step after the load would train every group at the A matrices' rate. The restored
        # LR schedule holds each group's rate (base_lrs, get_last_lr()).
        schedule = engine.lr_scheduler
        if schedule is not None and hasattr(schedule, "get_last_lr"):
            for g, lr in zip(engine.optimizer.param_groups, schedule.get_last_lr()):
                g["lr"] = lr
            for g, base in zip(engine.optimizer.param_groups, getattr(schedule, "base_lrs", [])):
                g["initial_lr"] = base
        # ... and one step-count tensor to every parameter group's state; torch's Adam increments it in place
        # once per group and step, which would run the bias correction ahead in all groups after the first
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        for st in getattr(inner, "state", {}).values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
    if path is None or "train_state" not in (client or {}):
        raise RunFailure(f"--resume: DeepSpeed could not load '{ckpt}'")
    saved = dict(client["train_state"])
    if "batches_in_epoch" in saved:  # checkpoints before the position was global: per-rank micro-batches
        old = saved_config(ckpt) or {}
        micro = old.get("train", {}).get("micro_batch_size", 0)
        saved["samples_in_epoch"] = saved.pop("batches_in_epoch") * micro * marker(ckpt).get("world_size", 1)
    state = TrainState(**{k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__})
    logger.info(f"{what} {ckpt}: step {state.step}, epoch {state.epoch}, "
                f"{state.samples_in_epoch} rows of the epoch consumed")
    return state


def check_free_space(run_dir: Path, engine) -> None:
    """Refuse to train when the run folder's disk cannot hold one checkpoint (all ranks share the estimate).

    Estimate: parameters x (4 bytes fp32 weights + 8 bytes AdamW moments, + 4 bytes fp32 master weights and
    2 bytes 16-bit weights in bf16/fp16) x 1.1, written by all ranks together; frozen parameters (a LoRA base)
    count with their own size only.

    Raises:
        ConfigError: less free space than the estimate (before any step is trained).
    """
    params = list(engine.module.parameters())
    n = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
    frozen = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params if not p.requires_grad)
    per_param = 12 + (6 if engine_precision(engine) != "fp32" else 0)
    need = int((n * per_param + frozen) * 1.1)  # frozen (LoRA base) weights: saved as they are, no AdamW state
    free = shutil.disk_usage(run_dir).free
    logger.info(f"checkpoint size estimate {need / 2**20:.1f} MiB; {free / 2**30:.1f} GiB free in {run_dir}")
    if free < need:
        raise ConfigError(f"output_dir: '{run_dir}' has {free / 2**20:.1f} MiB free, one checkpoint needs about "
                          f"{need / 2**20:.1f} MiB ({n:,} trainable parameters with AdamW states); free space or "
                          f"move output_dir")
