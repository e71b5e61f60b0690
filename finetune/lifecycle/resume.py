"""What ``--resume`` may change, and applying the changes that are allowed.

A checkpoint keeps the resolved run config it was trained with (``<ckpt>/run_config.yaml``). On
``--resume`` the launch's config is compared with it key by key and every difference is printed:

* **Refused always**: a change of ``model.lora`` on/off, ``model.lora.r`` or ``model.lora.target_modules``, or of
  ``model.quantization`` on/off, its ``bits``, ``quant_type`` or ``double_quant``, which gives the model parameters
  the checkpoint does not hold (it could never be loaded).
* **Refused** (the continuation would be a different run), one line per key, unless
  ``--resume-allow-changes`` is given: ``recipe``, every ``model.*`` key but ``gradient_checkpointing`` and
  ``fused_kernels``,
  the ``data.*`` keys that decide which rows and tokens exist (files, columns, ``max_seq_len``, ``packing``,
  masking, row caps, the held-out fraction), ``train.seed``, ``train.loss_weighting`` and the global batch size
  (micro batch x accumulation x world size).
* **Applied** from the resumed step on: the learning rate and its schedule (``lr``, ``lr_scheduler``,
  ``warmup_steps``, and ``max_steps``/``epochs``, which set the schedule's length: the scheduler is
  rebuilt for the new values at the current step), the AdamW hyper-parameters (written into the restored
  optimizer's parameter groups, which would otherwise keep the checkpoint's), clipping, and the eval,
  save and log cadence (read from the config by the loop).
* A different micro batch / accumulation split of the same global batch is allowed: the loop position is
  kept in rows of the epoch's global order (``TrainState.samples_in_epoch``), so no row is repeated or
  skipped.
* A different world size (a requeued Slurm job on fewer nodes) is allowed: when the launch runs the micro
  batch and accumulation of the checkpoint or of the run's first launch, :func:`keep_global_batch` sets
  the accumulation that keeps the global batch (refused when none does: the global batch would change);
  the checkpoint is loaded through its universal copy (:func:`finetune.lifecycle.checkpoint.resume_layout` says
  which ZeRO stages can).

Before anything is loaded, :func:`settle` checks the checkpoint's files against its manifest (each rank its own
files; a damaged one is refused when named by path, else the newest checkpoint that verifies is resumed) and sets
aside, renamed and never deleted, what the resumed steps would otherwise meet twice: the later checkpoints of an
abandoned lineage and the completion rows written after the resumed step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from transformers import get_scheduler

from finetune.lifecycle import checkpoint as ckpt_utils
from finetune.lifecycle.checkpoint import TrainState
from finetune.config import RunConfig, config_to_dict
from finetune.engine.model import optimizer_groups
from finetune.errors import ConfigError
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils

_REFUSED_EXACT = {"recipe", "train.seed", "train.loss_weighting"}
_REFUSED_PREFIXES = ("model.", "data.")
# Keys that change how the same numbers are computed, not which: gradient checkpointing recomputes the forward
# pass bit-identically in fp32 (a resume may switch it on to save memory, or read a checkpoint older than it).
# model.fused_kernels swaps a module for a kernel of the same function (equal up to the precision's rounding).
_FREE_DATA = {"data.cache_dir", "data.num_workers", "data.num_proc", "data.pad_to_multiple_of", "model.gradient_checkpointing",
              "model.fused_kernels"}
_NOT_COMPARED = {"output_dir", "output_root"}
# Keys added after checkpoints were written: absent from an older checkpoint's config, they compare as their default.
_ADDED = ("train.optimizer", "train.muon_lr", "train.muon_momentum")
# Keys whose change gives the model other parameters (names or shapes) than the checkpoint holds: its state dict
# can never load, so these are refused even with --resume-allow-changes.
_UNLOADABLE = {"model.lora", "model.lora.r", "model.lora.target_modules", "model.quantization",
               "model.quantization.bits", "model.quantization.quant_type", "model.quantization.double_quant"}
SCHEDULE_KEYS = ("train.lr", "train.muon_lr", "train.lr_scheduler", "train.warmup_steps", "train.max_steps",
                 "train.epochs")
_OPTIMIZER_KEYS = ("train.weight_decay", "train.adam_beta1", "train.adam_beta2", "train.adam_eps",
                   "train.muon_momentum")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "config_overrides":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changes(old: dict, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """``key -> (checkpoint's value, this launch's value)`` for every run-config key that differs."""
    a, b = _flatten(old), _flatten(config_to_dict(cfg))
    defaults = _flatten(config_to_dict(RunConfig()))
    for k in _ADDED:  # a checkpoint from before these keys existed ran with what is now their default
        a.setdefault(k, defaults[k])
    keys = [k for k in dict.fromkeys([*b, *a]) if k not in _NOT_COMPARED]
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def _refused(key: str) -> bool:
    return key in _REFUSED_EXACT or (key.startswith(_REFUSED_PREFIXES) and key not in _FREE_DATA)


def keep_global_batch(old: dict, old_world: int, cfg: RunConfig, world: int, first: dict | None = None) -> str | None:
    """On another world size, set ``train.gradient_accumulation_steps`` so the global batch stays the checkpoint's.

    Only when this launch runs the micro batch and accumulation of the checkpoint's config or of the run's
    first launch (``first``: a requeued job runs its original config, whatever an earlier requeue adjusted; so also
    on the checkpoint's own world size, when an earlier requeue onto it changed the accumulation)
    and ``global batch / (micro batch x world size)`` is a whole number. An accumulation or micro batch the
    launch sets otherwise is left alone (:func:`review` then judges the global batch).

    Returns:
        A note for the log when it changed ``cfg``, else None.
    """
    ot = old.get("train", {})
    old_micro, old_gas = ot.get("micro_batch_size"), ot.get("gradient_accumulation_steps")
    ft = (first or {}).get("train", {})
    split = (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps)
    if split not in ((old_micro, old_gas), (ft.get("micro_batch_size"), ft.get("gradient_accumulation_steps"))):
        return None
    global_batch = old_micro * old_gas * old_world
    if cfg.train.micro_batch_size != old_micro or global_batch % (old_micro * world):
        return None
    was, cfg.train.gradient_accumulation_steps = cfg.train.gradient_accumulation_steps, global_batch // (old_micro * world)
    if was == cfg.train.gradient_accumulation_steps:
        return None
    return (f"--resume: world size {old_world} -> {world}: train.gradient_accumulation_steps {was} -> "
            f"{cfg.train.gradient_accumulation_steps} keeps the global batch of {global_batch} rows (micro batch {old_micro})")


def review(old: dict, old_world: int, cfg: RunConfig, world: int, allow: bool) -> tuple[list[str], list[str]]:
    """Compare the checkpoint's config with this launch's.

    Args:
        old: the checkpoint's resolved run config (dict).
        old_world: the checkpoint's world size (from its ``COMPLETE`` marker).
        cfg: this launch's config.
        world: this launch's world size.
        allow: ``--resume-allow-changes`` was given.

    Returns:
        ``(problems, notes)``: one-line refusals (empty when ``allow``) and one line per change for the log.
    """
    diff = changes(old, cfg)
    problems, notes = [], []
    unloadable = [f"{k} {diff[k][0]!r} -> {diff[k][1]!r}" for k in diff if k in _UNLOADABLE]
    if unloadable:
        problems.append(f"--resume: the LoRA adapters or the quantized base changed ({', '.join(unloadable)}): the "
                        f"model's parameters no "
                        f"longer match the checkpoint's, which can then never be loaded (not even with "
                        f"--resume-allow-changes); start a new run (drop --resume), e.g. from the export as model.path")
    if "train.optimizer" in diff:
        was, now = diff["train.optimizer"]
        problems.append(f"--resume: train.optimizer changed ({was!r} -> {now!r}): the checkpoint holds the other "
                        f"optimizer's state, which cannot be loaded (not even with --resume-allow-changes); start a "
                        f"new run (drop --resume), e.g. from the export as model.path")
    fix = "start a new run (drop --resume), or pass --resume-allow-changes to continue anyway"
    for key, (was, now) in diff.items():
        if key in ("train.micro_batch_size", "train.gradient_accumulation_steps"):
            continue
        if (key in _UNLOADABLE or key.startswith("model.lora") and unloadable) or key == "train.optimizer":
            continue  # one line for the whole LoRA change, above; the optimizer's line above
        if key == "train.grpo.num_iterations":  # the sampler's position counts repeated rows
            line = (f"--resume: {key} changed ({was!r} -> {now!r}): the sampler repeats each step's prompts "
                    f"num_iterations times and the checkpoint's position counts those repeats, so the continuation "
                    f"would skip or repeat prompts of the uninterrupted order")
            (notes if allow else problems).append(line + ("; continuing as --resume-allow-changes asks" if allow
                                                          else f"; {fix}"))
        elif _refused(key):
            line = f"--resume: {key} changed ({was!r} -> {now!r}): the continuation would be a different run"
            (notes if allow else problems).append(line + ("; continuing as --resume-allow-changes asks" if allow
                                                          else f"; {fix}"))
        elif key in SCHEDULE_KEYS:
            notes.append(f"--resume: {key}: {was!r} -> {now!r} (applied: the LR schedule is rebuilt at the current step)")
        else:
            notes.append(f"--resume: {key}: {was!r} -> {now!r} (applied from now on)")
    ot = old.get("train", {})
    old_micro, old_gas = ot.get("micro_batch_size", cfg.train.micro_batch_size), ot.get("gradient_accumulation_steps",
                                                                              cfg.train.gradient_accumulation_steps)
    old_global, new_global = old_micro * old_gas * old_world, cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * world
    split = (f"micro batch {old_micro} x accumulation {old_gas} x world {old_world} -> "
             f"{cfg.train.micro_batch_size} x {cfg.train.gradient_accumulation_steps} x {world}")
    if old_global != new_global:
        line = f"--resume: the global batch changed from {old_global} to {new_global} rows ({split})"
        (notes if allow else problems).append(
            line + ("; continuing as --resume-allow-changes asks" if allow else
                    f": a different run; keep micro batch x accumulation x world size = {old_global}, or {fix}"))
    elif (old_micro, old_gas, old_world) != (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps, world):
        notes.append(f"--resume: same global batch of {new_global} rows, new split ({split}); the position is kept "
                     f"in rows, so no row is repeated or skipped")
    return problems, notes


def _decays(index: int, group: dict) -> bool:
    """True for an optimizer group of weight-decayed parameters when :func:`_built` cannot say (Muon, expert
    parallelism): group 0 of :func:`finetune.engine.model.param_groups`, or under Muon (``use_muon`` in every group)
    both halves DeepSpeed splits it into (named ``group0-...``)."""
    if "use_muon" in group:
        return str(group.get("name", "")).startswith("group0-")
    return index == 0


def _built(engine, cfg: RunConfig) -> list[dict] | None:
    """``(lr, weight_decay)`` of each of the engine's optimizer groups as this launch's config builds them
    (:func:`finetune.engine.model.optimizer_groups` on the engine's model: LoRA+'s rates, which peft's
    ``create_loraplus_optimizer`` defines, and the decay rule); None when DeepSpeed split the groups into others
    (Muon's halves, expert parallelism: not the same count), which :func:`_decays` and ``train.lr`` then cover."""
    groups = engine.optimizer.param_groups
    if any("use_muon" in g for g in groups):
        return None
    built = optimizer_groups(engine.module, cfg)
    if len(built) != len(groups):
        return None
    return [{"lr": b.get("lr", cfg.train.lr), "weight_decay": b["weight_decay"]} for b in built]


def apply(engine, old: dict, cfg: RunConfig, total_steps: int) -> None:
    """Make the restored optimizer and LR schedule follow this launch's config (after ``load_checkpoint``).

    DeepSpeed restores the optimizer's parameter groups and the scheduler's state from the checkpoint,
    which would silently keep the old learning rate, schedule and AdamW settings. Each group's weight decay and peak
    learning rate (``initial_lr``) are rebuilt from this launch's config as a fresh launch builds them
    (:func:`finetune.engine.model.optimizer_groups`: decay on every decayed group, none on biases and norms; under
    LoRA+ the ``B`` matrices and 1-D adapters at ``train.lr`` x ``model.lora.loraplus_lr_ratio``, the ``A`` matrices
    at ``train.lr``, embedding adapters at peft's 1e-6); under Muon (whose groups DeepSpeed splits) the decay goes to
    both halves of group 0 (:func:`_decays`) and Muon's groups get ``train.muon_lr`` and ``train.muon_momentum``.
    When a schedule key changed, a new ``transformers.get_scheduler`` schedule is built for the new values and moved
    to the restored position (``last_epoch``), so the next step uses the new schedule's value.
    Nothing is touched when nothing changed (resume stays bit-exact).
    """
    diff = changes(old, cfg)
    groups = engine.optimizer.param_groups
    schedule, optimizer = any(k in diff for k in SCHEDULE_KEYS), any(k in diff for k in _OPTIMIZER_KEYS)
    built = _built(engine, cfg) if schedule or optimizer else None
    if optimizer:
        for i, g in enumerate(groups):
            if "betas" in g:
                g["betas"] = (cfg.train.adam_beta1, cfg.train.adam_beta2)
            if "eps" in g:
                g["eps"] = cfg.train.adam_eps
            if g.get("use_muon"):
                g["momentum"] = cfg.train.muon_momentum
            if built is not None:
                g["weight_decay"] = built[i]["weight_decay"]
            elif _decays(i, g):
                g["weight_decay"] = cfg.train.weight_decay
    if not schedule or engine.lr_scheduler is None:
        return
    old_sched = engine.lr_scheduler
    position = old_sched.last_epoch
    for i, g in enumerate(groups):
        g["initial_lr"] = (built[i]["lr"] if built is not None else
                           cfg.train.muon_lr if g.get("use_muon") else cfg.train.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
        sched = get_scheduler(cfg.train.lr_scheduler, old_sched.optimizer, num_warmup_steps=cfg.train.warmup_steps,
                              num_training_steps=total_steps)
        sched.last_epoch = position - 1
        sched.step()
    engine.lr_scheduler = sched


def restore(engine, resolved, cfg: RunConfig, total_steps: int) -> TrainState:
    """The training state to start from: fresh, or loaded from ``resolved.resume_ckpt`` into ``engine``.

    On another world size or ZeRO stage the checkpoint is loaded through its universal copy (rank 0 converts it
    once, :func:`finetune.lifecycle.checkpoint.to_universal`); then :func:`apply` makes the restored optimizer and LR
    schedule follow this launch's config. All ranks call it.

    Raises:
        RunFailure: the conversion or the load failed.
    """
    if resolved.resume_ckpt is None:
        return TrainState()
    universal = ckpt_utils.to_universal(resolved.resume_ckpt) if resolved.universal else None
    state = ckpt_utils.load(engine, resolved.resume_ckpt, universal)
    old = ckpt_utils.saved_config(resolved.resume_ckpt)
    if old is not None:
        apply(engine, old, cfg, total_steps)
    return state


ABANDONED = "abandoned"
"""Folder of the run folder where :func:`settle` sets aside, per launch (``abandoned/launch<n>/``), what a resume from an
earlier step leaves behind: ``checkpoints/step<M>/`` of the abandoned lineage, the rows of ``completions.jsonl`` and
the ``eval/step<M>_*`` files of steps after the resumed one. Never deleted."""
COMPLETIONS = "completions.jsonl"
_EVAL_FILE = re.compile(r"^step(\d+)_")


_JUDGED = ("train.micro_batch_size", "train.gradient_accumulation_steps", "train.optimizer", "train.grpo.num_iterations")
"""Keys that :func:`review` or :func:`keep_global_batch` judge besides the refused ones (the global batch, keys refused
for reasons of their own)."""


def _same_origin(a: Path, b: Path) -> bool:
    """True when validation's verdict on checkpoint ``a`` holds for ``b`` as well: both saved on the same layout, and
    their run configs differ at most in keys that a resume applies (:func:`review`'s notes: the schedule, the
    cadence, ...), never in one it refuses or that decides the global batch or the layout."""
    def layout(c: Path) -> tuple:
        meta = ckpt_utils.marker(c)
        return (ckpt_utils.saved_layout(c), meta.get("expert_parallel_size", 1), meta.get("pipeline_parallel_size", 1),
                ckpt_utils.is_sharded(c))

    if layout(a) != layout(b):
        return False
    ca, cb = _flatten(ckpt_utils.saved_config(a) or {}), _flatten(ckpt_utils.saved_config(b) or {})
    differ = [k for k in {*ca, *cb} if ca.get(k) != cb.get(k)]
    return not any(_refused(k) or k in _UNLOADABLE or k in _JUDGED or k.startswith("parallel.") for k in differ)


def verified(ckpt: Path, fall_back: bool) -> Path:
    """``ckpt`` once every file matches its manifest (:func:`finetune.lifecycle.checkpoint.verify`: each rank hashes
    its own files, in parallel, then the ranks agree), or with ``fall_back`` the newest older complete checkpoint of
    the same folder that does. All ranks call it; the answer is the same on every rank.

    A fallback must have been saved on the same layout with the same run config as ``ckpt`` (what the launch's checks
    judged before the process group existed); the newest one that verifies but was not is named instead.

    Raises:
        ConfigError: ``ckpt`` is damaged and named by path (one line naming the file), or nothing older verifies.
    """
    t0 = time.perf_counter()
    check = ckpt_utils.verify(ckpt)
    if not check.manifest and not check.code:
        return ckpt  # resolve_resume's note said so: loaded unverified (its pickles scanned for code all the same)
    if not check.problems:
        logger.info(f"--resume: {ckpt} verified: {check.files} files, {check.bytes / 2**20:.1f} MiB in "
                    f"{ckpt_utils.duration(time.perf_counter() - t0)} (SHA-256 {ckpt_utils.duration(check.seconds)} on "
                    f"the slowest of {dist_utils.world_size()} rank(s), each hashing its own files)")
        return ckpt
    damage = f"{ckpt.name}: {'; '.join(check.problems[:3])}{' ...' if len(check.problems) > 3 else ''}"
    if not fall_back:
        raise ConfigError(f"--resume: '{ckpt}' is damaged ({damage}); resume another checkpoint (--resume with its "
                          f"run folder takes the newest that verifies)")
    skipped = [damage]
    step = ckpt_utils.marker(ckpt).get("step", -1)
    for older in reversed(ckpt_utils.complete_checkpoints(ckpt.parent)):
        if ckpt_utils.marker(older).get("step", -1) >= step:
            continue
        problem = ckpt_utils.size_problem(older)
        if problem is None:
            check = ckpt_utils.verify(older)
            problem = "; ".join(check.problems[:3]) or None
        if problem:
            skipped.append(f"{older.name}: {problem}")
            continue
        if not _same_origin(older, ckpt):
            raise ConfigError(f"--resume: damaged ({'; '.join(skipped)}); the newest checkpoint that verifies, "
                              f"'{older}', was saved on another layout or with a run config this launch's checks did "
                              f"not judge: resume it by its path (--resume {older})")
        logger.warning(ckpt_utils.fallback_note(skipped, older) + ("" if check.manifest else " (saved without a "
                       f"{ckpt_utils.MANIFEST}: unverified)"))
        return older
    raise ConfigError(f"--resume: no complete checkpoint in '{ckpt.parent}' verifies ({'; '.join(skipped)}); resume "
                      f"another run, or drop --resume to start a new one")


def _set_aside_rows(path: Path, after: int, dest: Path) -> int:
    """Move the rows of JSON-lines file ``path`` whose ``step`` is above ``after`` (and lines that are not JSON: a torn
    last row) to ``dest`` (appended), rewriting ``path`` with the rest. Returns the rows moved."""
    kept, moved = [], []
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        (kept if isinstance(step, int) and step <= after else moved).append(line if line.endswith("\n") else line + "\n")
    if moved:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "a") as f:
            f.writelines(moved)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return len(moved)


def set_aside_after(run_dir: Path, step: int, launch: int) -> str | None:
    """Rank 0, before a resumed launch trains: move what the run folder holds of steps after ``step`` into
    ``<run>/abandoned/launch<launch>/`` (:data:`ABANDONED`), renamed, never deleted:

    * ``checkpoints/step<M>/`` with ``M > step`` and their universal copies (a resume from an older checkpoint
      abandons that lineage; ``latest`` and ``train.keep_last_checkpoints`` would otherwise take it up again);
    * the rows of ``completions.jsonl`` (``grpo``'s samples) whose ``step`` is after ``step``, which the resumed steps
      append again;
    * ``eval/step<M>_*`` files with ``M > step`` (``grpo``'s ``eval/step<M>_completions.jsonl`` is appended to, the
      others rewritten by the resumed evaluations).

    Returns:
        One line for the log naming what moved and where, or None when nothing did.
    """
    dest = run_dir / ABANDONED / f"launch{launch}"
    parts = []
    moved = ckpt_utils.set_aside(ckpt_utils.checkpoints_dir(run_dir), step, dest / "checkpoints")
    if moved:
        parts.append(f"checkpoints {', '.join(moved)}")
    if (run_dir / COMPLETIONS).is_file():
        rows = _set_aside_rows(run_dir / COMPLETIONS, step, dest / COMPLETIONS)
        if rows:
            parts.append(f"{rows} row(s) of {COMPLETIONS}")
    evals = sorted((p for p in (run_dir / "eval").glob("step*_*") if (m := _EVAL_FILE.match(p.name))
                    and int(m.group(1)) > step), key=lambda p: p.name) if (run_dir / "eval").is_dir() else []
    for p in evals:
        (dest / "eval").mkdir(parents=True, exist_ok=True)
        os.replace(p, dest / "eval" / p.name)
    if evals:
        parts.append(f"eval/{', eval/'.join(p.name for p in evals)}")
    if not parts:
        return None
    return (f"--resume from step {step}: what the run folder held of later steps is set aside in {dest} (never "
            f"deleted): {'; '.join(parts)}")


def settle(resolved, run_dir: Path, launch: int):
    """A resumed launch, once its process group and run lock exist and before any model is built: verify the
    checkpoint (:func:`verified`; a fallback replaces ``resolved.resume_ckpt``), then rank 0 sets aside what the run
    folder holds of later steps (:func:`set_aside_after`). All ranks call it.

    Args:
        resolved: validation's :class:`finetune.preflight.validate.Resolved` (``resume_ckpt``, ``resume_fallback``).
        run_dir: this launch's run folder.
        launch: this launch's number (names ``abandoned/launch<n>/``).

    Returns:
        ``resolved``, with the checkpoint that verified.

    Raises:
        ConfigError: the checkpoint is damaged and nothing can replace it (:func:`verified`).
    """
    if resolved.resume_ckpt is None:
        return resolved
    ckpt = verified(resolved.resume_ckpt, getattr(resolved, "resume_fallback", False))
    if ckpt != resolved.resume_ckpt:
        resolved = dataclasses.replace(resolved, resume_ckpt=ckpt)
    if dist_utils.is_main():
        line = set_aside_after(Path(run_dir), ckpt_utils.marker(ckpt).get("step", 0), launch)
        if line:
            logger.warning(line)
    dist_utils.barrier()
    return resolved
