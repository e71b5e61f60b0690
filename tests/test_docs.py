"""The manual builds: the MkDocs site in docs/ has no broken link or page missing from the nav, and the README
stays a short front page whose links into docs/ resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO

README_MAX_LINES = 200


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "config" / "index.html").is_file()


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t)]
    assert any(t.startswith("docs/") for t in relative), "README.md links no page of docs/"
    missing = [t for t in relative if not (REPO / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
