"""The prompts a GRPO step starts from: rows -> tokenized prompts (:class:`PromptRows`), prompt batches
(:class:`PromptCollator`, left-padded), the columns and cache key of the tokenized data, the run's tokenizer and
``train.eval_generate``'s prompts."""

from __future__ import annotations

import functools
from collections import Counter

import torch

from finetune.config import DataConfig, RunConfig
from finetune.data import images
from finetune.errors import ConfigError
from finetune.recipes.common import pairs
from finetune.recipes.common.chat import count_summary, message_problem, prompt_ids, template_text

PROMPT_COLUMN = "prompt_raw"
"""Tokenized-row column: the prompt as the data holds it (text or messages), for the reward functions."""
COLUMN_PREFIX = "reward_column:"
"""Tokenized-row columns ``reward_column:<name>``: the ``data.reward_columns`` values."""


def prompt_column(data_cfg: DataConfig) -> str:
    """``data.prompt_column``, or ``prompt`` when it is empty (TRL's name)."""
    return data_cfg.prompt_column or "prompt"


def columns(data_cfg: DataConfig, with_images: bool = False) -> list[str]:
    """Parquet columns the tokenize function reads: the prompt, then the reward columns; ``with_images`` (an
    image-text model, :func:`finetune.recipes.grpo.configure`): then ``data.image_column``."""
    return list(dict.fromkeys([prompt_column(data_cfg), *data_cfg.reward_columns,
                               *([data_cfg.image_column] if with_images else [])]))


def cache_key(data_cfg: DataConfig, tools: list[dict] | None = None, with_images: bool = False) -> dict:
    """The prompt truncation, chat template, reward columns, the tools the prompts offer and whether the prompts
    hold images."""
    return {"truncation": data_cfg.truncation, "chat_template": template_text(data_cfg),
            "reward_columns": list(data_cfg.reward_columns), "prompt_cut": "left",
            **({"tools": tools} if tools else {}), **({"images": data_cfg.image_column, **images.pixel_key(data_cfg)} if with_images else {})}


prepare_tokenizer = pairs.prepare_tokenizer
prepare_model_config = pairs.prepare_model_config


class PromptRows:
    """Batched map function: rows -> tokenized prompts with their reward columns; counts what it drops.

    Output columns: ``input_ids``, ``attention_mask`` (the prompt's tokens: text with the tokenizer's special
    tokens, or messages rendered with the assistant's turn opened; longer than ``data.max_seq_len``: its last
    ``max_seq_len`` tokens, or dropped with ``data.truncation: drop``), :data:`PROMPT_COLUMN` and one
    ``reward_column:<name>`` per reward column. Rows with a null or empty prompt are dropped and counted.

    With a ``processor`` (an image-text model's), each prompt is a conversation whose ``{"type": "image"}`` parts take
    the row's ``data.image_column`` images in order: the model's processor renders it (the assistant's turn opened)
    and its image tensors are stored with the row (:func:`finetune.data.images.store`); a prompt longer than
    ``data.max_seq_len`` is dropped and counted, never cut (an image's tokens stay whole).

    Raises:
        ConfigError: a conversational prompt is malformed (checked before training by :func:`check_rows`).
    """

    def __init__(self, tokenizer, data_cfg: DataConfig, tools: list[dict] | None = None,
                 processor: images.ProcessorSource | None = None):
        self.tokenizer, self.d, self.tools = tokenizer, data_cfg, tools or None
        self.template = template_text(data_cfg) or None
        self.processor = processor(tokenizer) if processor is not None else None
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def encode(self, prompt) -> list[int]:
        """The prompt's token ids (uncut)."""
        if isinstance(prompt, str):
            if self.tools:
                raise ConfigError("data.prompt_column: a row's prompt is text, and train.grpo.tools (or "
                                  "environment) offers tools through the chat template; make the prompts "
                                  "conversations ([{role: user, content: ...}])")
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        problem = message_problem(prompt)
        if problem:
            raise ConfigError(f"data.prompt_column: a row's prompt is {problem}")
        if self.template is None:
            from finetune.recipes.common.chat import chat_template
            self.template = chat_template(self.d, self.tokenizer)
        return prompt_ids(self.tokenizer, list(prompt), self.template, self.tools)

    def encode_with_images(self, prompt, row_images, folder: str | None, where: str = "") -> dict:
        """A conversational prompt with its images through the processor: ``input_ids`` ``[1, T]`` and the image
        tensors (numpy).

        Raises:
            ConfigError: the prompt is not a conversation, its image parts and images differ in number, or an image
                cannot be read (one line naming ``where``, the file and row, else the columns).
        """
        where = where or f"a row of '{prompt_column(self.d)}' and '{self.d.image_column}'"
        problem = images.pairing_problem(prompt, len(row_images or []))
        if problem:
            raise ConfigError(f"data: {where}: {problem}; fix or drop that row")
        pictures = [images.decode_image(v, f"data.image_column: {where}", folder, self.d) for v in (row_images or [])]
        kwargs = {"chat_template": self.template} if self.template else {}
        prompt = images.conversation(prompt, len(pictures))
        return self.processor.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="np",
                                                  processor_kwargs={"images": pictures} if pictures else {}, **kwargs)

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
            enc = None
            if self.processor is not None:
                enc = self.encode_with_images(prompt, batch[d.image_column][i], images.folder_of(batch, i),
                                              images.row_where(batch, i, f"'{names[0]}' and '{d.image_column}'"))
                ids = enc["input_ids"][0].tolist()
            else:
                ids = self.encode(prompt)
            if len(ids) > d.max_seq_len:
                if d.truncation == "drop" or enc is not None:
                    c["too_long"] += 1
                    continue
                c["truncated"] += 1
                ids = ids[-d.max_seq_len:]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out[PROMPT_COLUMN].append(prompt)
            for n in d.reward_columns:
                out[COLUMN_PREFIX + n].append(batch[n][i])
            if enc is not None:
                images.store(enc, out, self.processor.model_input_names)
                c["images"] += len(batch[d.image_column][i] or [])
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
                    f"keep their last tokens{'; with images: left out' if self.processor is not None else ''})"
        if self.processor is not None:
            text += f"; {c['images']:,} images"
        return text


def tokenize_function(tokenizer, data_cfg: DataConfig, tools: list[dict] | None = None,
                      processor: images.ProcessorSource | None = None) -> PromptRows:
    """The batched map function (:class:`PromptRows`); ``tools``: the JSON schemas the prompts offer
    (``train.grpo.tools`` and the environment's methods), ``processor``: an image-text model's, whose prompts hold
    their images (both bound by :func:`finetune.recipes.grpo.configure`)."""
    return PromptRows(tokenizer, data_cfg, tools, processor)


class PromptCollator:
    """Rows -> a prompt batch: ``input_ids`` and ``attention_mask`` ``[B, longest]`` int64, **left**-padded (generation
    continues every prompt at the same position); ``labels`` ``[B]`` int64, 0 (-100 on evaluation filler rows);
    ``row_seeds`` ``[B]`` int64 (the rows' ``_seed``: the sampling seed, independent of ranks and split); and, not
    tensors, ``prompts`` (the raw prompts), ``reward_columns`` (name -> ``B`` values) and ``row_index`` (the
    validation rows' indexes, -1 in training); with images, ``images``: each row's image tensors
    (:func:`finetune.data.images.row_tensors`, joined per generation and training batch), and the processor's
    per-token inputs (``mm_token_type_ids``, ``token_type_ids``) ``[B, longest]``, left-padded with 0
    (:func:`finetune.data.images.pad_tokens`)."""

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
                "reward_columns": {n: [r[COLUMN_PREFIX + n] for r in rows] for n in self.names},
                **({"images": [images.row_tensors(r) for r in rows]} if any(k.endswith("__shape") for k in rows[0])
                   else {}), **images.pad_tokens(rows, longest, left=True)}


def make_collator(tokenizer, data_cfg: DataConfig) -> PromptCollator:
    """:class:`PromptCollator` with the tokenizer's pad token."""
    return PromptCollator(tokenizer.pad_token_id, data_cfg)


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer
    return prepare_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))


def tokenizer_of(cfg: RunConfig):
    """The run's prepared tokenizer (loaded once per process)."""
    return _tokenizer(cfg.model.tokenizer_path or cfg.model.path)


def generation_pairs(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """``train.eval_generate``'s prompts and references: the prompt and the first reward column as text."""
    if not data_cfg.reward_columns:
        return []
    encode = PromptRows(tokenizer, data_cfg).encode
    return [(encode(r[prompt_column(data_cfg)]), str(r[data_cfg.reward_columns[0]])) for r in rows
            if r.get(prompt_column(data_cfg)) and r.get(data_cfg.reward_columns[0]) is not None]
