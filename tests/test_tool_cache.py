"""KV-cache reuse across the turns of a multi-turn rollout (``train.grpo.fast_generation``; issue 53 item 4):
inside one ``weights()`` block, a turn that extends the previous turn's rows (the sampled tokens, then a tool
result's tokens) starts from their cached keys and values (:meth:`finetune.engine.rollout.HFGenerateRollout.
_cached_prefix`) and writes the very tokens of a full prefill: greedy transcripts of several turns (rollouts dropping
out, tails of different lengths, rows ended by EOS with padding after it in the cache) equal those without reuse,
on a plain model, with LoRA adapters, and on a real DeepSpeed ZeRO-3 engine whose every parameter is partitioned
(this file run as a script: ``python tests/test_tool_cache.py OUT.json``). The counters show the cache was used
(tokens taken from it, fewer encoded again), and a prompt that extends no cached row falls back to a full prefill.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from finetune.engine import rollout as rollout_mod  # noqa: E402
from finetune.engine.rollout import HFGenerateRollout, RolloutRequest, SamplingConfig  # noqa: E402


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=256, pad_token_id=0, bos_token_id=2,
                                         eos_token_id=1))
    with torch.no_grad():  # EOS more likely: some turns end early, leaving padding after their EOS in the cache
        model.lm_head.weight[1] *= 4
    return model.eval()


def _left_padded(rows: list[list[int]]) -> RolloutRequest:
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return RolloutRequest(ids, mask)


def transcripts(model, reuse: bool, turns: int = 4) -> list[list[list[int]]]:
    """Greedy multi-turn rollouts as ``tool_turns`` drives them: 3 prompts x 2 completions, then per turn the rows
    that go on (one in three drops out) get 1-5 "result" tokens appended and continue, each call's prompt the real
    tokens so far, left-padded. ``reuse``: all turns inside one ``weights()`` block (the cache kept across turns);
    else each call in a block of its own (a full prefill every turn). Every turn's real tokens, per turn."""
    rollout = HFGenerateRollout(model, _Tok(), fast=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]

    def call(rows: list[list[int]], n: int, new: int) -> list[list[int]]:
        with contextlib.nullcontext() if reuse else rollout.weights():
            out = rollout.generate(_left_padded(rows), SamplingConfig(max_new_tokens=new, temperature=0.0,
                                                                      n_samples_per_prompt=n))
        return [row[m.bool()].tolist() for row, m in zip(out.input_ids, out.attention_mask)]

    with rollout.weights() if reuse else contextlib.nullcontext():
        rows = call(prompts, 2, 9)
        history = [rows]
        for t in range(turns - 1):
            go_on = [r for i, r in enumerate(rows) if (i + t) % 3]
            rows = [r + torch.randint(2, 97, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                      generator=gen).tolist() for r in go_on]
            rows = call(rows, 1, 7)
            history.append(rows)
    return history


def _stats() -> dict:
    return json.loads(json.dumps(rollout_mod.TURN_CACHE_STATS))


def _reset() -> None:
    rollout_mod.TURN_CACHE_STATS.update(reused=0, full=0, cached_tokens=0, encoded_tokens=0, why_not={})


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # random adapters (init_lora_weights=False): they change every turn's tokens
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False)).eval()


def _check(model) -> None:
    _reset()
    reused = transcripts(model, reuse=True)
    stats = _stats()
    full = transcripts(model, reuse=False)
    assert reused == full
    assert any(1 in r[:-1] for turn in reused for r in turn), "no turn ended with EOS before another went on: the padding-after-EOS case is not exercised"
    assert stats["reused"] == 3 and stats["full"] == 0 and stats["why_not"] == {}, stats
    assert stats["cached_tokens"] > 2 * stats["encoded_tokens"] > 0, stats


def test_greedy_turns_from_the_cache_equal_a_full_prefill_every_turn():
    _check(_model())


def test_greedy_turns_from_the_cache_equal_a_full_prefill_with_lora():
    model = _lora(_model())  # get_peft_model wraps the model it is given in place: a fresh base to compare with
    assert transcripts(model, reuse=False) != transcripts(_model(), reuse=False), "the adapters change nothing"
    _check(model)


def test_a_prompt_that_extends_no_cached_row_is_encoded_whole():
    model = _model()
    rollout = HFGenerateRollout(model, _Tok(), fast=True)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0, n_samples_per_prompt=1)
    _reset()
    with rollout.weights():
        rollout.generate(_left_padded([[5, 6, 7], [8, 9]]), greedy)
        other = rollout.generate(_left_padded([[40, 41, 42, 43]]), greedy)  # not a continuation
    plain = HFGenerateRollout(model, _Tok(), fast=True).generate(_left_padded([[40, 41, 42, 43]]), greedy)
    assert torch.equal(other.input_ids, plain.input_ids)
    assert _stats()["why_not"] == {"a prompt that extends no row of the previous call": 1} and _stats()["reused"] == 0


@pytest.mark.extended  # a DeepSpeed process: suite budget
def test_zero3_turns_from_the_cache_equal_a_plain_models_full_prefills(tmp_path):
    """Real DeepSpeed ZeRO-3, 1 rank, ``stage3_param_persistence_threshold: 0``, after a training step: the turns
    inside one gathered ``weights()`` block, from the cache, equal a plain copy's turns with a full prefill each."""
    from conftest import REPO as repo, cpu_env, free_port, ok, run_python

    out = tmp_path / "z3.json"
    ok(run_python(["tests/test_tool_cache.py", str(out)], env=cpu_env(MASTER_PORT=str(free_port()),
                                                                       PYTHONPATH=str(repo))))
    assert json.loads(out.read_text()) == {"same_as_plain": True, "reused": 3, "partitioned_after": True}


def _zero3(out_path: str) -> None:
    import copy

    import deepspeed

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    base = _model().train()
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=ds, model_parameters=None)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with HFGenerateRollout(engine, _Tok(), gather=True, fast=True).weights():  # the same weights, a plain copy
        plain = copy.deepcopy(base)
        plain.load_state_dict({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    _reset()
    got = transcripts(engine, reuse=True)  # its own gathered weights() block, the turns from the cache
    stats = _stats()
    want = transcripts(plain.eval(), reuse=False)
    result = {"same_as_plain": got == want, "reused": stats["reused"],
              "partitioned_after": engine.module.get_output_embeddings().weight.data.numel() == 0}
    engine.destroy()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _zero3(sys.argv[1])
