"""Task recipes: the protocol every recipe fills in, and the table of recipes by name.

A recipe is a small module (``finetune/recipes/<name>.py``) that ends with ``RECIPE = Recipe(...)``: the hooks
the shared loop (:mod:`finetune.training.trainer`), the data pipeline (:mod:`finetune.data.dataset`), the engine set-up, the
pre-flight checks and the planner call. Every hook and its default are the fields of :class:`Recipe`, so no
caller probes a recipe for what it has (in the spirit of torchtune's ``recipe_interfaces``: a documented set of
functions, no base-class hierarchy). A recipe registers by name in :data:`RECIPES`. A change of the protocol
changes every recipe in the same commit.

For ``seq_cls`` the "targets" below are examples: ``labels`` is ``[micro_batch]`` (-100 on eval filler rows) and
``count_targets`` counts examples, so token weighting is example weighting.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from finetune.errors import ConfigError

if TYPE_CHECKING:  # torch and transformers are not imported by the config checks that read RECIPES
    import torch

    from finetune.data.batch import LossOutput
    from finetune.config import DataConfig, RunConfig

RECIPES: dict[str, str] = {
    "bert_mlm": "finetune.recipes.bert_mlm",
    "dpo": "finetune.recipes.dpo",
    "gpt_clm": "finetune.recipes.gpt_clm",
    "seq_cls": "finetune.recipes.seq_cls",
    "sft": "finetune.recipes.sft",
}
"""Recipe name (the run config's ``recipe:``) -> the module that defines its ``RECIPE``."""


def text_column(data_cfg: DataConfig) -> list[str]:
    """Default ``columns``: ``[data.text_column]``."""
    return [data_cfg.text_column]


def no_settings(data_cfg: DataConfig) -> dict:
    """Default ``cache_key``: no settings besides files, columns, tokenizer and ``data.max_seq_len``."""
    return {}


def no_problems(*args: Any) -> None:
    """Default of the ``check_*`` hooks: nothing to add."""


def unchanged(model_config, data_cfg: DataConfig):
    """Default ``prepare_model_config``: the config as it is."""
    return model_config


def as_is(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """Default ``configure``: the recipe reads no run settings besides ``data``."""
    return recipe


def no_pass(engine, data, cfg: RunConfig):
    """Default ``before_training``: the data as it is, no pass over it."""
    return data


def no_generation(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """Default ``generation_pairs``: the recipe does not generate text (no prompts)."""
    return []


def every_target(data_cfg: DataConfig) -> float:
    """Default ``target_fraction``: every position is a target."""
    return 1.0


@dataclass(frozen=True)
class Recipe:
    """The hooks of one task. Required first, then the optional ones with their defaults."""

    name: str
    """The name in :data:`RECIPES` (part of the tokenized-cache key)."""
    model_class: type
    """The transformers auto class (``AutoModelForMaskedLM``, ``AutoModelForCausalLM``, ...)."""
    prepare_tokenizer: Callable
    """``(tokenizer) -> tokenizer``: fix up special tokens (GPT-2's missing pad token).

    Raises ``ConfigError`` when the tokenizer cannot serve the task."""
    tokenize_function: Callable
    """``(tokenizer, data_cfg) -> fn`` with ``fn(batch: dict[str, list]) -> dict[str, list]`` for
    ``datasets.Dataset.map(batched=True)``; reads :attr:`columns`, may return fewer or more rows than it got (drops
    empty texts, packs blocks)."""
    make_collator: Callable
    """``(tokenizer, data_cfg) -> fn`` with ``fn(rows: list[dict]) -> dict[str, Tensor]``: a batch as
    :mod:`finetune.data.batch` describes it, padded per batch. Random choices (MLM masks) must not use the global RNG:
    a collator with ``fn.row_seeded = True`` gets an int ``"_seed"`` in every row
    (``finetune.data.dataset.row_seed(train.seed, epoch, row index)``; epoch 0 for evaluation) and draws that row's choices
    from a generator seeded with it, so batches depend on neither ranks, nor micro-batch split, nor workers."""
    forward: Callable[..., LossOutput]
    """``(model, batch, metrics=False) -> LossOutput``: the loss of one micro-batch, "batch -> loss sum".

    ``batch`` is on the model's device, ``labels`` included; the recipe calls ``model(**model_inputs(batch))``
    itself (``model``: the DeepSpeed engine, or a plain/peft-wrapped transformers model) and never passes
    ``labels`` (``BertForMaskedLM`` ignores ``num_items_in_batch``). It returns the loss **summed** over the
    positions :attr:`count_targets` counts (0-dim float32, fp32 logits); the loop divides. The LM recipes run the
    head and the cross-entropy only at target positions, in chunks (:mod:`finetune.recipes.lm_loss`).
    ``metrics=True`` (evaluation, under ``torch.no_grad``) also fills ``LossOutput.metrics`` (and ``counts``); metrics
    a recipe returns in training too (``dpo``'s rewards; the same names at every call) are logged as
    ``train/<name>``.
    Outside this call the model is unchanged (the export check compares full logits)."""
    count_targets: Callable[[dict], torch.Tensor]
    """``(batch) -> 0-dim int64``: positions of the collated micro-batch that contribute to the loss (the
    token-weighting denominator; from its ``labels``, or ``shift_labels`` in a sequence-parallel slice). The loop
    calls it on every micro-batch of a step before any of them runs; it equals ``LossOutput.targets``."""

    configure: Callable[[Recipe, RunConfig], Recipe] = as_is
    """``(recipe, cfg) -> recipe``: the recipe with the run settings its hooks read bound in (``dpo``: ``train.dpo``
    into ``forward``); :func:`recipe_for` applies it, and every caller that runs ``forward`` gets its recipe there."""
    before_training: Callable[[Any, Any, RunConfig], Any] = no_pass
    """``(engine, data, cfg) -> data``: a pass over the data with the model's initial weights, after the engine is
    built and before a checkpoint is restored; returns the :class:`finetune.data.dataset.TrainData` to train on (``dpo``:
    the reference log-probabilities of every pair, cached, as a column of both splits). All ranks call it."""
    columns: Callable[[DataConfig], list[str]] = text_column
    """``(data_cfg) -> list[str]``: parquet columns the tokenize function reads; part of the tokenized-cache key,
    checked by ``finetune doctor`` and for valid UTF-8 before any model is built."""
    cache_key: Callable[[DataConfig], dict] = no_settings
    """``(data_cfg) -> dict``: more settings that decide the tokenized rows (``sft``: data form, truncation,
    packing, chat template text; ``gpt_clm``: packing); part of the tokenized-cache key."""
    checks_columns: bool = False
    """True when :attr:`check_data` checks every column the recipe reads (``data.text_column`` is then not
    checked by the generic parquet check)."""
    counts_rows: bool = False
    """True when the tokenize function gets every row (``finetune.data.dataset`` drops no empty texts for it), skips and
    counts bad rows itself, and has ``reset()`` and ``summary() -> str`` (logged once per split)."""
    check_data: Callable[[RunConfig, list[str], list[str], list[str]], None] = no_problems
    """``(cfg, train_files, validation_files, problems)``: checks of the data files before any model is built;
    appends one line per problem (``seq_cls``: label columns; ``sft``: columns and chat template)."""
    check_tokenizer: Callable[[Any, RunConfig, list[str]], None] = no_problems
    """``(prepared tokenizer, cfg, problems)``: what the task needs of the tokenizer beyond
    :attr:`prepare_tokenizer` (``gpt_clm``: an EOS token to put between packed texts)."""
    prepare_model_config: Callable = unchanged
    """``(model_config, data_cfg) -> model_config``: adjust the transformers config before the model is built
    and saved to the run folder (``seq_cls``: ``num_labels``, ``id2label``, ``label2id`` from the labels)."""
    eval_report: Callable | None = None
    """``(counts, model_config) -> (metrics, artefacts)``: metrics that are not ratios of sums (F1) from
    ``LossOutput.counts`` summed over eval batches and ranks; artefacts (name -> JSON-able dict) go to
    ``<run>/eval/step<N>_<name>.json`` and, with ``labels`` and ``matrix``, to TensorBoard as an image. Required
    when ``forward`` returns ``counts``."""
    eval_metrics: tuple[str, ...] = ()
    """Names of the metrics ``forward(..., metrics=True)`` and :attr:`eval_report` add to the loss (logged as
    ``eval/<name>``; ``seq_cls``'s ``f1`` for two classes only): ``--check`` refuses a ``train.keep_best`` or
    ``train.early_stopping`` metric no evaluation reports, before any training."""
    reports_perplexity: bool = True
    """Evaluation also reports ``eval/perplexity`` = exp(``eval/loss``) (false where the loss is no token
    cross-entropy: ``dpo``)."""
    generates_text: bool = False
    """True for causal LMs: the run can end with a sample of ``train.sample_prompt`` (:mod:`finetune.training.generation`)."""
    generation_pairs: Callable = no_generation
    """``(tokenizer, rows, data_cfg) -> [(prompt token ids, reference text)]``: what ``train.eval_generate`` asks the
    model to continue and the answer it is scored against, from raw validation rows (:attr:`columns`); rows
    without a prompt or a reference are left out. Default: none (the recipe does not generate)."""
    target_fraction: Callable[[DataConfig], float] = every_target
    """``(data_cfg) -> float``: share of the positions that are loss targets, for the planner's logits memory
    (``bert_mlm``: ``data.mlm_probability``)."""
    sequences_per_row: int = 1
    """Sequences the model runs per data row (``dpo``: chosen and rejected), for the planner's activations."""
    targets_per_row: bool = False
    """True when a row has one target (sequence classification: the planner counts no per-token logits)."""
    sequence_parallel: bool = False
    """True when ``forward`` and ``count_targets`` take sequence-parallel slices (:mod:`finetune.parallel.layout`:
    ``shift_labels`` instead of ``labels``, ``position_ids``, no ``attention_mask``) and their sums over the SP
    group equal those of the whole batch: the causal LMs ``gpt_clm`` and ``sft``."""
    tensor_parallel: bool = False
    """True when the recipe is tested under DeepSpeed's AutoTP (its head loss runs on the gathered lm_head output):
    ``gpt_clm`` and ``sft``."""


def get_recipe(name: str) -> Recipe:
    """The :class:`Recipe` registered as ``name`` (its module is imported on first use).

    Raises:
        KeyError: ``name`` is not in :data:`RECIPES`.
    """
    if name not in RECIPES:
        raise KeyError(f"unknown recipe '{name}' (choose one of: {', '.join(RECIPES)})")
    return importlib.import_module(RECIPES[name]).RECIPE


def recipe_for(cfg: RunConfig) -> Recipe:
    """The recipe ``cfg.recipe`` configured for this run (its ``configure`` hook): what the loop runs.

    Raises:
        KeyError: the recipe is not in :data:`RECIPES`.
    """
    recipe = get_recipe(cfg.recipe)
    return recipe.configure(recipe, cfg)


def pad_with_eos(tokenizer, recipe: str):
    """Shared ``prepare_tokenizer`` step: use the EOS token as the pad token when there is none (GPT-2 has none).

    Raises:
        ConfigError: the tokenizer has neither a pad nor an EOS token.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"model.tokenizer_path: tokenizer '{tokenizer.name_or_path}' has no pad and no EOS "
                              f"token; {recipe} needs one of them to pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
