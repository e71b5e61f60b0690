"""``finetune verify BUNDLE``: offline check of a folder made by ``finetune bundle`` (:func:`finetune.bundle.verify_bundle`):
every file's SHA-256, models and tokenizers loaded with ``local_files_only=True``, parquet footers. Exit 0, or 1
with one line per problem."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Verify a bundle; prints ``bundle ok: ...`` and returns 0, or one line per problem and returns 1."""
    p = argparse.ArgumentParser(prog="finetune verify", description="Check a bundle offline against its manifest.")
    p.add_argument("bundle", help="folder made by finetune bundle (with MANIFEST.json)")
    args = p.parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # before transformers is imported
        os.environ.setdefault(var, "1")
    from finetune.bundle import verify_bundle
    from finetune.manifest import read_manifest

    problems = verify_bundle(Path(args.bundle))
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"finetune verify: {len(problems)} problem(s) in {args.bundle}", file=sys.stderr)
        return 1
    m = read_manifest(Path(args.bundle))
    size = sum(f["size"] for f in m["files"].values())
    kinds = [s["kind"] for s in m["sources"]]
    print(f"bundle ok: {len(m['files'])} files ({size / 2**20:,.1f} MiB) match MANIFEST.json; "
          f"{kinds.count('model')} model(s) and {kinds.count('dataset')} dataset(s) load offline"
          + (f"; install: {m['install']}" if m.get("install") else ""))
    return 0
