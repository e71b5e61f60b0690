"""The training meter (``finetune.training.meter.StepMeter``) in process: throughput, padding, the step-time split and MFU.
The real runs of test_train check that these scalars reach TensorBoard and ``metrics.jsonl``."""

from __future__ import annotations

import pytest
import torch

from finetune.training.meter import PEAK_FLOPS, StepMeter, model_flops_per_token, peak_flops


def gpt2(layers: int = 2, hidden: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=2, vocab_size=100, n_positions=32))


def test_flops_per_token_is_6n_plus_attention():
    model = gpt2()
    n = sum(p.numel() for p in model.parameters())
    assert model_flops_per_token(model, 32.0) == 6 * n + 12 * 2 * 64 * 32
    assert model_flops_per_token(model, 10.0, n_params=1000) == 6000 + 12 * 2 * 64 * 10


def test_meter_counts_without_sync_and_reports_the_window():
    meter = StepMeter(gpt2(), torch.device("cpu"), world=2, half_precision=False)
    assert meter.peak is None and peak_flops(torch.device("cpu"), True) is None  # CPUs: no MFU
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    meter.begin(sample=False)
    meter.lap("forward")
    assert meter.split["forward"] == 0.0, "unsampled steps are not timed"
    meter.begin(sample=True)
    meter.count({"input_ids": torch.zeros_like(mask), "attention_mask": mask})
    meter.lap("forward")
    meter.lap("backward")
    assert meter.split["forward"] > 0 and meter.split["backward"] > 0
    assert meter.window.tolist() == [5, 8, 2] and meter.epoch.tolist() == [5, 8]
    meter.count({"input_ids": torch.zeros(3, 4, dtype=torch.long), "num_tokens": torch.tensor(9)})  # packed rows
    meter.count({"input_ids": torch.zeros(1, 4, dtype=torch.long)})  # no mask, no count: every position is real
    assert meter.window.tolist() == [18, 24, 6] and meter.epoch.tolist() == [18, 24]
    meter.window.zero_()
    out = meter.scalars(tokens=10, positions=16, rows=4, seconds=2.0)
    assert out["train/tokens_per_s"] == 5.0 and out["train/tokens_per_s_per_device"] == 2.5
    assert out["train/padding_ratio"] == 0.625 and "train/mfu" not in out
    assert set(out) >= {"time/data_wait_s", "time/forward_s", "time/backward_s", "time/optimizer_s"}
    assert meter.describe_mfu(out) == "n/a"
    meter.peak, meter.n_params = 1e12, 1000  # a GPU of the table: MFU = per-device tokens/s x FLOPs/token / peak
    out = meter.scalars(tokens=10, positions=16, rows=4, seconds=2.0)
    assert out["train/mfu"] == pytest.approx(2.5 * (6000 + 12 * 2 * 64 * 4) / 1e12)
    assert meter.describe_mfu({"train/mfu": 0.4512}) == "45.1%"
    assert all(bf16 > tf32 > 0 for bf16, tf32 in PEAK_FLOPS.values())
