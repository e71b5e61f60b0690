"""Command line: ``finetune train`` (what ``finetune/run.py`` runs) and ``finetune export``.

``train`` order of work: parse and merge the config, discover rank/world, validate everything (no
model yet; errors exit with status 2 and one line per problem), start the process group, write the
run folder, tokenize (rank 0 first), build the engine, resume, train, export.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from finetune.config import ConfigError, config_to_dict, dump_yaml, load_run_config

USAGE_EXAMPLE = ("deepspeed --num_gpus 2 finetune/run.py --config finetune/recipes/configs/gpt_clm_wikitext2.yaml "
                 "train.lr=3e-5 ds.zero_optimization.stage=3")


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="finetune train", description="Fine-tune a Hugging Face model with DeepSpeed.",
                                epilog=f"example: {USAGE_EXAMPLE}")
    p.add_argument("--config", required=True, help="run config (YAML or JSON)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-5 "
                   "ds.zero_optimization.stage=3 (precedence: defaults < file < these)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest complete checkpoint in output_dir, or from the given path")
    p.add_argument("--print-config", action="store_true", help="print the resolved run and DeepSpeed configs, exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _git_hash() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _write_run_folder(run_dir: Path, cfg, ds: dict, tokenizer, model_config, launcher: str) -> None:
    import deepspeed
    import torch
    import transformers

    from finetune.distributed import world_size
    from finetune.ds_config import describe_precision
    from finetune.export import MODEL_META

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run_config.yaml").write_text(dump_yaml(config_to_dict(cfg)))
    (run_dir / "ds_config.json").write_text(json.dumps(ds, indent=2))
    meta = {"command": shlex.join([sys.executable] + sys.argv), "cwd": os.getcwd(), "git": _git_hash(),
            "launcher": launcher, "world_size": world_size(), "host": platform.node(),
            "precision": describe_precision(cfg, _on_cpu()),
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()}}
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    model_config.save_pretrained(run_dir / MODEL_META)
    tokenizer.save_pretrained(run_dir / MODEL_META)


def _error(e: ConfigError) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        for line in e.problems:
            print(f"finetune: error: {line}", file=sys.stderr)
    return 2


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of ``finetune/run.py`` and ``finetune train``. Returns the process exit status."""
    args = _train_parser().parse_args(argv)
    from finetune import distributed as dist_utils

    try:
        cfg = load_run_config(args.config, args.overrides)
        launcher = dist_utils.export_rank_env()
        if args.print_config:
            from finetune.ds_config import resolve_ds_config

            ds, problems = resolve_ds_config(cfg, dist_utils.world_size(), _on_cpu())
            if problems:
                raise ConfigError(problems)
            if dist_utils.rank() == 0:
                print(dump_yaml({**config_to_dict(cfg), "resolved_deepspeed": ds}))
            return 0
        from finetune.validate import validate_run

        _auto_resume(args, cfg)
        resolved = validate_run(cfg, args.resume, dist_utils.world_size(), _on_cpu())
    except ConfigError as e:
        return _error(e)
    from finetune.preemption import StopRequested, StopSignal

    try:
        # SIGTERM/SIGUSR1: during start-up stop at once; once training runs, checkpoint and stop (preemption.py)
        with StopSignal() as stop:
            return _train(cfg, resolved, launcher, stop)
    except ConfigError as e:
        return _error(e)
    except StopRequested as e:
        print(f"finetune: rank {dist_utils.rank()} {e}", file=sys.stderr, flush=True)
        return 128 + e.signum


def _auto_resume(args, cfg) -> None:
    """Requeued Slurm job or restarted torchrun worker group: continue from the latest complete checkpoint.

    With no ``--resume`` given and ``SLURM_RESTART_COUNT`` (set by Slurm in a requeued job) or
    ``TORCHELASTIC_RESTART_COUNT`` above 0, a complete checkpoint in ``output_dir`` is resumed as if
    ``--resume`` had been passed; without one the run starts from the beginning.
    """
    from finetune import checkpoint as ckpt_utils

    if args.resume is not None or not cfg.output_dir:
        return
    restarts = {k: int(os.environ.get(k) or 0) for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")}
    restarts = {k: v for k, v in restarts.items() if v > 0}
    if restarts and ckpt_utils.complete_checkpoints(ckpt_utils.checkpoints_dir(cfg.output_dir)):
        args.resume = "latest"
        if int(os.environ.get("RANK", "0")) == 0:
            why = ", ".join(f"{k}={v}" for k, v in restarts.items())
            print(f"finetune: restarted ({why}): resuming from the latest complete checkpoint in {cfg.output_dir}",
                  file=sys.stderr, flush=True)


def _train(cfg, resolved, launcher: str, stop) -> int:
    import torch

    from finetune import checkpoint as ckpt_utils
    from finetune import data as data_utils
    from finetune import distributed as dist_utils
    from finetune.ds_config import describe_precision
    from finetune.engine import build_engine, load_model_config, load_tokenizer
    from finetune.export import export_checkpoint
    from finetune.logs import logger, setup_logging, tensorboard_section
    from finetune.preemption import StopRequested
    from finetune.recipes import get_recipe
    from finetune.trainer import fit

    dist_utils.init(cfg.train.dist_timeout_minutes)
    run_dir = Path(cfg.output_dir)
    rank = dist_utils.rank()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist_utils.barrier()
    setup_logging(run_dir, rank)
    logger.info(dist_utils.describe())  # every rank's log: rank, world, local rank, launcher, host, pid
    try:
        recipe = get_recipe(cfg.recipe)
        ds = dict(resolved.ds)
        ds.setdefault("tensorboard", tensorboard_section(run_dir))
        tokenizer = load_tokenizer(cfg, recipe)
        if rank == 0:
            _write_run_folder(run_dir, cfg, ds, tokenizer, load_model_config(cfg), launcher)
        logger.info(f"run folder {run_dir}; world size {dist_utils.world_size()} ({launcher}); recipe {cfg.recipe}; "
                    f"DeepSpeed config {cfg.deepspeed}")
        logger.info("precision {precision} ({why})".format(**describe_precision(cfg, _on_cpu())))

        splits = data_utils.load_splits(recipe, cfg.recipe, tokenizer, cfg.data, cfg.train.seed)
        collator = recipe.make_collator(tokenizer, cfg.data)
        t = cfg.train
        train_dl = data_utils.train_loader(splits.train, collator, cfg.data, t.micro_batch_size, t.seed)
        eval_dl = data_utils.eval_loader(splits.validation, collator, cfg.data, t.micro_batch_size)
        steps_per_epoch = (train_dl.sampler.num_samples // t.micro_batch_size) // t.gradient_accumulation_steps
        if steps_per_epoch == 0:
            raise ConfigError(f"data.train_files: {len(splits.train)} training rows give no full global batch of "
                              f"{t.micro_batch_size} x {t.gradient_accumulation_steps} x {dist_utils.world_size()} "
                              f"rows; lower train.micro_batch_size or add data")
        total_steps = t.max_steps or t.epochs * steps_per_epoch
        logger.info(f"global batch {ds['train_batch_size']} rows = micro batch {t.micro_batch_size} x accumulation "
                    f"{t.gradient_accumulation_steps} x world size {dist_utils.world_size()}; {steps_per_epoch} "
                    f"steps/epoch; {total_steps} steps")

        built = build_engine(cfg, recipe, ds, total_steps)
        engine = built.engine
        state = ckpt_utils.TrainState()
        if resolved.resume_ckpt is not None:
            problem = ckpt_utils.check_compatible(resolved.resume_ckpt)
            if problem:
                raise ConfigError(problem)
            state = ckpt_utils.load(engine, resolved.resume_ckpt)

        stop.defer_to_loop()
        state = fit(cfg, engine, recipe, train_dl, eval_dl, state, total_steps, run_dir,
                    resume_from=resolved.resume_ckpt, stop_flag=stop.requested)
        if state.step < total_steps:  # fit stopped early on a signal; every rank agreed on the step
            logger.warning(f"stopped at step {state.step} of {total_steps}; resume with --resume (a requeued "
                           f"Slurm job resumes by itself)")
            return stop.exit_code()

        if cfg.export:
            ckpt = ckpt_utils.checkpoints_dir(run_dir) / f"step{state.step}"
            if rank == 0:
                export_checkpoint(ckpt, run_dir / "export", keep_previous=True)
            dist_utils.barrier()
            _verify_export(engine, splits.validation, collator, run_dir, ds)
            if cfg.train.sample_prompt and rank == 0 and hasattr(recipe, "greedy_sample"):
                sample = recipe.greedy_sample(run_dir / "export", cfg.train.sample_prompt)
                (run_dir / "sample.txt").write_text(sample + "\n")
                logger.info(f"greedy sample (sample.txt): {sample!r}")
        logger.info(f"done: {state.step} steps; run folder {run_dir}")
        return 0
    except (ConfigError, StopRequested):
        raise
    except BaseException as e:
        logger.exception(f"rank {rank} failed: {type(e).__name__}: {e}{_failure_hint(e)}")
        raise
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001  (best effort at shutdown)
                pass


def _failure_hint(e: BaseException) -> str:
    """Extra words for a failed rank's log line when a collective broke because another rank went away."""
    text = str(e)
    peer_gone = ("closed by peer", "Connection reset", "Broken pipe", "NCCL communicator was aborted",
                 "remote process exited", "timed out", "Timed out", "Timeout")
    if any(p in text for p in peer_gone):
        return (" (a collective failed: another rank probably died or hung; its logs/rank<r>.log and the "
                "launcher's output name it)")
    return ""


def _verify_export(engine, validation, collator, run_dir: Path, ds: dict) -> None:
    """Compare the export's logits with the engine's on a fixed batch; save both; fail an fp32 run beyond 1e-4."""
    import torch

    from finetune import distributed as dist_utils
    from finetune.config import load_run_config
    from finetune.export import plain_model_construction
    from finetune.logs import logger
    from finetune.recipes import get_recipe

    rows = [validation[i] for i in range(min(4, len(validation)))]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        batch = collator(rows)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    engine.eval()
    with torch.no_grad():
        ref = engine(**{k: v.to(engine.device) for k, v in inputs.items()}).logits.float().cpu()
    engine.train()
    if dist_utils.is_main():
        recipe = get_recipe(load_run_config(run_dir / "run_config.yaml").recipe)
        with plain_model_construction():
            exported = recipe.MODEL_CLASS.from_pretrained(run_dir / "export", local_files_only=True,
                                                          dtype=torch.float32).eval()
        with torch.no_grad():
            got = exported(**inputs).logits.float()
        diff = (got - ref).abs().max().item()
        torch.save({"inputs": inputs, "engine_logits": ref}, run_dir / "export_check.pt")
        (run_dir / "export_check.json").write_text(json.dumps({"max_abs_logit_diff": diff}))
        low_precision = ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled")
        logger.info(f"export check: max |logits(export) - logits(engine)| = {diff:.3g} on a fixed batch")
        if not low_precision and diff > 1e-4:
            raise RuntimeError(f"export check failed: exported logits differ from the engine's by {diff:.3g}")
    dist_utils.barrier()


def export_main(argv: list[str] | None = None) -> int:
    """``finetune export <checkpoint> <out>``: Hugging Face folder from a checkpoint."""
    p = argparse.ArgumentParser(prog="finetune export", description="Export a checkpoint as a Hugging Face folder.")
    p.add_argument("checkpoint", help="checkpoint folder, e.g. runs/x/checkpoints/step200")
    p.add_argument("out", help="new folder for config.json, tokenizer files and model.safetensors")
    p.add_argument("--run-dir", default=None, help="run folder (default: the checkpoint's grandparent)")
    args = p.parse_args(argv)
    from finetune.logs import setup_logging

    setup_logging(None, 0)
    try:
        from finetune.export import export_checkpoint

        export_checkpoint(args.checkpoint, args.out, args.run_dir)
    except ConfigError as e:
        return _error(e)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``finetune <train|export> ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train_main, "export": export_main}
    if not argv or argv[0] not in commands:
        print("usage: finetune {train,export} ...  (finetune train --help)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
