"""Check a run before any model is built: every problem with the config, files and resume target at once."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import is_flash_attn_2_available

from finetune.lifecycle import checkpoint as ckpt_utils
from finetune.parallel import distributed as dist_utils
from finetune.engine import freeze, gguf, lora, moe, muon, quantize
from finetune.engine.model import meta_model
from finetune.data import mixture
from finetune.parallel import checks, expert, layout, pipeline, sequence, tensor
from finetune.lifecycle import gguf_export, run_folder
from finetune.lifecycle import resume as resume_policy
from finetune.config import RunConfig, config_to_dict, dump_yaml, load_run_config
from finetune.data import tokenization
from finetune.data.dataset import (check_parquet_files, check_utf8, default_cache_dir, expand_files,
                                   fingerprint, holdout, linked_column, no_rows_problem, remember_checked,
                                   row_mapper, source_id, tokenization_key)
from finetune.engine.ds_config import resolve_ds_config, zero_stage
from finetune.errors import ConfigError
from finetune.recipes import RECIPES, get_recipe, offering, said

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")


@dataclass
class Resolved:
    """What validation worked out: the DeepSpeed dict, the checkpoint to resume from (or None) and, for a
    resume, one line per config change against the checkpoint's config (for the log)."""

    ds: dict
    resume_ckpt: Path | None
    resume_notes: list[str] = field(default_factory=list)
    universal: bool = False
    """Resume through the checkpoint's universal copy (another world size or ZeRO stage; ``ds`` then has
    ``checkpoint.load_universal``)."""
    resume_fallback: bool = False
    """A damaged checkpoint may give way to the newest older one that verifies (``--resume`` without a checkpoint
    path; :func:`finetune.lifecycle.resume.settle`)."""

    def print_check(self, cfg: RunConfig, config_path: str, print_config: bool) -> int:
        """``--print-config`` / ``--check``: rank 0 prints the resolved configs or that all checks pass, and the
        resume notes; returns 0."""
        if dist_utils.rank() == 0:
            if print_config:
                print(dump_yaml({**config_to_dict(cfg), "resolved_deepspeed": self.ds}))
            else:
                lay = layout.layout(cfg)
                split = (f" = data-parallel {lay.dp} x sequence-parallel {lay.sp} x tensor-parallel {lay.tp}"
                         if lay.sp * lay.tp > 1 else "")
                print(f"finetune: {config_path}: no problems found (world size {dist_utils.world_size()}{split}"
                      f"{f'; resume from {self.resume_ckpt}' if self.resume_ckpt else ''})")
            for note in self.resume_notes:
                print(f"finetune: {note}")
        return 0


def _check_writable(key: str, path: str, problems: list[str]) -> None:
    """``path`` (need not exist yet) can be created and written: its nearest existing ancestor is a writable folder."""
    p = Path(path).absolute()
    if p.parts[1:2] in (("proc",), ("sys",)):
        problems.append(f"{key}: '{path}' is under /{p.parts[1]} (a kernel file system); choose a folder on a disk")
        return
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        problems.append(f"{key}: '{probe}' is a file, not a folder; choose another {key}")
    elif not os.access(probe, os.W_OK | os.X_OK):
        problems.append(f"{key}: '{path}' cannot be written ('{probe}' is read-only or not yours); "
                        f"choose a writable {key}")


def _check_model(cfg: RunConfig, problems: list[str]) -> None:
    if cfg.model.attn_implementation == "flash_attention_2":
        if not is_flash_attn_2_available():
            problems.append("model.attn_implementation: 'flash_attention_2' needs the flash-attn package and a CUDA "
                            "GPU, not available here; use sdpa (default) or eager")
    if not cfg.model.path:
        problems.append("model.path: not set (a local folder with config.json, or a .gguf file)")
        return
    if gguf.is_gguf(cfg.model.path) or gguf.is_gguf(cfg.model.tokenizer_path):
        return  # a GGUF that could not be converted: resolve_model_files said why
    p = Path(cfg.model.path)
    if not p.is_dir():
        problems.append(f"model.path: folder '{p}' does not exist (models load from local folders only; "
                        f"copy the downloaded model there or fix the path)")
    elif not (p / "config.json").is_file():
        problems.append(f"model.path: '{p}' has no config.json")
    elif (cfg.model.init == "pretrained" and not any((p / w).is_file() for w in WEIGHT_FILES)
          and not gguf.weights_deferred(p)):  # a GGUF's config-only folder: its weights are in the checked file
        problems.append(f"model.path: '{p}' has no weights ({', '.join(WEIGHT_FILES)}); "
                        f"use model.init=scratch to train from config.json alone")
    tok = Path(cfg.model.tokenizer_path or cfg.model.path)
    if cfg.model.tokenizer_path and not tok.is_dir():
        problems.append(f"model.tokenizer_path: folder '{tok}' does not exist")
    elif tok.is_dir() and not any((tok / f).is_file() for f in TOKENIZER_FILES):
        problems.append(f"model.tokenizer_path: '{tok}' has no tokenizer files ({', '.join(TOKENIZER_FILES)})")


_ATTN_SUPPORT = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}

# Config keys that set parameter shapes: with init=pretrained, overriding one makes the weights on disk not fit.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "ffn_dim",
               "max_position_embeddings", "n_positions", "type_vocab_size", "num_key_value_heads", "head_dim",
               "embedding_size")
# Where a config keeps its number of position embeddings (the first one set counts).
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
# Model types whose position ids start after the padding index (RoBERTa style): pad_token_id + 1 fewer usable.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "data2vec-text",
                     "roberta-prelayernorm", "ibert", "mpnet", "luke", "bros")


def _check_compatibility(cfg: RunConfig, problems: list[str]):
    """Model, tokenizer and data settings that fit together, from ``config.json`` and the tokenizer files alone.

    Builds no model: transformers' ``AutoConfig`` (with ``model.config_overrides`` applied) and
    ``AutoTokenizer`` (prepared by the recipe) are all it loads. Appends a problem for: an unreadable
    config.json, an override key the model config does not have, a shape override with pretrained
    weights, a model type the recipe's model class cannot build, a hidden size not divisible by the
    number of attention heads, ``data.max_seq_len`` above the model's position embeddings, ``model.lora`` /
    ``model.gradient_checkpointing`` the model cannot take (:func:`finetune.engine.lora.check`), an unreadable
    tokenizer, missing special tokens (the recipe's ``prepare_tokenizer``; EOS for packed ``gpt_clm``), a
    ``model.attn_implementation`` the model class does not support,
    and token ids beyond the model's ``vocab_size``; a mixture-of-experts model (:func:`finetune.engine.moe.moe_shape`)
    with sequence or tensor parallelism or tiled MLPs (its router's loss is defined on whole micro-batches). Runs only when the folders and the recipe are valid
    (their own problems are reported elsewhere).

    Returns:
        The tokenizer as the recipe prepares it (the launch's), or None when it was not loaded.
    """
    model_dir = Path(cfg.model.path) if cfg.model.path else None
    tok_dir = Path(cfg.model.tokenizer_path or cfg.model.path) if (cfg.model.tokenizer_path or cfg.model.path) else None
    if cfg.recipe not in RECIPES or model_dir is None or not (model_dir / "config.json").is_file():
        return None

    recipe = get_recipe(cfg.recipe)
    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # ValueError (unknown model_type), OSError, JSON errors
        problems.append(f"model.path: '{model_dir}/config.json' cannot be read by transformers: "
                        f"{' '.join(str(e).split())[:300]}")
        return None
    where = f"'{model_dir}/config.json' (model_type {config.model_type})"
    if cfg.export_gguf:
        try:
            gguf_export.check_type(cfg.export_gguf, "export_gguf")
            gguf_export.check_family(config.model_type, "export_gguf")
        except ConfigError as e:
            problems.append(str(e))
    for key, value in cfg.model.config_overrides.items():
        if not hasattr(config, str(key)):
            close = difflib.get_close_matches(str(key), list(config.to_dict()) + list(config.attribute_map), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"model.config_overrides: '{key}' is not a key of the model config {where}{hint}; "
                            f"it would be ignored")
            continue
        before = getattr(config, key)
        if cfg.model.init == "pretrained" and key in _SHAPE_KEYS and before != value:
            problems.append(f"model.config_overrides: {key}={value} differs from {where} ({before}), but the "
                            f"pretrained weights in '{model_dir}' have that shape; drop the override or use "
                            f"model.init=scratch")
        setattr(config, key, value)
    mapping = getattr(recipe.model_class, "_model_mapping", None)
    if mapping is not None and type(config) not in mapping:
        problems.append(f"model.path: {where} is a model type that {recipe.model_class.__name__} (recipe "
                        f"{cfg.recipe}) cannot build; choose a model with that head or another recipe")
    elif mapping is not None and not getattr(mapping[type(config)], _ATTN_SUPPORT.get(cfg.model.attn_implementation, ""), True):
        problems.append(f"model.attn_implementation: {mapping[type(config)].__name__} ({where}) does not support "
                        f"'{cfg.model.attn_implementation}'; use eager")
    else:  # model.lora / model.gradient_checkpointing against a meta-device model built from the config

        # one meta-device build for both checks (freezing first: peft's wrapping renames the modules in place)
        needed = cfg.model.lora is not None or cfg.model.gradient_checkpointing or bool(cfg.model.freeze)
        built = meta_model(recipe.model_class, config) if needed else None
        freeze.check(cfg, built, problems)
        lora.check(cfg, recipe.model_class, built, where, problems)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if (isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and getattr(config, "head_dim", None) is None
            and hidden % heads):
        overridden = set(cfg.model.config_overrides) & {"hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head"}
        problems.append(f"{'model.config_overrides' if overridden else 'model.path'}: hidden size {hidden} is not a "
                        f"multiple of the number of attention heads {heads} ({where} + overrides)")
    positions = next((getattr(config, k) for k in _POSITION_KEYS if isinstance(getattr(config, k, None), int)), None)
    if positions is not None:
        key = next(k for k in _POSITION_KEYS if getattr(config, k, None) == positions)
        usable = positions - ((config.pad_token_id or 0) + 1 if config.model_type in _OFFSET_POSITIONS else 0)
        if cfg.data.max_seq_len > usable:
            problems.append(f"data.max_seq_len: {cfg.data.max_seq_len} is more tokens than the model has positions "
                            f"for ({key}={positions}"
                            f"{f', {usable} usable' if usable != positions else ''} in {where} + overrides); "
                            f"set data.max_seq_len={usable} or lower")
        sp = cfg.parallel.sequence_parallel_size
        padded = -(-cfg.data.max_seq_len // sp) * sp if sp > 1 else cfg.data.max_seq_len
        if usable >= cfg.data.max_seq_len and padded > usable:
            problems.append(f"data.max_seq_len: under sequence parallelism rows are padded to a multiple of {sp} "
                            f"({padded} positions), more than the model has ({key}={positions}"
                            f"{f', {usable} usable' if usable != positions else ''}); set data.max_seq_len="
                            f"{usable // sp * sp} or lower")
    asked = (cfg.parallel.sequence_parallel_size > 1 or cfg.parallel.tensor_parallel_size > 1 or cfg.parallel.tiled_mlp
             or cfg.parallel.expert_parallel_size > 1 or cfg.parallel.pipeline_parallel_size > 1)
    offered = ({d: said(offering(lambda c, d=d: d in c.parallel))
                for d in (sequence.DIMENSION, tensor.DIMENSION, expert.DIMENSION, pipeline.DIMENSION)}
               if asked else None)  # only for the lines of a refusal: it imports every recipe
    checks.check(cfg, config, None, recipe.capabilities.parallel, problems, offered)
    shape = moe.moe_shape(config)
    beside = [f"{key}={value}" for key, value in (("parallel.sequence_parallel_size", cfg.parallel.sequence_parallel_size),
                                                   ("parallel.tensor_parallel_size", cfg.parallel.tensor_parallel_size),
                                                   ("parallel.tiled_mlp", cfg.parallel.tiled_mlp)) if value not in (1, False)]
    if shape is not None and beside:  # the router's loss and statistics are defined per whole micro-batch
        problems.append(f"{beside[0].split('=')[0]}: {where} is a mixture of experts ({shape.experts} experts, top-"
                        f"{shape.top_k}), and its router's load-balancing loss is defined on whole micro-batches, "
                        f"which {', '.join(beside)} splits; finetune does not train MoE models with it yet: leave it "
                        f"at {'1' if 'size' in beside[0] else 'false'}")
    if tok_dir is None or not any((tok_dir / f).is_file() for f in TOKENIZER_FILES):
        return None  # reported by _check_model
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except Exception as e:  # missing or corrupt tokenizer files raise many types
        problems.append(f"model.tokenizer_path: the tokenizer in '{tok_dir}' cannot be loaded: "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        return None
    try:
        tokenizer = recipe.prepare_tokenizer(tokenizer)
    except ConfigError as e:
        problems += e.problems
    recipe.check_tokenizer(tokenizer, cfg, problems)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        needed = max([len(tokenizer)] + [i + 1 for i in tokenizer.all_special_ids if i is not None])
        if needed > vocab:
            problems.append(f"model.tokenizer_path: tokenizer '{tok_dir}' has {needed:,} token ids but the model's "
                            f"vocab_size is {vocab:,} ({where} + overrides): ids >= {vocab:,} would index past the "
                            f"embedding matrix; use the model's own tokenizer"
                            + (" or set model.config_overrides={vocab_size: %d}" % needed
                               if cfg.model.init == "scratch" else ""))
    return tokenizer


def _check_numbers(cfg: RunConfig, problems: list[str]) -> None:
    positive = {"train.micro_batch_size": cfg.train.micro_batch_size, "train.gradient_accumulation_steps":
                cfg.train.gradient_accumulation_steps, "train.lr": cfg.train.lr, "data.max_seq_len": cfg.data.max_seq_len,
                "train.log_every": cfg.train.log_every, "train.dist_timeout_minutes": cfg.train.dist_timeout_minutes,
                "data.tokenize_timeout_minutes": cfg.data.tokenize_timeout_minutes, "train.sample_tokens": cfg.train.sample_tokens}
    problems += [f"{k}: must be > 0, got {v}" for k, v in positive.items() if not v > 0]  # NaN too
    non_negative = {"train.max_steps": cfg.train.max_steps, "train.warmup_steps": cfg.train.warmup_steps, "train.eval_every":
                    cfg.train.eval_every, "train.save_every": cfg.train.save_every, "train.weight_decay": cfg.train.weight_decay,
                    "train.max_grad_norm": cfg.train.max_grad_norm, "data.num_workers": cfg.data.num_workers,
                    "data.num_proc": cfg.data.num_proc,
                    "train.eval_max_batches": cfg.train.eval_max_batches, "data.max_train_rows": cfg.data.max_train_rows,
                    "train.eval_micro_batch_size": cfg.train.eval_micro_batch_size,
                    "data.pad_to_multiple_of": cfg.data.pad_to_multiple_of, "data.min_pixels": cfg.data.min_pixels,
                    "data.max_pixels": cfg.data.max_pixels,
                    "train.keep_last_checkpoints": cfg.train.keep_last_checkpoints, "train.sample_temperature":
                cfg.train.sample_temperature, "train.sample_top_k": cfg.train.sample_top_k}
    problems += [f"{k}: must be >= 0, got {v}" for k, v in non_negative.items() if not v >= 0]
    eval_micro = cfg.train.eval_micro_batch_size
    if cfg.parallel.sequence_parallel_size > 1 and eval_micro not in (0, cfg.train.micro_batch_size):
        problems.append(f"train.eval_micro_batch_size: {eval_micro} with sequence parallelism, which cuts every batch "
                        f"as the training micro batch ({cfg.train.micro_batch_size}); set it to 0")
    if cfg.data.min_pixels > 0 and cfg.data.max_pixels > 0 and cfg.data.min_pixels > cfg.data.max_pixels:
        problems.append(f"data.min_pixels: {cfg.data.min_pixels} is more than data.max_pixels "
                        f"{cfg.data.max_pixels}; an image cannot fit both")
    _check_optimizer(cfg, problems)
    _check_best(cfg, problems)
    _check_eval_generate(cfg, problems)
    if cfg.train.max_steps == 0 and cfg.train.epochs <= 0:
        problems.append(f"train.epochs: must be > 0 when train.max_steps is 0, got {cfg.train.epochs}")
    if not 0.0 < cfg.data.mlm_probability < 1.0:
        problems.append(f"data.mlm_probability: must be in (0, 1), got {cfg.data.mlm_probability}")
    if not cfg.data.validation_files and not 0.0 < cfg.data.validation_fraction < 1.0:
        problems.append(f"data.validation_fraction: must be in (0, 1) when data.validation_files is empty, "
                        f"got {cfg.data.validation_fraction}")


def _check_optimizer(cfg: RunConfig, problems: list[str]) -> None:
    """The optimizer's numbers in the ranges torch's AdamW and DeepSpeed's Muon compute with (neither checks them all:
    ``muon_lr=-1`` trains uphill to the end, ``adam_beta1=1.5`` fails in AdamW once the model is built): finite
    learning rates (``train.lr`` > 0 is checked with the other positive numbers), betas and Muon's momentum in
    [0, 1), an epsilon > 0 (at 0 a parameter without gradient gets 0/0 = NaN), a finite weight decay. Checked
    whatever ``train.optimizer`` is: a value outside its range is a mistake wherever it is."""
    t = cfg.train
    if math.isinf(t.lr):
        problems.append(f"train.lr: must be a finite number > 0, got {t.lr}")
    if not 0 < t.muon_lr < math.inf:
        problems.append(f"train.muon_lr: must be a finite number > 0 (the Muon matrices' peak learning rate; "
                        f"default 0.02), got {t.muon_lr}")
    for key, value, default in (("train.muon_momentum", t.muon_momentum, 0.95), ("train.adam_beta1", t.adam_beta1, 0.9),
                                ("train.adam_beta2", t.adam_beta2, 0.999)):
        if not 0 <= value < 1:
            problems.append(f"{key}: must be in [0, 1) (a running average's decay; default {default}), got {value}")
    if not 0 < t.adam_eps < math.inf:
        problems.append(f"train.adam_eps: must be a finite number > 0 (default 1e-08), got {t.adam_eps}")
    if not 0 <= t.neftune_noise_alpha < math.inf:
        problems.append(f"train.neftune_noise_alpha: must be a finite number >= 0 (the NEFTune paper uses 5-15; 0: "
                        f"off), got {t.neftune_noise_alpha}")
    elif t.neftune_noise_alpha and cfg.recipe in RECIPES and not get_recipe(cfg.recipe).capabilities.noisy_embeddings:
        problems.append(f"train.neftune_noise_alpha: NEFTune is for the causal-LM recipes "
                        f"{said(offering(lambda c: c.noisy_embeddings))} (noise on the embeddings of text trained on), "
                        f"not {cfg.recipe}; set it to 0")
    if math.isinf(t.weight_decay):
        problems.append(f"train.weight_decay: must be a finite number >= 0, got {t.weight_decay}")


def _check_eval_generate(cfg: RunConfig, problems: list[str]) -> None:
    """``train.eval_generate``: a recipe that generates, sane decoding settings, a pattern that compiles."""
    g = cfg.train.eval_generate
    if g.prompts < 0:
        problems.append(f"train.eval_generate.prompts: must be >= 0 (0: off), got {g.prompts}")
    if g.prompts <= 0:
        return
    if cfg.recipe in RECIPES and not get_recipe(cfg.recipe).capabilities.generates_text:
        problems.append(f"train.eval_generate: recipe {cfg.recipe} does not generate text "
                        f"({said(offering(lambda c: c.generates_text))} do); set train.eval_generate.prompts=0")
    if g.max_new_tokens <= 0:
        problems.append(f"train.eval_generate.max_new_tokens: must be > 0, got {g.max_new_tokens}")
    if g.temperature < 0:
        problems.append(f"train.eval_generate.temperature: must be >= 0 (0: greedy), got {g.temperature}")
    if not 0 < g.top_p <= 1:
        problems.append(f"train.eval_generate.top_p: must be in (0, 1], got {g.top_p}")
    if not isinstance(g.stop, list) or not all(isinstance(s, str) and s for s in g.stop):
        problems.append(f"train.eval_generate.stop: must be a list of non-empty strings, got {g.stop!r}")
    if g.answer_pattern:
        try:
            re.compile(g.answer_pattern)
        except re.error as e:
            problems.append(f"train.eval_generate.answer_pattern: '{g.answer_pattern}' is not a regular expression "
                            f"({e})")


def eval_metric_names(cfg: RunConfig) -> list[str]:
    """Every ``eval/...`` key the run's evaluations write: loss, perplexity (recipes that report it), the recipe's
    :attr:`~finetune.recipes.Capabilities.eval_metrics`, the generation scores of ``train.eval_generate`` and, with
    ``data.sources``, each source's ``eval/<source>/...``. Known before any model is built."""
    can = get_recipe(cfg.recipe).capabilities
    names = ["loss", *(["perplexity"] if can.reports_perplexity else []), *can.eval_metrics]
    per_source = list(names)
    if cfg.train.eval_generate.prompts:
        names += ["rougeL", *(["generation_exact_match"] if cfg.train.eval_generate.answer_pattern else [])]
    sources = [src.get("name") for src in cfg.data.sources if isinstance(src, dict)]
    return [f"eval/{n}" for n in names] + [f"eval/{src}/{n}" for src in sources for n in per_source]


def _check_best(cfg: RunConfig, problems: list[str]) -> None:
    """``train.early_stopping`` and ``train.keep_best``: numbers, an ``eval/`` metric, evaluations to watch."""
    es, kb = cfg.train.early_stopping, cfg.train.keep_best
    if es.patience < 0:
        problems.append(f"train.early_stopping.patience: must be >= 0 (0: off), got {es.patience}")
    if es.min_delta < 0:
        problems.append(f"train.early_stopping.min_delta: must be >= 0, got {es.min_delta}")
    for key, on, metric in (("train.early_stopping", es.patience > 0, es.metric), ("train.keep_best", bool(kb.metric),
                                                                                    kb.metric)):
        if not on:
            continue
        if not metric.startswith("eval/"):
            problems.append(f"{key}.metric: '{metric}' is not an evaluation metric; use a key of metrics.jsonl "
                            f"that starts with eval/ (eval/loss, eval/accuracy, ...)")
        elif (metric == "eval/perplexity" and cfg.recipe in RECIPES
              and not get_recipe(cfg.recipe).capabilities.reports_perplexity):
            problems.append(f"{key}.metric: recipe {cfg.recipe} reports no eval/perplexity; use eval/loss or one "
                            f"of its metrics")
        elif cfg.recipe in RECIPES and metric not in (known := eval_metric_names(cfg)):
            close = difflib.get_close_matches(metric, known, n=1)
            problems.append(f"{key}.metric: '{metric}' is not among the metrics this run's evaluation reports"
                            + (f" (did you mean '{close[0]}'?)" if close else "")
                            + f"; choose one of: {', '.join(k for k in known if k.count('/') == 1)}")
        if cfg.train.eval_every <= 0:
            problems.append(f"{key}: needs evaluations during training; set train.eval_every (steps between "
                            f"evaluations), e.g. train.eval_every=100")


def _check_trackers(ds: dict) -> list[str]:
    """A DeepSpeed monitor that is enabled needs its package (DeepSpeed would fail after the model is built)."""
    for section, package in (("wandb", "wandb"), ("comet", "comet_ml")):
        enabled = isinstance(ds.get(section), dict) and ds[section].get("enabled")
        if enabled and importlib.util.find_spec(package) is None:
            offline = " (it runs offline: finetune sets WANDB_MODE=offline unless set)" if section == "wandb" else ""
            return [f"deepspeed: {section}.enabled is true but the '{package}' package is not installed; "
                    f"pip install {package}{offline} or use ds.csv_monitor.enabled=true"]
    return []


def resolve_model_files(cfg: RunConfig, problems: list[str], announce: bool = True, weights: bool = True) -> list[str]:
    """A ``.gguf`` ``model.path`` / ``model.tokenizer_path`` replaced in ``cfg`` by its converted Hugging Face folder
    under ``<data.cache_dir>/gguf/`` (:func:`finetune.engine.gguf.resolve`: checked, then converted once by
    transformers' GGUF loader), so that every verb reads a GGUF as the folder a launch trains. A file that cannot be
    converted adds its lines to ``problems`` and stays as it is. ``weights=False`` (the verbs that build no model):
    the file's config-only folder serves, read in seconds instead of a dequantization.

    Returns:
        The lines that say what was converted and where (empty when nothing was converted now).
    """
    return gguf.resolve(cfg, default_cache_dir(cfg.data), problems, announce=announce, weights=weights)


def checked_inputs_config(config: str | Path, overrides: list[str]) -> RunConfig:
    """The run config of ``config`` + ``overrides`` once its inputs pass :func:`check_inputs` (the data verbs:
    ``finetune prepare``, ``finetune inspect``); the valid files' UTF-8 marks are written.

    Raises:
        ConfigError: every problem of the config or its inputs, one line each.
    """
    load_problems: list[str] = []
    cfg = load_run_config(config, overrides, problems=load_problems)
    marks: list[Path] = []
    problems = load_problems + check_inputs(cfg, marks)[0]
    if problems:
        raise ConfigError(problems)
    remember_checked(marks)
    return cfg


def check_inputs(cfg: RunConfig, marks: list[Path] | None = None, weights: bool = True) -> tuple[list[str], list[str]]:
    """The checks of the run's inputs, a part of :func:`validate_run` that needs neither a world size nor an output
    folder (``finetune prepare`` runs them alone): recipe, model and tokenizer files, data files and columns, the
    recipe's data checks, model/tokenizer/data compatibility, numbers.

    ``marks`` collects the cache marks of files whose text was found valid UTF-8
    (:func:`finetune.data.dataset.check_utf8`); write them with :func:`finetune.data.dataset.remember_checked` once every check
    passed. ``weights=False``: nothing will be built from the model files (``--check``), so a ``.gguf`` is read without
    its weights (:func:`resolve_model_files`).

    Returns:
        ``(problems, number_problems)``: every problem (one line each), and those of them about numbers.
    """
    problems: list[str] = []
    if cfg.recipe not in RECIPES:
        problems.append(f"recipe: '{cfg.recipe}' unknown (choose one of: {', '.join(RECIPES)})")
    resolve_model_files(cfg, problems, weights=weights)
    _check_model(cfg, problems)
    if not cfg.data.train_files and not cfg.data.sources:
        problems.append("data.train_files: no training files given")
    recipe = get_recipe(cfg.recipe) if cfg.recipe in RECIPES else None
    sources = mixture.sources_of(cfg.data, problems)
    if sources and recipe is not None and not recipe.capabilities.mixes_sources:
        problems.append(f"data.sources: recipe {cfg.recipe} takes one dataset (its classes come from one label "
                        f"column; {said(offering(lambda c: c.mixes_sources))} take mixtures); use data.train_files")
    if sources and cfg.train.eval_generate.prompts:
        problems.append("train.eval_generate: not available with data.sources yet; set train.eval_generate.prompts=0 "
                        "or train on one dataset")
    for source, data in [(s, s.data) for s in sources] or [(None, cfg.data)]:
        found: list[str] = []
        files = {}
        for key, patterns in (("data.train_files", data.train_files), ("data.validation_files", data.validation_files)):
            files[key] = expand_files(patterns, key, found)
            own_checks = recipe is not None and recipe.capabilities.checks_columns  # sft, dpo check their columns
            check_parquet_files(files[key], key, None if own_checks else data.text_column, found)
            try:
                columns = recipe.columns(data) if recipe is not None else None
            except ConfigError:  # no form recognised in the files (sft): the recipe's check_data says so
                columns = None
            if columns is not None:
                check_utf8(files[key], key, columns, found,
                           checked=default_cache_dir(cfg.data) / "checked", marks=marks)
        if recipe is not None:
            recipe.check_data(dataclasses.replace(cfg, data=data), files["data.train_files"],
                              files["data.validation_files"], found)
        if source and not data.validation_files and not 0.0 < data.validation_fraction < 1.0:
            found.append(f"validation_fraction: must be in (0, 1) when the source has no validation_files, got "
                         f"{data.validation_fraction}")
        problems += [mixture.in_source(source, p) for p in found] if source else found
    tokenizer = _check_compatibility(cfg, problems)
    number_problems: list[str] = []
    _check_numbers(cfg, number_problems)
    number_problems += _nan_problems(cfg, problems + number_problems)
    if not problems and tokenizer is not None and not any(p.startswith("data.") for p in number_problems):
        launch = recipe.configure(recipe, cfg)  # the launch's map function, columns and cache key
        for source, data in [(s, s.data) for s in sources] or [(None, cfg.data)]:
            _check_rows_left(launch, tokenizer, data, cfg.train.seed, f"{source.where}: " if source else "", problems,
                             marks)
    problems += number_problems
    return problems, number_problems


ROWS_PROBE = 32
"""Rows of a split :func:`_check_rows_left` maps first; only a split none of whose first rows gives a row is mapped
further, batch by batch as the launch maps it."""


def _gives_a_row(mapper, source: tokenization.ParquetRows, rows) -> bool:
    if len(rows) == 0:
        return False
    return len(next(iter(mapper(source.take(rows)).values()), [])) > 0


def _check_rows_left(recipe, tokenizer, d, seed: int, where: str, problems: list[str],
                     marks: list[Path] | None = None) -> None:
    """Refuse a split that the launch's tokenization would leave with no row (every DPO pair with chosen ==
    rejected, every row longer than ``data.max_seq_len`` under ``data.truncation=drop``, ...), in the launch's own
    words, before any model: the split's rows as :func:`finetune.data.dataset.load_splits` chooses them
    (``data.max_train_rows``, the held-out share), mapped with the same function
    (:func:`finetune.data.dataset.row_mapper`, in batches of :data:`~finetune.data.tokenization.MAP_BATCH` rows) until
    one gives a row; the line is :func:`finetune.data.dataset.no_rows_problem`'s. A split whose first
    :data:`ROWS_PROBE` rows give a row costs one small batch. Runs once every other input check passed.

    As :func:`finetune.data.dataset.check_utf8`, splits that give rows are remembered in ``<cache>/checked`` (a mark
    keyed as the launch's tokenization cache, :func:`finetune.data.dataset.tokenization_key`, with the files' versions
    and how the rows are chosen), appended to ``marks`` for the caller to write once every check passed; the next
    check of the same inputs maps nothing."""
    cols = recipe.columns(d)
    train_files = expand_files(d.train_files, "data.train_files", [])
    val_files = expand_files(d.validation_files, "data.validation_files", [])
    mark, linked = None, linked_column(d, cols)
    if marks is not None:
        try:
            mark = default_cache_dir(d) / "checked" / ("rows-" + fingerprint(
                {**tokenization_key(recipe, tokenizer, d), "train": [source_id(f, linked) for f in train_files],
                 "max_rows": d.max_train_rows,
                 "validation": [source_id(f, linked) for f in val_files] or [d.validation_fraction, seed]}))
        except OSError:  # a file gone meanwhile: reported by the launch
            return
        if mark.exists():
            return
    train = tokenization.ParquetRows(train_files, cols)
    n_train = min(d.max_train_rows, len(train)) if d.max_train_rows else len(train)
    if val_files:
        val = tokenization.ParquetRows(val_files, cols)
        splits = [("train", "data.train_files", train, np.arange(n_train)),
                  ("validation", "data.validation_files", val, np.arange(len(val)))]
    else:
        train_rows, val_rows = holdout(n_train, d.validation_fraction, seed)
        splits = [("train", "data.train_files", train, train_rows),
                  ("validation", "data.validation_fraction", train, val_rows)]
    before = len(problems)
    for name, key, source, rows in splits:
        try:
            if _gives_a_row(row_mapper(recipe, recipe.tokenize_function(tokenizer, d), d.text_column), source,
                            rows[:ROWS_PROBE]):
                continue
            fn = recipe.tokenize_function(tokenizer, d)  # fresh counts for the line
            mapper = row_mapper(recipe, fn, d.text_column)
            if not any(_gives_a_row(mapper, source, rows[a:a + tokenization.MAP_BATCH])
                       for a in range(0, len(rows), tokenization.MAP_BATCH)):
                problems.append(no_rows_problem(where, key, name, len(rows), getattr(mapper, "dropped", 0), fn,
                                                d.text_column, recipe.capabilities.counts_rows))
        except ConfigError as e:  # a row the recipe's map function refuses: the launch would stop on it too
            problems += [line for line in (f"{where}{line}" for line in e.problems) if line not in problems]
            # (a row of a file that is both the train and the validation file: one line)
    if mark is not None and len(problems) == before:
        marks.append(mark)


def _nan_problems(cfg: RunConfig, known: list[str]) -> list[str]:
    """One line per number of the run config that is NaN (``train.muon_lr=nan``: every comparison with it is false,
    so a range check alone lets it through), unless a line about its key is in ``known`` already."""
    named = {p.split(":", 1)[0] for p in known}
    out = []

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value, key = getattr(obj, f.name), prefix + f.name
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
            elif isinstance(value, float) and math.isnan(value) and key not in named:
                out.append(f"{key}: must be a number, got nan; set a finite value (see docs/config.md)")

    walk(cfg, "")
    return out


def validate_run(cfg: RunConfig, resume: str | None, world_size: int, on_cpu: bool,
                 allow_changes: bool = False, weights: bool = True) -> Resolved:
    """Check everything that can be checked before a model is built; raise all problems together.

    Args:
        cfg: the merged run config.
        resume: the ``--resume`` value (``latest``, a path) or None.
        world_size: number of ranks of this launch.
        on_cpu: True on DeepSpeed's CPU accelerator.
        allow_changes: ``--resume-allow-changes``: config changes that make a different run are notes, not
            problems (see :mod:`finetune.lifecycle.resume`).

    Returns:
        :class:`Resolved`.

    Raises:
        ConfigError: one line per problem: unknown recipe, missing model/tokenizer/data files,
            unreadable/empty parquet, missing or non-string text column, a text column without text,
            model/tokenizer/data incompatibilities (:func:`_check_compatibility`: override keys, shape
            overrides of pretrained weights, model type vs recipe, positions, vocabulary, special
            tokens; LoRA and gradient checkpointing, :func:`finetune.engine.lora.check`), bad numbers, DeepSpeed JSON
            problems (unknown keys, batch-size contradiction; DeepSpeed's own parser only when our numbers are
            fine), nothing to resume, a checkpoint whose layout cannot be loaded here
            (:func:`finetune.lifecycle.checkpoint.resume_layout`), refused config changes on resume, an output folder
            that already holds checkpoints, is locked by a live launch, or cannot be written. On another world
            size the accumulation may be changed in ``cfg`` to keep the checkpoint's global batch
            (:func:`finetune.lifecycle.resume.keep_global_batch`).
    """
    marks: list[Path] = []
    problems, number_problems = check_inputs(cfg, marks, weights=weights)
    if not cfg.output_dir and not cfg.output_root:  # listed where it always was: after an unknown recipe
        problems.insert(int(cfg.recipe not in RECIPES), "output_dir: not set (the run folder for logs, checkpoints and the export; or set "
                        "output_root, a parent folder in which every launch gets a new run folder)")
    sp, tp, pp = cfg.parallel.sequence_parallel_size, cfg.parallel.tensor_parallel_size, \
        cfg.parallel.pipeline_parallel_size
    problems += layout.size_problems(world_size, sp, tp, cfg.parallel.expert_parallel_size, pp)
    dp = layout.data_parallel_size(world_size, sp, tp, pp)  # global batch = micro x accumulation x dp
    resume_ckpt, resume_problem, notes = None, None, []
    if cfg.output_dir and resume is not None:
        resume_ckpt, resume_problem, notes = ckpt_utils.resolve_resume(resume, cfg.output_dir)
        old = ckpt_utils.saved_config(resume_ckpt) if resume_ckpt else None
        if old is not None and not number_problems:  # before the DeepSpeed config: it has the accumulation
            first_file = resume_ckpt.parent.parent / ckpt_utils.CONFIG_FILE  # the run's first launch's config
            first = yaml.safe_load(first_file.read_text()) if first_file.is_file() else None
            note = resume_policy.keep_global_batch(old, _old_dp(old, resume_ckpt, world_size), cfg, dp, first)
            notes += [note] if note else []
    ds: dict = {}
    try:
        # DeepSpeed's own parser sees only numbers we accept, so it never repeats one of our problems in its words
        ds, ds_problems = resolve_ds_config(cfg, dp, on_cpu, deepspeed_checks=not number_problems)
        problems += ds_problems
        problems += _check_trackers(ds)
        checks.check_zero_stage(cfg, zero_stage(ds), problems)
        muon.check(cfg, zero_stage(ds), problems)
        problems += quantize.problems(cfg, zero_stage(ds), {
            "parallel.tensor_parallel_size": tp, "parallel.expert_parallel_size": cfg.parallel.expert_parallel_size})
    except ConfigError as e:
        problems += e.problems
    universal = False
    if cfg.output_dir:
        _check_writable("output_dir", cfg.output_dir, problems)
        if resume is not None:
            if resume_problem:
                problems.append(resume_problem)
            elif ds:
                layout_problems, layout_notes, universal = ckpt_utils.resume_layout(resume_ckpt, world_size, ds, pp)
                old = ckpt_utils.saved_config(resume_ckpt)
                saved_optimizer = (old.get("train") or {}).get("optimizer", "adamw") if old else cfg.train.optimizer
                if universal and saved_optimizer == "muon":  # Muon's momentum has no universal form
                    layout_problems, layout_notes, universal = [muon.universal_problem(
                        resume_ckpt, ckpt_utils.marker(resume_ckpt), world_size, zero_stage(ds))], [], False
                problems += layout_problems
                notes += layout_notes
                if universal:
                    ds.setdefault("checkpoint", {})["load_universal"] = True
                if old is not None:
                    refused, changed = resume_policy.review(old, _old_dp(old, resume_ckpt, 1), cfg, dp, allow_changes)
                    problems += refused
                    notes += changed
        elif ckpt_utils.complete_checkpoints(ckpt_utils.checkpoints_dir(cfg.output_dir)):
            problems.append(f"output_dir: '{cfg.output_dir}' already holds checkpoints; pass --resume to continue "
                            f"that run or choose a new output_dir (nothing is overwritten)")
        lock = run_folder.lock_problem(cfg.output_dir)
        if lock:
            problems.append(lock)
    elif cfg.output_root:
        _check_writable("output_root", cfg.output_root, problems)
        if resume is not None:
            problems.append(f"--resume: no run under output_root '{cfg.output_root}' has a complete checkpoint "
                            f"(a checkpoint counts once its '{ckpt_utils.MARKER}' marker exists); drop --resume "
                            f"to start a new run")
    if problems:
        raise ConfigError(problems)
    remember_checked(marks)
    return Resolved(ds=ds, resume_ckpt=resume_ckpt, resume_notes=notes, universal=universal,
                    resume_fallback=ckpt_utils.falls_back(resume))


def _old_dp(old: dict, ckpt: Path, default_world: int) -> int:
    """The data-parallel size a checkpoint was trained with: its world size (``COMPLETE`` marker) split by its
    config's ``parallel`` sizes (:func:`finetune.parallel.layout.data_parallel_size`)."""
    world = ckpt_utils.marker(ckpt).get("world_size", default_world)
    split = old.get("parallel") or {}
    return layout.data_parallel_size(world, int(split.get("sequence_parallel_size", 1)),
                                     int(split.get("tensor_parallel_size", 1)),
                                     int(split.get("pipeline_parallel_size", 1)))


def _unless_about(problems: list[str], load_problems: list[str]) -> list[str]:
    """``problems`` without those about a key that already has a load problem (``key: ...``): a key given with
    the wrong type keeps its default, and a second line about that default would only confuse."""
    keys = {p.split(":", 1)[0] for p in load_problems if re.match(r"^[\w.]+: ", p)}
    return [p for p in problems if p.split(":", 1)[0] not in keys]


def check_launch(config: str, overrides: list[str], resume: str | None, allow_changes: bool,
                 announce: bool = True, weights: bool = True) -> tuple[RunConfig, Resolved, str]:
    """Everything a launch checks before its process group exists, on every rank: load and merge the config
    (defaults < file < overrides), discover rank and world size from the launcher, resolve ``output_root`` and
    an automatic resume, then :func:`validate_run`.

    Args:
        config: the run config file.
        overrides: dotted ``key=value`` overrides.
        resume: the ``--resume`` value or None.
        allow_changes: ``--resume-allow-changes``.
        announce: rank 0 prints the note of an automatic resume (not for ``--check``).
        weights: False when no model will be built (``--check``, ``--print-config``): see :func:`check_inputs`.

    Returns:
        ``(cfg, resolved, launcher)``.

    Raises:
        ConfigError: every problem, the config file's own first.
    """
    load_problems: list[str] = []
    cfg = load_run_config(config, overrides, problems=load_problems)
    launcher = dist_utils.export_rank_env()
    resume, note = run_folder.resolve_output_dir(cfg, resume)
    if note and announce and dist_utils.rank() == 0:
        print(f"finetune: {note}", file=sys.stderr, flush=True)
    try:
        resolved = validate_run(cfg, resume, dist_utils.world_size(), dist_utils.on_cpu(), allow_changes, weights)
    except ConfigError as e:
        raise ConfigError(load_problems + _unless_about(e.problems, load_problems)) from e
    if load_problems:
        raise ConfigError(load_problems)
    return cfg, resolved, launcher
