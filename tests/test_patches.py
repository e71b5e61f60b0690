"""finetune.patches in process: every kind of change finetune makes to a library object is undone by
``sequence_parallel_off`` (model scope) and by ``restore_all`` (everything), and a patch whose target is missing
or whose library version is unchecked fails loudly.

The patches are the real ones of a sequence-parallel launch, on a real tiny Llama (1 key/value head): transformers'
attention table gets the packed-row sdpa (what ``start_sequence_parallel`` registers before DeepSpeed's Ulysses
wraps it), every MLP gets DeepSpeed's ``TiledMLP`` forward (``tile_mlps``), every attention module's
``num_key_value_groups`` is watched and then overwritten as the Ulysses forward overwrites it when it replicates
key/value heads, and torch's default process-group timeout is set as ``distributed.init`` sets it. (The multi-rank
launches of tests/test_sequence_parallel.py run the same patches under DeepSpeed's Ulysses.)
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch.distributed import distributed_c10d
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from finetune import patches
from finetune.errors import RunFailure
from finetune.parallel import sequence


def test_sequence_parallel_off_and_restore_all_give_back_every_original():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
    attentions = [m for m in model.modules() if isinstance(getattr(m, "num_key_value_groups", None), int)]
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    timeout = distributed_c10d.default_pg_timeout
    ids = torch.randint(0, 64, (2, 10))
    plain = model(input_ids=ids).logits
    assert not patches.active() and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    try:
        for m in attentions:
            patches.apply(patches.watch_attribute(m, "num_key_value_groups", "test"))
        patches.apply(patches.attention_function("sdpa", sequence.packed_sdpa(sdpa_attention_forward), "test"))
        patches.apply(patches.mask_function("sdpa", sequence.no_local_mask, "test"))
        assert sequence.tile_mlps(model) == len(mlps) == 2
        patches.apply(patches.module_global(distributed_c10d, "default_pg_timeout", timedelta(seconds=7), "test"))
        for m in attentions:  # what DeepSpeed's Ulysses forward does with SP 2 and 1 KV head (replicated twice)
            m.num_key_value_groups = 1
        set_values = {id(p): p.current() for p, _, _ in patches.active()}
        assert len(set_values) == len(attentions) + 2 + len(mlps) + 1
        assert all(now is not original for _, original, now in patches.active())

        with sequence.sequence_parallel_off():
            for p, original, now in patches.active():
                if p.scope == "model":
                    assert now is original or now == original, p.describe()
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
            assert all("forward" not in vars(m) for m in mlps)
            assert [m.num_key_value_groups for m in attentions] == [2, 2]
            assert torch.allclose(model(input_ids=ids).logits, plain)  # transformers' own model, whole sequences
            # the process-scope patch is not the model's: it stays
            assert distributed_c10d.default_pg_timeout == timedelta(seconds=7)
        assert {id(p): p.current() for p, _, _ in patches.active()} == set_values  # all back as they were
        assert [m.num_key_value_groups for m in attentions] == [1, 1]
    finally:
        patches.restore_all()
    assert not patches.active()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward and distributed_c10d.default_pg_timeout == timeout
    assert all("forward" not in vars(m) for m in mlps) and [m.num_key_value_groups for m in attentions] == [2, 2]
    assert torch.allclose(model(input_ids=ids).logits, plain)


def test_a_missing_target_or_an_unchecked_version_fails_loudly():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RunFailure, match=r"Linear\.no_such_method.*upstream X"):
        patches.instance_method(model, "no_such_method", lambda f: f, "upstream X")
    with pytest.raises(RunFailure, match=r"\['no_such_kernel'\]"):
        patches.apply(patches.attention_function("no_such_kernel", sdpa_attention_forward, "test"))
    assert not patches.active()  # nothing half-applied
    with pytest.raises(RunFailure, match=r"checked for deepspeed 0\.19\.8 only \(this is 0\.20\.0\)"):
        patches.require_version("deepspeed", "0.20.0", ("0.19.8",), "the ZeRO-3 average")
    patches.require_version("deepspeed", "0.19.8", ("0.19.8",), "the ZeRO-3 average")
    with patches.applied(patches.instance_forward(model, lambda x: x * 0, "test")):
        assert float(model(torch.ones(2)).detach().abs().sum()) == 0
    assert "forward" not in vars(model) and float(model(torch.ones(2)).detach().abs().sum()) > 0


def test_packed_slices_get_no_local_mask_while_sequence_parallel_trains():
    """transformers builds a ``[rows, 1, seq, seq]`` mask for a slice whose ``position_ids`` restart (packed rows);
    while sequence parallelism trains, the mask table's ``sdpa`` entry (``sequence.no_local_mask``) makes none (the
    Ulysses attention would discard it: nothing quadratic in the length is allocated), and
    ``sequence_parallel_off`` gives transformers' mask back for whole-sequence work."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
    ids, pos = torch.randint(0, 64, (2, 10)), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2)
    received = []

    def spy(module, q, k, v, mask, *args, **kwargs):  # what the attention is handed
        received.append(mask)
        return sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)

    try:  # the spy stays through sequence_parallel_off (process scope); the mask patch is the model's
        patches.apply(patches.Patch(ALL_ATTENTION_FUNCTIONS, "sdpa", spy, "test", item=True, scope="process"))
        model(input_ids=ids, position_ids=pos, use_cache=False)
        assert len(received) == 2 and all(m is not None and m.shape == (2, 1, 10, 10) for m in received)
        received.clear()
        patches.apply(patches.mask_function("sdpa", sequence.no_local_mask, "test"))
        model(input_ids=ids, position_ids=pos, use_cache=False)
        assert received == [None, None]
        received.clear()
        with sequence.sequence_parallel_off():
            model(input_ids=ids, position_ids=pos, use_cache=False)
            assert all(m is not None and m.shape == (2, 1, 10, 10) for m in received)
    finally:
        patches.restore_all()
    assert not patches.active()
