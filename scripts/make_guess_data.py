"""Make ``data/guess_number/``: the prompts of the guessing game (``data/environments/guess_number.py``) and the
expert trajectories that play it by bisection, as chat conversations with tool calls (seeded).

    python scripts/make_guess_data.py            # writes data/guess_number/{train,test,train_chat}.parquet

``train.parquet`` / ``test.parquet``: columns ``prompt`` (the task: a conversation of one user message), ``low``, ``high``,
``secret`` (1,000 and 100 games, ranges 1-16 to 1-64). ``train_chat.parquet``: column ``messages``, the user
message, then for each guess an assistant turn calling ``guess`` and the ``tool`` result, and a last assistant turn
stating the number; column ``tools``, the JSON text of the tool schemas that ``grpo`` offers with
``train.grpo.environment: data/environments/guess_number.py:GuessNumber`` (built by the same
:func:`finetune.recipes.grpo.tools.environment_tools`), which ``sft`` renders into each conversation
(``data.tools_column: tools``) so that the SFT model learns the prompt GRPO's rollouts show it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "data" / "guess_number"
ENVIRONMENT = "data/environments/guess_number.py:GuessNumber"


def tool_schemas() -> list[dict]:
    """The schemas ``grpo`` offers for :data:`ENVIRONMENT` (its public methods, one probe instance)."""
    sys.path.insert(0, str(REPO))
    from finetune.recipes.grpo import tools

    return [t.schema for t in tools.environment_tools(tools.load_environment(ENVIRONMENT)())]


def prompt(low: int, high: int) -> str:
    return (f"Find the secret whole number between {low} and {high}. Call guess(number) with a guess; each answer "
            f"says whether the secret is higher or lower. Use as few guesses as you can, then say the number.")


def expert(low: int, high: int, secret: int) -> list[dict]:
    """Bisection, as a conversation with tool calls."""
    messages = [{"role": "user", "content": prompt(low, high)}]
    lo, hi = low, high
    while True:
        g = (lo + hi) // 2
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"number": g}}}]})
        if g < secret:
            answer, lo = f"{g} is too low: the secret is higher.", g + 1
        elif g > secret:
            answer, hi = f"{g} is too high: the secret is lower.", g - 1
        else:
            answer = f"{g} is correct."
        messages.append({"role": "tool", "name": "guess", "content": answer})
        if g == secret:
            messages.append({"role": "assistant", "content": f"The secret number is {secret}."})
            return messages


def games(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        high = rng.choice([16, 32, 64])
        rows.append({"prompt": [{"role": "user", "content": prompt(1, high)}], "low": 1, "high": high,
                     "secret": rng.randint(1, high)})
    return rows


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train, test = games(1000, rng), games(100, rng)
    pq.write_table(pa.Table.from_pylist(train), OUT / "train.parquet")
    pq.write_table(pa.Table.from_pylist(test), OUT / "test.parquet")
    schemas = json.dumps(tool_schemas())
    chats = [{"messages": expert(r["low"], r["high"], r["secret"]), "tools": schemas} for r in train]
    for chat in chats:  # one schema for every row: arguments as JSON text (the template writes a string as is)
        for m in chat["messages"]:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = '{"number": %d}' % call["function"]["arguments"]["number"]
    pq.write_table(pa.Table.from_pylist(chats), OUT / "train_chat.parquet")
    print(f"wrote {len(train)} + {len(test)} games and {len(chats)} expert conversations to {OUT}")


if __name__ == "__main__":
    main()
