"""One process, one rank, real DeepSpeed ZeRO-3 with ``stage3_param_persistence_threshold: 0`` (every parameter
partitioned, as a real model's layers are): ``python tests/zero3_generation.py OUT.json`` (used by
tests/test_rollout.py).

A tiny Llama engine trains one step, then generates through :class:`finetune.engine.rollout.HFGenerateRollout`
(``weights()`` + ``generate``, greedy, 2 completions of 2 prompts, 12 new tokens) while DeepSpeed's gathers are
counted: ``GatheredParameters`` gathers (``Init._all_gather`` calls) and module fetches by the ZeRO-3 hooks
(``PartitionedParameterCoordinator.fetch_sub_module``). Then it trains a second step (the hooks must be back: the
forward gathers, the backward computes gradients, the parameters are partitioned again). Writes ``{"gathers": int,
"fetches_in_generation": int, "resets_in_generation": int, "same_as_plain": bool, "fetches_in_training": int,
"partitioned_after": bool, "loss_finite": bool}``.

``python tests/zero3_generation.py OUT.json lora``: the same with a LoRA ``PeftModel`` as the engine's module (what
``grpo`` with ``beta > 0`` trains). ``resets_in_generation`` counts the coordinator's ``reset_step`` calls (DeepSpeed's
top-level forward pre-hook, which broadcasts while a prefetch trace is recorded: a rank that generates more turns
than another would broadcast more often and hang).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def main(out_path: str, lora: bool = False) -> None:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft import LoraConfig, get_peft_model

    from finetune.engine.rollout import HFGenerateRollout, RolloutRequest, SamplingConfig

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=128, pad_token_id=0, bos_token_id=2,
                                        eos_token_id=1))
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}
    model = copy.deepcopy(base)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(model, config)
    engine, *_ = deepspeed.initialize(model=model, config=ds,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    engine.train()
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))

    def train_step() -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    train_step()
    counts = {"gathers": 0, "fetches": 0, "resets": 0}
    gather, fetch = Init._all_gather, PartitionedParameterCoordinator.fetch_sub_module
    reset = PartitionedParameterCoordinator.reset_step

    def counted_reset(self, *a, **k):
        counts["resets"] += 1
        return reset(self, *a, **k)

    def counted_gather(self, *a, **k):
        counts["gathers"] += 1
        return gather(self, *a, **k)

    def counted_fetch(self, *a, **k):
        counts["fetches"] += 1
        return fetch(self, *a, **k)

    Init._all_gather, PartitionedParameterCoordinator.fetch_sub_module = counted_gather, counted_fetch
    PartitionedParameterCoordinator.reset_step = counted_reset
    prompts = RolloutRequest(torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0, n_samples_per_prompt=2)
    rollout = HFGenerateRollout(engine, _Tok(), gather=True, fast=True)
    with rollout.weights():
        out = rollout.generate(prompts, greedy)
        # the same weights in a plain model: the reference completions
        plain = copy.deepcopy(base)
        if lora:
            plain = get_peft_model(plain, config)
        plain.load_state_dict({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    in_generation = dict(counts)
    want = HFGenerateRollout(plain.eval(), _Tok(), fast=True).generate(prompts, greedy)
    counts.update(gathers=0, fetches=0, resets=0)
    loss = train_step()
    head = engine.module.get_output_embeddings().weight
    result = {"gathers": in_generation["gathers"], "fetches_in_generation": in_generation["fetches"],
              "resets_in_generation": in_generation["resets"],
              "same_as_plain": bool(torch.equal(out.input_ids, want.input_ids)),
              "fetches_in_training": counts["fetches"], "partitioned_after": head.data.numel() == 0,
              "loss_finite": bool(torch.isfinite(torch.tensor(loss)))}
    Init._all_gather, PartitionedParameterCoordinator.fetch_sub_module = gather, fetch
    PartitionedParameterCoordinator.reset_step = reset
    engine.destroy()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], lora=sys.argv[2:] == ["lora"])
