"""``finetune plan <run config>``: memory per GPU and per node of every ZeRO stage, offload and gradient
checkpointing choice, offline from ``config.json`` (the memory model is :mod:`finetune.preflight.plan`); a ``.gguf``
``model.path`` is read from its converted folder (:func:`finetune.preflight.validate.resolve_model_files`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from finetune.config import load_run_config
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.preflight.plan import make_plan, parse_size
from finetune.preflight.validate import resolve_model_files


def main(argv: list[str] | None = None) -> int:
    """``finetune plan <run config> [key=value ...] [--gpus-per-node N] [--nodes M] [--gpu-memory 80GiB]
    [--cpu-memory 512GiB]``: print the memory plan; exit 2 with one line per problem on a bad config."""
    p = argparse.ArgumentParser(prog="finetune plan", description="Memory per GPU and node for each ZeRO stage, "
                                "offload and gradient checkpointing choice, offline from config.json.")
    p.add_argument("config", help="run config (YAML or JSON)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for finetune train")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    p.add_argument("--cpu-memory", default=None, help="CPU RAM of one node (default: not checked)")
    args = p.parse_args(argv)
    try:
        problems = []
        if args.gpus_per_node < 1 or args.nodes < 1:
            problems.append("--gpus-per-node and --nodes: must be >= 1")
        try:
            gpu = parse_size(args.gpu_memory)
            cpu = parse_size(args.cpu_memory) if args.cpu_memory else None
        except ValueError as e:
            problems.append(f"--gpu-memory/--cpu-memory: {e}")
        if problems:
            raise ConfigError(problems)
        cfg = load_run_config(args.config, args.overrides)
        resolve_model_files(cfg, problems, weights=False)  # a .gguf model.path: its config (finetune.engine.gguf)
        if problems:
            raise ConfigError(problems)
        if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
            raise ConfigError(f"model.path: '{cfg.model.path}/config.json' does not exist (the plan needs the model's "
                              f"config.json, not its weights)")
        text, _, _ = make_plan(cfg, args.gpus_per_node, args.nodes, gpu, cpu)
    except ConfigError as e:
        return report_error(e)
    print(text)
    return 0

