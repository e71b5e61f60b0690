"""The architecture conformance matrix: tiny configs of the families users train, built as transformers' own model
tests build them (2 layers, hidden 32, the family's distinguishing features kept: Llama 3's rope scaling, Qwen2.5's
tied embeddings, Qwen3's q/k norms, Mistral's sliding window, Gemma-2's logit soft-capping with sliding and global
layers, Gemma-3's mixed sliding/global layers, Phi-3's fused projections with a sliding window, Cohere's logit scale,
Granite's logits scaling), each through every causal-LM recipe's forward, in process, against the plain model's own
forward on the same tokens:

* ``gpt_clm`` / ``sft`` (one loss path): the loss sum equals ``-sum log_softmax(logits)`` at the targets, padded,
  and packed (``position_ids`` restarting: the examples' separate sums);
* ``dpo`` / ``kto`` (``dpo.sequence_logps``): each sequence's log-probability equals the plain per-row sum;
* ``grpo`` (``grpo.completion_logps``): every completion token's log-probability at the sampling temperature
  equals ``log_softmax(logits / T)`` of the plain forward, with prompt sharing on and off;
* ``reward`` (sliding-window families): shared-prefix scores equal the separate rows' scores.

Rows are longer than the sliding windows (4 tokens), so a window that is not applied shows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from finetune.config import GrpoConfig
from finetune.recipes import dpo, gpt_clm, grpo, reward
from finetune.recipes.common import masks

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, attention_dropout=0.0)

FAMILIES = {
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})),
    "qwen2.5": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict()),
    "mistral-sliding": ("mistral", dict(sliding_window=4)),
    "gemma2-softcap": ("gemma2", dict(final_logit_softcapping=2.0, attn_logit_softcapping=None, sliding_window=4,
                                      query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])),
    "gemma3-mixed": ("gemma3_text", dict(sliding_window=4, query_pre_attn_scalar=8,
                                         layer_types=["sliding_attention", "full_attention"])),
    "phi3-sliding": ("phi3", dict(sliding_window=4)),
    "cohere-scale": ("cohere", dict(logit_scale=0.25)),
    "granite-scaling": ("granite", dict(logits_scaling=4.0)),
}


def _config(family: str, **extra):
    model_type, own = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **(COMMON | own | extra))
    config._attn_implementation = "eager" if model_type == "gemma2" else "sdpa"  # Gemma-2 runs eager only
    return config


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(_config(request.param)).eval()
    m.family = request.param
    return m


def _plain_logps(model, ids, mask=None, positions=None, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T - 1]``: ``log_softmax(logits / T)`` of the plain forward at each next token."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float() / temperature
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _rows(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (n, length), generator=torch.Generator().manual_seed(seed))


def test_token_losses_equal_the_plain_forward(model):
    """``gpt_clm``/``sft`` (padded and packed) and ``dpo``/``kto``'s sequence log-probabilities against the plain
    forward."""
    ids = _rows(3, 11, 1)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    plain = _plain_logps(model, ids, mask)
    keep = labels[:, 1:] != -100
    with torch.no_grad():
        got = gpt_clm.forward(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}).loss_sum
        rows, _ = dpo.sequence_logps(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert got.item() == pytest.approx(-(plain * keep).sum().item(), rel=1e-5), model.family
    assert torch.allclose(rows, (plain * keep).sum(1), rtol=1e-5, atol=1e-5), (model.family, rows)
    # packed (sft's prepare_model_config: no KV cache, so transformers derives the block mask from the positions): two
    # examples of 7 and 6 tokens in one row, positions restarting, no attention mask
    model.config.use_cache = False
    a, b = _rows(1, 7, 2), _rows(1, 6, 3)
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(7), torch.arange(6)])[None]
    packed_labels = packed.clone()
    packed_labels[0, 7] = -100  # the first token of an example: nothing predicts it
    with torch.no_grad():
        got = gpt_clm.forward(model, {"input_ids": packed, "position_ids": positions, "labels": packed_labels}).loss_sum
    model.config.use_cache = True
    want = -(_plain_logps(model, a).sum() + _plain_logps(model, b).sum())
    assert got.item() == pytest.approx(want.item(), rel=1e-5), model.family


def _grpo_batch(g: int = 3) -> dict:
    """Two left-padded prompts (8 and 6 tokens), ``g`` completions each (EOS at different places, one without)."""
    p = _rows(2, 8, 4)
    p[1, :2] = 0
    prompts = {"input_ids": p, "attention_mask": (torch.arange(8)[None] >= torch.tensor([[0], [2]])).long()}
    c = _rows(2 * g, 7, 5)
    ends = [3, 7, 5, 2, 6, 4]
    for row, at in enumerate(ends[:2 * g]):
        if at < 7:
            c[row, at] = 2
            c[row, at + 1:] = 0
    is_eos = c == 2
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((2 * g,), 7))
    cmask = (torch.arange(7)[None] <= first[:, None]).float()
    done = {"completion_ids": c, "completion_mask": cmask, "terminated": is_eos.any(1), "lengths": cmask.sum(1).long()}
    zeros = torch.zeros(2 * g)
    return grpo._sequences(prompts, done, GrpoConfig(num_generations=g), zeros, zeros, zeros, zeros[:, None])


@pytest.mark.parametrize("share", [False, True])
def test_grpo_logps_equal_the_plain_forward(model, share):
    """Every active completion token's log-probability at temperature 0.7 equals the plain forward's
    ``log_softmax(logits / 0.7)`` on the same left-padded sequence, prompt sharing on and off."""
    batch = _grpo_batch()
    assert grpo.shares_prompts(model, batch, share) == share, model.family
    with torch.no_grad():
        got, _ = grpo.completion_logps(model, batch, 0.7, share)
    p = int(batch["prompt_length"])
    want = _plain_logps(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], 0.7)[:, p - 1:]
    active = batch["completion_mask"].bool()
    assert torch.allclose(got[active], want[active], rtol=1e-5, atol=1e-5), \
        (model.family, share, (got - want)[active].abs().max())


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma3-mixed", "qwen3-sliding"])
def test_reward_shared_prefix_scores_respect_sliding_windows(family):
    """A sequence classifier with sliding-window layers (all of them, or mixed with global ones): the shared-prefix
    scores equal the separate rows' (pairs sharing 8 prompt tokens, longer than the window)."""
    torch.manual_seed(0)
    if family == "qwen3-sliding":
        config = AutoConfig.for_model("qwen3", **COMMON, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1)
        config._attn_implementation = "sdpa"
    else:
        config = _config(family)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config).eval()
    assert masks.sliding_layout(model)[0] == 4
    prompt = _rows(2, 8, 6)
    chosen = torch.cat([prompt, _rows(2, 5, 7)], 1)
    rejected = torch.cat([prompt, _rows(2, 5, 8)], 1)
    mask = torch.ones(4, 13, dtype=torch.long)
    mask[3, 11:] = 0
    ids = torch.cat([chosen, rejected]).masked_fill(mask == 0, 0)
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        shared, k = reward.scores(model, batch, share_prefix=True)
        separate, _ = reward.scores(model, batch, share_prefix=False)
    assert (k >= 8).all()
    assert torch.allclose(shared, separate, rtol=1e-5, atol=1e-5), (family, shared, separate)
