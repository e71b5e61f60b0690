"""One process, one rank, real DeepSpeed (``python tests/head_loss_zero.py OUT.json``; used by tests/test_head_loss.py).

For the ``bert_mlm`` (scratch BERT, head transform + decoder tied to the word embeddings) and ``gpt_clm`` (tiny
GPT-2, ``lm_head`` tied to ``wte``) recipes at ZeRO stages 0 and 3, with cross-entropy chunks forced down to 3 rows
(so every micro-batch runs several chunks: BERT's head checkpointed, recomputed in the backward pass; GPT-2's plain
``Linear`` head in ``lm_loss.LinearCrossEntropy``, its gradients computed in the forward pass): the recipe's
``forward`` on the engine against the textbook loss of a plain copy of the model (full logits, full softmax), one
micro-batch, same weights. ZeRO-3 runs with ``stage3_param_persistence_threshold: 0``: every parameter is
partitioned, so the head runs only if DeepSpeed's module hooks gather it, in the forward and again for the
recomputation in the backward. Writes ``{case: {"loss": [engine, textbook], "grad_diff": max abs,
"grad_scale": max abs textbook grad, "partitioned": bool, "chunks": int, "in_forward": calls of
LinearCrossEntropy}}``.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def models():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(f"{REPO}/data/models/bert-small")
    for k, v in dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0).items():
        setattr(cfg, k, v)
    bert = AutoModelForMaskedLM.from_config(cfg)
    gpt = AutoModelForCausalLM.from_pretrained(f"{REPO}/data/models/tiny-gpt2", resid_pdrop=0.0, embd_pdrop=0.0,
                                               attn_pdrop=0.0)
    return {"bert_mlm": bert, "gpt_clm": gpt}


def batch(recipe: str, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    if recipe == "bert_mlm":
        labels = torch.full_like(ids, -100)
        chosen = torch.rand(ids.shape, generator=g) < 0.4
        labels[chosen] = ids[chosen]
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def textbook(recipe: str, model, b: dict) -> tuple[float, dict]:
    model.zero_grad()
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
    labels = b["labels"]
    if recipe == "gpt_clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def main(out_path: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from finetune.recipes import get_recipe, lm_loss

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = {}
    for name, base in models().items():
        recipe = get_recipe(name)
        b = batch(name, base.config.vocab_size)
        want_loss, want_grads = textbook(name, copy.deepcopy(base).train(), b)
        for stage in (0, 3):
            ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "steps_per_print": 10**9}
            engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=ds,
                                              model_parameters=None)
            engine.train()
            head_weight = engine.module.get_output_embeddings().weight
            partitioned = head_weight.data.numel() == 0  # ZeRO-3: released until a module hook gathers it
            default_chunk = lm_loss.LOGITS_CHUNK_ELEMENTS
            lm_loss.LOGITS_CHUNK_ELEMENTS = 3 * base.config.vocab_size  # 3 rows per chunk
            n = int(recipe.count_targets(b))
            calls, fused = [], lm_loss.LinearCrossEntropy.apply
            lm_loss.LinearCrossEntropy.apply = lambda *a: (calls.append(1), fused(*a))[1]
            out = recipe.forward(engine, dict(b))
            lm_loss.LinearCrossEntropy.apply = fused
            engine.backward(out.loss_sum)
            grads = {n_: safe_get_full_grad(p).detach().float().clone() for n_, p in engine.module.named_parameters()}
            results[f"{name}-z{stage}"] = {
                "loss": [out.loss_sum.item(), want_loss], "targets": [int(out.targets), n],
                "grad_diff": max((grads[k] - want_grads[k]).abs().max().item() for k in want_grads),
                "grad_scale": max(g.abs().max().item() for g in want_grads.values()),
                "partitioned": partitioned, "chunks": -(-n // 3),
                "in_forward": len(calls)}
            lm_loss.LOGITS_CHUNK_ELEMENTS = default_chunk
            engine.destroy()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
