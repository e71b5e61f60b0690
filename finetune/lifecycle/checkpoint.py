"""Checkpoints: DeepSpeed's ``save_checkpoint``/``load_checkpoint`` plus what exact resume needs.

Layout: ``<output_dir>/checkpoints/step<N>/`` holds DeepSpeed's files (model states, ZeRO optimizer
shards, ``zero_to_fp32.py``), ``rng_state_rank<r>.pt`` per rank (Python, NumPy, torch CPU and
accelerator generators, as in HF Trainer), ``recipe_state_rank<r>.pt`` per rank when the recipe keeps state
between steps (``grpo``'s reused generation batch) and, last, ``COMPLETE``: a JSON marker rank 0 writes after a
barrier that follows every rank's writes. Only folders with the marker count as checkpoints, so a
run killed mid-save leaves nothing a resume would load.

Another world size or ZeRO stage: ZeRO shards are per rank, so a resume on another layout loads a
*universal* copy of the checkpoint (DeepSpeed's ``ds_to_universal``: one file per parameter and optimizer
state, any layout can load it) from the sibling folder ``step<N>.universal/``. Rank 0 converts once
(into a temporary folder renamed into place, with its own ``COMPLETE`` marker) and later resumes reuse
it; DeepSpeed loads it with ``checkpoint.load_universal``. See :func:`resume_layout` for what is allowed.

Deleting: only :func:`prune` (``train.keep_last_checkpoints``) removes checkpoints, on rank 0, after a
newer one is complete.

The loop's position travels as DeepSpeed ``client_state`` (optimizer step, epoch, micro-batches
consumed in the epoch, tokens seen).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from deepspeed.accelerator import get_accelerator

from finetune import patches
from finetune.parallel import distributed as dist_utils
from finetune.config import dump_yaml
from finetune.engine.ds_config import engine_precision, zero_stage
from finetune.errors import ConfigError, RunFailure
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
    state = torch.load(path, weights_only=False)
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
    return torch.load(path, weights_only=True) if path.is_file() else None


def save(engine, output_dir: str | Path, state: TrainState, config: dict | None = None, keep_last: int = 0,
         protect: list | None = None, rank_state=None) -> Path:
    """Save a checkpoint on all ranks; mark it complete after every rank has written.

    Must be called by every rank. ``config`` (the resolved run config as a dict) is written to
    ``<ckpt>/run_config.yaml`` so a resume can tell what changed. Once the new checkpoint is complete,
    rank 0 removes older ones beyond the newest ``keep_last`` (:func:`prune`; 0 keeps all), never those in
    ``protect`` (the checkpoint this launch resumed from, the best one of ``train.keep_best``). Returns the
    checkpoint folder. ``rank_state``: the recipe's state of this rank (its ``rank_state`` hook), saved as
    :data:`RECIPE_STATE` when not None.

    Raises:
        RunFailure: the disk filled up or the folder cannot be written (the message names the folder and
            its free space; the checkpoint stays without its ``COMPLETE`` marker, so nothing loads it).
    """
    ckdir = checkpoints_dir(output_dir)
    tag = f"step{state.step}"
    t0 = time.perf_counter()
    try:
        engine.save_checkpoint(str(ckdir), tag=tag, client_state={"train_state": asdict(state)}, save_latest=True)
        torch.save(_rng_state(), ckdir / tag / f"rng_state_rank{dist_utils.rank()}.pt")
        if rank_state is not None:
            torch.save(rank_state, ckdir / tag / RECIPE_STATE.format(rank=dist_utils.rank()))
        if dist_utils.is_main() and config is not None:
            (ckdir / tag / CONFIG_FILE).write_text(dump_yaml(config))
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "unexpected pos" not in str(e) and "write" not in str(e).lower():
            raise
        free = shutil.disk_usage(ckdir).free if ckdir.exists() else 0
        raise RunFailure(f"checkpoint: writing '{ckdir / tag}' failed ({type(e).__name__}: {e}); "
                          f"{free / 2**30:.2f} GiB free there: free space or move output_dir "
                          f"(the partial checkpoint has no {MARKER} marker and is never loaded)") from e
    dist_utils.barrier()
    if dist_utils.is_main():
        shutil.rmtree(universal_folder(ckdir / tag), ignore_errors=True)  # a copy of an older save of this step
        tmp = ckdir / tag / f".{MARKER}.tmp"
        par = (config or {}).get("parallel", {})
        tmp.write_text(json.dumps({"step": state.step, "world_size": dist_utils.world_size(),
                                   "zero_stage": engine.zero_optimization_stage(),
                                   "sequence_parallel_size": par.get("sequence_parallel_size", 1),
                                   "tensor_parallel_size": par.get("tensor_parallel_size", 1),
                                   "expert_parallel_size": par.get("expert_parallel_size", 1), "time": time.time()}))
        os.replace(tmp, ckdir / tag / MARKER)
        if keep_last > 0:
            try:
                prune(ckdir, keep_last, protect)
            except OSError as e:  # a checkpoint that cannot be removed is no reason to stop training
                logger.warning(f"train.keep_last_checkpoints: could not remove an old checkpoint ({e})")
    dist_utils.barrier()
    logger.info(f"checkpoint saved: {ckdir / tag} ({time.perf_counter() - t0:.1f}s)")
    return ckdir / tag


def marker(ckpt: Path) -> dict:
    """The ``COMPLETE`` marker's contents: ``step``, ``world_size``, ``zero_stage``, ``sequence_parallel_size``,
    ``tensor_parallel_size``, ``expert_parallel_size`` (absent from older checkpoints: 1), ``time``."""
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


def resume_layout(ckpt: Path, world_size: int, ds: dict) -> tuple[list[str], list[str], bool]:
    """Can ``ckpt`` be resumed on this launch's layout (world size, ZeRO stage, offload), and how.

    Read from the ``COMPLETE`` marker and the file names, before any model is built.

    * Same world size and ZeRO stage: loaded as it is.
    * ZeRO-0 fp32 checkpoint (no shards) on ZeRO 0 with any world size: loaded as it is.
    * ZeRO 1/2 checkpoint on ZeRO 1/2, or ZeRO-3 on ZeRO-3, with another world size or stage: through the
      universal copy (:func:`to_universal`); exact (the continuation's losses equal the uninterrupted run's;
      :func:`load` repairs two things DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong).
    * Expert parallelism (AutoEP) on either side: only the same world size, ZeRO stage and expert-parallel size.
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
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt),
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
    path, client = engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if universal is not None:
        # DeepSpeed 0.19.8's ZeRO-3 universal load gives every parameter group the hyper-parameters of group 0,
        # which would put weight decay on the no-decay group (biases, norms; finetune.engine.model.param_groups)
        for g, wd in zip(engine.optimizer.param_groups, decay):
            g["weight_decay"] = wd
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
