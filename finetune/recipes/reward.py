"""Reward-model training of any ``AutoModelForSequenceClassification`` (one output) on chosen/rejected pairs.

Data: TRL's preference columns, as ``dpo`` reads them (:mod:`finetune.recipes.common.pairs`): ``data.prompt_column``
(default ``prompt``), ``data.chosen_column``, ``data.rejected_column``, text or conversational, and optionally
``data.margin_column`` (TRL's ``margin``: a number per pair). A row becomes two whole sequences, prompt + chosen
and prompt + rejected, tokenized as ``dpo`` tokenizes them (:class:`finetune.recipes.pairs.PairExamples`: text is
``tokens(prompt) + tokens(response) + [EOS]``; a conversation is rendered with the chat template), with its drops
and counts (identical pairs, pairs identical after truncation, null responses, ``data.truncation``). No label mask:
the model reads its score at the last token that is not ``config.pad_token_id`` (transformers' sequence
classification), so the model config's ``pad_token_id`` must be the tokenizer's pad token (refused otherwise,
before any model).

A micro-batch of ``B`` pairs is ``[2B, seq]``: the chosen sequences, then the rejected ones, right-padded together,
run in one forward (TRL's ``DataCollatorForPreference`` layout); with ``train.reward.share_prefix`` (the default)
:func:`scores` runs each pair as one row whose rejected part reuses the prefix it shares with the chosen sequence
(:func:`shared_rows`: the same scores, the shared tokens computed once). ``labels`` is ``[2B]`` int64: 0 (the index
of the one output, ``reward``) on every sequence, -100 on eval filler rows, so they mark the pairs
``count_targets`` counts; ``margin`` is ``[B]`` float32 when ``data.margin_column`` is set.

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
chosen and rejected); and ``shared_tokens``, the share of the pairs' tokens computed once for both sequences.
Dropout is off (TRL's ``disable_dropout`` default). The model config gets ``num_labels: 1``, ``id2label {0:
"reward"}`` and ``problem_type: regression``, so ``pipeline("text-classification")`` on the export returns the raw
score (no sigmoid).
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

from finetune.config import DataConfig, DpoConfig, RewardConfig, RunConfig
from finetune.data.batch import LossOutput, model_inputs
from finetune.data.dataset import file_schemas
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common import pairs
from finetune.recipes.common.masks import block_mask, sharing_problem

MODEL_CLASS = AutoModelForSequenceClassification
MARGIN = "margin"
"""Tokenized column and batch key of the pairs' margins (float32 ``[B]`` in a batch)."""
LABEL = "reward"
"""The model's one label (``id2label``): what ``pipeline("text-classification")`` names the score."""


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads: prompt, chosen, rejected (and the margin column when set)."""
    return pairs.columns(data_cfg) + ([data_cfg.margin_column] if data_cfg.margin_column else [])


def cache_key(data_cfg: DataConfig) -> dict:
    """``dpo``'s settings (truncation, chat template); the margin column is one of :func:`columns`."""
    return pairs.cache_key(data_cfg)


def prepare_tokenizer(tokenizer):
    """``dpo``'s (``sft``'s): EOS as the pad token when there is none, right padding.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """
    return pairs.prepare_tokenizer(tokenizer)


def prepare_model_config(model_config, data_cfg: DataConfig):
    """One output (``num_labels: 1``, label ``reward``, ``problem_type: regression``: the pipeline returns the raw
    score) and dropout off (``dpo``'s: every ``*dropout``/``*pdrop`` probability set to 0)."""
    model_config = pairs.prepare_model_config(model_config, data_cfg)
    model_config.num_labels = 1
    model_config.id2label = {0: LABEL}
    model_config.label2id = {LABEL: 0}
    model_config.problem_type = "regression"
    return model_config


class RewardPairs(pairs.PairExamples):
    """Batched map function: rows -> tokenized pairs (``dpo``'s :class:`~finetune.recipes.pairs.PairExamples`, row by
    row, so that each kept pair keeps its margin); counts what it drops.

    Output columns: ``input_ids``, ``attention_mask`` (the prompt + chosen sequence), ``rejected_input_ids``, and
    ``margin`` (float) when ``data.margin_column`` is set. A row with a null margin is dropped and counted
    (refused before training by :func:`check_data`).
    """

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        names = pairs.columns(d)
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


def shared_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int) -> dict:
    """The pairs of a ``[2B, T]`` micro-batch as ``B`` shared-prefix rows (Wang et al. 2024, "Accelerating Direct
    Preference Optimization with Prefix Sharing", arXiv:2410.20305, for the pairwise reward loss).

    Row ``i`` is chosen sequence ``i`` (``l_c`` tokens) followed by the tokens of rejected sequence ``i`` after the
    longest token prefix the two share (``k`` tokens: the prompt at least, often more); those rejected tokens take
    the positions they have in their own sequence (``k, k + 1, ...``) and attend to the shared prefix and to each
    other, never to the chosen tokens after the prefix. Under causal attention the prefix's hidden states are the
    same in both sequences, so every score equals the one of the separate rows (up to the order of float sums),
    and the prefix is computed once: a row has ``l_c + l_r - k`` positions instead of two rows of ``max(l_c, l_r)``.

    Args:
        input_ids: ``[2B, T]`` int64, :class:`RewardCollator`'s layout (the chosen sequences, then the rejected
            ones, right-padded).
        attention_mask: ``[2B, T]`` int64, 1 on real tokens.
        pad_token_id: the model config's pad token: a score is read at the sequence's last token that is not it,
            the position transformers' sequence classification reads.

    Returns:
        ``input_ids`` ``[B, W]`` int64 (W the longest row, right-padded with ``pad_token_id``), ``position_ids``
        ``[B, W]`` int64, ``allowed`` ``[B, 1, W, W]`` bool (query ``q`` may attend key ``j``), ``chosen_at`` and
        ``rejected_at`` ``[B]`` int64 (the row positions whose outputs are the two scores) and ``shared`` ``[B]``
        int64 (``k``).
    """
    b, t = input_ids.shape[0] // 2, input_ids.shape[1]
    c, r = input_ids[:b], input_ids[b:]
    lc, lr = attention_mask[:b].sum(1), attention_mask[b:].sum(1)
    along = torch.arange(t, device=input_ids.device)
    same = (c == r) & (along < torch.minimum(lc, lr)[:, None])
    k = same.long().cumprod(1).sum(1)
    n = lc + lr - k
    w = int(n.max())
    j = torch.arange(w, device=input_ids.device).expand(b, w)
    in_chosen = j < lc[:, None]
    own = j - lc[:, None] + k[:, None]  # a rejected token's index in its own sequence
    ids = torch.where(in_chosen, c.gather(1, j.clamp(max=t - 1)), r.gather(1, own.clamp(0, t - 1)))
    ids = torch.where(j < n[:, None], ids, torch.full_like(ids, pad_token_id))
    position_ids = torch.where(in_chosen, j, own)
    q, key = j[:, :, None], j[:, None, :]
    skipped = (q >= lc[:, None, None]) & (key >= k[:, None, None]) & (key < lc[:, None, None])
    allowed = ((key <= q) & ~skipped)[:, None]
    last_c = (along * (c != pad_token_id)).argmax(1)  # transformers' rule: the last token that is not the pad token
    last_r = (along * (r != pad_token_id)).argmax(1)
    return {"input_ids": ids, "position_ids": position_ids, "allowed": allowed, "chosen_at": last_c,
            "rejected_at": torch.where(last_r >= k, lc + last_r - k, last_r), "shared": k}


def _score_head(module):
    """The decoder classifier's ``score`` head (transformers names it so on every decoder-only model; the shallowest
    module of that name, a peft wrapper of it included), or None (encoders: ``classifier``)."""
    found = [(name.count("."), m) for name, m in module.named_modules() if name.rsplit(".", 1)[-1] == "score"]
    return min(found, key=lambda x: x[0])[1] if found else None


_ANNOUNCED: set = set()


def _announce(shared: bool, asked: bool, kernel: str | None, problem: str | None = None) -> None:
    """Log once per process (rank 0) whether the pairs run as shared-prefix rows, and why not when asked for."""
    key = (shared, asked, kernel, problem)
    if key in _ANNOUNCED or not dist_utils.is_main():
        return
    _ANNOUNCED.add(key)
    if shared:
        logger.info(f"reward: prefix sharing on ({kernel}): each pair runs as one row, the prefix its sequences "
                    f"share computed once (train/shared_tokens)")
    elif asked and kernel is not None:
        why = problem or "the model is no decoder classifier with a score head"
        logger.info(f"reward: prefix sharing off: {why}; the two sequences run as separate rows")


def scores(model, batch: dict, share_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2B]`` float32: the model's one output per sequence (chosen, then rejected), read at the last token that is
    not ``config.pad_token_id`` (transformers' sequence classification), and ``[B]`` int64: the tokens of each pair
    computed once for both sequences.

    With ``share_prefix``, a decoder classifier (a ``score`` head) under an attention of :data:`SHARING_KERNELS`
    runs :func:`shared_rows` (the head's per-position outputs are read where the sequences end); otherwise the
    ``[2B, T]`` batch runs as it is and nothing is shared.
    """
    module = getattr(model, "module", model)  # the DeepSpeed engine's model
    config = getattr(module, "config", None)
    problem = sharing_problem(module)
    head = _score_head(module) if share_prefix and problem is None else None
    b = batch["input_ids"].shape[0] // 2
    _announce(head is not None, share_prefix, getattr(config, "_attn_implementation", None), problem)
    if head is None:
        return model(**model_inputs(batch)).logits.float()[:, 0], torch.zeros(b, dtype=torch.long)
    rows = shared_rows(batch["input_ids"], batch["attention_mask"], config.get_text_config().pad_token_id)
    mask = block_mask(module, rows["allowed"], rows["position_ids"])
    out = {}
    handle = head.register_forward_hook(lambda _m, _i, o: out.__setitem__("logits", o))
    try:
        model(input_ids=rows["input_ids"], attention_mask=mask, position_ids=rows["position_ids"])
    finally:
        handle.remove()
    logits, at = out["logits"], torch.arange(b, device=rows["input_ids"].device)
    r = torch.cat([logits[at, rows["chosen_at"], 0], logits[at, rows["rejected_at"], 0]]).float()
    return r, rows["shared"]


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
    ``accuracy``, ``margin`` (per pair) and ``mean_reward`` (per score: twice the pairs); and ``shared_tokens`` (the
    prefix tokens computed once, over the pairs' tokens).

    Args:
        model: the engine (or a transformers sequence classifier with one output).
        batch: :class:`RewardCollator`'s batch on the model's device.
        metrics: accepted for the contract (the metrics are always returned).
        settings: ``train.reward`` (bound by ``configure``; the defaults when None).

    Returns:
        :class:`~finetune.data.batch.LossOutput`: ``loss_sum`` 0-dim float32 over pairs, ``targets`` the pair count.
    """
    s = settings or RewardConfig()
    r, shared = scores(model, batch, s.share_prefix)
    b = r.shape[0] // 2
    losses = pair_losses(r[:b], r[b:], batch.get(MARGIN), s.center_rewards_coefficient)
    valid = _valid_pairs(batch)
    n_pairs = valid.sum().to(losses.dtype)
    rc, rr = r[:b].detach(), r[b:].detach()
    zero = torch.zeros_like(rc)
    tokens = batch["attention_mask"].sum(1)
    sums = {"accuracy": ((rc > rr).to(rc.dtype), n_pairs), "margin": (rc - rr, n_pairs),
            "mean_reward": (rc + rr, 2 * n_pairs),
            "shared_tokens": (shared.to(rc), torch.where(valid, tokens[:b] + tokens[b:], 0).sum().to(rc))}
    return LossOutput(torch.where(valid, losses, torch.zeros_like(losses)).sum(), count_targets(batch),
                      metrics={k: (torch.where(valid, v, zero).sum(), n) for k, (v, n) in sums.items()})


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with ``train.reward`` bound into ``forward``."""
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=cfg.train.reward))


def _numeric(typ) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def check_data(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the reward settings and data before any model is built; append one line per problem.

    The pairs are checked as ``dpo`` checks them (:func:`finetune.recipes.pairs.check_pairs`: missing columns, null or
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
    pairs.check_pairs(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dpo=DpoConfig())),
                    train_files, validation_files, found)
    problems += [p.replace("; dpo reads", "; reward reads") for p in found]
    unread = []
    for key, f, schema in file_schemas(train_files, validation_files):
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
    """``finetune doctor``'s rows: ``dpo``'s (:func:`finetune.recipes.pairs.doctor_rows`, the same tokenization), the
    share of pairs per split dropped because chosen and rejected are identical after truncation."""
    return [("reward", status, text) for _, status, text in pairs.doctor_rows(cfg)]


RECIPE = Recipe(name="reward", model_class=MODEL_CLASS,
                capabilities=Capabilities(reports_perplexity=False, sequences_per_row=2, one_target_per_row=True,
                                          disables_dropout=True,
                                          eval_metrics=("accuracy", "margin", "mean_reward"), checks_columns=True,
                                          counts_rows=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, columns=columns,
                cache_key=cache_key, check_data=check_data, check_tokenizer=check_tokenizer,
                prepare_model_config=prepare_model_config, doctor_rows=doctor_rows)
