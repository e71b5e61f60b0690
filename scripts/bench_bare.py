"""The bare-loop contender of ``scripts/bench.py``: ``engine(batch) / backward / step`` on pre-collated batches.

Launched by ``scripts/bench.py`` under ``deepspeed`` with the toolkit run's config and overrides. It builds
exactly what ``finetune/run.py`` builds (resolved DeepSpeed config, recipe, and through the same functions the
tokenized rows from the same cache, the length-grouped loader and the engine), but then draws every micro-batch of
the run from the loader up front, moves them to the device, all-reduces each step's target count in one
collective, and only then times a loop with nothing
but the work itself::

    for step:                                  # the timed loop
        for batch in step's micro-batches:
            loss = recipe.forward(engine, batch).loss_sum / denominator[step]
            engine.backward(loss)
            engine.step()
        step_ends.append(time.time())

No data loading, no per-step collective of ours, no metrics, no logging, checkpointing or stop checks: what it
leaves out is the toolkit loop's overhead (``scripts/bench.py`` prints the ratio). The batches, model, loss and
optimizer steps are the toolkit's, so the losses match its run.

Measured, per rank, into ``<out>/rank<r>.json`` (the format of ``scripts/bench_hf.py``): the wall time at the
end of each optimizer step (Unix seconds), the non-pad tokens and positions of each micro-batch, and (rank 0)
each step's global-batch loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="folder for rank<r>.json")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import torch

    from finetune.data import dataset as data_utils
    from finetune.parallel import distributed as dist_utils
    from finetune.lifecycle import health
    from finetune.config import load_run_config
    from finetune.engine.ds_config import resolve_ds_config
    from finetune.engine.model import build_engine, load_model_config, load_tokenizer
    from finetune.data.batch import real_tokens
    from finetune.recipes import get_recipe
    from finetune.data.batch import to_device

    cfg = load_run_config(args.config, args.overrides)
    dist_utils.export_rank_env()
    world, rank = dist_utils.world_size(), dist_utils.rank()
    ds, problems = resolve_ds_config(cfg, world, on_cpu=not torch.cuda.is_available())  # before the process group
    if problems:
        raise SystemExit("\n".join(problems))
    dist_utils.init(cfg.train.dist_timeout_minutes)
    ds.pop("tensorboard", None)
    recipe = get_recipe(cfg.recipe)
    tokenizer = load_tokenizer(cfg, recipe)
    data = data_utils.build_train_data(recipe, cfg, tokenizer)  # as finetune/commands/train.py: same rows, sampler, collator
    t = cfg.train
    gas, steps, loader = t.gradient_accumulation_steps, data.total_steps, data.train_loader
    loader.sampler.set_epoch(0, skip=0)
    loader.collate_fn.set_epoch(0)
    health.prepare_host_memory(dist_utils.on_cpu())  # as finetune/commands/train.py before the model
    built = build_engine(cfg, recipe, load_model_config(cfg, recipe), ds, steps)
    engine = built.engine
    device = engine.device
    it = iter(loader)  # after the engine, as the toolkit's loop does (the same global RNG draws: dropout)
    micro = [to_device(next(it), device) for _ in range(steps * gas)]  # one epoch covers the bench's steps
    counts = [(int(real_tokens(b)), b["input_ids"].numel()) for b in micro]  # (non-pad tokens, positions)
    targets = torch.stack([recipe.count_targets(b) for b in micro]).view(steps, gas).sum(1)
    denominators = dist_utils.all_reduce_sum(targets.to(device, torch.float32)).clamp(min=1.0) / (world * gas)
    losses = torch.zeros(steps, dtype=torch.float64, device=device)
    dist_utils.barrier()

    engine.train()
    step_ends: list[float] = []
    step_cpu: list[float] = []  # this process's CPU seconds at each step's end (gloo waits sleep: not counted)
    for s in range(steps):
        for i in range(gas):
            out = recipe.forward(engine, micro[s * gas + i])
            loss = out.loss_sum / denominators[s]
            engine.backward(loss)
            engine.step()
            losses[s] += loss.detach().double() / gas
        step_ends.append(time.time())
        step_cpu.append(time.process_time())

    losses = dist_utils.all_reduce_sum(losses) / world
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "step_ends": step_ends, "step_cpu": step_cpu, "counts": counts, "gpu_max_allocated": peak_gpu,
        "losses": {str(s + 1): v for s, v in enumerate(losses.tolist())}}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
