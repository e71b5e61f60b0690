"""Images in the data pipeline, for the recipes that train image-text models (``vlm_sft``, ``grpo`` on an
``AutoModelForImageTextToText`` checkpoint): the model's processor, a row's images read and checked, the processor's
image tensors stored flat in the tokenized rows and joined per micro-batch the way the processor joins a batch.

Images are stored as ``datasets.Image`` stores them (``{bytes, path}``; the bytes win), as bytes, or as file paths;
a relative path is relative to the folder of the parquet file that names it (:data:`SOURCE_DIR`, which
:class:`finetune.data.tokenization.ParquetRows` adds to every batch of rows it reads). Conversations are TRL's
conversational vision form: a list of ``{role, content}`` whose content is text or a list of parts
``{"type": "text", "text": ...}`` and ``{"type": "image"}``, the row's images in the order of its image parts.
"""

from __future__ import annotations

import copy
import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoProcessor

from finetune.data.dataset import default_cache_dir, file_columns, fingerprint, source_id
from finetune.data.tokenization import SOURCE_DIR, SOURCE_ROW
from finetune.errors import ConfigError

TEXT_KEYS = ("input_ids", "attention_mask", "assistant_masks")
"""Keys of the processor's output that the recipes store themselves (the token ids, their mask, the assistant
marks that become the labels); :func:`store` keeps every other key."""

TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
"""Per-token model inputs a processor returns beside ``input_ids`` (``[rows, tokens]``, 1 on an image's tokens):
Qwen2.5-VL builds its 3-D (M-RoPE) positions only when given ``mm_token_type_ids`` (``compute_3d_position_ids``;
without them every token gets a 1-D position), Gemma 3 attends bidirectionally within an image only when given
``token_type_ids``. Stored as token lists (:func:`store`, where the processor's ``model_input_names`` name them),
padded with 0 like ``attention_mask`` (:func:`pad_tokens`) and 0 on generated tokens, as TRL's collators and
``generate`` extend them."""

STACKED = ("pixel_attention_mask",)
"""Image tensors that a processor stacks per row (padded to the batch's most images) whatever their rank; besides
these, any 5-dimensional ``pixel_values`` (``[rows, images, 3, H, W]``, Idefics3's)."""

SHAPE = "{}__shape"
"""The column that holds an image tensor's shape (the tensor itself is stored flat)."""


def is_image_text_model(path: str) -> bool:
    """Whether the model folder ``path`` holds an image-text model: its ``config.json`` has a ``vision_config``
    (Idefics3/SmolVLM, Qwen2.5-VL, LLaVA, Gemma 3, ...). False when there is no readable ``config.json``."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def in_prompts(cfg) -> bool:
    """Whether a run's prompts hold images (``grpo``, ``dpo``): its model (``model.path``, a
    :class:`~finetune.config.RunConfig`'s) is an image-text model (:func:`is_image_text_model`)."""
    return bool(cfg.model.path) and is_image_text_model(cfg.model.path)


def load_processor(path: str, tokenizer=None, who: str = "vlm_sft", data_cfg=None):
    """The model's ``AutoProcessor`` from ``path`` (local files only), with ``tokenizer`` (prepared) in place of its
    own; ``who`` (the recipe) names the caller in errors; ``data_cfg``'s ``min_pixels`` / ``max_pixels``, when set,
    replace the image processor's own where it has them (Qwen2.5-VL's; :func:`fit_pixels` resizes for the others).""

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
        raise ConfigError(f"model.path: '{path}' has no processor {who} can load ({type(e).__name__}: "
                          f"{first.strip()}); point model.tokenizer_path at the folder with the model's processor "
                          f"files (preprocessor_config.json, processor_config.json)") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"model.path: the processor in '{path}' ({type(processor).__name__}) has no image "
                          f"processor; {who} needs an image-text model's processor")
    if tokenizer is not None:
        processor.tokenizer = tokenizer
    if data_cfg is not None:
        set_pixels(processor.image_processor, data_cfg)
    return processor


class ProcessorSource:
    """An image-text model's processor for the map functions, named once when the recipe is configured
    (``model.tokenizer_path`` or ``model.path``) and loaded at most once per process, on first use
    (:func:`load_processor`); each map function gets a shallow copy holding its own prepared tokenizer.

    Args:
        path: the folder with the processor's files.
        who: the recipe, named in errors.
        data_cfg: ``data`` (its ``min_pixels`` / ``max_pixels``).

    Raises (on first use):
        ConfigError: the folder has no processor an image-text model can use.
    """

    def __init__(self, path: str, who: str, data_cfg=None):
        self.path, self.who, self.data_cfg = str(path), who, data_cfg
        self._loaded = None

    def __call__(self, tokenizer):
        """The processor with ``tokenizer`` (prepared) in place of its own."""
        if self._loaded is None:
            self._loaded = load_processor(self.path, None, self.who, self.data_cfg)
        processor = copy.copy(self._loaded)
        processor.tokenizer = tokenizer
        return processor


def processor_source(cfg, who: str) -> ProcessorSource:
    """The run's :class:`ProcessorSource`: ``model.tokenizer_path`` or ``model.path``."""
    return ProcessorSource(cfg.model.tokenizer_path or cfg.model.path, who, cfg.data)


def set_pixels(image_processor, data_cfg) -> None:
    """``data.min_pixels`` / ``data.max_pixels`` (when set) as the image processor's own pixel bounds where it takes
    them (its ``valid_kwargs`` name ``min_pixels``: Qwen2-VL's and Qwen2.5-VL's, whose ``size`` holds them as
    ``shortest_edge`` / ``longest_edge``, in pixels); other image processors keep their settings."""
    takes = "min_pixels" in getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    size = getattr(image_processor, "size", None)
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = getattr(data_cfg, key, 0)
        if not value or not takes or size is None:
            continue
        if isinstance(size, dict):
            size[edge] = value
        else:
            setattr(size, edge, value)
        if hasattr(image_processor, key):
            setattr(image_processor, key, value)


def open_image(value, folder: str | None = None):
    """One image of a row, opened lazily (``PIL.Image.open``: header read, pixels not decoded): ``{bytes, path}``
    (``datasets.Image``'s storage; the bytes win), bytes, or a file path (a relative one relative to ``folder``,
    the parquet file's folder, when given).

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
        return Image.open(Path(folder) / value if folder and not Path(value).is_absolute() else value)
    raise ValueError(f"an image is {type(value).__name__}, not image bytes or a file path")


def fit_pixels(image, min_pixels: int = 0, max_pixels: int = 0):
    """``image`` resized (aspect ratio kept, bicubic, each side at least 1) so that its pixel count is at most
    ``max_pixels`` and at least ``min_pixels`` (0: no bound); as it is when it already fits (``data.min_pixels`` /
    ``data.max_pixels``, the bounds Qwen2.5-VL's processor takes as ``min_pixels`` / ``max_pixels``)."""
    from PIL import Image

    pixels = image.width * image.height
    scale = 1.0
    if max_pixels and pixels > max_pixels:
        scale = (max_pixels / pixels) ** 0.5
    elif min_pixels and pixels < min_pixels:
        scale = (min_pixels / pixels) ** 0.5
    if scale == 1.0:
        return image
    width, height = max(1, int(image.width * scale)), max(1, int(image.height * scale))
    if min_pixels and width * height < min_pixels:  # rounding down fell short
        width, height = width + 1, height + 1
    return image.resize((width, height), Image.Resampling.BICUBIC)


def decode_image(value, where: str, folder: str | None = None, data_cfg=None):
    """One image of a row (:func:`open_image`) decoded, turned upright by its EXIF orientation
    (``ImageOps.exif_transpose``, as ``datasets.Image`` and ``transformers.image_utils.load_image`` do: a phone's
    JPEG stored sideways is seen as its viewers show it), as an RGB PIL image, resized into ``data_cfg``'s
    ``min_pixels`` / ``max_pixels`` (:func:`fit_pixels`) when given.

    Raises:
        ConfigError: unreadable or empty (one line: ``where``, what was wrong).
    """
    from PIL import ImageOps

    try:
        image = open_image(value, folder)
        image.load()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: an image cannot be read ({type(e).__name__}: {e}); fix or drop that row") \
            from None
    if image.width == 0 or image.height == 0:
        raise ConfigError(f"{where}: an image is empty ({image.width}x{image.height}); fix or drop that row")
    image = ImageOps.exif_transpose(image).convert("RGB")
    if data_cfg is not None:
        image = fit_pixels(image, data_cfg.min_pixels, data_cfg.max_pixels)
    return image


ROWS_VERSION = 3
"""The layout of the tokenized image rows (2: the processor's per-token inputs, :data:`TOKEN_KEYS`, are kept; 3: the
assistant turns of templates without ``{% generation %}`` and no image token trained: :func:`assistant_mask`);
part of every image recipe's cache key (:func:`pixel_key`), so rows tokenized by an older layout are not reused."""


def row_where(batch: dict, i: int, columns: str) -> str:
    """How errors name row ``i`` of a batch of rows: ``'<parquet file>' row <n>`` (:data:`SOURCE_ROW`, which
    :class:`finetune.data.tokenization.ParquetRows` adds), else ``a row of <columns>``."""
    return batch[SOURCE_ROW][i] if SOURCE_ROW in batch else f"a row of {columns}"


def folder_of(batch: dict, i: int) -> str | None:
    """The folder of row ``i``'s parquet file (:data:`SOURCE_DIR`; relative image paths are relative to it), or
    None."""
    return batch[SOURCE_DIR][i] if SOURCE_DIR in batch else None


def pixel_key(data_cfg) -> dict:
    """The image settings that change the tokenized rows (for a recipe's cache key): ``min_pixels``, ``max_pixels``
    when set, and :data:`ROWS_VERSION`."""
    return {"image_rows": ROWS_VERSION,
            **{k: getattr(data_cfg, k) for k in ("min_pixels", "max_pixels") if getattr(data_cfg, k)}}


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


GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
"""A chat template's ``{% generation %}`` tag (``apply_chat_template(return_assistant_tokens_mask=True)`` marks the
text inside it)."""


def marks_assistant(template: str | None) -> bool:
    """Whether ``template`` marks assistant text with ``{% generation %}`` outside Jinja comments."""
    return bool(template) and bool(GENERATION.search(re.sub(r"{#.*?#}", "", template, flags=re.S)))


IMAGE_TOKENS = ("image_token", "fake_image_token", "global_image_tag", "boi_token", "eoi_token", "video_token",
                "vision_start_token", "vision_end_token")
"""Attributes of a processor or its tokenizer that name the tokens an image becomes (Idefics3's ``<image>``,
``<fake_token_around_image>``, ``<global-img>``; Qwen2.5-VL's ``<|image_pad|>``; Gemma 3's ``<start_of_image>``,
``<image_soft_token>``, ``<end_of_image>``)."""


def image_token_ids(processor) -> set[int]:
    """The token ids of :data:`IMAGE_TOKENS` that the processor's tokenizer knows (none of them text)."""
    tok = getattr(processor, "tokenizer", processor)
    out = set()
    for owner in (processor, tok):
        for name in IMAGE_TOKENS:
            token = getattr(owner, name, None)
            i = tok.convert_tokens_to_ids(token) if isinstance(token, str) else None
            if isinstance(i, int) and i != tok.unk_token_id:
                out.add(i)
    return out


def assistant_mask(processor, messages: list, pictures: list, enc: dict, template: str | None = None,
                   where: str = "data") -> list[int]:
    """1 on the assistant turns' tokens of ``enc`` (the processor's output of ``messages`` with ``pictures``) but
    an image's (:func:`image_token_ids`: an image in an assistant turn is input the processor places, never a
    prediction), 0 elsewhere: the template's ``{% generation %}`` marks (``enc["assistant_masks"]``) when it has them (``template``,
    else the processor's own), else from rendering prefixes, as ``sft`` does for text: turn ``i`` spans from the
    end of ``messages[:i]`` rendered with the assistant's turn opened to the end of ``messages[:i + 1]``, each
    prefix processed with the images its image parts show (so an image's tokens count as in the whole row). Stock
    templates (Qwen2.5-VL's, SmolVLM's, Gemma 3's) have no marks.

    Raises:
        ConfigError: a prefix renders differently when more turns follow (the assistant turns cannot be located;
            one line, ``where`` naming the row).
    """
    ids = np.asarray(enc["input_ids"]).reshape(-1).tolist()
    if marks_assistant(template or getattr(processor, "chat_template", None)):
        mask = np.asarray(enc["assistant_masks"]).reshape(-1).tolist()
        return _without_images(processor, ids, mask)
    kwargs = {"chat_template": template} if template else {}

    def render(turns: list, opened: bool) -> list[int]:
        shown = pictures[:image_parts(turns)]
        out = processor.apply_chat_template(turns, add_generation_prompt=opened, tokenize=True, return_dict=True,
                                            return_tensors="np", processor_kwargs={"images": shown} if shown else {},
                                            **kwargs)
        return np.asarray(out["input_ids"]).reshape(-1).tolist()

    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start = len(render(messages[:i], True)) if i else 0
        upto = render(messages[: i + 1], False)
        if ids[: len(upto)] != upto:
            raise ConfigError(f"{where}: the chat template renders the start of a conversation differently when more "
                              f"turns follow, so assistant turns cannot be located; mark assistant text with "
                              f"{{% generation %}} ... {{% endgeneration %}} in data.chat_template")
        mask[start:len(upto)] = [1] * (len(upto) - start)
    return _without_images(processor, ids, mask)


def _without_images(processor, ids: list[int], mask: list[int]) -> list[int]:
    drop = image_token_ids(processor)
    return [0 if t in drop else m for t, m in zip(ids, mask)]


def image_parts(messages: list) -> int:
    """The number of ``{"type": "image"}`` parts of a conversation."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


def conversation(prompt, images: int) -> list:
    """A row's prompt as a conversation: a list of messages as it is; a plain text prompt as one user turn that shows
    the row's ``images`` images, then the text (LLaVA's and TRL's order)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": prompt}]}]
    return prompt


def pairing_problem(messages, images: int) -> str | None:
    """Why a row's conversation (or plain text prompt: :func:`conversation`) and its ``images`` images do not go
    together (a malformed conversation, no image, image parts and images in different numbers); None when they do.

    A row without images is refused: the tokenized rows would lack its image tensors (the columns would differ in
    length), and at ZeRO-3 a micro-batch without an image on one rank would skip the vision tower there only, while
    the other ranks gather its parameters."""
    messages = conversation(messages, images)
    problem = message_problem(messages)
    if problem:
        return f"its conversation is {problem}"
    if images == 0:
        return ("it has no image (rows without images are not supported in an image dataset: a batch without one "
                "would skip the vision tower on one rank, which hangs ZeRO-3)")
    if image_parts(messages) != images:
        return f"it has {images} image(s) for {image_parts(messages)} image part(s) in its conversation"
    return None


def image_problem(messages, images, folder: str | None = None) -> str | None:
    """:func:`pairing_problem`, or why an image cannot be read or is empty; None when the row is fine. Decodes each
    image (``PIL.Image.load``): a truncated JPEG has a valid header (``PIL.Image.verify`` passes it) and fails only
    where its pixels are read."""
    images = list(images or [])
    problem = pairing_problem(messages, len(images))
    if problem:
        return problem
    for j, value in enumerate(images):
        try:
            with open_image(value, folder) as im:
                im.load()
                if im.width == 0 or im.height == 0:
                    return f"image {j + 1} is empty ({im.width}x{im.height})"
        except Exception as e:  # noqa: BLE001  (PIL raises many kinds for a bad file)
            return f"image {j + 1} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def check_image_rows(key: str, path: str, cols: list[str], cache: Path, problems: list[str]) -> None:
    """:func:`image_problem` of every row of ``path`` (``cols``: the conversation and image columns), one row group
    at a time; one line for the first bad row, naming the file and the row. A file that passes is marked in
    ``<cache>/checked`` (keyed on its version and those of the image files it names:
    :func:`finetune.data.dataset.source_id`) and not read again."""
    parts = {"file": source_id(path, cols[1]), "columns": cols, "version": 3}
    mark = cache / "checked" / f"images-{fingerprint(parts)}"
    if mark.exists():
        return
    pf, row = pq.ParquetFile(path), 0
    for g in range(pf.num_row_groups):
        table = pf.read_row_group(g, columns=cols)
        for messages, images in zip(table.column(cols[0]).to_pylist(), table.column(cols[1]).to_pylist()):
            problem = image_problem(messages, images, str(Path(path).parent))
            if problem:
                problems.append(f"{key}: '{path}' row {row}: {problem}; fix or drop that row")
                return
            row += 1
    with contextlib.suppress(OSError):  # a read-only cache: the rows are checked again next time
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()


def check_prompt_files(cfg, who: str, cols: list[str], reads: str, train_files: list[str],
                       validation_files: list[str], problems: list[str]) -> list[tuple[str, str]]:
    """A recipe whose prompts hold images (``grpo``, ``dpo`` on an image-text model), before any model is built: no
    sequence parallelism (an image's tokens cannot be split across ranks), every file has the columns ``cols``
    (else one line, ``reads`` naming them), its rows pass :func:`check_image_rows` (the prompt column, ``cols[0]``,
    with ``data.image_column``), and the model folder has a processor (:func:`load_processor`).

    Returns:
        The ``(key, file)`` of the files whose rows passed, for the recipe's own row checks.
    """
    d, passed = cfg.data, []
    if cfg.parallel.sequence_parallel_size > 1:
        problems.append(f"parallel.sequence_parallel_size: {cfg.parallel.sequence_parallel_size}; model.path "
                        f"'{cfg.model.path}' is an image-text model and an image's tokens cannot be split across "
                        f"ranks; set it to 1")
    for key, f, names in file_columns(train_files, validation_files):
        missing = [c for c in cols if c not in names]
        if missing:
            problems.append(f"{key}: '{f}' has no column {', '.join(repr(c) for c in missing)} (columns: "
                            f"{', '.join(names)}); {who} with images reads {reads}")
            continue
        start = len(problems)
        check_image_rows(key, f, [cols[0], d.image_column], default_cache_dir(d), problems)
        if len(problems) == start:
            passed.append((key, f))
    try:
        load_processor(cfg.model.tokenizer_path or cfg.model.path, who=who)
    except ConfigError as e:
        problems += e.problems
    return passed


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


def store(enc: dict, out: dict[str, list], names=None) -> int:
    """Append one row's processor output ``enc`` to the tokenized columns ``out``: its per-token inputs
    (:data:`TOKEN_KEYS`, those among ``names``, the processor's ``model_input_names``; all when None) as token
    lists, and every other key but :data:`TEXT_KEYS` (the image tensors) flat, its shape in :data:`SHAPE`. Returns
    how many image tensors it stored."""
    n = 0
    for key, value in enc.items():
        if key in TEXT_KEYS:
            continue
        value = np.asarray(value)
        if key in TOKEN_KEYS:
            if names is None or key in names:
                out.setdefault(key, []).append(value.reshape(-1).tolist())
            continue
        out.setdefault(key, []).append(value.ravel())
        out.setdefault(SHAPE.format(key), []).append(list(value.shape))
        n += 1
    return n


def pad_tokens(rows: list[dict], width: int, left: bool = False, prefix: str = "") -> dict[str, torch.Tensor]:
    """The rows' per-token inputs (:data:`TOKEN_KEYS`, read as ``prefix + key``) as ``[rows, width]`` int64
    tensors under their own names, padded with 0 on the right (``left``: on the left), as the processor pads a
    batch's ``attention_mask``; none when the rows have none."""
    out = {}
    for key in TOKEN_KEYS:
        if prefix + key not in rows[0]:
            continue
        t = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            v = torch.as_tensor(list(r[prefix + key]), dtype=torch.long)
            if left:
                t[i, width - len(v):] = v
            else:
                t[i, :len(v)] = v
        out[key] = t
    return out


def row_tensors(row: dict) -> dict[str, torch.Tensor]:
    """A tokenized row's image tensors (those :func:`store` wrote), each in its shape."""
    return {key: torch.as_tensor(np.asarray(row[key])).reshape(list(row[SHAPE.format(key)]))
            for key in row if not key.endswith("__shape") and SHAPE.format(key) in row}


def join(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several rows' image tensors (:func:`row_tensors`) as the processor joins a batch: per-row stacks
    (:data:`STACKED`, 5-dimensional ``pixel_values``) zero-padded to the most and largest images (:func:`_padded`)
    and stacked, flat ones (Qwen2.5-VL's patches and ``image_grid_thw``, LLaVA's ``[images, 3, H, W]``)
    concatenated in row order. A row may appear several times (``grpo``'s completions of one prompt)."""
    out = {}
    for key in rows[0] if rows else ():
        parts = [r[key] for r in rows]
        if key in STACKED or (key == "pixel_values" and parts[0].dim() == 5):
            parts = _padded(parts)
        out[key] = torch.cat(parts, 0)
    return out
