"""The sentence-transformers contender of ``scripts/bench.py`` for the ``embed`` preset (launched by it under
``deepspeed``).

Written as a user of sentence-transformers writes it: ``datasets`` reads the parquet pairs, ``SentenceTransformer``
loads the model folder (its ``modules.json``: Transformer, Pooling, Normalize), ``MultipleNegativesRankingLoss``
(with both directions, sentence-transformers 6's symmetric form, when the spec says symmetric) with ``gather_across_devices`` as the
variant says (``defaults``: off, sentence-transformers' default; ``gather``: on, every rank's positives as
negatives, the toolkit's default; ``gather_nodup``: on, and batches drawn by ``BatchSamplers.NO_DUPLICATES``, no text
twice in a rank's micro-batch: sentence-transformers' way to keep a repeated positive from being a negative), and
``SentenceTransformerTrainer(args=SentenceTransformerTrainingArguments(deepspeed=<dict>))`` trains with the spec's
batch layout, ZeRO stage, optimizer (torch AdamW), schedule, seed and steps. The model's ``max_seq_length`` is the run config's ``data.max_seq_len``.

Measured, per rank, into ``<out>/rank<r>.json``: the wall time at the end of each optimizer step, the non-pad tokens
and positions of each collated micro-batch (every column's), and (rank 0) the logged loss of each step; after
training (not timed), rank 0 embeds the validation pairs with ``model.encode`` and scores them with the toolkit's
own metric functions (``finetune.recipes.embed.retrieval``, ``spearman``), so both sides are scored alike.
This file is a benchmark contender only: the ``finetune`` package never imports sentence-transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_records import leave, step_meter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="JSON spec written by scripts/bench.py")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args()
    spec = json.loads(Path(args.spec).read_text())

    import datasets
    import torch
    import transformers
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", 0))
    half = spec["precision"]
    targs = SentenceTransformerTrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], max_steps=spec["steps"],
        learning_rate=spec["lr"], weight_decay=spec["weight_decay"], warmup_steps=spec["warmup_steps"],
        lr_scheduler_type=spec["lr_scheduler"], max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        logging_steps=spec.get("log_every", 1), save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, bf16=half == "bf16", fp16=half == "fp16", deepspeed=spec["hf_deepspeed"],
        use_cpu=not torch.cuda.is_available(),
        batch_sampler=BatchSamplers.NO_DUPLICATES if spec["variant"] == "gather_nodup" else BatchSamplers.BATCH_SAMPLER)
    columns = [spec["anchor_column"], spec["positive_column"]] + ([spec["negative_column"]]
                                                                   if spec["negative_column"] else [])
    data_start = time.time()
    with targs.main_process_first(desc="dataset"):
        raw = datasets.load_dataset("parquet", data_files=spec["train_files"], split="train",
                                    cache_dir=spec.get("hf_cache") or str(out.parent / "hf-datasets"))
        if spec.get("max_train_rows"):
            raw = raw.select(range(min(spec["max_train_rows"], len(raw))))
        train = raw.select_columns(columns)
    data_seconds = time.time() - data_start

    torch.manual_seed(spec["seed"])
    model = SentenceTransformer(spec["model"], device="cuda" if torch.cuda.is_available() else "cpu",
                                model_kwargs={"dtype": torch.float32}, local_files_only=True)
    model.max_seq_length = spec["max_seq_len"]
    symmetric = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"} \
        if spec["embed"]["symmetric"] else {}  # sentence-transformers 6's form of MultipleNegativesSymmetricRankingLoss
    loss = MultipleNegativesRankingLoss(model, scale=spec["embed"]["scale"],
                                        gather_across_devices=spec["variant"] != "defaults", **symmetric)

    counts: list[tuple[int, int]] = []  # (non-pad tokens, positions) of each collated micro-batch, in order
    step_ends: list[float] = []
    step_cpu: list[float] = []
    losses: dict[int, float] = {}

    trainer = SentenceTransformerTrainer(model=model, args=targs, train_dataset=train, loss=loss,
                                         callbacks=[step_meter(step_ends, step_cpu, losses)])

    class Counting:  # sentence-transformers' collator, counting what it collates (its attributes read through)
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, rows):
            batch = self.inner(rows)
            masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
            counts.append((sum(int(m.sum()) for m in masks), sum(int(m.numel()) for m in masks)))
            return batch

    trainer.data_collator = Counting(trainer.data_collator)
    trainer.train()
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    heldout = None
    if rank == 0 and spec.get("validation_files"):  # not timed: the toolkit's metrics on model.encode's embeddings
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import torch.nn.functional as F

        from finetune.recipes.embed import retrieval, spearman

        dev = datasets.load_dataset("parquet", data_files=spec["validation_files"], split="train",
                                    cache_dir=spec.get("hf_cache") or str(out.parent / "hf-datasets"))
        model.eval()
        a = model.encode(dev[spec["anchor_column"]], convert_to_tensor=True, batch_size=64).cpu()
        p = model.encode(dev[spec["positive_column"]], convert_to_tensor=True, batch_size=64).cpu()
        if spec["score_column"]:
            score = torch.tensor(dev[spec["score_column"]], dtype=torch.float64)
            queries = torch.nonzero(score >= spec["embed"]["relevant_score"] - 1e-9).flatten()
        else:
            score, queries = None, torch.arange(len(a))
        heldout = retrieval(a[queries], p, queries)
        if score is not None:
            heldout["spearman"] = spearman(F.cosine_similarity(a, p, dim=-1), score)
        heldout["accuracy"] = heldout["ndcg_at_10"]
    (out / f"rank{rank}.json").write_text(json.dumps({"step_ends": step_ends, "step_cpu": step_cpu, "counts": counts,
                                                      "losses": losses, "gpu_max_allocated": peak_gpu,
                                                      "heldout": heldout, "data_seconds": data_seconds}))
    leave()

if __name__ == "__main__":
    main()
