"""Checkpoints: DeepSpeed's ``save_checkpoint``/``load_checkpoint`` plus what exact resume needs.

Layout: ``<output_dir>/checkpoints/step<N>/`` holds DeepSpeed's files (model states, ZeRO optimizer
shards, ``zero_to_fp32.py``), ``rng_state_rank<r>.pt`` per rank (Python, NumPy, torch CPU and
accelerator generators, as in HF Trainer) and, last, ``COMPLETE``: a JSON marker rank 0 writes after a
barrier that follows every rank's writes. Only folders with the marker count as checkpoints, so a
run killed mid-save leaves nothing a resume would load. Nothing here ever deletes a checkpoint.

The loop's position travels as DeepSpeed ``client_state`` (optimizer step, epoch, micro-batches
consumed in the epoch, tokens seen).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from finetune import distributed as dist_utils
from finetune.config import ConfigError
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


def resolve_resume(resume: str, output_dir: str) -> tuple[Path | None, str | None]:
    """Find the checkpoint ``--resume`` names.

    Args:
        resume: ``latest`` (newest complete checkpoint in ``output_dir``), a checkpoint folder, a
            ``checkpoints`` folder or a run folder.
        output_dir: the run's output folder.

    Returns:
        ``(checkpoint_folder, None)`` or ``(None, problem)`` where nothing complete exists.
    """
    if resume == "latest":
        found = complete_checkpoints(checkpoints_dir(output_dir))
        if not found:
            return None, (f"--resume: no complete checkpoint in '{checkpoints_dir(output_dir)}' (a checkpoint counts "
                          f"once its '{MARKER}' marker exists); drop --resume to start a new run")
        return found[-1], None
    p = Path(resume)
    if not p.exists():
        return None, f"--resume: '{p}' does not exist"
    if _TAG.match(p.name):
        if not is_complete(p):
            return None, f"--resume: '{p}' is incomplete (no '{MARKER}' marker: its save was interrupted)"
        return p, None
    for candidate in (p / "checkpoints", p):
        found = complete_checkpoints(candidate)
        if found:
            return found[-1], None
    return None, f"--resume: no complete checkpoint under '{p}'"


def _rng_state() -> dict:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if acc.device_name() != "cpu":
        state["accelerator"] = acc.get_rng_state()
    return state


def restore_rng_state(ckpt: Path) -> None:
    """Restore this rank's generators from ``ckpt/rng_state_rank<r>.pt``."""
    from deepspeed.accelerator import get_accelerator

    state = torch.load(ckpt / f"rng_state_rank{dist_utils.rank()}.pt", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


def save(engine, output_dir: str | Path, state: TrainState, config: dict | None = None) -> Path:
    """Save a checkpoint on all ranks; mark it complete after every rank has written.

    Must be called by every rank. ``config`` (the resolved run config as a dict) is written to
    ``<ckpt>/run_config.yaml`` so a resume can tell what changed. Returns the checkpoint folder.

    Raises:
        ConfigError: the disk filled up or the folder cannot be written (the message names the folder and
            its free space; the checkpoint stays without its ``COMPLETE`` marker, so nothing loads it).
    """
    from finetune.config import dump_yaml

    ckdir = checkpoints_dir(output_dir)
    tag = f"step{state.step}"
    t0 = time.perf_counter()
    try:
        engine.save_checkpoint(str(ckdir), tag=tag, client_state={"train_state": asdict(state)}, save_latest=True)
        torch.save(_rng_state(), ckdir / tag / f"rng_state_rank{dist_utils.rank()}.pt")
        if dist_utils.is_main() and config is not None:
            (ckdir / tag / CONFIG_FILE).write_text(dump_yaml(config))
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "unexpected pos" not in str(e) and "write" not in str(e).lower():
            raise
        free = shutil.disk_usage(ckdir).free if ckdir.exists() else 0
        raise ConfigError(f"checkpoint: writing '{ckdir / tag}' failed ({type(e).__name__}: {e}); "
                          f"{free / 2**30:.2f} GiB free there: free space or move output_dir "
                          f"(the partial checkpoint has no {MARKER} marker and is never loaded)") from e
    dist_utils.barrier()
    if dist_utils.is_main():
        tmp = ckdir / tag / f".{MARKER}.tmp"
        tmp.write_text(json.dumps({"step": state.step, "world_size": dist_utils.world_size(),
                                   "zero_stage": engine.zero_optimization_stage(), "time": time.time()}))
        os.replace(tmp, ckdir / tag / MARKER)
    dist_utils.barrier()
    logger.info(f"checkpoint saved: {ckdir / tag} ({time.perf_counter() - t0:.1f}s)")
    return ckdir / tag


def marker(ckpt: Path) -> dict:
    """The ``COMPLETE`` marker's contents: ``step``, ``world_size``, ``zero_stage``, ``time``."""
    return json.loads((ckpt / MARKER).read_text())


def check_compatible(ckpt: Path, world_size: int, zero_stage: int) -> list[str]:
    """Problems resuming ``ckpt`` on this layout: another world size or ZeRO stage (shards are per layout).

    Read from the ``COMPLETE`` marker, before any model is built.
    """
    meta = marker(ckpt)
    problems = []
    if meta.get("world_size") not in (None, world_size):
        problems.append(f"--resume: '{ckpt}' was saved with world size {meta['world_size']}, this launch has "
                        f"{world_size} (ZeRO shards are per rank); resume with {meta['world_size']} ranks, or "
                        f"export it (finetune export {ckpt} <dir>) and start a new run from the export")
    if meta.get("zero_stage") not in (None, zero_stage):
        problems.append(f"--resume: '{ckpt}' was saved with ZeRO stage {meta['zero_stage']}, this launch uses "
                        f"stage {zero_stage}; resume with ds.zero_optimization.stage={meta['zero_stage']} (or its "
                        f"DeepSpeed JSON), or export it (finetune export {ckpt} <dir>) and start a new run "
                        f"from the export with the new stage")
    return problems


def saved_config(ckpt: Path) -> dict | None:
    """The run config ``ckpt`` was trained with (its own copy, else the run folder's first launch's)."""
    import yaml

    for p in (ckpt / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
        if p.is_file():
            return yaml.safe_load(p.read_text())
    return None


def load(engine, ckpt: Path) -> TrainState:
    """Load model, optimizer, LR-schedule and loop state from ``ckpt`` (all ranks).

    Raises:
        ConfigError: DeepSpeed could not load it.
    """
    path, client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None or "train_state" not in (client or {}):
        raise ConfigError(f"--resume: DeepSpeed could not load '{ckpt}'")
    saved = dict(client["train_state"])
    if "batches_in_epoch" in saved:  # checkpoints before the position was global: per-rank micro-batches
        old = saved_config(ckpt) or {}
        micro = old.get("train", {}).get("micro_batch_size", 0)
        saved["samples_in_epoch"] = saved.pop("batches_in_epoch") * micro * marker(ckpt).get("world_size", 1)
    state = TrainState(**{k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__})
    logger.info(f"resumed from {ckpt}: step {state.step}, epoch {state.epoch}, "
                f"{state.samples_in_epoch} rows of the epoch consumed")
    return state
