"""Task recipes, selected by ``recipe:`` in the run config.

A recipe is a small module (no base class) that provides exactly these names, the contract the
shared loop in :mod:`finetune.trainer` relies on (in the spirit of torchtune's ``recipe_interfaces``):

``MODEL_CLASS``
    The transformers auto class (``AutoModelForMaskedLM``, ``AutoModelForCausalLM``).
``prepare_tokenizer(tokenizer) -> tokenizer``
    Fix up special tokens (e.g. GPT-2's missing pad token); raise ``ConfigError`` if unusable.
``tokenize_function(tokenizer, data_cfg) -> fn``
    ``fn(batch: dict[str, list]) -> dict[str, list]`` for ``datasets.Dataset.map(batched=True)``; reads
    ``data_cfg.text_column``, may return fewer or more rows than it got (drops empty texts, packs blocks).
``make_collator(tokenizer, data_cfg) -> fn``
    ``fn(rows: list[dict]) -> dict[str, Tensor]`` with ``input_ids``/``attention_mask`` (int64,
    ``[micro_batch, seq]``) and ``labels`` (int64, -100 where no loss), padded per batch; every key but
    ``labels`` and ``num_tokens`` goes to the model (:func:`model_inputs`). Packed ``sft`` batches carry
    ``position_ids`` (restarting per example) instead of an ``attention_mask`` (transformers then builds a
    block-diagonal causal mask), and ``num_tokens`` (0-dim int64: the real, non-pad tokens, which the loop's
    tokens/s and padding ratio count where there is no attention mask). Random choices
    (MLM masks) must not use the global RNG: a collator with ``fn.row_seeded = True`` gets an int
    ``"_seed"`` in every row (``finetune.data.row_seed(train.seed, epoch, row index)``; epoch 0 for
    evaluation) and draws that row's choices from a generator seeded with it, so batches do not depend
    on ranks, micro-batch split or workers; it should fall back to the global RNG for rows without
    ``"_seed"``. Other collators get rows of tokenized columns only.
``forward(model, batch, metrics=False) -> LossOutput``
    The loss of one micro-batch, "batch -> loss sum": ``batch`` is the collated micro-batch on the model's
    device (``labels`` included); the recipe calls ``model(**inputs)`` itself (``model`` is the DeepSpeed
    engine, or a plain/peft-wrapped transformers model) and never passes ``labels`` to it (not every model
    honours ``num_items_in_batch``: ``BertForMaskedLM`` always returns its own mean). It returns a
    :class:`LossOutput`: the loss **summed** over the positions ``count_targets`` counts (0-dim float32,
    fp32 logits); the loop divides it by the token-weighting denominator itself. The recipe decides what
    runs: ``bert_mlm`` and ``gpt_clm`` run the output head and the cross-entropy only at target positions,
    in chunks (:mod:`finetune.recipes.lm_loss`), so full ``[tokens, vocab]`` logits never exist.
    ``metrics=True`` (evaluation, under ``torch.no_grad``) also fills ``LossOutput.metrics`` (and
    ``counts``). Outside this call the model is unchanged (the export check compares full logits).
``count_targets(labels) -> Tensor``
    Number of positions that contribute to the loss (0-dim int64): the token-weighting denominator. The
    loop calls it on the labels of every micro-batch of a step before any of them runs (one all-reduce of
    the step's total); it must equal ``LossOutput.targets``.

For ``seq_cls`` the "positions" above are examples: ``labels`` is ``[micro_batch]`` (-100 on eval filler
rows) and ``count_targets`` counts examples, so token weighting is example weighting.

Optional names (a recipe without them behaves as if they returned nothing; ``bert_mlm`` and ``gpt_clm``
define none):

``columns(data_cfg) -> list[str]``
    Parquet columns the tokenize function reads (default: ``[data_cfg.text_column]``); part of the
    tokenized-cache key.
``cache_key(data_cfg) -> dict``
    More settings that decide the tokenized rows (``sft``: data form, truncation, packing, chat template text);
    part of the tokenized-cache key.
``checks_columns = True``
    ``check_labels`` checks every column the recipe reads, so ``data.text_column`` is not checked (``sft``).
A tokenize function with ``counts_rows = True`` gets every row (``finetune.data`` drops no empty texts for
it), skips and counts bad rows itself, and has ``reset()`` and ``summary() -> str`` (logged once per split).
``check_labels(cfg, train_files, validation_files, problems) -> None``
    Extra checks of the data files before any model is built (``finetune.validate.validate_run``);
    appends one line per problem to ``problems``.
``prepare_model_config(model_config, data_cfg) -> model_config``
    Adjust the transformers config before the model is built and before it is saved to the run folder
    (``seq_cls``: ``num_labels``, ``id2label``, ``label2id`` from the training labels).
``eval_report(counts, model_config) -> (dict, dict)``
    Metrics that are not ratios of sums (F1), from ``LossOutput.counts`` (a fixed-shape float64 tensor
    summed over eval batches and ranks; ``seq_cls``: the confusion matrix): scalar metrics (``name ->
    float``, logged as ``eval/<name>``) and artefacts (``name -> JSON-able dict``; rank 0 writes each to
    ``<run folder>/eval/step<N>_<name>.json``, and one with ``labels`` and ``matrix`` also as an image to
    TensorBoard). Required when ``forward`` returns ``counts``.

The contract changes for every recipe at once (it moved from ``loss_sum(logits, labels)``,
``eval_stats(logits, labels)`` and ``eval_counts(logits, labels)`` to ``forward`` in issue 11).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported by the config checks that read RECIPES
    import torch

RECIPES = ("bert_mlm", "gpt_clm", "seq_cls", "sft")


@dataclass
class LossOutput:
    """What a recipe's ``forward`` returns for one micro-batch."""

    loss_sum: torch.Tensor
    """Loss summed over the micro-batch's targets: 0-dim float32, differentiable (the loop divides it)."""
    targets: torch.Tensor
    """Targets it sums over (0-dim int64), equal to ``count_targets(labels)``."""
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """With ``metrics=True``: extra eval metrics as ``name -> (numerator, denominator)`` sums (0-dim tensors),
    reduced over batches and ranks and logged as ``eval/<name>`` = numerator / denominator."""
    counts: torch.Tensor | None = None
    """With ``metrics=True``, optionally: a fixed-shape float64 tensor summed over eval batches and ranks and
    handed to the recipe's ``eval_report`` (``seq_cls``: the confusion matrix)."""


NOT_MODEL_INPUTS = ("labels", "num_tokens")
"""Keys of a collated batch that never reach the model: the loss targets and the real-token count of packed rows."""


def model_inputs(batch: dict) -> dict:
    """The keys of ``batch`` the model is called with: all but :data:`NOT_MODEL_INPUTS`."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def real_tokens(batch: dict):
    """Real (non-pad) tokens of a collated micro-batch (0-dim int64 tensor, or int): the ``attention_mask`` ones,
    else ``num_tokens`` (packed rows), else every position of ``input_ids``."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if "num_tokens" in batch:
        return batch["num_tokens"]
    return batch["input_ids"].numel()


def get_recipe(name: str) -> ModuleType:
    """Import ``finetune.recipes.<name>``.

    Raises:
        KeyError: ``name`` is not one of :data:`RECIPES`.
    """
    if name not in RECIPES:
        raise KeyError(f"unknown recipe '{name}' (choose one of: {', '.join(RECIPES)})")
    return importlib.import_module(f"finetune.recipes.{name}")


def data_columns(recipe: ModuleType, data_cfg) -> list[str]:
    """Parquet columns the recipe's tokenize function reads: its ``columns(data_cfg)``, else ``[data.text_column]``."""
    return recipe.columns(data_cfg) if hasattr(recipe, "columns") else [data_cfg.text_column]


def pad_with_eos(tokenizer, recipe: str):
    """Shared ``prepare_tokenizer`` step: use the EOS token as the pad token when there is none (GPT-2 has none).

    Raises:
        ConfigError: the tokenizer has neither a pad nor an EOS token.
    """
    from finetune.config import ConfigError

    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"model.tokenizer_path: tokenizer '{tokenizer.name_or_path}' has no pad and no EOS "
                              f"token; {recipe} needs one of them to pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
