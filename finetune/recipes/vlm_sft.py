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
turns, which need a template with ``{% generation %}`` (the shipped tiny models' templates have it). Only those
tokens train: the prompt, the image tokens and the template's own tokens get label -100, and so does every row's
first token.

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

import contextlib
import io
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from finetune.config import DataConfig, RunConfig
from finetune.data.batch import padded_length
from finetune.data.dataset import default_cache_dir, file_id, fingerprint
from finetune.errors import ConfigError
from finetune.recipes import Capabilities, Recipe, pad_with_eos
from finetune.recipes.gpt_clm import count_targets, forward  # noqa: F401  (one loss path)
from finetune.recipes.sft import count_summary, template_text

MODEL_CLASS = AutoModelForImageTextToText

TEXT_KEYS = ("input_ids", "attention_mask", "assistant_masks", "token_type_ids", "mm_token_type_ids")
"""Keys of the processor's output that are not image tensors (``token_type_ids`` and ``mm_token_type_ids`` mark
image positions for some processors; the model does not need them for a causal-LM loss)."""

STACKED = ("pixel_attention_mask",)
"""Image tensors that a processor stacks per row (padded to the batch's most images) whatever their rank; besides
these, any 5-dimensional ``pixel_values`` (``[rows, images, 3, H, W]``, Idefics3's)."""

SHAPE = "{}__shape"
"""The column that holds an image tensor's shape (the tensor itself is stored flat)."""


def messages_column(data_cfg: DataConfig) -> str:
    """``data.messages_column``, ``messages`` when empty."""
    return data_cfg.messages_column or "messages"


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads: the conversations and the images."""
    return [messages_column(data_cfg), data_cfg.image_column]


def cache_key(data_cfg: DataConfig) -> dict:
    """Settings besides the files, columns and tokenizer that decide the tokenized rows."""
    return {"chat_template": template_text(data_cfg), "max_seq_len": data_cfg.max_seq_len, "version": 1}


def prepare_tokenizer(tokenizer):
    """A pad token (EOS when the tokenizer has none: :func:`~finetune.recipes.pad_with_eos`), right padding. No EOS
    is appended: the chat template ends each turn with the model's own end-of-turn token, which trains."""
    tokenizer = pad_with_eos(tokenizer, "vlm_sft")
    tokenizer.padding_side = "right"
    return tokenizer


def load_processor(path: str, tokenizer=None):
    """The model's ``AutoProcessor`` from ``path`` (local files only), with ``tokenizer`` (prepared) in place of its
    own.

    Raises:
        ConfigError: ``path`` has no processor an image-text model can use (one line naming the folder and the
            error).
    """
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError as e:  # a package the processor is built on (Qwen2.5-VL's video processor: torchvision)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"model.path: the processor in '{path}' cannot be built here: {first.strip()} "
                          f"Install that package (built for the installed torch) or use another model") from None
    except Exception as e:  # noqa: BLE001  (missing or unreadable processor files)
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        raise ConfigError(f"model.path: '{path}' has no processor vlm_sft can load ({type(e).__name__}: "
                          f"{first.strip()}); point model.tokenizer_path at the folder with the model's processor "
                          f"files (preprocessor_config.json, processor_config.json)") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"model.path: the processor in '{path}' ({type(processor).__name__}) has no image "
                          f"processor; vlm_sft needs an image-text model's processor")
    if tokenizer is not None:
        processor.tokenizer = tokenizer
    return processor


def open_image(value):
    """One image of a row, opened lazily (``PIL.Image.open``: header read, pixels not decoded): ``{bytes, path}``
    (``datasets.Image``'s storage; the bytes win), bytes, or a file path.

    Raises:
        ValueError: the value is none of these.
        OSError: not an image (PIL's ``UnidentifiedImageError``), or a missing file.
    """
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str) and value:
        return Image.open(value)
    raise ValueError(f"an image is {type(value).__name__}, not image bytes or a file path")


def decode_image(value, where: str):
    """One image of a row (:func:`open_image`) decoded, as an RGB PIL image.

    Raises:
        ConfigError: unreadable or empty (one line: ``where``, what was wrong).
    """
    try:
        image = open_image(value)
        image.load()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: an image cannot be read ({type(e).__name__}: {e}); fix or drop that row") \
            from None
    if image.width == 0 or image.height == 0:
        raise ConfigError(f"{where}: an image is empty ({image.width}x{image.height}); fix or drop that row")
    return image.convert("RGB")


def message_problem(messages) -> str | None:
    """Why ``messages`` is not a list of ``{role, content}`` dicts whose content is text or a list of ``{type: text,
    text}`` / ``{type: image}`` parts; None when it is."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"{'an empty list' if isinstance(messages, (list, tuple)) else type(messages).__name__}, not a list " \
               f"of {{role, content}} messages"
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                isinstance(content, str) or isinstance(content, (list, tuple)) and all(
                    isinstance(p, dict) and (p.get("type") == "image" or p.get("type") == "text"
                                             and isinstance(p.get("text"), str)) for p in content)):
            return f"message {i} is {m!r:.80}, not {{role: str, content: str or a list of text and image parts}}"
    return None


def image_parts(messages: list) -> int:
    """The number of ``{"type": "image"}`` parts of a conversation."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


class VlmExamples:
    """Batched map function: rows -> ``input_ids``, ``attention_mask``, ``labels`` and the processor's image tensors
    (each flat, with its shape in :data:`SHAPE`); skips and counts rows without an answer and rows too long.

    Raises:
        ConfigError: a malformed conversation, an unreadable image, or a row whose image parts and images differ in
            number (one line naming the column and what was wrong).
    """

    def __init__(self, tokenizer, data_cfg: DataConfig):
        self.tokenizer, self.d = tokenizer, data_cfg
        self.processor = load_processor(tokenizer.name_or_path, tokenizer)
        self.template = template_text(data_cfg)
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        mcol, icol = messages_column(d), d.image_column
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        for i, messages in enumerate(batch[mcol]):
            c["rows"] += 1
            problem = pairing_problem(messages, len(batch[icol][i] or []))
            if problem:
                raise ConfigError(f"data: a row of '{mcol}' and '{icol}': {problem}; fix or drop that row")
            images = [decode_image(v, f"data.image_column: a row of '{icol}'") for v in (batch[icol][i] or [])]
            kwargs = {"chat_template": self.template} if self.template else {}
            enc = self.processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="np", return_assistant_tokens_mask=True,
                processor_kwargs={"images": images} if images else {}, **kwargs)
            ids = enc["input_ids"][0].tolist()
            trained = enc["assistant_masks"][0].tolist()
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
            for key, value in enc.items():
                if key in TEXT_KEYS:
                    continue
                value = np.asarray(value)
                out.setdefault(key, []).append(value.ravel())
                out.setdefault(SHAPE.format(key), []).append(list(value.shape))
            c["examples"] += 1
            c["tokens"] += len(ids)
            c["images"] += len(images)
        return out

    def summary(self) -> str:
        """One line: rows read, examples kept, images, what was dropped and why."""
        c = self.counts
        why = [("no_answer", "without an assistant turn"),
               ("too_long_row", f"longer than data.max_seq_len={self.d.max_seq_len} (not cut: images stay whole)")]
        return count_summary("vlm_sft", c, "examples", why, self.d.max_seq_len, "answer") + f"; {c['images']:,} images"


def tokenize_function(tokenizer, data_cfg: DataConfig) -> VlmExamples:
    """The batched map function (:class:`VlmExamples`)."""
    return VlmExamples(tokenizer, data_cfg)


class ImageCollator:
    """Right-pad ``input_ids`` (pad token), ``attention_mask`` (0) and ``labels`` (-100) to the micro-batch's longest
    row (rounded up to ``pad_to_multiple_of``), and join each image tensor as its processor joins a batch: per-row
    stacks (:data:`STACKED`, 5-dimensional ``pixel_values``) zero-padded to the micro-batch's most and largest
    images (:func:`_padded`) and stacked, flat ones concatenated in row order."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 0):
        self.pad, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        longest = padded_length(rows, self.multiple)
        out = {}
        for key, fill in (("input_ids", self.pad), ("attention_mask", 0), ("labels", -100)):
            out[key] = torch.tensor([list(r[key]) + [fill] * (longest - len(r[key])) for r in rows], dtype=torch.long)
        for key in rows[0]:
            if key in out or key.endswith("__shape") or SHAPE.format(key) not in rows[0]:
                continue
            parts = [torch.as_tensor(np.asarray(r[key])).reshape(list(r[SHAPE.format(key)])) for r in rows]
            if key in STACKED or (key == "pixel_values" and parts[0].dim() == 5):
                parts = _padded(parts)
            out[key] = torch.cat(parts, 0)
        return out


def _padded(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor zero-padded at the end of every dimension but the first to the largest size among ``parts``
    (more images, larger images: a processor pads a batch so, its ``pixel_attention_mask`` 0 on the padding)."""
    most = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = []
    for p in parts:
        if list(p.shape[1:]) != most:
            q = p.new_zeros((p.shape[0], *most))
            q[(slice(None), *(slice(0, n) for n in p.shape[1:]))] = p
            p = q
        out.append(p)
    return out


def make_collator(tokenizer, data_cfg: DataConfig) -> ImageCollator:
    """:class:`ImageCollator` with the tokenizer's pad token."""
    return ImageCollator(tokenizer.pad_token_id, data_cfg.pad_to_multiple_of)


def pairing_problem(messages, images: int) -> str | None:
    """Why a row's conversation and its ``images`` images do not go together (a malformed conversation, image parts
    and images in different numbers); None when they do."""
    problem = message_problem(messages)
    if problem:
        return f"its conversation is {problem}"
    if image_parts(messages) != images:
        return f"it has {images} image(s) for {image_parts(messages)} image part(s) in its conversation"
    return None


def image_problem(messages, images) -> str | None:
    """:func:`pairing_problem`, or why an image cannot be read or is empty; None when the row is fine. Reads each
    image's header only (``PIL.Image.verify``), not its pixels."""
    images = list(images or [])
    problem = pairing_problem(messages, len(images))
    if problem:
        return problem
    for j, value in enumerate(images):
        try:
            with open_image(value) as im:
                im.verify()
                if im.width == 0 or im.height == 0:
                    return f"image {j + 1} is empty ({im.width}x{im.height})"
        except Exception as e:  # noqa: BLE001  (PIL raises many kinds for a bad file)
            return f"image {j + 1} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def check_data(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Before any model is built: packing is off; each file has the conversation and image columns, and every row's
    images can be read and match its image parts (:func:`image_problem`: the first bad row of a file is one line
    naming the file and the row; a file that passes is marked in ``<cache>/checked`` and not read again); the model
    folder has a processor with an image processor."""
    d = cfg.data
    if d.packing:
        problems.append("data.packing: vlm_sft does not pack rows (an example's image tensors belong to its row); "
                        "set data.packing=false")
    cols = columns(d)
    for key, files in (("data.train_files", train_files), ("data.validation_files", validation_files)):
        for f in files:
            try:
                names = set(pq.ParquetFile(f).schema_arrow.names)
            except Exception:  # noqa: BLE001  (reported by the generic parquet checks)
                continue
            missing = [(c, s) for c, s in zip(cols, ("data.messages_column", "data.image_column")) if c not in names]
            for col, setting in missing:
                problems.append(f"{key}: '{f}' has no column '{col}' ({setting}); columns: "
                                f"{', '.join(sorted(names))}")
            if not missing:
                _check_rows(key, f, cols, default_cache_dir(d), problems)
    path = cfg.model.tokenizer_path or cfg.model.path
    if path and Path(path).is_dir():
        try:
            load_processor(path)
        except ConfigError as e:
            problems += e.problems


def _check_rows(key: str, path: str, cols: list[str], cache: Path, problems: list[str]) -> None:
    """:func:`image_problem` of every row of ``path``, one row group at a time; one line for the first bad row."""
    mark = cache / "checked" / f"images-{fingerprint({'file': file_id(path), 'columns': cols, 'version': 1})}"
    if mark.exists():
        return
    pf, row = pq.ParquetFile(path), 0
    for g in range(pf.num_row_groups):
        table = pf.read_row_group(g, columns=cols)
        for messages, images in zip(table.column(cols[0]).to_pylist(), table.column(cols[1]).to_pylist()):
            problem = image_problem(messages, images)
            if problem:
                problems.append(f"{key}: '{path}' row {row}: {problem}; fix or drop that row")
                return
            row += 1
    with contextlib.suppress(OSError):  # a read-only cache: the rows are checked again next time
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()


RECIPE = Recipe(name="vlm_sft", model_class=MODEL_CLASS,
                capabilities=Capabilities(generates_text=False, checks_columns=True, counts_rows=True,
                                          mixes_sources=False, evaluates_exports=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, columns=columns, cache_key=cache_key,
                check_data=check_data)
