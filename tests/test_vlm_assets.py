"""The shipped vision-language assets (issue 55): the digits images and the two tiny VLM folders.

In process, no launch: the parquet files hold what ``scripts/make_digits_data.py`` makes (the same pixels and text:
the PNG and parquet bytes may differ with the installed Pillow and pyarrow); each tiny
model renders a digits row with its own processor and chat template, marks only the answer and its end-of-turn token
for the loss, and a model built from its ``config.json`` (``init: scratch``) trains on it, vision tower included.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "data" / "digits"
MODELS = ROOT / "data" / "models"


def _rows(split: str, n: int) -> list[dict]:
    ds = datasets.load_dataset("parquet", data_files=str(DIGITS / f"{split}.parquet"), split="train")
    return [ds[i] for i in range(n)]


def test_digits_are_what_the_script_makes(tmp_path):
    """Regenerated into a temporary folder, the two files hold the shipped rows (pixels and text); they read back as
    one 32x32 RGB image a row, with every digit in both splits and the answer in the assistant turn."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_digits_data.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for split in ("train", "test"):
        made, shipped = (datasets.load_dataset("parquet", data_files=str(d / f"{split}.parquet"), split="train")
                         for d in (tmp_path, DIGITS))
        assert made.remove_columns("images").to_list() == shipped.remove_columns("images").to_list(), split
        assert all(np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
                   for a, b in zip(made["images"], shipped["images"])), split
    for split, rows in (("train", 1497), ("test", 300)):
        ds = datasets.load_dataset("parquet", data_files=str(DIGITS / f"{split}.parquet"), split="train")
        assert len(ds) == rows and sorted(set(ds["label"])) == list(range(10))
        row = ds[0]
        assert len(row["images"]) == 1 and row["images"][0].size == (32, 32) and row["images"][0].mode == "RGB"
        assert row["messages"][1]["content"][0]["text"] == row["answer"] == str(row["label"])
        assert row["prompt"] == row["messages"][:1]


def _trains_on(model_dir: Path, inputs: dict, labels: torch.Tensor) -> None:
    """A model from ``config.json`` (seeded) trains on ``inputs``: a finite loss near ln(vocabulary) and a gradient
    on the vision tower's first layer."""
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - math.log(config.text_config.vocab_size)) < 0.5, loss.item()
    vision = [p for n, p in model.named_parameters() if "visual" in n or "vision_model" in n]
    assert vision and vision[0].grad is not None and vision[0].grad.abs().sum() > 0


def test_tiny_smolvlm_renders_masks_and_trains():
    """Idefics3 (SmolVLM): a batch of two rows, right-padded; each row's assistant mask covers exactly its answer
    digit and ``<end_of_utterance>``, and each image is 4 ``<image>`` tokens between its markers."""
    d = MODELS / "tiny-smolvlm"
    processor = AutoProcessor.from_pretrained(d)
    rows = _rows("train", 2)
    batch = processor.apply_chat_template([r["messages"] for r in rows], tokenize=True, return_dict=True,
                                          return_tensors="pt", return_assistant_tokens_mask=True,
                                          processor_kwargs={"images": [r["images"] for r in rows], "padding": True})
    tok = processor.tokenizer
    image_id = AutoConfig.from_pretrained(d).image_token_id
    for i, row in enumerate(rows):
        ids = batch["input_ids"][i]
        assert int((ids == image_id).sum()) == 4
        marked = tok.convert_ids_to_tokens(ids[batch["assistant_masks"][i].bool()].tolist())
        assert tok.convert_tokens_to_string(marked[:-1]).strip() == row["answer"] and marked[-1] == "<end_of_utterance>"
    labels = torch.where(batch["assistant_masks"].bool(), batch["input_ids"], -100)
    _trains_on(d, {k: v for k, v in batch.items() if k != "assistant_masks"}, labels)


def test_tiny_qwen2_5_vl_renders_masks_and_trains():
    """Qwen2.5-VL: its tokenizer and image processor load without torchvision (the processor's video half needs it:
    then ``AutoProcessor`` is checked too); a 32x32 digit is one 1x4x4 patch grid merged into 4 ``<|image_pad|>``
    tokens, and the assistant mask covers the digit and ``<|im_end|>``."""
    d = MODELS / "tiny-qwen2.5-vl"
    tok, images = AutoTokenizer.from_pretrained(d), AutoImageProcessor.from_pretrained(d)
    if importlib.util.find_spec("torchvision") is not None:
        assert type(AutoProcessor.from_pretrained(d)).__name__ == "Qwen2_5_VLProcessor"
    row = _rows("test", 1)[0]
    pixels = images(row["images"], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 4, 4]]
    pads = int(pixels["image_grid_thw"].prod()) // images.merge_size ** 2
    text = tok.apply_chat_template(row["messages"], tokenize=False).replace("<|image_pad|>", "<|image_pad|>" * pads)
    enc = tok(text, return_tensors="pt")
    rendered = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(rendered["input_ids"], rendered["assistant_masks"]) if m]
    assert tok.decode(marked[:-1]).strip() == row["answer"] and tok.convert_ids_to_tokens(marked[-1]) == "<|im_end|>"
    assert int((enc["input_ids"] == AutoConfig.from_pretrained(d).image_token_id).sum()) == pads == 4
    labels = torch.full_like(enc["input_ids"], -100)
    labels[0, -len(marked) - 1:-1] = enc["input_ids"][0, -len(marked) - 1:-1]
    _trains_on(d, {**enc, **pixels}, labels)


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-smolvlm"])
def test_tiny_vlm_folders_hold_no_weights(name):
    """Config-only, as the other tiny models (``init: scratch``): nothing large ships."""
    files = {p.name for p in (MODELS / name).iterdir()}
    assert "config.json" in files and not any(f.endswith((".safetensors", ".bin")) for f in files)
