"""Build the shipped preference set ``data/gsm8k_pref/{train,test}.parquet`` from the shipped GSM8K slice.

Columns (TRL's text form): ``prompt`` (the question, verbatim, as ``sft_gsm8k.yaml`` prompts), ``chosen`` (the
reference solution) and ``rejected`` (the same solution whose final answer after ``####`` is changed by a nonzero
amount drawn from a seeded generator: +-1..9 for 60% of rows, +-10..99 for 30%, x10 or /10-ish for 10%).

Why this rejected answer: the pair differs only in the final answer, so the preference is unambiguous (the chosen
one is the reference, the rejected one contradicts the computation written just before it: ``<<48/2=24>>24 ...
#### 24``) and it is learnable by a small model, which only has to prefer the final number that repeats the last
computed result. Since both responses share every token up to the final answer, the DPO gradient acts on those
answer tokens alone. Another problem's solution as the rejected answer would be a far easier pair (a topic
mismatch) and teach less.

    python scripts/make_preference_data.py            # writes data/gsm8k_pref/train.parquet and test.parquet
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
FINAL = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)\s*$")


def wrong_answer(answer: str, rng: np.random.Generator) -> str | None:
    """``answer`` with the number after ``####`` replaced by a different one; None when it has no final number."""
    m = FINAL.search(answer)
    if not m:
        return None
    value = float(m.group(1).replace(",", ""))
    kind = rng.random()
    if kind < 0.6:
        delta = int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
    elif kind < 0.9:
        delta = int(rng.integers(10, 100)) * (1 if rng.random() < 0.5 else -1)
    else:
        delta = value * 9 if value != 0 else 10
    new = value + delta
    text = str(int(new)) if float(new).is_integer() else f"{new:.2f}"
    if text == m.group(1).replace(",", ""):
        text = str(int(new) + 1)
    return answer[: m.start(1)] + text + answer[m.end(1):]


def build(src: Path, dst: Path, seed: int) -> int:
    """Write the pairs of ``src`` (columns question, answer) to ``dst``; returns the number of pairs."""
    rng = np.random.default_rng(seed)
    rows = pq.read_table(src, columns=["question", "answer"]).to_pylist()
    out = {"prompt": [], "chosen": [], "rejected": []}
    for r in rows:
        rejected = wrong_answer(r["answer"], rng)
        if rejected is None or rejected == r["answer"]:
            continue
        out["prompt"].append(r["question"])
        out["chosen"].append(r["answer"])
        out["rejected"].append(rejected)
    pq.write_table(pa.table(out), dst)
    return len(out["prompt"])


def main() -> int:
    """Build both splits; prints the row counts."""
    folder = ROOT / "data" / "gsm8k_pref"
    folder.mkdir(parents=True, exist_ok=True)
    for split, seed in (("train", 0), ("test", 1)):
        n = build(ROOT / "data" / "gsm8k" / f"{split}.parquet", folder / f"{split}.parquet", seed)
        print(f"{folder / f'{split}.parquet'}: {n} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
