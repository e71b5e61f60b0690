"""Packed rows under ``sdpa`` without crossing examples: which way is fastest and smallest, side by side.

A packed row of ``S`` tokens holds several examples whose ``position_ids`` restart; each token may attend only to
earlier tokens of its own example. Three ways to compute that attention (forward + backward, fp32, one row,
``--heads`` query heads of 64 dimensions, examples of 64-1024 tokens drawn from ``--seed``):

* ``dense_mask``: ``sdpa`` with a ``[1, 1, S, S]`` boolean block-diagonal causal mask, what transformers'
  ``masking_utils`` builds from restarting ``position_ids`` (and what ``finetune`` built under sequence
  parallelism before); the mask keeps sdpa off its flash kernel;
* ``per_example``: ``finetune.parallel.sequence.packed_sdpa``, the path ``finetune`` takes: each example attended
  on its own with causal ``sdpa`` and no mask, outputs joined;
* ``flex``: PyTorch's ``flex_attention`` with a document ``BlockMask`` (``create_block_mask``; what DeepSpeed's
  Ulysses accepts for ``flex_attention``), compiled with ``torch.compile`` as PyTorch requires for its fused
  kernel (the first call, which compiles, is not timed). PyTorch has no backward of it on CPUs
  (``NotImplementedError``, reported as the row's failure): measured on GPUs only.

Each (way, length) runs in a fresh process: the time is the median of ``--repeats`` forward + backward passes
after one warm-up, the memory the largest growth of the resident set during those passes over the set before them
(CPU: ``/proc/self/statm`` sampled every millisecond by a thread; the inputs and any compiled code are in the
baseline) or ``torch.cuda.max_memory_allocated`` over the allocated memory before them (GPU). Prints a table and one JSON line per measurement.

Usage (from the repository root)::

    python scripts/bench_packed_attention.py                       # lengths 2048 4096 16384, 3 repeats
    python scripts/bench_packed_attention.py --lengths 1024 8192 --ways per_example flex
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAYS = ("dense_mask", "per_example", "flex")


def example_lengths(total: int, seed: int) -> list[int]:
    """Lengths of 64-1024 tokens (seeded) that add up to ``total``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(64, 1025, (1,), generator=g)))
        out.append(n)
        left -= n
    return out


def measure(way: str, length: int, heads: int, repeats: int, seed: int) -> dict:
    """One (way, length) in this process: median seconds of forward + backward, peak memory growth in MiB."""
    import threading

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sys.path.insert(0, str(REPO))
    from finetune.parallel.sequence import packed_sdpa

    torch.manual_seed(seed)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    lengths = example_lengths(length, seed)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(device)
    q, k, v = (torch.randn(1, heads, length, 64, device=device, requires_grad=True) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True

    if way == "dense_mask":
        def attend():
            idx = torch.arange(length, device=device)
            mask = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])
            return sdpa_attention_forward(module, q, k, v, mask[None, None])[0]
    elif way == "per_example":
        packed = packed_sdpa(sdpa_attention_forward)

        def attend():
            return packed(module, q, k, v, None, position_ids=pos)[0]
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(document_causal, None, None, length, length, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def attend():
            return compiled(q, k, v, block_mask=block_mask).transpose(1, 2)

    def step() -> float:
        start = time.perf_counter()
        out = attend()
        out.sum().backward()
        if gpu:
            torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    step()  # warm-up (flex: compiles)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * page

    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.001)

    if gpu:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss()
        meter = threading.Thread(target=sample, daemon=True)
        meter.start()
    times = [step() for _ in range(repeats)]
    if gpu:
        grown = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        done.set()
        meter.join()
        grown = (peak[0] - base) / 2**20
    return {"way": way, "length": length, "examples": len(lengths), "heads": heads, "device": device,
            "seconds": statistics.median(times), "peak_mib": round(grown, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 16384])
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one", nargs=2, metavar=("WAY", "LENGTH"), help=argparse.SUPPRESS)  # a child process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.heads, args.repeats, args.seed)))
        return 0
    rows = []
    for length in args.lengths:
        for way in args.ways:
            proc = subprocess.run([sys.executable, __file__, "--one", way, str(length), "--heads", str(args.heads),
                                   "--repeats", str(args.repeats), "--seed", str(args.seed)],
                                  capture_output=True, text=True, cwd=REPO, env={**os.environ})
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not line:
                why = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
                rows.append({"way": way, "length": length, "error": why[-1][-300:]})
            else:
                rows.append(json.loads(line[-1]))
            print(json.dumps({"bench": "packed_attention", **rows[-1]}), flush=True)
    print(f"\n{'length':>8} {'way':<12} {'examples':>8} {'fwd+bwd s':>10} {'peak MiB':>9} {'vs per_example':>15}")
    for r in rows:
        if "error" in r:
            print(f"{r['length']:>8} {r['way']:<12} failed: {r['error'][:160]}")
            continue
        ref = next((x for x in rows if x.get("way") == "per_example" and x["length"] == r["length"]
                    and "error" not in x), None)
        ratio = f"{r['seconds'] / ref['seconds']:.2f}x time" if ref else "-"
        print(f"{r['length']:>8} {r['way']:<12} {r['examples']:>8} {r['seconds']:>10.3f} {r['peak_mib']:>9.1f} "
              f"{ratio:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
