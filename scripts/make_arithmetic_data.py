"""Make ``data/arithmetic/{train,test}.parquet``: generated arithmetic questions with checkable answers, for GRPO on a
real instruct model (``finetune/recipes/configs/grpo_smollm2_arithmetic.yaml``; seeded, deterministic, offline).

Each row asks "What is A + B? Answer with just the number." with two-digit operands A and B (10-99, drawn
uniformly by ``random.Random(SEED)``), as a conversation of one user message. No question is in both splits (the
ordered pair (A, B) decides). Columns, TRL's conversational prompt form:

- ``prompt``: ``[{"role": "user", "content": "What is 37 + 45? Answer with just the number."}]``;
- ``answer``: the sum as text (``"82"``), what ``exact_match`` compares the completion's last integer with.

``--task`` writes another task of the same shape (for measuring which one a model starts below 50% on):
``add2`` (the default, above), ``addsub2`` (two-digit addition or subtraction, the
answer may be negative), ``sum3`` (three one- or two-digit terms).

    python scripts/make_arithmetic_data.py                 # writes data/arithmetic/{train,test}.parquet
    python scripts/make_arithmetic_data.py --out DIR --task sum3 --train 2000 --test 200
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "data" / "arithmetic"
SEED = 0
TRAIN_ROWS = 2000
TEST_ROWS = 200
SUFFIX = "Answer with just the number."


def draw(rng: random.Random, task: str) -> tuple[tuple[int, ...], str, int]:
    """One question of ``task``: its terms (the key that keeps the splits apart), its text and its answer."""
    if task == "add2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return (a, b), f"What is {a} + {b}?", a + b
    if task == "addsub2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return (a, 0, b), f"What is {a} + {b}?", a + b
        return (a, 1, b), f"What is {a} - {b}?", a - b
    if task == "sum3":
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99)
        return (a, b, c), f"What is {a} + {b} + {c}?", a + b + c
    raise ValueError(f"unknown task {task!r}")


def make(task: str, train_rows: int, test_rows: int, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """The training and test rows: distinct questions, the test split drawn first."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    splits: list[list[dict]] = [[], []]
    tries = 0
    for split, n in ((1, test_rows), (0, train_rows)):
        while len(splits[split]) < n:
            tries += 1
            if tries > 100 * (train_rows + test_rows):
                raise ValueError(f"{task}: too few distinct questions for {train_rows} + {test_rows} rows")
            key, question, answer = draw(rng, task)
            if key in seen:
                continue
            seen.add(key)
            splits[split].append({"prompt": [{"role": "user", "content": f"{question} {SUFFIX}"}],
                                  "answer": str(answer)})
    return splits[0], splits[1]


def write(rows: list[dict], path: Path) -> None:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("prompt", pa.list_(message)), ("answer", pa.string())])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, compression="zstd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--task", default="add2", choices=["add2", "addsub2", "sum3"])
    parser.add_argument("--train", type=int, default=TRAIN_ROWS)
    parser.add_argument("--test", type=int, default=TEST_ROWS)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    train, test = make(args.task, args.train, args.test, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write(train, args.out / "train.parquet")
    write(test, args.out / "test.parquet")
    print(f"{args.out}: {len(train)} training and {len(test)} test rows ({args.task}, seed {args.seed})")


if __name__ == "__main__":
    main()
