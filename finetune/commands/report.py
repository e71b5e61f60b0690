"""``finetune report <run dir> [<run dir> ...] [--out report.png]``: the training curves of run folders as one PNG
(:mod:`finetune.lifecycle.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.lifecycle.report import write_report


def main(argv: list[str] | None = None) -> int:
    """``finetune report <run dir> [<run dir> ...] [--out report.png]``; exit 2 on a folder without metrics."""
    p = argparse.ArgumentParser(prog="finetune report", description="PNG of the training curves of one or more "
                                "run folders (several runs overlaid).")
    p.add_argument("run_dirs", nargs="+", help="run folders (with metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG to write (default: <run dir>/report.png for one run, "
                   "./report.png for several)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else (Path(args.run_dirs[0]) / "report.png" if len(args.run_dirs) == 1
                                           else Path("report.png"))
    skipped: dict[str, int] = {}
    try:
        write_report([Path(d) for d in args.run_dirs], out, skipped)
    except ConfigError as e:
        return report_error(e)
    for run_dir, n in skipped.items():
        if n:
            print(f"finetune: warning: {run_dir}/metrics.jsonl: {n} line(s) skipped (torn or not JSON); the "
                  f"report draws the rest", file=sys.stderr)
    print(f"finetune: report {out}")
    return 0
