"""Step 1b of a GRPO step with tools (``train.grpo.tools``) or an environment (``train.grpo.environment``): the
multi-turn rollout. After the step's one batched generation of every first turn, the completions that call tools
get the results and continue, every such rollout of the rank together, turn by turn
(:func:`finetune.recipes.grpo.tools.tool_turns`), inside the same gathered weights (ZeRO-3: still one gather per step;
each rank generates locally, so ranks whose rollouts take different numbers of turns never wait for each other).

Token in, token out: each turn is sampled from ``[prompt | the completion so far]`` with the positions the training
pass gives those tokens (``position_ids`` count real tokens), and the tool results' tokens between the turns are
the template's, masked out of the loss, the KL, the token counts and ``completions/mean_length``
(``tool_mask`` of :func:`multi_turn`'s output; :func:`finetune.recipes.grpo._sequences` multiplies it in).

An environment (TRL 1.16's ``environment_factory``) has one instance per rollout, reset with its row's
``data.reward_columns`` before the rollout's first turn; what ``reset`` returns (None or text, the first
observation) is appended to the prompt's last message, as TRL does, and the rollout starts from that prompt,
rendered by the chat template: prompt tokens, never trained (:func:`observed_prompts`); its public methods are the
rollout's tools, and the reward functions receive the instances as ``environments`` (its ``get_reward`` is the
reward named after its class, weight 1: :func:`environment_reward`). The instances live in the rank's environment
process, not in the rank (:func:`finetune.recipes.grpo.tools.new_environment`): a call of one past
``train.grpo.tool_timeout_s`` is stopped, even in C code that holds the GIL, and the instances lost with that
process answer their tool calls with an error and their reads with None; every rank goes on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from finetune.config import GrpoConfig, RunConfig
from finetune.errors import RunFailure
from finetune.recipes.grpo import tools as tool_utils


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
    environment: str = ""
    """The factory as ``/absolute/file.py:Factory``: each rollout's instance is made from it in the rank's
    environment process (:func:`start_environments`); :attr:`factory` makes the rank's probe instances only
    (schemas, ``--check``, whether it has ``get_reward``)."""

    @property
    def names(self) -> tuple[str, ...]:
        """Every tool name the prompts offer, in :attr:`schemas`' order: the per-tool call counts' columns (the
        same on every rank: they come from the run config)."""
        return tuple(t.name for t in self.tools) + self.methods


@functools.cache
def _load(tools: tuple[str, ...], environment: str) -> Agent:
    loaded = tool_utils.load_tools(list(tools))
    factory = tool_utils.load_environment(environment) if environment else None
    schemas, methods, spec = [t.schema for t in loaded], (), ""
    if factory is not None:
        offered = tool_utils.environment_tools(factory())  # a probe: inspected in the rank, its methods never called
        tool_utils.refuse_shadowing(loaded, offered, environment)
        schemas += [t.schema for t in offered]
        methods = tuple(t.name for t in offered)
        path, _, name = environment.rpartition(":")
        spec = f"{Path(path).resolve()}:{name}"
    return Agent(loaded, factory, schemas, methods, spec)


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
    """The environment's own reward (TRL's ``get_reward``): one per rollout, read when it ends, as it returns it
    (:func:`finetune.recipes.common.rewards.score` refuses what is no number, text included, as for any reward function);
    None for an instance lost with its process (:class:`~finetune.recipes.grpo.tools.RemoteEnvironment`)."""
    return [e.get_reward() if e is not None and hasattr(e, "get_reward") else None for e in environments]


def start_environments(agent: Agent, columns: dict[str, list], n: int, timeout_s: float = 10.0) \
        -> tuple[list, list[str | None]]:
    """One fresh instance per rollout, reset with its row's columns (TRL 1.16's ``environment_factory``:
    ``reset(**row)`` returns None or the first observation); ``n`` rollouts. Called before the rollouts' first turn,
    since an observation belongs to the prompt (:func:`observed_prompts`). The instances live in the rank's
    environment process (:func:`finetune.recipes.grpo.tools.new_environment`), so that a call past ``timeout_s``
    (``train.grpo.tool_timeout_s``; ``reset`` included) can be stopped; each is a
    :class:`~finetune.recipes.grpo.tools.RemoteEnvironment` here. The instances of the batch before are dropped first
    (its rollouts were scored), so that process does not grow.

    Returns:
        ``(environments, observations)``: ``n`` instances (``[None] * n`` without an environment) and what each
        ``reset`` returned (None or text).

    Raises:
        RunFailure: one line: ``reset`` (or the factory) raised, ran past ``timeout_s``, or returned something other
            than None or text; a row value that is not JSON; the file does not import in the environment process.
    """
    if agent.factory is None:
        return [None] * n, [None] * n
    if not agent.environment:
        raise ValueError("start_environments: the agent names no environment file (Agent.environment)")
    tool_utils.drop_environments()
    out, observations = [], []
    for i in range(n):
        row = {k: v[i] for k, v in columns.items() if k != "environments"}
        try:
            env, observation = tool_utils.new_environment(agent.environment, row, timeout_s)
        except tool_utils.EnvironmentFailed as e:  # the user's environment: one line on every rank via the caller
            raise RunFailure(f"grpo: train.grpo.environment: {e}") from e
        out.append(env)
        observations.append(observation)
    return out, observations


def observe(prompt, observation: str | None):
    """The prompt a rollout starts from: ``prompt`` (a list of ``{role, content}`` messages) with ``observation``
    appended to its last message's content, as TRL 1.16's ``GRPOTrainer`` does (``content + observation``, no
    separator; the input row is left untouched); ``prompt`` itself when the observation is None."""
    if observation is None:
        return prompt
    messages = list(prompt)
    return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]


def observed_prompts(prompts: list, observations: list[str | None], encode, max_seq_len: int, pad: int) \
        -> tuple[dict, list] | None:
    """The rollouts' own prompts when an environment's ``reset`` returned observations: each prompt with its
    observation (:func:`observe`), rendered as the data's prompts are (``encode``: the prompt rows' encoder, the
    tools offered, the assistant's turn opened) and cut to its last ``max_seq_len`` tokens (``data.max_seq_len``).
    The observation is prompt: never trained. Rollouts of one group may then start from different prompts (the
    training pass runs each with its own prompt, without prompt sharing: :func:`finetune.recipes.grpo._sequences`).

    Args:
        prompts: one raw prompt per rollout (messages).
        observations: one per rollout (:func:`start_environments`).
        encode: messages -> token ids (:meth:`finetune.recipes.grpo.prompts.PromptRows.encode`).
        max_seq_len: the prompt length at most.
        pad: the pad token id (left padding).

    Returns:
        None when every observation is None (the rollouts start from the data's prompts), else ``(batch,
        messages)``: ``input_ids`` and ``attention_mask`` ``[N, longest]`` int64,
        left-padded with ``pad``, and each rollout's prompt messages with its observation.
    """
    if all(o is None for o in observations):
        return None
    messages = [observe(p, o) for p, o in zip(prompts, observations)]
    ids = [encode(m)[-max_seq_len:] for m in messages]
    width = max(map(len, ids))
    out = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, width - len(x):], mask[i, width - len(x):] = torch.tensor(x, dtype=torch.long), 1
    return {"input_ids": out, "attention_mask": mask}, messages


def multi_turn(whole: dict, prompts: dict, generate_fn, tok, g: GrpoConfig, agent: Agent, environments: list,
               chat_template: str | None, stops: list[int] | None = None) \
        -> tuple[dict, list[list[dict]], tool_utils.ToolStats]:
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
        environments: one instance (or None) per rollout (:func:`start_environments`'s first).
        chat_template: ``data.chat_template`` as text, or None (the tokenizer's).
        stops: the ids a turn ends at (:func:`finetune.engine.rollout.stop_token_ids`); None: the tokenizer's EOS.

    Returns:
        ``(whole, transcripts, stats)``: ``whole`` with every rollout's tokens (``completion_ids`` padded,
        ``completion_mask`` 1 on every real token, ``lengths``, ``terminated``: the last turn ended with one of
        ``stops`` and the rollout was not cut for want of room for its tool results) and
        ``tool_mask`` ``[N, C']`` float32 (1 on the model's tokens, 0 on the tools'); ``turns`` ``[N]`` int64 (the
        model's turns); ``tool_calls``, ``tool_failures`` ``[N]`` float32; ``tool_calls_by_name`` ``[N, T + 1]``
        float32 (the calls of each of :attr:`Agent.names`, then those naming no offered tool or none at all); the
        transcripts (one list of turns per rollout); the counts.
    """
    pad, stops = tok.pad_token_id, stops or [tok.eos_token_id]
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
                                 g.max_tool_calling_iterations, g.tool_timeout_s, per_stats, chat_template, stops)
    width = max([len(t.ids) for t in done] + [1])
    ids = torch.full((n, width), pad, dtype=torch.long)
    real = torch.zeros((n, width), dtype=torch.float32)
    model = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(done):
        ids[i, :len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        real[i, :len(t.ids)] = 1
        model[i, :len(t.ids)] = torch.tensor(t.mask, dtype=torch.float32)
    out = {"completion_ids": ids, "completion_mask": real,
           "terminated": torch.tensor([bool(t.ids) and t.ids[-1] in stops and not t.cut for t in done]),
           "lengths": real.sum(1).long(), "tool_mask": model,
           "turns": torch.tensor([sum(m["role"] == "assistant" for m in t.turns) for t in done], dtype=torch.long),
           "tool_calls": torch.tensor([float(s.calls) for s in per_stats]),
           "tool_failures": torch.tensor([float(s.failures) for s in per_stats]),
           "tool_calls_by_name": torch.tensor([[float(s.per_tool.get(name, 0)) for name in agent.names]
                                               + [float(s.calls - sum(s.per_tool.get(name, 0) for name in agent.names))]
                                               for s in per_stats], dtype=torch.float32).reshape(n, -1)}
    return out, [t.turns for t in done], tool_utils.ToolStats.total(per_stats)


def sample_arguments(schema: dict) -> dict:
    """Arguments for a sample call of the tool whose JSON schema is ``schema`` (``finetune inspect``): each required
    parameter (every parameter when none is marked required) gets its first ``enum`` value, or by type ``"text"``,
    1, 1.5, true, [] or {}."""
    params = schema["function"].get("parameters", {})
    props = params.get("properties", {})
    by_type = {"string": "text", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    names = params.get("required") or list(props)
    return {n: (props[n]["enum"][0] if props[n].get("enum") else by_type.get(props[n].get("type"), "text"))
            for n in names}


REPLY = "(the model's next turn)"
"""The text of :func:`sample_rollout`'s second assistant turn."""


def sample_rollout(agent: Agent, tok, prompt: list[dict], columns: dict, g: GrpoConfig, chat_template: str | None,
                   encode) -> tuple[list[int], tool_utils.Trajectory]:
    """A multi-turn rollout as training builds it, before any model has generated (``finetune inspect``): the
    prompt (with the environment's first observation, :func:`observed_prompts`), an assistant turn calling the first
    offered tool with :func:`sample_arguments` (as the chat template renders such a turn), the tool run for real
    (an environment's method on an instance reset with the row's ``columns``) and its result rendered by the
    template, then a second assistant turn (:data:`REPLY`): :func:`finetune.recipes.grpo.tools.tool_turns`, the training
    loop's own, with these two turns in place of the model's.

    Args:
        agent: the run's tools and environment.
        tok: the tokenizer.
        prompt: the row's prompt messages.
        columns: the row's ``data.reward_columns`` values (name -> value), for ``reset``.
        g: ``train.grpo`` (``tool_timeout_s``; the sample is not cut to ``max_completion_length``: the caller
            says when training would cut it).
        chat_template: ``data.chat_template`` as text, or None (the tokenizer's).
        encode: messages -> prompt token ids (:meth:`finetune.recipes.grpo.prompts.PromptRows.encode`).

    Returns:
        ``(prompt_ids, trajectory)``: the rollout's prompt tokens and its completion (``ids``, ``mask``: 1 on the
        model's tokens, trained; 0 on the tool's and the template's; ``turns``).

    Raises:
        RunFailure: the environment's ``reset`` failed.
    """
    environments, observations = start_environments(agent, {k: [v] for k, v in columns.items()}, 1,
                                                    g.tool_timeout_s)
    messages = observe(prompt, observations[0])
    prompt_ids = encode(messages)
    schema = agent.schemas[0]
    name = schema["function"]["name"]
    kwargs = {"chat_template": chat_template} if chat_template else {}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": sample_arguments(schema)}}]}
    opened = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False,
                                     **kwargs)
    whole = tok.apply_chat_template(messages + [call], tokenize=True, return_dict=False, **kwargs)
    turn = whole[len(opened):]
    eos = [i for i, t in enumerate(turn) if t == tok.eos_token_id]
    turn = turn[:eos[-1] + 1] if eos else turn + [tok.eos_token_id]
    reply = tok(REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    functions = {t.name: t.function for t in agent.tools}
    if environments[0] is not None:
        functions.update({m: getattr(environments[0], m) for m in agent.methods})
    done = tool_utils.tool_turns([prompt_ids], [turn], lambda inputs, budget: [reply[:budget] for _ in inputs], tok,
                                 [functions], 1 << 20, 1, g.tool_timeout_s,
                                 [tool_utils.ToolStats()], chat_template)
    return prompt_ids, done[0]


def inspect_sample(cfg: RunConfig, tok, row: dict) -> tuple[list[int], list[bool]] | None:
    """The recipe's ``sample_rollout`` hook (``finetune inspect``): :func:`sample_rollout` of a tokenized row
    (its ``prompt_raw`` and ``reward_column:<name>`` columns), as ``(prompt + completion ids, trained per token)``:
    the model's tokens trained, the prompt's, the tool's and the template's not; None without tools or an
    environment.

    Raises:
        ConfigError: a tool or environment that does not load, or an environment whose ``reset`` fails (one line).
    """
    from finetune.errors import ConfigError
    from finetune.recipes.grpo.prompts import COLUMN_PREFIX, PROMPT_COLUMN, PromptRows
    from finetune.recipes.common.chat import template_text

    agent = agent_of(cfg)
    if agent is None or not agent.schemas:
        return None
    columns = {n: row[COLUMN_PREFIX + n] for n in cfg.data.reward_columns}
    try:
        prompt, done = sample_rollout(agent, tok, list(row[PROMPT_COLUMN]), columns, cfg.train.grpo,
                                      template_text(cfg.data), PromptRows(tok, cfg.data, agent.schemas).encode)
    except RunFailure as e:
        raise ConfigError(str(e)) from e
    return prompt + done.ids, [False] * len(prompt) + [bool(m) for m in done.mask]
