"""Reward-model training of any ``AutoModelForSequenceClassification`` (one output) on chosen/rejected pairs.

Data: TRL's preference columns, as ``dpo`` reads them (:mod:`finetune.recipes.dpo`): ``data.prompt_column``
(default ``prompt``), ``data.chosen_column``, ``data.rejected_column``, text or conversational, and optionally
``data.margin_column`` (TRL's ``margin``: a number per pair). A row becomes two whole sequences, prompt + chosen
and prompt + rejected, tokenized as ``dpo`` tokenizes them (:class:`finetune.recipes.dpo.PairExamples`: text is
``tokens(prompt) + tokens(response) + [EOS]``; a conversation is rendered with the chat template), with its drops
and counts (identical pairs, pairs identical after truncation, null responses, ``data.truncation``). No label mask:
the model reads its score at the last token that is not ``config.pad_token_id`` (transformers' sequence
classification), so the model config's ``pad_token_id`` must be the tokenizer's pad token (refused otherwise,
before any model).

A micro-batch of ``B`` pairs is ``[2B, seq]``: the chosen sequences, then the rejected ones, right-padded together,
run in one forward (TRL's ``DataCollatorForPreference`` layout). ``labels`` is ``[2B]`` int64: 0 (the index of the
one output, ``reward``) on every sequence, -100 on eval filler rows, so they mark the pairs ``count_targets``
counts; ``margin`` is ``[B]`` float32 when ``data.margin_column`` is set.

Loss of a pair (TRL 1.16 ``RewardTrainer.compute_loss``; Ouyang et al. 2022 eq. 1 with a margin as Touvron et al.
2023 eq. 2; the centring term of Eisenstein et al. 2023 eq. 2), ``r`` the model's score, ``m`` the margin (0 without
a margin column), ``c`` ``train.reward.center_rewards_coefficient``::

    loss = -log sigma(r_chosen - r_rejected - m) + c * (r_chosen + r_rejected)^2

``count_targets`` counts pairs and ``forward`` returns the loss summed over pairs, so the loop's token weighting is
pair weighting: the step's loss is the exact mean over the pairs of the global batch, whatever the ranks and the
accumulation (TRL averages per micro-batch and process, then over them: the same only when every micro-batch has as
many pairs).

Metrics (TRL's names), sums over pairs with their counts, logged for train and eval: ``accuracy`` (share of pairs
with ``r_chosen > r_rejected``), ``margin`` (mean of ``r_chosen - r_rejected``), ``mean_reward`` (mean of all scores,
chosen and rejected). Dropout is off (TRL's ``disable_dropout`` default). The model config gets ``num_labels: 1``,
``id2label {0: "reward"}`` and ``problem_type: regression``, so ``pipeline("text-classification")`` on the export
returns the raw score (no sigmoid).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification

from finetune.config import DataConfig, RewardConfig, RunConfig
from finetune.data.batch import LossOutput, model_inputs
from finetune.logs import logger
from finetune.recipes import Capabilities, Recipe, dpo

MODEL_CLASS = AutoModelForSequenceClassification
MARGIN = "margin"
"""Tokenized column and batch key of the pairs' margins (float32 ``[B]`` in a batch)."""
LABEL = "reward"
"""The model's one label (``id2label``): what ``pipeline("text-classification")`` names the score."""


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads: prompt, chosen, rejected (and the margin column when set)."""
    return dpo.columns(data_cfg) + ([data_cfg.margin_column] if data_cfg.margin_column else [])


def cache_key(data_cfg: DataConfig) -> dict:
    """``dpo``'s settings (truncation, chat template); the margin column is one of :func:`columns`."""
    return dpo.cache_key(data_cfg)


def prepare_tokenizer(tokenizer):
    """``dpo``'s (``sft``'s): EOS as the pad token when there is none, right padding.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """
    return dpo.prepare_tokenizer(tokenizer)


def prepare_model_config(model_config, data_cfg: DataConfig):
    """One output (``num_labels: 1``, label ``reward``, ``problem_type: regression``: the pipeline returns the raw
    score) and dropout off (``dpo``'s: every ``*dropout``/``*pdrop`` probability set to 0)."""
    model_config = dpo.prepare_model_config(model_config, data_cfg)
    model_config.num_labels = 1
    model_config.id2label = {0: LABEL}
    model_config.label2id = {LABEL: 0}
    model_config.problem_type = "regression"
    return model_config


class RewardPairs(dpo.PairExamples):
    """Batched map function: rows -> tokenized pairs (``dpo``'s :class:`~finetune.recipes.dpo.PairExamples`, row by
    row, so that each kept pair keeps its margin); counts what it drops.

    Output columns: ``input_ids``, ``attention_mask`` (the prompt + chosen sequence), ``rejected_input_ids``, and
    ``margin`` (float) when ``data.margin_column`` is set. A row with a null margin is dropped and counted
    (refused before training by :func:`check_data`).
    """

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        names = dpo.columns(d)
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "rejected_input_ids": []}
        if d.margin_column:
            out[MARGIN] = []
        for i in range(len(batch[names[0]])):
            margin = batch[d.margin_column][i] if d.margin_column else 0.0
            if margin is None or (isinstance(margin, float) and not math.isfinite(margin)):
                c["rows"] += 1
                c["no_margin"] += 1
                continue
            one = super().__call__({name: [batch[name][i]] for name in names})
            if not one["input_ids"]:
                continue
            out["input_ids"].append(one["input_ids"][0])
            out["attention_mask"].append(one["attention_mask"][0])
            out["rejected_input_ids"].append(one["rejected_input_ids"][0])
            if d.margin_column:
                out[MARGIN].append(float(margin))
        return out

    def summary(self) -> str:
        """One line: rows read, pairs kept, what was dropped or truncated and why."""
        text = "reward" + super().summary().removeprefix("dpo")
        if self.counts["no_margin"]:
            text += f"; dropped {self.counts['no_margin']:,} with a null or non-finite margin"
        return text


def tokenize_function(tokenizer, data_cfg: DataConfig) -> RewardPairs:
    """The batched map function (:class:`RewardPairs`)."""
    return RewardPairs(tokenizer, data_cfg)


class RewardCollator:
    """Rows of pairs -> one ``[2B, longest]`` batch: ``input_ids`` and ``attention_mask`` (the B chosen sequences,
    then the B rejected ones, right-padded with the pad token, mask 0, the length rounded up to
    ``pad_to_multiple_of``), ``labels`` ``[2B]`` (0: the one output) and, when the rows have it, ``margin``
    ``[B]`` float32."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 0):
        self.pad, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        seqs = [r["input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        longest = max(len(s) for s in seqs)
        if self.multiple:
            longest = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(seqs), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        labels = torch.zeros(len(seqs), dtype=torch.long)  # no class: marks the real pairs (eval fillers: -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if MARGIN in rows[0]:
            batch[MARGIN] = torch.tensor([r[MARGIN] for r in rows], dtype=torch.float32)
        return batch


def make_collator(tokenizer, data_cfg: DataConfig) -> RewardCollator:
    """:class:`RewardCollator` with the tokenizer's pad token."""
    return RewardCollator(tokenizer.pad_token_id, data_cfg.pad_to_multiple_of)


def _valid_pairs(batch: dict) -> torch.Tensor:
    """``[B]`` bool: the pair is real (eval filler rows have ``labels`` -100)."""
    labels = batch["labels"]
    return labels[: labels.shape[0] // 2] != -100


def count_targets(batch: dict) -> torch.Tensor:
    """Pairs in the batch (eval filler rows not counted); 0-dim int64."""
    return _valid_pairs(batch).sum()


def scores(model, batch: dict) -> torch.Tensor:
    """``[2B]`` float32: the model's one output per sequence (chosen, then rejected), read by transformers at the
    last token that is not ``config.pad_token_id``."""
    return model(**model_inputs(batch)).logits.float()[:, 0]


def pair_losses(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None,
                center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    """``[B]``: ``-log sigma(r_c - r_r - m) + c (r_c + r_r)^2`` (the module docstring's formula)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (r_chosen + r_rejected) ** 2
    return losses


def forward(model, batch: dict, metrics: bool = False, settings: RewardConfig | None = None) -> LossOutput:
    """The reward-model loss of one micro-batch of pairs, summed over its pairs (``count_targets``).

    TRL's metrics are returned at every call (train logs and evaluation) as sums over the pairs with their counts:
    ``accuracy``, ``margin`` (per pair) and ``mean_reward`` (per score: twice the pairs).

    Args:
        model: the engine (or a transformers sequence classifier with one output).
        batch: :class:`RewardCollator`'s batch on the model's device.
        metrics: accepted for the contract (the metrics are always returned).
        settings: ``train.reward`` (bound by ``configure``; the defaults when None).

    Returns:
        :class:`~finetune.data.batch.LossOutput`: ``loss_sum`` 0-dim float32 over pairs, ``targets`` the pair count.
    """
    s = settings or RewardConfig()
    r = scores(model, batch)
    b = r.shape[0] // 2
    losses = pair_losses(r[:b], r[b:], batch.get(MARGIN), s.center_rewards_coefficient)
    valid = _valid_pairs(batch)
    pairs = valid.sum().to(losses.dtype)
    rc, rr = r[:b].detach(), r[b:].detach()
    zero = torch.zeros_like(rc)
    sums = {"accuracy": ((rc > rr).to(rc.dtype), pairs), "margin": (rc - rr, pairs),
            "mean_reward": (rc + rr, 2 * pairs)}
    return LossOutput(torch.where(valid, losses, torch.zeros_like(losses)).sum(), count_targets(batch),
                      metrics={k: (torch.where(valid, v, zero).sum(), n) for k, (v, n) in sums.items()})


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with ``train.reward`` bound into ``forward``."""
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=cfg.train.reward))


def _numeric(typ) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def check_data(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the reward settings and data before any model is built; append one line per problem.

    The pairs are checked as ``dpo`` checks them (:func:`finetune.recipes.dpo.check_pairs`: missing columns, null or
    empty responses, malformed conversations, chat templates that raise, a split with no pair left after
    truncation). Besides: ``train.reward.center_rewards_coefficient`` below 0; ``model.config_overrides.num_labels``
    other than 1; a margin column that is missing, not numeric, or has null or non-finite values (the first such
    row of each file, and their number). A ``margin`` column the run does not read (``data.margin_column`` empty)
    is warned about.
    """
    d = cfg.data
    if cfg.train.reward.center_rewards_coefficient < 0:
        problems.append(f"train.reward.center_rewards_coefficient: {cfg.train.reward.center_rewards_coefficient} "
                        f"must be >= 0 (TRL recommends 0.01; 0: off)")
    labels = cfg.model.config_overrides.get("num_labels")
    if labels is not None and labels != 1:
        problems.append(f"model.config_overrides.num_labels: {labels}, but a reward model has one output; remove it "
                        f"(reward sets num_labels: 1)")
    found: list[str] = []
    dpo.check_pairs(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dpo=dpo.DpoConfig())),
                    train_files, validation_files, found)
    problems += [p.replace("; dpo reads", "; reward reads") for p in found]
    unread = []
    for key, files in (("data.train_files", train_files), ("data.validation_files", validation_files)):
        for f in files:
            try:
                schema = pq.ParquetFile(f).schema_arrow
            except Exception:  # noqa: BLE001  (reported by check_parquet_files)
                continue
            if not d.margin_column:
                if MARGIN in schema.names:
                    unread.append(f)
                continue
            if d.margin_column not in schema.names:
                problems.append(f"{key}: '{f}' has no margin column '{d.margin_column}' (columns: "
                                f"{', '.join(schema.names)}); set data.margin_column='' for no margin")
                continue
            typ = schema.field(d.margin_column).type
            if not _numeric(typ):
                problems.append(f"{key}: '{f}' column '{d.margin_column}' has type {typ}; a margin is a number "
                                f"per pair (int or float)")
                continue
            values = pq.read_table(f, columns=[d.margin_column]).column(d.margin_column).to_pylist()
            bad = [i for i, v in enumerate(values) if v is None or not math.isfinite(v)]
            if bad:
                problems.append(f"{key}: '{f}' row {bad[0]} of column '{d.margin_column}' is {values[bad[0]]!r} "
                                f"({len(bad):,} such rows); every pair needs a finite margin")
    if unread:
        logger.warning(f"reward: {', '.join(repr(f) for f in unread[:3])} {'has' if len(unread) == 1 else 'have'} a "
                       f"'{MARGIN}' column that this run does not read (TRL would); set data.margin_column={MARGIN} "
                       f"to use it")


def check_tokenizer(tokenizer, cfg: RunConfig, problems: list[str]) -> None:
    """The model config's ``pad_token_id`` (with ``model.config_overrides``) must be the tokenizer's pad token: the
    model reads each score at the last token that is not ``pad_token_id``, and batches are padded with the
    tokenizer's. The model config is read from ``model.path`` (problems reading it are reported elsewhere)."""
    overrides = cfg.model.config_overrides
    try:
        pad = overrides.get("pad_token_id", AutoConfig.from_pretrained(cfg.model.path,
                                                                       local_files_only=True).pad_token_id)
    except Exception:  # noqa: BLE001  (reported by the model checks)
        return
    want = tokenizer.pad_token_id
    if pad != want:
        problems.append(f"model.config_overrides.pad_token_id: the model config's pad_token_id is {pad} but the "
                        f"tokenizer pads with {want} ({tokenizer.pad_token!r}); a reward model reads its score at the "
                        f"last token that is not pad_token_id, so set model.config_overrides.pad_token_id={want}")


def doctor_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """``finetune doctor``'s rows: ``dpo``'s (:func:`finetune.recipes.dpo.doctor_rows`, the same tokenization), the
    share of pairs per split dropped because chosen and rejected are identical after truncation."""
    return [("reward", status, text) for _, status, text in dpo.doctor_rows(cfg)]


RECIPE = Recipe(name="reward", model_class=MODEL_CLASS,
                capabilities=Capabilities(reports_perplexity=False, sequences_per_row=2, one_target_per_row=True,
                                          eval_metrics=("accuracy", "margin", "mean_reward"), checks_columns=True,
                                          counts_rows=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, columns=columns,
                cache_key=cache_key, check_data=check_data, check_tokenizer=check_tokenizer,
                prepare_model_config=prepare_model_config, doctor_rows=doctor_rows)
