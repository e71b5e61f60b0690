"""Rewrite the run-config reference table in README.md from the dataclasses (``tests/test_readme.py`` checks it).

    python scripts/update_readme_reference.py
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from finetune.config import config_reference_markdown  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"

readme = Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
new = re.sub(re.escape(START) + r".*?" + re.escape(END), f"{START}\n{config_reference_markdown()}\n{END}", text,
             flags=re.S)
readme.write_text(new)
print("README.md reference", "updated" if new != text else "already up to date")
