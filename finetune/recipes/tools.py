"""Tool calling for multi-turn ``grpo`` (``train.grpo.tools``): loading the tools, their schemas, finding a
completion's tool calls, running them, and the tokens of their results.

A tool is a Python function with type hints and a Google-style docstring, named ``path/to/file.py:function``
(TRL 1.16's ``GRPOTrainer(tools=[...])``; transformers' "passing tools"): its JSON schema comes from transformers'
:func:`~transformers.utils.get_json_schema`, and the tokenizer's chat template renders the schemas into the prompt
(``apply_chat_template(messages, tools=schemas)``). When a completion calls tools, each call is parsed
(:func:`parse_tool_calls`: the tokenizer's own response parser where it declares a ``response_schema``, else the
Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form), run (:func:`call_tool`), and its
result is appended to the sampled tokens as the template renders a ``tool`` message (:func:`tool_suffix_ids`); the
model then continues. Token in, token out: the sampled tokens are never re-tokenized from text.

A tool that raises, runs past ``train.grpo.tool_timeout_s``, is unknown, or gets arguments that are not a JSON
object returns ``{"error": ...}`` (JSON) to the model (as TRL does) and is counted (``tools/failure_frequency``); a
result that is not a string is sent as TRL 1.16 sends it, ``str(result)`` (a list of text content blocks: their
texts), and counted as ``non_text`` (not a failure).
No tool call ever stops a rank. A tool that hangs keeps its thread (Python cannot stop one); the rollout goes on
without it.

The user's file is imported when the run starts and by ``--check``: the run config names it, so running it is what
the user asked for (as for reward functions, :mod:`finetune.recipes.rewards`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from finetune.errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""The Hermes / Qwen2.5 / Qwen3 tool-call block: a JSON object ``{"name": ..., "arguments": {...}}``."""


@dataclass
class Tool:
    """A loaded tool: its name (the function's), the function, and its JSON schema (transformers'
    ``get_json_schema``: ``{"type": "function", "function": {"name", "description", "parameters"}}``)."""

    name: str
    function: Callable
    schema: dict


@dataclass
class ToolStats:
    """Per rollout batch: tool calls made, failed (raised, timed out, unknown tool, malformed arguments), and
    results that were not text; calls per tool name."""

    calls: int = 0
    failures: int = 0
    non_text: int = 0
    per_tool: dict[str, int] = field(default_factory=dict)

    @classmethod
    def total(cls, parts: list[ToolStats]) -> ToolStats:
        """The sum of several counts."""
        out = cls()
        for p in parts:
            out.calls, out.failures, out.non_text = out.calls + p.calls, out.failures + p.failures, \
                out.non_text + p.non_text
            for k, v in p.per_tool.items():
                out.per_tool[k] = out.per_tool.get(k, 0) + v
        return out


def load_tools(specs: list[str], key: str = "train.grpo.tools") -> list[Tool]:
    """The functions ``specs`` name (``path/to/file.py:function`` each), with their schemas.

    Raises:
        ConfigError: one line naming ``key``: a file that is missing or does not import, a missing function, two
            tools of one name, or a function whose schema cannot be built (a parameter without a type hint, no
            docstring, an argument the docstring does not describe).
    """
    from transformers.utils import get_json_schema

    from finetune.recipes.rewards import import_function

    tools: list[Tool] = []
    for spec in specs:
        fn = import_function(spec, key, "not path/to/file.py:function (a tool)")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001  (transformers' TypeHintParsingException, DocstringParsingException)
            raise ConfigError(f"{key}: '{spec}' cannot be offered as a tool: {str(e).splitlines()[0]} (a tool needs "
                              f"a type hint on every parameter and a Google-style docstring with an Args: line for "
                              f"each)") from e
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise ConfigError(f"{key}: two tools are named '{name}'; rename one function")
        tools.append(Tool(name, fn, schema))
    return tools


def environment_tools(environment, key: str = "train.grpo.environment") -> list[Tool]:
    """The tools an environment instance offers: its public methods other than ``reset`` and ``get_reward`` (TRL
    1.16's ``environment_factory`` contract), bound to the instance, with their schemas.

    Raises:
        ConfigError: one line naming ``key``: no callable ``reset``, or a method whose schema cannot be built.
    """
    from transformers.utils import get_json_schema

    if not callable(getattr(environment, "reset", None)):
        raise ConfigError(f"{key}: {type(environment).__name__} has no reset(**row) method; an environment resets "
                          f"itself for each rollout from its row and returns None or the first observation (text)")
    tools = []
    for name in sorted(dir(environment)):
        method = getattr(environment, name)
        if name.startswith("_") or name in ("reset", "get_reward") or not callable(method):
            continue
        try:
            schema = get_json_schema(method)
        except Exception as e:  # noqa: BLE001  (transformers' schema errors)
            raise ConfigError(f"{key}: {type(environment).__name__}.{name} cannot be offered as a tool: "
                              f"{str(e).splitlines()[0]} (a public method is a tool: type hints and a Google-style "
                              f"docstring, or make it private with a leading underscore)") from e
        tools.append(Tool(name, method, schema))
    return tools


def load_environment(spec: str, key: str = "train.grpo.environment") -> Callable:
    """The environment factory ``path/to/file.py:Factory`` names (a class or a function returning an instance),
    checked on one instance (:func:`environment_tools`).

    Raises:
        ConfigError: one line naming ``key`` (as :func:`load_tools`, or an instance that cannot be made).
    """
    from finetune.recipes.rewards import import_function

    factory = import_function(spec, key, "not path/to/file.py:Factory (an environment)")
    try:
        probe = factory()
    except Exception as e:  # noqa: BLE001  (the user's code)
        raise ConfigError(f"{key}: {spec}() failed: {type(e).__name__}: {e}") from e
    environment_tools(probe, key)
    return factory


def template_problem(tokenizer, schemas: list[dict], chat_template: str | None = None) -> str | None:
    """Why the chat template (``chat_template``, else the tokenizer's) cannot offer the tools whose JSON schemas
    are ``schemas`` (None when it can): it must render the schemas (each tool's name appears in the rendered
    prompt), an assistant turn with a tool call and a ``tool`` message."""
    if not schemas:
        return None
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        return ("the tokenizer has no chat template; set data.chat_template (e.g. "
                "data/chat_templates/chatml_tools.jinja)")
    messages = [{"role": "user", "content": "x"}]
    kwargs = {"chat_template": chat_template} if chat_template else {}
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        tool_suffix_ids(tokenizer, [{"role": "tool", "name": schemas[0]["function"]["name"], "content": "1"}],
                        chat_template)
    except Exception as e:  # noqa: BLE001  (a Jinja error of the user's template)
        return f"the chat template cannot render tools, tool calls or tool results ({type(e).__name__}: {e})"
    missing = [n for n in (x["function"]["name"] for x in schemas) if n not in rendered]
    if missing:
        return (f"the chat template does not render the tools' schemas (no '{missing[0]}' in the prompt); use a "
                f"template with tools, e.g. data/chat_templates/chatml_tools.jinja")
    return None


def parse_tool_calls(text: str, tokenizer=None) -> list[dict]:
    """The tool calls of one assistant turn, in order: ``{"name": str | None, "arguments": dict | None, "error":
    str | None}`` each (``error`` when the call could not be read). Uses the tokenizer's response parser when it
    declares a ``response_schema`` (transformers' chat-template tool-call parsing), else the Hermes ``<tool_call>``
    blocks (:data:`TOOL_CALL`); an empty list when the turn calls nothing."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        try:
            parsed = tokenizer.parse_response(text)
        except Exception as e:  # noqa: BLE001  (a malformed call: the model is told)
            return [{"name": None, "arguments": None, "error": f"the tool call could not be parsed ({e})"}]
        calls = []
        for call in parsed.get("tool_calls") or []:
            f = call.get("function", call)
            calls.append(_call(f.get("name"), f.get("arguments")))
        return calls
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append({"name": None, "arguments": None, "error": f"the tool call is not JSON ({e.msg})"})
            continue
        if not isinstance(obj, dict):
            calls.append({"name": None, "arguments": None, "error": "the tool call is not a JSON object"})
            continue
        calls.append(_call(obj.get("name"), obj.get("arguments", {})))
    return calls


def _call(name, arguments) -> dict:
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str):
        return {"name": None, "arguments": None, "error": "the tool call names no tool"}
    if not isinstance(arguments, dict):
        return {"name": name, "arguments": None, "error": "the tool call's arguments are not a JSON object"}
    return {"name": name, "arguments": arguments, "error": None}


def call_tool(tools: dict[str, Callable], call: dict, timeout_s: float, stats: ToolStats) -> str:
    """Run one parsed call and return what the model reads: the result as text, or ``{"error": ...}`` (JSON) for a
    call that failed. Counts it in ``stats``. Never raises."""
    stats.calls += 1
    name = call.get("name")
    stats.per_tool[name or "<unparsed>"] = stats.per_tool.get(name or "<unparsed>", 0) + 1
    if call.get("error"):
        return _failed(stats, call["error"])
    if name not in tools:
        return _failed(stats, f"unknown tool '{name}'; the tools are: {', '.join(sorted(tools))}")
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = tools[name](**call["arguments"])
        except BaseException as e:  # noqa: BLE001  (any failure of the user's tool is the model's to read)
            box["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return _failed(stats, f"the tool '{name}' did not return within {timeout_s:g} s")
    if "error" in box:
        return _failed(stats, box["error"])
    value = box.get("value")
    if isinstance(value, str):
        return value
    stats.non_text += 1
    return _as_text(value)


def _as_text(value) -> str:
    """A tool's result that is not a string, as the model reads it: TRL 1.16's ``str(result)`` (``None`` ->
    ``"None"``, ``{"a": 1}`` -> ``"{'a': 1}"``, ``3`` -> ``"3"``); a list of text content blocks
    (``[{"type": "text", "text": ...}]``, which TRL passes to the template as multimodal content) -> their texts
    joined. Never raises (a ``__str__`` that raises gives the type's name)."""
    if isinstance(value, list) and value and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "".join(str(b.get("text", "")) for b in value)
    try:
        return str(value)
    except Exception:  # noqa: BLE001  (the user's object)
        return f"<{type(value).__name__}>"


def _failed(stats: ToolStats, why: str) -> str:
    stats.failures += 1
    return json.dumps({"error": why})


def tool_suffix_ids(tokenizer, tool_messages: list[dict], chat_template: str | None = None,
                    stops: list[int] | None = None) -> list[int]:
    """The token ids the chat template puts after an assistant turn that called tools: the ``tool`` messages
    (``{"role": "tool", "name", "content"}``), then the next assistant turn's generation prompt (TRL 1.16's
    ``_get_tool_suffix_ids``): the rendering of a dummy conversation with them, less its rendering without them,
    cut after the assistant turn's last end token (one of ``stops``; None: the tokenizer's EOS).

    Raises:
        ValueError: the template does not render the shorter conversation as a prefix of the longer one.
    """
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}]}]
    kwargs = {"chat_template": chat_template} if chat_template else {}
    prefix = tokenizer.apply_chat_template(dummy, tokenize=True, add_generation_prompt=False, return_dict=False,
                                           **kwargs)
    full = tokenizer.apply_chat_template(dummy + tool_messages, tokenize=True, add_generation_prompt=True,
                                         return_dict=False, **kwargs)
    ends = stops or [tokenizer.eos_token_id]
    eos = [i for i, t in enumerate(prefix) if t in ends]
    if eos:  # templates that write "<EOS>\n" after a turn: the sampled turn ends at its end token
        prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template does not render a conversation's first turns as a prefix of the whole "
                         "(tool results cannot be appended to the sampled tokens)")
    return full[len(prefix):]


@dataclass
class Trajectory:
    """One rollout's tokens after its tool turns: ``ids`` (every completion token: the model's own, as sampled,
    and the tool results' and template's between its turns), ``mask`` (1 on the model's tokens, 0 on the others:
    no loss, no KL, not counted) and ``turns`` (the transcript: ``{"role": "assistant", "content"}`` with the
    turn's ``tool_calls``, and ``{"role": "tool", "name", "content"}``)."""

    ids: list[int]
    mask: list[int]
    turns: list[dict]


def tool_turns(prompts: list[list[int]], completions: list[list[int]], generate_fn, tokenizer,
               tools: list[dict[str, Callable]], max_completion_length: int, max_iterations: int,
               timeout_s: float, stats: list[ToolStats], chat_template: str | None = None,
               stops: list[int] | None = None) -> list[Trajectory]:
    """Run the tool calls of each completion and let the model continue, turn by turn, every rollout of the batch
    together (the rollouts that call no tool drop out), up to ``max_iterations`` tool turns per rollout (TRL 1.16's
    ``_tool_call_loop``, token in, token out).

    A turn calls tools when it ends with an end token (``stops``: the tokenizer's EOS and the model's
    ``generation_config`` ones, :func:`finetune.engine.rollout.stop_token_ids`; None: the tokenizer's EOS) and
    :func:`parse_tool_calls` finds calls in it. Its
    calls run (:func:`call_tool`); their results' tokens (:func:`tool_suffix_ids`) are appended to the sampled
    tokens, and ``generate_fn`` continues every such rollout in one batch. A rollout whose results would take it past
    ``max_completion_length`` tokens stops before them (as TRL); a continuation is cut to what is left.

    Args:
        prompts: each rollout's prompt token ids (no padding).
        completions: each rollout's first turn, as sampled, up to and including its EOS (no padding).
        generate_fn: ``(inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]``, the new tokens of each
            input (up to and including an EOS), sampled as the first turn was.
        tokenizer: the run's tokenizer (its chat template renders the tool results).
        tools: per rollout, tool name -> function (an environment's methods are bound to the rollout's instance).
        max_completion_length: tokens a rollout's completion may hold in all (tool results included).
        max_iterations: tool turns per rollout at most (``train.grpo.max_tool_calling_iterations``).
        timeout_s: seconds a tool call may take (``train.grpo.tool_timeout_s``).
        stats: per rollout, the counts of its calls (:class:`ToolStats`), added to.
        chat_template: the template to render the results with (``data.chat_template``), else the tokenizer's.
        stops: the ids a turn ends at; None: the tokenizer's EOS.

    Returns:
        One :class:`Trajectory` per rollout, in order.
    """
    ends = stops or [tokenizer.eos_token_id]

    def turn(ids: list[int]) -> dict:
        ended = bool(ids) and ids[-1] in ends
        text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        calls = parse_tool_calls(text, tokenizer) if ended else []
        return {"role": "assistant", "content": text, "tool_calls": calls}

    out = [Trajectory(list(c), [1] * len(c), [turn(list(c))]) for c in completions]
    active = [i for i, t in enumerate(out) if t.turns[-1]["tool_calls"]]
    for _ in range(max_iterations):
        inputs, budgets, rows = [], [], []
        for i in active:
            results = [{"role": "tool", "name": call.get("name") or "unknown",
                        "content": call_tool(tools[i], call, timeout_s, stats[i])} for call in out[i].turns[-1]["tool_calls"]]
            suffix = tool_suffix_ids(tokenizer, results, chat_template, stops)
            if len(out[i].ids) + len(suffix) >= max_completion_length:
                continue  # no room for the results and a reply: the rollout ends with its calls
            out[i].ids += suffix
            out[i].mask += [0] * len(suffix)
            out[i].turns += results
            inputs.append(prompts[i] + out[i].ids)
            budgets.append(max_completion_length - len(out[i].ids))
            rows.append(i)
        if not rows:
            break
        new = generate_fn(inputs, max(budgets))
        active = []
        for i, ids, budget in zip(rows, new, budgets):
            ids = list(ids)[:budget]
            out[i].ids += ids
            out[i].mask += [1] * len(ids)
            out[i].turns.append(turn(ids))
            if out[i].turns[-1]["tool_calls"]:
                active.append(i)
    return out
