"""Tool calling for multi-turn ``grpo`` (``train.grpo.tools``): loading the tools, their schemas, finding a
completion's tool calls, running them, and the tokens of their results.

A tool is a Python function with type hints and a Google-style docstring, named ``path/to/file.py:function``
(TRL 1.16's ``GRPOTrainer(tools=[...])``; transformers' "passing tools"): its JSON schema comes from transformers'
:func:`~transformers.utils.get_json_schema`, and the tokenizer's chat template renders the schemas into the prompt
(``apply_chat_template(messages, tools=schemas)``). When a completion calls tools, each call is parsed
(:func:`parse_tool_calls`: the tokenizer's ``parse_response`` with its ``response_template``, or with the one TRL
1.16's ``add_response_schema`` gives a stock template it knows, e.g. Llama-3.1's bare ``{"name": ...,
"parameters": {...}}``; else the Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
SmolLM2's list of calls in one block and a ``"parameters"`` key included), run (:func:`call_tool`), and its result
is appended to the sampled tokens as the template renders a ``tool`` message (:func:`tool_suffix_ids`); the model
then continues. Token in, token out: the sampled tokens are never re-tokenized from text. ``--check`` renders a
tool call with the template and refuses a template whose calls the parser does not read back
(:func:`template_problem`).

A tool that raises, runs past ``train.grpo.tool_timeout_s``, is unknown, or gets arguments that are not a JSON
object returns ``{"error": ...}`` (JSON) to the model (as TRL does) and is counted (``tools/failure_frequency``); a
result that is not a string is sent as TRL 1.16 sends it, ``str(result)`` (a list of text content blocks: their
texts), and counted as ``non_text`` (not a failure).
No tool call ever stops a rank. Tools and environments run in the rank's worker processes
(:mod:`finetune.recipes.grpo.tool_worker`), so that a call past the timeout is stopped by killing its process, and the
next call starts another: a thread cannot be stopped, and one in C code holding the GIL (``(9**64)**64**64``) blocks
the rank, its timeout and its signal handlers (a preemption's SIGTERM could not checkpoint). A
``train.grpo.tools`` function runs in the rank's tool process (:class:`ToolProcess`). An environment's instances
(TRL 1.16's ``environment_factory``: one per rollout) live in the rank's environment process
(:func:`new_environment`); the rank holds a handle on each (:class:`RemoteEnvironment`) whose methods are the
rollout's tools and which the reward functions read as the instance (``env.get_reward()``, ``env.attribute``: JSON
values cross, nothing else; JSON both ways, so nothing read runs code). A call past the timeout stops that process
and loses every instance it held: their later tool calls return an error saying so, and their reads (``get_reward``
included) give None, a missing reward. The environment's own process keeps a hanging tool from losing the
environments' state. The probe instance ``--check`` and the schemas use (:func:`load_environment`,
:func:`environment_tools`) stays in the rank: it is only inspected, its methods never called. The parser accepts
brackets nested :data:`MAX_NESTING` deep at most (deeper is an error the model reads), and a result is known not to
fit from its length before it is tokenized.

The user's file is imported when the run starts and by ``--check``: the run config names it, so running it is what
the user asked for (as for reward functions, :mod:`finetune.recipes.common.rewards`).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from finetune.errors import ConfigError
from finetune.recipes.grpo import tool_worker

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""The Hermes / Qwen2.5 / Qwen3 tool-call block: a JSON object ``{"name": ..., "arguments": {...}}`` (or a list
of them: SmolLM2)."""

MAX_NESTING = 32
"""Brackets (``[``, ``{``) a turn's tool calls may nest at most; deeper is an error the model reads (Python's JSON
decoder raises ``RecursionError`` near 1,000)."""

LOAD_TIMEOUT_S = 120.0
"""Seconds the worker process may take to import a tool's file (not counted in ``train.grpo.tool_timeout_s``)."""

MAX_RESULT_BYTES = 64 << 20
"""A tool result's size at most (its JSON line from the worker); a larger one is an error."""


@dataclass(frozen=True)
class ToolProcess:
    """A ``train.grpo.tools`` function as :func:`call_tool` runs it: in the rank's worker process
    (:func:`worker`), so a call past its timeout can be stopped. ``spec`` is ``/absolute/file.py:name``; calling the
    object runs the function in this process, without a timeout."""

    spec: str
    function: Callable

    def __call__(self, **arguments):
        return self.function(**arguments)


@dataclass
class Tool:
    """A loaded tool: its name (the function's), the function, and its JSON schema (transformers'
    ``get_json_schema``: ``{"type": "function", "function": {"name", "description", "parameters"}}``)."""

    name: str
    function: ToolProcess
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

    from finetune.recipes.common.rewards import import_function

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
        path, _, attr = spec.rpartition(":")
        tools.append(Tool(name, ToolProcess(f"{Path(path).resolve()}:{attr}", fn), schema))
    return tools


def refuse_shadowing(tools: list[Tool], methods: list[Tool], environment: str,
                     key: str = "train.grpo.environment") -> None:
    """Refuse a ``train.grpo.tools`` function named like a method the environment offers (both would be offered:
    two schemas of one name, and a call would run only one of them).

    Raises:
        ConfigError: one line naming ``key``, the method and the tool.
    """
    for m in methods:
        for t in tools:
            if t.name == m.name:
                raise ConfigError(f"{key}: {environment.rpartition(':')[2]}.{m.name} has the name of the tool "
                                  f"{t.function.spec} (train.grpo.tools); rename one (an environment's public "
                                  f"methods are tools too; a leading underscore makes one private)")


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
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        # a property (or other data attribute) is no method: never read it (it may need reset() first)
        static = inspect.getattr_static(environment, name, None)
        if isinstance(static, (property, functools.cached_property)) or not callable(static) and not isinstance(
                static, (staticmethod, classmethod)):
            continue
        method = getattr(environment, name)
        if not callable(method):
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
    from finetune.recipes.common.rewards import import_function

    factory = import_function(spec, key, "not path/to/file.py:Factory (an environment)")
    try:
        probe = factory()
    except Exception as e:  # noqa: BLE001  (the user's code)
        raise ConfigError(f"{key}: {spec}() failed: {type(e).__name__}: {e}") from e
    environment_tools(probe, key)
    return factory


def template_problem(tokenizer, schemas: list[dict], chat_template: str | None = None,
                     stops: list[int] | None = None) -> str | None:
    """Why the chat template (``chat_template``, else the tokenizer's) cannot offer the tools whose JSON schemas
    are ``schemas`` (None when it can): it must render the schemas (each tool's name appears in the rendered
    prompt), an assistant turn with a tool call that :func:`parse_tool_calls` reads back as that call, and a
    ``tool`` message. ``stops``: the ids a turn ends at (None: the tokenizer's EOS)."""
    if not schemas:
        return None
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        return ("the tokenizer has no chat template; set data.chat_template (e.g. "
                "data/chat_templates/chatml_tools.jinja)")
    messages = [{"role": "user", "content": "x"}]
    name = schemas[0]["function"]["name"]
    arguments = _sample_arguments(schemas[0])
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}
    kwargs = {"chat_template": chat_template} if chat_template else {}
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        whole = tokenizer.apply_chat_template(messages + [call], tools=schemas, tokenize=False, **kwargs)
        tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": "1"}], chat_template, stops)
    except Exception as e:  # noqa: BLE001  (a Jinja error of the user's template)
        return f"the chat template cannot render tools, tool calls or tool results ({type(e).__name__}: {e})"
    missing = [n for n in (x["function"]["name"] for x in schemas) if n not in rendered]
    if missing:
        return (f"the chat template does not render the tools' schemas (no '{missing[0]}' in the prompt); use a "
                f"template with tools, e.g. data/chat_templates/chatml_tools.jinja")
    if whole.startswith(rendered):
        turn = whole[len(rendered):]
        ends = [tokenizer.convert_ids_to_tokens(t) for t in (stops or [tokenizer.eos_token_id])]
        cut = max((turn.find(e) + len(e) for e in ends if isinstance(e, str) and e in turn), default=len(turn))
        got = parse_tool_calls(turn[:cut], tokenizer, rendered, chat_template)
        if [(c["name"], c["arguments"]) for c in got] != [(name, arguments)]:
            return (f"the chat template writes a tool call as {turn[:cut][:80]!r}, which finetune reads as "
                    f"{[(c['name'], c['arguments'] or c['error']) for c in got]} (it reads the tokenizer's "
                    f"response_template, TRL's for a stock template, or Hermes <tool_call> blocks); use a template "
                    f"whose calls it reads, e.g. data/chat_templates/chatml_tools.jinja")
    return None


def _sample_arguments(schema: dict) -> dict:
    """One argument for the round trip of :func:`template_problem`: the first parameter, a value of its type."""
    props = schema["function"].get("parameters", {}).get("properties", {})
    by_type = {"string": "text", "integer": 1, "number": 1.5, "boolean": True, "array": [1], "object": {"k": 1}}
    return {n: by_type.get(p.get("type"), "text") for n, p in list(props.items())[:1]}


@functools.lru_cache(maxsize=16)
def _stock_response_template(chat_template: str) -> dict | None:
    """TRL 1.16's response template for a stock chat template it knows (``add_response_schema``), or None."""
    from trl.chat_template_utils import add_response_schema

    holder = types.SimpleNamespace(chat_template=chat_template)
    try:
        add_response_schema(holder)
    except ValueError:  # not a template TRL knows
        return None
    return getattr(holder, "response_template", None)


def response_template(tokenizer, chat_template: str | None = None) -> dict | None:
    """The response template that reads an assistant turn written with ``chat_template`` (else the tokenizer's):
    the tokenizer's own ``response_template`` (transformers 5.23) when the template is the tokenizer's, else TRL
    1.16's for a stock template it knows (``trl.chat_template_utils.add_response_schema``: Llama-3.1/3.2, Qwen2.5/3,
    GPT-OSS, ...); None for another template (the Hermes ``<tool_call>`` blocks are read)."""
    own = getattr(tokenizer, "chat_template", None)
    if (chat_template is None or chat_template == own) and getattr(tokenizer, "response_template", None):
        return tokenizer.response_template
    template = chat_template or own
    return _stock_response_template(template) if isinstance(template, str) else None


def _nesting(text: str) -> int:
    """How deep ``[`` and ``{`` nest in ``text`` (outside JSON strings: a ``"`` opens one only inside brackets)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
        elif ch == '"' and depth:
            in_string = True
    return deepest


def _error(why: str) -> dict:
    return {"name": None, "arguments": None, "error": why}


def parse_tool_calls(text: str, tokenizer=None, prefix: str = "", chat_template: str | None = None) -> list[dict]:
    """The tool calls of one assistant turn, in order: ``{"name": str | None, "arguments": dict | None, "error":
    str | None}`` each (``error`` when the call could not be read); an empty list when the turn calls nothing.

    With a response template (:func:`response_template`), the tokenizer's ``parse_response(text, schema,
    prefix=prefix)`` reads the turn (``text`` up to and including its end token: Llama-3.x's close pattern needs
    it; ``prefix``: the text before the turn, whose generation prompt the template anchors at). Not TRL's
    ``parse_response`` wrapper: it turns a call it cannot read into plain text, which would hide it from the model
    and from ``tools/failure_frequency``. Else the Hermes ``<tool_call>`` blocks (:data:`TOOL_CALL`): a JSON
    object, or a list of them (SmolLM2), its arguments under ``"arguments"`` or ``"parameters"`` (Llama-3.x).

    A call nesting brackets deeper than :data:`MAX_NESTING` is an error, not parsed (the JSON decoder recurses).
    """
    template = response_template(tokenizer, chat_template) if tokenizer is not None else None
    if template is not None:
        if _nesting(text) > MAX_NESTING:
            return [_error(f"the tool call nests brackets deeper than {MAX_NESTING} levels")]
        try:
            parsed = tokenizer.parse_response(text, template, prefix=prefix)
        except Exception as e:  # noqa: BLE001  (a malformed call: the model is told)
            return [_error(f"the tool call could not be parsed ({type(e).__name__}: {str(e).splitlines()[0]})")]
        calls = []
        for call in (parsed or {}).get("tool_calls") or []:
            calls += _calls(call.get("function", call) if isinstance(call, dict) else call)
        return calls
    calls = []
    for block in TOOL_CALL.findall(text):
        if _nesting(block) > MAX_NESTING:
            calls.append(_error(f"the tool call nests brackets deeper than {MAX_NESTING} levels"))
            continue
        try:
            obj = json.loads(block)
        except ValueError as e:
            calls.append(_error(f"the tool call is not JSON ({getattr(e, 'msg', e)})"))
            continue
        calls += _calls(obj)
    return calls


def _calls(obj) -> list[dict]:
    """A parsed call ``{"name", "arguments" | "parameters"}``, or a list of them (SmolLM2), as call dicts."""
    if isinstance(obj, list) and obj:
        return [c for item in obj for c in _calls(item)] if all(isinstance(i, dict) for i in obj) else \
            [_error("the tool call is not a JSON object or a list of them")]
    if not isinstance(obj, dict):
        return [_error("the tool call is not a JSON object")]
    return [_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))]


def _call(name, arguments) -> dict:
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        if _nesting(arguments) > MAX_NESTING:
            return _error(f"the tool call nests brackets deeper than {MAX_NESTING} levels")
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(name, str):
        return _error("the tool call names no tool")
    if not isinstance(arguments, dict):
        return {"name": name, "arguments": None, "error": "the tool call's arguments are not a JSON object"}
    return {"name": name, "arguments": arguments, "error": None}


class _Worker:
    """One of the rank's worker processes (:mod:`finetune.recipes.grpo.tool_worker`): started on the first request,
    killed and replaced when a request runs past its timeout, killed when the rank exits; a process forked from the
    rank starts its own. ``what`` names it in messages (``"tool"``, ``"environment"``).

    Environment instances are numbered by the rank (:attr:`next_id`), so it knows without asking which are gone: an
    instance made before the current process started was lost with the process that held it (:meth:`lost` says
    why), one numbered below :attr:`dropped` was dropped."""

    def __init__(self, what: str):
        self.what = what
        self.process: subprocess.Popen | None = None
        self.pid = os.getpid()
        self.loaded: set[str] = set()
        self.buffer = b""
        self.lock = threading.RLock()
        self.next_id = 0
        """The number the next environment instance gets."""
        self.born = 0
        """The first instance number of the current process (those below it were lost or dropped)."""
        self.dropped = 0
        """Instances numbered below this were dropped (:meth:`drop`)."""
        self.losses: list[tuple[int, str]] = []
        """Per process that ended holding instances: (the instance numbers below which it held them, why)."""

    def kill(self, why: str | None = None) -> None:
        """Stop the process (the rank's own only: never one a forked parent started); the instances it held are
        lost, for ``why`` (None: it ended)."""
        with self.lock:
            if self.pid != os.getpid():  # forked: the process is the parent's
                self.process, self.pid = None, os.getpid()
                why = why or "it was made in another process (the rank forked)"
            if self.next_id > max(self.born, self.dropped):
                self.losses.append((self.next_id, why or f"the {self.what} process ended"))
            if self.process is not None:
                self.process.kill()
                self.process.wait()
                for pipe in (self.process.stdin, self.process.stdout):
                    pipe.close()
            self.process, self.loaded, self.buffer, self.born = None, set(), b"", self.next_id

    def lost(self, number: int) -> str | None:
        """Why environment instance ``number`` is gone, or None while the process holds it."""
        if number < self.dropped:
            return "it was dropped at the end of its step"
        return next((why for below, why in self.losses if number < below), None)

    def ask(self, request: dict, timeout_s: float, why: str | None = None) -> dict | None:
        """The worker's answer, or None when it did not answer within ``timeout_s`` (it is then killed, its
        instances lost for ``why``)."""
        with self.lock:
            if self.pid != os.getpid() or self.process is None or self.process.poll() is not None:
                code = None if self.process is None or self.pid != os.getpid() else self.process.poll()
                self.kill(None if code is None else f"the {self.what} process ended (exit code {code})")
                self.process = subprocess.Popen([sys.executable, "-u", tool_worker.__file__], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, cwd=os.getcwd())
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except OSError:  # it died
                self.kill()
                return {"error": f"the {self.what} process ended"}
            fd, deadline = self.process.stdout.fileno(), time.monotonic() + timeout_s
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    self.kill(why or f"a call ran past {timeout_s:g} s")
                    return None
                chunk = os.read(fd, 1 << 20)
                if not chunk or len(self.buffer) > MAX_RESULT_BYTES:
                    try:
                        code = self.process.wait(0 if chunk else 5)  # at the end of its output it is exiting
                    except subprocess.TimeoutExpired:
                        code = None
                    ended = f"the {self.what} process ended (exit code {code})"
                    longer = f"the {self.what}'s result is longer than {MAX_RESULT_BYTES} bytes"
                    self.kill(longer if chunk else ended)
                    return {"error": longer if chunk else ended}
                self.buffer += chunk
            line, _, self.buffer = self.buffer.partition(b"\n")
            return json.loads(line)

    def load(self, spec: str) -> str | None:
        """Import ``spec``'s file in the process (once per process, within :data:`LOAD_TIMEOUT_S`); None, or why
        it failed (``"failed: Type: ..."``, ``"took more than ... s"``)."""
        with self.lock:
            if spec in self.loaded and self.pid == os.getpid() and self.process is not None \
                    and self.process.poll() is None:
                return None
            answer = self.ask({"load": spec}, LOAD_TIMEOUT_S, f"importing {spec} took more than {LOAD_TIMEOUT_S:g} s")
            if answer is None or "error" in answer:
                return f"failed: {answer['error']}" if answer else f"took more than {LOAD_TIMEOUT_S:g} s"
            self.loaded.add(spec)
            return None

    def call(self, spec: str, arguments: dict, timeout_s: float) -> dict | None:
        failed = self.load(spec)
        if failed:
            return {"error": f"importing the tool {failed}"}
        return self.ask({"call": spec, "arguments": arguments}, timeout_s)

    def drop(self) -> None:
        """Forget every environment instance made so far (the process frees them; their handles say so)."""
        with self.lock:
            if self.process is not None and self.pid == os.getpid() and self.process.poll() is None \
                    and self.next_id > max(self.born, self.dropped):
                self.ask({"drop_below": self.next_id}, LOAD_TIMEOUT_S, "dropping the instances of a step took "
                                                                       f"more than {LOAD_TIMEOUT_S:g} s")
            self.dropped = self.next_id
            self.losses = [(below, why) for below, why in self.losses if below > self.dropped]


_WORKER = _Worker("tool")
"""The rank's ``train.grpo.tools`` process."""
_ENVIRONMENTS = _Worker("environment")
"""The rank's ``train.grpo.environment`` process (its own, so that a tool that hangs never takes the environments'
state with it)."""
atexit.register(_WORKER.kill)
atexit.register(_ENVIRONMENTS.kill)


class EnvironmentFailed(Exception):
    """An environment instance could not be made (:func:`new_environment`); the message is one line."""


class EnvironmentCallError(RuntimeError):
    """A method or property of an environment instance raised in the environment process (the message names it
    and the exception, one line)."""


@dataclass(frozen=True)
class _Handle:
    worker: _Worker
    number: int
    name: str
    """The instance's class name."""
    methods: frozenset[str]
    timeout_s: float


def _lost_error(why: str) -> dict:
    return {"error": f"the environment was lost: {why}"}


class RemoteMethod:
    """A method of a :class:`RemoteEnvironment`: called by a reward function (``env.get_reward()``), it runs in the
    environment process and returns its value (JSON: numbers, text, lists, dicts, None; a NumPy or PyTorch scalar as
    its Python number); on a lost instance, or past the instance's timeout (which stops the process: the rank's other
    instances are lost with it), it returns None, a missing value (TRL's for a reward). As a tool, :func:`call_tool`
    runs it (:meth:`tool_call`).

    Raises (when called):
        TypeError: an argument or the result is not a JSON value (one line: environments run in the environment
            process, and only JSON crosses).
        AttributeError: the instance has no such attribute.
        EnvironmentCallError: the method raised.
    """

    def __init__(self, environment: RemoteEnvironment, name: str):
        self.__self__, self.__name__ = environment, name

    def __repr__(self) -> str:
        return f"<method {self.__self__._remote.name}.{self.__name__} in the environment process>"

    def __call__(self, *args, **kwargs):
        h = self.__self__._remote
        where = f"{h.name}.{self.__name__}()"
        if h.worker.lost(h.number):
            return None
        try:
            json.dumps([args, kwargs])
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: an argument cannot be passed ({e}); environments run in the environment "
                            f"process, and only JSON values (numbers, text, lists, dicts, None) cross") from None
        answer = h.worker.ask({"invoke": self.__name__, "id": h.number, "args": list(args), "kwargs": kwargs},
                              h.timeout_s, _ran_past(h.timeout_s))
        return _read(answer, h, where)

    def tool_call(self, arguments: dict, timeout_s: float) -> dict | None:
        """The method run as a tool (:func:`call_tool`): the worker's answer (``{"text"[, "non_text"]}`` or
        ``{"error"}``; the instance lost: ``{"error": "the environment was lost: ..."}``), or None when it did not
        return within ``timeout_s`` (the process is stopped: the rank's other instances are lost with it)."""
        h = self.__self__._remote
        why = h.worker.lost(h.number)
        if why:
            return _lost_error(why)
        answer = h.worker.ask({"invoke": self.__name__, "id": h.number, "kwargs": arguments, "text": True},
                              timeout_s, _ran_past(timeout_s))
        if answer is not None and "missing" in answer:
            return {"error": f"AttributeError: {answer['missing']}"}
        return answer


def _ran_past(timeout_s: float) -> str:
    return (f"a call of another rollout, or of this one, ran past {timeout_s:g} s (train.grpo.tool_timeout_s), so "
            f"the process holding the rank's environments was stopped")


def _read(answer: dict | None, h: _Handle, where: str):
    """A value the environment process sent for ``where`` (a read or a call by a reward function)."""
    if answer is None or h.worker.lost(h.number):
        if answer is None:
            from finetune.logs import logger

            logger.warning(f"train.grpo.environment: {where} did not return within {h.timeout_s:g} s "
                           f"(train.grpo.tool_timeout_s); the environment process was stopped, and reads of its "
                           f"instances give None (a missing reward)")
        return None
    if "value" in answer:
        return answer["value"]
    if "not_json" in answer:
        raise TypeError(f"{where} {'returned' if where.endswith(')') else 'holds'} a value of type "
                        f"'{answer['not_json']}', which cannot be read from the rank: environments run in the "
                        f"environment process, and only JSON values (numbers, text, lists, dicts, None) cross")
    if "missing" in answer:
        raise AttributeError(answer["missing"])
    raise EnvironmentCallError(f"{where} raised {answer['error']}")


class RemoteEnvironment:
    """A handle on one environment instance (TRL 1.16's ``environment_factory``) that lives in the rank's environment
    process (:func:`new_environment`), so that every call of it can be stopped: the rollout's tools are its methods
    (:class:`RemoteMethod`, run by :func:`call_tool`), and a reward function that receives it in ``environments``
    reads it as the instance: ``env.get_reward()``, ``env.some_attribute`` (a JSON value, read in that process; a
    callable attribute gives a :class:`RemoteMethod`). An instance lost because its process was stopped (a call past
    ``train.grpo.tool_timeout_s``) reads None, and its methods return None; its tool calls return an error the model
    reads. Attributes are read-only from the rank.

    Raises (reading an attribute):
        TypeError: the value is not JSON (one line naming the attribute).
        AttributeError: the instance has no such attribute.
        EnvironmentCallError: a property raised.
    """

    def __init__(self, handle: _Handle):
        object.__setattr__(self, "_remote", handle)

    def __repr__(self) -> str:
        return f"<{self._remote.name} environment {self._remote.number} in the environment process>"

    def __setattr__(self, name, value):
        raise TypeError(f"{self._remote.name}.{name} cannot be set from the rank: environments run in the environment "
                        f"process; change their state in their own methods")

    def __getattr__(self, name: str):
        if name == "_remote" or name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        h = self._remote
        if name in h.methods:
            return RemoteMethod(self, name)
        if h.worker.lost(h.number):
            return None
        answer = h.worker.ask({"get": name, "id": h.number}, h.timeout_s, _ran_past(h.timeout_s))
        if answer is not None and "callable" in answer:
            return RemoteMethod(self, name)
        return _read(answer, h, f"{h.name}.{name}")


def new_environment(spec: str, row: dict, timeout_s: float) -> tuple[RemoteEnvironment, str | None]:
    """A new environment instance in the rank's environment process: ``Factory()`` (``spec`` is
    ``/absolute/file.py:Factory``), then ``reset(**row)`` (TRL 1.16's ``environment_factory``), together within
    ``timeout_s`` (the file's import is not counted).

    Returns:
        ``(environment, observation)``: the instance's handle, and what ``reset`` returned (None or text).

    Raises:
        EnvironmentFailed: one line: a value of ``row`` that is not JSON, the file does not import there, the
            factory or ``reset`` raised or ran past ``timeout_s``, or ``reset`` returned other than None or text.
    """
    factory = spec.rpartition(":")[2]
    for k, v in row.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            raise EnvironmentFailed(f"the row's column '{k}' holds a value of type '{type(v).__name__}', which "
                                    f"cannot be passed to {factory}.reset: environments run in the environment "
                                    f"process, and only JSON values (numbers, text, lists, dicts, None) cross") \
                from None
    worker, call = _ENVIRONMENTS, f"{factory}.reset({', '.join(row)})"
    with worker.lock:
        failed = worker.load(spec)
        if failed:
            raise EnvironmentFailed(f"importing {spec} in the environment process {failed}")
        number = worker.next_id  # counted once made: a failed one is not, and a restarted process holds it
        answer = worker.ask({"create": spec, "id": number, "row": row}, timeout_s,
                            f"{call} ran past {timeout_s:g} s (train.grpo.tool_timeout_s)")
        if answer is not None and "observation" in answer:
            worker.next_id += 1
    if answer is None:
        raise EnvironmentFailed(f"{call} did not return within {timeout_s:g} s (train.grpo.tool_timeout_s)")
    if answer.get("stage") == "factory":
        raise EnvironmentFailed(f"{factory}() failed: {answer['error']}")
    if "error" in answer:
        raise EnvironmentFailed(f"{answer.get('class', factory)}.reset({', '.join(row)}) failed: {answer['error']}")
    if "observation_type" in answer:
        raise EnvironmentFailed(f"{answer['class']}.reset returned a {answer['observation_type']}; return None or the "
                                f"first observation as text (it is appended to the prompt's last message)")
    handle = _Handle(worker, number, answer["class"], frozenset(answer["methods"]), timeout_s)
    return RemoteEnvironment(handle), answer["observation"]


def drop_environments() -> None:
    """Free every environment instance made so far in the rank's environment process (called before a batch of
    rollouts makes its own, so the process does not grow); their handles then read None."""
    _ENVIRONMENTS.drop()


def call_tool(tools: dict[str, Callable], call: dict, timeout_s: float, stats: ToolStats) -> str:
    """Run one parsed call and return what the model reads: the result as text, or ``{"error": ...}`` (JSON) for a
    call that failed. Counts it in ``stats``. Never raises.

    A :class:`ToolProcess` runs in the rank's tool process, an environment's method (:class:`RemoteMethod`) in its
    environment process: a call past ``timeout_s`` is stopped by killing that process (the next call starts
    another; the environment instances it held are lost: their calls return an error saying so). Another callable
    (code that builds its own tool map, tests) runs in the rank's thread, without a timeout."""
    stats.calls += 1
    name = call.get("name")
    stats.per_tool[name or "<unparsed>"] = stats.per_tool.get(name or "<unparsed>", 0) + 1
    if call.get("error"):
        return _failed(stats, call["error"])
    if name not in tools:
        return _failed(stats, f"unknown tool '{name}'; the tools are: {', '.join(sorted(tools))}")
    fn = tools[name]
    if isinstance(fn, (ToolProcess, RemoteMethod)):
        answer = _WORKER.call(fn.spec, call["arguments"], timeout_s) if isinstance(fn, ToolProcess) else \
            fn.tool_call(call["arguments"], timeout_s)
        if answer is None:
            return _failed(stats, f"the tool '{name}' did not return within {timeout_s:g} s")
    else:
        try:
            answer = tool_worker._text(fn(**call["arguments"]))
        except (Exception, SystemExit) as e:  # noqa: BLE001  (any failure of the user's tool is the model's to read)
            answer = {"error": f"{type(e).__name__}: {e}"}
    if "error" in answer:
        return _failed(stats, answer["error"])
    stats.non_text += bool(answer.get("non_text"))
    return answer["text"]


def _failed(stats: ToolStats, why: str) -> str:
    stats.failures += 1
    return json.dumps({"error": why})


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer) -> int:
    """Characters one token of ``tokenizer`` decodes to at most (its longest vocabulary entry: byte-level BPE
    writes one character per byte, SentencePiece one per character): a text of ``n`` characters is at least
    ``n / _longest_token`` tokens."""
    return max([len(t) for t in tokenizer.get_vocab()] + [1])


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
    cut: bool = False
    """The rollout ended because its last calls' results did not fit in ``max_completion_length``: truncated, not
    terminated (``mask_truncated_completions`` applies to it, as to a rollout cut by the length limit)."""


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
    ``max_completion_length`` tokens stops before them (as TRL) and is marked ``cut`` (truncated; TRL counts it as
    terminated by its EOS); results whose characters cannot fit are not tokenized (:func:`_longest_token`). A
    continuation is cut to what is left.

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

    def turn(ids: list[int], before: list[int]) -> dict:
        ended = bool(ids) and ids[-1] in ends
        text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        calls = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=False), tokenizer,
                                 tokenizer.decode(before, skip_special_tokens=False), chat_template) if ended else []
        return {"role": "assistant", "content": text, "tool_calls": calls}

    out = [Trajectory(list(c), [1] * len(c), [turn(list(c), list(p))]) for p, c in zip(prompts, completions)]
    active = [i for i, t in enumerate(out) if t.turns[-1]["tool_calls"]]
    for _ in range(max_iterations):
        inputs, budgets, rows = [], [], []
        for i in active:
            results = [{"role": "tool", "name": call.get("name") or "unknown",
                        "content": call_tool(tools[i], call, timeout_s, stats[i])} for call in out[i].turns[-1]["tool_calls"]]
            room = max_completion_length - len(out[i].ids)
            if sum(len(r["content"]) for r in results) > room * _longest_token(tokenizer):
                out[i].cut = True  # more characters than `room` tokens can hold: never tokenized
                continue
            suffix = tool_suffix_ids(tokenizer, results, chat_template, stops)
            if len(suffix) >= room:
                out[i].cut = True  # no room for the results and a reply: the rollout ends with its calls
                continue
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
            out[i].turns.append(turn(ids, prompts[i] + out[i].ids[:len(out[i].ids) - len(ids)]))
            if out[i].turns[-1]["tool_calls"]:
                active.append(i)
    return out
