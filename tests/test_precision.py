"""``train.precision``: what ``auto`` picks on each accelerator, and contradictions with the DeepSpeed JSON.

There is no GPU here: the GPU rule is tested through DeepSpeed's own ``CUDA_Accelerator`` capability queries
(``is_bf16_supported``/``is_fp16_supported``) with torch's CUDA device queries replaced by a given compute
capability (V100 = 7.0, T4 = 7.5, A100 = 8.0, H100 = 9.0; torch reports bf16 from 8.0 on).
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, refused_here
from finetune.config import load_run_config
from finetune.errors import ConfigError
from finetune.engine.ds_config import auto_precision, choose_precision, precision_of, resolve_ds_config

TINY = REPO / "tests/configs/tiny_gpt.yaml"


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(major, minor)`` -> DeepSpeed's CUDA accelerator answering as a GPU of that compute capability."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    def make(major: int, minor: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (major, minor))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: major >= 8)
        return CUDA_Accelerator()

    return make


@pytest.mark.parametrize(("capability", "want"), [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"),
                                                  ((7, 0), "fp16"), ((6, 0), "fp32")],
                         ids=["H100", "A100", "T4", "V100", "P100"])
def test_auto_on_gpus_follows_the_capability_query(gpu, capability, want):
    accel = gpu(*capability)
    precision, why = auto_precision(accel)
    assert precision == want and why.startswith("auto: cuda")
    cfg = load_run_config(TINY, ["ds={}"])
    ds, problems = resolve_ds_config(cfg, world_size=2, on_cpu=False, accelerator=accel)
    if want == "fp32":
        assert problems == [] and precision_of(ds) == "fp32"
        return
    assert problems == [] and ds[want]["enabled"] is True and precision_of(ds) == want


def test_auto_is_fp32_on_the_cpu_accelerator():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accel = CPU_Accelerator()
    assert accel.is_bf16_supported(), "DeepSpeed's CPU accelerator reports bf16; auto still picks fp32"
    assert auto_precision(accel)[0] == "fp32"
    cfg = load_run_config(TINY, ["ds={}"])
    ds, problems = resolve_ds_config(cfg, world_size=2, on_cpu=True)
    assert problems == [] and ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}


def test_auto_takes_the_json_choice_and_explicit_precision_is_written(gpu):
    fp16_json = ["deepspeed=ds_configs/zero2_fp16.json", "ds={}"]
    ds, problems = resolve_ds_config(load_run_config(TINY, fp16_json), 2, on_cpu=False, accelerator=gpu(9, 0))
    assert problems == [] and ds["fp16"]["enabled"] is True and ds["fp16"]["initial_scale_power"] == 16
    assert ds["bf16"]["enabled"] is False
    precision, why, _ = choose_precision("auto", {"fp16": {"enabled": True}}, "x.json", on_cpu=False)
    assert (precision, why) == ("fp16", "auto: x.json sets it explicitly")
    ds, problems = resolve_ds_config(load_run_config(TINY, ["ds={}", "train.precision=bf16"]), 2, on_cpu=True)
    assert problems == [] and ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False


@pytest.mark.parametrize(("overrides", "needle"), [
    (["train.precision=fp32", "ds.bf16.enabled=true"], "gives bf16 (bf16/fp16 'enabled') but train.precision=fp32"),
    (["train.precision=bf16", "deepspeed=ds_configs/zero3_fp16.json"], "gives fp16 (bf16/fp16 'enabled') but "
                                                                       "train.precision=bf16"),
    (["train.precision=fp16", "ds.bf16.enabled=false"], "gives fp32 (bf16/fp16 'enabled') but train.precision=fp16"),
])
def test_contradictions_are_errors(gpu, overrides, needle):
    cfg = load_run_config(TINY, ["ds={}", *overrides])
    _, problems = resolve_ds_config(cfg, world_size=2, on_cpu=False, accelerator=gpu(9, 0))
    assert len(problems) == 1 and needle in problems[0], problems


def test_unknown_precision_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="train.precision: 'fp8' unknown \\(choose one of: auto, fp32, bf16, fp16\\)"):
        load_run_config(TINY, ["train.precision=fp8"])


def test_contradiction_is_one_cli_error_line(tmp_path, capsys):
    code, printed = refused_here(["--config", TINY, f"output_dir={tmp_path / 'run'}", "train.precision=fp32",
                                  "ds.bf16.enabled=true"], capsys)  # the launch's main, in this process
    errs = [line for line in printed.splitlines() if line.startswith("finetune: error:")]
    assert code == 2 and len(errs) == 1, printed[-3000:]
    assert "precision contradiction" in errs[0] and "train.precision=fp32" in errs[0]
