"""The TRL contenders of ``scripts/bench.py``'s ``dpo``, ``dpo_realistic`` and ``reward`` presets (run by it under
``deepspeed``): TRL's ``DPOTrainer`` or ``RewardTrainer`` + DeepSpeed.

Written as a TRL user writes it: ``datasets`` reads the parquet pairs (``prompt``/``chosen``/``rejected`` text
columns, TRL's standard form), ``DPOTrainer(model, args=DPOConfig(...), train_dataset=..., processing_class=tokenizer)``
(or ``RewardTrainer`` / ``RewardConfig``). Model (config + overrides, random init from the seed), ``max_length``
(= our ``data.max_seq_len``; DPO: TRL's default ``keep_start`` truncation, as ours cuts the end; reward: TRL drops
longer pairs), micro batch x accumulation, ZeRO stage, precision, optimizer (torch AdamW), schedule, ``beta``, seed
and number of steps come from the same spec as the toolkit's run (``--spec``, written by ``scripts/bench.py``).
TRL's own default ``disable_dropout=True`` matches the recipes' dropout-free policy. The spec's ``variant``:

* ``defaults`` (contender ``trl``): TRL's defaults. DPO: the reference is a copy of the initial model (what TRL
  loads from the model's path when given none) run on every batch (``precompute_ref_log_probs=False``), gradient
  checkpointing on (``DPOConfig``'s and ``RewardConfig``'s default), random order.
* ``best`` (contender ``trl_best``): every speed option of TRL 1.16 that applies here.
  ``precompute_ref_log_probs=True`` with no reference model: TRL computes the reference log-probabilities of the
  training pairs once before training with the policy's initial weights (``precompute_ref_batch_size`` = the micro
  batch, as ours) and keeps no second model; ``gradient_checkpointing`` as the toolkit's run (off by default);
  length grouping (``train_sampling_strategy="group_by_length"``, transformers' ``LengthGroupedSampler``, per
  rank) on a ``length`` column (prompt + the longer completion; DPO; chosen + rejected tokens for reward) added
  to TRL's tokenized dataset, which has no ``input_ids`` column for the sampler to measure. Not applicable in TRL
  1.16: ``padding_free`` (disabled since its DPO refactor: it warns and pads; FlashAttention only, which CPUs
  lack), ``use_logits_to_keep`` (no longer a ``DPOConfig`` option in 1.16; only GRPO keeps logits of the
  completion), ``use_liger_kernel`` (deprecated; Triton kernels, GPUs only).

Measured, per rank, into ``<out>/rank<r>.json``: the wall time at the end of each optimizer step (Unix seconds), the
non-pad tokens and positions of each collated micro-batch (DPO: chosen and rejected sequences, stacked as ours;
reward: the same), (rank 0) the logged loss, ``rewards/accuracies`` (DPO) or ``accuracy`` (reward) of each step,
(``defaults``, DPO) TRL's reference log-probabilities of the first 4 pairs and (reward) the held-out accuracy of
``trainer.evaluate`` on the validation pairs after training (not timed). The model starts from the weights
``finetune`` builds for a scratch model (``no_init_weights`` + ``init_weights`` after the seed), so both sides have
the same reference. Benchmark contender only: the ``finetune`` package never imports TRL.
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

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", 0))
    reward = spec["recipe"] == "reward"
    best = spec.get("variant", "defaults") == "best"
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"], local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # the datasets cache (tokenized pairs and TRL's precomputed reference) per launch: each launch pays TRL's own
    # preparation, as the toolkit's launch pays its reference pass (bench.py removes its cached one per launch)
    cache = str(out / "hf-datasets")
    columns = {spec["prompt_column"] or "prompt": "prompt", spec["chosen_column"]: "chosen",
               spec["rejected_column"]: "rejected"}

    def pairs(files: list[str], limit: int = 0):
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
        if limit:
            ds = ds.select(range(min(limit, len(ds))))
        return ds.select_columns(list(columns)).rename_columns({k: v for k, v in columns.items() if k != v})

    raw = pairs(spec["train_files"], spec.get("max_train_rows") or 0)
    config = AutoConfig.from_pretrained(spec["model"], local_files_only=True)
    for k, v in spec["config_overrides"].items():
        setattr(config, k, v)
    auto = transformers.AutoModelForSequenceClassification if reward else transformers.AutoModelForCausalLM
    torch.manual_seed(spec["seed"])
    with no_init_weights():  # the initial weights of finetune's scratch model (finetune.engine.model.scratch_model), so
        model = auto.from_config(config, dtype=torch.float32)  # both references agree
    model.init_weights()

    counts: list[tuple[int, int]] = []  # (non-pad tokens, positions) of each collated micro-batch, in order
    step_ends: list[float] = []
    step_cpu: list[float] = []
    losses: dict[int, float] = {}
    accuracies: dict[int, float] = {}
    accuracy_key = "accuracy" if reward else "rewards/accuracies"

    class Meter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.time())
            step_cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])
            if logs and accuracy_key in logs:
                accuracies[state.global_step] = float(logs[accuracy_key])

    half = spec["precision"]
    common = dict(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["micro_batch_size"],
        per_device_eval_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], max_steps=spec["steps"],
        learning_rate=spec["lr"], weight_decay=spec["weight_decay"], warmup_steps=spec["warmup_steps"],
        lr_scheduler_type=spec["lr_scheduler"], max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        logging_steps=spec.get("log_every", 1), save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, bf16=half == "bf16", fp16=half == "fp16",
        deepspeed=spec["hf_deepspeed"], use_cpu=not torch.cuda.is_available(), max_length=spec["max_seq_len"])
    if best:  # checkpointing as the toolkit's run; length-grouped batches (on the ``length`` column added below)
        # (remove_unused_columns=False keeps that column, which is no model input, for the sampler; TRL's collators
        # read their own keys only)
        common.update(gradient_checkpointing=bool(spec.get("gradient_checkpointing")),
                      train_sampling_strategy="group_by_length", remove_unused_columns=False)
    if reward:
        from trl import RewardConfig, RewardTrainer

        # the held-out pairs are tokenized (and filtered by length) with the training pairs, evaluated after training
        held = pairs(spec["validation_files"]) if spec.get("validation_files") else None
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=raw, eval_dataset=held,
                                processing_class=tokenizer, callbacks=[Meter()])
    else:
        from trl import DPOConfig, DPOTrainer

        dargs = DPOConfig(**common, beta=spec["dpo_beta"], loss_type=["sigmoid"], precompute_ref_log_probs=best)
        # TRL reloads the reference from the model's path when none is given; a model built from a config has none,
        # so the reference is handed over as TRL would load it: a copy of the initial weights (frozen and run by TRL
        # on every batch). With precompute_ref_log_probs, none: TRL runs the policy's initial weights once.
        reference = None if best else copy.deepcopy(model)
        trainer = DPOTrainer(model=model, ref_model=reference, args=dargs, train_dataset=raw,
                             processing_class=tokenizer, callbacks=[Meter()])
    if best:  # what LengthGroupedSampler measures (training and, for reward, evaluation): TRL's tokenized rows have
        # no input_ids column
        def with_length(ds):
            if reward:
                lengths = [len(c) + len(r) for c, r in zip(ds["chosen_ids"], ds["rejected_ids"])]
            else:
                lengths = [len(p) + max(len(c), len(r)) for p, c, r in
                           zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"])]
            return ds.add_column("length", lengths)

        trainer.train_dataset = with_length(trainer.train_dataset)
        if trainer.eval_dataset is not None:
            trainer.eval_dataset = with_length(trainer.eval_dataset)
    collate = trainer.data_collator

    def counting_collate(rows):
        batch = collate(rows)
        mask = batch["attention_mask"]  # chosen rows, then rejected rows (both of TRL's collators)
        counts.append((int(mask.sum()), int(mask.numel())))
        return batch

    reference_first = []
    if not reward and not best:
        # TRL's own reference log-probabilities of the first pairs (its compute_ref_log_probs on its collated batch),
        # for scripts/bench.py to compare with finetune's cached ones
        first = collate([trainer.train_dataset[i] for i in range(min(4, len(trainer.train_dataset)))])
        chosen, rejected = trainer.compute_ref_log_probs(trainer.ref_model, first)
        reference_first = [[float(c), float(r)] for c, r in zip(chosen.tolist(), rejected.tolist())]
    trainer.data_collator = counting_collate
    trainer.train()
    heldout = None
    if reward and trainer.eval_dataset is not None:  # after the timed steps
        trainer.data_collator = collate
        metrics = trainer.evaluate()
        heldout = {"accuracy": metrics.get("eval_accuracy"), "loss": metrics.get("eval_loss"),
                   "pairs": len(trainer.eval_dataset)}
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    (out / f"rank{rank}.json").write_text(json.dumps({"step_ends": step_ends, "step_cpu": step_cpu, "counts": counts,
                                                      "losses": losses, "reward_accuracies": accuracies,
                                                      "reference_logps_first": reference_first,
                                                      "heldout": heldout, "gpu_max_allocated": peak_gpu}))
    # as scripts/bench_hf.py: leave without the interpreter's teardown of gloo's threads, after a last barrier
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
