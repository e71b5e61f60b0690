"""The TRL ``DPOTrainer`` + DeepSpeed contender of ``scripts/bench.py --preset dpo`` (run by it under ``deepspeed``).

Written as a TRL user writes it: ``datasets`` reads the parquet pairs (``prompt``/``chosen``/``rejected`` text
columns, TRL's standard form), ``DPOTrainer(model, args=DPOConfig(...), train_dataset=...,
processing_class=tokenizer)`` with the reference a copy of the initial model (what TRL loads from the model's path
when given none; TRL runs it on every batch, its default ``precompute_ref_log_probs=False``) trains with the
``sigmoid`` loss. Model (config + overrides, random init from the seed), ``max_length`` (= our ``data.max_seq_len``, TRL's default ``keep_start`` truncation, as ours
cuts the end), micro batch x accumulation, ZeRO stage, precision, optimizer (torch AdamW), schedule, ``beta``,
seed and number of steps come from the same spec as the toolkit's run (``--spec``, written by
``scripts/bench.py``). TRL's own default ``disable_dropout=True`` matches the recipe's dropout-free policy.

Measured, per rank, into ``<out>/rank<r>.json``: the wall time at the end of each optimizer step (Unix seconds), the
non-pad tokens and positions of each collated micro-batch (chosen and rejected sequences: TRL's collator stacks
them as ours does), (rank 0) the logged loss and ``rewards/accuracies`` of each step, and TRL's reference
log-probabilities of the first 4 pairs. The model starts from the weights ``finetune`` builds for a scratch model
(``no_init_weights`` + ``init_weights`` after the seed), so both sides have the same reference. Benchmark contender only:
the ``finetune`` package never imports TRL.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="JSON spec written by scripts/bench.py")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args()
    spec = json.loads(Path(args.spec).read_text())

    import datasets
    import torch
    import transformers
    from transformers import AutoConfig, TrainerCallback
    from transformers.initialization import no_init_weights
    from trl import DPOConfig, DPOTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", 0))
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"], local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    raw = datasets.load_dataset("parquet", data_files=spec["train_files"], split="train",
                                cache_dir=str(out.parent / "hf-datasets"))
    if spec.get("max_train_rows"):
        raw = raw.select(range(min(spec["max_train_rows"], len(raw))))
    columns = {spec["prompt_column"] or "prompt": "prompt", spec["chosen_column"]: "chosen",
               spec["rejected_column"]: "rejected"}
    raw = raw.select_columns(list(columns)).rename_columns({k: v for k, v in columns.items() if k != v})
    config = AutoConfig.from_pretrained(spec["model"], local_files_only=True)
    for k, v in spec["config_overrides"].items():
        setattr(config, k, v)
    torch.manual_seed(spec["seed"])
    with no_init_weights():  # the initial weights of finetune's scratch model (finetune.engine.model.scratch_model), so
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # both references agree
    model.init_weights()
    # TRL reloads the reference from the model's path when none is given; a model built from a config has none, so
    # the reference is handed over as TRL would load it: a copy of the initial weights (frozen and run by TRL)
    reference = copy.deepcopy(model)

    counts: list[tuple[int, int]] = []  # (non-pad tokens, positions) of each collated micro-batch, in order
    step_ends: list[float] = []
    step_cpu: list[float] = []
    losses: dict[int, float] = {}
    accuracies: dict[int, float] = {}

    class Meter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.time())
            step_cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])
            if logs and "rewards/accuracies" in logs:
                accuracies[state.global_step] = float(logs["rewards/accuracies"])

    half = spec["precision"]
    dargs = DPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], max_steps=spec["steps"],
        learning_rate=spec["lr"], weight_decay=spec["weight_decay"], warmup_steps=spec["warmup_steps"],
        lr_scheduler_type=spec["lr_scheduler"], max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        logging_steps=spec.get("log_every", 1), save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, bf16=half == "bf16", fp16=half == "fp16",
        deepspeed=spec["hf_deepspeed"], use_cpu=not torch.cuda.is_available(), beta=spec["dpo_beta"],
        loss_type=["sigmoid"], max_length=spec["max_seq_len"])
    trainer = DPOTrainer(model=model, ref_model=reference, args=dargs, train_dataset=raw, processing_class=tokenizer,
                         callbacks=[Meter()])
    collate = trainer.data_collator

    def counting_collate(rows):
        batch = collate(rows)
        mask = batch["attention_mask"]
        counts.append((int(mask.sum()), int(mask.numel())))
        return batch

    # TRL's own reference log-probabilities of the first pairs (its compute_ref_log_probs on its collated batch),
    # for scripts/bench.py to compare with finetune's cached ones
    first = collate([trainer.train_dataset[i] for i in range(min(4, len(trainer.train_dataset)))])
    chosen, rejected = trainer.compute_ref_log_probs(trainer.ref_model, first)
    reference_first = [[float(c), float(r)] for c, r in zip(chosen.tolist(), rejected.tolist())]
    trainer.data_collator = counting_collate
    trainer.train()
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    (out / f"rank{rank}.json").write_text(json.dumps({"step_ends": step_ends, "step_cpu": step_cpu, "counts": counts,
                                                      "losses": losses, "reward_accuracies": accuracies,
                                                      "reference_logps_first": reference_first,
                                                      "gpu_max_allocated": peak_gpu}))
    # as scripts/bench_hf.py: leave without the interpreter's teardown of gloo's threads, after a last barrier
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
