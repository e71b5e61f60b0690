"""Check a run before any model is built: every problem with the config, files and resume target at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune import checkpoint as ckpt_utils
from finetune.config import ConfigError, RunConfig
from finetune.data import check_parquet_files, expand_files
from finetune.ds_config import resolve_ds_config
from finetune.recipes import RECIPES

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")


@dataclass
class Resolved:
    """What validation worked out: the DeepSpeed dict and the checkpoint to resume from (or None)."""

    ds: dict
    resume_ckpt: Path | None


def _check_model(cfg: RunConfig, problems: list[str]) -> None:
    m = cfg.model
    if not m.path:
        problems.append("model.path: not set (a local folder with config.json)")
        return
    p = Path(m.path)
    if not p.is_dir():
        problems.append(f"model.path: folder '{p}' does not exist (models load from local folders only; "
                        f"copy the downloaded model there or fix the path)")
    elif not (p / "config.json").is_file():
        problems.append(f"model.path: '{p}' has no config.json")
    elif m.init == "pretrained" and not any((p / w).is_file() for w in _WEIGHTS):
        problems.append(f"model.path: '{p}' has no weights ({', '.join(_WEIGHTS)}); "
                        f"use model.init=scratch to train from config.json alone")
    if m.init not in ("pretrained", "scratch"):
        problems.append(f"model.init: '{m.init}' is not 'pretrained' or 'scratch'")
    tok = Path(m.tokenizer_path or m.path)
    if m.tokenizer_path and not tok.is_dir():
        problems.append(f"model.tokenizer_path: folder '{tok}' does not exist")
    elif tok.is_dir() and not any((tok / f).is_file() for f in _TOKENIZER_FILES):
        problems.append(f"model.tokenizer_path: '{tok}' has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")


def _check_numbers(cfg: RunConfig, problems: list[str]) -> None:
    t, d = cfg.train, cfg.data
    positive = {"train.micro_batch_size": t.micro_batch_size, "train.gradient_accumulation_steps":
                t.gradient_accumulation_steps, "train.lr": t.lr, "data.max_seq_len": d.max_seq_len,
                "train.log_every": t.log_every, "train.dist_timeout_minutes": t.dist_timeout_minutes}
    problems += [f"{k}: must be > 0, got {v}" for k, v in positive.items() if v <= 0]
    non_negative = {"train.max_steps": t.max_steps, "train.warmup_steps": t.warmup_steps, "train.eval_every":
                    t.eval_every, "train.save_every": t.save_every, "train.weight_decay": t.weight_decay,
                    "train.max_grad_norm": t.max_grad_norm, "data.num_workers": d.num_workers,
                    "train.eval_max_batches": t.eval_max_batches, "data.max_train_rows": d.max_train_rows,
                    "data.pad_to_multiple_of": d.pad_to_multiple_of}
    problems += [f"{k}: must be >= 0, got {v}" for k, v in non_negative.items() if v < 0]
    if t.max_steps == 0 and t.epochs <= 0:
        problems.append(f"train.epochs: must be > 0 when train.max_steps is 0, got {t.epochs}")
    if not 0.0 < d.mlm_probability < 1.0:
        problems.append(f"data.mlm_probability: must be in (0, 1), got {d.mlm_probability}")
    if not d.validation_files and not 0.0 < d.validation_fraction < 1.0:
        problems.append(f"data.validation_fraction: must be in (0, 1) when data.validation_files is empty, "
                        f"got {d.validation_fraction}")
    if t.lr_scheduler not in SCHEDULERS:
        problems.append(f"train.lr_scheduler: '{t.lr_scheduler}' unknown (choose one of: {', '.join(SCHEDULERS)})")
    if t.loss_weighting not in ("token", "micro_batch"):
        problems.append(f"train.loss_weighting: '{t.loss_weighting}' is not 'token' or 'micro_batch'")


def _check_recipe_data(cfg: RunConfig, train_files: list[str], validation_files: list[str],
                       problems: list[str]) -> None:
    """The recipe's own data checks (``check_labels``: seq_cls label columns), when it has them."""
    if cfg.recipe in RECIPES:
        from finetune.recipes import get_recipe

        recipe = get_recipe(cfg.recipe)
        if hasattr(recipe, "check_labels"):
            recipe.check_labels(cfg, train_files, validation_files, problems)


def validate_run(cfg: RunConfig, resume: str | None, world_size: int, on_cpu: bool) -> Resolved:
    """Check everything that can be checked before a model is built; raise all problems together.

    Args:
        cfg: the merged run config.
        resume: the ``--resume`` value (``latest``, a path) or None.
        world_size: number of ranks of this launch.
        on_cpu: True on DeepSpeed's CPU accelerator.

    Returns:
        :class:`Resolved`.

    Raises:
        ConfigError: one line per problem: unknown recipe, missing model/tokenizer/data files,
            unreadable/empty parquet, missing text column, bad numbers, DeepSpeed JSON problems
            (unknown keys, batch-size contradiction), nothing to resume, or an output folder that
            already holds checkpoints.
    """
    problems: list[str] = []
    if cfg.recipe not in RECIPES:
        problems.append(f"recipe: '{cfg.recipe}' unknown (choose one of: {', '.join(RECIPES)})")
    if not cfg.output_dir:
        problems.append("output_dir: not set (the run folder for logs, checkpoints and the export)")
    _check_model(cfg, problems)
    if not cfg.data.train_files:
        problems.append("data.train_files: no training files given")
    files = {}
    for key, patterns in (("data.train_files", cfg.data.train_files),
                          ("data.validation_files", cfg.data.validation_files)):
        files[key] = expand_files(patterns, key, problems)
        check_parquet_files(files[key], key, cfg.data.text_column, problems)
    _check_recipe_data(cfg, files["data.train_files"], files["data.validation_files"], problems)
    _check_numbers(cfg, problems)
    ds: dict = {}
    try:
        ds, ds_problems = resolve_ds_config(cfg, world_size, on_cpu)
        problems += ds_problems
    except ConfigError as e:
        problems += e.problems
    resume_ckpt = None
    if cfg.output_dir:
        if resume is not None:
            resume_ckpt, problem = ckpt_utils.resolve_resume(resume, cfg.output_dir)
            if problem:
                problems.append(problem)
        elif ckpt_utils.complete_checkpoints(ckpt_utils.checkpoints_dir(cfg.output_dir)):
            problems.append(f"output_dir: '{cfg.output_dir}' already holds checkpoints; pass --resume to continue "
                            f"that run or choose a new output_dir (nothing is overwritten)")
    if problems:
        raise ConfigError(problems)
    return Resolved(ds=ds, resume_ckpt=resume_ckpt)
