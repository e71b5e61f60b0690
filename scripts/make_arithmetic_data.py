"""Make ``data/arithmetic/{train,test}.parquet``: generated arithmetic questions with checkable answers, for GRPO on a
real instruct model (``finetune/recipes/configs/grpo_smollm2_arithmetic.yaml``; seeded, deterministic, offline).

Each row asks "What is A + B? Answer with just the number." with two-digit operands A and B (10-99, drawn
uniformly by ``random.Random(SEED)``), as a conversation of one user message. No question is in both splits (the
ordered pair (A, B) decides). Columns, TRL's conversational prompt form:

- ``prompt``: ``[{"role": "user", "content": "What is 37 + 45? Answer with just the number."}]``;
- ``answer``: the sum as text (``"82"``), what ``exact_match`` compares the completion's last integer with.

``--task`` writes another task of the same shape (for measuring which one a model starts below 50% on):
``add2`` (the default, above), ``addsub2`` (two-digit addition or subtraction, the
answer may be negative), ``sum3`` (three one- or two-digit terms), ``mul`` (a three-digit number times a
two-digit one: the calculator task, ``data/calculator``).

``--demos N`` also writes ``train_chat.parquet``: the first N training questions as conversations for ``sft``
(``messages``, ``tools``: the calculator's schema as JSON, TRL's tool-calling dataset form), every
``--tool-share`` of them solved with a call of ``data/tools/calculator.py:calculate`` (the assistant's tool call,
the tool's result, then "The answer is N."), the others answered directly ("The answer is N."): the warm start
that teaches the tool-call format before GRPO with the tool, but not when to call, which GRPO then learns from the
reward (docs/performance.md, "GRPO with a calculator on SmolLM2-135M-Instruct").

    python scripts/make_arithmetic_data.py                 # writes data/arithmetic/{train,test}.parquet
    python scripts/make_arithmetic_data.py --out DIR --task sum3 --train 2000 --test 200
    python scripts/make_arithmetic_data.py --out data/calculator --task mul --demos 256   # data/calculator
"""

from __future__ import annotations

import argparse
import json
import random
import sys
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
    if task == "mul":
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        return (a, b), f"What is {a} * {b}?", a * b
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


def demos(rows: list[dict], n: int, tool_share: float) -> list[dict]:
    """The first ``n`` of ``rows`` as SFT conversations: ``tool_share`` of them (spread evenly by index) call the
    calculator with the question's expression and answer with its result; the others answer directly (the right
    number: the model cannot learn to compute it, only the form).
    The tool's result is computed by the calculator itself, so a demonstration shows exactly what the tool returns."""
    sys.path.insert(0, str(REPO / "data" / "tools"))
    from calculator import calculate  # the shipped tool: its result and its schema
    from transformers.utils import get_json_schema
    schema = json.dumps([get_json_schema(calculate)])
    out = []
    for i, row in enumerate(rows[:n]):
        question = row["prompt"][0]["content"]
        messages = [{"role": "user", "content": question}]
        if int((i + 1) * tool_share) > int(i * tool_share):  # tool_share of them, spread evenly
            expression = question.removeprefix("What is ").split("?")[0]
            call = {"type": "function", "function": {"name": "calculate",
                                                     "arguments": json.dumps({"expression": expression})}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "calculate", "content": calculate(expression)}]
        messages.append({"role": "assistant", "content": f"The answer is {row['answer']}."})
        out.append({"messages": messages, "tools": schema})
    return out


def write_demos(rows: list[dict], path: Path) -> None:
    call = pa.struct([("type", pa.string()), ("function", pa.struct([("name", pa.string()),
                                                                    ("arguments", pa.string())]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(call)),
                         ("name", pa.string())])
    schema = pa.schema([("messages", pa.list_(message)), ("tools", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--task", default="add2", choices=["add2", "addsub2", "sum3", "mul"])
    parser.add_argument("--demos", type=int, default=0, help="also write train_chat.parquet: N SFT conversations")
    parser.add_argument("--tool-share", type=float, default=0.5, help="the share of --demos that call the tool")
    parser.add_argument("--train", type=int, default=TRAIN_ROWS)
    parser.add_argument("--test", type=int, default=TEST_ROWS)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    train, test = make(args.task, args.train, args.test, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write(train, args.out / "train.parquet")
    write(test, args.out / "test.parquet")
    print(f"{args.out}: {len(train)} training and {len(test)} test rows ({args.task}, seed {args.seed})")
    if args.demos:
        write_demos(demos(train, args.demos, args.tool_share), args.out / "train_chat.parquet")
        print(f"{args.out / 'train_chat.parquet'}: {args.demos} conversations, {args.tool_share:.0%} with a tool call")


if __name__ == "__main__":
    main()
