"""Preference training of any ``AutoModelForCausalLM`` on chosen/rejected pairs: DPO, IPO, SimPO and ORPO.

Data, in TRL's two forms (per row, from the prompt's type):

* **text**: ``data.prompt_column`` (default ``prompt``), ``data.chosen_column`` and ``data.rejected_column``
  (default ``chosen``/``rejected``), all text. Each response is encoded as ``sft`` encodes a prompt/response pair
  (:func:`finetune.recipes.common.chat.encode_pair`): ``tokens(prompt) + tokens(response) + [EOS]``, labels -100 on the
  prompt.
* **conversational**: the prompt is a list of ``{role, content}`` messages and each response a list of assistant
  messages (a plain string is taken as one assistant message); ``prompt + response`` is rendered with
  ``data.chat_template`` or the tokenizer's own (as ``sft`` does) and only the response's tokens are targets.

A pair whose two responses are identical, or become identical once cut to ``data.max_seq_len`` (they differ only
after it: such a pair has no DPO gradient and always counts as a wrong ranking), or whose responses lose every token
to ``data.max_seq_len`` (``data.truncation: truncate`` cuts the end; ``drop`` leaves out any pair longer than it), is
dropped and counted (:meth:`PairExamples.summary`). Null or empty responses, a chat template that raises on a row,
and a split none of whose pairs survives truncation are refused before any model is built (:func:`check_pairs`);
``finetune doctor`` reports the share of pairs identical after truncation per split (:func:`doctor_rows`).

A tokenized row holds the chosen sequence as ``input_ids``/``labels`` and the rejected one as
``rejected_input_ids``/``rejected_labels`` (length grouping reads the chosen length). A micro-batch of ``B`` pairs
is ``[2B, seq]``: the chosen sequences, then the rejected ones, right-padded together, so the policy sees both in
one forward (TRL's "concatenated forward"). The sequence log-probability ``log pi(y | x)`` is the sum over the
response's tokens, from the LM head run at target positions only, in chunks
(:func:`finetune.recipes.lm_loss.token_loss_sum` with ``per_row``): no ``[tokens, vocab]`` logits.

The loss of a pair (``train.dpo``; ``l`` are log-probabilities summed over a response, ``n`` its tokens,
``sigma`` the logistic function, ``eps`` the label smoothing):

* ``sigmoid`` (DPO; Rafailov et al. 2023, "Direct Preference Optimization", eq. 7), with ``eps > 0`` conservative
  DPO (cDPO; Mitchell 2023, "A note on DPO with noisy preferences and relationship to IPO"):
  ``z = beta * ((l_c - ref_c) - (l_r - ref_r))``, loss ``-(1 - eps) log sigma(z) - eps log sigma(-z)``. TRL 1.16's
  ``sigmoid`` has no smoothing; its smoothed variants are other losses (``robust``: Chowdhury et al. 2024, the
  same terms divided by ``1 - 2 eps`` with the flipped term subtracted; ``exo_pair``: Ji et al. 2024).
* ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
  eq. 17; length-averaged log-probabilities, as TRL 1.16 computes them): ``h = (l_c/n_c - ref_c/n_c) - (l_r/n_r -
  ref_r/n_r)``, loss ``(h - 1 / (2 beta))^2``; no label smoothing (refused).
* ``simpo`` (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6): no
  reference, ``z = beta * (l_c/n_c - l_r/n_r) - gamma``, loss as ``sigmoid``'s.
* ``orpo`` (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eqs. 4-7; TRL's
  ``ORPOTrainer``): no reference; with the length-averaged ``a = l / n`` (the log of the geometric-mean token
  probability ``P``), ``log_odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))`` (``log(P/(1-P))`` of chosen
  minus rejected, computed stably with ``log1mexp``), loss ``-a_c - beta * log sigma(log_odds)``: the chosen
  response's mean token NLL plus ``beta`` times the odds-ratio term. The NLL is per pair here (TRL's is the mean
  over all chosen tokens of the process's batch), so the pair-weighted mean stays exact. Rewards ``beta * a``,
  and TRL's ``nll_loss``, ``log_odds_ratio`` (``log sigma(log_odds)``) and ``log_odds_chosen`` (``log_odds``).
* ``rpo_alpha > 0`` adds ``rpo_alpha * (-l_c / n_c)``, the chosen response's mean token NLL (RPO: Pang et al.
  2024, "Iterative Reasoning Preference Optimization", eq. 3), per pair so that the pair weighting below stays
  exact. TRL 1.16 has no ``rpo_alpha``: its ``loss_type=["sigmoid", "sft"]`` with ``loss_weights`` adds the mean
  NLL over all chosen tokens of the batch instead (token-weighted across pairs, per process).

Implicit rewards (TRL's metric names and values): ``beta * (l - ref)`` (IPO too: summed log-ratios, as TRL
logs them), SimPO and ORPO ``beta * l / n``.
``rewards/accuracies`` is the share of pairs whose chosen reward is higher. Dropout is off (``prepare_model_config``
sets every ``*dropout``/``*pdrop`` probability of the model config to 0, as TRL's ``disable_dropout`` default), so
policy and reference log-probabilities are deterministic.

**Reference without a second model.** ``before_training`` computes ``(ref_c, ref_r)`` of every pair of both
splits once, with the engine's initial weights (no grad, every rank its shard, in lockstep under ZeRO-3), keeps
them in ``<cache>/reference/`` under a key of the tokenized split, the model (files and a hash of their content,
overrides, init, seed, attention, precision) and the library versions (:func:`reference_key`) so that a resume or
another run reuses them, and adds them as the ``reference_logps`` column.
With LoRA the reference is the base model: the same pass and cache with the adapters disabled (peft's
``disable_adapter``; TRL's ``precompute_ref_log_probs``), so training runs no reference forward either. A batch
without the column (``finetune evaluate`` of a LoRA run) gets a no-grad forward with the adapters off instead.
SimPO needs no reference.

Pair weighting: ``count_targets`` counts pairs (rows with a target; eval filler rows have none) and ``forward``
returns the loss summed over pairs, so the loop's token weighting is pair weighting: the loss is the exact mean
over the pairs of the global batch whatever the ZeRO stage, ranks and accumulation.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from finetune.parallel import sequence
from finetune.data import images
from finetune.data.batch import LossOutput
from finetune.config import DpoConfig, RunConfig
from finetune.data.dataset import (
    TrainData,
)
from finetune.logs import logger
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common.pairs import (
    MODEL_CLASS,
    REFERENCE_COLUMN,
    cache_key,
    check_pairs,
    columns,
    count_targets,
    doctor_rows,
    generation_pairs,
    make_collator,
    prepare_model_config,
    prepare_tokenizer,
    sequence_logps,
    tokenize_function,
    valid_pairs,
)
from finetune.recipes.common.reference import adapters_off, attach_reference, peft_model_of

def pair_losses(logps: torch.Tensor, tokens: torch.Tensor, ref: torch.Tensor | None,
                s: DpoConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss and implicit rewards (the formulas of the module docstring).

    Args:
        logps: ``[2B]`` float32 policy log-probabilities, chosen then rejected.
        tokens: ``[2B]`` int64 response tokens of each sequence.
        ref: ``[2B]`` float32 reference log-probabilities in the same order (None for ``simpo`` and ``orpo``).
        s: ``train.dpo``.

    Returns:
        ``(losses, reward_chosen, reward_rejected)``, each ``[B]`` float32.
    """
    b = logps.shape[0] // 2
    n = tokens.clamp(min=1).to(logps.dtype)
    ls = s.label_smoothing
    if s.loss_type == "simpo":
        avg = logps / n
        reward_c, reward_r = s.beta * avg[:b], s.beta * avg[b:]
        z = reward_c - reward_r - s.simpo_gamma
        losses = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
    elif s.loss_type == "orpo":
        avg = logps / n
        log_odds, nll = orpo_terms(logps, tokens)
        losses = nll - s.beta * F.logsigmoid(log_odds)
        reward_c, reward_r = s.beta * avg[:b], s.beta * avg[b:]
    else:
        ratio = (logps - ref) / n if s.loss_type == "ipo" else logps - ref
        h = ratio[:b] - ratio[b:]
        if s.loss_type == "ipo":
            losses = (h - 1 / (2 * s.beta)) ** 2
        else:
            losses = -(1 - ls) * F.logsigmoid(s.beta * h) - ls * F.logsigmoid(-s.beta * h)
        summed = logps - ref  # TRL logs the summed log-ratios as rewards, IPO's too
        reward_c, reward_r = s.beta * summed[:b], s.beta * summed[b:]
    if s.rpo_alpha:
        losses = losses + s.rpo_alpha * (-logps[:b] / n[:b])
    return losses, reward_c.detach(), reward_r.detach()


REFERENCE_FREE = ("simpo", "orpo")
"""Loss types that need no reference log-probabilities (no reference pass, no adapters-off forward)."""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stably (Maechler 2012, "Accurately computing log(1 - exp(-|a|))": the
    branch at ``-log 2``; as TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_terms(logps: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's log odds ratio and the chosen responses' mean token NLL, per pair.

    Args:
        logps: ``[2B]`` float32 summed log-probabilities, chosen then rejected.
        tokens: ``[2B]`` int64 response tokens.

    Returns:
        ``(log_odds, nll)``, each ``[B]``: ``log(P_c / (1 - P_c)) - log(P_r / (1 - P_r))`` with ``P = exp(l / n)``,
        and ``-l_c / n_c``.
    """
    b = logps.shape[0] // 2
    avg = logps / tokens.clamp(min=1).to(logps.dtype)
    log_odds = (avg[:b] - avg[b:]) - (log1mexp(avg[:b]) - log1mexp(avg[b:]))
    return log_odds, -avg[:b]


def forward(model, batch: dict, metrics: bool = False, settings: DpoConfig | None = None) -> LossOutput:
    """The preference loss of one micro-batch of pairs, summed over its pairs (``count_targets``).

    The reference log-probabilities come from the batch (``reference_logps``, computed before training), or from a
    no-grad forward of the same batch with the LoRA adapters off (:func:`adapters_off`); SimPO uses none.
    TRL's metrics are returned at every call (train logs and evaluation) as sums over the valid pairs:
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``.

    Args:
        model: the engine (or a causal LM, peft-wrapped or not).
        batch: :class:`PairCollator`'s batch on the model's device.
        metrics: accepted for the contract (the metrics are always returned).
        settings: ``train.dpo`` (bound by ``configure``; the defaults when None).

    Returns:
        :class:`~finetune.data.batch.LossOutput`: ``loss_sum`` 0-dim float32 over pairs, ``targets`` the pair count.
        A mixture-of-experts policy adds its router's load-balancing term (``aux_loss``, of the forward over the
        chosen and rejected rows together) and router statistics (:func:`finetune.engine.moe.router_terms`).

    Raises:
        ValueError: a DPO or IPO batch has no ``reference_logps`` and the model no adapters to turn off.
    """
    s = settings or DpoConfig()
    router: dict = {}  # a mixture of experts: its load-balancing loss term and router statistics
    logps, tokens = sequence_logps(model, batch, router)
    ref = None
    if s.loss_type not in REFERENCE_FREE:
        ref = batch.get(REFERENCE_COLUMN)
        if ref is None:
            if peft_model_of(model) is None:
                raise ValueError("dpo: the batch has no reference_logps and the model no LoRA adapters to turn off "
                                 "for the reference; run the reference pass (before_training) first")
            with torch.no_grad(), adapters_off(model):
                ref, _ = sequence_logps(model, batch)
        ref = ref.to(logps.dtype)
    losses, reward_c, reward_r = pair_losses(logps, tokens, ref, s)
    b = losses.shape[0]
    # under sequence parallelism every rank of the SP group holds the whole pairs' values: each adds 1 / sp of them
    # (the loss, and through sum_over_sequence's backward its gradient, counts once over the group)
    valid = valid_pairs(batch).to(losses.dtype) * sequence.sequence_weight()
    pairs = valid.sum()
    lp = logps.detach()
    sums = {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
            "rewards/accuracies": (reward_c > reward_r).to(losses.dtype), "rewards/margins": reward_c - reward_r,
            "logps/chosen": lp[:b], "logps/rejected": lp[b:]}
    if s.loss_type == "orpo":  # TRL's ORPOTrainer metrics
        log_odds, nll = (t.detach() for t in orpo_terms(lp, tokens))
        sums.update({"nll_loss": nll, "log_odds_ratio": F.logsigmoid(log_odds), "log_odds_chosen": log_odds})
    return LossOutput((losses * valid).sum(), count_targets(batch),
                      metrics={**{k: ((v * valid).sum(), pairs) for k, v in sums.items()}, **router.get("metrics", {})},
                      aux_loss=router.get("aux_loss"))


SIMPO_BETA = (1.0, 10.0)
"""``beta`` range within which SimPO's settings are left unremarked: Meng et al. 2024 tune 2.0-2.5 (10 for Gemma)."""
SIMPO_GAMMA_RATIO = (0.1, 1.6)
"""``gamma / beta`` range of the paper's tuned settings (about 0.5 typical)."""


def simpo_note(s: DpoConfig) -> str | None:
    """A warning when SimPO's ``beta`` or ``simpo_gamma / beta`` lies outside the ranges of the paper's tuned
    settings (:data:`SIMPO_BETA`, :data:`SIMPO_GAMMA_RATIO`; TRL's DPO default beta 0.1 is 20x below them), else
    None. Not an error: the values are the user's to choose."""
    if s.loss_type != "simpo" or s.beta <= 0:
        return None
    ratio = s.simpo_gamma / s.beta
    if SIMPO_BETA[0] <= s.beta <= SIMPO_BETA[1] and SIMPO_GAMMA_RATIO[0] <= ratio <= SIMPO_GAMMA_RATIO[1]:
        return None
    return (f"train.dpo: SimPO with beta {s.beta} and simpo_gamma {s.simpo_gamma} (gamma/beta {ratio:.2f}) is far "
            f"from the paper's settings (Meng et al. 2024: beta 2.0-2.5, gamma/beta about 0.5; this warning below "
            f"beta {SIMPO_BETA[0]:g} or above {SIMPO_BETA[1]:g}, or gamma/beta outside {SIMPO_GAMMA_RATIO[0]:g}-"
            f"{SIMPO_GAMMA_RATIO[1]:g}); e.g. train.dpo.beta=2.0 train.dpo.simpo_gamma=1.0")


_NOTED: set = set()


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with ``train.dpo`` bound into ``forward``; with an image-text model
    (:func:`finetune.data.images.in_prompts`), ``data.image_column`` into ``columns``, ``tokenize_function`` and
    ``cache_key``; logs :func:`simpo_note`'s warning when there is one."""
    note = simpo_note(cfg.train.dpo)
    if note and note not in _NOTED:  # once per process (the pre-flight checks configure the recipe too)
        _NOTED.add(note)
        logger.warning(note)
    extra = {}
    if recipe.name == "dpo" and images.in_prompts(cfg):
        extra = {"tokenize_function": functools.partial(tokenize_function, processor=images.processor_source(cfg, "dpo")),
                 "cache_key": functools.partial(cache_key, with_images=True),
                 "columns": functools.partial(columns, with_images=True)}
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=cfg.train.dpo), **extra)


def before_training(engine, data: TrainData, cfg: RunConfig) -> TrainData:
    """Attach the reference log-probabilities of every pair to both splits (``reference_logps``, :func:`attach_reference`;
    with LoRA the base model's, adapters off); the data as it is for the reference-free losses.

    Must run before a checkpoint is restored (the reference is the model's initial weights).
    """
    if cfg.train.dpo.loss_type in REFERENCE_FREE:
        logger.info(f"dpo: {cfg.train.dpo.loss_type} is reference-free; no reference log-probabilities")
        return data
    if cfg.model.lora is not None:
        logger.info("dpo: reference = the base model (LoRA adapters off), computed once before training")
    return attach_reference(engine, data, cfg, "dpo", "pairs")


RECIPE = Recipe(name="dpo", model_class=MODEL_CLASS,
                capabilities=Capabilities(parallel=frozenset({sequence.DIMENSION}), generates_text=True,
                                          disables_dropout=True,
                                          reports_perplexity=False, sequences_per_row=2,
                                          eval_metrics=tuple(f"{k}/{v}" for k in ("rewards", "logps")
                                                             for v in ("chosen", "rejected"))
                                          + ("rewards/accuracies", "rewards/margins"),
                                          checks_columns=True, counts_rows=True, evaluates_exports=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, before_training=before_training,
                columns=columns, cache_key=cache_key, check_data=check_pairs, prepare_model_config=prepare_model_config,
                generation_pairs=generation_pairs, doctor_rows=doctor_rows)
