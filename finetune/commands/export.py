"""``finetune export <source> <out>``: a Hugging Face folder (config, tokenizer, safetensors; with LoRA the merged
model and the adapter folder) from a complete checkpoint (:func:`finetune.lifecycle.export.export_checkpoint`), and
with ``--gguf TYPE`` the GGUF file llama.cpp and Ollama run, checked by llama.cpp where ``xllamacpp`` is installed
(:mod:`finetune.lifecycle.gguf_export`). ``source`` may also be a run folder (its ``export/``) or an export folder,
for the GGUF alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.lifecycle import gguf_export
from finetune.lifecycle.checkpoint import CONFIG_FILE
from finetune.lifecycle.export import export_checkpoint
from finetune.lifecycle.run_folder import MODEL_META
from finetune.logs import setup_logging


def _base_of(hf: Path) -> str | None:
    """The base model a LoRA export's adapter was trained on (peft's ``base_model_name_or_path``)."""
    path = hf / "adapter" / "adapter_config.json"
    return json.loads(path.read_text()).get("base_model_name_or_path") if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    """``finetune export <source> <out> [--run-dir DIR] [--gguf TYPE [--gguf-adapter] [--no-check]]``; exit 2 with one
    line per problem."""
    p = argparse.ArgumentParser(prog="finetune export", description="Export a checkpoint as a Hugging Face folder "
                                "and, with --gguf, as the GGUF file llama.cpp and Ollama run.")
    p.add_argument("source", help="checkpoint folder (e.g. runs/x/checkpoints/step200); with --gguf also a run folder "
                   "(its export/) or a Hugging Face export folder")
    p.add_argument("out", help="new folder for config.json, tokenizer files and model.safetensors (and the .gguf)")
    p.add_argument("--run-dir", default=None, help="run folder (default: the checkpoint's grandparent)")
    p.add_argument("--gguf", default=None, metavar="TYPE",
                   help=f"also write model-TYPE.gguf and an Ollama Modelfile; TYPE: {', '.join(gguf_export.TYPES)}")
    p.add_argument("--gguf-adapter", action="store_true",
                   help="with --gguf on a LoRA run: write the adapter alone as llama.cpp's GGUF LoRA adapter")
    p.add_argument("--no-check", action="store_true", help="do not check the GGUF file with llama.cpp (xllamacpp)")
    args = p.parse_args(argv)
    setup_logging(None, 0)
    source, out = Path(args.source), Path(args.out)
    try:
        if args.gguf_adapter and args.gguf is None:
            raise ConfigError("--gguf-adapter needs --gguf TYPE (the adapter's tensor type, e.g. --gguf f16)")
        if args.gguf is not None:
            gguf_export.check_type(args.gguf)
        run_folder = (source / CONFIG_FILE).is_file() and (source / "checkpoints").is_dir()
        if (source / "config.json").is_file() or run_folder:  # an export, or a run's
            hf = source if (source / "config.json").is_file() else source / "export"
            if args.gguf is None:
                raise ConfigError(f"export: '{source}' is {'an export' if hf == source else 'a run folder'}, not a "
                                  f"checkpoint; add --gguf TYPE to write its GGUF, or name a checkpoint")
            if not (hf / "config.json").is_file():
                raise ConfigError(f"export: run folder '{source}' has no export/ (the run did not finish, or ran with "
                                  f"export: false); export a checkpoint: finetune export {source}/checkpoints/stepN ...")
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise ConfigError(f"export: '{out}' exists and is not empty; choose a new folder")
            gguf_export.check_family(gguf_export.model_type_of(hf), f"export of '{hf}'")
        else:
            hf = out
            if args.gguf is not None:  # before any export work: the family is the run's
                run_dir = Path(args.run_dir) if args.run_dir else source.parent.parent
                gguf_export.check_family(gguf_export.model_type_of(run_dir / MODEL_META), f"export of '{source}'")
            export_checkpoint(source, out, args.run_dir)
        if args.gguf is not None:
            gguf_export.export_gguf(hf, out, args.gguf, adapter=args.gguf_adapter, check=not args.no_check,
                                    base=_base_of(hf))
    except ConfigError as e:
        return report_error(e)
    return 0
