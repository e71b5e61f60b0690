"""Time to first step on a large text corpus: ``finetune`` (``data.num_proc``) vs Hugging Face Trainer with the
preprocessing of transformers' ``run_clm.py`` (one process), side by side in one run.

The corpus: the shipped WikiText-2 lines (``data/wikitext2/test.parquet`` and ``validation.parquet``, CC BY-SA 3.0)
repeated until the parquet file holds ``--corpus-mb`` MB of text (UTF-8 bytes of the text column), written in row
groups of 10,000 rows. Repeated lines tokenize as fast as new ones for both contenders (the same tokenizer, whose
word cache is bounded), so the ratio holds; the absolute MB/s is that of this tokenizer on this text.

The work: the ``gpt_clm`` preset of ``scripts/bench.py`` (the byte-level GPT-2 of ``data/models/gpt2-bytes``, packed
128-token blocks, micro batch 16, ZeRO-2, fp32, 2 CPU ranks) trained for ``--steps`` steps on the corpus. Each
contender is launched with ``deepspeed`` and timed from the launcher's start to the end of optimizer step 1:

* ``finetune cold``: a fresh cache (``FINETUNE_CACHE``), ``data.num_proc`` processes on local rank 0 while rank 1
  waits; ``finetune warm``: the same launch again (cache hit);
* ``prepare + launch``: ``finetune prepare --num-proc N`` on a fresh cache, then the launch (cache hit): the sum;
* ``hf cold``: ``scripts/bench_hf.py``: ``datasets.load_dataset("parquet")`` (its Arrow conversion), then
  ``run_clm.py``'s tokenize-and-``group_texts`` ``map`` in one process under ``main_process_first`` (rank 0 maps,
  rank 1 reads its cache), a fresh ``datasets`` cache; ``hf warm``: the same launch again (``datasets``' cache).

An untimed warm-up launch on the shipped data comes first (DeepSpeed's one-time builds of its CPU ops;
``--no-warm-up`` skips it for smoke runs). Also
printed: the data phase's seconds (finetune: the ``info.json`` of its entry; HF: load and map, timed in the
script), tokenization throughput per process (MB of text per second per process; finetune's multiplied by the
node's cores gives what a node would do), and the peak resident memory of each launch's largest process (``VmHWM``
of the rank processes and finetune's forked tokenizers, sampled every 0.2 s; for ``finetune prepare``, alone in the
JSON line as ``prepare_peak_mb``: its process and its tokenizers, the memory of tokenization alone). ``anon MB``:
the largest sampled ``RssAnon`` (finetune only), the resident memory without the file pages of memory-mapped
caches, which the kernel can drop and which grow with the corpus whenever a reader touches a cache file's pages.

Usage (from the repository root)::

    python scripts/bench_startup.py --corpus-mb 1024            # the issue's ~1 GB corpus
    python scripts/bench_startup.py --corpus-mb 256 --only finetune   # peak memory of ours on a smaller corpus
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: launches, peak memory, the HF contender)

REPO = bench.REPO


def build_corpus(path: Path, megabytes: float) -> tuple[int, int]:
    """Write ``path``: WikiText-2 lines repeated to ``megabytes`` MB of UTF-8 text; returns (rows, bytes)."""
    lines = []
    for f in ("test", "validation"):
        lines += [t for t in pq.read_table(REPO / "data" / "wikitext2" / f"{f}.parquet").column("text").to_pylist()
                  if t and t.strip()]
    target, rows, size = megabytes * 1e6, 0, 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        while size < target:
            chunk, i = [], 0
            while len(chunk) < 10_000 and size < target:
                text = lines[(rows + i) % len(lines)]
                chunk.append(text)
                size += len(text.encode())
                i += 1
            writer.write_table(pa.table({"text": pa.array(chunk, pa.string())}))
            rows += len(chunk)
    return rows, size


def first_step(out: Path, start: float) -> float:
    """Seconds from ``start`` to the end of step 1 in a finetune run folder's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["time"] for r in rows if r.get("step") == 1 and "train/loss" in r) - start


def ours(args, overrides: list[str], out: Path, env: dict) -> dict:
    cmd = bench.deepspeed_cmd(args, "finetune/run.py", "--config", bench.PRESETS["gpt_clm"]["config"], *overrides,
                              f"output_dir={out}")
    anon: dict = {}
    start, peaks = bench.run_launch(cmd, env, out.with_suffix(".log"), args.timeout, anon)
    entry = next(Path(env["FINETUNE_CACHE"]).glob("tokenized/gpt_clm-train-*"))
    info = json.loads((entry / "info.json").read_text())
    log = (out / "logs" / "rank0.log").read_text()
    return {"first_step_s": first_step(out, start), "peak_mb": max(peaks.values()) / 1024,
            "peak_anon_mb": max(anon.values()) / 1024,
            "data_s": info["seconds"] if "cache hit" not in log.split("validation:")[0] else None,
            "num_proc": info["num_proc"], "startup": next((line.split("| ")[-1] for line in log.splitlines()
                                                           if "start-up " in line), "")}


def prepare(args, overrides: list[str], env: dict, log: Path) -> tuple[float, float, float]:
    """``finetune prepare`` on ``env``'s cache: (seconds, peak MB of its largest process, itself or a tokenizer, peak
    anonymous MB likewise)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "finetune", "prepare", "--config",
                                 bench.PRESETS["gpt_clm"]["config"], *overrides, "--num-proc", str(args.num_proc)],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        meter = bench.PeakRSS(proc.pid, every_process=True)
        meter.start()
        try:
            code = proc.wait(timeout=args.timeout)
        finally:
            meter.done.set()
            meter.join()
    if code:
        raise RuntimeError(log.read_text()[-3000:])
    return time.time() - t0, max(meter.peaks.values(), default=0) / 1024, max(meter.anon.values(), default=0) / 1024


def hf(args, spec: dict, out: Path, env: dict, cache: Path) -> dict:
    record = bench.hf({**spec, "hf_cache": str(cache)}, "random", args, out, env)
    rank0 = json.loads((out / "rank0.json").read_text())
    return {"first_step_s": record["ends"][0] - record["start"], "peak_mb": max(record["peaks"].values()) / 1024,
            "peak_anon_mb": None,
            "data_s": rank0["data_seconds"], "num_proc": 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-mb", type=float, default=1024, help="MB of text in the corpus (default 1024)")
    p.add_argument("--num-proc", type=int, default=2, help="finetune's data.num_proc (default 2: the cores here)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per launch")
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--only", choices=["finetune", "hf"], default=None, help="run one contender")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per launch")
    p.add_argument("--keep", default="", help="folder to keep the corpus, caches and run folders in")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed warm-up launch (smoke runs: the "
                   "first contender's launch then pays DeepSpeed's one-time op builds, if any)")
    args = p.parse_args(argv)
    from finetune.config import load_run_config

    env = bench.environment(gpu=False)
    with tempfile.TemporaryDirectory(prefix="finetune_startup_") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        corpus = root / f"corpus-{args.corpus_mb:g}mb.parquet"
        t0 = time.time()
        rows, size = build_corpus(corpus, args.corpus_mb)
        print(f"corpus: {rows:,} rows, {size / 1e6:,.0f} MB of text in {corpus} ({time.time() - t0:.0f} s)", flush=True)
        overrides = [*bench.PRESETS["gpt_clm"]["overrides"], f"data.train_files=[{corpus}]",
                     "data.validation_files=[data/wikitext2/validation.parquet]", f"data.num_proc={args.num_proc}",
                     f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=0",
                     "train.eval_on_start=false", "train.save_every=0", "export=false", "train.sample_prompt=",
                     "train.precision=fp32"]
        spec = bench.hf_spec(load_run_config(REPO / bench.PRESETS["gpt_clm"]["config"], overrides), args.steps, "fp32")
        before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
        results: dict[str, dict] = {}
        if not args.no_warm_up:
            bench.warm_up(bench.PRESETS["gpt_clm"], [*bench.PRESETS["gpt_clm"]["overrides"],
                                                     "train.precision=fp32", "export=false",
                                                     "train.eval_on_start=false"], args, root / "warmup", env)
        try:
            if args.only in (None, "finetune"):
                cache = {**env, "FINETUNE_CACHE": str(root / "cache-launch")}
                results["finetune cold"] = ours(args, overrides, root / "ft-cold", cache)
                results["finetune warm"] = ours(args, overrides, root / "ft-warm", cache)
                prepared = {**env, "FINETUNE_CACHE": str(root / "cache-prepare")}
                seconds, prepare_peak, prepare_anon = prepare(args, overrides, prepared, root / "prepare.log")
                launch = ours(args, overrides, root / "ft-prepared", prepared)
                results["prepare + launch"] = {**launch, "first_step_s": seconds + launch["first_step_s"],
                                               "data_s": None, "prepare_s": seconds, "prepare_peak_mb": prepare_peak,
                                               "prepare_peak_anon_mb": prepare_anon}
            if args.only in (None, "hf"):
                results["hf cold"] = hf(args, spec, root / "hf-cold", env, root / "hf-cache")
                results["hf warm"] = hf(args, spec, root / "hf-warm", env, root / "hf-cache")
        finally:
            bench.clean_shm(before)
    print(f"\nstartup: gpt_clm packed, {size / 1e6:,.0f} MB corpus, {args.nproc} CPU ranks, finetune data.num_proc="
          f"{args.num_proc}\n{'contender':<18}{'1st step s':>11}{'data s':>9}{'MB/s/proc':>10}{'peak MB':>9}"
          f"{'anon MB':>9}")
    for name, r in results.items():
        rate = size / 1e6 / r["data_s"] / r["num_proc"] if r.get("data_s") else None
        print(f"{name:<18}{r['first_step_s']:>11.1f}{r['data_s'] or float('nan'):>9.1f}"
              f"{rate or float('nan'):>10.2f}{r['peak_mb']:>9.0f}{r['peak_anon_mb'] or float('nan'):>9.0f}")
    if "finetune cold" in results and "hf cold" in results:
        for phase in ("cold", "warm"):
            print(f"time to first step, hf {phase} / finetune {phase}: "
                  f"{results[f'hf {phase}']['first_step_s'] / results[f'finetune {phase}']['first_step_s']:.2f}x")
    for name, r in results.items():
        print(json.dumps({"bench": "startup", "contender": name, "corpus_mb": size / 1e6, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
