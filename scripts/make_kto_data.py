"""Build the shipped KTO set ``data/gsm8k_kto/{train,test}.parquet`` from the shipped preference pairs.

TRL's unpaired form (``KTOTrainer``'s ``prompt``/``completion``/``label``; what TRL's ``unpair_preference_dataset``
makes of pairs): every pair of ``data/gsm8k_pref`` (``scripts/make_preference_data.py``) gives two rows, its chosen
response with ``label`` true (desirable) and its rejected response with ``label`` false (undesirable); the test split
is made of the first 100 held-out pairs (200 rows). The rows are shuffled (seeded), so that the row before a row,
whose completion the ``kto`` recipe pairs with its prompt for the KL estimate (:mod:`finetune.recipes.kto`), is almost
never of the same question.

    python scripts/make_kto_data.py            # writes data/gsm8k_kto/train.parquet and test.parquet
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
TEST_PAIRS = 100
"""Pairs of ``gsm8k_pref/test.parquet`` unpaired into the test split (200 rows): the reference pass runs every
validation row before training, and the shipped config runs in about a minute."""


def build(src: Path, dst: Path, seed: int, limit: int = 0) -> tuple[int, int]:
    """Write the unpaired rows of the pairs in ``src`` (prompt, chosen, rejected; the first ``limit`` when > 0) to
    ``dst``, shuffled with ``seed``; returns the number of rows and of neighbouring rows with the same prompt."""
    table = pq.read_table(src, columns=["prompt", "chosen", "rejected"])
    pairs = (table.slice(0, limit) if limit else table).to_pydict()
    rows = [(p, c, True) for p, c in zip(pairs["prompt"], pairs["chosen"])]
    rows += [(p, r, False) for p, r in zip(pairs["prompt"], pairs["rejected"])]
    rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]
    pq.write_table(pa.table({"prompt": [r[0] for r in rows], "completion": [r[1] for r in rows],
                             "label": pa.array([r[2] for r in rows], pa.bool_())}), dst)
    return len(rows), sum(rows[i][0] == rows[i - 1][0] for i in range(len(rows)))


def main() -> int:
    """Build both splits; prints the row counts."""
    folder = ROOT / "data" / "gsm8k_kto"
    folder.mkdir(parents=True, exist_ok=True)
    for split, seed, limit in (("train", 0, 0), ("test", 1, TEST_PAIRS)):
        n, same = build(ROOT / "data" / "gsm8k_pref" / f"{split}.parquet", folder / f"{split}.parquet", seed, limit)
        print(f"{folder / f'{split}.parquet'}: {n} rows ({same} after a row of the same prompt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
