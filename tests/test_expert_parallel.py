"""Expert parallelism (DeepSpeed AutoEP, ``parallel.expert_parallel_size``) trains what one device trains.

A tiny Qwen3-MoE built in the test from ``Qwen3MoeConfig`` (2 layers, hidden 64, 4 experts of 32, top-2, the GPT-2
tokenizer's vocabulary; 3.3M parameters, ``model.init: scratch``) on 2 CPU ranks with EP=2 (each rank holds 2 experts
per layer, tokens travel by gloo's all-to-all, the experts run ``torch._grouped_mm``), ZeRO-2, against
:mod:`parity_reference` (a plain single-process loop with transformers' own MoE blocks over the same global batches):
per-step losses 1e-5 and grad norms 1e-4; the export (experts gathered back into ``gate_up_proj``/``down_proj``)
loads with ``from_pretrained`` and its weights equal the reference's; the step-3 checkpoint resumes at the same layout
exactly. Measured when written (DeepSpeed 0.19.8, torch 2.13 CPU): losses 4.8e-8, grad norms 1.5e-6, exported weights
1.7e-5 (absolute), export check 0.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, check_here, cpu_env, finetune_here, launch, ok, read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from parity_reference import reference_run  # noqa: E402

GPT = CONFIGS / "parity_gpt.yaml"
RANKS = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """A folder with the tiny Qwen3-MoE's ``config.json``."""
    from transformers import Qwen3MoeConfig

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    Qwen3MoeConfig(vocab_size=50257, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                   num_experts_per_tok=2, max_position_embeddings=512, bos_token_id=50256, eos_token_id=50256,
                   pad_token_id=50256, tie_word_embeddings=True,
                   router_aux_loss_coef=0.0).save_pretrained(folder)  # the reference has no router loss (test_moe's)
    return folder


def _over(model: Path) -> list[str]:
    return [f"model.path={model}", "model.tokenizer_path=data/models/tiny-gpt2", "model.init=scratch",
            "model.config_overrides={}", "parallel.expert_parallel_size=2", "train.max_steps=6", "train.save_every=3",
            "export=true"]


def _per_step(run: Path, key: str, launch_no: int | None = None) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run) if key in r and (launch_no is None or r["launch"] == launch_no)}


def _max_rel(got: dict[int, float], want: list[float], steps) -> float:
    return max(abs(got[s] - want[s - 1]) / abs(want[s - 1]) for s in steps)


@pytest.mark.slow
def test_ep2_equals_one_device_exports_and_resumes(tmp_path, moe_model, capsys):
    """EP=2 on 2 ranks: losses and grad norms equal the one-device reference, the export (experts gathered) equals its
    weights and passes the logit check, ``finetune export`` of the split checkpoint says how to export it, and the
    step-3 checkpoint resumes at EP=2 with steps 4-6 equal to the reference."""
    from finetune.config import load_run_config

    run, over = tmp_path / "ep", _over(moe_model)
    proc = ok(launch(GPT, [f"output_dir={run}", *over]))
    assert "(experts over 2-rank groups)" in proc.stdout and "expert-parallel rank 0" in proc.stdout
    assert "= micro batch 4 x accumulation 1 x data-parallel size 2" in proc.stdout
    assert "export check: max |logits(export) - logits(engine)|" in proc.stdout
    assert (run / "checkpoints" / "step3" / "layer_0_expert_3_mp_rank_00_model_states.pt").is_file()
    cfg = load_run_config(GPT, [*over[:4], "train.max_steps=6", f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"])
    ref = reference_run(cfg, 2, 6)
    losses, norms = _per_step(run, "train/loss"), _per_step(run, "train/grad_norm")
    assert sorted(losses) == list(range(1, 7))
    assert _max_rel(losses, ref.losses, range(1, 7)) <= 1e-5, (losses, ref.losses)
    assert _max_rel(norms, ref.grad_norms, range(1, 7)) <= 1e-4, (norms, ref.grad_norms)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # transformers writes the Hub layout (one gate/up/down_proj per expert) and loads it back into its fused experts
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in load_file(run / "export" / "model.safetensors")
    exported = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).state_dict()
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in ref.state_dict.items()}
    for name, tensor in exported.items():
        assert torch.allclose(tensor.float(), ref.state_dict[name], rtol=1e-4, atol=1e-4), name

    code, refused = finetune_here(["export", run / "checkpoints" / "step3", tmp_path / "out"], capsys)
    assert code == 2 and "is an expert-parallel (AutoEP) checkpoint" in refused, refused[-2000:]

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step6")
    ok(launch(GPT, [f"output_dir={resumed}", *over, "export=false"], resume="latest"))
    again = _per_step(resumed, "train/loss", launch_no=2)
    assert sorted(again) == [4, 5, 6]
    assert _max_rel(again, ref.losses, range(4, 7)) <= 1e-5, (again, ref.losses)


def test_expert_parallel_checks_before_any_model(tmp_path, capsys, moe_model):
    """No AutoEP preset (GPT-2), experts and world size not divisible, LoRA, Muon, EP with SP and TP, a recipe without
    expert parallelism, a preset finetune has not checked (Mixtral): one line each, exit 2, before any model."""
    code, out = check_here(["--config", GPT, f"output_dir={tmp_path / 'g'}", "parallel.expert_parallel_size=2"],
                           capsys, WORLD_SIZE="2", **RANKS)
    assert code == 2 and "model type 'gpt2' has no DeepSpeed AutoEP preset" in out, out[-3000:]
    over = _over(moe_model)[:4]
    code, out = check_here(["--config", GPT, f"output_dir={tmp_path / 'm'}", *over, "parallel.expert_parallel_size=3",
                            "model.lora.r=4", "train.optimizer=muon", "parallel.sequence_parallel_size=2"],
                           capsys, WORLD_SIZE="4", **RANKS)
    errs = "\n".join(line for line in out.splitlines() if line.startswith("finetune: error:"))
    assert code == 2, out[-3000:]
    for needle in ("parallel.expert_parallel_size: 3 does not divide the world size 4",
                   "the model's 4 experts are not divisible by 3",
                   "LoRA does not combine with AutoEP", "train.optimizer=muon would orthogonalise",
                   "expert and sequence parallelism are not combined"):
        assert sum(needle in e for e in errs.splitlines()) == 1, (needle, errs)
    mixtral = tmp_path / "mixtral"
    mixtral.mkdir()
    (mixtral / "config.json").write_text((moe_model / "config.json").read_text().replace(
        '"model_type": "qwen3_moe"', '"model_type": "mixtral"').replace('"num_experts"', '"num_local_experts"'))
    code, out = check_here(["--config", CONFIGS / "parity_sft.yaml", f"output_dir={tmp_path / 's'}", *over[1:],
                            f"model.path={mixtral}", "parallel.tensor_parallel_size=2",
                            "parallel.expert_parallel_size=2"], capsys, WORLD_SIZE="4",
                           **RANKS)
    assert code == 2, out[-3000:]
    for needle in ("recipe sft is not tested with expert parallelism (gpt_clm is)",
                   "model type 'mixtral' has an AutoEP preset ('mixtral') but finetune checked",
                   "expert and tensor parallelism are not combined"):
        assert needle in out, (needle, out[-3000:])


def test_resume_at_another_expert_parallel_size_is_refused(tmp_path):
    """A checkpoint saved at EP=2 is refused at EP=1 (and the other way), with the reason, before any model."""
    import json

    from finetune.lifecycle.checkpoint import resume_layout

    ckpt = tmp_path / "step3"
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 3, "world_size": 2, "zero_stage": 2,
                                               "expert_parallel_size": 2}))
    ds2 = {"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert resume_layout(ckpt, 2, ds2) == ([], [], False)
    problems, _, universal = resume_layout(ckpt, 2, {"zero_optimization": {"stage": 2}})
    assert not universal and len(problems) == 1
    assert "expert-parallel size 2, this launch has 2, 2 and 1" in problems[0]
    assert "parallel.expert_parallel_size=2" in problems[0]
    problems, _, _ = resume_layout(ckpt, 4, ds2)
    assert len(problems) == 1 and "this launch has 4, 2 and 2" in problems[0]
