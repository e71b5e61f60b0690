"""``finetune bundle OUT --model ID_OR_PATH[@REV] --dataset ID_OR_PATH[@REV][:CONFIG] ... [--wheels]``: everything a
cluster without internet needs, in one folder with a manifest (:mod:`finetune.airgap.bundle`); run on a connected machine."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from loguru import logger

from finetune.airgap.bundle import make_bundle
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.logs import setup_logging
from finetune.airgap.manifest import MANIFEST, manifest_sha256


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size such as 500MB or 2GB")
    unit = (m.group(2) or "B").upper()[0]
    return int(float(m.group(1)) * {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit])


def main(argv: list[str] | None = None) -> int:
    """Make or complete a bundle and print the SHA-256 of its ``MANIFEST.json``; exit 2 with one line on a problem
    (the manifest is then absent)."""
    p = argparse.ArgumentParser(prog="finetune bundle", description="Fetch models, datasets and wheels into one "
                                "folder with a SHA-256 manifest, for a cluster without internet (then: finetune verify).")
    p.add_argument("out", help="bundle folder (new, empty, or an earlier bundle to complete)")
    p.add_argument("--model", action="append", default=[], metavar="ID_OR_PATH[@REV]",
                   help="Hub model id (at a branch, tag or commit) or local folder; repeatable; tokenizers too")
    p.add_argument("--dataset", action="append", default=[], metavar="ID_OR_PATH[@REV][:CONFIG]",
                   help="Hub dataset id, local parquet/jsonl/json/csv file or folder, or save_to_disk folder")
    p.add_argument("--wheels", action="store_true", help="also finetune and its dependencies as wheels")
    p.add_argument("--for-python", default=None, help="wheels for this Python (e.g. 3.11; default: this one)")
    p.add_argument("--for-platform", default=None,
                   help="wheels for this platform tag (e.g. manylinux2014_x86_64; default: this one)")
    p.add_argument("--torch", default=None, help="torch version of the wheels (default: the installed one)")
    p.add_argument("--torch-index", default=None,
                   help="extra index for torch, e.g. https://download.pytorch.org/whl/cu128 or .../whl/cpu")
    p.add_argument("--allow-pickle", action="store_true", help="also bundle pickled weights (*.bin, *.pt, ...)")
    p.add_argument("--trust-remote-code", action="store_true", help="also bundle a model's Python files (recorded)")
    p.add_argument("--follow-links", action="store_true",
                   help="copy what links out of a local model folder point to (default: such a link is refused)")
    p.add_argument("--max-shard-size", type=_bytes, default=_bytes("500MB"), help="parquet shard size (500MB)")
    args = p.parse_args(argv)
    if not (args.model or args.dataset or args.wheels):
        p.error("nothing to bundle: give --model, --dataset or --wheels")
    setup_logging(None, 0)
    try:
        manifest = make_bundle(Path(args.out), args.model, args.dataset, args.wheels, args.allow_pickle,
                               args.trust_remote_code, args.max_shard_size, args.for_python, args.for_platform,
                               args.torch, args.torch_index, args.follow_links)
    except ConfigError as e:
        return report_error(e)
    size = sum(f["size"] for f in manifest["files"].values())
    logger.info(f"bundle {args.out}: {len(manifest['files'])} files, {size / 2**20:,.1f} MiB, "
                f"{len(manifest['sources'])} sources; copy it to the cluster, then: finetune verify <folder>")
    if manifest["install"]:
        logger.info(f"install on the cluster, from the bundle folder: {manifest['install']}")
    logger.info(f"{MANIFEST} SHA-256 {manifest_sha256(Path(args.out))} (finetune verify prints it too: compare "
                "the two across the gap)")
    return 0
