"""``finetune export <checkpoint> <out>``: a Hugging Face folder (config, tokenizer, safetensors; with LoRA the merged
model and the adapter folder) from a complete checkpoint (:func:`finetune.lifecycle.export.export_checkpoint`)."""

from __future__ import annotations

import argparse

from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.lifecycle.export import export_checkpoint
from finetune.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    """``finetune export <checkpoint> <out> [--run-dir DIR]``; exit 2 with one line per problem."""
    p = argparse.ArgumentParser(prog="finetune export", description="Export a checkpoint as a Hugging Face folder.")
    p.add_argument("checkpoint", help="checkpoint folder, e.g. runs/x/checkpoints/step200")
    p.add_argument("out", help="new folder for config.json, tokenizer files and model.safetensors")
    p.add_argument("--run-dir", default=None, help="run folder (default: the checkpoint's grandparent)")
    args = p.parse_args(argv)
    setup_logging(None, 0)
    try:
        export_checkpoint(args.checkpoint, args.out, args.run_dir)
    except ConfigError as e:
        return report_error(e)
    return 0
