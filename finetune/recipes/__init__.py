"""Task recipes: the protocol every recipe fills in, what each recipe supports, and the table of recipes by name.

A recipe is a small module (``finetune/recipes/<name>.py``) that ends with ``RECIPE = Recipe(...)``. It holds two
kinds of parts, kept apart as torchtitan's ``TrainSpec`` keeps what builds and runs the model apart from its
``parallelize_fn`` and the job config:

* **hooks**, the fields of :class:`Recipe`: the functions the shared loop (:mod:`finetune.training.trainer`), the
  data pipeline (:mod:`finetune.data.dataset`), the engine set-up, the pre-flight checks and the planner call
  (``forward``, ``count_targets``, ``tokenize_function``, ``make_collator``, ``configure``, ...). Every hook and
  its default are declared here, so no caller probes a recipe for what it has (in the spirit of torchtune's
  ``recipe_interfaces``: a documented set of functions, no base-class hierarchy).
* **capabilities**, one :class:`Capabilities` in ``Recipe.capabilities``: what the recipe supports and is, as
  constants the callers read and never call: the parallel dimensions beyond data parallelism its hooks are correct
  under, text generation, perplexity, the names of its evaluation metrics, how the planner counts a row, and the
  data checks and row filtering its hooks take on themselves. The pre-flight checks ask them
  (``recipe.capabilities.parallel`` goes to :func:`finetune.parallel.checks.check`), never a recipe's name.

Where a part goes: a function, or anything that depends on the run config, is a hook (``target_fraction`` reads
``data.mlm_probability``); what holds whatever the run config says is a capability. Adding a recipe is its module
and its line in :data:`RECIPES`; adding a parallel dimension is its module in :mod:`finetune.parallel` (its
``DIMENSION`` name and checks) and that name in the ``Capabilities.parallel`` of the recipes that support it, with
no new field here. A recipe registers by name in :data:`RECIPES`. A change of the protocol changes every recipe in
the same commit.

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
    "distill": "finetune.recipes.distill",
    "dpo": "finetune.recipes.dpo",
    "embed": "finetune.recipes.embed",
    "gpt_clm": "finetune.recipes.gpt_clm",
    "grpo": "finetune.recipes.grpo",
    "kto": "finetune.recipes.kto",
    "qa": "finetune.recipes.qa",
    "reward": "finetune.recipes.reward",
    "seq_cls": "finetune.recipes.seq_cls",
    "sft": "finetune.recipes.sft",
    "token_cls": "finetune.recipes.token_cls",
    "vlm_sft": "finetune.recipes.vlm_sft",
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


def same_batches(engine, micro: list[dict], cfg: RunConfig) -> list[dict]:
    """Default ``before_step``: the step's micro-batches as they are."""
    return micro


def no_generation(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """Default ``generation_pairs``: the recipe does not generate text (no prompts)."""
    return []


def no_rows(cfg: RunConfig) -> list:
    """Default ``doctor_rows``: nothing to add to ``finetune doctor``'s table."""
    return []


def no_rollout(cfg: RunConfig) -> None:
    """Default ``rollout``: the recipe generates nothing during training."""
    return None


def no_sample(cfg: RunConfig, tokenizer, row: dict) -> None:
    """Default ``sample_rollout``: nothing to show beyond the rows."""
    return None


def once(cfg: RunConfig) -> int:
    """Default ``batch_repeats``: each global batch trains one optimizer step."""
    return 1


def no_state() -> None:
    """Default ``rank_state``: nothing of the recipe's own to checkpoint."""
    return None


def ignore_state(state) -> None:
    """Default ``load_rank_state``: nothing to restore."""


def no_models(cfg: RunConfig) -> list[str]:
    """Default ``frozen_models``: the recipe runs no model besides the trained one."""
    return []


def no_files(cfg: RunConfig, out) -> None:
    """Default ``export_files``: the export is the transformers folder alone."""


def every_target(data_cfg: DataConfig) -> float:
    """Default ``target_fraction``: every position is a target."""
    return 1.0


@dataclass(frozen=True)
class Capabilities:
    """What a recipe supports and is: constants of the recipe, the same for every run config, read by the
    pre-flight checks, the loop, the data pipeline and the planner.

    The defaults describe a recipe that trains under data parallelism only, reports perplexity and no other metric,
    does not generate text, runs one sequence per row with a target at every position it counts, and leaves the
    check of ``data.text_column`` and the dropping of empty texts to the data pipeline.
    """

    parallel: frozenset[str] = frozenset()
    """The parallel dimensions beyond data parallelism that the recipe's hooks are correct under: the ``DIMENSION``
    names of the :mod:`finetune.parallel` modules. ``"sequence"`` (:mod:`finetune.parallel.sequence`): ``forward``
    and ``count_targets`` take sequence-parallel slices (``shift_labels`` instead of ``labels``, ``position_ids``,
    no ``attention_mask``; :mod:`finetune.parallel.sequence`) and their sums over the SP group equal those of the
    whole batch. ``"tensor"`` (:mod:`finetune.parallel.tensor`): tested under DeepSpeed's AutoTP (the head loss runs
    on the gathered lm_head output). ``"expert"`` (:mod:`finetune.parallel.expert`): tested under DeepSpeed's AutoEP
    (the MoE blocks replaced, the losses equal to EP=1). ``"pipeline"`` (:mod:`finetune.parallel.pipeline`): the
    recipe's loss is a token cross-entropy of the model's LM head that the pipeline's last stage computes itself
    (next-token targets for causal LMs, the labels for a masked LM); its ``forward`` is not called in training or
    evaluation. :func:`finetune.parallel.checks.check` takes this set and
    refuses a size above 1 of any dimension not in it. ``gpt_clm``: all four; ``sft``: sequence, tensor and
    pipeline; ``bert_mlm``: pipeline;
    ``dpo``: ``"sequence"`` (a pair's log-probabilities are summed over the SP group,
    :func:`finetune.parallel.sequence.sum_over_sequence`)."""
    generates_text: bool = False
    """The model continues text (causal LMs): the run can end with a sample of ``train.sample_prompt``
    (:mod:`finetune.training.generation`) and ``train.eval_generate`` is allowed (it needs the
    ``generation_pairs`` hook too)."""
    reports_perplexity: bool = True
    """Evaluation also reports ``eval/perplexity`` = exp(``eval/loss``); false where the loss is no token
    cross-entropy (``dpo``)."""
    eval_metrics: tuple[str, ...] = ()
    """Names of the metrics ``forward(..., metrics=True)`` and the ``eval_report`` hook add to the loss (logged as
    ``eval/<name>``; ``seq_cls``'s ``f1`` for two classes only): ``--check`` refuses a ``train.keep_best`` or
    ``train.early_stopping`` metric no evaluation reports, before any training."""
    packs_rows: bool = False
    """With ``data.packing`` on, a row holds several examples whose ``position_ids`` restart (``gpt_clm``, ``sft``):
    under a flash-attention kernel each micro-batch is flattened into one row (:func:`finetune.data.batch.flattens`)
    so that the variable-length kernel keeps them apart."""
    sequences_per_row: int = 1
    """Sequences the model runs per data row (``dpo``, ``reward``: chosen and rejected, 2; ``kto``: the completion
    and its mismatched KL pair, 2), for the planner's activations."""
    sequence_names: tuple[str, ...] = ()
    """What ``finetune inspect`` calls each of a row's sequences (the collator's batch holds the first sequence of
    every row, then the second, ...); empty: ``chosen``, ``rejected`` for two, else ``sequence <j>``."""
    one_target_per_row: bool = False
    """A row has one target, not one per position (sequence classification: ``seq_cls``, ``reward``): the planner
    counts the head's logits per row (``num_labels``), not per token."""
    checks_columns: bool = False
    """The ``check_data`` hook checks every column the recipe reads, so the generic parquet check does not
    require ``data.text_column`` (``sft``, ``dpo``, ``reward``)."""
    label_head: bool = False
    """The head gives the config's ``num_labels`` logits at every position, not the vocabulary's (``token_cls``;
    ``qa``: 2, the start and end logits): the planner counts those per token."""
    mixes_sources: bool = True
    """The recipe trains on a weighted mixture of datasets (``data.sources``); false for ``seq_cls``, whose classes
    come from one dataset's label column."""
    evaluates_exports: bool = True
    """``finetune evaluate`` can score an export of it; false for ``dpo``, whose metrics need the reference model
    an export does not carry (its evaluation is part of the training run)."""
    disables_dropout: bool = False
    """The loss compares the policy's log-probabilities with a deterministic reference or generating policy
    (``dpo``, ``kto``, ``grpo``, ``reward``): after the model is built, LoRA adapters included, every
    ``torch.nn.Dropout`` is turned off (:func:`finetune.engine.lora.disable_dropout`, TRL's
    ``disable_dropout_in_model``); the config's ``*dropout`` fields alone leave peft's ``lora_dropout`` on."""
    noisy_embeddings: bool = False
    """NEFTune (``train.neftune_noise_alpha``, :mod:`finetune.engine.neftune`) applies: a causal LM trained on text
    (``sft``, ``gpt_clm``), where noise on the input embeddings is the paper's regularizer."""
    counts_rows: bool = False
    """The tokenize function gets every row (:mod:`finetune.data.dataset` drops no empty texts for it), skips and
    counts bad rows itself, and has ``reset()`` and ``summary() -> str`` (logged once per split): ``sft``, ``dpo``,
    ``reward``."""

    def __post_init__(self) -> None:
        # a str would pass every "in" test by substring, a set would make the recipe unhashable
        if not isinstance(self.parallel, frozenset) or not all(isinstance(d, str) for d in self.parallel):
            raise TypeError(f"Capabilities.parallel: a frozenset of dimension names, got {self.parallel!r}")
        if self.sequences_per_row < 1:
            raise ValueError(f"Capabilities.sequences_per_row: at least 1, got {self.sequences_per_row}")


@dataclass(frozen=True)
class Recipe:
    """One task: its name, model class and :class:`Capabilities`, then its hooks, the required ones first, then the
    optional ones with their defaults. Every field after ``capabilities`` is a function (or ``None`` where the
    docstring says so)."""

    name: str
    """The name in :data:`RECIPES` (part of the tokenized-cache key)."""
    model_class: type
    """The transformers auto class (``AutoModelForMaskedLM``, ``AutoModelForCausalLM``, ...)."""
    capabilities: Capabilities
    """What the recipe supports and is (parallel dimensions, generation, perplexity, metric names, the planner's
    counting, the data checks it takes on)."""
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
    before_step: Callable[[Any, list[dict], RunConfig], list[dict]] = same_batches
    """``(engine, micro_batches, cfg) -> micro_batches``: called by the loop on every rank with the ``gas``
    collated micro-batches (on the host) of each optimizer step, before the step's collective and any
    ``forward``; returns the batches the step trains on. For values that depend on the whole global batch: ``kto``
    runs its KL pairs with no gradient, all-reduces the KL estimate over the data-parallel ranks and stores it in
    every batch. It may run the model (ZeRO-3: every rank runs the same number of forwards) and collectives.
    Default: the batches as they are."""
    columns: Callable[[DataConfig], list[str]] = text_column
    """``(data_cfg) -> list[str]``: parquet columns the tokenize function reads; part of the tokenized-cache key,
    checked by ``finetune doctor`` and for valid UTF-8 before any model is built."""
    cache_key: Callable[[DataConfig], dict] = no_settings
    """``(data_cfg) -> dict``: more settings that decide the tokenized rows (``sft``: data form, truncation,
    packing, chat template text; ``gpt_clm``: packing); part of the tokenized-cache key."""
    check_data: Callable[[RunConfig, list[str], list[str], list[str]], None] = no_problems
    """``(cfg, train_files, validation_files, problems)``: checks of the data files before any model is built;
    appends one line per problem (``seq_cls``: label columns; ``sft``: columns and chat template). A recipe whose
    check covers every column it reads says so in :attr:`Capabilities.checks_columns`."""
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
    when ``forward`` returns ``counts``; the names of its metrics are in :attr:`Capabilities.eval_metrics`."""
    generation_pairs: Callable = no_generation
    """``(tokenizer, rows, data_cfg) -> [(prompt token ids, reference text)]``: what ``train.eval_generate`` asks the
    model to continue and the answer it is scored against, from raw validation rows (:attr:`columns`); rows
    without a prompt or a reference are left out. Default: none, for recipes without
    :attr:`Capabilities.generates_text`."""
    doctor_rows: Callable[[RunConfig], list] = no_rows
    """``(cfg) -> [(check, status, detail)]``: rows of the recipe's own in ``finetune doctor``'s table (``dpo``: the
    share of pairs identical after truncation). Default: none."""
    rollout: Callable[[RunConfig], tuple[int, int] | None] = no_rollout
    """``(cfg) -> (sequences per row, tokens per sequence)`` that the recipe generates every step and then trains on
    (``grpo``: ``num_generations`` completions of up to ``data.max_seq_len + max_completion_length`` tokens), or
    None (default): for the planner's activations and the generation's KV cache."""
    sample_rollout: Callable[[RunConfig, Any, dict], tuple[list[int], list[bool]] | None] = no_sample
    """``(cfg, tokenizer, tokenized row) -> (token ids, trained per token)`` of a sample of what the recipe
    generates and trains on from the row, for ``finetune inspect`` before any model has generated (``grpo`` with
    tools or an environment: a multi-turn rollout, the model's turns scripted, the tools' tokens not trained), or
    None (default: nothing to show beyond the rows). Raises ``ConfigError`` (one line) for bad input."""
    batch_repeats: Callable[[RunConfig], int] = once
    """``(cfg) -> int``: optimizer steps each global batch of rows trains, one after the other (``grpo``:
    ``train.grpo.num_iterations``, its generation batch reused with importance ratios to the generation-time
    policy). The training sampler yields each step's rows that many times in a row (TRL's ``RepeatSampler``), so an
    epoch counts the repeats. Default: 1."""
    rank_state: Callable[[], Any] = no_state
    """``() -> object | None``: what this rank's ``before_step`` keeps between steps and a resume needs (``grpo``
    with ``num_iterations`` > 1: the generation batch it reuses, with its generation-time log-probabilities),
    saved by ``torch.save`` in every checkpoint as ``recipe_state_rank<r>.pt``. Default: None (nothing)."""
    load_rank_state: Callable[[Any], None] = ignore_state
    """``(state | None) -> None``: give back what :attr:`rank_state` returned when the checkpoint resumed from was
    saved (None: the checkpoint has none for this rank); called on every rank before the first step of a resumed
    launch. The recipe checks it still fits (same step, same rows) before using it."""
    frozen_models: Callable[[RunConfig], list[str]] = no_models
    """``(cfg) -> [model folder]``: models the recipe runs beside the trained one in every step without training
    them (``distill``: the teacher), for the planner, which counts their weights (partitioned under ZeRO-3) and a
    forward without gradients. Default: none."""
    export_files: Callable[[Any, Any], None] = no_files
    """``(run config, export folder: Path) -> None``: write the files beside the transformers model and tokenizer
    that the task's own library loads the export with (``embed``: sentence-transformers' ``modules.json`` and pooling
    config), called by :func:`finetune.lifecycle.export.export_checkpoint` before the folder is complete. Default:
    nothing."""
    target_fraction: Callable[[DataConfig], float] = every_target
    """``(data_cfg) -> float``: share of the positions that are loss targets, for the planner's logits memory
    (``bert_mlm``: ``data.mlm_probability``).

    A hook, not a capability beside :attr:`Capabilities.sequences_per_row`: its value depends on the run config,
    and :class:`Capabilities` holds only what is true of the recipe whatever the run config says (it stays plain
    data: comparable, printable, checked without calling anything)."""


def offering(has: Callable[[Capabilities], bool]) -> list[str]:
    """The names of the recipes whose :class:`Capabilities` satisfy ``has`` (for messages that say which recipes
    do what a run asked for), in :data:`RECIPES` order."""
    return [name for name in RECIPES if has(get_recipe(name).capabilities)]


def said(names: list[str]) -> str:
    """``"a, b and c"``."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


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
