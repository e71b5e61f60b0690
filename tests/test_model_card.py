"""The export's model card from hand-made run folders (no training, no DeepSpeed engine): it round-trips through
``huggingface_hub.ModelCard.load``, says what the run logged for the exported step, leaves out what the run does not
have, and names Hub ids only where the folders record them. The card of a real export: tests/test_train.py's
``test_export_command``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from conftest import CONFIGS
from finetune.config import load_run_config
from finetune.lifecycle.checkpoint import MARKER
from finetune.lifecycle.model_card import CARD, write_card


def make_run(root: Path, step: int = 8, world: int = 4, sp: int = 2) -> tuple[Path, Path]:
    """A run folder with a complete-looking ``checkpoints/step<step>`` (its marker only); returns (run, checkpoint)."""
    run, ckpt = root / "run", root / "run" / "checkpoints" / f"step{step}"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text(json.dumps({"step": step, "world_size": world, "zero_stage": 3,
                                           "sequence_parallel_size": sp, "tensor_parallel_size": 1, "time": 0.0}))
    return run, ckpt


def test_card_round_trips_with_what_the_run_logged(tmp_path):
    run, ckpt = make_run(tmp_path)
    rows = [{"step": 4, "launch": 1, "eval/loss": 2.5, "eval/perplexity": 12.18},
            {"step": 8, "launch": 1, "eval/loss": 2.4, "eval/perplexity": 11.02},
            {"step": 8, "launch": 2, "train/loss": 2.3},  # a resumed launch re-ran step 8: its evaluation counts
            {"step": 8, "launch": 2, "eval/loss": 2.25, "eval/perplexity": 9.487735836358526, "eval/accuracy": None},
            {"step": 12, "launch": 2, "eval/loss": 2.0}]  # after the exported step
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "launch"')
    for launch, precision in ((1, "bf16"), (2, "fp32")):
        (run / "launches" / str(launch)).mkdir(parents=True)
        (run / "launches" / str(launch) / "meta.json").write_text(json.dumps(
            {"launch": launch, "git": "cafe", "precision": {"precision": precision}, "versions": {"torch": "2.x"}}))
    (run / "export_check.json").write_text(json.dumps({"checkpoint_step": 8, "max_abs_logit_diff": 1.5e-6,
                                                       "tolerance": 1e-4, "chosen_by": {"last_step": 8}}))
    cfg = load_run_config(CONFIGS / "tiny_gpt.yaml", ["train.gradient_accumulation_steps=3", "model.lora.r=4"])
    path = write_card(tmp_path / "export", ckpt, run, cfg)

    card = ModelCard.load(path)
    assert path.name == CARD == "README.md"
    data = card.data
    assert data.base_model == "tiny-gpt2" and data.library_name == "transformers"  # a local folder: its name
    assert data.pipeline_tag == "text-generation" and data.datasets == ["wikitext2"]
    assert {"finetune", "gpt_clm", "deepspeed", "lora", "peft"} <= set(data.tags)
    meta = data.finetune
    assert meta["checkpoint_step"] == 8 and meta["chosen_by"] == {"last_step": 8}
    assert meta["evaluation"] == {"step": 8, "launch": 2, "metrics": {"eval/loss": 2.25,
                                                                      "eval/perplexity": 9.487735836358526,
                                                                      "eval/accuracy": None}}
    assert {r.metric_name: r.metric_value for r in data.eval_results} == {"eval/loss": 2.25,
                                                                         "eval/perplexity": 9.487735836358526}
    assert meta["export_check"] == {"max_abs_logit_diff": 1.5e-6, "tolerance": 1e-4}
    hp = meta["hyperparameters"]
    assert hp["train.lr"] == cfg.train.lr and hp["train.micro_batch_size"] == 4
    assert hp["global_batch_size"] == 4 * 3 * 2  # micro x accumulation x data-parallel (4 ranks / SP 2)
    assert hp["zero_stage"] == 3 and hp["precision"] == "fp32" and hp["model.lora.r"] == 4
    assert meta["layout"] == {"world_size": 4, "data_parallel_size": 2, "sequence_parallel_size": 2,
                              "tensor_parallel_size": 1}
    assert meta["training_launch"]["launch"] == 2 and meta["versions"]["finetune"]
    assert "- eval/loss: 2.25" in card.text and "eval/accuracy: not finite" in card.text
    assert "1.5e-06" in card.text and "adapter/" in card.text


def test_card_of_a_run_without_evaluation_or_records(tmp_path):
    """No metrics.jsonl, no launch record, no export check, a model from scratch: a card all the same, without
    those parts, and no base model (nothing was started from)."""
    run, ckpt = make_run(tmp_path, step=5, world=1, sp=1)
    cfg = load_run_config(CONFIGS / "tiny_bert.yaml")
    card = ModelCard.load(write_card(tmp_path, ckpt, run, cfg))
    assert card.data.base_model is None and card.data.pipeline_tag == "fill-mask"
    assert card.data.eval_results is None and "model-index" not in card.content
    meta = card.data.finetune
    assert meta["init"] == "scratch" and meta["chosen_by"] == {"named": "step5"}
    assert not {"evaluation", "export_check", "training_launch"} & set(meta)
    assert "precision" not in meta["hyperparameters"] and meta["hyperparameters"]["global_batch_size"] == 4
    assert "no evaluation" in card.text and "trained from scratch" in card.text


@pytest.mark.parametrize("where", ["bundle", "cache"])
def test_hub_ids_only_where_the_folders_record_them(tmp_path, monkeypatch, where):
    """A model and dataset of a ``finetune bundle`` are named by the Hub ids its manifest records (and the model's
    license); a Hugging Face cache snapshot by its repo."""
    monkeypatch.chdir(tmp_path)
    if where == "bundle":
        model, data = Path("bundle/models/Qwen2.5-0.5B"), Path("bundle/data/gsm8k")
        Path("bundle").mkdir()
        Path("bundle/MANIFEST.json").write_text(json.dumps({"format": 1, "files": {}, "sources": [
            {"kind": "model", "name": "Qwen2.5-0.5B", "spec": "Qwen/Qwen2.5-0.5B@main", "origin": "hub",
             "resolved_revision": "abc", "license": "apache-2.0"},
            {"kind": "dataset", "name": "gsm8k", "spec": "openai/gsm8k:main", "origin": "hub"}]}))
        expected = ("Qwen/Qwen2.5-0.5B", "openai/gsm8k", "apache-2.0")
    else:
        model = Path("hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd")
        data = Path("hub/datasets--openai--gsm8k/snapshots/4567ef")
        expected = ("Qwen/Qwen2.5-0.5B", "openai/gsm8k", None)
    model.mkdir(parents=True)
    data.mkdir(parents=True)
    run, ckpt = make_run(tmp_path, world=1, sp=1)
    cfg = load_run_config(CONFIGS / "tiny_gpt.yaml", [f"model.path={model}",
                                                      f"data.train_files=[{data / 'train-00000.parquet'}]"])
    card = ModelCard.load(write_card(tmp_path, ckpt, run, cfg))
    assert (card.data.base_model, card.data.datasets[0], card.data.license) == expected
