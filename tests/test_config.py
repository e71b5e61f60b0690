"""Run-config parsing, precedence, strictness, and validation of every shipped config (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config import RunConfig, load_run_config
from finetune.errors import ConfigError
from finetune.engine.ds_config import known_top_level_keys, resolve_ds_config
from finetune.preflight.validate import validate_run

from conftest import EXPORT_STAND_INS, REPO, refused_here

RUN_CONFIGS = sorted((REPO / "finetune" / "recipes" / "configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))

# The reference user's target config points at paths on their cluster; here they become the tiny stand-ins.
STAND_INS = {
    **EXPORT_STAND_INS,
    "bert_large_mlm_wikitext2_zero3.yaml": [
        "model.path=data/models/bert-small", "model.init=scratch",
        "model.tokenizer_path=data/models/bert-base-uncased-tokenizer",
        "data.train_files=[data/wikitext2/test.parquet]", "data.validation_files=[data/wikitext2/validation.parquet]"],
}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_precedence_defaults_file_cli(tmp_path):
    """defaults < file < command line, key by key."""
    cfg_file = write(tmp_path, "recipe: gpt_clm\ntrain:\n  lr: 1.0e-3\n  micro_batch_size: 4\n")
    cfg = load_run_config(cfg_file, ["train.lr=3e-5"])
    assert cfg.train.lr == 3e-5  # CLI beats file
    assert cfg.train.micro_batch_size == 4  # file beats default
    assert cfg.train.gradient_accumulation_steps == RunConfig().train.gradient_accumulation_steps  # default
    assert load_run_config(cfg_file, ["train.lr=1", "train.lr=2"]).train.lr == 2.0  # later override wins


def test_override_types_and_ds_keys(tmp_path):
    cfg = load_run_config(write(tmp_path, "recipe: gpt_clm\n"),
                          ["data.packing=false", "train.max_steps=7", "data.train_files=[a.parquet,b.parquet]",
                           "ds.zero_optimization.stage=3", "ds.bf16.enabled=false", "output_dir=/tmp/somewhere"])
    assert cfg.data.packing is False and cfg.train.max_steps == 7
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.ds == {"zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    assert cfg.output_dir == "/tmp/somewhere"


def test_all_problems_reported_together_with_suggestions(tmp_path):
    cfg_file = write(tmp_path, "recipe: gpt_clm\ntrain:\n  lrr: 1\n  micro_batch_size: many\nmodle: {}\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(cfg_file, ["data.max_seq_lenn=3", "nokeyvalue"])
    msg = str(err.value)
    assert "unknown key 'train.lrr' (did you mean 'lr'?)" in msg
    assert "train.micro_batch_size: expected int, got 'many'" in msg
    assert "unknown key 'modle' (did you mean 'model'?)" in msg
    assert "did you mean 'max_seq_len'" in msg
    assert "'nokeyvalue' is not key=value" in msg
    assert len(err.value.problems) == 5


def test_unknown_deepspeed_key_and_batch_contradiction(tmp_path):
    ds = write(tmp_path, json.dumps({"zero_optimisation": {"stage": 2}, "train_batch_size": 64}), "ds.json")
    cfg = load_run_config(None, [f"deepspeed={ds}", "train.micro_batch_size=4",
                                 "train.gradient_accumulation_steps=2"])
    _, problems = resolve_ds_config(cfg, world_size=2, on_cpu=True)
    text = "\n".join(problems)
    assert "unknown top-level key 'zero_optimisation'" in text and "did you mean 'zero_optimization'" in text
    # All four numbers named: micro batch, accumulation, world size, and the JSON's value.
    assert "train_batch_size=64" in text and "train.micro_batch_size=4" in text
    assert "train.gradient_accumulation_steps=2" in text and "data-parallel size=2" in text and "= train_batch_size 16" in text


def test_ds_override_inside_section_checked_by_deepspeed(tmp_path):
    cfg = load_run_config(None, ["deepspeed=ds_configs/zero2.json", "ds.zero_optimization.stagee=3"])
    _, problems = resolve_ds_config(cfg, world_size=1, on_cpu=True)
    assert len(problems) == 1 and "stagee" in problems[0] and "rejected by DeepSpeed" in problems[0]


def test_resolved_ds_config_carries_run_config_values():
    cfg = load_run_config(REPO / "finetune/recipes/configs/gpt_clm_wikitext2.yaml",
                          ["train.micro_batch_size=3", "train.gradient_accumulation_steps=5", "train.lr=0.25",
                           "train.max_grad_norm=0.5"])
    ds, problems = resolve_ds_config(cfg, world_size=4, on_cpu=True)
    assert problems == []
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 5, 60)
    assert ds["optimizer"]["params"]["lr"] == 0.25 and ds["gradient_clipping"] == 0.5


def test_known_deepspeed_keys_come_from_deepspeed():
    keys = known_top_level_keys()
    assert {"zero_optimization", "bf16", "fp16", "train_batch_size", "tensorboard", "optimizer"} <= keys
    assert "zero_optimisation" not in keys


def _earlier_run(root: Path, name: str = "20260101-000000") -> Path:
    """A finished run under ``root``: launch record and a complete checkpoint (what the main command leaves)."""
    ck = root / name / "checkpoints" / "step5"
    ck.mkdir(parents=True)
    (ck / "COMPLETE").write_text(json.dumps({"step": 5, "world_size": 2, "zero_stage": 2}))
    (root / name / "launches" / "1").mkdir(parents=True)
    return root / name


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_shipped_run_config_validates(path, tmp_path):
    """Every shipped config validates, also when its root already holds a finished run (the quick start run
    twice): a new launch gets a new folder, ``--resume`` finds the earlier run. The root is the test's own."""
    root = tmp_path / "runs"
    earlier = _earlier_run(root)
    cfg = load_run_config(path, [*STAND_INS.get(path.name, []), f"output_root={root}"])
    assert cfg.output_root and not cfg.output_dir, "shipped configs name a root, so they can run again"
    resolved = validate_run(cfg, None, world_size=2, on_cpu=True)
    data_parallel = 2 // (cfg.parallel.sequence_parallel_size * cfg.parallel.tensor_parallel_size)
    assert resolved.ds["train_batch_size"] == (cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
                                               * data_parallel)
    assert resolved.resume_ckpt is None and not cfg.output_dir  # the new folder is named at launch

    from finetune.lifecycle.run_folder import resolve_output_dir

    resume, _ = resolve_output_dir(cfg, "latest")
    assert cfg.output_dir == str(earlier) and resume == "latest"


def test_reference_target_config_needs_its_real_paths():
    """Without the stand-ins, the bert-large config fails validation on the missing model and data, clearly."""
    cfg = load_run_config(REPO / "finetune/recipes/configs/bert_large_mlm_wikitext2_zero3.yaml")
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, world_size=8, on_cpu=False)
    msg = str(err.value)
    assert "model.path: folder '/data/models/bert-large-uncased' does not exist" in msg
    assert "data.train_files: '/data/datasets/wikitext-2/train-*.parquet' matches no file" in msg


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_ds_config_validates(path):
    """Every ds_configs/*.json passes our checks and DeepSpeed's own parser (fp16 ones as on a GPU)."""
    raw = json.loads(path.read_text())
    # fp16 JSONs state their precision (GPUs without bf16); the others leave it to train.precision (auto)
    assert ("fp16" in path.name) == bool(raw.get("fp16", {}).get("enabled")) and "bf16" not in raw
    cfg = load_run_config(REPO / "tests/configs/tiny_gpt.yaml", [f"deepspeed={path.relative_to(REPO)}", "ds={}"])
    ds, problems = resolve_ds_config(cfg, world_size=2, on_cpu=False)
    assert problems == []
    assert ds["zero_optimization"]["stage"] == int(path.name[4])


def test_print_config_prints_resolved_configs_and_exits(capsys):
    code, printed = refused_here(["--config", "tests/configs/tiny_gpt.yaml", "--print-config", "train.lr=0.125",
                                  "ds.zero_optimization.stage=3"], capsys)  # the launch's main, in this process
    assert code == 0, printed
    assert "lr: 0.125" in printed and "resolved_deepspeed:" in printed and "stage: 3" in printed
    assert "train_batch_size: 4" in printed
