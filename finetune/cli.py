"""The ``finetune`` command: parses the verb and hands the rest of the command line to its module.

``finetune <verb> ...`` (``COMMANDS``) (also ``python -m finetune ...``); ``deepspeed finetune/run.py``
runs ``train``. Each verb is a module of :mod:`finetune.commands` with ``main(argv) -> int`` (``-`` in a verb is ``_`` in its
module's name: ``lm-eval`` is ``finetune.commands.lm_eval``).

The one lazy import of the package is here: a verb's module is imported only when that verb runs, so that
``finetune report`` or ``finetune --help`` do not pay for importing DeepSpeed's training stack.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "fine-tune a model with DeepSpeed (what deepspeed finetune/run.py runs)",
    "export": "a Hugging Face folder from a checkpoint",
    "evaluate": "loss, perplexity and the recipe's metrics of an export on a run config's data",
    "lm-eval": "lm-evaluation-harness tasks on an export, offline; scores into the run folder and the model card",
    "prepare": "tokenize a run's data into the cache its launches read, on a CPU node (no GPU, no process group)",
    "inspect": "tokenized rows as the model gets them, trained tokens marked (label masks, packing, chat templates)",
    "plan": "memory per GPU and node of each ZeRO stage, offload and checkpointing choice",
    "doctor": "pre-flight checks of a run config on the login node",
    "report": "PNG of the training curves of run folders",
    "bundle": "models, datasets and wheels in one folder with a manifest, for a cluster without internet",
    "verify": "offline check of a bundle: every file's SHA-256, models, tokenizers and parquet load",
    "selftest": "the node's numerics and collectives against fp32 single-device references, one row per check",
    "env": "platform, versions, devices and launcher variables to paste into a bug report (--json: as JSON)",
}
"""Verb -> one line of help; the verb's code is ``finetune.commands.<verb>.main``."""


def usage() -> str:
    """The command's help: one line per verb."""
    width = max(map(len, COMMANDS))
    return "usage: finetune <command> ...  (finetune <command> --help)\n\n" + "\n".join(
        f"  {name:<{width}}  {text}" for name, text in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    """Run ``finetune <command> ...``; returns the process exit status (2 for an unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # DeepSpeed's launcher puts --local_rank=N first (deepspeed --module finetune <verb> ...); LOCAL_RANK says it too
    argv = [a for a in argv if not a.startswith(("--local_rank=", "--local-rank="))]
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        unknown = f"finetune: error: unknown command '{argv[0]}'\n" if argv else ""
        print(unknown + usage(), file=sys.stderr)
        return 2
    return importlib.import_module(f"finetune.commands.{argv[0].replace('-', '_')}").main(argv[1:])
