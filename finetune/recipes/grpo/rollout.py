"""Step 1 of a GRPO step: the rollout. The prompts of the step's micro-batches -> ``G`` completions each, in one
``generate`` call per rank and step (:func:`generate_completions`, the generation side of
:func:`finetune.recipes.grpo.before_step`), the completions as text and token ids for the reward functions, and
evaluation's greedy completions (:func:`greedy_completions`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from finetune.config import GrpoConfig, RunConfig
from finetune.data import images
from finetune.engine.rollout import HFGenerateRollout, SamplingConfig, complete, lockstep, make_rollout, sampling_seed
from finetune.recipes.grpo.agent import agent_of, multi_turn, observed_prompts, start_environments
from finetune.recipes.grpo.prompts import PromptRows
from finetune.recipes.common.chat import template_text


@dataclass
class Completions:
    """The step's completions on this rank (:func:`generate_completions`)."""

    batches: list[dict]
    """One :func:`generate` output per prompt batch (``B G`` completions each, a prompt's ``G`` consecutive); with an
    environment's observations, also ``prompt_ids`` and ``prompt_mask`` ``[B G, P']``: each rollout's own prompt,
    left-padded."""
    texts: list[str]
    """Every completion as text, in the batches' order."""
    ids: list[list[int]]
    """Every completion's token ids up to and including its EOS."""
    prompts: list
    """Every completion's prompt (each prompt ``G`` times; with an environment's observation, the rollout's own:
    the prompt's last message with the observation appended)."""
    columns: dict[str, list]
    """Every completion's ``data.reward_columns`` values (each row's ``G`` times); with an environment, also
    ``environments``: each rollout's instance (the reward functions' ``environments`` argument, TRL's)."""
    transcripts: list[list[dict]] | None = None
    """With tools: every rollout's turns (:func:`finetune.recipes.grpo.agent.multi_turn`), else None."""


def generate_completions(engine, micro: list[dict], cfg: RunConfig, step: int, tok) -> Completions:
    """``train.grpo.num_generations`` sampled completions of every prompt of the step's micro-batches: one
    :func:`generate` call for all of them (:func:`join_prompts`; ZeRO-3: the whole model gathered once for it),
    seeded from the rows' seeds and the step, cut back per micro-batch (:func:`split_completions`)."""
    g = cfg.train.grpo
    joined = join_prompts(micro, tok.pad_token_id)  # one generate call for all the step's prompts on this rank
    cols = {n: [v for b in micro for v in b["reward_columns"][n] for _ in range(g.num_generations)]
            for n in cfg.data.reward_columns}
    seed = sampling_seed(cfg.train.seed, step, joined["row_seeds"])
    transcripts = None
    prompts = [p for b in micro for p in b["prompts"] for _ in range(g.num_generations)]
    agent = agent_of(cfg)
    # an environment's reset before the first turn: its observations become the rollouts' own prompts
    environments, observed = _environments(agent, cols, prompts, cfg, tok)
    with _rollout(engine, g, tok).weights():  # ZeRO-3: the whole model gathered once for the step's generation
        if observed is None:
            whole = generate(engine, joined, g, tok, g.num_generations, True, seed, _synced(engine, g))
            repeated = {k: joined[k].repeat_interleave(g.num_generations, 0) for k in ("input_ids", "attention_mask")}
        else:  # one prompt per rollout
            repeated, prompts = observed
            whole = generate(engine, repeated, g, tok, 1, True, seed, _synced(engine, g))
        if agent is not None:  # the tool turns, in the same gathered weights
            whole, transcripts, cols = _tool_turns(engine, whole, repeated, cols, cfg, tok, agent, seed, True,
                                                   environments)
    if observed is not None:  # the training pass's prompts: each rollout's own
        whole.update(prompt_ids=repeated["input_ids"], prompt_mask=repeated["attention_mask"])
    done = split_completions(whole, [len(b["prompts"]) * g.num_generations for b in micro], tok.pad_token_id)
    texts, ids = [], []
    for c in done:
        t, i = _texts(tok, c)
        texts += t
        ids += i
    return Completions(done, texts, ids, prompts, cols, transcripts)


def _environments(agent, cols: dict, prompts: list, cfg: RunConfig, tok) -> tuple[list | None, tuple | None]:
    """With an environment: one instance per rollout, reset before its first turn
    (:func:`~finetune.recipes.grpo.agent.start_environments`), and, when some ``reset`` returned an observation, the
    rollouts' own prompts (:func:`~finetune.recipes.grpo.agent.observed_prompts`: ``(batch, messages)``)."""
    if agent is None or agent.factory is None:
        return None, None
    environments, observations = start_environments(agent, cols, len(prompts), cfg.train.grpo.tool_timeout_s)
    encode = PromptRows(tok, cfg.data, agent.schemas).encode
    return environments, observed_prompts(prompts, observations, encode, cfg.data.max_seq_len, tok.pad_token_id)


def _tool_turns(engine, whole: dict, prompts: dict, cols: dict, cfg: RunConfig, tok, agent, seed: int,
                sample: bool, environments: list | None) -> tuple[dict, list[list[dict]], dict]:
    """:func:`~finetune.recipes.grpo.agent.multi_turn` on this rank's rollouts, each continuation sampled as the
    first turn (seeded from the step's seed and the turn); with an environment, its instances (one per rollout,
    :func:`_environments`) added to the columns as ``environments``."""
    g = cfg.train.grpo
    environments = environments or [None] * len(whole["completion_ids"])
    turn = iter(range(1, 1 << 20))

    def continue_(batch: dict, max_new: int) -> dict:
        return generate(engine, batch, dataclasses.replace(g, max_completion_length=max_new), tok, 1, sample,
                        seed + 104_729 * next(turn), _synced(engine, g))

    whole, transcripts, _ = multi_turn(whole, prompts, continue_, tok, g, agent, environments,
                                       template_text(cfg.data), _rollout(engine, g, tok).stop_ids())
    if agent.factory is not None:
        cols = {**cols, "environments": environments}
    return whole, transcripts, cols


def greedy_completions(model, batch: dict, g: GrpoConfig, tok, cfg: RunConfig | None = None) \
        -> tuple[list[str], list[list[int]], dict, torch.Tensor | None]:
    """One greedy completion of each prompt of a prompt batch (evaluation), as text and as token ids, the reward
    columns (with an environment, its instances added as ``environments``) and, with tools (``cfg``), the tool
    turns too and each completion's tool calls (``[N]`` float32; None without tools)."""
    cols = dict(batch["reward_columns"])
    agent = agent_of(cfg) if cfg is not None else None
    environments, observed = _environments(agent, cols, list(batch["prompts"]) if agent else [], cfg, tok)
    prompts = {k: batch[k] for k in ("input_ids", "attention_mask", "images", *images.TOKEN_KEYS) if k in batch} \
        if observed is None \
        else observed[0]
    with _rollout(model, g, tok).weights():
        c = generate(model, prompts, g, tok, 1, False, 0, _synced(model, g))
        if agent is not None:
            c, _, cols = _tool_turns(model, c, prompts, cols, cfg, tok, agent, 0, False, environments)
    texts, ids = _texts(tok, c)
    return texts, ids, cols, c.get("tool_calls")


def generate(engine, batch: dict, g: GrpoConfig, tokenizer, n: int, sample: bool, seed: int, synced: bool) -> dict:
    """``n`` completions of each prompt of ``batch`` through :class:`finetune.engine.rollout.HFGenerateRollout` (no
    gradient; the caller holds the rollout's :meth:`~finetune.engine.rollout.HFGenerateRollout.weights`).

    Args:
        engine: the engine (or a plain causal LM).
        batch: a prompt batch (:class:`PromptCollator`); its ``images`` (each row's image tensors) go to the model
            with the prompts (:func:`finetune.data.images.join`), and so do its per-token inputs
            (:data:`finetune.data.images.TOKEN_KEYS`: Qwen2.5-VL's 3-D positions, Gemma 3's image attention).
        g: ``train.grpo`` (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``fast_generation``).
        n: completions per prompt.
        sample: sample (else greedy).
        seed: the sampling seed.
        synced: generate layer by layer in lockstep (ZeRO-3 without ``gather_for_generation``).

    Returns:
        :func:`finetune.engine.rollout.complete`'s ``completion_ids``, ``completion_mask``, ``terminated``, ``lengths``.
    """
    sampling = SamplingConfig(max_new_tokens=g.max_completion_length, temperature=g.temperature if sample else 0.0,
                              top_p=g.top_p, top_k=g.top_k, n_samples_per_prompt=n)
    inputs = {**images.join(batch["images"]), **{k: batch[k] for k in images.TOKEN_KEYS if k in batch}} \
        if batch.get("images") else None
    return complete(engine, batch["input_ids"], batch["attention_mask"], sampling, tokenizer, seed, inputs,
                    g.generation_backend, gather=not synced, fast=g.fast_generation)


def _texts(tokenizer, completion: dict) -> tuple[list[str], list[list[int]]]:
    """The completions as text (decoded without their end token) and as token ids up to and including it (what
    TRL 1.16 passes its reward functions as ``completion_ids``: the completion mask's tokens)."""
    ids = [row[: int(n)].tolist() for row, n in zip(completion["completion_ids"], completion["lengths"])]
    text_ids = [x[:-1] if x and bool(ended) else x for x, ended in zip(ids, completion["terminated"])]
    return tokenizer.batch_decode(text_ids, skip_special_tokens=True), ids


def join_prompts(micro: list[dict], pad: int) -> dict:
    """The prompts of several prompt batches as one: ``input_ids``, ``attention_mask`` ``[sum B, longest]``
    (left-padded again to the longest prompt), ``row_seeds`` and, with images, ``images`` (the rows' image tensors in
    order) and the per-token inputs (:data:`finetune.data.images.TOKEN_KEYS`, left-padded with 0); a prompt's
    positions do not change (they count its real tokens)."""
    width = max(b["input_ids"].shape[1] for b in micro)
    ids = torch.cat([torch.nn.functional.pad(b["input_ids"], (width - b["input_ids"].shape[1], 0), value=pad)
                     for b in micro])
    mask = torch.cat([torch.nn.functional.pad(b["attention_mask"], (width - b["attention_mask"].shape[1], 0))
                      for b in micro])
    tokens = {k: torch.cat([torch.nn.functional.pad(b[k], (width - b[k].shape[1], 0)) for b in micro])
              for k in images.TOKEN_KEYS if k in micro[0]}
    return {"input_ids": ids, "attention_mask": mask, "row_seeds": torch.cat([b["row_seeds"] for b in micro]),
            **({"images": [r for b in micro for r in b["images"]]} if "images" in micro[0] else {}), **tokens}


def split_completions(whole: dict, sizes: list[int], pad: int) -> list[dict]:
    """:func:`generate`'s output for joined prompts cut back into one per prompt batch (``sizes`` completions each),
    each trimmed to its own longest completion (``completion_ids``, ``completion_mask`` and, with tools,
    ``tool_mask``)."""
    out, start = [], 0
    for n in sizes:
        part = {k: v[start:start + n] for k, v in whole.items()}
        width = int(part["lengths"].max()) if n else 0
        for k in ("completion_ids", "completion_mask", "tool_mask"):
            if k in part:
                part[k] = part[k][:, :width]
        out.append(part)
        start += n
    return out


def _rollout(engine, g: GrpoConfig, tokenizer) -> HFGenerateRollout:
    return make_rollout(engine, tokenizer, g.generation_backend, gather=g.gather_for_generation, fast=g.fast_generation)


def _synced(engine, g: GrpoConfig) -> bool:
    return lockstep(engine, g.gather_for_generation)


def rollout_shape(cfg: RunConfig) -> tuple[int, int]:
    """What each row becomes every step: ``num_generations`` sequences of up to ``data.max_seq_len +
    max_completion_length`` tokens (for ``finetune plan``)."""
    return cfg.train.grpo.num_generations, cfg.data.max_seq_len + cfg.train.grpo.max_completion_length
