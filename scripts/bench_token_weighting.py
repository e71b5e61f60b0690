"""What token weighting costs: step time of ``train.loss_weighting=token`` vs ``micro_batch`` on the same run.

Token weighting adds, per optimizer step, counting the targets of each micro-batch and one all-reduce of a
scalar (``finetune.training.trainer.fit``). This launches the real toolkit (``deepspeed`` launcher, CPU ranks by
default) with both settings, alternating ``token, micro_batch, token, micro_batch, ...`` so that drifting
machine load hits both alike, and prints the median step time of each and their ratio.

Step time comes from the loop's own ``train/tokens_per_s`` (non-pad tokens of all ranks over the wall time
of the step, logged every step with ``train.log_every=1``): both settings train on exactly the same batches,
so ``1 / tokens_per_s`` (seconds per token) is proportional to the step time with the same factor in both,
and the ratio of medians is the ratio of step times. With packing (the shipped config) every position is a
token, so the step time is ``micro x accumulation x ranks x max_seq_len / tokens_per_s``. The first
``--skip`` steps (warm-up) are left out; eval and checkpointing happen outside the timed steps.

Usage (from the repository root)::

    python scripts/bench_token_weighting.py                        # shipped GPT config, 2 ranks, 40 steps, 2 repeats
    python scripts/bench_token_weighting.py --repeats 3 --steps 60 train.micro_batch_size=4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import launch, read_metrics  # noqa: E402  (free master port per launch, CPU environment)

CONFIG = REPO / "finetune" / "recipes" / "configs" / "gpt_clm_wikitext2.yaml"


def seconds_per_token(run_dir: Path, skip: int) -> list[float]:
    """``1 / train/tokens_per_s`` of every logged step after the first ``skip``: wall seconds per trained token."""
    rates = [r["train/tokens_per_s"] for r in read_metrics(run_dir) if "train/tokens_per_s" in r]
    return [1.0 / rate for rate in rates[skip:]]


def describe(sec_per_token: float, tokens_per_step: int | None) -> str:
    text = f"{1e6 * sec_per_token:7.2f} us/token"
    return text + (f" = {1e3 * sec_per_token * tokens_per_step:7.2f} ms/step" if tokens_per_step else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="run config (default: the shipped GPT-2 config)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per launch")
    p.add_argument("--repeats", type=int, default=2, help="launches per setting (alternating)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both settings")
    args = p.parse_args()

    from finetune.config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    t = cfg.train
    packed = cfg.recipe == "gpt_clm" and cfg.data.packing  # every position a token: tokens per step fixed
    tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * args.nproc * cfg.data.max_seq_len \
        if packed else None
    common = [f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=0", "train.eval_max_batches=1",
              "train.save_every=0", "export=false", *args.overrides]
    print(f"config {args.config}: {cfg.recipe}, micro {t.micro_batch_size} x accum {t.gradient_accumulation_steps} "
          f"x {args.nproc} ranks, max_seq_len {cfg.data.max_seq_len}, packing {cfg.data.packing}; "
          f"{args.steps} steps per launch, first {args.skip} not timed")

    times: dict[str, list[float]] = {"token": [], "micro_batch": []}  # seconds per token, per timed step
    with tempfile.TemporaryDirectory(prefix="bench_tw_") as tmp:
        for rep in range(args.repeats):
            for mode in times:
                out = Path(tmp) / f"{mode}-{rep}"
                t0 = time.perf_counter()
                proc = launch(args.config, [*common, f"train.loss_weighting={mode}", f"output_dir={out}"],
                              nproc=args.nproc, timeout=1800)
                if proc.returncode != 0:
                    print(proc.stdout[-4000:], file=sys.stderr)
                    print(f"launch failed ({mode}, repeat {rep}): exit {proc.returncode}", file=sys.stderr)
                    return 1
                steps = seconds_per_token(out, args.skip)
                times[mode] += steps
                print(f"  repeat {rep} {mode:11s}: median {describe(statistics.median(steps), tokens_per_step)} "
                      f"(launch {time.perf_counter() - t0:.0f} s)")

    med = {mode: statistics.median(v) for mode, v in times.items()}
    for mode in times:
        print(f"{mode:11s}: median {describe(med[mode], tokens_per_step)} over {len(times[mode])} steps")
    print(f"step time ratio token / micro_batch = {med['token'] / med['micro_batch']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
