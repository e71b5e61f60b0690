"""Write ``data/stsb/{train,validation}.parquet`` from the STS Benchmark's tab-separated files (Cer et al. 2017,
"SemEval-2017 Task 1: Semantic Textual Similarity", ``sts-train.csv`` and ``sts-dev.csv``: genre, file, year, id,
score 0-5, sentence 1, sentence 2, and on some rows the sources' names).

- ``train.parquet``: the training pairs scored at least ``--min-score`` (default 4.0 of 5: the two sentences mean
  nearly the same), as ``anchor`` and ``positive`` columns, the form of sentence-transformers' (anchor, positive) pairs
  that the multiple-negatives ranking loss trains on, and their ``score`` (0-1).
- ``validation.parquet``: every pair of the dev split, ``anchor``, ``positive`` and ``score`` (0-5 scaled to 0-1, as
  sentence-transformers' ``stsb`` dataset has it), for STS Spearman over all pairs and retrieval over the pairs scored
  at least 0.8.

    python scripts/make_stsb_data.py --train sts-train.csv --dev sts-dev.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sts_rows(path: str) -> list[dict]:
    """The pairs of one STS Benchmark file: ``anchor``, ``positive`` (the two sentences) and ``score`` (0-1)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 7:
            rows.append({"anchor": fields[5], "positive": fields[6], "score": float(fields[4]) / 5.0})
    return rows


def main() -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True, help="sts-train.csv")
    p.add_argument("--dev", required=True, help="sts-dev.csv")
    p.add_argument("--min-score", type=float, default=4.0, help="training pairs kept: score at least this (0-5)")
    p.add_argument("--out", default=str(REPO / "data" / "stsb"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = [r for r in sts_rows(args.train) if r["score"] * 5.0 >= args.min_score]
    dev = sts_rows(args.dev)
    pq.write_table(pa.Table.from_pylist(train), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(dev), out / "validation.parquet")
    print(f"{out}/train.parquet: {len(train)} pairs scored >= {args.min_score}; {out}/validation.parquet: "
          f"{len(dev)} scored pairs ({sum(r['score'] >= 0.8 for r in dev)} at >= 0.8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
