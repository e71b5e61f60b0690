"""GRPO: online reinforcement learning of any ``AutoModelForCausalLM`` from rewards of its own completions
(Shao et al. 2024, "DeepSeekMath", sec. 4.1; DAPO, Yu et al. 2025; Dr. GRPO, Liu et al. 2025; GSPO, Zheng et al.
2025; TRL 1.16's ``GRPOTrainer``, whose metric names and defaults this follows), or of an
``AutoModelForImageTextToText`` on prompts with images (:func:`configure`; docs/vision-language.md).

Data: ``data.prompt_column`` (default ``prompt``: text, used verbatim, or a list of ``{role, content}`` messages
rendered with the chat template and the assistant's turn opened) and ``data.reward_columns`` (default
``[answer]``), which reach the reward functions (:mod:`finetune.recipes.common.rewards`). A row is one prompt, cut to its
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
   with one line naming it, :class:`finetune.recipes.common.rewards.RewardError`), weight and sum
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
with tools the greedy answers take their tool turns too, and ``eval/tools/call_frequency`` (tool calls per answer)
and ``eval/tools/any_call_rate`` (the share of answers with a tool call) are logged; ``eval/loss`` is 0.

Metrics (training, TRL's names): ``reward``, ``reward_std`` (the mean of the groups' standard deviations),
``rewards/<function>/mean``, ``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``
(completions without EOS), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
``entropy`` (mean per active token), ``kl`` (with ``beta`` > 0). A sample of each logged step's completions goes
to ``<run>/completions.jsonl`` (``train.grpo.log_completions``).

The package follows a step's way: :mod:`~finetune.recipes.grpo.prompts` (rows -> prompt batches),
:mod:`~finetune.recipes.grpo.rollout` (step 1: the completions), :mod:`~finetune.recipes.grpo.scoring` (steps 2
and 3: rewards and advantages), :mod:`~finetune.recipes.grpo.loss` (step 4 and the loss: log-probabilities, the
surrogate, its sum; evaluation), :mod:`~finetune.recipes.grpo.checks` (the checks before any model is built); this
module holds the step (:func:`before_step`, the generation batch it reuses) and the recipe (:data:`RECIPE`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import torch
from finetune.config import GrpoConfig, RunConfig
from finetune.data import images
from finetune.data.batch import to_device
from finetune.engine.auto import AutoModelForCausalOrImageTextLM
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils
from finetune.parallel import sequence
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common.reference import adapters_off
from finetune.recipes.grpo import rollout, scoring
from finetune.recipes.grpo.agent import agent_of, inspect_sample
from finetune.recipes.grpo.checks import check_rows
from finetune.recipes.grpo.loss import completion_logps, count_targets, forward, loss_sum, prompt_shared_rows, \
    shares_prompts, token_losses
from finetune.recipes.grpo.prompts import COLUMN_PREFIX, PROMPT_COLUMN, PromptCollator, PromptRows, cache_key, \
    columns, generation_pairs, make_collator, prepare_model_config, prepare_tokenizer, prompt_column, \
    tokenize_function, tokenizer_of
from finetune.recipes.grpo.rollout import Completions, generate, generate_completions, greedy_completions, \
    join_prompts, rollout_shape, split_completions
from finetune.recipes.grpo.scoring import advantages, combine, reward_functions, score_completions, \
    score_everywhere

_texts, _nanstd = rollout._texts, scoring._nanstd  # the tests' names for them

MODEL_CLASS = AutoModelForCausalOrImageTextLM
"""Any ``AutoModelForCausalLM``, or an ``AutoModelForImageTextToText`` (a config with a ``vision_config``): its prompts
then hold images (:func:`configure`)."""


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
    with sequence.sequence_parallel_off():  # whole sequences: generation runs as without SP
        done = generate_completions(engine, micro, cfg, step, tok)
    tables, own, mine, batch_std = score_completions(functions, done.prompts, done.texts, done.ids, done.columns,
                                                     g.scale_rewards)
    if sequence.sequence_group() is not None:
        done, own, mine, batch_std = _same_in_sequence_group(engine, done, tables, own, mine, batch_std, functions)
    texts = done.texts
    out, start = [], 0
    for b, c in zip(micro, done.batches):
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
                    with adapters_off(engine):
                        b["ref_logps"] = completion_logps(engine, on_device, g.temperature, g.share_prompt)[0].cpu()
        module.train()
    _log_sample(cfg, step + 1, done.prompts, texts, mine, tables, functions, done.transcripts, out)
    return out


_DIFFERED: list = []


def _same_in_sequence_group(engine, done, tables: list, own, mine, batch_std, functions) -> tuple:
    """Under sequence parallelism, the completions and rewards of the SP group's first rank on every rank of the
    group (one broadcast of host objects over the group): the group trains the same rows, each rank a slice of every
    sequence (:func:`~finetune.recipes.grpo.loss.completion_logps`), so its ranks must hold the very same
    completions. Each rank generated them from the same prompts, seeds and weights (every rank still enters every
    gathered forward of generation, ZeRO-3's included), which gives the same tokens unless a kernel is not
    deterministic; a rank whose own differ says so once and trains the first rank's. With ``scale_rewards: batch``
    the global batch's standard deviation counts each group's rows once (its first rank's table).

    Returns:
        ``(done, own, mine, batch_std)`` as :func:`~finetune.recipes.grpo.scoring.score_completions` and
        :func:`~finetune.recipes.grpo.rollout.generate_completions` give them, the group's first rank's.
    """
    group = sequence.sequence_group()
    first = torch.distributed.get_global_rank(group, 0)
    sp = torch.distributed.get_world_size(group)
    payload = [(dataclasses.replace(done, columns={}), own, mine)]  # environments stay on their rank
    device = engine.device if getattr(engine.device, "type", "cpu") == "cuda" else None
    torch.distributed.broadcast_object_list(payload, src=first, group=group, device=device)
    theirs, own, mine = payload[0]
    if theirs.ids != done.ids and not _DIFFERED:
        _DIFFERED.append(True)
        logger.warning(f"grpo: rank {dist_utils.rank()} generated other completions than rank {first} of its "
                       f"sequence-parallel group from the same prompts, seeds and weights (a kernel that is not "
                       f"deterministic); the group trains rank {first}'s (said once)")
    done = dataclasses.replace(theirs, columns=done.columns)
    if batch_std is not None:  # every SP group's rows once: the tables of the groups' first ranks
        weights = torch.tensor([f.weight for f in functions], dtype=torch.float32)
        firsts = [row for r, t in enumerate(tables) if r % sp == 0 for row in t]
        batch_std = scoring._nanstd(combine(torch.tensor(firsts, dtype=torch.float32), weights))
    return done, own, mine, batch_std


def _sequences(b: dict, c: dict, g: GrpoConfig, adv, r, std, table) -> dict:
    """A training micro-batch from a prompt batch and its completions; with an environment's observations, each
    rollout's own prompt (``c["prompt_ids"]``, ``c["prompt_mask"]``:
    :func:`~finetune.recipes.grpo.agent.observed_prompts`) and ``prompts_differ`` (0-d bool: some group's prompts
    differ, so :func:`~finetune.recipes.grpo.loss.shares_prompts` turns prompt sharing off for this micro-batch);
    with images, each completion's prompt's image tensors (joined as the processor joins a batch of ``B G`` rows,
    :func:`finetune.data.images.join`), the prompt's per-token inputs (:data:`finetune.data.images.TOKEN_KEYS`) with 0
    on the completion, and ``image_keys``, their names."""
    n = g.num_generations
    prompt_ids, prompt_mask = b["input_ids"].repeat_interleave(n, 0), b["attention_mask"].repeat_interleave(n, 0)
    differ = False
    if "prompt_ids" in c:  # an environment's observations: each rollout's own prompt (agent.observed_prompts)
        keep = c["prompt_mask"].bool().any(0)  # left padding no rollout of this micro-batch needs
        prompt_ids, prompt_mask = c["prompt_ids"][:, keep], c["prompt_mask"][:, keep]
        groups = torch.stack([prompt_ids, prompt_mask]).reshape(2, -1, n, prompt_ids.shape[1])
        differ = not bool((groups == groups[:, :, :1]).all())  # a group's prompts differ: no prompt sharing
    pictures = images.join([r for r in b["images"] for _ in range(n)]) if b.get("images") else {}
    for key in images.TOKEN_KEYS:  # the prompt's per-token inputs, 0 on the completion (as generate extends them)
        if key in b and "prompt_ids" not in c:
            pictures[key] = torch.nn.functional.pad(b[key].repeat_interleave(n, 0), (0, c["completion_ids"].shape[1]))
    cmask = c["completion_mask"] * c["tool_mask"] if "tool_mask" in c else c["completion_mask"]  # tools: not trained
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
            "lengths": c["lengths"], "group_size": torch.tensor(n), "prompts_differ": torch.tensor(differ),
            **pictures, **({"image_keys": tuple(pictures)} if pictures else {}),
            **({"model_lengths": c["tool_mask"].sum(1).long(), "tool_calls": c["tool_calls"],
                "tool_failures": c["tool_failures"], "turns": c["turns"],
                "tool_calls_by_name": c["tool_calls_by_name"]} if "tool_mask" in c else {})}


def _trained_tokens(batches: list[dict], k: int) -> list[tuple[list[int], list[int]]]:
    """The first ``k`` rollouts of a step's training micro-batches (:func:`_sequences`) as the loss sees them: each
    rollout's completion token ids (the model's and, with tools, the tools' and the template's between its turns;
    padding left out) and its mask (1: trained; 0: a tool's or the template's token, or a truncated completion's
    under ``mask_truncated_completions``), for ``completions.jsonl`` and ``finetune inspect --completions``."""
    out = []
    for b in batches:
        p = int(b["prompt_length"])
        for ids, real, mask in zip(b["input_ids"][:, p:], b["attention_mask"][:, p:].bool(), b["completion_mask"]):
            if len(out) == k:
                return out
            out.append((ids[real].tolist(), (mask[real] > 0).long().tolist()))
    return out


def _log_sample(cfg: RunConfig, step: int, prompts, texts, r, tables, functions, transcripts,
                batches: list[dict]) -> None:
    """Rank 0, on logged steps: the first ``log_completions`` completions to ``<run>/completions.jsonl``, each with
    its advantage and, from the step's training micro-batches ``batches``, its ``completion_ids`` and ``trained``
    mask (:func:`_trained_tokens`); with tools, each rollout's ``turns`` too (``transcripts``: the assistant turns
    with their tool calls, and the tool results)."""
    k = cfg.train.grpo.log_completions
    if not k or not dist_utils.is_main() or not cfg.output_dir or step % max(cfg.train.log_every, 1):
        return
    adv = torch.cat([b["advantages"] for b in batches])
    tokens = _trained_tokens(batches, k)
    with open(Path(cfg.output_dir) / "completions.jsonl", "a") as f:
        for i in range(min(k, len(texts))):
            f.write(json.dumps({"step": step, "prompt": prompts[i], "completion": texts[i],
                                "reward": None if math.isnan(float(r[i])) else float(r[i]),
                                "rewards": {fn.name: (None if math.isnan(v) else v)
                                            for fn, v in zip(functions, tables[0][i])},
                                "advantage": float(adv[i]),
                                **({"turns": transcripts[i]} if transcripts else {}),
                                **({"completion_ids": tokens[i][0], "trained": tokens[i][1]}
                                   if i < len(tokens) else {})}, default=str) + "\n")


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with ``train.grpo``, the reward functions and the run config bound into ``forward`` and
    ``count_targets``; with tools or an environment, their schemas into ``tokenize_function`` and ``cache_key``;
    with an image-text model (:func:`finetune.data.images.in_prompts`), ``data.image_column`` into ``columns``,
    ``tokenize_function`` and ``cache_key`` (the prompts rendered by the model's processor with their images)."""
    g = cfg.train.grpo
    agent = agent_of(cfg)  # tools and environment: the prompts offer their schemas, which the cache key holds
    tools = {} if agent is None else {"tokenize_function": functools.partial(tokenize_function, tools=agent.schemas),
                                      "cache_key": functools.partial(cache_key, tools=agent.schemas)}
    if images.in_prompts(cfg):  # no tools with images (checks.check_rows)
        tools = {"tokenize_function": functools.partial(tokenize_function, processor=images.processor_source(cfg, "grpo")),
                 "cache_key": functools.partial(cache_key, with_images=True),
                 "columns": functools.partial(columns, with_images=True)}
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=g, functions=reward_functions(cfg),
                                                                 cfg=cfg),
                               count_targets=functools.partial(count_targets, loss_type=g.loss_type), **tools)


RECIPE = Recipe(name="grpo", model_class=MODEL_CLASS,
                capabilities=Capabilities(parallel=frozenset({sequence.DIMENSION}), generates_text=True,
                                          reports_perplexity=False, disables_dropout=True,
                                          eval_metrics=("reward",), checks_columns=True, counts_rows=True,
                                          evaluates_exports=True, mixes_sources=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, before_step=before_step,
                columns=columns, cache_key=cache_key, check_data=check_rows, prepare_model_config=prepare_model_config,
                generation_pairs=generation_pairs, rollout=rollout_shape, batch_repeats=batch_repeats,
                rank_state=rank_state, load_rank_state=load_rank_state, sample_rollout=inspect_sample)
