"""Prompt/response and chat examples, as ``sft`` trains on them and ``distill``, ``dpo``, ``kto``, ``grpo`` and
``vlm_sft`` render their prompts: the forms (:func:`form`), rendering a conversation with ``data.chat_template`` or the
tokenizer's own template (:func:`template_text`, :func:`chat_template`, :func:`prompt_ids`), the answer masks (every
assistant turn trained, system, user and template tokens -100: :func:`encode_messages`, :func:`encode_pair`),
best-fit-decreasing packing (:func:`pack`, :class:`SftExamples`, :class:`PackedCollator`) and the checks of rows and
templates before any model is built (:class:`TemplateCheck`, :func:`check_labels`, :func:`message_problem`,
:func:`tokenizer_template_problem`). What each form and setting means: :mod:`finetune.recipes.sft`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import jinja2
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

from finetune.config import DataConfig, RunConfig
from finetune.data import formats
from finetune.data.batch import padded_length
from finetune.data.dataset import default_cache_dir, file_id, file_schemas, fingerprint, string_type
from finetune.errors import ConfigError
from finetune.recipes import pad_with_eos

MODEL_CLASS = AutoModelForCausalLM

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def form(data_cfg: DataConfig) -> str:
    """``"chat"`` for conversations (``data.messages_column``, or a ShareGPT, Alpaca, messages or conversational
    prompt-completion file: :func:`finetune.data.formats.resolve`), else ``"pair"`` (prompt/response text)."""
    return "chat" if formats.resolve(data_cfg).chat else "pair"


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads."""
    read = formats.resolve(data_cfg)
    return list(read.columns) + ([data_cfg.tools_column] if read.chat and data_cfg.tools_column else [])


def cache_key(data_cfg: DataConfig) -> dict:
    """Settings besides the files, columns and tokenizer that decide the tokenized rows (the template's text, the
    rows' form)."""
    return {"form": form(data_cfg), "format": formats.resolve(data_cfg).name, "truncation": data_cfg.truncation,
            "packing": data_cfg.packing,
            "chat_template": template_text(data_cfg) if form(data_cfg) == "chat" else None}


def conversation(read: formats.Form, row: dict) -> tuple[list[dict], int]:
    """A row of a chat form as ``(messages, first)``: the conversation and the index of its first message that may
    be trained (0; for conversational prompt-completion, the completion's first: TRL trains the completion only).

    Raises:
        ValueError: the row does not fit the form (:func:`finetune.data.formats.to_messages`).
    """
    messages = formats.to_messages(read, row)
    if isinstance(messages, tuple):
        prompt, completion = messages
        return prompt + completion, len(prompt)
    return messages, 0


def prepare_model_config(model_config, data_cfg: DataConfig):
    """Packing: ``use_cache = False`` in the model config, for training only (the export's ``config.json`` and
    ``generation_config.json`` get the source model's ``use_cache`` back:
    :func:`finetune.lifecycle.export.source_use_cache`).

    transformers derives the block-diagonal mask from ``position_ids`` only when the forward has no KV cache,
    and Llama/Qwen models create one on every forward (training too) while ``config.use_cache`` is true: the
    packed examples would then attend to each other (measured: loss off by 0.27 on three short examples).
    """
    if data_cfg.packing:
        model_config.use_cache = False
    return model_config


def prepare_tokenizer(tokenizer):
    """EOS as the pad token when there is none, right padding (positions start at 0 in every unpacked row).

    Raises:
        ConfigError: the tokenizer has no EOS token (it ends every answer).
    """
    tokenizer = pad_with_eos(tokenizer, "sft")
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"model.tokenizer_path: tokenizer '{tokenizer.name_or_path}' has no EOS token, which sft "
                          f"puts after every answer; use a tokenizer with an EOS token")
    tokenizer.padding_side = "right"
    return tokenizer


def template_text(data_cfg: DataConfig) -> str | None:
    """``data.chat_template`` as Jinja text: the string itself when it holds ``{%``/``{{``, else the file it names.

    Raises:
        ConfigError: the named file does not exist.
    """
    t = data_cfg.chat_template
    if not t:
        return None
    if "{%" in t or "{{" in t:
        return t
    path = Path(t).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.chat_template: '{t}' is neither a Jinja template (no '{{%' or '{{{{') nor a file "
                          f"(paths are relative to the working directory; the shipped one is "
                          f"data/chat_templates/chatml.jinja)")
    return path.read_text()


def chat_template(data_cfg: DataConfig, tokenizer) -> str:
    """The Jinja chat template the chat form renders with: ``data.chat_template``, else the tokenizer's.

    Raises:
        ConfigError: neither exists (nothing is guessed), or the named file is missing.
    """
    template = template_text(data_cfg) or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        if data_cfg.messages_column:
            what = f"data.messages_column '{data_cfg.messages_column}'"
        else:
            try:
                what = f"the conversations of the {formats.NAMES[formats.resolve(data_cfg).name]} file(s)"
            except ConfigError:  # reported by the form's own check
                what = "the conversations of the data files"
        raise ConfigError(f"data.chat_template: tokenizer '{tokenizer.name_or_path}' has no chat template to render "
                          f"{what}; set data.chat_template to a Jinja template or a file (e.g. "
                          f"data/chat_templates/chatml.jinja, ChatML-style)")
    return template


def message_problem(messages) -> str | None:
    """Why ``messages`` is not a list of ``{role, content}`` dicts with string values; None when it is."""
    if not isinstance(messages, (list, tuple)):
        return f"a {type(messages).__name__}, not a list of {{role, content}} messages"
    if not messages:
        return "an empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is {m!r:.80}, not {{role: str, content: str}}"
    return None


def row_tools(value) -> list[dict] | None:
    """A ``data.tools_column`` value as the list of tool JSON schemas ``apply_chat_template(tools=...)`` takes:
    the list itself, or parsed from its JSON text; None for a null, empty or ``"[]"`` value (no tools).

    Raises:
        ValueError: text that is not JSON, or a value that is not a list of dicts (one line, for the caller).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"{value!r:.80} is not a list of tool JSON schemas ({{type, function}} dicts)")
    return list(value) or None


def has_answer(messages) -> bool:
    """True when the conversation has an assistant turn."""
    return any(m["role"] == "assistant" for m in messages)


def encode_pair(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of one prompt/response example (lists of int, same length).

    ``ids = tokens(prompt, with special tokens) + tokens(response) + [EOS]``; labels are -100 on the prompt and on
    the first position, the token ids elsewhere (response and EOS).
    """
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    labels = [-100] * len(p) + list(r)
    labels[0] = -100
    return p + r, labels


def _render(tokenizer, messages, template: str, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                              **kwargs)["input_ids"])


def prompt_ids(tokenizer, messages: list[dict], template: str, tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with ``template`` and the assistant's turn opened
    (``add_generation_prompt=True``): what a model continues to answer them; with ``tools`` (JSON schemas), the
    template offers them (``apply_chat_template(tools=...)``)."""
    return _render(tokenizer, messages, template, add_generation_prompt=True, **({"tools": tools} if tools else {}))


def generation_pairs(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """``train.eval_generate``'s prompts and references: the prompt (as training tokenizes it) and the response;
    for conversations, the turns before the last assistant turn (rendered, the assistant's turn opened) and that
    turn's content. Rows with an empty prompt or reference, or no assistant turn, are left out."""
    pairs = []
    read = formats.resolve(data_cfg)
    tools_col = data_cfg.tools_column if read.chat else ""
    for row in rows:
        if not read.chat:
            prompt, response = row.get(read.columns[0]), row.get(read.columns[1])
            if isinstance(prompt, str) and isinstance(response, str) and prompt.strip() and response.strip():
                pairs.append((tokenizer(prompt, add_special_tokens=True)["input_ids"], response))
            continue
        try:
            messages, first = conversation(read, row)
        except ValueError:
            continue  # reported before training by check_labels
        if message_problem(messages) or not has_answer(messages[first:]):
            continue
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if last > 0:
            try:
                tools = row_tools(row.get(tools_col)) if tools_col else None
            except ValueError:
                continue  # reported before training by check_labels
            pairs.append((prompt_ids(tokenizer, list(messages[:last]), chat_template(data_cfg, tokenizer), tools),
                          messages[last]["content"]))
    return pairs


def prompt_length(tokenizer, messages: list[dict], template: str) -> int:
    """Tokens of ``messages`` rendered with ``template`` up to where the assistant's reply starts
    (``add_generation_prompt=True``): the prompt part of a conversation whose answer follows (``dpo``)."""
    return len(_render(tokenizer, messages, template, add_generation_prompt=True))


def encode_messages(tokenizer, messages: list[dict], template: str,
                    tools: list[dict] | None = None, first: int = 0) -> tuple[list[int], list[int]]:
    """Token ids and labels of one conversation rendered with ``template`` (lists of int, same length); with
    ``tools`` (JSON schemas) the template offers them (``apply_chat_template(tools=...)``); with ``first`` > 0,
    the tokens of ``messages[:first]`` rendered with the assistant's turn opened are never trained (a
    prompt-completion row's prompt).

    Labels are the token ids on assistant turns (content and what the template ends the turn with, e.g. EOS),
    -100 elsewhere and on the first position. With ``{% generation %}`` markers in the template the turns come
    from ``apply_chat_template(return_assistant_tokens_mask=True)``; otherwise from rendering prefixes.

    Raises:
        ConfigError: a template without ``{% generation %}`` renders a conversation's beginning differently when
            more turns follow (the prefix difference is then undefined).
    """
    offered = {"tools": tools} if tools else {}
    if _GENERATION.search(re.sub(r"{#.*?#}", "", template, flags=re.S)):  # a marker outside Jinja comments
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **offered)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids = _render(tokenizer, messages, template, **offered)
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(_render(tokenizer, messages[:i], template, add_generation_prompt=True, **offered)) if i else 0
            upto = _render(tokenizer, messages[: i + 1], template, **offered)
            if ids[: len(upto)] != upto:
                raise ConfigError("data.chat_template: the chat template renders the start of a conversation "
                                  "differently when more turns follow, so assistant turns cannot be located; mark "
                                  "assistant text with {% generation %} ... {% endgeneration %} in the template")
            mask[start:len(upto)] = [1] * (len(upto) - start)
    if first:
        prompt = len(_render(tokenizer, messages[:first], template, add_generation_prompt=True, **offered))
        mask[:prompt] = [0] * min(prompt, len(mask))
    labels = [t if k else -100 for t, k in zip(ids, mask)]
    labels[0] = -100
    return ids, labels


def encode_rendered(tokenizer, messages: list[dict], template: str, column: str,
                    tools: list[dict] | None = None, first: int = 0) -> tuple[list[int], list[int]]:
    """:func:`encode_messages`, with an error the template raises (``raise_exception``) as one ConfigError line
    (the input checks render every row first, :class:`TemplateCheck`; this is the backstop).

    Raises:
        ConfigError: the template raised on the conversation, or :func:`encode_messages`'s.
    """
    try:
        return encode_messages(tokenizer, messages, template, tools, first)
    except jinja2.TemplateError as e:
        raise ConfigError(f"data.chat_template: the chat template raised on a row of column '{column}': "
                          f"{_one_line(e)}; fix the row or the template") from None


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def load_check_tokenizer(cfg: RunConfig, prepare: Callable | None = None):
    """The run's tokenizer for the input checks (``model.tokenizer_path`` or ``model.path``, local files only),
    prepared with ``prepare`` (default :func:`prepare_tokenizer`); None when it cannot be loaded or prepared (the
    model and compatibility checks report that)."""
    path = cfg.model.tokenizer_path or cfg.model.path
    if not path or not Path(path).is_dir():
        return None
    try:
        return (prepare or prepare_tokenizer)(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception:  # noqa: BLE001  (reported by the compatibility checks)
        return None


class TemplateCheck:
    """Renders every conversation of a data file with the run's chat template before any model is built.

    A chat template can raise on a row (Llama's and Mistral's call ``raise_exception`` on an unexpected role);
    found in tokenization that is a long Jinja traceback, here it is one problem line naming the file, the row,
    the column and the template's message. Each conversation is rendered once with the tokenizer's
    ``apply_chat_template(..., tokenize=False)``. A file that renders gets a mark in ``<cache>/checked`` named by
    its :func:`finetune.data.dataset.file_id`, the columns, the template's text and the tokenizer's files, so each file
    version is rendered once (a mark is written at once: it says only that this file renders with this template).
    The tokenizer is loaded on first use (:func:`load_check_tokenizer`); nothing is checked without one or without
    a template (the other checks report that).
    """

    def __init__(self, cfg: RunConfig, prepare: Callable | None = None):
        self.cfg, self.prepare = cfg, prepare
        self._loaded: tuple | None = None

    def tokenizer(self):
        """The prepared tokenizer, or None (loaded once)."""
        if self._loaded is None:
            tokenizer, template = load_check_tokenizer(self.cfg, self.prepare), None
            if tokenizer is not None:
                with contextlib.suppress(ConfigError):
                    template = chat_template(self.cfg.data, tokenizer)
            self._loaded = (tokenizer, template)
        return self._loaded[0]

    def _mark(self, path: str, cols: list[str]) -> Path | None:
        """The mark of ``path``, from file ids only (the tokenizer's own template and special tokens are in its
        files), so that a file already checked costs no tokenizer load; None when a file is missing."""
        folder = Path(self.cfg.model.tokenizer_path or self.cfg.model.path or ".")
        try:
            files = sorted(str(p) for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []
            parts = {"file": file_id(path), "columns": sorted(cols), "template": template_text(self.cfg.data),
                     "tokenizer": [file_id(f) for f in files], "version": 1}
        except (OSError, ConfigError):  # missing files are reported elsewhere
            return None
        return default_cache_dir(self.cfg.data) / "checked" / f"template-{fingerprint(parts)}"

    def check(self, key: str, path: str, cols: list[str], conversations: Iterable[tuple[int, str, list]],
              problems: list[str]) -> None:
        """Render ``conversations`` (``(row, column, messages)`` or ``(row, column, messages, tools)``, well-formed
        ones) of the file ``path``; append one line for the first that raises; mark the file when all render."""
        mark = self._mark(path, cols)
        if mark is not None and mark.exists():
            return
        if self.tokenizer() is None or self._loaded[1] is None:
            return
        tokenizer, template = self._loaded
        for row, col, messages, *tools in conversations:
            try:
                tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              **({"tools": tools[0]} if tools and tools[0] else {}))
            except Exception as e:  # noqa: BLE001  (jinja2.TemplateError from raise_exception, or any other)
                problems.append(f"{key}: '{path}' row {row} of column '{col}': the chat template raised "
                                f"{_one_line(e)}; fix that row or data.chat_template")
                return
        if mark is not None:
            with contextlib.suppress(OSError):  # a read-only cache: the rows are rendered again next time
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.touch()


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: indices of ``lengths`` grouped into bins of total length <= ``capacity``.

    Longest first, each into the fullest bin it still fits in (a new bin when none). Every length must be
    <= ``capacity``. Bins are in order of creation; each lists its indices in ascending order.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda k: room[k])
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


class SftExamples:
    """Batched map function: rows -> examples (ids, labels) -> packed (or single-example) rows; counts what it drops.

    Output columns: ``input_ids``, ``labels``, ``position_ids`` (packed) or ``input_ids``, ``attention_mask``,
    ``labels`` (unpacked); lists of int. It skips and counts bad rows itself (the recipe's ``Capabilities.counts_rows``);
    :meth:`summary` is logged once per tokenized split.

    Raises:
        ConfigError: a messages row is malformed (checked before training by :func:`check_labels`).
    """

    def __init__(self, tokenizer, data_cfg: DataConfig):
        self.tokenizer, self.d, self.read = tokenizer, data_cfg, formats.resolve(data_cfg)
        self.template = chat_template(data_cfg, tokenizer) if self.read.chat else None
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def _examples(self, batch: dict) -> list[tuple[list[int], list[int]]]:
        d, c = self.d, self.counts
        out = []
        cols = self.read.columns
        n = len(batch[cols[0]])
        for i in range(n):
            c["rows"] += 1
            if self.template is not None:
                try:
                    messages, first = conversation(self.read, {k: batch[k][i] for k in cols})
                except ValueError as e:
                    raise ConfigError(f"data.format: a row of the {formats.NAMES[self.read.name]} form has {e}") \
                        from None
                problem = message_problem(messages)
                if problem:
                    raise ConfigError(f"data.messages_column: a row of '{cols[0]}' is {problem}")
                if not has_answer(messages[first:]):
                    c["no_answer"] += 1
                    continue
                try:
                    tools = row_tools(batch[d.tools_column][i]) if d.tools_column else None
                except ValueError as e:
                    raise ConfigError(f"data.tools_column: a row of '{d.tools_column}' is {e}") from None
                ids, labels = encode_rendered(self.tokenizer, messages, self.template, cols[0], tools, first)
            else:
                prompt, response = batch[cols[0]][i], batch[cols[1]][i]
                if not isinstance(response, str) or not response.strip() or not isinstance(prompt, str):
                    c["empty"] += 1
                    continue
                ids, labels = encode_pair(self.tokenizer, prompt, response)
            if len(ids) > d.max_seq_len:
                if d.truncation == "drop":
                    c["too_long"] += 1
                    continue
                ids, labels = ids[: d.max_seq_len], labels[: d.max_seq_len]
                c["truncated"] += 1
                if all(v == -100 for v in labels):
                    c["truncated_no_answer"] += 1
                    continue
            out.append((ids, labels))
        return out

    def __call__(self, batch: dict) -> dict:
        examples = self._examples(batch)
        self.counts["examples"] += len(examples)
        self.counts["tokens"] += sum(len(ids) for ids, _ in examples)
        if not self.d.packing:
            return {"input_ids": [ids for ids, _ in examples], "attention_mask": [[1] * len(ids) for ids, _ in examples],
                    "labels": [labels for _, labels in examples]}
        bins = pack([len(ids) for ids, _ in examples], self.d.max_seq_len)
        self.counts["packed_rows"] += len(bins)
        return {"input_ids": [[t for i in b for t in examples[i][0]] for b in bins],
                "labels": [[t for i in b for t in examples[i][1]] for b in bins],
                "position_ids": [[p for i in b for p in range(len(examples[i][0]))] for b in bins]}

    def summary(self) -> str:
        """One line: rows read, examples kept, what was dropped or truncated and why, packing fill ratio."""
        c, d = self.counts, self.d
        text = count_summary("sft", c, "examples", [("no_answer", "without an assistant turn"),
                                                    ("empty", "with a null or empty response or null prompt")],
                             d.max_seq_len, "answer")
        if d.packing and c["packed_rows"]:
            positions = c["packed_rows"] * d.max_seq_len
            text += (f"; packed into {c['packed_rows']:,} rows of {d.max_seq_len} positions, fill ratio "
                     f"{c['tokens'] / positions:.3f} (real tokens / positions)")
        return text


def count_summary(recipe: str, counts: Counter, kept: str, reasons: list[tuple[str, str]], max_seq_len: int,
                  target: str) -> str:
    """The tokenization line of a recipe that drops rows and counts why (``sft``, ``dpo``).

    ``"<recipe>: R rows -> K <kept> (dropped N <reason>, ...); truncated T <kept> to data.max_seq_len=L"`` from
    ``counts`` (``rows``, ``kept``, ``truncated`` and each reason's key; ``too_long`` and ``truncated_no_answer``
    are added to ``reasons``), ``target`` naming what a truncated example may lose (``answer``, ``response``).
    """
    c = counts
    reasons = [*reasons, ("too_long", f"longer than data.max_seq_len={max_seq_len} (data.truncation=drop)"),
               ("truncated_no_answer", f"with no {target} token within data.max_seq_len={max_seq_len}")]
    dropped = [f"{c[k]:,} {why}" for k, why in reasons if c[k]]
    text = f"{recipe}: {c['rows']:,} rows -> {c[kept]:,} {kept}"
    if dropped:
        text += f" (dropped {', '.join(dropped)})"
    if c["truncated"]:
        text += f"; truncated {c['truncated']:,} {kept} to data.max_seq_len={max_seq_len}"
    return text


def tokenize_function(tokenizer, data_cfg: DataConfig) -> SftExamples:
    """The batched map function (:class:`SftExamples`)."""
    return SftExamples(tokenizer, data_cfg)


class PackedCollator:
    """Stack packed rows: ``input_ids``, ``labels`` and ``position_ids`` (int64 ``[micro_batch, longest row]``).

    Rows are right-padded to the longest row (rounded up to ``pad_to_multiple_of``) with the pad token, label
    -100 and positions 0, 1, ... (a segment of its own). No ``attention_mask``: transformers derives the
    block-diagonal causal mask from ``position_ids`` only when there is none. ``num_tokens`` (0-dim int64) is the
    number of real (non-pad) tokens, for the loop's tokens/s and padding ratio; it never reaches the model.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 0):
        self.pad, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        longest = padded_length(rows, self.multiple)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for r in rows:
            n = longest - len(r["input_ids"])
            batch["input_ids"].append(list(r["input_ids"]) + [self.pad] * n)
            batch["labels"].append(list(r["labels"]) + [-100] * n)
            batch["position_ids"].append(list(r["position_ids"]) + list(range(n)))
        out = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
        out["num_tokens"] = torch.tensor(sum(len(r["input_ids"]) for r in rows), dtype=torch.long)
        return out


def make_collator(tokenizer, data_cfg: DataConfig):
    """Packed: :class:`PackedCollator`. Unpacked: transformers' ``DataCollatorForSeq2Seq`` (right padding, labels
    padded with -100)."""
    if data_cfg.packing:
        return PackedCollator(tokenizer.pad_token_id, data_cfg.pad_to_multiple_of)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100,
                                  pad_to_multiple_of=data_cfg.pad_to_multiple_of or None, return_tensors="pt")


def check_labels(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the sft settings and data before any model is built; append one line per problem.

    Problems: both data forms set, half a prompt/response pair, no form recognised in the files or files of
    different forms (:func:`finetune.data.formats.resolve`), an unknown ``data.truncation``, a file without a needed
    column, a prompt/response column that is not text, the first row of a chat form that does not fit it or is not
    a list of ``{role, content}`` strings (named), ``data.tools_column`` without a chat form or a tools row that is
    not a list of schemas (nor its JSON text), training files in which no conversation has an assistant turn, no
    chat template (none in ``data.chat_template`` nor in the tokenizer) or a missing template file, and a row on
    which the chat template raises (:class:`TemplateCheck`: every row rendered once per file version).
    """
    d = cfg.data
    pair = bool(d.prompt_column or d.response_column)
    if d.messages_column and pair:
        problems.append("data.messages_column: set either data.messages_column (chat) or data.prompt_column and "
                        "data.response_column (prompt/response), not both")
        return
    if d.format == "auto" and not d.messages_column and pair and not (d.prompt_column and d.response_column):
        problems.append("data.prompt_column: sft needs data.prompt_column and data.response_column (prompt/response "
                        "text), or data.messages_column (a list of {role, content} per row)")
        return
    try:
        read = formats.resolve(dataclasses.replace(d, train_files=list(train_files),
                                                   validation_files=list(validation_files)))
    except ConfigError as e:
        problems += e.problems
        return
    if d.tools_column and not read.chat:
        problems.append("data.tools_column: tools are rendered into conversations; set data.messages_column too, or "
                        "leave data.tools_column empty")
    keys = {"pair": ("prompt_column", "response_column"), "messages": ("messages_column",),
            "sharegpt": ("messages_column", "format")}.get(read.name, ("format",) * len(read.columns))
    answers = read_files = 0  # conversations with an answer; training files read without a problem
    templates = TemplateCheck(cfg)
    for key, f, schema in file_schemas(train_files, validation_files):
        needed = list(zip(read.columns, keys)) + ([(d.tools_column, "tools_column")] if d.tools_column else [])
        missing = False
        absent = [col for col, what in needed if col not in schema.names and what != "tools_column"]
        recognised = formats.detect(schema) if absent and d.format == "auto" else None
        recognised = recognised if recognised != read.name else None  # a misnamed column of the same form
        if recognised:  # the column keys name columns of another form: say which form the file is in
            named = " and ".join(f"data.{k}" for k in ("messages_column", "prompt_column", "response_column")
                                 if getattr(d, k))
            problems.append(f"{key}: '{f}' has no column {' nor '.join(repr(c) for c in absent)} (columns: "
                            f"{', '.join(schema.names)}); the file is in the {formats.NAMES[recognised]} form "
                            f"(recognised from its columns): set data.format: {recognised}, or clear {named} "
                            f"(sft then recognises the form)")
            missing = True
        for col, what in needed:
            if col not in schema.names:
                if not (recognised and col in absent):  # else said above
                    problems.append(f"{key}: '{f}' has no column '{col}' (columns: {', '.join(schema.names)}); "
                                    f"set data.{what}")
                missing = True
            elif not read.chat and what != "tools_column" and not string_type(schema.field(col).type):
                problems.append(f"{key}: '{f}' column '{col}' has type {schema.field(col).type}, not text "
                                f"(string); set data.{what} to a text column")
        if not read.chat or missing:
            continue
        table = pq.read_table(f, columns=list(read.columns)).to_pylist()
        tools = [None] * len(table)
        if d.tools_column:
            values = pq.read_table(f, columns=[d.tools_column]).column(d.tools_column).to_pylist()
            for i, value in enumerate(values):
                try:
                    tools[i] = row_tools(value)
                except ValueError as e:
                    problems.append(f"{key}: '{f}' row {i} of column '{d.tools_column}' is {e}; set "
                                    f"data.tools_column to a column of tool schema lists (or their JSON text)")
                    break
        rows = []
        for i, row in enumerate(table):
            try:
                messages, first = conversation(read, row)
            except ValueError as e:
                problems.append(f"{key}: '{f}' row {i} of the {formats.NAMES[read.name]} form has {e}; fix the "
                                f"row or set data.format")
                break
            problem = message_problem(messages)
            if problem:
                problems.append(f"{key}: '{f}' row {i} of column '{read.columns[0]}' is {problem}; every "
                                f"row must be a list of {{role, content}} messages")
                break
            rows.append((messages, first))
        else:
            if key == "data.train_files":
                answers += sum(has_answer(m[k:]) for m, k in rows)
                read_files += 1
            col = read.columns[0]
            templates.check(key, f, columns(d), ((i, col, m, tools[i]) for i, (m, _) in enumerate(rows)),
                            problems)
    if read.chat and train_files and read_files == len(train_files) and not answers:
        problems.append(f"data.train_files: no conversation in column '{read.columns[0]}' has an assistant turn, "
                        f"so there is nothing to train on (sft trains on assistant turns only)")
    if read.chat:
        try:
            if not template_text(d):
                tokenizer_template_problem(cfg, problems)
        except ConfigError as e:
            problems += e.problems


def tokenizer_template_problem(cfg: RunConfig, problems: list[str]) -> None:
    """Append the problem of rendering ``cfg.data``'s conversations with the tokenizer's own chat template (there is
    none, or ``data.chat_template`` names a missing file); nothing when the tokenizer cannot be loaded (the
    compatibility checks report that)."""
    tokenizer = load_check_tokenizer(cfg, prepare=lambda t: t)
    if tokenizer is None:
        return  # reported by the model and compatibility checks
    try:
        chat_template(cfg.data, tokenizer)
    except ConfigError as e:
        problems += e.problems
