"""Write ``data/wnut17/{train,validation}.parquet`` (columns ``tokens``, ``ner_tags``: lists of words and their
IOB2 tags) from WNUT-17's training file in CoNLL form (``wnut17train.conll``: a word and its tag per line, a blank
line between sentences; Derczynski et al. 2017, "Results of the WNUT2017 Shared Task on Novel and Emerging Entity
Recognition", CC BY 4.0), read by :func:`finetune.recipes.token_cls.read_conll`.

The 3,394 sentences are split at random (NumPy ``default_rng(0)``) into 500 held-out sentences and the rest, each
kept in file order.

    python scripts/make_wnut17_data.py --conll wnut17train.conll
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from finetune.recipes.token_cls import read_conll

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conll", required=True, help="WNUT-17's wnut17train.conll")
    p.add_argument("--out", default=str(REPO / "data" / "wnut17"))
    p.add_argument("--validation", type=int, default=500)
    args = p.parse_args()
    rows = read_conll(args.conll)
    held = set(np.random.default_rng(0).permutation(len(rows))[:args.validation].tolist())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", [r for i, r in enumerate(rows) if i not in held]),
                       ("validation", [r for i, r in enumerate(rows) if i in held])):
        table = pa.table({"tokens": [r["tokens"] for r in part], "ner_tags": [r["ner_tags"] for r in part]})
        pq.write_table(table, out / f"{name}.parquet")
        print(f"{out / name}.parquet: {len(part)} sentences, {sum(len(r['tokens']) for r in part)} words")
    return 0


if __name__ == "__main__":
    sys.exit(main())
