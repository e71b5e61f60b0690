"""``finetune verify BUNDLE``: offline check of a folder made by ``finetune bundle`` (:func:`finetune.airgap.bundle.verify_bundle`):
every file's SHA-256 (no links, nothing outside the bundle) and every source's folder (where the manifest hashes:
not under ``runs/`` or a cache, no link on the way), then, when all is well, model configs (as JSON),
safetensors headers, tokenizers (``local_files_only=True``, never the bundle's code) and parquet footers. Exit 0
with the SHA-256 of ``MANIFEST.json``, 1 with one line per problem, 2 with one line when the manifest is not one."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.airgap.manifest import MANIFEST, manifest_sha256, read_manifest


def main(argv: list[str] | None = None) -> int:
    """Verify a bundle; prints ``bundle ok: ...`` and the manifest's SHA-256 and returns 0, one line per problem
    and returns 1, or one line and returns 2 for a manifest that is not one (not JSON, entries of the wrong shape,
    paths outside the bundle)."""
    p = argparse.ArgumentParser(prog="finetune verify", description="Check a bundle offline against its manifest.")
    p.add_argument("bundle", help="folder made by finetune bundle (with MANIFEST.json)")
    args = p.parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # before transformers is imported
        os.environ.setdefault(var, "1")
    from finetune.airgap.bundle import verify_bundle  # after the offline variables: it may import transformers

    try:
        problems = verify_bundle(Path(args.bundle))
    except ConfigError as e:
        return report_error(e)
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
    print(f"{MANIFEST} SHA-256 {manifest_sha256(Path(args.bundle))} (compare with the one finetune bundle printed)")
    return 0
