"""QLoRA (``model.quantization``): a bitsandbytes-quantized frozen base with LoRA adapters, on bitsandbytes' CPU
backend.

* In process: the quantized layers' real storage equals what ``finetune plan`` counts for them; the base dequantized
  for the export computes what the quantized layers compute in training mode (4-bit: 1e-5; 8-bit quantizes the
  activations too, so only near), and given the checkpoint's layers it dequantizes their saved weights; the merged
  export of a checkpoint whose base another machine quantized is that base dequantized bit for bit (not
  ``model.path`` quantized again); bad ``model.quantization`` input is one line before any model.
* Extended (two 2-rank launches): a ZeRO-2 run of a pretrained tiny Llama with a 4-bit NF4 base trains, its merged
  export and its adapter folder on the 4-bit base reproduce the engine's logits (1e-5), and a resume from its step-2
  checkpoint gives the same losses at steps 3-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, REPO, launch, ok, train_losses

SFT = CONFIGS / "parity_sft.yaml"


@pytest.fixture(scope="module")
def pretrained_llama(tmp_path_factory) -> Path:
    """A tiny Llama with pretrained-style weights (hidden 128: two 4-bit blocks a row) and the 8k BPE tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("qllama")
    tok = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "gsm8k-bpe-8k")
    cfg = LlamaConfig.from_pretrained(REPO / "data" / "models" / "tiny-llama")
    cfg.update({"vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 256, "head_dim": 32,
                "bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_plan_counts_the_stored_bytes_and_the_dequantized_base_computes_the_same(pretrained_llama, bits):
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.config import QuantizationConfig
    from finetune.engine import quantize

    q = QuantizationConfig(bits=bits)
    config = AutoConfig.from_pretrained(pretrained_llama)
    model = quantize.load_base(AutoModelForCausalLM, str(pretrained_llama), config, q, "fp32")
    with torch.device("meta"):
        n, planned = quantize.planned(AutoModelForCausalLM.from_config(config), q)
    full = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    # the plan: quantized weights at their packed size, the rest (embeddings, norms) in fp32
    assert quantize.model_bytes(model) == pytest.approx(planned + (full - n) * 4, rel=1e-3)
    assert n == 2 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 256)  # the 7 linear layers of each of 2 layers
    model.train()  # the training path (the eval path is switched off in quantize.prepare)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        model.eval()
        evaluated = model(input_ids=ids).logits
        if bits == 4:  # evaluation computes as training does (LLM.int8 treats outliers apart in training only)
            assert torch.equal(evaluated, ref)
        config = AutoConfig.from_pretrained(pretrained_llama)
        dequantized = quantize.dequantized_base(AutoModelForCausalLM, str(pretrained_llama), config, q, "fp32")
        diff = (dequantized(input_ids=ids).logits - ref).abs().max().item()
    assert "quantization_config" not in dequantized.config.to_dict()
    assert diff < (1e-5 if bits == 4 else 0.2 * ref.std().item()), diff
    # given the layers' saved state (the export's checkpoint), their saved quantized weights are what is dequantized
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    weight = saved["model.layers.0.mlp.up_proj.weight"].view(-1)
    weight[0] = weight[0] ^ 0x10 if bits == 4 else weight[0] + 1  # one weight's code changed
    layer = "model.layers.0.mlp.up_proj"
    again = quantize.dequantized_base(AutoModelForCausalLM, str(pretrained_llama), config, q, "fp32",
                                      saved=lambda name: {k[len(name) + 1:]: v for k, v in saved.items()
                                                          if k.startswith(name + ".")})
    changed = {n: int((p != dequantized.get_parameter(n)).sum()) for n, p in again.named_parameters()}
    assert changed == {**dict.fromkeys(changed, 0), f"{layer}.weight": 1}, {n: c for n, c in changed.items() if c}


def _move_a_code_across_its_nearest_boundary(state: dict, key: str, weight: torch.Tensor) -> int:
    """Change the packed NF4 code of the weight of ``weight`` (``[out, in]``, the layer's source weights) nearest to a
    code boundary (a midpoint between two NF4 values, relative to its 64-weight block's absmax) to the code on the
    boundary's other side, in ``state[key]`` (the packed uint8 ``[out * in / 2, 1]``), as a quantizer rounding by
    other arithmetic moves it. Returns the weight's flat index."""
    import bitsandbytes as bnb

    code = bnb.functional.get_4bit_type("nf4", device="cpu")
    mid = (code[:-1] + code[1:]) / 2
    flat = weight.reshape(-1, 64).float()
    scaled = (flat / flat.abs().amax(1, keepdim=True)).reshape(-1)
    gap, which = (scaled[:, None] - mid[None]).abs().min(1)
    i = int(gap.argmin())
    new = int(which[i]) + (0 if scaled[i] > mid[which[i]] else 1)  # the code on the other side of the boundary
    packed = state[key].view(-1)
    byte = int(packed[i // 2])
    packed[i // 2] = (new << 4 | byte & 0xF) if i % 2 == 0 else (byte & 0xF0 | new)
    return i


def test_the_merged_export_dequantizes_the_checkpoints_packed_base(pretrained_llama, tmp_path):
    """In process, a ZeRO-0 checkpoint (``mp_rank_00_model_states.pt``: the engine's module state, the 4-bit base
    packed with its quantization state) whose base another machine quantized: bitsandbytes' CUDA kernel and its CPU
    backend round differently in places (a last partial block divided by its absmax on the CPU, multiplied by the
    reciprocal on CUDA; double quantization's offset a mean summed in each device's order), so a weight at an NF4
    code boundary may get the neighbouring code; here one weight's code is moved across its nearest boundary. The
    merged export's weights are the checkpoint's packed base dequantized, bit for bit, not ``model.path`` quantized
    again on the export's CPU; a checkpoint without the packed base is one line."""
    import bitsandbytes as bnb
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.config import config_to_dict, dump_yaml, load_run_config
    from finetune.engine import lora, quantize
    from finetune.errors import ConfigError
    from finetune.lifecycle.export import export_checkpoint

    run = tmp_path / "run"
    cfg = load_run_config(SFT, [f"output_dir={run}", f"model.path={pretrained_llama}", "model.tokenizer_path=",
                                "model.init=pretrained", "deepspeed=ds_configs/zero0.json", "model.lora.r=4",
                                "model.quantization.bits=4"])
    config = AutoConfig.from_pretrained(pretrained_llama)
    trained = lora.wrap(quantize.load_base(AutoModelForCausalLM, str(pretrained_llama), config,
                                           cfg.model.quantization, "fp32"), cfg.model.lora, AutoModelForCausalLM, 0)
    state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    layer = "model.layers.1.mlp.down_proj"
    key = f"base_model.model.{layer}.base_layer.weight"
    source = AutoModelForCausalLM.from_pretrained(pretrained_llama).get_submodule(layer).weight
    _move_a_code_across_its_nearest_boundary(state, key, source)
    stats = {k[len(key) + 1:]: v for k, v in state.items() if k.startswith(key + ".")}
    assert stats["quant_state.bitsandbytes__nf4"] is not None and "nested_absmax" in stats  # double quantization

    ckpt = run / "checkpoints" / "step1"
    ckpt.mkdir(parents=True)
    torch.save({"module": state}, ckpt / "mp_rank_00_model_states.pt")
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 1}))
    (run / "run_config.yaml").write_text(dump_yaml(config_to_dict(cfg)))
    config.save_pretrained(run / "model_config")
    AutoTokenizer.from_pretrained(pretrained_llama).save_pretrained(run / "model_config")
    out = export_checkpoint(ckpt, tmp_path / "export")

    got = load_file(out / "model.safetensors")
    for name, module in trained.named_modules():  # every quantized layer: the checkpoint's bytes dequantized
        if isinstance(module, bnb.nn.Linear4bit):
            prefix = f"{name}.weight"
            packed = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
            want = bnb.functional.dequantize_4bit(state[prefix], bnb.functional.QuantState.from_dict(packed, "cpu"))
            plain = name.removeprefix("base_model.model.").removesuffix(".base_layer")
            differ = int((got[f"{plain}.weight"] != want.float()).sum())
            assert differ == 0, f"{plain}: {differ} weights differ from the checkpoint's dequantized"

    del state[key]  # a checkpoint saved without its frozen base
    torch.save({"module": state}, ckpt / "mp_rank_00_model_states.pt")
    with pytest.raises(ConfigError, match=f"{layer}: the checkpoint holds no packed weight"):
        export_checkpoint(ckpt, tmp_path / "export2")


@pytest.mark.parametrize(("overrides", "expected"), [
    (["deepspeed=ds_configs/zero3.json"], "model.quantization: ZeRO stage 3 cannot partition a bitsandbytes-quantized "
                                         "base (DeepSpeed issue #7096"),
    (["model.lora=null"], "model.quantization: a quantized base is frozen, so it needs LoRA adapters"),
    (["model.init=scratch"], "model.quantization: quantizes pretrained weights as they load; needs model.init=pretrained"),
    (["model.quantization.bits=3"], "model.quantization.bits: must be 4 or 8, got 3"),
    (["model.quantization.quant_type=int4"], "model.quantization.quant_type"),
])
def test_bad_quantization_is_one_line_before_any_model(pretrained_llama, overrides, expected, tmp_path):
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    base = [f"output_dir={tmp_path / 'run'}", f"model.path={pretrained_llama}", "model.tokenizer_path=",
            "model.init=pretrained", "deepspeed=ds_configs/zero2.json", "model.lora.r=4", "model.quantization.bits=4"]
    with pytest.raises(ConfigError) as err:
        validate_run(load_run_config(SFT, [*base, *overrides]), None, 2, True)
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0], err.value.problems
    assert err.value.problems[0].startswith(expected), err.value.problems[0]


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_qlora_zero2_trains_exports_and_resumes_exactly(pretrained_llama, tmp_path):
    """Two ranks, ZeRO 2, NF4 with double quantization, LoRA r=4 on every linear layer: the engine's logits are
    reproduced by the merged export (dequantized base + merged adapters, plain ``from_pretrained``) and by the adapter
    folder on the 4-bit base (``peft.PeftModel.from_pretrained``), within 1e-5; the resume from step 2 gives steps 3-4
    bit for bit."""
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    args = [f"model.path={pretrained_llama}", "model.tokenizer_path=", "model.init=pretrained",
            "deepspeed=ds_configs/zero2.json", "model.lora.r=4", "model.quantization.bits=4", "train.max_steps=4",
            "train.save_every=2", "export=true"]
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    ok(launch(SFT, [*args, f"output_dir={run}"]))
    log = (run / "logs" / "rank0.log").read_text()
    assert "quantized base: bitsandbytes 4-bit nf4, double quantization True, compute dtype float32" in log
    check = json.loads((run / "export_check.json").read_text())
    assert check["max_abs_logit_diff"] <= 1e-5 and check["max_abs_logit_diff_adapter"] <= 1e-5, check
    inputs = {k: torch.tensor(v) for k, v in check["inputs"].items()}
    base = AutoModelForCausalLM.from_pretrained(pretrained_llama, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32))
    adapted = peft.PeftModel.from_pretrained(base, run / "export" / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(run / "export")
    assert "quantization_config" not in merged.config.to_dict()
    with torch.no_grad():
        got_adapter = adapted.train()(**inputs).logits  # bitsandbytes' training path: its fp32 matmul
        got_merged = merged.eval()(**inputs).logits
    head = check["engine_logits_head"]
    assert got_adapter.reshape(-1)[:8].tolist() == pytest.approx(head, abs=1e-5)
    assert got_merged.reshape(-1)[:8].tolist() == pytest.approx(head, abs=1e-5)

    ok(launch(SFT, [*args, f"output_dir={resumed}"], resume=str(run / "checkpoints" / "step2")))
    first, second = train_losses(run), train_losses(resumed)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4]
    assert [second[s] for s in (3, 4)] == [first[s] for s in (3, 4)], (first, second)


def test_launches_without_quantization_never_import_bitsandbytes(tmp_path):
    """``finetune/run.py`` blocks bitsandbytes (peft would import it, and with it TorchInductor) unless the command
    line or the ``--config`` file mentions ``quantization``; blocked, transformers and peft see it as not installed."""
    import subprocess
    import sys

    qlora = tmp_path / "qlora.yaml"
    qlora.write_text("model:\n  quantization: {bits: 4}\n")
    probe = ("import sys; from finetune.startup import skip_unused; blocked = skip_unused(sys.argv[1:]); "
             "import peft, transformers.utils as u; "
             "print(blocked, u.is_bitsandbytes_available(), 'torch._inductor.compile_fx' in sys.modules)")
    for argv, expected in (([f"--config={SFT}"], "['bitsandbytes'] False False"),
                           (["--config", str(SFT), "model.quantization.bits=4"], "[] True True"),
                           (["--config", str(qlora)], "[] True True")):
        out = subprocess.run([sys.executable, "-c", probe, *argv], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout
        assert out.strip().splitlines()[-1] == expected, (argv, out)
