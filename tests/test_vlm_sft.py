"""``vlm_sft``: vision-language SFT computes what one device computes, at ZeRO 0 and ZeRO 3.

The rows (written here from ``data/digits``) hold 1 to 3 images of different sizes and answers of 1 to 3 digits, so
the micro-batches of a step hold different numbers of images and of answer tokens: token weighting matters on them.
Each launch (2 ranks, micro-batch 2 x accumulation 2, 3 steps, the tiny SmolVLM from scratch; ZeRO-3 with every
parameter partitioned, vision tower included) is compared with :mod:`parity_reference`: the same global batches run
through the plain transformers model's own forward (images included) and the textbook loss over the global batch's
answer tokens (losses 1e-5, gradient norms 1e-4 at ZeRO 0 and 1e-5 at ZeRO 3, as the text parity battery).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from conftest import REPO, cpu_env, launch, launch_problems, ok, read_metrics
from parity_reference import reference_run

CONFIG = REPO / "finetune" / "recipes" / "configs" / "vlm_sft_digits.yaml"
SIZES = [(32, 32), (24, 40), (40, 24), (16, 16)]


def _write_rows(path: Path, n: int = 24) -> None:
    """``n`` rows: row i asks about ``1 + i % 3`` digits images (sizes cycling through :data:`SIZES`) with a question
    whose length varies, and answers with their digits."""
    source = datasets.load_dataset("parquet", data_files=str(REPO / "data" / "digits" / "train.parquet"),
                                   split="train")
    images, messages = [], []
    k = 0
    for i in range(n):
        count = 1 + i % 3
        row_images, digits = [], []
        for _ in range(count):
            row = source[k]
            row_images.append(row["images"][0].resize(SIZES[k % len(SIZES)]))
            digits.append(row["answer"])
            k += 1
        question = "Which digits are these?" + " Read them from left to right." * (i % 4)
        user = [{"type": "image", "text": None}] * count + [{"type": "text", "text": question}]
        messages.append([{"role": "user", "content": user},
                         {"role": "assistant", "content": [{"type": "text", "text": " ".join(digits)}]}])
        images.append(row_images)
    part = datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")})
    features = datasets.Features({"images": datasets.List(datasets.Image()),
                                  "messages": datasets.List({"role": datasets.Value("string"), "content": part})})
    datasets.Dataset.from_dict({"images": images, "messages": messages}, features=features).to_parquet(str(path))


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vlm_rows") / "rows.parquet"
    _write_rows(path)
    return path


def _overrides(rows: Path, stage: int) -> list[str]:
    return [f"data.train_files=[{rows}]", f"data.validation_files=[{rows}]", f"ds.zero_optimization.stage={stage}",
            "train.micro_batch_size=2", "train.gradient_accumulation_steps=2", "train.max_steps=3",
            "train.warmup_steps=0", "train.log_every=1", "train.eval_every=0", "train.eval_on_start=false",
            "train.save_every=0", "export=false", "data.max_seq_len=128",
            f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"]


def _logged(run: Path, key: str) -> list[float]:
    values = {r["step"]: r[key] for r in read_metrics(run) if key in r}
    assert sorted(values) == [1, 2, 3], f"missing steps in {run}/metrics.jsonl"
    return [values[s] for s in (1, 2, 3)]


def _max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The tiny SmolVLM with seeded random weights saved as a pretrained folder (weights, tokenizer, processor)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    source = REPO / "data" / "models" / "tiny-smolvlm"
    folder = tmp_path_factory.mktemp("smolvlm_pretrained")
    torch.manual_seed(3)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(source)).save_pretrained(folder)
    for f in source.iterdir():
        if f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("stage", [0, 3, "3-lora"])
def test_vlm_sft_matches_the_plain_model_on_one_device(tmp_path, rows, pretrained, stage):
    """ZeRO 0 trains every weight from scratch, and a resume from its step-2 checkpoint repeats its step 3; ZeRO 3 (every parameter partitioned) starts from a pretrained folder
    with ``model.freeze: [vision_tower]``, and its export holds that tower's weights bit for bit as they were loaded
    (and every other weight changed); ZeRO 3 with LoRA (``all-linear``: the language model's linear layers only)
    against peft's model on one device."""
    from safetensors.torch import load_file

    from finetune.config import load_run_config

    lora = stage == "3-lora"
    stage = 3 if lora else stage
    overrides = _overrides(rows, stage)
    if stage == 3:
        overrides += [f"model.path={pretrained}", "model.init=pretrained"]
        overrides += ["model.lora.r=4"] if lora else ["model.freeze=[vision_tower]", "export=true"]
    else:
        overrides += ["train.save_every=2"]
    out = tmp_path / f"z{stage}"
    proc = launch(CONFIG, [*overrides, f"output_dir={out}"], nproc=2)
    ok(proc)
    assert "vlm_sft: 24 rows -> 24 examples; 48 images" in proc.stdout
    ref = reference_run(load_run_config(CONFIG, overrides), 2, 3)
    # token weighting matters on these batches: the mean of micro-batch means is another number
    assert max(abs(a - b) / b for a, b in zip(ref.micro_batch_losses, ref.token_losses)) > 1e-4
    assert _max_rel(_logged(out, "train/loss"), ref.losses) <= 1e-5, (_logged(out, "train/loss"), ref.losses)
    norms = _logged(out, "train/grad_norm")
    assert _max_rel(norms, ref.grad_norms) <= (1e-4 if stage == 0 else 1e-5), (norms, ref.grad_norms)
    if stage == 0:  # resumed from the step-2 checkpoint, step 3 repeats the uninterrupted run's loss
        again = tmp_path / "resumed"
        ok(launch(CONFIG, [*overrides, f"output_dir={again}"], nproc=2, resume=str(out / "checkpoints" / "step2")))
        resumed = {r["step"]: r["train/loss"] for r in read_metrics(again) if "train/loss" in r}
        assert list(resumed) == [3] and resumed[3] == pytest.approx(_logged(out, "train/loss")[2], rel=1e-6)
    if lora:
        assert "LoRA r=4 alpha=16 dropout=0 on 14 modules (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, " \
               "v_proj)" in proc.stdout  # the language model's 2 x 7 linear layers, none of the vision tower's
    elif stage == 3:
        assert "frozen: vision_tower (23,840 parameters); 610,624 parameters train" in proc.stdout
        before, after = load_file(pretrained / "model.safetensors"), load_file(out / "export" / "model.safetensors")
        tower = [k for k in before if ".vision_model." in k]
        assert tower and all(torch_equal(before[k], after[k]) for k in tower)
        assert all(not torch_equal(before[k], after[k]) for k in before if k not in tower)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_micro_batch_of_different_image_counts_is_the_processors_own_batch(rows):
    """Rows tokenized one by one and collated (1 and 3 images of different sizes, different lengths) give the tensors
    the model's processor makes of the two conversations as one padded batch: token ids, attention mask, every
    image tensor; labels only on each row's answer and end-of-turn token."""
    import numpy as np
    import torch

    from finetune.config import load_run_config
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    cfg = load_run_config(CONFIG, [f"data.train_files=[{rows}]"])
    recipe = get_recipe("vlm_sft")
    tokenizer = load_tokenizer(cfg, recipe)
    examples = recipe.tokenize_function(tokenizer, cfg.data)
    raw = datasets.load_dataset("parquet", data_files=str(rows), split="train")
    picked = [raw[0], raw[2]]  # 1 and 3 images
    tokenized = examples({"messages": [r["messages"] for r in picked],
                          "images": [[{"bytes": _png(im), "path": None} for im in r["images"]] for r in picked]})
    batch = recipe.make_collator(tokenizer, cfg.data)([{k: v[i] for k, v in tokenized.items()} for i in range(2)])
    want = examples.processor.apply_chat_template(
        [r["messages"] for r in picked], tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"images": [r["images"] for r in picked], "padding": True})
    assert batch["pixel_values"].shape[:2] == (2, 3)
    for key in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask"):
        assert torch.equal(batch[key], want[key].to(batch[key].dtype)), key
    assert not batch["pixel_attention_mask"][0, 1:].any() and batch["pixel_attention_mask"][1].any(dim=(1, 2)).all()
    for i, r in enumerate(picked):
        trained = batch["labels"][i][batch["labels"][i] != -100].tolist()
        text = tokenizer.decode(trained)
        assert text.strip() == r["messages"][1]["content"][0]["text"] + "<end_of_utterance>", text
    assert np.asarray(tokenized["pixel_values__shape"][1]).tolist() == [1, 3, 3, 32, 32]


def _png(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.extended  # suite budget: the shipped run and 100 held-out generations
def test_shipped_digits_config_learns_and_its_export_answers(tmp_path):
    """``vlm_sft_digits.yaml`` as shipped (200 steps, 2 ranks): the export loads with ``AutoProcessor`` and
    ``AutoModelForImageTextToText`` and reads most of 100 held-out digits greedily (chance: 0.1; the margin and the
    run's figures: docs/performance.md), and ``pipeline("image-text-to-text")`` answers with a digit."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

    out = tmp_path / "run"
    ok(launch(CONFIG, [f"output_dir={out}", f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"], nproc=2))
    export = out / "export"
    card = (export / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in card and "A multimodal (image-text-to-text) model" in card
    processor = AutoProcessor.from_pretrained(export)
    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    held_out = datasets.load_dataset("parquet", data_files=str(REPO / "data" / "digits" / "test.parquet"),
                                     split="train").select(range(100))
    right = 0
    for row in held_out:
        enc = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt",
                                            processor_kwargs={"images": row["images"]})
        with torch.no_grad():
            new = model.generate(**enc, max_new_tokens=3, do_sample=False)[0, enc["input_ids"].shape[1]:]
        right += processor.tokenizer.decode(new, skip_special_tokens=True).strip()[:1] == row["answer"]
    assert right >= 60, f"{right} of 100 held-out digits read after the shipped run"
    answer = pipeline("image-text-to-text", model=str(export))(
        text=[{"role": "user", "content": [{"type": "image", "image": held_out[0]["images"][0]},
                                          {"type": "text", "text": held_out[0]["prompt"][0]["content"][1]["text"]}]}],
        max_new_tokens=3, return_full_text=False)
    assert answer[0]["generated_text"].strip()[:1].isdigit(), answer


def test_plan_counts_the_whole_model_and_sizes_the_language_model():
    """``finetune plan`` builds the VLM on the meta device: every parameter (vision tower, connector, language model)
    in the model states, the language model's shape for the activations, the vision tower and projector's share, and
    the tokens one image takes (the processor's own count: Idefics3's ``image_seq_len`` 4 for a 32x32 image, as the
    rendered training rows hold them)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.config import load_run_config
    from finetune.preflight import plan

    cfg = load_run_config(CONFIG, [])
    shape = plan.model_shape(cfg)
    assert shape.params == 634_464 and shape.hidden == 64 and shape.layers == 2 and shape.head_outputs == 8256
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(cfg.model.path))
    assert shape.vision_params == sum(p.numel() for n, p in model.named_parameters()
                                      if n.startswith(("model.vision_model.", "model.connector.")))
    assert (shape.image_tokens, shape.image_size) == (4, "32x32")
    text = plan.render(cfg, shape, {}, [], "fp32", 1, 1, 1e9, None, None)
    assert f"vision tower and projector: {shape.vision_params:,} parameters" in text and "32x32 image: 4 tokens" in text


def test_bad_image_inputs_are_one_line_before_any_model(tmp_path, rows):
    """In process, the launch's own validation: a missing image column, an unreadable image, a row with fewer images
    than image parts, packing on, a ``model.freeze`` key that matches nothing, a model folder without a processor:
    one line each, naming the file and the row."""
    import importlib.util

    import pyarrow.parquet as pq

    def problems(*overrides: str) -> list[str]:
        return launch_problems(CONFIG, [f"output_dir={tmp_path / 'out'}", f"data.train_files=[{rows}]",
                                        f"data.validation_files=[{rows}]", f"data.cache_dir={tmp_path / 'cache'}",
                                        *overrides])

    assert problems() == []
    table = pq.read_table(rows)
    images = table.column("images").to_pylist()
    broken = [list(x) for x in images]
    broken[5] = [{"bytes": b"not an image", "path": None}] + broken[5][1:]
    fewer = [list(x) for x in images]
    fewer[7] = fewer[7][:-1]
    files = {}
    for name, column in (("broken", broken), ("fewer", fewer)):
        files[name] = tmp_path / f"{name}.parquet"
        pq.write_table(table.set_column(0, "images", [column]), files[name])
    cases = {
        "data.image_column=pictures": "has no column 'pictures' (data.image_column)",
        f"data.train_files=[{files['broken']}]": f"'{files['broken']}' row 5: image 1 cannot be read",
        f"data.train_files=[{files['fewer']}]": f"'{files['fewer']}' row 7: it has 1 image(s) for 2 image part(s)",
        "data.packing=true": "data.packing: vlm_sft does not pack rows",
        "model.freeze=[vision_towr]": "model.freeze: 'vision_towr' match(es) no parameter of Idefics3For",
        "model.tokenizer_path=data/models/gsm8k-bpe-8k": "has no image processor; vlm_sft needs an image-text",
        **({} if importlib.util.find_spec("torchvision") else {  # Qwen2.5-VL's processor is built on torchvision
            "model.path=data/models/tiny-qwen2.5-vl": "cannot be built here: Qwen2VLVideoProcessor requires the "
                                                      "Torchvision library"}),
    }
    for override, want in cases.items():
        found = problems(*override.split(" "))
        assert any(want in p for p in found), (override, found)
        assert len(found) == (2 if "pictures" in want else 1), (override, found)


def test_min_and_max_pixels_bound_every_image(tmp_path):
    """``data.min_pixels`` / ``data.max_pixels``: an image outside the bounds is resized into them, its aspect ratio
    kept; Qwen2.5-VL's image processor takes them as its own ``min_pixels`` / ``max_pixels``; they are part of the
    tokenization cache key; min above max is one line."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from finetune.config import load_run_config
    from finetune.data import images
    from finetune.recipes import get_recipe

    wide = Image.new("RGB", (40, 24))
    small = images.fit_pixels(wide, 0, 500)
    assert small.width * small.height <= 500 and abs(small.width / small.height - 40 / 24) < 0.1
    large = images.fit_pixels(wide, 2000, 0)
    assert large.width * large.height >= 2000 and abs(large.width / large.height - 40 / 24) < 0.1
    assert images.fit_pixels(wide, 100, 1000) is wide
    cfg = load_run_config(CONFIG, ["data.min_pixels=3136", "data.max_pixels=12544"])
    qwen = AutoImageProcessor.from_pretrained(REPO / "data" / "models" / "tiny-qwen2.5-vl")
    images.set_pixels(qwen, cfg.data)
    assert (qwen.size.shortest_edge, qwen.size.longest_edge) == (3136, 12544)
    idefics = images.load_processor(str(REPO / "data" / "models" / "tiny-smolvlm"), data_cfg=cfg.data).image_processor
    assert idefics.size.longest_edge == 32  # its own setting: data.max_pixels reaches it by resizing the images
    recipe = get_recipe("vlm_sft")
    assert recipe.cache_key(cfg.data) != recipe.cache_key(load_run_config(CONFIG, []).data)
    found = launch_problems(CONFIG, [f"output_dir={tmp_path / 'out'}", "data.min_pixels=5000", "data.max_pixels=1000"])
    assert any("data.min_pixels: 5000 is more than data.max_pixels 1000" in p for p in found), found


def test_a_plain_prompt_column_renders_as_the_conversation(tmp_path):
    """``data.prompt_column`` + ``data.response_column`` (text) with the images: each row becomes a user turn that
    shows its images then asks the prompt, and an assistant turn with the response; the tokenized rows (ids, labels,
    image tensors) equal those of the same rows written as conversations, and ``--check`` passes on them."""
    import numpy as np
    import pyarrow.parquet as pq

    from finetune.config import load_run_config
    from finetune.data.tokenization import ParquetRows
    from finetune.engine.model import load_tokenizer
    from finetune.preflight.validate import validate_run
    from finetune.recipes import get_recipe

    digits = REPO / "data" / "digits" / "test.parquet"
    table = pq.read_table(digits).slice(0, 4)
    question = [m[0]["content"][1]["text"] for m in table.column("messages").to_pylist()]
    plain_rows = tmp_path / "plain.parquet"
    pq.write_table(table.select(["images", "answer"]).append_column("question", [question]), plain_rows)
    recipe = get_recipe("vlm_sft")
    base = [f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}"]
    cfg_plain = load_run_config(CONFIG, [*base, "data.messages_column=", "data.prompt_column=question",
                                         "data.response_column=answer", f"data.train_files=[{plain_rows}]",
                                         f"data.validation_files=[{plain_rows}]"])
    cfg_chat = load_run_config(CONFIG, base)
    validate_run(cfg_plain, None, 1, True)
    tok = load_tokenizer(cfg_chat, recipe)
    got = recipe.tokenize_function(tok, cfg_plain.data)(
        ParquetRows([str(plain_rows)], recipe.columns(cfg_plain.data)).take(np.arange(4)))
    want = recipe.tokenize_function(tok, cfg_chat.data)(
        ParquetRows([str(digits)], recipe.columns(cfg_chat.data)).take(np.arange(4)))
    assert set(got) == set(want)
    for key in want:
        assert [np.asarray(v).tolist() for v in got[key]] == [np.asarray(v).tolist() for v in want[key]], key


STOCK = Path(__file__).parent / "stock_chat_templates"
"""Stock chat templates of the image-text families (copied from their published checkpoints; none marks the
assistant's text with ``{% generation %}``)."""

FAMILIES = ["tiny-smolvlm", "tiny-qwen2.5-vl", "tiny-gemma3"]


def _family(name: str, tmp_path_factory=None) -> Path:
    """A tiny image-text model folder (config and processor, no weights): the shipped SmolVLM and Qwen2.5-VL (skipped
    where its processor cannot be built: its video processor needs torchvision), or a Gemma 3 built here into the
    session's temporary folder (Gemma 3's processor with Gemma 3's stock chat template, ``data/models/gsm8k-bpe-8k``
    plus its image and turn tokens; 32x32 images of 4 tokens)."""
    import importlib.util

    if name == "tiny-qwen2.5-vl" and importlib.util.find_spec("torchvision") is None:
        pytest.skip("Qwen2.5-VL's processor needs torchvision (its video processor)")
    if name != "tiny-gemma3":
        return REPO / "data" / "models" / name
    folder = tmp_path_factory.getbasetemp() / "tiny-gemma3"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer, Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "gsm8k-bpe-8k", extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tok,
                    chat_template=(STOCK / "gemma3.jinja").read_text(), image_seq_length=4).save_pretrained(folder)
    Gemma3Config(text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 16, "sliding_window": 16, "max_position_embeddings": 512},
                 vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                 mm_tokens_per_image=4, boi_token_index=tok.boi_token_id, image_token_index=tok.image_token_id,
                 eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>")).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", FAMILIES)
def test_the_collated_batch_runs_the_model_as_the_processors_own_batch(rows, name, tmp_path_factory):
    """Issue 68 item 1: two rows (1 and 3 images) tokenized and collated by ``vlm_sft`` give every model input the
    processor's own padded batch gives (Qwen2.5-VL's ``mm_token_type_ids``, from which it builds its 3-D rotary
    positions; Gemma 3's ``token_type_ids``, its bidirectional attention within an image), and the plain model's
    logits on the real tokens are the same for both batches."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.config import load_run_config
    from finetune.data.batch import model_inputs
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    folder = _family(name, tmp_path_factory)
    cfg = load_run_config(CONFIG, [f"data.train_files=[{rows}]", f"model.path={folder}", "data.max_seq_len=256"])
    recipe = get_recipe("vlm_sft")
    tokenizer = load_tokenizer(cfg, recipe)
    examples = recipe.tokenize_function(tokenizer, cfg.data)
    raw = datasets.load_dataset("parquet", data_files=str(rows), split="train")
    picked = [raw[0], raw[2]]
    tokenized = examples({"messages": [r["messages"] for r in picked],
                          "images": [[{"bytes": _png(im), "path": None} for im in r["images"]] for r in picked]})
    batch = recipe.make_collator(tokenizer, cfg.data)([{k: v[i] for k, v in tokenized.items()} for i in range(2)])
    tokenizer.padding_side = "right"
    want = examples.processor.apply_chat_template(
        [r["messages"] for r in picked], tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"images": [r["images"] for r in picked], "padding": True})
    assert set(model_inputs(batch)) - {"labels"} == set(want), (set(batch), set(want))
    for key in want:
        assert torch.equal(batch[key], want[key].to(batch[key].dtype)), key
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder)).eval()
    with torch.no_grad():
        ours = model(**{k: v for k, v in model_inputs(batch).items() if k != "labels"}).logits
        theirs = model(**want).logits
    real = want["attention_mask"].bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-6), (ours[real] - theirs[real]).abs().max()


def test_exif_orientation_is_applied_as_the_libraries_apply_it(tmp_path):
    """Issue 68 item 14: a 64x32 JPEG whose EXIF orientation is 6 (rotate 90 degrees clockwise to view) decodes
    32x64, with the pixels ``transformers.image_utils.load_image`` and ``datasets.Image`` give (both apply
    ``ImageOps.exif_transpose``)."""
    import numpy as np
    from PIL import Image
    from transformers.image_utils import load_image

    from finetune.data import images

    pixels = np.zeros((32, 64, 3), np.uint8)
    pixels[:, :32] = (255, 0, 0)  # left half red: upright, the red half is on top
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "sideways.jpg"
    Image.fromarray(pixels).save(path, exif=exif.tobytes(), quality=95)
    got = images.decode_image(str(path), "test")
    want = load_image(str(path))
    assert got.size == want.size == (32, 64)
    assert np.array_equal(np.asarray(got), np.asarray(want.convert("RGB")))
    stored = datasets.Image().decode_example({"bytes": path.read_bytes(), "path": None})
    assert np.array_equal(np.asarray(images.decode_image({"bytes": path.read_bytes(), "path": None}, "test")),
                          np.asarray(stored.convert("RGB")))


def test_an_image_file_changed_on_disk_is_tokenized_again(tmp_path):
    """Issue 68 item 14: rows that name their images by a path relative to the parquet file; after one image file
    is rewritten with other pixels (the parquet file untouched), the next tokenization misses the cache and its
    ``pixel_values`` are the new image's; an image file broken after ``--check`` passed is found by the next check
    (its mark is keyed on the image files too)."""
    import os

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from finetune.config import load_run_config
    from finetune.data.dataset import load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    (tmp_path / "images").mkdir()
    for k in range(2):
        Image.new("RGB", (32, 32), (40 * k, 0, 0)).save(tmp_path / "images" / f"{k}.png")
    turn = pa.struct([("role", pa.string()), ("content", pa.list_(pa.struct([("type", pa.string()),
                                                                            ("text", pa.string())])))])
    messages = [[{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Digit?"}]},
                 {"role": "assistant", "content": [{"type": "text", "text": str(k)}]}] for k in range(2)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"messages": pa.array(messages, pa.list_(turn)),
                             "images": pa.array([[f"images/{k}.png"] for k in range(2)], pa.list_(pa.string()))}),
                   path)
    cfg = load_run_config(CONFIG, [f"data.train_files=[{path}]", f"data.validation_files=[{path}]",
                                   f"data.cache_dir={tmp_path / 'cache'}"])
    recipe = get_recipe("vlm_sft")
    tokenizer = load_tokenizer(cfg, recipe)

    def first_pixels():
        split = load_splits(recipe, tokenizer, cfg.data, cfg.train.seed, num_proc=1).train
        return np.asarray(split[0]["pixel_values"])

    before = first_pixels()
    image = tmp_path / "images" / "0.png"
    stat = image.stat()
    Image.new("RGB", (32, 32), (0, 0, 250)).save(image)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = first_pixels()
    assert not np.array_equal(before, after)
    from finetune.data import images

    cols, problems = ["messages", "images"], []
    images.check_image_rows("data.train_files", str(path), cols, tmp_path / "cache", problems)
    assert problems == []
    broken = tmp_path / "images" / "1.png"
    stat = broken.stat()
    broken.write_bytes(b"not an image")
    os.utime(broken, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    images.check_image_rows("data.train_files", str(path), cols, tmp_path / "cache", problems)
    assert len(problems) == 1 and "row 1: image 1 cannot be read" in problems[0], problems


def _jpeg(size: int = 64) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((size, size, 3)) * 255).astype("uint8")).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.mark.parametrize("bad", ["text_only", "truncated"])
def test_a_text_only_row_or_a_truncated_jpeg_is_one_line_naming_its_file_and_row(tmp_path, bad):
    """Issue 68 items 6 and 15: a row without images in an image dataset (the tokenized columns would differ in
    length, and at ZeRO-3 a rank with an image-less micro-batch would skip the vision tower alone) and a truncated
    JPEG (its header is valid) are refused by ``--check``, one line per file key naming the file and the row; the
    tokenization (a launch whose check marks are stale) stops on them with the same file and row, never an
    ``ArrowInvalid``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from finetune.config import load_run_config
    from finetune.data.dataset import load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.errors import ConfigError
    from finetune.recipes import get_recipe

    good = _jpeg()
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    turn = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    user = [{"type": "image", "text": None}, {"type": "text", "text": "Digit?"}]
    messages = [[{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "7"}]}]
                for _ in range(3)]
    pictures = [[{"bytes": good, "path": None}] for _ in range(3)]
    if bad == "text_only":
        messages[1][0]["content"] = user[1:]
        pictures[1] = []
        want = "row 1: it has no image"
    else:
        pictures[1] = [{"bytes": good[: len(good) * 3 // 4], "path": None}]
        want = "row 1: image 1 cannot be read (OSError: image file is truncated"
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"messages": pa.array(messages, pa.list_(turn)), "images": pa.array(
        pictures, pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))}), path)
    overrides = [f"data.train_files=[{path}]", f"data.validation_files=[{path}]", f"data.cache_dir={tmp_path / 'c'}",
                 f"output_dir={tmp_path / 'out'}"]
    found = launch_problems(CONFIG, overrides)
    assert len(found) == 2 and all(f"'{path}' {want}" in p for p in found), found
    assert {p.split(":")[0] for p in found} == {"data.train_files", "data.validation_files"}, found
    cfg = load_run_config(CONFIG, overrides)
    recipe = get_recipe("vlm_sft")
    with pytest.raises(ConfigError) as e:
        load_splits(recipe, load_tokenizer(cfg, recipe), cfg.data, cfg.train.seed, num_proc=1)
    line = e.value.problems[0]
    assert len(e.value.problems) == 1 and f"'{path}' row 1: " in line, e.value.problems
    assert ("image file is truncated" if bad == "truncated" else "it has no image") in line, line


@pytest.mark.parametrize("name,template,end", [("tiny-smolvlm", "smolvlm.jinja", "<end_of_utterance>"),
                                               ("tiny-qwen2.5-vl", "qwen2_5_vl.jinja", "<|im_end|>"),
                                               ("tiny-gemma3", "gemma3.jinja", "<end_of_turn>")])
def test_a_stock_template_without_generation_marks_trains_the_answers(rows, name, template, end, tmp_path_factory):
    """Issue 68 (settled): the stock image-text chat templates have no ``{% generation %}`` marks, so
    ``return_assistant_tokens_mask`` marks nothing and every row was dropped as having no answer. With each
    family's stock template every row is kept and exactly its answer and the turn's end (and the newline the
    template puts after it) train, located by rendering prefixes with their images; no image token trains."""
    from finetune.config import load_run_config
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    folder = _family(name, tmp_path_factory)
    cfg = load_run_config(CONFIG, [f"data.train_files=[{rows}]", f"model.path={folder}", "data.max_seq_len=256",
                                   f"data.chat_template={STOCK / template}"])
    recipe = get_recipe("vlm_sft")
    tokenizer = load_tokenizer(cfg, recipe)
    examples = recipe.tokenize_function(tokenizer, cfg.data)
    raw = datasets.load_dataset("parquet", data_files=str(rows), split="train").select(range(3))
    tokenized = examples({"messages": raw["messages"],
                          "images": [[{"bytes": _png(im), "path": None} for im in r] for r in raw["images"]]})
    assert len(tokenized["labels"]) == 3, examples.summary()
    for labels, r in zip(tokenized["labels"], raw):
        trained = [t for t in labels if t != -100]
        assert tokenizer.decode(trained).strip() == r["messages"][1]["content"][0]["text"] + end, \
            tokenizer.decode(trained)


def test_an_image_in_an_assistant_turn_does_not_train(tmp_path):
    """Issue 68 (settled): an assistant turn that shows an image (``{"type": "image"}`` in its content) was marked
    whole by ``{% generation %}``, so the model was trained to predict the image's placeholder tokens, which only
    the processor places. Those tokens (``<image>``, ``<fake_token_around_image>``, ``<global-img>`` for Idefics3)
    get label -100; the turn's text still trains."""
    from PIL import Image

    from finetune.config import load_run_config
    from finetune.data.images import image_token_ids
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    cfg = load_run_config(CONFIG, ["data.max_seq_len=256"])
    recipe = get_recipe("vlm_sft")
    tokenizer = load_tokenizer(cfg, recipe)
    examples = recipe.tokenize_function(tokenizer, cfg.data)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Show me a seven."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, {"type": "image"}]}]
    out = examples({"messages": [messages], "images": [[{"bytes": _png(Image.new("RGB", (32, 32))), "path": None}]]})
    ids, labels = out["input_ids"][0], out["labels"][0]
    placed = image_token_ids(examples.processor)
    assert len(placed) == 3 and sum(t in placed for t in ids) == 7  # 4 <image>, 2 fake tokens, <global-img>
    assert all(label == -100 for t, label in zip(ids, labels) if t in placed)
    assert tokenizer.decode([t for t in labels if t != -100]).strip() == "Here:<end_of_utterance>"
