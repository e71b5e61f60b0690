"""The LM recipes' loss runs the output head and the cross-entropy at target positions only, in chunks
(``finetune/recipes/lm_loss.py``), and gives the full head's loss and gradients (fp32, 1e-6).

* ZeRO 0 and 3 (one real DeepSpeed rank, every parameter partitioned at stage 3, 3-row chunks so the backward
  recomputes each checkpointed chunk through DeepSpeed's module hooks): ``tests/head_loss_zero.py``.
* In process: MLM (head transform included) and CLM (tied ``lm_head``), with the default and with tiny chunks,
  masked accuracy as eval computes it, a peft LoRA wrapper and packed ``position_ids``; outside the recipe call
  the model returns full logits (the export check needs them); a model that post-processes its head's output
  (soft-capping) is refused.
The 2-rank end-to-end runs at ZeRO 0-3 (losses, grad norms, weights against the full-logits reference) are the
parity battery (``tests/test_parity.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, cpu_env, free_port, ok, run_python
from head_loss_zero import batch as make_batch


def _bert():
    from transformers import AutoConfig, AutoModelForMaskedLM

    cfg = AutoConfig.from_pretrained(REPO / "data/models/bert-small")
    for k, v in dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0).items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForMaskedLM.from_config(cfg).train()


def _gpt():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(REPO / "data/models/tiny-gpt2", resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0).train()


def _full_head(model, batch: dict, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook loss sum and logits from the full ``[batch, seq, vocab]`` logits."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float()
    lg, labels = (logits[:, :-1], batch["labels"][:, 1:]) if causal else (logits, batch["labels"])
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="sum"), logits


def _loss_and_grads(fn, model) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: tuple[float, dict], want: tuple[float, dict], what: str) -> None:
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=0), what
    assert got[1].keys() == want[1].keys(), what
    scale = max(g.abs().max().item() for g in want[1].values())
    worst = max((got[1][k] - want[1][k]).abs().max().item() for k in want[1])
    # 1e-5 of the largest gradient: chunks sum the head weight's gradient in another order (fp32 rounding; up to
    # 3.8e-6 of the scale for BERT's MLM head in chunks of 3 rows, depending on the CPU's kernels)
    assert worst <= 1e-5 * scale, f"{what}: gradients differ by {worst:.2e} (scale {scale:.2e})"


def test_target_positions_only_equal_full_head(monkeypatch):
    """MLM and CLM, default chunks and 3-row chunks (checkpointed for BERT's head, gradients in the forward pass for
    GPT-2's plain ``Linear``): loss and every gradient as the full head (1e-6);
    eval's masked accuracy is the full logits' argmax accuracy; the head really saw only the target rows; the
    model's own forward is untouched afterwards."""
    from finetune.recipes import bert_mlm, gpt_clm, lm_loss

    for recipe, model, causal in ((bert_mlm, _bert(), False), (gpt_clm, _gpt(), True)):
        batch = make_batch("gpt_clm" if causal else "bert_mlm", model.config.vocab_size)
        name = recipe.__name__.rsplit(".", 1)[-1]
        head = lm_loss.find_head(model)
        assert head is (model.cls if not causal else model.lm_head), "BERT: transform + decoder; GPT-2: lm_head"
        want = _loss_and_grads(lambda: _full_head(model, batch, causal)[0], model)
        seen = []  # rows of each head computation
        chunked, default_chunk = lm_loss.chunked_cross_entropy, lm_loss.LOGITS_CHUNK_ELEMENTS

        def spy(head_fn, *args, **kwargs):
            return chunked(lambda h: (seen.append(h.shape[0]), head_fn(h))[1], *args, **kwargs)

        fused, in_forward = lm_loss.LinearCrossEntropy.apply, []  # rows the gradients-in-forward path got

        monkeypatch.setattr(lm_loss, "chunked_cross_entropy", spy)
        monkeypatch.setattr(lm_loss.LinearCrossEntropy, "apply",
                            lambda h, *a: (in_forward.append(h.shape[0]), fused(h, *a))[1])
        for rows in (None, 3):
            if rows:
                monkeypatch.setattr(lm_loss, "LOGITS_CHUNK_ELEMENTS", rows * model.config.vocab_size)
            seen.clear(), in_forward.clear()
            got = _loss_and_grads(lambda: recipe.forward(model, batch).loss_sum, model)
            _assert_same(got, want, f"{name}, chunk={rows or 'default'}")
            n = int(recipe.count_targets(batch))
            if rows and causal:  # GPT-2's plain Linear head, several chunks: gradients in the forward, no recompute
                assert seen == [] and in_forward == [n], (seen, in_forward)
            else:  # forward + (with several chunks) the recomputation in backward; never a row that is not a target
                assert sum(seen) == n * (2 if rows else 1) and max(seen) <= (rows or n) and not in_forward, seen
        monkeypatch.setattr(lm_loss, "chunked_cross_entropy", chunked)
        monkeypatch.setattr(lm_loss.LinearCrossEntropy, "apply", fused)
        monkeypatch.setattr(lm_loss, "LOGITS_CHUNK_ELEMENTS", default_chunk)
        with torch.no_grad():
            out = recipe.forward(model, batch, metrics=True)
            full_loss, logits = _full_head(model, batch, causal)
        assert out.loss_sum.item() == pytest.approx(full_loss.item(), rel=1e-6)
        assert int(out.targets) == int(recipe.count_targets(batch))
        assert logits.shape == (*batch["input_ids"].shape, model.config.vocab_size), "hook left active"
        if not causal:
            mask = batch["labels"] != -100
            correct = ((logits.argmax(-1) == batch["labels"]) & mask).sum()
            assert [int(t) for t in out.metrics["masked_accuracy"]] == [int(correct), int(mask.sum())]


def test_peft_packed_rows_and_unsupported_models():
    """A peft LoRA model (LoRA on attention and on the tied lm_head itself) with packed ``position_ids``: the same
    loss and gradients as its full head. A model that soft-caps its logits after the head (Gemma-2) gets the loss of
    the logits it returns; one that changes them in a way ``lm_loss.logits_transform`` does not know is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from finetune.recipes import gpt_clm

    cfg = AutoConfig.for_model("gemma2", vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.5)
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(cfg)
    capped = make_batch("gpt_clm", 300)
    want = _loss_and_grads(lambda: _full_head(gemma, capped, True)[0], gemma)
    got = _loss_and_grads(lambda: gpt_clm.forward(gemma, capped).loss_sum, gemma)
    _assert_same(got, want, "Gemma-2 with final_logit_softcapping")

    class Doubled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    doubled = Doubled(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(RuntimeError, match="changes the output of its head"):
        gpt_clm.forward(doubled, capped)

    peft = pytest.importorskip("peft", reason="peft is the LoRA branch's dependency")  # pinned with LoRA (issue 10)
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    batch = make_batch("gpt_clm", 50257)
    batch["position_ids"] = torch.cat([torch.arange(7), torch.arange(5)]).repeat(3, 1)  # two packed documents
    batch["labels"][:, 7] = -100  # no loss across the document boundary
    for targets in (["c_attn"], ["c_attn", "lm_head"]):
        model = get_peft_model(_gpt(), LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
        want = _loss_and_grads(lambda: _full_head(model, batch, True)[0], model)
        got = _loss_and_grads(lambda: gpt_clm.forward(model, batch).loss_sum, model)
        _assert_same(got, want, f"peft LoRA on {targets}")
        assert any("lora" in k for k in got[1])



def test_fused_path_choice(monkeypatch):
    """Which head loss runs, as decided inside the loss call: GPT-2's plain ``lm_head`` is turned down on CPU for the
    device only (on a GPU it would be fused); BERT's transform + projection head and a peft LoRA ``lm_head`` are
    turned down for what they are; evaluation never takes the fused path."""
    from finetune.recipes import bert_mlm, gpt_clm, lm_loss

    reasons = []
    real = lm_loss.fused_head_loss

    def spy(*args, **kwargs):
        reasons.append(real(*args, **kwargs))
        return reasons[-1]

    monkeypatch.setattr(lm_loss, "fused_head_loss", spy)
    gpt, bert = _gpt(), _bert()
    gpt_batch = make_batch("gpt_clm", gpt.config.vocab_size)
    gpt_clm.forward(gpt, gpt_batch)
    bert_mlm.forward(bert, make_batch("bert_mlm", bert.config.vocab_size))
    assert reasons[0] == "CPU tensors", reasons
    assert reasons[1].startswith("the head is transformers.") and "BertOnlyMLMHead" in reasons[1], reasons
    with torch.no_grad():
        gpt_clm.forward(gpt, gpt_batch)
    assert reasons[2] == "evaluation", reasons
    rows = torch.zeros(2, gpt.config.n_embd)
    assert real(lm_loss.find_head(gpt), rows, forward_replaced=True).endswith("with a replaced forward, not "
                                                                              "torch.nn.Linear")

    peft = pytest.importorskip("peft", reason="peft is the LoRA branch's dependency")
    lora = peft.get_peft_model(_gpt(), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    gpt_clm.forward(lora, gpt_batch)
    assert reasons[3].startswith("the head is peft."), reasons


def _liger_ready() -> bool:
    from finetune.recipes import lm_loss

    return torch.cuda.is_available() and lm_loss._liger_loss_class() is not None


@pytest.mark.skipif(not _liger_ready(), reason="needs a CUDA GPU and liger-kernel (pip install -e .[gpu])")
def test_liger_fused_head_equals_chunked(monkeypatch):
    """On a CUDA GPU with liger-kernel, GPT-2's loss runs in Liger's fused linear cross-entropy (once per forward):
    in fp32 the same loss and gradients as the full head (1e-4 relative: the kernel sums in another order); in bf16
    the same loss and gradients as the chunked path within bf16 rounding. Evaluation keeps the chunked path."""
    from finetune.recipes import gpt_clm, lm_loss
    from finetune.recipes.common.targets import shift_labels

    fused_calls = []
    fused = lm_loss._fused_ce_sum
    monkeypatch.setattr(lm_loss, "_fused_ce_sum", lambda *a: (fused_calls.append(1), fused(*a))[1])
    model = _gpt().cuda()
    batch = {k: v.cuda() for k, v in make_batch("gpt_clm", model.config.vocab_size).items()}
    head = lm_loss.find_head(model)
    want = _loss_and_grads(lambda: _full_head(model, batch, True)[0], model)
    got = _loss_and_grads(lambda: gpt_clm.forward(model, batch).loss_sum, model)
    assert len(fused_calls) == 1, "the fused path did not run"
    assert got[0] == pytest.approx(want[0], rel=1e-4)
    assert got[1].keys() == want[1].keys()
    scale = max(g.abs().max().item() for g in want[1].values())
    worst = max((got[1][k] - want[1][k]).abs().max().item() for k in want[1])
    assert worst <= 1e-4 * scale, f"gradients differ by {worst:.2e} (scale {scale:.2e})"
    with torch.no_grad():
        gpt_clm.forward(model, batch)
    assert len(fused_calls) == 1, "evaluation took the fused path"

    model = model.to(torch.bfloat16)
    targets = shift_labels(batch["labels"])
    keep = targets != -100

    def chunked():
        hidden = model.transformer(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
        return lm_loss.chunked_cross_entropy(head, hidden[keep], targets[keep], chunk=10**6)[0]

    want = _loss_and_grads(chunked, model)
    got = _loss_and_grads(lambda: gpt_clm.forward(model, batch).loss_sum, model)
    assert len(fused_calls) == 2, "the fused path did not run in bf16"
    assert got[0] == pytest.approx(want[0], rel=5e-3)
    scale = max(g.abs().float().max().item() for g in want[1].values())
    worst = max((got[1][k] - want[1][k]).abs().float().max().item() for k in want[1])
    assert worst <= 2e-2 * scale, f"bf16 gradients differ by {worst:.2e} (scale {scale:.2e})"


def test_zero0_and_zero3_equal_full_head(tmp_path):
    """Real DeepSpeed, 1 rank, ZeRO 0 and 3 (every parameter partitioned), 3-row chunks (BERT's checkpointed, GPT-2's
    with gradients in the forward pass, under DeepSpeed's hooks): MLM and CLM
    losses (1e-6) and full gradients (1e-6 of the largest) equal the full head's on a plain copy of the model."""
    out = tmp_path / "zero.json"
    ok(run_python(["tests/head_loss_zero.py", str(out)], env=cpu_env(MASTER_PORT=str(free_port()),
                                                                      PYTHONPATH=str(REPO))))
    results = json.loads(out.read_text())
    assert sorted(results) == ["bert_mlm-z0", "bert_mlm-z3", "gpt_clm-z0", "gpt_clm-z3"]
    for case, r in results.items():
        assert r["targets"][0] == r["targets"][1] and r["chunks"] >= 3, (case, r)
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6, abs=0), (case, r)
        assert r["grad_diff"] <= 1e-5 * r["grad_scale"], (case, r)
        assert r["partitioned"] == case.endswith("z3"), (case, r)
        assert r["in_forward"] == case.startswith("gpt_clm"), (case, r)  # GPT-2's Linear head: gradients in forward
