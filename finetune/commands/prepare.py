"""``finetune prepare --config X [key=value ...] [--num-proc N]``: tokenize a run's data into the cache that its
launches read, without a process group or GPUs (a CPU node, a login node): axolotl's ``preprocess``.

It runs the input checks of a launch (:func:`finetune.preflight.validate.check_inputs`: files, columns, model and tokenizer),
then :func:`finetune.data.dataset.load_splits` with ``--num-proc`` processes (default ``data.num_proc``). A launch with
the same data, tokenizer and settings then logs ``cache hit`` and starts training without tokenizing. A killed
``prepare`` leaves no entry a launch could read (the entry appears only once complete). What ``dpo`` computes
before training (reference log-probabilities) needs the model and stays with the launch.
"""

from __future__ import annotations

import argparse
import time

from finetune.errors import ConfigError
from finetune.errors import report as report_error


def main(argv: list[str] | None = None) -> int:
    """Tokenize the run's training and validation splits into the cache; prints one line per split and returns 0,
    or prints one line per problem and returns 2."""
    p = argparse.ArgumentParser(prog="finetune prepare", description="Tokenize a run's data into the cache its "
                                "launches read (no GPU, no process group).")
    p.add_argument("--config", required=True, help="run config (YAML or JSON), as for finetune train")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for finetune train")
    p.add_argument("--num-proc", type=int, default=0,
                   help="tokenizing processes (default: data.num_proc, else the CPUs this process may use, at most 32)")
    args = p.parse_intermixed_args(argv)
    from finetune.data.dataset import default_cache_dir, load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.preflight.validate import checked_inputs_config
    from finetune.recipes import recipe_for

    try:
        if args.num_proc < 0:
            raise ConfigError(f"--num-proc: must be >= 0, got {args.num_proc}")
        cfg = checked_inputs_config(args.config, args.overrides)
        start = time.monotonic()
        recipe = recipe_for(cfg)
        splits = load_splits(recipe, load_tokenizer(cfg, recipe), cfg.data, cfg.train.seed, args.num_proc)
    except ConfigError as e:
        return report_error(e)
    print(f"prepared: {len(splits.train):,} training and {len(splits.validation):,} validation rows of recipe "
          f"{cfg.recipe} in {default_cache_dir(cfg.data) / 'tokenized'} ({time.monotonic() - start:.1f} s); launches "
          f"with this data, tokenizer and settings read them (cache hit)")
    return 0
