"""``dpo`` on an image-text model: each pair's prompt holds images, which both of its sequences see.

The pairs reuse :func:`test_grpo_images.write_prompts`'s prompts (1 or 2 digit images of different sizes, bytes and
relative file paths) with the right digit as the chosen answer and another as the rejected one. The tiny SmolVLM
(Idefics3) from scratch is compared with its own plain transformers forward of each sequence alone with its images.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, launch, launch_problems, ok, read_metrics
from test_grpo_images import MODEL, first_batch, write_prompts

CONFIG = REPO / "finetune" / "recipes" / "configs" / "dpo_gsm8k.yaml"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpo_images")
    table = pq.read_table(write_prompts(folder))
    answers = table.column("answer").to_pylist()

    def turn(text: str) -> list[dict]:
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    kind = pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))]))
    table = table.append_column("chosen", pa.array([turn(a) for a in answers], kind))
    table = table.append_column("rejected", pa.array([turn(str((int(a) + 3) % 10)) for a in answers], kind))
    path = folder / "pairs.parquet"
    pq.write_table(table, path)
    return path


def _overrides(pairs: Path, tmp: Path) -> list[str]:
    return [f"model.path={MODEL}", "model.tokenizer_path=", "model.init=scratch", f"data.train_files=[{pairs}]",
            f"data.validation_files=[{pairs}]", f"data.cache_dir={tmp / 'cache'}", f"output_dir={tmp / 'run'}",
            "data.max_seq_len=64", "train.eval_generate.prompts=0"]


def test_both_sequences_of_a_pair_see_its_images(pairs, tmp_path):
    """Three pairs (1, 2 and 1 images) tokenized and collated by the recipe: the ``[2B]`` batch holds each pair's
    image tensors for its chosen and again for its rejected sequence; the labels are the answer digit and its
    end-of-turn token; each sequence's summed log-probability equals the plain model's forward of that sequence
    alone with its images."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.recipes import dpo

    _, tok, batch = first_batch(CONFIG, _overrides(pairs, tmp_path), pairs, 3)
    assert batch["input_ids"].shape[0] == 6 and batch["pixel_values"].shape[:2] == (6, 2)
    assert torch.equal(batch["pixel_values"][:3], batch["pixel_values"][3:])
    answers = pq.read_table(pairs).column("answer").to_pylist()
    for i in range(6):
        trained = tok.decode(batch["labels"][i][batch["labels"][i] != -100])
        want = answers[i % 3] if i < 3 else str((int(answers[i % 3]) + 3) % 10)
        assert trained.strip() == want + "<end_of_utterance>", (i, trained)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(MODEL)).eval()
    with torch.no_grad():
        logps, tokens = dpo.sequence_logps(model, batch)
    for i in range(6):
        real = batch["attention_mask"][i].bool()
        ids, labels = batch["input_ids"][i][real][None], batch["labels"][i][real]
        k = i % 3
        n_images = int(batch["pixel_attention_mask"][k].flatten(1).any(1).sum())
        pictures = {"pixel_values": batch["pixel_values"][k:k + 1, :n_images],
                    "pixel_attention_mask": batch["pixel_attention_mask"][k:k + 1, :n_images]}
        with torch.no_grad():
            logits = model(input_ids=ids, **pictures).logits[0, :-1].float()
        target = labels[1:]
        keep = target != -100
        want = torch.log_softmax(logits, -1)[keep].gather(-1, target[keep][:, None]).sum()
        assert abs(float(logps[i]) - float(want)) <= 1e-4, (i, float(logps[i]), float(want))
        assert int(tokens[i]) == int(keep.sum())


def test_check_names_a_bad_image_and_what_does_not_go_with_images(pairs, tmp_path):
    """``--check`` (in process): a missing image column and ``train.eval_generate`` with images are one line each."""
    def problems(*overrides: str) -> list[str]:
        return launch_problems(CONFIG, [*_overrides(pairs, tmp_path), *overrides])

    assert problems() == []
    assert any("has no column 'pictures'" in p for p in problems("data.image_column=pictures"))
    assert any("train.eval_generate.prompts: 4;" in p for p in problems("train.eval_generate.prompts=4"))


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_zero3_dpo_on_images_trains_and_exports(pairs, tmp_path):
    """2 ranks, ZeRO-3 with every parameter partitioned (vision tower included), 3 steps: the reference pass and
    the policy see the images; the reward accuracy is logged and the export reloads as an image-text model."""
    from transformers import AutoModelForImageTextToText

    run = tmp_path / "run"
    ok(launch(CONFIG, [*_overrides(pairs, tmp_path), "ds.zero_optimization.stage=3",
                       "ds.zero_optimization.stage3_param_persistence_threshold=0", "train.max_steps=3",
                       "train.eval_every=3", "train.log_every=1", "train.micro_batch_size=2", "train.save_every=3",
                       "train.warmup_steps=0"]))
    metrics = read_metrics(run)
    assert any("eval/rewards/accuracies" in r for r in metrics), metrics
    assert len([r for r in metrics if "train/loss" in r]) == 3
    model = AutoModelForImageTextToText.from_pretrained(run / "export")
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"


@pytest.mark.parametrize("name", ["tiny-smolvlm", "tiny-qwen2.5-vl", "tiny-gemma3"])
def test_the_pair_batch_is_the_processors_own_batch(pairs, tmp_path, name, tmp_path_factory):
    """Issue 68 item 1: two pairs collated by the recipe hold every model input the processor gives the four
    conversations (prompt + chosen, prompt + rejected, with the prompt's images) as one right-padded batch
    (Qwen2.5-VL's ``mm_token_type_ids``, its 3-D rotary positions' source, included), and the plain model's logits
    on the real tokens are the same for both."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.data.batch import model_inputs
    from finetune.data.images import decode_image, load_processor
    from test_vlm_sft import _family

    folder = _family(name, tmp_path_factory)
    overrides = [*_overrides(pairs, tmp_path), f"model.path={folder}", "data.max_seq_len=256"]
    _, tok, batch = first_batch(CONFIG, overrides, pairs, 2)
    rows = pq.read_table(pairs).slice(0, 2).to_pylist()
    processor = load_processor(str(folder))
    processor.tokenizer.padding_side = "right"
    pictures = [[decode_image(v, "test", str(pairs.parent)) for v in r["images"]] for r in rows]
    want = processor.apply_chat_template(
        [r["prompt"] + r[side] for side in ("chosen", "rejected") for r in rows], tokenize=True, return_dict=True,
        return_tensors="pt", processor_kwargs={"images": pictures + pictures, "padding": True})
    got = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
    assert set(got) == set(want), (set(got), set(want))
    for key in want:
        assert torch.equal(got[key], want[key].to(got[key].dtype)), key
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder)).eval()
    with torch.no_grad():
        ours, theirs = model(**got).logits, model(**want).logits
    real = want["attention_mask"].bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-6), (ours[real] - theirs[real]).abs().max()


@pytest.mark.parametrize("name,template,end", [("tiny-smolvlm", "smolvlm.jinja", "<end_of_utterance>"),
                                               ("tiny-gemma3", "gemma3.jinja", "<end_of_turn>")])
def test_a_stock_template_without_generation_marks_scores_the_responses(pairs, tmp_path, name, template, end,
                                                                        tmp_path_factory):
    """Issue 68 (settled): with a family's stock chat template (no ``{% generation %}`` marks) every pair was
    dropped as having no answer; now each pair is kept and its chosen and rejected responses (and the turn's end)
    are the targets, located by rendering prefixes with the prompt's images."""
    from test_vlm_sft import STOCK, _family

    folder = _family(name, tmp_path_factory)
    overrides = [*_overrides(pairs, tmp_path), f"model.path={folder}", "data.max_seq_len=256",
                 f"data.chat_template={STOCK / template}"]
    _, tok, batch = first_batch(CONFIG, overrides, pairs, 3)
    answers = pq.read_table(pairs).column("answer").to_pylist()
    for i in range(6):
        want = answers[i % 3] if i < 3 else str((int(answers[i % 3]) + 3) % 10)
        trained = tok.decode(batch["labels"][i][batch["labels"][i] != -100])
        assert trained.strip() == want + end, (i, trained)
