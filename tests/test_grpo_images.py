"""``grpo`` on an image-text model: the prompts hold images, generation and the training pass see them.

The prompts (written here from ``data/digits``) hold 1 or 2 images of different sizes, some stored as bytes and some
as file paths relative to the parquet file. The tiny SmolVLM (Idefics3) from scratch is compared with its own plain
transformers calls on each prompt alone: ``generate`` with the prompt's ``pixel_values`` (greedy, so the tokens must
be the same), and a forward of prompt + completion with them (the completion tokens' log-probabilities).
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, launch, launch_problems, ok, read_metrics

CONFIG = REPO / "finetune" / "recipes" / "configs" / "grpo_digits.yaml"
MODEL = REPO / "data" / "models" / "tiny-smolvlm"
SIZES = [(32, 32), (24, 40), (40, 24)]


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_prompts(folder: Path, n: int = 12) -> Path:
    """``n`` prompt rows in ``folder/prompts.parquet``: row i shows ``1 + i % 2`` digit images (sizes cycling
    through :data:`SIZES`; every third row's images stored as files in ``folder/images`` named by a path relative
    to the parquet file, the others as bytes) and asks for them; ``answer``: the first digit."""
    source = datasets.load_dataset("parquet", data_files=str(REPO / "data" / "digits" / "train.parquet"),
                                   split="train")
    (folder / "images").mkdir(parents=True, exist_ok=True)
    prompts, images, answers, k = [], [], [], 0
    for i in range(n):
        count = 1 + i % 2
        row_images, digits = [], []
        for _ in range(count):
            image = source[k]["images"][0].resize(SIZES[k % len(SIZES)])
            if i % 3 == 0:
                name = f"images/{k}.png"
                image.save(folder / name)
                row_images.append({"bytes": None, "path": name})
            else:
                row_images.append({"bytes": _png(image), "path": None})
            digits.append(source[k]["answer"])
            k += 1
        text = "Which digit is this?" if count == 1 else "Which digit comes first?"
        prompts.append([{"role": "user", "content": [{"type": "image", "text": None}] * count
                         + [{"type": "text", "text": text}]}])
        images.append(row_images)
        answers.append(digits[0])
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    table = pa.table({
        "prompt": pa.array(prompts, pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))]))),
        "images": pa.array(images, pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        "answer": pa.array(answers, pa.string())})
    path = folder / "prompts.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("grpo_images"))


def first_batch(config: Path, overrides: list[str], path: Path, n: int) -> tuple:
    """``(cfg, tokenizer, batch)``: the first ``n`` rows of ``path`` tokenized and collated by the configured recipe
    of ``config`` with ``overrides``, as the launch's data pipeline does."""
    from finetune.config import load_run_config
    from finetune.data.tokenization import ParquetRows
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import recipe_for

    cfg = load_run_config(config, overrides)
    recipe = recipe_for(cfg)
    tok = load_tokenizer(cfg, recipe)
    rows = recipe.tokenize_function(tok, cfg.data)(ParquetRows([str(path)], recipe.columns(cfg.data))
                                                   .take(np.arange(n)))
    return cfg, tok, recipe.make_collator(tok, cfg.data)([{k: v[i] for k, v in rows.items()} for i in range(n)])


def _overrides(prompts: Path, tmp: Path) -> list[str]:
    return [f"model.path={MODEL}", "model.init=scratch", f"data.train_files=[{prompts}]",
            f"data.validation_files=[{prompts}]", f"data.cache_dir={tmp / 'cache'}", f"output_dir={tmp / 'run'}"]


def test_generation_and_the_training_pass_see_each_prompts_images(prompts, tmp_path):
    """Three prompts (1, 2 and 1 images; the first two from relative file paths and bytes) tokenized and collated
    by the recipe: two greedy completions of each through the rollout (each prompt prefilled once with its image
    tensors) are the tokens the plain model's ``generate`` gives the prompt alone with its ``pixel_values``; the
    training pass over the ``[B G]`` prompt + completion rows (left-padded, image tensors repeated per completion)
    gives each completion token the log-probability of the plain model's forward of that row alone."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.data import images
    from finetune.engine.rollout import image_token_ids
    from finetune.recipes import grpo
    from finetune.recipes.grpo.loss import completion_logps
    from finetune.recipes.grpo.rollout import generate

    cfg, tok, batch = first_batch(CONFIG, _overrides(prompts, tmp_path), prompts, 3)
    assert [r["pixel_values"].shape[1] for r in batch["images"]] == [1, 2, 1]  # [1, images, 3, H, W] each
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left-padded, lengths differ
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(MODEL)).eval()
    g = dataclasses.replace(cfg.train.grpo, max_completion_length=5, temperature=1.0, num_generations=2)
    n = g.num_generations
    out = generate(model, batch, g, tok, n, False, 0, False)
    alone = []
    for i, row in enumerate(batch["images"]):
        real = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][real][None]
        with torch.no_grad():
            want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                  do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  suppress_tokens=image_token_ids(model.config), **row)[0, ids.shape[1]:]
        alone.append((ids[0], row, want))
        for j in range(n):
            got = out["completion_ids"][i * n + j][: int(out["lengths"][i * n + j])]
            assert got.tolist() == want[: len(got)].tolist(), (i, j, got, want)
    zeros = torch.zeros(len(out["completion_ids"]))
    seqs = grpo._sequences(batch, out, g, zeros, zeros, zeros, torch.zeros(len(zeros), 1))
    assert seqs["pixel_values"].shape[:2] == (3 * n, 2) and set(seqs["image_keys"]) == {"pixel_values",
                                                                                          "pixel_attention_mask"}
    with torch.no_grad():
        logps, _ = completion_logps(model, seqs, g.temperature)
    for i, (ids, row, want) in enumerate(alone):
        for j in range(n):
            k, length = i * n + j, int(out["lengths"][i * n + j])
            c = out["completion_ids"][k][:length]
            full = torch.cat([ids, c])[None]
            with torch.no_grad():
                logits = model(input_ids=full, attention_mask=torch.ones_like(full), **row).logits[0]
            ref = torch.log_softmax(logits[len(ids) - 1:-1].float(), -1).gather(-1, c[:, None]).squeeze(-1)
            assert torch.allclose(logps[k][:length], ref, atol=1e-5), (k, logps[k][:length], ref)
    assert images.is_image_text_model(str(MODEL)) and not images.is_image_text_model(str(REPO / "data"))

    # a model whose likeliest next token is its image placeholder: generation never samples it (a completion's image
    # token would have no image features in the training pass, which transformers refuses)
    image_token = model.config.image_token_id
    assert image_token_ids(model.config) == [image_token]
    first = out["completion_ids"][0][0]
    with torch.no_grad():
        model.lm_head.weight[image_token] = 3 * model.lm_head.weight[first]
        ids, row, _ = alone[0]
        plain = model.generate(input_ids=ids[None], max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id,
                               **row)[0, -1]
    assert plain == image_token
    for sample in (False, True):
        again = generate(model, batch, g, tok, n, sample, 0, False)
        assert not (again["completion_ids"] == image_token).any() and again["lengths"].min() > 0


def test_check_names_what_does_not_go_with_images(prompts, tmp_path):
    """``--check`` (in process): a bad image row, a missing image column, tools, sequence parallelism, the hybrid
    engine rollout and ``train.eval_generate`` are each one line before any model is built."""
    def problems(*overrides: str) -> list[str]:
        return launch_problems(CONFIG, [*_overrides(prompts, tmp_path), *overrides])

    assert problems() == []
    table = pq.read_table(prompts)
    broken = table.column("images").to_pylist()
    broken[4] = [{"bytes": b"not an image", "path": None}]
    bad = prompts.parent / "broken.parquet"  # beside the images its rows name by relative paths
    pq.write_table(table.set_column(1, "images", pa.array(broken, table.schema.field("images").type)), bad)
    cases = {
        f"data.train_files=[{bad}]": f"'{bad}' row 4: image 1 cannot be read",
        "data.image_column=pictures": "has no column 'pictures'",
        f"train.grpo.tools=[{REPO}/data/tools/calculator.py:calculate]": "train.grpo.tools / environment: not available with images",
        "train.grpo.generation_backend=hybrid_engine": "hybrid_engine takes token ids alone",
        "train.eval_generate.prompts=4": "train.eval_generate.prompts: 4;",
    }
    for override, want in cases.items():
        found = problems(override)
        assert any(want in p for p in found), (override, found)


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_zero3_lora_with_kl_trains_on_images_and_exports(prompts, tmp_path):
    """2 ranks, ZeRO-3 with every parameter partitioned (vision tower included), LoRA and ``beta`` > 0 (the
    reference pass with adapters off sees the images too), 2 steps with evaluation: it trains, logs rewards and KL,
    and its export reloads as an image-text model with its processor."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run = tmp_path / "run"
    ok(launch(CONFIG, [*_overrides(prompts, tmp_path), "ds.zero_optimization.stage=3",
                       "ds.zero_optimization.stage3_param_persistence_threshold=0", "model.lora.r=4",
                       "train.grpo.beta=0.04", "train.max_steps=2", "train.eval_every=2", "train.log_every=1",
                       "train.micro_batch_size=2", "train.save_every=2"]))
    metrics = read_metrics(run)
    trained = [r for r in metrics if "train/loss" in r]
    assert len(trained) == 2 and all("train/kl" in r and "train/reward" in r for r in trained), trained
    assert any("eval/reward" in r for r in metrics)
    model = AutoModelForImageTextToText.from_pretrained(run / "export")
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert AutoProcessor.from_pretrained(run / "export").image_processor is not None


@pytest.mark.parametrize("name", ["tiny-smolvlm", "tiny-qwen2.5-vl", "tiny-gemma3"])
def test_rollouts_and_the_training_pass_run_the_model_on_the_processors_inputs(prompts, tmp_path, name, tmp_path_factory):
    """Issue 68 item 1: three prompts (1, 2 and 1 images) collated by the recipe, two greedy completions of each
    through the rollout (each prompt prefilled once, its KV cache repeated) are the tokens the plain model's
    ``generate`` gives the processor's own inputs of the prompt alone (Qwen2.5-VL's ``mm_token_type_ids`` included:
    its 3-D rotary positions), and the training pass gives each completion token the log-probability of the plain
    model's forward of the processor's inputs of prompt + completion."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.data.images import decode_image, load_processor
    from finetune.engine.rollout import image_token_ids
    from finetune.recipes import grpo
    from finetune.recipes.grpo.loss import completion_logps
    from finetune.recipes.grpo.rollout import generate
    from test_vlm_sft import _family

    folder = _family(name, tmp_path_factory)
    cfg, tok, batch = first_batch(CONFIG, [*_overrides(prompts, tmp_path), f"model.path={folder}",
                                           "data.max_seq_len=256"], prompts, 3)
    processor = load_processor(str(folder))
    rows = pq.read_table(prompts).slice(0, 3).to_pylist()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder)).eval()
    g = dataclasses.replace(cfg.train.grpo, max_completion_length=5, temperature=1.0, num_generations=2)
    n = g.num_generations
    out = generate(model, batch, g, tok, n, False, 0, False)
    zeros = torch.zeros(len(out["completion_ids"]))
    seqs = grpo._sequences(batch, out, g, zeros, zeros, zeros, torch.zeros(len(zeros), 1))
    with torch.no_grad():
        logps, _ = completion_logps(model, seqs, g.temperature)
    for i, row in enumerate(rows):
        pictures = [decode_image(v, "test", str(prompts.parent)) for v in row["images"]]
        alone = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=True, return_tensors="pt",
                                              processor_kwargs={"images": pictures})
        with torch.no_grad():
            want = model.generate(**alone, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, suppress_tokens=image_token_ids(model.config))
        want = want[0, alone["input_ids"].shape[1]:]
        for j in range(n):
            k = i * n + j
            c = out["completion_ids"][k][: int(out["lengths"][k])]
            assert c.tolist() == want[: len(c)].tolist(), (k, c, want)
            full = {**alone, "input_ids": torch.cat([alone["input_ids"][0], c])[None],
                    "attention_mask": torch.ones(1, alone["input_ids"].shape[1] + len(c), dtype=torch.long)}
            for key in ("mm_token_type_ids", "token_type_ids"):
                if key in alone:
                    full[key] = torch.nn.functional.pad(alone[key], (0, len(c)))
            with torch.no_grad():
                logits = model(**full).logits[0]
            p = alone["input_ids"].shape[1]
            ref = torch.log_softmax(logits[p - 1:-1].float(), -1).gather(-1, c[:, None]).squeeze(-1)
            assert torch.allclose(logps[k][: len(c)], ref, atol=1e-5), (k, logps[k][: len(c)], ref)
