"""The error of ``train.distill.cache_top_k``: the divergence and the student's gradient from the teacher's top-k
against those from its whole distribution, on a distillation run config's validation rows.

Runs in one process, no DeepSpeed: the run config's student (``--student``: a model folder, e.g. a distilled export;
default ``model.path``) and teacher (``train.distill.teacher``), the config's tokenization and collator, the recipe's
own ``forward`` with and without the cached arrays (:func:`finetune.recipes.distill.top_k` of the teacher's logits
at the trained positions). Prints, per k, the relative error of the summed divergence (``kd_loss``) and of the
gradient of the output head (its norm of the difference over the norm), over ``--batches`` micro-batches.

    python scripts/distill_topk_error.py --config finetune/recipes/configs/distill_gsm8k.yaml \
        --student runs/distill_gsm8k/<run>/export --k 1 4 16 64 256
"""

from __future__ import annotations

import argparse
import dataclasses

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--student", default="", help="student model folder (default: the config's model.path)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from finetune.config import load_run_config
    from finetune.data.dataset import load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import distill
    from finetune.recipes.common.targets import next_token_targets

    cfg = load_run_config(args.config, args.overrides)
    if args.student:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=args.student, init="pretrained"))
    recipe = distill.RECIPE
    tokenizer = load_tokenizer(cfg, recipe)
    splits = load_splits(recipe, tokenizer, cfg.data, cfg.train.seed)
    collator = recipe.make_collator(tokenizer, cfg.data)
    # no KV cache in either forward: transformers keeps packed examples apart only without one (an export's
    # config.json says use_cache: true)
    student = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, use_cache=False)
    teacher = AutoModelForCausalLM.from_pretrained(cfg.train.distill.teacher, dtype=torch.float32,
                                                   use_cache=False).eval()
    distill._TEACHER.update(engine=teacher)
    d = cfg.train.distill
    vocab = min(student.get_output_embeddings().out_features, teacher.get_output_embeddings().out_features)
    mb = cfg.train.micro_batch_size
    totals = {k: [0.0, 0.0, 0.0] for k in args.k}  # |kd - kd_exact|, |grad - grad_exact|^2, |grad_exact|^2
    exact_kd = 0.0
    for i in range(args.batches):
        batch = collator([dict(splits.validation[j]) for j in range(i * mb, (i + 1) * mb)])
        keep = next_token_targets(batch) != -100
        with torch.no_grad():
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
            logits = teacher(**inputs).logits[keep].float()

        def run(cached):
            student.zero_grad()
            b = dict(batch)
            if cached is not None:
                b["teacher_topk_ids"], b["teacher_topk_logps"] = cached
            out = distill.forward(student, b, settings=dataclasses.replace(d, alpha=1.0))
            out.loss_sum.backward()
            return out.metrics["kd_loss"][0].item(), student.get_output_embeddings().weight.grad.clone()

        kd, grad = run(None)
        exact_kd += kd
        for k in args.k:
            kd_k, grad_k = run(distill.top_k(logits, k, d.temperature, vocab))
            totals[k][0] += abs(kd_k - kd)
            totals[k][1] += float((grad_k - grad).norm() ** 2)
            totals[k][2] += float(grad.norm() ** 2)
    print(f"{'k':>6}  {'divergence error':>17}  {'head gradient error':>20}   ({args.batches} batches of {mb} rows, "
          f"{d.loss} at temperature {d.temperature:g}, vocabulary {vocab:,})")
    for k, (kd_err, g_err, g_norm) in totals.items():
        print(f"{k:>6}  {kd_err / exact_kd:>17.2%}  {(g_err / g_norm) ** 0.5:>20.2%}")


if __name__ == "__main__":
    main()
