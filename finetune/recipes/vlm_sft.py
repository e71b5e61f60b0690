"""Supervised fine-tuning of vision-language models (``AutoModelForImageTextToText``: Idefics3/SmolVLM, Qwen2.5-VL,
LLaVA, Gemma 3, ...) on conversations with images, the loss on the answers only.

Data: TRL's conversational vision form. ``data.messages_column`` (default ``messages``) holds each row's
conversation, a list of ``{role, content}`` whose content is a list of parts ``{"type": "text", "text": ...}`` and
``{"type": "image"}``; ``data.image_column`` (default ``images``) holds the row's images in the order of its image
parts, each as ``datasets.Image`` stores it (``{bytes, path}``; the bytes win) or a file path. The model's own
processor (``AutoProcessor`` from ``model.tokenizer_path`` or ``model.path``) renders every row with its chat
template (``data.chat_template`` overrides it) and its image processor: the image placeholder becomes the model's
image tokens (their number set by the image processor's sizes: ``min_pixels``/``max_pixels`` for Qwen2.5-VL,
``image_seq_len`` for Idefics3), and ``apply_chat_template(return_assistant_tokens_mask=True)`` marks the assistant
turns when the template has ``{% generation %}`` marks (the shipped tiny models' templates have them); a template
without them (the stock ones of Qwen2.5-VL, SmolVLM, Gemma 3) has its assistant turns located by rendering prefixes
(:func:`finetune.data.images.assistant_mask`). Only those tokens train: the prompt, every image token (one in an
assistant turn too) and the template's own tokens get label -100, and so does every row's first token. The
processor's per-token inputs (Qwen2.5-VL's ``mm_token_type_ids``, Gemma 3's ``token_type_ids``) go to the model
with the batch.

Rows are tokenized once per data file, processor and settings and cached like the text recipes' tokens, the
processor's image tensors included (``pixel_values`` and whatever else the processor returns for the model:
``image_grid_thw``, ``pixel_attention_mask``); decoding and resizing run in the tokenizing processes
(``data.num_proc``). A row longer than ``data.max_seq_len`` is left out and counted (cutting it could split an
image's tokens). No packing: each row is one sequence, right-padded per micro-batch with an ``attention_mask``.

A micro-batch's image tensors are joined the way each processor joins a batch (:class:`ImageCollator`): per-row
image stacks (Idefics3's ``[rows, images, 3, H, W]`` ``pixel_values`` and ``pixel_attention_mask``) are padded to the
micro-batch's most images and stacked; flat tensors (Qwen2.5-VL's patches ``[patches, dim]`` and ``image_grid_thw``,
LLaVA's ``[images, 3, H, W]``) are concatenated in row order.

Loss, token counts and evaluation are ``gpt_clm``'s (one causal-LM loss path: the head and the cross-entropy at the
answer positions only, in chunks, :mod:`finetune.recipes.lm_loss`), so the loss is the exact mean over the global
batch's answer tokens at every ZeRO stage and accumulation.

A separate recipe rather than ``sft`` with an image column: the model class, the processor's rendering, the image
tensors in every batch and the absence of packing and sequence parallelism differ from every one of ``sft``'s text
paths, and a recipe's capabilities are constants.
"""

from __future__ import annotations

import functools
import dataclasses
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from finetune.config import DataConfig, RunConfig
from finetune.data import images
from finetune.data.batch import padded_length
from finetune.data.dataset import default_cache_dir, file_columns
from finetune.errors import ConfigError
from finetune.recipes import Capabilities, Recipe, pad_with_eos
from finetune.recipes.common.targets import count_targets, forward  # noqa: F401  (one loss path)
from finetune.recipes.common.chat import count_summary, template_text

MODEL_CLASS = AutoModelForImageTextToText


def messages_column(data_cfg: DataConfig) -> str:
    """``data.messages_column``, ``messages`` when empty."""
    return data_cfg.messages_column or "messages"


def plain(data_cfg: DataConfig) -> bool:
    """The rows are a plain text prompt and response (``data.prompt_column`` and ``data.response_column`` set,
    ``data.messages_column`` empty) instead of conversations."""
    return bool(data_cfg.prompt_column and data_cfg.response_column and not data_cfg.messages_column)


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads: the conversations (or the prompts and responses: :func:`plain`)
    and the images."""
    if plain(data_cfg):
        return [data_cfg.prompt_column, data_cfg.response_column, data_cfg.image_column]
    return [messages_column(data_cfg), data_cfg.image_column]


def row_messages(data_cfg: DataConfig, batch: dict, i: int) -> list:
    """Row ``i`` of a batch of rows as a conversation: its messages, or (:func:`plain`) a user turn showing the row's
    images then its prompt text, and an assistant turn with its response
    (:func:`finetune.data.images.conversation`)."""
    if not plain(data_cfg):
        return batch[messages_column(data_cfg)][i]
    prompt, response = batch[data_cfg.prompt_column][i], batch[data_cfg.response_column][i]
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ConfigError(f"data.prompt_column / data.response_column: a row's prompt or response is "
                          f"{type(prompt if not isinstance(prompt, str) else response).__name__}, not text; fix "
                          f"or drop that row")
    return images.conversation(prompt, len(batch[data_cfg.image_column][i] or [])) + [
        {"role": "assistant", "content": [{"type": "text", "text": response}]}]


def cache_key(data_cfg: DataConfig) -> dict:
    """Settings besides the files, columns and tokenizer that decide the tokenized rows."""
    return {"chat_template": template_text(data_cfg), "max_seq_len": data_cfg.max_seq_len, "version": 1,
            **images.pixel_key(data_cfg)}


def prepare_tokenizer(tokenizer):
    """A pad token (EOS when the tokenizer has none: :func:`~finetune.recipes.pad_with_eos`), right padding. No EOS
    is appended: the chat template ends each turn with the model's own end-of-turn token, which trains."""
    tokenizer = pad_with_eos(tokenizer, "vlm_sft")
    tokenizer.padding_side = "right"
    return tokenizer


class VlmExamples:
    """Batched map function: rows -> ``input_ids``, ``attention_mask``, ``labels`` and the processor's image tensors
    (each flat, with its shape: :func:`finetune.data.images.store`); skips and counts rows without an answer and rows too long.

    Raises:
        ConfigError: a malformed conversation, an unreadable image, or a row whose image parts and images differ in
            number (one line naming the column and what was wrong).
    """

    def __init__(self, tokenizer, data_cfg: DataConfig, processor: images.ProcessorSource | None = None):
        self.tokenizer, self.d = tokenizer, data_cfg
        source = processor or images.ProcessorSource(tokenizer.name_or_path, "vlm_sft", data_cfg)
        self.processor = source(tokenizer)
        self.template = template_text(data_cfg)
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        mcol, icol = columns(d)[0], d.image_column
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        for i in range(len(batch[icol])):
            messages = row_messages(d, batch, i)
            c["rows"] += 1
            where = images.row_where(batch, i, f"'{mcol}' and '{icol}'")
            problem = images.pairing_problem(messages, len(batch[icol][i] or []))
            if problem:
                raise ConfigError(f"data: {where}: {problem}; fix or drop that row")
            pictures = [images.decode_image(v, f"data.image_column: {where}", images.folder_of(batch, i), d)
                        for v in (batch[icol][i] or [])]
            kwargs = {"chat_template": self.template} if self.template else {}
            enc = self.processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="np", return_assistant_tokens_mask=True,
                processor_kwargs={"images": pictures} if pictures else {}, **kwargs)
            ids = enc["input_ids"][0].tolist()
            trained = images.assistant_mask(self.processor, messages, pictures, enc, self.template, f"data: {where}")
            if not any(trained[1:]):
                c["no_answer"] += 1
                continue
            if len(ids) > d.max_seq_len:
                c["too_long_row"] += 1
                continue
            labels = [t if m else -100 for t, m in zip(ids, trained)]
            labels[0] = -100
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
            images.store(enc, out, self.processor.model_input_names)
            c["examples"] += 1
            c["tokens"] += len(ids)
            c["images"] += len(pictures)
        return out

    def summary(self) -> str:
        """One line: rows read, examples kept, images, what was dropped and why."""
        c = self.counts
        why = [("no_answer", "without an assistant turn"),
               ("too_long_row", f"longer than data.max_seq_len={self.d.max_seq_len} (not cut: images stay whole)")]
        return count_summary("vlm_sft", c, "examples", why, self.d.max_seq_len, "answer") + f"; {c['images']:,} images"


def tokenize_function(tokenizer, data_cfg: DataConfig,
                      processor: images.ProcessorSource | None = None) -> VlmExamples:
    """The batched map function (:class:`VlmExamples`); ``processor``: the model's (bound by :func:`configure`; the
    tokenizer's folder when called unconfigured)."""
    return VlmExamples(tokenizer, data_cfg, processor)


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with the model's processor (:func:`finetune.data.images.processor_source`: named here, loaded once
    per process on first use) bound into ``tokenize_function``."""
    return dataclasses.replace(recipe, tokenize_function=functools.partial(
        tokenize_function, processor=images.processor_source(cfg, "vlm_sft")))


class ImageCollator:
    """Right-pad ``input_ids`` (pad token), ``attention_mask`` (0), ``labels`` (-100) and the processor's per-token
    inputs (``mm_token_type_ids``, ``token_type_ids``: 0; :func:`finetune.data.images.pad_tokens`) to the
    micro-batch's longest row (rounded up to ``pad_to_multiple_of``), and join each image tensor as its processor joins a batch: per-row
    stacks zero-padded to the micro-batch's most and largest images and stacked, flat ones concatenated in row order
    (:func:`finetune.data.images.join`)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 0):
        self.pad, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        longest = padded_length(rows, self.multiple)
        out = {}
        for key, fill in (("input_ids", self.pad), ("attention_mask", 0), ("labels", -100)):
            out[key] = torch.tensor([list(r[key]) + [fill] * (longest - len(r[key])) for r in rows], dtype=torch.long)
        return {**out, **images.pad_tokens(rows, longest), **images.join([images.row_tensors(r) for r in rows])}


def make_collator(tokenizer, data_cfg: DataConfig) -> ImageCollator:
    """:class:`ImageCollator` with the tokenizer's pad token."""
    return ImageCollator(tokenizer.pad_token_id, data_cfg.pad_to_multiple_of)


def check_data(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Before any model is built: packing is off; each file has the conversation and image columns, and every row's
    images can be read and match its image parts (:func:`finetune.data.images.image_problem`: the first bad row of a file is one line
    naming the file and the row; a file that passes is marked in ``<cache>/checked`` and not read again); the model
    folder has a processor with an image processor."""
    d = cfg.data
    if d.packing:
        problems.append("data.packing: vlm_sft does not pack rows (an example's image tensors belong to its row); "
                        "set data.packing=false")
    cols = columns(d)
    for key, f, names in file_columns(train_files, validation_files):
        settings = (("data.prompt_column", "data.response_column") if plain(d) else ("data.messages_column",)) \
            + ("data.image_column",)
        missing = [(c, s) for c, s in zip(cols, settings) if c not in names]
        for col, setting in missing:
            problems.append(f"{key}: '{f}' has no column '{col}' ({setting}); columns: {', '.join(sorted(names))}")
        if not missing:
            images.check_image_rows(key, f, [cols[0], d.image_column], default_cache_dir(d), problems)
    path = cfg.model.tokenizer_path or cfg.model.path
    if path and Path(path).is_dir():
        try:
            images.load_processor(path)
        except ConfigError as e:
            problems += e.problems


RECIPE = Recipe(name="vlm_sft", model_class=MODEL_CLASS,
                capabilities=Capabilities(generates_text=False, checks_columns=True, counts_rows=True,
                                          mixes_sources=False, evaluates_exports=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, columns=columns, cache_key=cache_key,
                check_data=check_data, configure=configure)
