"""Step 1b of a GRPO step with tools (``train.grpo.tools``) or an environment (``train.grpo.environment``): the
multi-turn rollout. After the step's one batched generation of every first turn, the completions that call tools
get the results and continue, every such rollout of the rank together, turn by turn
(:func:`finetune.recipes.tools.tool_turns`), inside the same gathered weights (ZeRO-3: still one gather per step;
each rank generates locally, so ranks whose rollouts take different numbers of turns never wait for each other).

Token in, token out: each turn is sampled from ``[prompt | the completion so far]`` with the positions the training
pass gives those tokens (``position_ids`` count real tokens), and the tool results' tokens between the turns are
the template's, masked out of the loss, the KL, the token counts and ``completions/mean_length``
(``tool_mask`` of :func:`multi_turn`'s output; :func:`finetune.recipes.grpo._sequences` multiplies it in).

An environment (TRL 1.16's ``environment_factory``) has one instance per rollout, reset with its row's
``data.reward_columns``; its public methods are the rollout's tools, and the reward functions receive the
instances as ``environments`` (its ``get_reward`` is the reward named after its class, weight 1:
:func:`environment_reward`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from finetune.config import GrpoConfig, RunConfig
from finetune.errors import RunFailure
from finetune.recipes import tools as tool_utils


@dataclasses.dataclass
class Agent:
    """The run's tools and environment, loaded once per process."""

    tools: list[tool_utils.Tool]
    """The ``train.grpo.tools`` functions."""
    factory: Callable | None
    """The ``train.grpo.environment`` factory, or None."""
    schemas: list[dict]
    """What the prompts offer: the tools' schemas, then the environment's methods' (one probe instance)."""
    methods: tuple[str, ...] = ()
    """The environment's methods offered as tools (bound to each rollout's instance by name)."""


@functools.cache
def _load(tools: tuple[str, ...], environment: str) -> Agent:
    loaded = tool_utils.load_tools(list(tools))
    factory = tool_utils.load_environment(environment) if environment else None
    schemas, methods = [t.schema for t in loaded], ()
    if factory is not None:
        offered = tool_utils.environment_tools(factory())
        schemas += [t.schema for t in offered]
        methods = tuple(t.name for t in offered)
    return Agent(loaded, factory, schemas, methods)


def agent_of(cfg: RunConfig) -> Agent | None:
    """The run's :class:`Agent`, or None for a single-turn run (no tools, no environment).

    Raises:
        ConfigError: a tool or environment that cannot be loaded (one line).
    """
    g = cfg.train.grpo
    if not g.tools and not g.environment:
        return None
    return _load(tuple(g.tools), g.environment)


def environment_reward(prompts, completions, environments=None, **columns) -> list[float | None]:
    """The environment's own reward (TRL's ``get_reward``): one per rollout, read when it ends."""
    return [float(e.get_reward()) if e is not None and hasattr(e, "get_reward") else None for e in environments]


def start_environments(agent: Agent, columns: dict[str, list], n: int) -> list:
    """One fresh instance per rollout, reset with its row's columns; ``n`` rollouts. None without an environment.

    Raises:
        RunFailure: ``reset`` raised, or returned an observation (text): put the task in the prompt column.
    """
    if agent.factory is None:
        return [None] * n
    out = []
    for i in range(n):
        env = agent.factory()
        row = {k: v[i] for k, v in columns.items()}
        try:
            observation = env.reset(**row)
        except Exception as e:  # noqa: BLE001  (the user's environment: one line on every rank via the caller)
            raise RunFailure(f"grpo: train.grpo.environment: {type(env).__name__}.reset({', '.join(row)}) failed: "
                             f"{type(e).__name__}: {e}") from e
        if observation is not None:
            raise RunFailure(f"grpo: train.grpo.environment: {type(env).__name__}.reset returned an observation; "
                             f"finetune takes the task from the prompt column (data.prompt_column): return None and "
                             f"state the task there")
        out.append(env)
    return out


def multi_turn(whole: dict, prompts: dict, generate_fn, tok, g: GrpoConfig, agent: Agent, environments: list,
               chat_template: str | None) -> tuple[dict, list[list[dict]], tool_utils.ToolStats]:
    """The tool turns of every rollout of the step on this rank.

    Args:
        whole: :func:`~finetune.recipes.grpo.rollout.generate`'s first turns: ``completion_ids`` ``[N, C]``,
            ``completion_mask``, ``terminated``, ``lengths``.
        prompts: the left-padded prompts each rollout continues: ``input_ids``, ``attention_mask`` ``[N, P]``.
        generate_fn: ``(batch, max_new_tokens) -> generate's output`` for a left-padded prompt batch, one
            completion each.
        tok: the tokenizer.
        g: ``train.grpo``.
        agent: the run's tools and environment.
        environments: one instance (or None) per rollout (:func:`start_environments`).
        chat_template: ``data.chat_template`` as text, or None (the tokenizer's).

    Returns:
        ``(whole, transcripts, stats)``: ``whole`` with every rollout's tokens (``completion_ids`` padded,
        ``completion_mask`` 1 on every real token, ``lengths``, ``terminated``: the last turn ended with EOS) and
        ``tool_mask`` ``[N, C']`` float32 (1 on the model's tokens, 0 on the tools'); ``turns`` ``[N]`` int64 (the
        model's turns); ``tool_calls``, ``tool_failures`` ``[N]`` float32; the transcripts (one list of turns per
        rollout); the counts.
    """
    pad, eos = tok.pad_token_id, tok.eos_token_id
    n = len(whole["completion_ids"])
    firsts = [row[:int(k)].tolist() for row, k in zip(whole["completion_ids"], whole["lengths"])]
    starts = [row[m.bool()].tolist() for row, m in zip(prompts["input_ids"], prompts["attention_mask"])]
    standalone = {t.name: t.function for t in agent.tools}
    # an environment's methods bound by name (their schemas were built once, by agent_of)
    per_rollout = [{**standalone, **({m: getattr(e, m) for m in agent.methods} if e is not None else {})}
                   for e in environments]

    def continue_(inputs: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(map(len, inputs))
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for i, x in enumerate(inputs):
            ids[i, width - len(x):], mask[i, width - len(x):] = torch.tensor(x), 1
        out = generate_fn({"input_ids": ids, "attention_mask": mask}, max_new)
        return [row[:int(k)].tolist() for row, k in zip(out["completion_ids"], out["lengths"])]

    per_stats = [tool_utils.ToolStats() for _ in range(n)]
    done = tool_utils.tool_turns(starts, firsts, continue_, tok, per_rollout, g.max_completion_length,
                                 g.max_tool_calling_iterations, g.tool_timeout_s, per_stats, chat_template)
    width = max([len(t.ids) for t in done] + [1])
    ids = torch.full((n, width), pad, dtype=torch.long)
    real = torch.zeros((n, width), dtype=torch.float32)
    model = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(done):
        ids[i, :len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        real[i, :len(t.ids)] = 1
        model[i, :len(t.ids)] = torch.tensor(t.mask, dtype=torch.float32)
    out = {"completion_ids": ids, "completion_mask": real,
           "terminated": torch.tensor([bool(t.ids) and t.ids[-1] == eos for t in done]),
           "lengths": real.sum(1).long(), "tool_mask": model,
           "turns": torch.tensor([sum(m["role"] == "assistant" for m in t.turns) for t in done], dtype=torch.long),
           "tool_calls": torch.tensor([float(s.calls) for s in per_stats]),
           "tool_failures": torch.tensor([float(s.failures) for s in per_stats])}
    return out, [t.turns for t in done], tool_utils.ToolStats.total(per_stats)
