"""Rewrite the run-config reference table in docs/config.md from the dataclasses (``tests/test_readme.py`` checks it).

    python scripts/update_readme_reference.py

The table sits between the ``config-reference`` markers of docs/config.md (it lived in README.md before the
manual moved to docs/; the script keeps its name).
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from finetune.config import config_reference_markdown  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"

page = Path(__file__).resolve().parent.parent / "docs" / "config.md"
text = page.read_text()
if START not in text or END not in text:
    sys.exit(f"{page}: no {START} ... {END} markers")
new = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: f"{START}\n{config_reference_markdown()}\n{END}",
             text, flags=re.S)
page.write_text(new)
print("docs/config.md reference", "updated" if new != text else "already up to date")
