"""Write ``data/squad_v2/{train,validation}.parquet`` and, with the answerable questions alone (SQuAD 1.1's form),
``data/squad/{train,validation}.parquet`` (SQuAD's columns as Hugging Face ``datasets`` has them:
``id``, ``title``, ``context``, ``question``, ``answers`` = ``{text: [str], answer_start: [int]}``, empty lists for
an unanswerable question) from SQuAD 2.0 JSON files (Rajpurkar et al. 2018, "Know What You Don't Know: Unanswerable
Questions for SQuAD", CC BY-SA 4.0).

Questions are read from every file given, each question id once (the first file that has it). The articles named by
``--validation`` (default ``Normans``) are the held-out split, the others the training split, each in file order.

    python scripts/make_squad_data.py --json dev-v2.0.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def squad_rows(paths: list[str]) -> list[dict]:
    """The questions of SQuAD-form JSON files (``data`` -> articles -> ``paragraphs`` -> ``qas``) as rows, each
    question id once, in file order."""
    rows, seen = [], set()
    for path in paths:
        for article in json.loads(Path(path).read_text(encoding="utf-8"))["data"]:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    if qa["id"] in seen:
                        continue
                    seen.add(qa["id"])
                    answers = [] if qa.get("is_impossible") else qa["answers"]
                    rows.append({"id": qa["id"], "title": article["title"], "context": paragraph["context"],
                                 "question": qa["question"],
                                 "answers": {"text": [a["text"] for a in answers],
                                             "answer_start": [int(a["answer_start"]) for a in answers]}})
    return rows


def main() -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", nargs="+", required=True, help="SQuAD 2.0 JSON files")
    p.add_argument("--out", default=str(REPO / "data" / "squad_v2"))
    p.add_argument("--answerable-out", default=str(REPO / "data" / "squad"))
    p.add_argument("--validation", nargs="+", default=["Normans"], help="titles of the held-out articles")
    args = p.parse_args()
    rows = squad_rows(args.json)
    for out, keep in ((Path(args.out), rows), (Path(args.answerable_out), [r for r in rows if r["answers"]["text"]])):
        out.mkdir(parents=True, exist_ok=True)
        for name, part in (("train", [r for r in keep if r["title"] not in args.validation]),
                           ("validation", [r for r in keep if r["title"] in args.validation])):
            pq.write_table(pa.Table.from_pylist(part), out / f"{name}.parquet")
            answerable = sum(bool(r["answers"]["text"]) for r in part)
            print(f"{out / name}.parquet: {len(part)} questions ({answerable} answerable) from "
                  f"{', '.join(sorted({r['title'] for r in part}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
