"""``finetune.engine.kernels``: Python-written activations replaced by fused kernels of the same function.

In-process tests on the shipped tiny configs (random init, fp32, CPU, seconds). The real launches that train
with the fused modules are the rest of the suite (every GPT-2 run; ``test_resume_changes`` checks the log line).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
from transformers import activations as act

from finetune import patches
from finetune.engine.kernels import DropoutAttention, attention_dropout, fuse, light_dropout_sdpa, \
    lighten_attention_dropout

MODELS = Path(__file__).resolve().parent.parent / "data" / "models"


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for the backward pass while ``fn()`` runs (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def gpt2(**overrides):
    config = AutoConfig.from_pretrained(MODELS / "gpt2-bytes", local_files_only=True)
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_gpt2_gelu_new_same_losses_and_gradients_less_saved_memory():
    """GPT-2's ``gelu_new`` -> ``F.gelu(tanh)``: loss and every gradient agree to fp32 rounding (1e-6), and
    autograd keeps at least 3 fewer ``[tokens, d_ff]`` fp32 tensors per layer."""
    plain = gpt2()
    fused = copy.deepcopy(plain)
    assert fuse(fused) == "NewGELUActivation x2 -> F.gelu(approximate='tanh')"
    assert fuse(fused) == "nothing to replace", "a second call finds nothing left"
    assert all(type(block.mlp.act) is act.GELUTanh for block in fused.transformer.h)
    assert all(type(block.mlp.act) is act.NewGELUActivation for block in plain.transformer.h), "a copy, untouched"

    ids = torch.randint(0, 259, (4, 64), generator=torch.Generator().manual_seed(1))
    losses, kept = {}, {}
    for name, model in (("plain", plain), ("fused", fused)):
        model.train()

        def step(model=model, name=name):
            losses[name] = model(input_ids=ids, labels=ids).loss
        kept[name] = saved_bytes(step)
        losses[name].backward()
    assert abs(losses["plain"].item() - losses["fused"].item()) <= 1e-6 * abs(losses["plain"].item())
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    tensor = 4 * 64 * plain.config.n_inner * 4  # one [tokens, d_ff] fp32 tensor
    assert kept["plain"] - kept["fused"] >= 3 * tensor * plain.config.n_layer, kept


def test_only_python_written_activations_are_replaced():
    """Each Python-written tanh GELU becomes ``F.gelu(approximate="tanh")`` with equal values; fused and other
    activations, the Python erf GELU (torch's CPU ``F.gelu`` is less accurate than it near x = -3.5), subclasses
    (which may do something else) and models without such modules are left alone."""

    class MyGELU(act.NewGELUActivation):
        pass

    modules = [act.NewGELUActivation(), act.FastGELUActivation(), act.AccurateGELUActivation(),
               act.GELUTanh(use_gelu_tanh_python=True), act.GELUTanh(), act.GELUActivation(),
               act.GELUActivation(use_gelu_python=True), act.QuickGELUActivation(), MyGELU(), torch.nn.SiLU()]
    seq = torch.nn.Sequential(*modules).eval()
    x = torch.linspace(-12, 12, 100_001)
    want = [m(x) for m in modules]
    assert fuse(seq) == ("NewGELUActivation x1 -> F.gelu(approximate='tanh'), FastGELUActivation x1 -> "
                         "F.gelu(approximate='tanh'), AccurateGELUActivation x1 -> F.gelu(approximate='tanh'), "
                         "GELUTanh (Python) x1 -> F.gelu(approximate='tanh')")
    assert [type(m) for m in seq] == [act.GELUTanh] * 5 + [act.GELUActivation] * 2 + [
        act.QuickGELUActivation, MyGELU, torch.nn.SiLU]
    assert all(seq[i] is modules[i] for i in range(4, 10)), "the others stay the same objects"
    assert not any(m.training for m in seq), "the replacement keeps the train/eval mode"
    for i, (m, w, original) in enumerate(zip(seq, want, modules)):
        assert torch.allclose(m(x), w, rtol=1e-5, atol=2e-6), i  # within a few fp32 rounding steps
        if i < 4:  # replaced: within 2.5 fp32 ulps of the module's own formula in float64
            exact = original(x.double())
            assert ((m(x).double() - exact).abs() / exact.abs().clamp(min=1)).max() <= 3e-7, i

    bert = AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(MODELS / "bert-small", local_files_only=True))
    assert fuse(bert) == "nothing to replace", "BERT's gelu is F.gelu already"


@pytest.mark.parametrize("mask", ["none", "bool", "additive", "causal"])
def test_dropout_attention_is_sdpa_bit_for_bit(mask):
    """``DropoutAttention`` = ``F.scaled_dot_product_attention`` with dropout on CPU (its math path): the same output
    and gradients bit for bit, the same positions dropped for the same seed, the same draws taken from the
    generator (the next random number agrees)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 16, generator=g).requires_grad_() for _ in range(3))
    masks = {"none": None, "bool": torch.rand(3, 1, 37, 37, generator=g) > 0.3,
             "additive": torch.randn(3, 1, 37, 37, generator=g), "causal": torch.ones(37, 37, dtype=torch.bool).tril()}
    m = masks[mask]
    grad = torch.randn(3, 4, 37, 16, generator=g)
    torch.manual_seed(7)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.1, scale=0.3)
    want_grads, want_next = torch.autograd.grad(want, (q, k, v), grad), torch.rand(1)
    torch.manual_seed(7)
    got = DropoutAttention.apply(q, k, v, m, 0.1, 0.3)
    got_grads, got_next = torch.autograd.grad(got, (q, k, v), grad), torch.rand(1)
    assert torch.equal(got, want) and torch.equal(got_next, want_next)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def test_bert_trains_the_same_with_less_attention_memory():
    """A BERT (``bert-small``, attention dropout 0.1) with ``sdpa`` routed through ``light_dropout_sdpa``: the same
    loss and gradients bit for bit over two training steps, and autograd keeps 7 fewer bytes per attention score
    (5 instead of 12: the softmax output and a bool mask instead of three float32 tensors). Evaluation, calls
    without gradients and grouped key/value heads go to transformers' own function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = AutoConfig.from_pretrained(MODELS / "bert-small", local_files_only=True)
    assert attention_dropout(config) == 0.1 and config._attn_implementation in (None, "sdpa")
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
    ids = torch.randint(5, config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:2, 40:] = 0  # padded rows: a bool padding mask reaches the attention

    def steps():
        torch.manual_seed(3)
        model.zero_grad()
        losses, kept = [], []
        for _ in range(2):
            box = {}
            kept.append(saved_bytes(lambda: box.update(loss=model(input_ids=ids, attention_mask=mask,
                                                                     labels=ids).loss)))
            box["loss"].backward()
            losses.append(box["loss"].item())
        return losses, [p.grad.clone() for p in model.parameters()], kept

    plain = steps()
    try:
        assert lighten_attention_dropout().startswith("sdpa attention with dropout on CPU")
        assert lighten_attention_dropout() is None, "applied once"
        light = steps()
        calls = []
        sdpa = light_dropout_sdpa(lambda *a, **kw: calls.append(kw.get("dropout")) or (a[1], None))
        q = torch.randn(1, 2, 4, 8, requires_grad=True)
        sdpa(model, q, q, q, None, dropout=0.0)  # no dropout (evaluation)
        with torch.no_grad():
            sdpa(model, q, q, q, None, dropout=0.1)
        sdpa(model, q, q[:, :1], q[:, :1], None, dropout=0.1)  # grouped key/value heads
        assert calls == [0.0, 0.1, 0.1]
        assert ALL_ATTENTION_FUNCTIONS["sdpa"].light_dropout
    finally:
        patches.restore_all()
    assert not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "light_dropout", False)
    assert plain[0] == light[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], light[1]))
    scores = 4 * config.num_attention_heads * 48 * 48 * config.num_hidden_layers
    assert [a - b for a, b in zip(plain[2], light[2])] == [7 * scores] * 2, (plain[2], light[2])


def test_resume_may_switch_fused_kernels_or_read_a_checkpoint_from_before_them():
    """A checkpoint whose config has no ``model.fused_kernels`` (older) or the other value resumes with a note."""
    from finetune.config import RunConfig, config_to_dict
    from finetune.lifecycle.resume import review

    cfg = RunConfig()
    old = config_to_dict(cfg)
    del old["model"]["fused_kernels"]
    problems, notes = review(old, 2, cfg, 2, allow=False)
    assert problems == [] and notes == ["--resume: model.fused_kernels: None -> True (applied from now on)"]
    old["model"]["fused_kernels"] = False
    assert review(old, 2, cfg, 2, allow=False)[0] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gelu_tanh_is_as_close_to_the_float64_formula(dtype):
    """Over 10^6 inputs the fused kernel is no further from the float64 formula than transformers' module."""
    x = torch.linspace(-16, 16, 1_000_001, dtype=torch.float64)
    exact = act.NewGELUActivation()(x)
    fused = torch.nn.functional.gelu(x.to(dtype), approximate="tanh").double()
    python = act.NewGELUActivation()(x.to(dtype)).double()
    assert (fused - exact).abs().max() <= (python - exact).abs().max() * 1.0001


def test_plan_counts_the_python_activation_only_when_it_stays(monkeypatch):
    """``finetune plan``: with ``model.fused_kernels=false`` a ``gelu_new`` model keeps 3 more ``[tokens, d_ff]``
    tensors per layer (what the saved-tensor test above measures); with the default, or a model without a
    Python-written activation, the count is the same."""
    from finetune.preflight import plan
    from finetune.config import load_run_config

    monkeypatch.chdir(MODELS.parent.parent)  # run configs name repo-relative paths
    gpt = "finetune/recipes/configs/gpt_clm_wikitext2.yaml"
    fused = plan.model_shape(load_run_config(gpt))
    python = plan.model_shape(load_run_config(gpt, ["model.fused_kernels=false"]))
    assert not fused.python_activation and python.python_activation
    b, s = 16, 128
    extra = (plan.activation_bytes(python, b, s, 4, False)["activations"]
             - plan.activation_bytes(fused, b, s, 4, False)["activations"])
    assert extra == 3 * b * s * fused.intermediate * 4 * fused.layers
    bert = "finetune/recipes/configs/bert_mlm_wikitext2.yaml"
    assert not plan.model_shape(load_run_config(bert, ["model.fused_kernels=false"])).python_activation
