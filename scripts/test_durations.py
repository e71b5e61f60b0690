"""Record each test's seconds for the suite's file order (``tests/durations.json``, read by ``tests/conftest.py``).

Reads the ``--durations=0`` lines of pytest runs (``12.34s call     tests/test_x.py::test_y[...]``), adds a test's
setup, call and teardown, and merges them into ``tests/durations.json`` (newer runs replace a test's entry)::

    python -m pytest -q --durations=0 > suite.log; python -m pytest -q -m extended --durations=0 > extended.log
    python scripts/test_durations.py suite.log extended.log
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(tests/\S+::.+?)\s*$")
OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def parse(text: str) -> dict[str, float]:
    """``nodeid`` -> seconds (setup + call + teardown) from pytest's ``--durations`` lines in ``text``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line.removeprefix("> "))
        if m:
            out[m.group(3)] = out.get(m.group(3), 0.0) + float(m.group(1))
    return out


def main(paths: list[str]) -> int:
    seconds = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for path in paths:
        seconds.update({k: round(v, 1) for k, v in parse(Path(path).read_text()).items()})
    OUT.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{OUT}: {len(seconds)} tests, {sum(seconds.values()) / 60:.1f} minutes in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
