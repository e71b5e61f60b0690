"""The instruction-data forms ``sft`` reads, recognised from a parquet file's columns and turned into the recipe's
two forms (a conversation of ``{role, content}`` messages, or a prompt/response pair of text).

The forms, as the peers name them:

* **messages** (OpenAI / TRL conversational): a ``messages`` column, a list of ``{role, content}`` per row.
* **ShareGPT** (LLaMA-Factory, axolotl): a ``conversations`` column, a list of ``{from, value}`` per row; ``from``
  is ``human``/``user``, ``gpt``/``assistant``/``model``/``chatgpt``/``bard``, ``system``, ``function_call`` (the
  value is the call's JSON ``{name, arguments}``: an assistant turn with that tool call) or ``observation``/``tool``
  (the tool's result); an optional ``system`` column of text is the conversation's system message (LLaMA-Factory's).
* **Alpaca** (Stanford Alpaca, LLaMA-Factory): ``instruction`` and ``output`` columns, optional ``input`` (joined to
  the instruction with a newline when not empty, as LLaMA-Factory does), ``system`` (text) and ``history`` (a list
  of ``[instruction, output]`` pairs of earlier turns).
* **prompt-completion** (TRL): ``prompt`` and ``completion`` columns, both text (a prompt/response pair) or both
  lists of messages (the prompt's messages then the completion's; only the completion's assistant turns are
  trained, so a prompt may hold none).

Explicit column keys win (``data.messages_column``, ``data.prompt_column`` with ``data.response_column``); with none
set and ``data.format: auto``, the form is recognised from the first training file's schema and every file must
have the same one. :func:`resolve` says which, once per process, in one log line.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from finetune.config import DataConfig
from finetune.data.dataset import expand_files
from finetune.errors import ConfigError
from finetune.logs import logger

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "bard": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool", "function_call": "assistant"}
"""ShareGPT's ``from`` tags and the role each becomes (LLaMA-Factory's ``human``/``gpt``/``observation``/
``function_call``/``system`` and the other spellings found in public ShareGPT-form sets)."""

ACCEPTED = ("messages (a column 'messages' of {role, content} lists), ShareGPT (a column 'conversations' of "
            "{from, value} lists), Alpaca (columns 'instruction' and 'output', optional 'input'), prompt-completion "
            "(columns 'prompt' and 'completion')")
NAMES = {"messages": "messages", "sharegpt": "ShareGPT", "alpaca": "Alpaca", "prompt_completion": "prompt-completion",
         "pair": "prompt/response"}


@dataclass(frozen=True)
class Form:
    """How a data config's rows are read."""

    name: str
    """``messages``, ``sharegpt``, ``alpaca``, ``prompt_completion`` (conversational: lists of messages) or ``pair``
    (prompt and response text: ``data.prompt_column``/``response_column``, or TRL's prompt-completion as text)."""
    columns: tuple[str, ...]
    """The parquet columns read, in order (for ``pair``: prompt, response)."""

    @property
    def chat(self) -> bool:
        """Rows become conversations (rendered with the chat template), not prompt/response text."""
        return self.name != "pair"


def _struct_fields(field_type: pa.DataType) -> set[str]:
    """The field names of a ``list<struct<...>>`` column, else an empty set."""
    if pa.types.is_list(field_type) or pa.types.is_large_list(field_type):
        value = field_type.value_type
        if pa.types.is_struct(value):
            return {value.field(i).name for i in range(value.num_fields)}
    return set()


def detect(schema: pa.Schema) -> str | None:
    """The form of a file with ``schema`` (None when no form fits): ``messages``, ``sharegpt``, ``alpaca`` or
    ``prompt_completion`` (text or messages, told apart by :func:`form_of`). A list column of ``{from, value}`` is
    ShareGPT whatever its name (``conversations`` or ``messages``), one of ``{role, content}`` is messages."""
    names = set(schema.names)
    for col in ("conversations", "messages"):
        if col in names:
            fields = _struct_fields(schema.field(col).type)
            if {"from", "value"} <= fields:
                return "sharegpt"
            if {"role", "content"} <= fields:
                return "messages"
    if {"instruction", "output"} <= names:
        return "alpaca"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    return None


def form_of(name: str, schema: pa.Schema, d: DataConfig) -> Form:
    """The :class:`Form` of the form ``name`` in a file with ``schema`` (the optional columns it has). The
    conversation column of ``messages``/``sharegpt`` is ``data.messages_column``, else the one of
    ``conversations``/``messages`` whose turns have the form's fields (a ``conversations`` column of text beside a
    ``messages`` column of ``{role, content}`` lists is not the one read)."""
    names = set(schema.names)
    if name in ("messages", "sharegpt"):
        shape = {"from", "value"} if name == "sharegpt" else {"role", "content"}
        candidates = [c for c in ("conversations", "messages") if c in names]
        col = d.messages_column or next((c for c in candidates if shape <= _struct_fields(schema.field(c).type)),
                                        next(iter(candidates), "conversations" if name == "sharegpt" else "messages"))
        return Form(name, (col,) + (("system",) if name == "sharegpt" and "system" in names else ()))
    if name == "alpaca":
        return Form(name, ("instruction", "output") + tuple(c for c in ("input", "system", "history") if c in names))
    prompt, completion = d.prompt_column or "prompt", d.response_column or "completion"
    if prompt in names and (pa.types.is_list(schema.field(prompt).type)
                            or pa.types.is_large_list(schema.field(prompt).type)):
        return Form("prompt_completion", (prompt, completion))
    return Form("pair", (prompt, completion))


def resolve(d: DataConfig) -> Form:
    """How ``d``'s rows are read: the explicit column keys, else ``data.format``, else the form recognised from the
    files' schemas (logged once per process: the form, the columns, the files and rows).

    Raises:
        ConfigError: one line: no form fits a file (the columns found and the forms accepted), the files have
            different forms, or ``data.format`` names a form a file does not have.
    """
    if d.format == "auto" and d.messages_column:
        return Form("messages", (d.messages_column,))
    if d.format == "auto" and (d.prompt_column or d.response_column):
        return Form("pair", (d.prompt_column, d.response_column))
    patterns = tuple(str(f) for f in list(d.train_files) + list(d.validation_files))
    return _resolve(patterns, d.format, d.messages_column, d.prompt_column, d.response_column)


@functools.lru_cache(maxsize=64)
def _resolve(patterns: tuple[str, ...], fmt: str, messages_column: str, prompt_column: str,
             response_column: str) -> Form:
    d = DataConfig(format=fmt, messages_column=messages_column, prompt_column=prompt_column,
                   response_column=response_column)
    files = expand_files(list(patterns), "data.train_files", [])
    key = "data.train_files" if files else "data.format"
    found: dict[str, str | None] = {}
    schemas, rows = {}, 0
    for f in files:
        try:
            footer = pq.ParquetFile(f)
        except Exception:  # noqa: BLE001  (a missing or unreadable file: reported by the file checks)
            continue
        schemas[f], rows = footer.schema_arrow, rows + footer.metadata.num_rows
        found[f] = detect(schemas[f])
    if not schemas:
        raise ConfigError(f"{key}: sft reads {ACCEPTED}, or the columns data.messages_column, or "
                          f"data.prompt_column and data.response_column name; no readable file to recognise one in")
    first = next(iter(schemas))
    name = fmt if fmt != "auto" else found[first]
    if name is None:
        raise ConfigError(f"{key}: '{first}' has the columns {', '.join(schemas[first].names)}: no form sft reads; "
                          f"it reads {ACCEPTED}; or set data.messages_column, or data.prompt_column and "
                          f"data.response_column")
    forms = {f: form_of(name, s, d) for f, s in schemas.items()}
    for f, s in schemas.items():
        if fmt == "auto" and found[f] != name:
            raise ConfigError(f"{key}: '{f}' is {NAMES.get(found[f] or '', 'in no form sft reads')} (columns: "
                              f"{', '.join(s.names)}) but '{first}' is {NAMES[name]}: one form per run (convert the "
                              f"files, or train on each as a source of data.sources)")
        missing = [c for c in forms[f].columns if c not in s.names]
        if missing or forms[f].name != forms[first].name:
            raise ConfigError(f"data.format: '{f}' is not {NAMES[name]}: it has the columns {', '.join(s.names)}"
                              f"{' (no ' + ', '.join(missing) + ')' if missing else ''}; sft reads {ACCEPTED}")
    form = forms[first]
    for f in schemas:
        if forms[f].columns != form.columns:  # an optional column (input, system, history) in some files only
            raise ConfigError(f"{key}: '{f}' has the {NAMES[name]} columns {', '.join(forms[f].columns)} but "
                              f"'{first}' has {', '.join(form.columns)}; give every file the same columns (an empty "
                              f"'input' or 'system' is the same as none)")
    how = "recognised" if fmt == "auto" else "data.format"
    target = "conversations" if form.chat else "prompt/response pairs"
    logger.info(f"sft: {NAMES[name]} form ({how}; columns {', '.join(form.columns)}) in {len(schemas)} file(s), "
                f"{rows:,} rows: read as {target}")
    return form


def _alpaca(row: dict) -> list[dict]:
    messages = []
    if isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": row["system"]})
    for turn in row.get("history") or []:
        if not isinstance(turn, (list, tuple)) or len(turn) != 2 or not all(isinstance(t, str) for t in turn):
            raise ValueError("a 'history' entry that is not an [instruction, output] pair of text")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    instruction, extra = row.get("instruction"), row.get("input")
    if not isinstance(instruction, str) or not isinstance(row.get("output"), str):
        raise ValueError("a row whose 'instruction' or 'output' is not text")
    prompt = "\n".join(p for p in (instruction, extra) if isinstance(p, str) and p)
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def _sharegpt_turn(turn) -> dict:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or turn.get("from") not in SHAREGPT_ROLES:
        tag = turn.get("from") if isinstance(turn, dict) else type(turn).__name__
        raise ValueError(f"a turn with 'from' {tag!r} (known: {', '.join(SHAREGPT_ROLES)}) or a 'value' that is not "
                         f"text")
    if turn["from"] == "function_call":
        try:
            call = json.loads(turn["value"])
        except json.JSONDecodeError:
            raise ValueError("a function_call turn whose value is not JSON text") from None
        if not isinstance(call, dict) or "name" not in call:
            raise ValueError("a function_call turn whose value is not a JSON object with a 'name'")
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}]}
    return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}


def _sharegpt(row: dict, column: str) -> list[dict]:
    """A ShareGPT row as messages. Not TRL's ``maybe_convert_to_chatml``: it renames ``from``/``value`` to
    ``role``/``content`` but keeps ShareGPT's tags as roles (``human``, ``gpt``, ``observation``, ``function_call``),
    which chat templates reject or render as unknown roles, and it changes the row in place."""
    turns = row.get(column)
    if not isinstance(turns, (list, tuple)):
        raise ValueError(f"a row whose '{column}' is not a list of {{from, value}} turns")
    messages = [_sharegpt_turn(t) for t in turns]
    system = row.get("system")
    if isinstance(system, str) and system.strip() and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def to_messages(form: Form, row: dict):
    """Row ``row`` (the values of ``form.columns``) as the conversation ``sft`` trains on: a list of ``{role,
    content}`` messages (``tool_calls`` on a ShareGPT ``function_call`` turn); for conversational prompt-completion,
    ``(prompt, completion)``, two lists of messages. The value as it is for ``messages`` (checked by the recipe).

    Raises:
        ValueError: the row does not fit the form (the reason, for a line naming the file and row).
    """
    if form.name == "messages":
        return row[form.columns[0]]
    if form.name == "sharegpt":
        return _sharegpt(row, form.columns[0])
    if form.name == "alpaca":
        return _alpaca(row)
    if form.name == "prompt_completion":
        prompt, completion = row[form.columns[0]], row[form.columns[1]]
        if not isinstance(prompt, (list, tuple)) or not isinstance(completion, (list, tuple)):
            raise ValueError("a row whose prompt or completion is not a list of messages")
        return list(prompt), list(completion)
    raise ValueError(f"the {form.name} form has no conversation")
