"""LoRA (``model.lora``, peft) and gradient checkpointing (``model.gradient_checkpointing``) on real runs.

Real 2-rank DeepSpeed launches on CPU, fp32, dropout off (the parity configs, 4 steps, LoRA r=4 on all linear
layers):

* GPT-2 at ZeRO 0 on one rank (one device, micro batch 8) and at ZeRO 3 with sequence parallelism 2 on two ranks
  (each holds half of every sequence; the same 8 rows per step): the same per-step losses (1e-5 relative), only the
  adapters in the optimizer and trained (the base weights in the checkpoint are the pretrained ones), the
  trainable-parameter count in the log, the merged export and the adapter folder (loaded by plain
  ``from_pretrained`` and by ``peft.PeftModel.from_pretrained`` on the pretrained base) reproduce the engine.
* The GPT runs end with the sample of ``train.sample_prompt`` (at ZeRO 3 too, generated on rank 0 alone).
* BERT (MLM) at ZeRO 3, checkpoint at step 2, then resumed from it with gradient checkpointing switched on:
  steps 3-4 equal the uninterrupted run's (1e-6 relative; measured: bit-identical), which is both the resume
  exactness and the gradient-checkpointing loss equality (under ZeRO-3 with LoRA, the case that needs
  ``enable_input_require_grads``). A resume that changes the LoRA rank or drops LoRA is refused in one line
  by ``--check``, even with ``--resume-allow-changes``.
* seq_cls (BERT) at ZeRO 3, one rank: the classifier head trains with the adapters and is saved in the adapter folder.
* Bad ``model.lora`` input: one line each from :func:`finetune.preflight.validate.validate_run`, in process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, REPO, launch, ok, run_python, train_losses

GPT, BERT = CONFIGS / "parity_gpt.yaml", CONFIGS / "parity_bert.yaml"
LORA = ["model.lora.r=4", "train.max_steps=4", "export=true"]


def _log(run: Path) -> str:
    return (run / "logs" / "rank0.log").read_text()


def _export_check(run: Path) -> dict:
    check = json.loads((run / "export_check.json").read_text())
    assert check["finite"] and check["max_abs_logit_diff"] <= 1e-5, check["max_abs_logit_diff"]
    assert check["max_abs_logit_diff_adapter"] <= 1e-5, check["max_abs_logit_diff_adapter"]
    return check


@pytest.mark.slow
def test_lora_gpt_one_device_equals_zero3_sequence_parallel_and_exports(tmp_path):
    """SP + LoRA against one device: the adapters' gradients come through Ulysses' all-to-all and ZeRO-3's corrected
    reduce-scatter average."""
    import peft
    import transformers

    runs = {}
    for stage, over, nproc in ((0, [], 1), (3, ["parallel.sequence_parallel_size=2"], 2)):
        runs[stage] = tmp_path / f"z{stage}"
        ok(launch(GPT, [f"ds.zero_optimization.stage={stage}", "train.micro_batch_size=8", *over, *LORA,
                        f"output_dir={runs[stage]}", "train.sample_prompt=The game"], nproc=nproc))
        # the end-of-run sample comes from the export on rank 0 alone, also at ZeRO-3 (the other ranks have left)
        assert (runs[stage] / "sample.txt").read_text().startswith("The game")
    l0, l3 = train_losses(runs[0]), train_losses(runs[3])
    assert sorted(l0) == sorted(l3) == [1, 2, 3, 4]
    for step in l0:
        assert l3[step] == pytest.approx(l0[step], rel=1e-5), f"step {step}: SP 2 {l3[step]!r} vs one device {l0[step]!r}"
    assert len(set(l0.values())) == 4, f"losses do not move: {l0}"

    # 2 blocks x (c_attn 2->6, attn c_proj 2->2, c_fc 2->8, mlp c_proj 8->2) x r=4 x (in + out) = 256
    for run in runs.values():
        assert "on 8 modules (c_attn, c_fc, c_proj): trainable parameters 256 of 102,970 (0.249%)" in _log(run)

    # ZeRO 0 checkpoint: the optimizer holds the 16 adapter matrices only, the base weights are the pretrained ones
    states = torch.load(runs[0] / "checkpoints" / "step4" / "mp_rank_00_model_states.pt", weights_only=False)
    adam = states["optimizer"]["state"]
    assert len(adam) == 16 and sum(s["exp_avg"].numel() for s in adam.values()) == 256
    from safetensors.torch import load_file

    base = load_file(REPO / "data" / "models" / "tiny-gpt2" / "model.safetensors")
    module = states["module"]
    for name, tensor in base.items():
        key = f"base_model.model.{name}"
        if key not in module:  # an adapted layer keeps its original weights as base_layer
            key = key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(module[key], tensor), f"frozen base weight '{name}' changed"

    for run in runs.values():
        check = _export_check(run)
        inputs = {k: torch.tensor(v) for k, v in check["inputs"].items()}
        merged = transformers.AutoModelForCausalLM.from_pretrained(run / "export", local_files_only=True).eval()
        merged_weights = load_file(run / "export" / "model.safetensors")
        assert not torch.equal(merged_weights["transformer.h.0.attn.c_attn.weight"],
                               base["transformer.h.0.attn.c_attn.weight"]), "the adapters were not merged"
        pretrained = transformers.AutoModelForCausalLM.from_pretrained(REPO / "data" / "models" / "tiny-gpt2",
                                                                      local_files_only=True)
        adapted = peft.PeftModel.from_pretrained(pretrained, run / "export" / "adapter").eval()
        with torch.no_grad():
            got_merged, got_adapter = merged(**inputs).logits, adapted(**inputs).logits
        assert got_merged.reshape(-1)[:8].tolist() == pytest.approx(check["engine_logits_head"], abs=1e-5)
        assert torch.allclose(got_adapter, got_merged, atol=1e-5)


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_dora_rslora_loraplus_zero0_equals_zero3_and_exports(tmp_path):
    """Issue 54's PEFT variants together: DoRA, rsLoRA, LoRA+ (ratio 4) and ``modules_to_save`` (the final layer
    norm) on GPT-2, 2 ranks at ZeRO 0 and at ZeRO 3 with every parameter partitioned (threshold 0: DoRA's weight
    norm reads the base layer's gathered weight): the same losses (1e-5 relative), and each export, merged and the
    adapter folder on the pretrained base, reproduces its engine's logits."""
    import peft
    import transformers

    variants = ["model.lora.use_dora=true", "model.lora.use_rslora=true", "model.lora.loraplus_lr_ratio=4",
                "model.lora.modules_to_save=[ln_f]", "ds.zero_optimization.stage3_param_persistence_threshold=0"]
    runs = {}
    for stage in (0, 3):
        runs[stage] = tmp_path / f"z{stage}"
        ok(launch(GPT, [f"ds.zero_optimization.stage={stage}", *LORA, *variants, f"output_dir={runs[stage]}"]))
        assert "LoRA (DoRA, rsLoRA, LoRA+ ratio 4, modules_to_save ['ln_f']) r=4" in _log(runs[stage])
    l0, l3 = train_losses(runs[0]), train_losses(runs[3])
    assert sorted(l0) == sorted(l3) == [1, 2, 3, 4] and len(set(l0.values())) == 4, l0
    for step in l0:
        assert l3[step] == pytest.approx(l0[step], rel=1e-5), f"step {step}: ZeRO-3 {l3[step]!r} vs ZeRO-0 {l0[step]!r}"
    for run in runs.values():
        check = _export_check(run)
        inputs = {k: torch.tensor(v) for k, v in check["inputs"].items()}
        adapter = json.loads((run / "export" / "adapter" / "adapter_config.json").read_text())
        assert adapter["use_dora"] and adapter["use_rslora"] and adapter["modules_to_save"] == ["ln_f"], adapter
        pretrained = transformers.AutoModelForCausalLM.from_pretrained(REPO / "data" / "models" / "tiny-gpt2",
                                                                      local_files_only=True)
        adapted = peft.PeftModel.from_pretrained(pretrained, run / "export" / "adapter").eval()
        merged = transformers.AutoModelForCausalLM.from_pretrained(run / "export", local_files_only=True).eval()
        with torch.no_grad():
            got_adapter, got_merged = adapted(**inputs).logits, merged(**inputs).logits
        assert got_adapter.reshape(-1)[:8].tolist() == pytest.approx(check["engine_logits_head"], abs=1e-5)
        assert torch.allclose(got_adapter, got_merged, atol=1e-5)


def test_peft_variants_reach_peft_and_loraplus_groups():
    """rsLoRA scales by alpha / sqrt(r), DoRA adds magnitude vectors, LoRA+ puts B matrices and 1-D adapter
    parameters at lr x ratio and the A matrices at lr (peft's create_loraplus_optimizer grouping)."""
    import transformers

    from finetune.config import LoraConfig
    from finetune.engine import lora
    from finetune.engine.model import param_groups

    model = transformers.AutoModelForCausalLM.from_pretrained(REPO / "data" / "models" / "tiny-gpt2",
                                                              local_files_only=True)
    config = LoraConfig(r=4, alpha=8, use_dora=True, use_rslora=True, loraplus_lr_ratio=16)
    wrapped = lora.wrap(model, config, transformers.AutoModelForCausalLM, 0)
    layer = wrapped.base_model.model.transformer.h[0].attn.c_attn
    assert layer.scaling["default"] == 8 / 4 ** 0.5 and "default" in layer.lora_magnitude_vector
    groups = lora.loraplus_groups(wrapped, param_groups(wrapped, 0.01), 1e-3, 16)
    names = {id(p): n for n, p in wrapped.named_parameters()}
    rates = {names[id(p)].split(".")[-3]: g["lr"] for g in groups for p in g["params"]}  # <layer>.<kind>.default.weight
    assert rates == {"lora_A": 1e-3, "lora_B": 1.6e-2, "lora_magnitude_vector": 1.6e-2}, rates
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in wrapped.parameters())


@pytest.mark.slow
@pytest.mark.extended  # suite budget: LoRA at ZeRO-3 stays in (test_lora_gpt_zero0_equals_zero3_and_exports)
def test_lora_bert_zero3_resume_with_gradient_checkpointing(tmp_path):
    import transformers

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    stage3 = ["ds.zero_optimization.stage=3", *LORA, "train.save_every=2"]
    ok(launch(BERT, [*stage3, f"output_dir={full}"]))
    proc = ok(launch(BERT, [*stage3, "model.gradient_checkpointing=true", f"output_dir={resumed}"],
                     resume=str(full / "checkpoints" / "step2")))
    assert "resumed from" in proc.stdout
    assert "gradient checkpointing on (non-reentrant)" in _log(resumed)
    # Another LoRA rank, or no LoRA, can never load this checkpoint: one line before any model, flag or not.
    for change in (["model.lora.r=8"], ["model.lora=null"]):
        proc = run_python(["finetune/run.py", "--config", str(BERT), *stage3, *change, f"output_dir={resumed}",
                           "--resume", "--resume-allow-changes", "--check"])
        errors = [line for line in proc.stdout.splitlines() if line.startswith("finetune: error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-3000:]
        assert "the LoRA adapters or the quantized base changed (model.lora.r 4 -> " in errors[0] and "can then never be loaded" in errors[0]
    assert "gradient checkpointing" not in _log(full)
    want, got = train_losses(full), train_losses(resumed)
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6), f"step {step}: resumed {got[step]!r} vs {want[step]!r}"

    # 2 layers x (q, k, v, attention out 64->64; intermediate 64->128, output 128->64) + MLM transform 64->64
    # x r=4 x (in + out) = 7,680; the tied decoder (output embedding) is not adapted
    for run in (full, resumed):
        assert "trainable parameters 7,680 of 2,095,866" in _log(run)
        check = _export_check(run)
        merged = transformers.AutoModelForMaskedLM.from_pretrained(run / "export", local_files_only=True).eval()
        with torch.no_grad():
            logits = merged(**{k: torch.tensor(v) for k, v in check["inputs"].items()}).logits
        assert logits.reshape(-1)[:8].tolist() == pytest.approx(check["engine_logits_head"], abs=1e-5)
        assert (run / "export" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_lora_seq_cls_zero3_trains_the_classifier_head(tmp_path):
    """seq_cls: peft's SEQ_CLS task type keeps the classifier head trainable (a copy, saved with the adapter)."""
    import transformers
    from safetensors.torch import load_file

    run = tmp_path / "cls"
    ok(launch(CONFIGS / "parity_cls.yaml", ["ds.zero_optimization.stage=3", "train.micro_batch_size=8", *LORA,
                                             f"output_dir={run}"], nproc=1))  # 2 ranks add nothing here
    # 13 adapted 64 -> 64/128 layers as in bert_mlm (the pooler in place of the MLM transform): 7,680, plus the
    # classifier head copy (64 x 2 + 2)
    assert "trainable parameters 7,810 of 2,065,476" in _log(run)
    assert len(set(train_losses(run).values())) == 4
    check = _export_check(run)
    adapter = load_file(run / "export" / "adapter" / "adapter_model.safetensors")
    head = {k: v for k, v in adapter.items() if "classifier" in k}
    assert sorted(v.numel() for v in head.values()) == [2, 128], sorted(adapter)
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(run / "export", local_files_only=True)
    assert merged.config.id2label == {0: "negative", 1: "positive"}
    assert torch.equal(merged.classifier.weight, next(v for k, v in head.items() if k.endswith("weight")))
    with torch.no_grad():
        logits = merged.eval()(**{k: torch.tensor(v) for k, v in check["inputs"].items()}).logits
    assert logits.reshape(-1)[:8].tolist() == pytest.approx(check["engine_logits_head"], abs=1e-5)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["model.lora.r=0"], "model.lora.r: must be > 0, got 0"),
    (["model.lora.target_modules=q_proj,v_proj"],
     "model.lora.target_modules: ['q_proj', 'v_proj'] match no module of GPT2LMHeadModel"),
    (["model.lora.target_modules=ln_1"], "model.lora: peft cannot add LoRA adapters to GPT2LMHeadModel"),
])
def test_bad_lora_input_is_one_line_before_any_model(overrides, expected, tmp_path):
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    cfg = load_run_config(CONFIGS / "tiny_gpt.yaml", [f"output_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, 2, True)
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0], err.value.problems
    assert err.value.problems[0].startswith(expected), err.value.problems[0]
    if "match no module" in expected:
        assert "c_attn (Conv1D)" in err.value.problems[0]  # names the model's modules


def test_lora_config_keys():
    """``model.lora`` is off by default, switched on by one key (defaults for the rest), off again with null."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError

    assert load_run_config(GPT).model.lora is None
    lora = load_run_config(GPT, ["model.lora.alpha=8"]).model.lora
    assert (lora.r, lora.alpha, lora.target_modules) == (8, 8.0, ["all-linear"])
    assert load_run_config(GPT, ["model.lora.r=4", "model.lora=null"]).model.lora is None
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_run_config(GPT, ["model.lora.rank=4"])


def test_dora_at_zero3_generates_before_any_engine_forward(tmp_path, monkeypatch):
    """Issue 68 item 4: DoRA at ZeRO-3 (every parameter partitioned) on a real 1-rank engine: generation through the
    model itself before any engine forward (``grpo``, on-policy ``distill`` with ``gather_for_generation: false``)
    raised ``IndexError`` in peft's ``dora.py``, which reads ``lora_A.weight`` and the base layer's weight and bias
    outside their modules' forwards; DeepSpeed finds such parameters only inside an engine forward. They are
    registered with the DoRA modules beforehand: generation runs, and the model's logits equal the engine's."""
    from finetune import patches
    from finetune.config import load_run_config
    from finetune.engine.model import build_engine, load_model_config
    from finetune.parallel import distributed as dist_utils
    from finetune.preflight.validate import validate_run
    from finetune.recipes import recipe_for

    from conftest import free_port

    cfg = load_run_config(GPT, ["model.lora.r=4", "model.lora.use_dora=true", "ds.zero_optimization.stage=3",
                                "ds.zero_optimization.stage3_param_persistence_threshold=0",
                                f"output_dir={tmp_path / 'run'}"])
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO)
    ds = validate_run(cfg, None, 1, True).ds
    dist_utils.init(5.0)
    try:
        recipe = recipe_for(cfg)
        engine = build_engine(cfg, recipe, load_model_config(cfg, recipe), ds, total_steps=4).engine
        engine.eval()
        ids = torch.tensor([[464, 983, 286, 262, 1578]])
        with torch.no_grad():
            out = engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                         do_sample=False, pad_token_id=0)
            assert out.shape == (1, 8)
            logits = engine.module(input_ids=ids).logits
            assert torch.equal(engine(input_ids=ids).logits, logits)
    finally:
        dist_utils.shutdown()
        patches.restore_all()
