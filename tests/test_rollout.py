"""``finetune.engine.rollout``'s fast generation path against ``generate`` as it is: the same greedy completions with
one prefill per prompt, the same sampling distribution from :class:`InverseCdfSampler`, the reserved cache layers
equal to ``DynamicLayer``'s concatenation; completions sampled from the policy alone whatever the model's
``generation_config.json`` says; and, on a real ZeRO-3 engine whose every parameter is partitioned, one gather per
generation and no per-token fetch (``tests/zero3_generation.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, cpu_env, free_port, ok, run_python
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from finetune.engine.rollout import (HFGenerateRollout, InverseCdfSampler, ReservedLayer, RolloutRequest,
                                     SamplingConfig, complete, overridden_settings, sampling_processors,
                                     stop_token_ids)


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
                      bos_token_id=1, eos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


def _prompts() -> RolloutRequest:
    """Two left-padded prompts of 9 and 5 tokens."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 0, 20, 21, 22, 23, 24]])
    return RolloutRequest(ids, (ids != 0).long())


def test_one_prefill_per_prompt_generates_the_same_greedy_completions():
    """Greedy, 3 completions per prompt: the fast path (each prompt prefilled once, its cache repeated and reserved)
    writes the tokens and masks of ``generate`` on the prompts repeated 3 times."""
    model, req = _model(), _prompts()
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0, n_samples_per_prompt=3)
    fast = HFGenerateRollout(model, _Tok(), fast=True).generate(req, greedy)
    repeated = RolloutRequest(req.prompt_ids.repeat_interleave(3, 0), req.prompt_attention_mask.repeat_interleave(3, 0))
    plain = HFGenerateRollout(model, _Tok(), fast=False).generate(
        repeated, SamplingConfig(max_new_tokens=12, temperature=0.0, n_samples_per_prompt=1))
    assert fast.input_ids.shape == (6, 9 + 12)
    assert torch.equal(fast.input_ids, plain.input_ids)
    assert torch.equal(fast.attention_mask, plain.attention_mask)
    assert torch.equal(fast.response_start_idx, plain.response_start_idx)


def test_fast_sampling_is_seeded_and_shaped_as_generate():
    model, req = _model(), _prompts()
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, n_samples_per_prompt=4)
    rollout = HFGenerateRollout(model, _Tok())
    a, b = rollout.generate(req, sampling, seed=3), rollout.generate(req, sampling, seed=3)
    plain = HFGenerateRollout(model, _Tok(), fast=False).generate(req, sampling, seed=3)
    assert torch.equal(a.input_ids, b.input_ids) and a.input_ids.shape == plain.input_ids.shape == (8, 17)
    assert torch.equal(a.input_ids[:, :9], plain.input_ids[:, :9])  # each prompt's completions consecutive
    assert len({tuple(r) for r in a.input_ids[:, 9:].tolist()}) > 1  # sampled, not greedy


def test_the_inverse_cdf_sampler_draws_from_softmax_and_never_a_cut_token():
    """200,000 draws of one row's distribution after top-k 4 (through :func:`sampling_processors`): each kept
    token's share within 0.005 of its probability; the cut tokens are never drawn."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, -0.5]])
    processors = sampling_processors(SamplingConfig(max_new_tokens=1, temperature=0.8, top_k=4, top_p=1.0))
    assert isinstance(processors[-1], InverseCdfSampler)
    rows = logits.expand(200_000, -1).clone()
    scores = processors(torch.zeros((len(rows), 1), dtype=torch.long), rows)
    drawn = scores.argmax(-1)
    assert ((scores == 0).sum(-1) == 1).all()
    kept = (logits / 0.8).topk(4).indices[0]
    expected = torch.zeros(8).index_put_((kept,), (logits[0, kept] / 0.8).softmax(-1))
    share = torch.bincount(drawn, minlength=8).float() / len(rows)
    assert torch.allclose(share, expected, atol=0.005), (share, expected)
    assert share[expected == 0].sum() == 0


def test_a_reserved_layer_equals_concatenation_and_grows_past_its_capacity():
    torch.manual_seed(0)
    dynamic = DynamicLayer()
    dynamic.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    reserved = ReservedLayer.reserve(dynamic, 7)
    for _ in range(4):  # 2 steps within the capacity of 7, then 2 past it
        k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
        want, got = dynamic.update(k, v), reserved.update(k, v)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert reserved.get_seq_length() == 9


def test_decoding_keeps_a_cache_when_the_model_config_says_use_cache_false():
    """A packed SFT export's config and generation config say ``use_cache: false`` (``recipes.sft``): every decoding
    forward still gets one new token, on both paths."""
    model, req = _model(), _prompts()
    model.config.use_cache = model.generation_config.use_cache = False
    lengths = []
    model.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    for fast in (True, False):
        lengths.clear()
        HFGenerateRollout(model, _Tok(), fast=fast).generate(
            req, SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2), seed=0)
        assert lengths[-5:] == [1] * 5, (fast, lengths)


def _greedy_by_hand(model, req: RolloutRequest, new_tokens: int) -> torch.Tensor:
    """The policy's greedy completions, one full forward per token (no cache, no processor): ``[B, new_tokens]``,
    pad after the first EOS."""
    ids, mask = req.prompt_ids, req.prompt_attention_mask
    out, done = [], torch.zeros(len(ids), dtype=torch.bool)
    with torch.no_grad():
        for _ in range(new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
            nxt = torch.where(done, _Tok.pad_token_id, nxt)
            out.append(nxt)
            done |= nxt == _Tok.eos_token_id
            ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1)


def test_rollouts_ignore_the_processors_of_the_models_generation_config():
    """A ``generation_config.json`` with a repetition penalty, an n-gram ban, suppressed tokens, a minimum length and
    its own sampling knobs (Qwen2.5-Instruct ships ``repetition_penalty: 1.05``): greedy completions, fast and not,
    are the policy's argmax token by token; sampled ones equal those of the same model without such a file (same
    seed); the settings are named for the log and the model's own generation config is back after the call."""
    model, req = _model(), _prompts()
    sampled = SamplingConfig(max_new_tokens=10, temperature=0.9, top_k=0, n_samples_per_prompt=3)
    clean = {fast: HFGenerateRollout(model, _Tok(), fast=fast).generate(req, sampled, seed=5).input_ids
             for fast in (True, False)}
    want = _greedy_by_hand(model, req, 10)
    gc = model.generation_config
    gc.repetition_penalty, gc.no_repeat_ngram_size, gc.min_new_tokens = 3.0, 1, 4
    gc.suppress_tokens, gc.do_sample, gc.temperature, gc.top_k = [int(want[0, 0]), int(want[1, 0])], True, 0.3, 3
    assert overridden_settings(model) == {"do_sample": True, "temperature": 0.3, "top_k": 3, "repetition_penalty": 3.0,
                                          "no_repeat_ngram_size": 1, "min_new_tokens": 4,
                                          "suppress_tokens": [int(want[0, 0]), int(want[1, 0])]}
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0, n_samples_per_prompt=1)
    for fast in (True, False):
        got = HFGenerateRollout(model, _Tok(), fast=fast).generate(req, greedy).input_ids[:, 9:]
        assert torch.equal(got, want), (fast, got, want)
        again = HFGenerateRollout(model, _Tok(), fast=fast).generate(req, sampled, seed=5).input_ids
        assert torch.equal(again, clean[fast]), fast
    assert model.generation_config is gc and gc.repetition_penalty == 3.0


def test_completions_end_at_every_end_token_of_the_models_generation_config():
    """Real chat models list several end tokens in ``generation_config.json`` (Gemma's ``eos_token_id: [1, 106]``:
    ``<eos>`` and ``<end_of_turn>``; Llama 3's three): a completion ends at the first of them and the tokenizer's EOS
    (TRL 1.16's ``eos_token_ids``), fast and not: the greedy tokens up to and including it, pad after, the mask and
    ``terminated`` to match, the reward text without it; with the tokenizer's EOS alone that completion ran on."""
    from finetune.recipes.grpo.rollout import _texts

    model, req = _model(), _prompts()
    want = _greedy_by_hand(model, req, 10)
    # a token row 0 generates greedily (not first, not before): the model's second end token, like <end_of_turn>
    j = next(j for j in range(1, 10) if int(want[0, j]) not in want[0, :j].tolist() + [0, 1])
    end = int(want[0, j])
    assert stop_token_ids(model, _Tok()) == [1]
    model.generation_config.eos_token_id = [1, end]
    assert stop_token_ids(model, _Tok()) == [1, end]
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0, n_samples_per_prompt=1)
    for fast in (True, False):
        out = HFGenerateRollout(model, _Tok(), fast=fast).generate(req, greedy)
        got, mask = out.input_ids[:, 9:], out.attention_mask[:, 9:]
        assert got[0, :j + 1].tolist() == want[0, :j + 1].tolist() and set(got[0, j + 1:].tolist()) == {0}, fast
        assert mask[0].tolist() == [1] * (j + 1) + [0] * (9 - j), fast
        c = complete(model, req.prompt_ids, req.prompt_attention_mask, greedy, _Tok(), 0, fast=fast)
        assert bool(c["terminated"][0]) and int(c["lengths"][0]) == j + 1, fast
    texts, ids = _texts(type("T", (), {"batch_decode": lambda self, x, **k: [str(r) for r in x]})(), c)
    assert ids[0][-1] == end and texts[0] == str(want[0, :j].tolist())
    model.generation_config.eos_token_id = 1  # the tokenizer's EOS alone: the same row runs past that token
    c = complete(model, req.prompt_ids, req.prompt_attention_mask, greedy, _Tok(), 0)
    assert int(c["lengths"][0]) > j + 1


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_zero3_generation_gathers_once_and_fetches_nothing_per_token(tmp_path, lora):
    """Real DeepSpeed ZeRO-3, 1 rank, ``stage3_param_persistence_threshold: 0`` (every parameter partitioned, as a
    real model's layers are): generating 12 tokens inside ``weights()`` takes one ``GatheredParameters`` gather, no
    module fetch (with DeepSpeed's hooks left on: 416, a fetch per submodule and token) and no ``reset_step`` of the
    coordinator (its top-level pre-hook left on: one per decoding step of a plain model, one per generate call of a
    LoRA ``PeftModel``; each broadcasts while a trace is recorded, so ranks with different numbers of tool turns hung:
    issue 68 item 3); the completions equal a plain copy's; the next training step fetches through the restored
    hooks, trains and leaves the parameters partitioned. ``lora``: the engine's module is a LoRA ``PeftModel``."""
    out = tmp_path / "z3.json"
    ok(run_python(["tests/zero3_generation.py", str(out), *(["lora"] if lora else [])],
                  env=cpu_env(MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO))))
    r = json.loads(out.read_text())
    assert r == {"gathers": 1, "fetches_in_generation": 0, "resets_in_generation": 0, "same_as_plain": True,
                 "fetches_in_training": r["fetches_in_training"], "partitioned_after": True, "loss_finite": True}, r
    assert r["fetches_in_training"] > 0
