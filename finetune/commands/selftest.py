"""``finetune selftest [--checks a,b] [--json OUT]``: the node self-test (:mod:`finetune.preflight.selftest`), one row per check.

Run it once per cluster on a GPU node, with all its GPUs, and attach its table to a bug report::

    deepspeed --num_gpus 8 --module finetune selftest
    torchrun --nproc_per_node 8 -m finetune selftest
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module finetune selftest      # the CPU subset, on a laptop
    finetune selftest                                                           # one process

Exit status 0 when no check failed (skips are fine), 1 when one did, 2 for bad arguments (an unknown check, a
``--json`` file that exists or cannot be written: checked before any check runs; missing folders are created).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


from finetune.parallel import distributed as dist_utils
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.logs import setup_logging
from finetune.preflight.selftest import CHECKS, as_dicts, render, run_checks


def check_output_file(key: str, path: str | Path, command: str = "") -> None:
    """Refuse an output file that cannot be written, before any work: ``path`` must not exist, and its nearest
    existing ancestor must be a folder this process may write into (missing folders are created when the file is
    written). Shared by the commands that write one result file (``selftest --json``, ``evaluate --out``);
    ``command`` (``"evaluate: "``) starts the line.

    Raises:
        ConfigError: ``path`` exists, an ancestor is a regular file, or the folder is not writable
            (``os.access``; as root every folder is).
    """
    p = Path(path).absolute()
    if p.exists():
        raise ConfigError(f"{command}{key}: '{path}' exists; it is never overwritten, choose another file")
    probe = p.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{command}{key}: '{path}' cannot be written: '{probe}' is a file, not a folder; choose another "
                          f"{key}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{command}{key}: '{path}' cannot be written: '{probe}' is read-only or not yours; choose a "
                          f"writable {key}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``finetune selftest``; rank 0 prints the table (and writes ``--json``)."""
    p = argparse.ArgumentParser(prog="finetune selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--checks", default="", help=f"comma-separated subset of: {', '.join(CHECKS)} (default: all)")
    p.add_argument("--json", default="", help="also write the rows to this JSON file (rank 0)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.checks.split(",") if n.strip()] or None
    try:
        unknown = [n for n in names or [] if n not in CHECKS]
        if unknown:
            raise ConfigError(f"--checks: unknown check '{unknown[0]}'; choose from {', '.join(CHECKS)}")
        if args.json:
            check_output_file("--json", args.json)
        dist_utils.export_rank_env()
    except ConfigError as e:
        return report_error(e)
    setup_logging(None, dist_utils.rank())
    dist_utils.init(10.0)
    try:
        if dist_utils.on_cpu():
            dist_utils.set_cpu_threads()
        rows = run_checks(names)
    finally:
        dist_utils.shutdown()
    if dist_utils.is_main():
        print(render(rows))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"world_size": dist_utils.world_size(), "rows": as_dicts(rows)},
                                                  indent=2) + "\n")
            print(f"finetune: self-test rows written to {args.json}", file=sys.stderr)
    return 1 if any(r.status == "FAIL" for r in rows) else 0
