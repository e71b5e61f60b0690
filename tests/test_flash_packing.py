"""Packed rows under flash attention, on CPU: transformers' own flash-attention path (its ``flash_attention_forward``
and ``_flash_attention_forward``, unchanged) runs with pure-PyTorch kernels that keep flash-attn's contract
(``flash_attn_func`` on ``[batch, seq, heads, dim]``; ``flash_attn_varlen_func`` on the rows joined into
``[tokens, heads, dim]`` with ``cu_seqlens``/``max_seqlen``), registered as an attention implementation whose name
says "flash", so that transformers treats it as flash attention everywhere (masks, packed-sequence detection).

transformers 5.23 runs the variable-length kernel only for one row (``_is_packed_sequence`` is False for more
rows): a micro-batch of 4 packed rows (what finetune sent before it flattened them) attends across its examples, and
its loss is off; flattened into one row (:func:`finetune.data.batch.flatten`, what the data pipeline does under a
flash kernel with packing) the loss and gradients equal the examples run one by one with sdpa. ``finetune
selftest``'s ``flash_packing`` row runs the same comparison with the real flash-attn kernel on GPU nodes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers import modeling_flash_attention_utils as fa_utils
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from finetune import patches
from finetune.config import RunConfig
from finetune.data.batch import flatten, flattens
from finetune.data.dataset import FlattenRows
from finetune.parallel.sequence import shard_batch
from finetune.preflight import selftest
from finetune.recipes import get_recipe, gpt_clm
from finetune.recipes.common import targets

EMULATED = "flash_attention_cpu_emulated"


def _attend(q, k, v, causal, scale):
    """q ``[b, s, h, d]``, k/v ``[b, s, h_kv, d]`` -> ``[b, s, h, d]`` (grouped heads broadcast, as flash-attn)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    assert dropout_p == 0.0
    return _attend(q, k, v, causal, softmax_scale)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False):
    assert dropout_p == 0.0 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    bounds = cu_seqlens_q.tolist()
    assert bounds[-1] == q.shape[0] and max(b - a for a, b in zip(bounds, bounds[1:])) == int(max_seqlen_q)
    return torch.cat([_attend(q[None, a:b], k[None, a:b], v[None, a:b], causal, softmax_scale)[0]
                      for a, b in zip(bounds, bounds[1:])])


@pytest.fixture(scope="module")
def emulated_flash():
    """The emulated kernels loaded as transformers' flash implementation ``EMULATED`` for this module (its cache
    of loaded kernels is set through finetune.patches and restored after)."""
    process = fa_utils._lazy_define_process_function(flash_attn_varlen_func)
    cache = [patches.module_global(fa_utils, name, value, "test: flash-attn's contract in PyTorch")
             for name, value in (("_loaded_implementation", EMULATED), ("_flash_fn", flash_attn_func),
                                 ("_flash_varlen_fn", flash_attn_varlen_func), ("_flash_with_kvcache_fn", None),
                                 ("_pad_fn", fa_utils._pad_input), ("_unpad_fn", fa_utils._unpad_input),
                                 ("_process_flash_kwargs_fn", process), ("_process_with_kvcache_kwargs_fn", dict))]
    AttentionInterface.register(EMULATED, flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EMULATED, flash_attention_mask)
    try:
        with patches.applied(*cache):
            yield EMULATED
    finally:
        del AttentionInterface._global_mapping[EMULATED]
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[EMULATED]


def test_packed_rows_through_the_flash_varlen_contract(emulated_flash):
    cpu = torch.device("cpu")
    # the emulated kernels are flash attention: the same logits as sdpa on plain rows
    ids = selftest._batch(4, 24)
    with torch.no_grad():
        got = selftest.tiny_llama(emulated_flash)(input_ids=ids).logits
        want = selftest.tiny_llama("sdpa")(input_ids=ids).logits
    assert selftest.scaled_diff(got, want) < 1e-5
    # 4 packed rows as one row: the examples' own loss and gradients (fp32; the packing test's tolerance)
    assert selftest.packed_rows_diff(emulated_flash, cpu) < 1e-5
    # 4 packed rows as 4 rows, what transformers' flash path computes for them: examples attend across each other
    assert selftest.packed_rows_diff(emulated_flash, cpu, flatten_rows=False) > 1e-2


def test_the_data_pipeline_flattens_packed_rows_for_flash_kernels():
    sft, bert, dpo = get_recipe("sft"), get_recipe("bert_mlm"), get_recipe("dpo")
    cfg = RunConfig()
    cfg.data.packing = True
    for attn, want in (("flash_attention_2", True), ("flash_attention_3", True),
                       ("kernels-community/flash-attn2", True), ("sdpa", False), ("eager", False)):
        cfg.model.attn_implementation = attn
        assert flattens(cfg, sft) is want, attn
        assert not flattens(cfg, bert) and not flattens(cfg, dpo)  # no next-token targets to shift first
    cfg.data.packing = False
    cfg.model.attn_implementation = "flash_attention_2"
    assert not flattens(cfg, sft)  # padded rows keep their mask: flash's unpadding path keeps rows apart

    batch, _ = selftest.packed_batch()
    flat = FlattenRows(lambda rows: batch)([])
    assert flat["input_ids"].shape == flat["shift_labels"].shape == flat["position_ids"].shape == (1, 4 * 22)
    assert "labels" not in flat and "attention_mask" not in flat
    assert int(gpt_clm.count_targets(flat)) == int(gpt_clm.count_targets(batch))  # the same targets
    assert int(flat["num_tokens"]) == int(batch["num_tokens"])
    # no row's last token predicts the next row's first: the labels were shifted row by row before joining
    assert (flat["shift_labels"].view(4, 22)[:, -1] == -100).all()
    assert torch.equal(flat["shift_labels"].view(4, 22), targets.shift_labels(batch["labels"]))
    # an unpadded gpt_clm block batch (all-ones mask, no positions): one segment per row
    blocks = {"input_ids": selftest._batch(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    blocks["labels"] = blocks["input_ids"].clone()
    one = flatten(blocks)
    assert one["position_ids"].tolist() == [list(range(8)) * 2] and int(one["num_tokens"]) == 16
    with pytest.raises(ValueError, match="padded"):
        flatten({**blocks, "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3])})
    # under sequence parallelism the flattened row is cut like any row: the slices' targets sum to the row's
    slices = [shard_batch(flat, 2, r) for r in (0, 1)]
    assert sum(int(gpt_clm.count_targets(s)) for s in slices) == int(gpt_clm.count_targets(batch))
    assert torch.equal(torch.cat([s["shift_labels"] for s in slices], dim=1)[:, :88], flat["shift_labels"])
