"""GRPO: online reinforcement learning of any ``AutoModelForCausalLM`` from rewards of its own completions
(Shao et al. 2024, "DeepSeekMath", sec. 4.1; DAPO, Yu et al. 2025; Dr. GRPO, Liu et al. 2025; GSPO, Zheng et al.
2025; TRL 1.16's ``GRPOTrainer``, whose metric names and defaults this follows).

Data: ``data.prompt_column`` (default ``prompt``: text, used verbatim, or a list of ``{role, content}`` messages
rendered with the chat template and the assistant's turn opened) and ``data.reward_columns`` (default
``[answer]``), which reach the reward functions (:mod:`finetune.recipes.rewards`). A row is one prompt, cut to its
last ``data.max_seq_len`` tokens (``data.truncation: drop`` leaves longer prompts out). A micro-batch of ``B``
prompts trains on ``B x G`` completions (``G`` = ``train.grpo.num_generations``; TRL's
``per_device_train_batch_size`` counts completions instead).

Per optimizer step (:func:`before_step`, every rank, before the step's collective):

1. **Generate** ``G`` completions of each prompt of the step's micro-batches with the engine's model, in one
   ``generate`` call per rank and step (transformers' ``generate``, sampling at ``temperature``/``top_p``/``top_k``,
   at most ``max_completion_length`` tokens; :func:`generate`). Under ZeRO-3 the whole model is gathered once
   per step (``train.grpo.gather_for_generation``, TRL's ``ds3_gather_for_generation``) or, with it off, every rank
   generates in lockstep with ``synced_gpus``. Sampling is seeded from the rows' seeds and the step, not from the
   RNG state, so a resumed run draws the same completions.
2. **Score** them (every reward function on every completion; one failing function on one rank stops every rank
   with one line naming it, :class:`finetune.recipes.rewards.RewardError`), weight and sum
   (``reward_weights``; a completion no function scores is NaN and gets advantage 0).
3. **Advantages**, group-relative: ``A = r - mean(r of the prompt's G completions)``, divided by the group's
   standard deviation (``scale_rewards: group``), the global batch's (``batch``: all ranks and micro-batches), or
   not (``none``), + 1e-4 (TRL's).
4. With ``beta`` > 0 and LoRA, the **reference** per-token log-probabilities (adapters off, no gradient); with
   ``num_iterations`` > 1, the generating policy's (``pi_old``, no gradient).

With ``num_iterations`` = ``k`` (TRL's), each generation batch trains ``k`` optimizer steps in a row: the sampler
repeats each step's prompts ``k`` times, the first step generates, the next ``k - 1`` reuse the batch, which every
checkpoint keeps (:func:`rank_state`), so a resume between them is exact.

The loss (:func:`forward`; ``pi`` at the training temperature, ``pi_old`` the generating policy (``pi`` detached
when ``num_iterations`` is 1), ``rho = pi / pi_old`` per token, or per completion with ``importance_sampling_level:
sequence`` (GSPO: the exponent of the mean log-ratio)): per completion token
``l = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta KL_k3(pi, pi_ref)``, averaged as
``loss_type`` says. The loop divides :func:`forward`'s sum by :func:`count_targets` summed over the global batch,
so each is exact over the whole global batch, whatever the ranks and accumulation:

=========  ==================================================  =========================================
loss_type  loss_sum of a micro-batch                           count_targets (summed over the global batch)
=========  ==================================================  =========================================
dapo       sum of ``l`` over active tokens                     active completion tokens
grpo       sum over completions of (their ``l`` sum / tokens)  completions
dr_grpo    sum of ``l`` over active tokens / max_completion    completions
bnpo       (sum of ``l`` / the micro-batch's active tokens)    completions
           x the micro-batch's completions
=========  ==================================================  =========================================

TRL divides ``dapo`` by the tokens of its whole generation batch too; ``grpo``, ``dr_grpo`` and ``bnpo`` it
normalises per micro-batch and averages over accumulation steps and processes, which equals the table when every
micro-batch holds the same number of completions (here they always do). Active tokens: the completion up to and
including its EOS (``mask_truncated_completions``: none of a completion that never reached EOS).

The sequences the model trains on are ``[left-padded prompt | completion]`` with ``position_ids`` counting real
tokens only, as ``generate`` placed them (TRL passes none, so a left-padded prompt's positions differ between its
generation and its training pass); the head runs on the completion positions only, in chunks
(:func:`completion_logps`). Dropout is off, LoRA's included (``Capabilities.disables_dropout``): ``pi_old`` is ``pi``.

Evaluation (:func:`forward` on a prompt batch): one greedy completion per validation prompt, scored;
``eval/reward`` and ``eval/rewards/<function>/mean`` (``train.keep_best`` can follow ``eval/reward``, mode max);
``eval/loss`` is 0.

Metrics (training, TRL's names): ``reward``, ``reward_std`` (the mean of the groups' standard deviations),
``rewards/<function>/mean``, ``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``
(completions without EOS), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
``entropy`` (mean per active token), ``kl`` (with ``beta`` > 0). A sample of each logged step's completions goes
to ``<run>/completions.jsonl`` (``train.grpo.log_completions``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from finetune import patches
from finetune.config import DataConfig, GrpoConfig, RunConfig
from finetune.data.batch import LossOutput, to_device
from finetune.data.dataset import string_type
from finetune.engine.rollout import HFGenerateRollout, RolloutRequest, SamplingConfig, make_rollout
from finetune.errors import ConfigError, RunFailure
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils
from finetune.recipes import Capabilities, Recipe, dpo, reward, rewards
from finetune.recipes.lm_loss import check_head_output, chunk_tokens, find_head, head_output, logits_transform, unwrap
from finetune.recipes.sft import TemplateCheck, count_summary, message_problem, prompt_ids, template_text, \
    tokenizer_template_problem

MODEL_CLASS = AutoModelForCausalLM
PROMPT_COLUMN = "prompt_raw"
"""Tokenized-row column: the prompt as the data holds it (text or messages), for the reward functions."""
COLUMN_PREFIX = "reward_column:"
"""Tokenized-row columns ``reward_column:<name>``: the ``data.reward_columns`` values."""


def prompt_column(data_cfg: DataConfig) -> str:
    """``data.prompt_column``, or ``prompt`` when it is empty (TRL's name)."""
    return data_cfg.prompt_column or "prompt"


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads: the prompt, then the reward columns."""
    return list(dict.fromkeys([prompt_column(data_cfg), *data_cfg.reward_columns]))


def cache_key(data_cfg: DataConfig) -> dict:
    """The prompt truncation, chat template and reward columns."""
    return {"truncation": data_cfg.truncation, "chat_template": template_text(data_cfg),
            "reward_columns": list(data_cfg.reward_columns), "prompt_cut": "left"}


prepare_tokenizer = dpo.prepare_tokenizer
prepare_model_config = dpo.prepare_model_config


class PromptRows:
    """Batched map function: rows -> tokenized prompts with their reward columns; counts what it drops.

    Output columns: ``input_ids``, ``attention_mask`` (the prompt's tokens: text with the tokenizer's special
    tokens, or messages rendered with the assistant's turn opened; longer than ``data.max_seq_len``: its last
    ``max_seq_len`` tokens, or dropped with ``data.truncation: drop``), :data:`PROMPT_COLUMN` and one
    ``reward_column:<name>`` per reward column. Rows with a null or empty prompt are dropped and counted.

    Raises:
        ConfigError: a conversational prompt is malformed (checked before training by :func:`check_rows`).
    """

    def __init__(self, tokenizer, data_cfg: DataConfig):
        self.tokenizer, self.d = tokenizer, data_cfg
        self.template = template_text(data_cfg) or None
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def encode(self, prompt) -> list[int]:
        """The prompt's token ids (uncut)."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        problem = message_problem(prompt)
        if problem:
            raise ConfigError(f"data.prompt_column: a row's prompt is {problem}")
        if self.template is None:
            from finetune.recipes.sft import chat_template
            self.template = chat_template(self.d, self.tokenizer)
        return prompt_ids(self.tokenizer, list(prompt), self.template)

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        names = columns(d)
        out: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", PROMPT_COLUMN)}
        out.update({COLUMN_PREFIX + n: [] for n in d.reward_columns})
        for i, prompt in enumerate(batch[names[0]]):
            c["rows"] += 1
            if prompt is None or not prompt or (isinstance(prompt, str) and not prompt.strip()):
                c["empty"] += 1
                continue
            ids = self.encode(prompt)
            if len(ids) > d.max_seq_len:
                if d.truncation == "drop":
                    c["too_long"] += 1
                    continue
                c["truncated"] += 1
                ids = ids[-d.max_seq_len:]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out[PROMPT_COLUMN].append(prompt)
            for n in d.reward_columns:
                out[COLUMN_PREFIX + n].append(batch[n][i])
            c["prompts"] += 1
            c["tokens"] += len(ids)
        return out

    def summary(self) -> str:
        """One line: rows read, prompts kept, dropped and cut, mean prompt length."""
        c = self.counts
        text = count_summary("grpo", c, "prompts", [("empty", "with a null or empty prompt")],
                             self.d.max_seq_len, "prompt")
        if c["prompts"]:
            text += f"; {c['tokens'] / c['prompts']:.1f} tokens per prompt (prompts longer than data.max_seq_len " \
                    f"keep their last tokens)"
        return text


def tokenize_function(tokenizer, data_cfg: DataConfig) -> PromptRows:
    """The batched map function (:class:`PromptRows`)."""
    return PromptRows(tokenizer, data_cfg)


class PromptCollator:
    """Rows -> a prompt batch: ``input_ids`` and ``attention_mask`` ``[B, longest]`` int64, **left**-padded (generation
    continues every prompt at the same position); ``labels`` ``[B]`` int64, 0 (-100 on evaluation filler rows);
    ``row_seeds`` ``[B]`` int64 (the rows' ``_seed``: the sampling seed, independent of ranks and split); and, not
    tensors, ``prompts`` (the raw prompts), ``reward_columns`` (name -> ``B`` values) and ``row_index`` (the
    validation rows' indexes, -1 in training)."""

    row_seeded = True

    def __init__(self, pad_token_id: int, data_cfg: DataConfig):
        self.pad, self.names = pad_token_id, list(data_cfg.reward_columns)

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, longest - n:] = torch.tensor(r["input_ids"])
            mask[i, longest - n:] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(len(rows), dtype=torch.long),
                "row_seeds": torch.tensor([int(r.get("_seed", 0)) for r in rows], dtype=torch.long),
                "row_index": [int(r.get("_index", -1)) for r in rows],
                "prompts": [r[PROMPT_COLUMN] for r in rows],
                "reward_columns": {n: [r[COLUMN_PREFIX + n] for r in rows] for n in self.names}}


def make_collator(tokenizer, data_cfg: DataConfig) -> PromptCollator:
    """:class:`PromptCollator` with the tokenizer's pad token."""
    return PromptCollator(tokenizer.pad_token_id, data_cfg)


def count_targets(batch: dict, loss_type: str = "dapo") -> torch.Tensor:
    """What the step's loss is a mean over (the module docstring's table): a training batch's active completion
    tokens (``dapo``) or completions (the others); a prompt batch's (evaluation) real rows."""
    labels = batch["labels"]
    if labels.dim() == 1:
        return (labels != -100).sum()
    if loss_type == "dapo":
        return batch["completion_mask"].sum().long()
    return torch.tensor(labels.shape[0], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Generation and scoring
# ---------------------------------------------------------------------------------------------

@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer
    return prepare_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))


def tokenizer_of(cfg: RunConfig):
    """The run's prepared tokenizer (loaded once per process)."""
    return _tokenizer(cfg.model.tokenizer_path or cfg.model.path)


_LOADED: dict[str, list] = {}


def reward_functions(cfg: RunConfig) -> list[rewards.RewardFunction]:
    """The run's reward functions (:func:`finetune.recipes.rewards.load`), loaded once per process and settings."""
    g = cfg.train.grpo
    key = json.dumps([g.rewards, g.reward_weights, cfg.data.reward_columns, g.answer_pattern, g.format_pattern,
                      g.max_completion_length, g.length_cache], default=str)
    if key not in _LOADED:
        _LOADED[key] = rewards.load(cfg)
    return _LOADED[key]


def _seed(train_seed: int, step: int, row_seeds: torch.Tensor) -> int:
    """A sampling seed from the rows' seeds and the step (the same on resume, whatever the rank)."""
    return (train_seed * 1_000_003 + step * 7919 + int(row_seeds.sum()) * 31 + int(row_seeds[0])) % (2 ** 63 - 1)


def generate(engine, batch: dict, g: GrpoConfig, tokenizer, n: int, sample: bool, seed: int, synced: bool) -> dict:
    """``n`` completions of each prompt of ``batch`` through :class:`finetune.engine.rollout.HFGenerateRollout` (no
    gradient; the caller holds the rollout's :meth:`~finetune.engine.rollout.HFGenerateRollout.weights`).

    Args:
        engine: the engine (or a plain causal LM).
        batch: a prompt batch (:class:`PromptCollator`).
        g: ``train.grpo`` (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``fast_generation``).
        n: completions per prompt.
        sample: sample (else greedy).
        seed: the sampling seed.
        synced: generate layer by layer in lockstep (ZeRO-3 without ``gather_for_generation``).

    Returns:
        ``completion_ids`` ``[B n, C]`` int64 (pad after the EOS), ``completion_mask`` ``[B n, C]`` float32 (1 up to and
        including the first EOS), ``terminated`` ``[B n]`` bool (an EOS was generated), ``lengths`` ``[B n]`` int64.
    """
    rollout = make_rollout(engine, tokenizer, g.generation_backend, gather=not synced, fast=g.fast_generation)
    sampling = SamplingConfig(max_new_tokens=g.max_completion_length, temperature=g.temperature if sample else 0.0,
                              top_p=g.top_p, top_k=g.top_k, n_samples_per_prompt=n)
    out = rollout.generate(RolloutRequest(batch["input_ids"], batch["attention_mask"]), sampling, seed)
    p = int(out.response_start_idx[0]) if len(out.response_start_idx) else batch["input_ids"].shape[1]
    completion, cmask = out.input_ids[:, p:], out.attention_mask[:, p:].float()
    terminated = (completion == tokenizer.eos_token_id).any(1)
    return {"completion_ids": completion, "completion_mask": cmask, "terminated": terminated,
            "lengths": cmask.sum(1).long()}


def _texts(tokenizer, completion: dict) -> tuple[list[str], list[list[int]]]:
    """The completions as text (decoded without their EOS) and as token ids up to and including their EOS (what
    TRL 1.16 passes its reward functions as ``completion_ids``: the completion mask's tokens)."""
    ids = [row[: int(n)].tolist() for row, n in zip(completion["completion_ids"], completion["lengths"])]
    text_ids = [x[:-1] if x and x[-1] == tokenizer.eos_token_id else x for x in ids]
    return tokenizer.batch_decode(text_ids, skip_special_tokens=True), ids


def score_everywhere(functions, prompts, texts, ids, cols) -> list:
    """Score on this rank, then agree with every rank: each rank's table, or the first failure raised on every rank
    as :class:`~finetune.errors.RunFailure` (one line: the function, the rank, what it did), so no rank waits for
    one that failed."""
    try:
        mine, error = rewards.score(functions, prompts, texts, ids, cols), None
    except rewards.RewardError as e:
        mine, error = None, str(e)
    everyone = dist_utils.all_gather_object((error, mine))
    for rank, (err, _) in enumerate(everyone):
        if err is not None:
            raise RunFailure(f"grpo: {err} (rank {rank}); fix the reward function, then --resume from the last "
                             f"checkpoint")
    return [table for _, table in everyone]


def combine(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[N, F]`` rewards (NaN: not scored) -> ``[N]`` weighted sums, NaN where no function scored."""
    total = (table * weights).nansum(1)
    return torch.where(torch.isnan(table).all(1), torch.nan, total)


def _nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (TRL's ``nanstd``); NaN below 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1).clamp(min=1)
    var = torch.where(count > 1, var, torch.nan)
    return var.sqrt().squeeze(dim) if dim is not None else var.sqrt().reshape(())


def advantages(rewards_: torch.Tensor, g: int, scale: str, batch_std: torch.Tensor | None = None) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (TRL 1.16's ``_generate_and_score_completions``).

    Args:
        rewards_: ``[P g]`` float32, a prompt's ``g`` completions consecutive; NaN: unscored.
        g: completions per prompt.
        scale: ``group``, ``batch`` or ``none`` (``train.grpo.scale_rewards``).
        batch_std: the global batch's reward standard deviation (``batch``).

    Returns:
        ``(advantages, group_std)``, each ``[P g]`` float32; unscored completions' advantages are 0.
    """
    grouped = rewards_.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g)
    std = _nanstd(grouped, dim=1).repeat_interleave(g)
    adv = rewards_ - mean
    if scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), std


def join_prompts(micro: list[dict], pad: int) -> dict:
    """The prompts of several prompt batches as one: ``input_ids``, ``attention_mask`` ``[sum B, longest]``
    (left-padded again to the longest prompt) and ``row_seeds``; a prompt's positions do not change (they count its
    real tokens)."""
    width = max(b["input_ids"].shape[1] for b in micro)
    ids = torch.cat([torch.nn.functional.pad(b["input_ids"], (width - b["input_ids"].shape[1], 0), value=pad)
                     for b in micro])
    mask = torch.cat([torch.nn.functional.pad(b["attention_mask"], (width - b["attention_mask"].shape[1], 0))
                      for b in micro])
    return {"input_ids": ids, "attention_mask": mask, "row_seeds": torch.cat([b["row_seeds"] for b in micro])}


def split_completions(whole: dict, sizes: list[int], pad: int) -> list[dict]:
    """:func:`generate`'s output for joined prompts cut back into one per prompt batch (``sizes`` completions each),
    each trimmed to its own longest completion."""
    out, start = [], 0
    for n in sizes:
        part = {k: v[start:start + n] for k, v in whole.items()}
        width = int(part["lengths"].max()) if n else 0
        part["completion_ids"], part["completion_mask"] = part["completion_ids"][:, :width], \
            part["completion_mask"][:, :width]
        out.append(part)
        start += n
    return out


def _rollout(engine, g: GrpoConfig, tokenizer) -> HFGenerateRollout:
    return make_rollout(engine, tokenizer, g.generation_backend, gather=g.gather_for_generation, fast=g.fast_generation)


def _synced(engine, g: GrpoConfig) -> bool:
    stage = getattr(engine, "zero_optimization_stage", None)
    return stage is not None and stage() == 3 and not g.gather_for_generation and dist_utils.world_size() > 1


_REUSED: dict = {}
"""This rank's generation batch while ``num_iterations`` > 1 reuses it: ``step`` (the optimizer steps done when it
was generated), ``rows`` (its prompts' row seeds), ``batches`` (:func:`before_step`'s micro-batches, on the host)."""


def _rows_key(micro: list[dict]) -> list[int]:
    return [int(s) for b in micro for s in b["row_seeds"]]


def rank_state() -> dict | None:
    """The reused generation batch (:data:`_REUSED`) for the checkpoint, or None (``num_iterations`` 1)."""
    return dict(_REUSED) if _REUSED else None


def load_rank_state(state: dict | None) -> None:
    """Take back :func:`rank_state`'s batch from the checkpoint resumed from (:func:`before_step` checks that it is
    the one the next step reuses)."""
    _REUSED.clear()
    _REUSED.update(state or {})


def batch_repeats(cfg: RunConfig) -> int:
    """``train.grpo.num_iterations``: optimizer steps each generation batch trains."""
    return max(cfg.train.grpo.num_iterations, 1)


def before_step(engine, micro: list[dict], cfg: RunConfig) -> list[dict]:
    """Generate, score and compute the advantages of the step's global batch (the module docstring's steps 1-4);
    returns the micro-batches of prompt + completion sequences the step trains on (``input_ids``,
    ``attention_mask``, ``position_ids``, ``labels`` ``[B G, P + C]``; ``completion_mask`` ``[B G, C]``;
    ``prompt_length``; ``advantages``, ``rewards``, ``group_std`` ``[B G]``; ``reward_table`` ``[B G, F]``;
    ``terminated``; ``ref_logps`` ``[B G, C]`` with ``beta`` > 0; ``old_logps`` ``[B G, C]`` with ``num_iterations``
    > 1).

    With ``num_iterations`` = ``k`` > 1 (TRL's), a generation batch trains ``k`` optimizer steps: the sampler gives
    each step's prompts ``k`` times in a row (:func:`batch_repeats`), the first of them generates and stores the
    batch with the policy's log-probabilities at generation (``old_logps``, no gradient, TRL's
    ``old_per_token_logps``), the next ``k - 1`` train on the stored batch (kept in every checkpoint by
    :func:`rank_state`, so a resume between them trains the same batch). When any rank's stored batch is not the one
    of its rows this step (a resume on another layout, a checkpoint missing a rank's state file), every rank
    generates it again from the current weights, with a warning: the ranks agree with one all-reduce, so none runs
    generation's collectives alone.

    Raises:
        RunFailure: a reward function failed on some rank (raised on every rank).
    """
    step, k = int(engine.global_steps), batch_repeats(cfg)
    if k > 1 and step % k:
        mine = _REUSED.get("step") == step - step % k and _REUSED.get("rows") == _rows_key(micro)
        # one decision for every rank (one all-reduce): a rank that generated while the others reused would run
        # the gather and the scoring's collectives alone
        if not dist_utils.any_rank(not mine, engine.device):
            return _REUSED["batches"]
        logger.warning(f"grpo: the generation batch of step {step - step % k + 1} that step {step + 1} reuses "
                       f"(train.grpo.num_iterations={k}) is not at hand for these rows on "
                       f"{'this rank' if not mine else 'another rank'} (resumed on another layout, or a checkpoint "
                       f"without its recipe_state_rank<r>.pt?): every rank generates it again from the current "
                       f"weights, which the original run did not do")
    out = _generate_and_score(engine, micro, cfg, step)
    if k > 1:
        _REUSED.clear()
        _REUSED.update(step=step - step % k, rows=_rows_key(micro), batches=out)
    return out


def _generate_and_score(engine, micro: list[dict], cfg: RunConfig, step: int) -> list[dict]:
    """:func:`before_step`'s generation, scoring, advantages and no-gradient log-probabilities."""
    g, tok = cfg.train.grpo, tokenizer_of(cfg)
    functions = reward_functions(cfg)
    joined = join_prompts(micro, tok.pad_token_id)  # one generate call for all the step's prompts on this rank
    with _rollout(engine, g, tok).weights():  # ZeRO-3: the whole model gathered once for the step's generation
        whole = generate(engine, joined, g, tok, g.num_generations, True,
                         _seed(cfg.train.seed, step, joined["row_seeds"]), _synced(engine, g))
    done = split_completions(whole, [len(b["prompts"]) * g.num_generations for b in micro], tok.pad_token_id)
    texts, ids, prompts, cols = [], [], [], {n: [] for n in cfg.data.reward_columns}
    for b, c in zip(micro, done):
        t, i = _texts(tok, c)
        texts += t
        ids += i
        prompts += [p for p in b["prompts"] for _ in range(g.num_generations)]
        for n in cols:
            cols[n] += [v for v in b["reward_columns"][n] for _ in range(g.num_generations)]
    tables = score_everywhere(functions, prompts, texts, ids, cols)
    weights = torch.tensor([f.weight for f in functions], dtype=torch.float32)
    own = torch.tensor(tables[dist_utils.rank()], dtype=torch.float32).reshape(len(texts), -1)  # [B G, F]
    mine = combine(own, weights)
    batch_std = _nanstd(combine(torch.tensor([r for t in tables for r in t], dtype=torch.float32), weights)) \
        if g.scale_rewards == "batch" else None
    out, start = [], 0
    for b, c in zip(micro, done):
        n = len(c["completion_ids"])
        r = mine[start:start + n]
        adv, std = advantages(r, g.num_generations, g.scale_rewards, batch_std)
        out.append(_sequences(b, c, g, adv, r, std, own[start:start + n]))
        start += n
    if g.beta > 0 or g.num_iterations > 1:
        # the module's mode only: a hybrid engine's eval() would swap in its inference kernels, and these passes
        # must be the training forward's
        module = getattr(engine, "module", engine)
        module.eval()
        with torch.no_grad():
            for b in out:
                on_device = to_device(b, engine.device)
                if g.num_iterations > 1:  # the policy that generated: pi_old of the batch's later steps
                    b["old_logps"] = completion_logps(engine, on_device, g.temperature, g.share_prompt)[0].cpu()
                if g.beta > 0:
                    with dpo.adapters_off(engine):
                        b["ref_logps"] = completion_logps(engine, on_device, g.temperature, g.share_prompt)[0].cpu()
        module.train()
    _log_sample(cfg, step + 1, prompts, texts, mine, torch.cat([b["advantages"] for b in out]), tables,
                functions)
    return out


def _sequences(b: dict, c: dict, g: GrpoConfig, adv, r, std, table) -> dict:
    """A training micro-batch from a prompt batch and its completions."""
    n = g.num_generations
    prompt_ids, prompt_mask = b["input_ids"].repeat_interleave(n, 0), b["attention_mask"].repeat_interleave(n, 0)
    cmask = c["completion_mask"]
    if g.mask_truncated_completions:
        cmask = cmask * c["terminated"][:, None].float()
    ids = torch.cat([prompt_ids, c["completion_ids"]], 1)
    attention = torch.cat([prompt_mask, c["completion_mask"].long()], 1)
    labels = torch.full_like(ids, -100)
    p = prompt_ids.shape[1]
    labels[:, p:] = torch.where(cmask.bool(), c["completion_ids"], -100)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "labels": labels, "completion_mask": cmask, "prompt_length": torch.tensor(p), "advantages": adv,
            "rewards": r, "group_std": std, "reward_table": table, "terminated": c["terminated"],
            "lengths": c["lengths"], "group_size": torch.tensor(n)}


def _log_sample(cfg: RunConfig, step: int, prompts, texts, r, adv, tables, functions) -> None:
    """Rank 0, on logged steps: the first ``log_completions`` completions to ``<run>/completions.jsonl``."""
    k = cfg.train.grpo.log_completions
    if not k or not dist_utils.is_main() or not cfg.output_dir or step % max(cfg.train.log_every, 1):
        return
    with open(Path(cfg.output_dir) / "completions.jsonl", "a") as f:
        for i in range(min(k, len(texts))):
            f.write(json.dumps({"step": step, "prompt": prompts[i], "completion": texts[i],
                                "reward": None if math.isnan(float(r[i])) else float(r[i]),
                                "rewards": {fn.name: (None if math.isnan(v) else v)
                                            for fn, v in zip(functions, tables[0][i])},
                                "advantage": float(adv[i])}, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------

_HEAD_WHY = ("grpo: the LM head runs on the completion positions only and returns their per-token log-probabilities "
             "at the sampling temperature; restored after the forward")


def _chunk_logps(head_fn, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = head_fn(hidden).float() / temperature
    logp = torch.log_softmax(logits, -1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def prompt_shared_rows(batch: dict, pad_token_id: int) -> dict:
    """A training micro-batch's ``B x G`` sequences as ``B`` rows, each prompt once followed by its ``G`` completions
    (prefix sharing: Wang et al. 2024, arXiv:2410.20305, as :func:`finetune.recipes.reward.shared_rows` does for
    preference pairs).

    Row ``i`` holds prompt ``i``'s real tokens (``P_i``, positions ``0..P_i - 1``), then each of its completions up to
    and including its EOS (``lengths``), each at the positions it has in its own sequence (``P_i, P_i + 1, ...``) and
    attending to the prompt and to its own earlier tokens only. Under causal attention every hidden state equals the
    one of the separate sequence (up to the order of float sums), so the log-probabilities and their gradients do
    too, and each prompt runs once instead of ``G`` times.

    Args:
        batch: :func:`before_step`'s micro-batch (``input_ids`` / ``attention_mask`` ``[B G, P + C]``, a prompt's
            ``G`` completions consecutive; ``prompt_length``; ``lengths``; ``group_size``).
        pad_token_id: filler of the rows' right padding.

    Returns:
        ``input_ids`` and ``position_ids`` ``[B, W]`` int64 (W: the longest row), ``allowed`` ``[B, 1, W, W]`` bool
        (query ``q`` may attend key ``k``), ``source`` ``[B G, C]`` int64: the index into the flattened ``[B W]``
        rows of the hidden state that predicts each completion token (its prompt's last token for the first; -1
        past the completion's length).
    """
    ids, mask, p = batch["input_ids"], batch["attention_mask"], int(batch["prompt_length"])
    g, lengths = int(batch["group_size"]), batch["lengths"].tolist()
    b, c = ids.shape[0] // g, ids.shape[1] - p
    rows, positions, segments, source = [], [], [], torch.full((ids.shape[0], c), -1, dtype=torch.long)
    for i in range(b):
        prompt = ids[i * g, :p][mask[i * g, :p].bool()]
        n_p = len(prompt)
        parts, pos, seg, at = [prompt], [torch.arange(n_p)], [torch.zeros(n_p, dtype=torch.long)], n_p
        for j in range(g):
            r, n = i * g + j, int(lengths[i * g + j])
            parts.append(ids[r, p:p + n].cpu())
            pos.append(n_p + torch.arange(n))
            seg.append(torch.full((n,), j + 1, dtype=torch.long))
            source[r, :n] = torch.cat([torch.tensor([n_p - 1]), at + torch.arange(n - 1)])
            at += n
        rows.append(torch.cat([x.cpu() for x in parts]))
        positions.append(torch.cat(pos))
        segments.append(torch.cat(seg))
    w = max(len(x) for x in rows)
    out_ids = torch.full((b, w), pad_token_id, dtype=torch.long)
    out_pos = torch.zeros((b, w), dtype=torch.long)
    out_seg = torch.full((b, w), -1, dtype=torch.long)  # padding: a segment of its own
    for i, (x, q, sg) in enumerate(zip(rows, positions, segments)):
        out_ids[i, :len(x)], out_pos[i, :len(x)], out_seg[i, :len(x)] = x, q, sg
        source[i * g:(i + 1) * g] = torch.where(source[i * g:(i + 1) * g] >= 0, source[i * g:(i + 1) * g] + i * w, -1)
    j = torch.arange(w)
    causal = j[None, :, None] >= j[None, None, :]
    key_seg, query_seg = out_seg[:, None, :], out_seg[:, :, None]
    allowed = causal & ((key_seg == 0) | (key_seg == query_seg))
    device = ids.device
    return {"input_ids": out_ids.to(device), "position_ids": out_pos.to(device), "allowed": allowed[:, None].to(device),
            "source": source.to(device)}


def shares_prompts(model, batch: dict, share: bool) -> bool:
    """Whether :func:`completion_logps` runs :func:`prompt_shared_rows`: asked for (``train.grpo.share_prompt``), more
    than one completion per prompt, and a model that takes a block mask per row
    (:func:`finetune.recipes.reward.sharing_problem`: sdpa or eager attention, full or sliding-window layers; the
    flash-attention kernels take none). When it cannot, a line says why, once per process."""
    if not share or int(batch.get("group_size", 1)) <= 1:
        return False
    problem = reward.sharing_problem(unwrap(model))
    if problem is not None and problem not in _SHARING_OFF:
        _SHARING_OFF.add(problem)
        if dist_utils.is_main():
            logger.info(f"grpo: prompt sharing off (train.grpo.share_prompt): {problem}; each completion runs with "
                        f"its own copy of the prompt")
    return problem is None


_SHARING_OFF: set = set()


def completion_logps(model, batch: dict, temperature: float, share: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of the completion tokens (and their entropies) at ``temperature``.

    The output head (:func:`finetune.recipes.lm_loss.find_head`) runs only on the hidden states that predict
    completion tokens, in chunks of :func:`~finetune.recipes.lm_loss.chunk_tokens` positions (checkpointed when
    there are several and gradients are on); its forward is replaced on the instance for this call only. The logits
    are the ones the model samples from: what it does after its head (Gemma-2's soft-capping, Cohere's and Granite's
    scales: :func:`~finetune.recipes.lm_loss.logits_transform`) is applied to each chunk, and a model that does
    anything else is refused (:func:`~finetune.recipes.lm_loss.check_head_output`). With ``share``
    (:func:`shares_prompts`) the sequences run as :func:`prompt_shared_rows`, each prompt once.

    Args:
        model: the engine, or a (peft-wrapped) causal LM.
        batch: a training micro-batch of :func:`before_step` on the model's device.
        temperature: the logits are divided by it (``train.grpo.temperature``).
        share: run each prompt once for its completions (``train.grpo.share_prompt``) where the model allows it.

    Returns:
        ``(logps, entropy)``, each ``[B G, C]`` float32 (0 past a completion's length when shared); ``logps``
        differentiable when gradients are on.

    Raises:
        RuntimeError: the model changes its head's output in a way :func:`~finetune.recipes.lm_loss.logits_transform`
            does not know.
    """
    p = int(batch["prompt_length"])
    targets = batch["input_ids"][:, p:]
    head = find_head(model)
    original = head.forward
    state = {}
    transform = logits_transform(model)
    post = transform[1] if transform is not None else (lambda z: z)
    shared = prompt_shared_rows(batch, 0) if shares_prompts(model, batch, share) else None

    def forward(hidden, *args, **kwargs):
        if shared is None:
            h = hidden[:, p - 1:-1]
            rows, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        else:  # the positions that predict a completion token, in [B G, C] order
            keep = shared["source"].reshape(-1) >= 0
            rows = hidden.reshape(-1, hidden.shape[-1])[shared["source"].reshape(-1)[keep]]
            flat_t = targets.reshape(-1)[keep]
        fn = lambda x: post(original(x, *args, **kwargs))  # noqa: E731
        size = chunk_tokens(getattr(unwrap(model).config, "vocab_size", 32768))
        parts = []
        for s in range(0, rows.shape[0], size):
            args_ = (rows[s:s + size], flat_t[s:s + size])
            if torch.is_grad_enabled() and rows.shape[0] > size:
                parts.append(checkpoint(lambda a, b: _chunk_logps(fn, a, b, temperature), *args_, use_reentrant=False))
            else:
                parts.append(_chunk_logps(fn, *args_, temperature))
        logps, entropy = torch.cat([x[0] for x in parts]), torch.cat([x[1] for x in parts])
        if shared is not None:
            logps = torch.zeros(keep.shape, dtype=logps.dtype, device=logps.device).masked_scatter(keep, logps)
            entropy = torch.zeros(keep.shape, dtype=entropy.dtype, device=entropy.device).masked_scatter(keep, entropy)
        state["entropy"] = entropy.view_as(targets)
        return logps.view_as(targets)

    with patches.applied(patches.instance_forward(head, forward, _HEAD_WHY)), head_output(head) as seen:
        if shared is None:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=batch["position_ids"])
        else:
            out = model(input_ids=shared["input_ids"], position_ids=shared["position_ids"],
                        attention_mask=reward.block_mask(unwrap(model), shared["allowed"], shared["position_ids"]))
    return check_head_output(model, head, out.logits, seen, transform), state["entropy"]


def token_losses(logps, old, adv, mask, g: GrpoConfig, ref=None) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate per completion token (TRL 1.16's ``_compute_loss`` for ``grpo``, ``bnpo``,
    ``dr_grpo``, ``dapo``).

    Args:
        logps, old: ``[N, C]`` float32 log-probabilities under the policy (differentiable) and at generation.
        adv: ``[N]`` advantages.
        mask: ``[N, C]`` float32 active tokens.
        g: ``train.grpo``.
        ref: ``[N, C]`` reference log-probabilities (``beta`` > 0).

    Returns:
        ``(per_token_loss [N, C], parts)``: ``parts`` holds ``[N, C]`` clip indicators (``low``, ``high``) and the
        per-token ``kl`` (with ``ref``), detached.
    """
    log_ratio = logps - old
    if g.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef1 = torch.exp(log_ratio)
    high = g.epsilon_high or g.epsilon
    coef2 = torch.clamp(coef1, 1 - g.epsilon, 1 + high)
    a = adv[:, None]
    loss = -torch.min(coef1 * a, coef2 * a)
    parts = {"low": ((coef1 < 1 - g.epsilon) & (a < 0)).float().expand_as(mask).detach(),
             "high": ((coef1 > 1 + high) & (a > 0)).float().expand_as(mask).detach()}
    if ref is not None and g.beta > 0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        loss = loss + g.beta * kl
        parts["kl"] = kl.detach()
    return loss.expand_as(mask), parts


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, g: GrpoConfig) -> torch.Tensor:
    """A micro-batch's loss sum by ``loss_type`` (the module docstring's table), 0-dim float32."""
    masked = per_token * mask
    if g.loss_type == "dapo":
        return masked.sum()
    if g.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if g.loss_type == "dr_grpo":
        return masked.sum() / g.max_completion_length
    return masked.sum() / mask.sum().clamp(min=1.0) * mask.shape[0]  # bnpo


def _mean(values: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.float()
    if weights is None:
        ok = ~torch.isnan(values)
        return torch.nan_to_num(values).sum().double(), ok.sum().double()
    return (values * weights).sum().double(), weights.sum().double()


def forward(model, batch: dict, metrics: bool = False, settings: GrpoConfig | None = None,
            functions: list | None = None, cfg: RunConfig | None = None) -> LossOutput:
    """The GRPO loss of one training micro-batch (from :func:`before_step`), summed as ``loss_type`` says, with
    TRL's metrics; on a prompt batch (evaluation), greedy completions scored, loss 0.

    Returns:
        :class:`~finetune.data.batch.LossOutput` (``targets`` = :func:`count_targets`).
    """
    g = settings or GrpoConfig()
    if batch["labels"].dim() == 1:
        return _evaluate(model, batch, g, cfg)
    mask = batch["completion_mask"].float()
    logps, entropy = completion_logps(model, batch, g.temperature, g.share_prompt)
    old = batch.get("old_logps", logps.detach())
    per_token, parts = token_losses(logps, old, batch["advantages"].to(logps.dtype), mask, g, batch.get("ref_logps"))
    total = loss_sum(per_token, mask, g)
    n = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    tokens = mask.sum().double()
    region = torch.clamp(parts["low"] + parts["high"], max=1)
    m = {"reward": _mean(batch["rewards"]),
         "reward_std": _mean(batch["group_std"]),
         "frac_reward_zero_std": ((batch["group_std"].nan_to_num(0.0) < 1e-6).double().sum(), n),
         "completions/mean_length": (batch["lengths"].double().sum(), n),
         "completions/clipped_ratio": ((~batch["terminated"]).double().sum(), n),
         "clip_ratio/low_mean": ((parts["low"] * mask).sum().double(), tokens),
         "clip_ratio/high_mean": ((parts["high"] * mask).sum().double(), tokens),
         "clip_ratio/region_mean": ((region * mask).sum().double(), tokens),
         "entropy": ((entropy * mask).sum().double(), tokens)}
    if "kl" in parts:
        m["kl"] = ((parts["kl"] * mask).sum().double(), tokens)
    for j, f in enumerate(functions or []):
        m[f"rewards/{f.name}/mean"] = _mean(batch["reward_table"][:, j])
    return LossOutput(total, count_targets(batch, g.loss_type), metrics=m)


def _evaluate(model, batch: dict, g: GrpoConfig, cfg: RunConfig | None) -> LossOutput:
    """A prompt batch's greedy completions (one per prompt), scored on every rank: ``reward`` and
    ``rewards/<function>/mean`` over the real rows; loss 0."""
    if cfg is None:
        raise ValueError("grpo: evaluation needs the run config (bind it with configure)")
    tok, functions = tokenizer_of(cfg), reward_functions(cfg)
    with _rollout(model, g, tok).weights():
        c = generate(model, batch, g, tok, 1, False, 0, _synced(model, g))
    texts, ids = _texts(tok, c)
    tables = score_everywhere(functions, list(batch["prompts"]), texts, ids, dict(batch["reward_columns"]))
    table = torch.tensor(tables[dist_utils.rank()], dtype=torch.float32).reshape(len(texts), -1)
    weights = torch.tensor([f.weight for f in functions], dtype=torch.float32)
    real = (batch["labels"] != -100).cpu()
    r = combine(table, weights)
    _write_eval_records(model, cfg, batch, texts, table, functions, real)
    m = {"reward": _mean(torch.where(real, r, torch.nan))}
    for j, f in enumerate(functions):
        m[f"rewards/{f.name}/mean"] = _mean(torch.where(real, table[:, j], torch.nan))
    device = batch["labels"].device
    m = {k: (a.to(device), b.to(device)) for k, (a, b) in m.items()}
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return LossOutput(zero, count_targets(batch), metrics=m)


def _write_eval_records(engine, cfg: RunConfig, batch: dict, texts: list[str], table: torch.Tensor, functions,
                        real: torch.Tensor) -> None:
    """The evaluation's greedy completions of every rank's real rows, appended by rank 0 to
    ``<run>/eval/step<N>_completions.jsonl`` (``N``: the optimizer steps done) and, the first 3 of a step, to
    TensorBoard as text ``eval/completions``."""
    mine = [{"index": i, "prompt": p, "completion": t,
             "rewards": {f.name: (None if math.isnan(v) else v) for f, v in zip(functions, row)}}
            for i, p, t, row, ok in zip(batch["row_index"], batch["prompts"], texts, table.tolist(), real.tolist()) if ok]
    everyone = dist_utils.all_gather_object(mine)
    if not dist_utils.is_main() or not cfg.output_dir:
        return
    step = int(getattr(engine, "global_steps", 0))
    folder = Path(cfg.output_dir) / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step{step}_completions.jsonl"
    fresh = not path.exists()
    records = sorted((r for part in everyone for r in part), key=lambda r: r["index"])
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps({"step": step, **r}, default=str) + "\n")
    writer = getattr(getattr(getattr(engine, "monitor", None), "tb_monitor", None), "summary_writer", None)
    if writer is not None and fresh and records:
        def cell(t) -> str:
            return str(t).replace("|", "\\|").replace("\n", "<br>")
        rows = [f"| {cell(str(r['prompt'])[-300:])} | {cell(r['completion'])} | {cell(r['rewards'])} |" for r in records[:3]]
        writer.add_text("eval/completions", "\n".join(["| prompt (end) | completion | rewards |", "|---|---|---|", *rows]),
                        step)
        writer.flush()


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with ``train.grpo``, the reward functions and the run config bound into ``forward`` and
    ``count_targets``."""
    g = cfg.train.grpo
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=g, functions=reward_functions(cfg),
                                                                 cfg=cfg),
                               count_targets=functools.partial(count_targets, loss_type=g.loss_type))


def generation_pairs(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """``train.eval_generate``'s prompts and references: the prompt and the first reward column as text."""
    if not data_cfg.reward_columns:
        return []
    encode = PromptRows(tokenizer, data_cfg).encode
    return [(encode(r[prompt_column(data_cfg)]), str(r[data_cfg.reward_columns[0]])) for r in rows
            if r.get(prompt_column(data_cfg)) and r.get(data_cfg.reward_columns[0]) is not None]


def rollout(cfg: RunConfig) -> tuple[int, int]:
    """What each row becomes every step: ``num_generations`` sequences of up to ``data.max_seq_len +
    max_completion_length`` tokens (for ``finetune plan``)."""
    return cfg.train.grpo.num_generations, cfg.data.max_seq_len + cfg.train.grpo.max_completion_length


def _text_or_messages(typ) -> bool:
    return string_type(typ) or str(typ).startswith(("list", "large_list"))


def _all_dropped(cfg: RunConfig, key: str, f: str, p_col: str, prompts: list, problems: list[str]) -> None:
    """One line when ``data.truncation: drop`` would leave none of a file's prompts (every one longer than
    ``data.max_seq_len`` tokens), the launch's empty-split refusal, found before any model is built."""
    try:
        encode = PromptRows(tokenizer_of(cfg), cfg.data).encode
    except Exception:  # noqa: BLE001  (the tokenizer's own check reports it)
        return
    shortest = None
    for p in prompts:
        try:
            n = len(encode(p))
        except Exception:  # noqa: BLE001  (malformed prompts are reported above)
            return
        if n <= cfg.data.max_seq_len:
            return
        shortest = n if shortest is None else min(shortest, n)
    problems.append(f"{key}: every prompt of '{f}' is longer than data.max_seq_len={cfg.data.max_seq_len} tokens "
                    f"(the shortest has {shortest}), so data.truncation=drop leaves none; raise data.max_seq_len or "
                    f"set data.truncation=truncate (keeps each prompt's last tokens)")


def check_rows(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the grpo settings, reward functions and data before any model is built; one line per problem.

    Problems: ``train.grpo`` values out of range or unsupported (``beta`` > 0 without LoRA);
    reward functions that cannot load (:func:`finetune.recipes.rewards.load`: path, import, name, signature, weights);
    a file without the prompt or a reward column; a prompt column neither text nor messages; null or empty prompts
    (the first row and their number); a malformed conversational prompt or one the chat template fails on.
    """
    g, d = cfg.train.grpo, cfg.data
    if g.num_generations < 2:
        problems.append(f"train.grpo.num_generations: {g.num_generations}; GRPO compares each completion with the "
                        f"others of its prompt and needs at least 2")
    for key in ("max_completion_length", "num_iterations"):
        if getattr(g, key) < 1:
            problems.append(f"train.grpo.{key}: {getattr(g, key)} must be >= 1")
    for key in ("temperature", "top_p", "epsilon", "epsilon_high", "beta"):
        if not math.isfinite(float(getattr(g, key))):
            problems.append(f"train.grpo.{key}: {getattr(g, key)} is not a finite number")
    if g.temperature <= 0:
        problems.append(f"train.grpo.temperature: {g.temperature} must be > 0 (GRPO samples its completions)")
    if not 0 < g.top_p <= 1:
        problems.append(f"train.grpo.top_p: {g.top_p} must be in (0, 1]")
    if g.top_k < 0:
        problems.append(f"train.grpo.top_k: {g.top_k} must be >= 0 (0: off)")
    if g.epsilon <= 0 or g.epsilon_high < 0:
        problems.append(f"train.grpo.epsilon: {g.epsilon} must be > 0 and epsilon_high {g.epsilon_high} >= 0 "
                        f"(0: epsilon)")
    if g.beta < 0:
        problems.append(f"train.grpo.beta: {g.beta} must be >= 0")
    if g.beta > 0 and cfg.model.lora is None:
        problems.append(f"train.grpo.beta: {g.beta} > 0 needs a reference model; finetune takes the base model "
                        f"under LoRA (model.lora) as the reference; without LoRA set beta=0 (TRL's default)")
    if g.log_completions < 0:
        problems.append(f"train.grpo.log_completions: {g.log_completions} must be >= 0")
    try:
        reward_functions(cfg)
    except ConfigError as e:
        problems.extend(e.problems)
    p_col = prompt_column(d)
    conversational = False
    templates = TemplateCheck(cfg, prepare_tokenizer)
    for key, files in (("data.train_files", train_files), ("data.validation_files", validation_files)):
        for f in files:
            try:
                schema = pq.ParquetFile(f).schema_arrow
            except Exception:  # noqa: BLE001  (reported by check_parquet_files)
                continue
            missing = [c for c in columns(d) if c not in schema.names]
            if missing:
                problems.append(f"{key}: '{f}' has no column {', '.join(repr(c) for c in missing)} (columns: "
                                f"{', '.join(schema.names)}); grpo reads data.prompt_column (default 'prompt') and "
                                f"data.reward_columns (default ['answer'])")
                continue
            if not _text_or_messages(schema.field(p_col).type):
                problems.append(f"{key}: '{f}' column '{p_col}' has type {schema.field(p_col).type}, neither text "
                                f"nor a list of {{role, content}} messages")
                continue
            prompts = pq.read_table(f, columns=[p_col]).column(p_col).to_pylist()
            empty = [i for i, v in enumerate(prompts) if v is None or not v or (isinstance(v, str) and not v.strip())]
            if empty:
                problems.append(f"{key}: '{f}' row {empty[0]} of column '{p_col}' is null or empty ({len(empty):,} "
                                f"such rows); fix or remove them")
            start = len(problems)
            answered = []
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, list):
                    conversational = True
                    problem = message_problem(prompt)
                    if problem:
                        problems.append(f"{key}: '{f}' row {i} of column '{p_col}' is {problem}; a conversational "
                                        f"prompt is a list of {{role, content}} messages")
                        break
                    if prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
                        answered.append(i)
            if answered and len(problems) == start:
                problems.append(f"{key}: '{f}' row {answered[0]} of column '{p_col}' ends with an assistant message "
                                f"({len(answered):,} such rows): grpo would render the answer into the prompt and "
                                f"open a new assistant turn after it; give the conversations up to the turn the "
                                f"model completes (drop the last assistant message of a chat SFT file)")
            if d.truncation == "drop" and len(problems) == start and prompts and not empty:
                _all_dropped(cfg, key, f, p_col, prompts, problems)
            if len(problems) == start and conversational:
                templates.check(key, f, [p_col], ((i, p_col, list(p)) for i, p in enumerate(prompts)
                                                  if isinstance(p, list)), problems)
    if conversational and not template_text(d):
        tokenizer_template_problem(cfg, problems)


RECIPE = Recipe(name="grpo", model_class=MODEL_CLASS,
                capabilities=Capabilities(generates_text=True, reports_perplexity=False, disables_dropout=True,
                                          eval_metrics=("reward",), checks_columns=True, counts_rows=True,
                                          evaluates_exports=True, mixes_sources=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, before_step=before_step,
                columns=columns, cache_key=cache_key, check_data=check_rows, prepare_model_config=prepare_model_config,
                generation_pairs=generation_pairs, rollout=rollout, batch_repeats=batch_repeats,
                rank_state=rank_state, load_rank_state=load_rank_state)
