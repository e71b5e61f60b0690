"""Command line: ``finetune train`` (what ``finetune/run.py`` runs) and ``finetune export``; ``finetune plan``,
``finetune doctor`` and ``finetune report`` live in their own modules (``finetune/plan.py``, ...), dispatched here.

``train`` order of work: parse and merge the config, discover rank/world, validate everything (no
model yet; errors exit with status 2 and one line per problem), start the process group, write the
run folder, tokenize (rank 0 first), build the engine, resume, train, export.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
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
                   help="continue from the latest complete checkpoint in output_dir (with output_root: of the "
                        "newest run under it), or from the given checkpoint or run folder")
    p.add_argument("--resume-allow-changes", action="store_true",
                   help="on --resume, continue even when the config changes what the run is (data, model, seed, "
                        "global batch, ...): printed as notes instead of refused")
    p.add_argument("--print-config", action="store_true",
                   help="run every check a launch runs, print the resolved run and DeepSpeed configs, exit "
                        "(status 2 and one line per problem when something is wrong)")
    p.add_argument("--check", action="store_true",
                   help="run every check a launch runs (config, files, model/tokenizer/data compatibility, "
                        "resume target) and exit: 0 when all is well, 2 with one line per problem")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _git_hash() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _write_run_folder(run_dir: Path, launch_no: int, cfg, ds: dict, tokenizer, model_config, launcher: str,
                      precision: dict) -> None:
    """Rank 0: this launch's record (``launches/<n>/``: run config, DeepSpeed config, meta) and, for a new run,
    the model config and tokenizer the export is built from. Nothing an earlier launch wrote is rewritten."""
    import deepspeed
    import torch
    import transformers

    from finetune.distributed import world_size
    from finetune.export import MODEL_META
    from finetune.run_folder import slurm_job_id, write_launch_record

    meta = {"launch": launch_no, "command": shlex.join([sys.executable] + sys.argv), "cwd": os.getcwd(),
            "git": _git_hash(), "launcher": launcher, "world_size": world_size(), "host": platform.node(),
            "pid": os.getpid(), "slurm_job_id": slurm_job_id(), "precision": precision,
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()}}
    write_launch_record(run_dir, launch_no, {"run_config.yaml": dump_yaml(config_to_dict(cfg)),
                                             "ds_config.json": json.dumps(ds, indent=2),
                                             "meta.json": json.dumps(meta, indent=2)})
    if not (run_dir / MODEL_META / "config.json").is_file():
        model_config.save_pretrained(run_dir / MODEL_META)
        tokenizer.save_pretrained(run_dir / MODEL_META)


RANK0_REPORT_GRACE_S = 10.0
"""Seconds a rank other than 0 waits before leaving after an error that rank 0 reports (:func:`_error`)."""


def _let_rank0_report() -> None:
    """On ranks other than 0, wait :data:`RANK0_REPORT_GRACE_S` before exiting after an error only rank 0 prints.

    Every rank meets the same bad input, but only rank 0 prints it (one line, not one per rank). A launcher that
    stops all ranks when the first one fails (``deepspeed``, ``torchrun``, ``mpirun``) would otherwise kill rank 0
    before it prints whenever another rank gets there first (seen on 2 busy cores: the refused launch of
    ``tests/test_run_folder.py`` ended with no error line). When rank 0 exits, such a launcher ends this rank at
    once, so the wait costs nothing there; elsewhere it delays the failed launch's end by at most this long.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(RANK0_REPORT_GRACE_S)


def _error(e: ConfigError) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        for line in e.problems:
            print(f"finetune: error: {line}", file=sys.stderr, flush=True)
    _let_rank0_report()
    return 2


def _unless_about(problems: list[str], load_problems: list[str]) -> list[str]:
    """``problems`` without those about a key that already has a load problem (``key: ...``): a key given with
    the wrong type keeps its default, and a second line about that default would only confuse."""
    keys = {p.split(":", 1)[0] for p in load_problems if re.match(r"^[\w.]+: ", p)}
    return [p for p in problems if p.split(":", 1)[0] not in keys]


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of ``finetune/run.py`` and ``finetune train``. Returns the process exit status."""
    args = _train_parser().parse_args(argv)
    from finetune import distributed as dist_utils
    from finetune.run_folder import resolve_output_dir

    try:
        load_problems: list[str] = []
        cfg = load_run_config(args.config, args.overrides, problems=load_problems)
        launcher = dist_utils.export_rank_env()
        from finetune.validate import validate_run

        args.resume, note = resolve_output_dir(cfg, args.resume)
        if note and dist_utils.rank() == 0 and not (args.print_config or args.check):
            print(f"finetune: {note}", file=sys.stderr, flush=True)
        try:
            resolved = validate_run(cfg, args.resume, dist_utils.world_size(), dist_utils.on_cpu(),
                                    args.resume_allow_changes)
        except ConfigError as e:
            raise ConfigError(load_problems + _unless_about(e.problems, load_problems)) from e
        if load_problems:
            raise ConfigError(load_problems)
        if args.print_config or args.check:
            if dist_utils.rank() == 0:
                if args.print_config:
                    print(dump_yaml({**config_to_dict(cfg), "resolved_deepspeed": resolved.ds}))
                else:
                    print(f"finetune: {args.config}: no problems found (world size {dist_utils.world_size()}"
                          f"{f'; resume from {resolved.resume_ckpt}' if resolved.resume_ckpt else ''})")
                for note in resolved.resume_notes:
                    print(f"finetune: {note}")
            return 0
    except ConfigError as e:
        return _error(e)
    from finetune import health
    from finetune.preemption import StopRequested, StopSignal
    from finetune.trainer import TrainingDiverged

    try:
        # SIGTERM/SIGUSR1: during start-up stop at once; once training runs, checkpoint and stop (preemption.py)
        with StopSignal() as stop:
            code = _train(cfg, resolved, launcher, stop)
    except ConfigError as e:
        code = _error(e)
    except TrainingDiverged as e:
        if dist_utils.rank() == 0:
            print(f"finetune: error: {e}", file=sys.stderr, flush=True)
        _let_rank0_report()
        code = 3
    except StopRequested as e:
        print(f"finetune: rank {dist_utils.rank()} {e}", file=sys.stderr, flush=True)
        code = 128 + e.signum
    return health.finish(code)  # this rank's exit status in its record (finetune/health.py), for the others


def _train(cfg, resolved, launcher: str, stop) -> int:
    import torch

    from finetune import checkpoint as ckpt_utils
    from finetune import data as data_utils
    from finetune import distributed as dist_utils
    from finetune import health
    from finetune import resume as resume_policy
    from finetune.ds_config import describe_precision
    from finetune.engine import build_engine, load_model_config, load_tokenizer
    from finetune.export import export_checkpoint, verify_export
    from finetune.logs import logger, monitor_sections, setup_logging
    from finetune.preemption import StopRequested
    from finetune.recipes import get_recipe
    from finetune.run_folder import open_run
    from finetune.trainer import TrainingDiverged, fit

    dist_utils.init(cfg.train.dist_timeout_minutes)
    opened = open_run(cfg)  # rank 0 creates/locks the folder; refused launches raise here, having written nothing
    run_dir, rank = opened.run_dir, dist_utils.rank()
    try:
        setup_logging(run_dir, rank)
        logger.info(dist_utils.describe())  # every rank's log: rank, world, local rank, launcher, host, pid
        # heartbeat/exit-status record read by the other ranks when one fails; faulthandler into the rank's log
        health.start(run_dir / "launches" / str(opened.launch) / "ranks", run_dir / "logs" / f"rank{rank}.log")
        for note in resolved.resume_notes:
            logger.warning(note)
        recipe = get_recipe(cfg.recipe)
        ds = monitor_sections(resolved.ds, run_dir)  # TensorBoard, and csv/wandb (offline) when enabled
        tokenizer = load_tokenizer(cfg, recipe)
        precision = describe_precision(cfg, dist_utils.on_cpu())
        if rank == 0:
            _write_run_folder(run_dir, opened.launch, cfg, ds, tokenizer, load_model_config(cfg), launcher, precision)
            print(f"finetune: run folder {run_dir} (launch {opened.launch})", file=sys.stderr, flush=True)
        logger.info(f"run folder {run_dir} (launch {opened.launch}); world size {dist_utils.world_size()} "
                    f"({launcher}); recipe {cfg.recipe}; DeepSpeed config {cfg.deepspeed}")
        logger.info("precision {precision} ({why})".format(**precision))

        data = data_utils.build_train_data(recipe, cfg, tokenizer)
        splits, collator, train_dl, eval_dl = data.splits, data.collator, data.train_loader, data.eval_loader
        steps_per_epoch, total_steps, t = data.steps_per_epoch, data.total_steps, cfg.train
        logger.info(f"global batch {ds['train_batch_size']} rows = micro batch {t.micro_batch_size} x accumulation "
                    f"{t.gradient_accumulation_steps} x world size {dist_utils.world_size()}; {steps_per_epoch} "
                    f"steps/epoch; {total_steps} steps")

        # start-up's freed heap (validation, tokenization) back to the OS; CPU ranks: no page-fault churn per step
        allocator = health.prepare_host_memory(dist_utils.on_cpu())
        if allocator:
            logger.info(f"host allocator: {allocator}")
        health.memory_mark("before_model")  # host memory before/after: what `finetune plan` is checked against
        built = build_engine(cfg, recipe, ds, total_steps)
        engine = built.engine
        ckpt_utils.check_free_space(run_dir, engine)
        state = ckpt_utils.TrainState()
        if resolved.resume_ckpt is not None:
            # another world size or ZeRO stage: rank 0 converts once (a universal copy beside the checkpoint)
            universal = ckpt_utils.to_universal(resolved.resume_ckpt) if resolved.universal else None
            state = ckpt_utils.load(engine, resolved.resume_ckpt, universal)
            old = ckpt_utils.saved_config(resolved.resume_ckpt)
            if old is not None:
                resume_policy.apply(engine, old, cfg, total_steps)

        stop.defer_to_loop()
        state = fit(cfg, engine, recipe, train_dl, eval_dl, state, total_steps, run_dir,
                    resume_from=resolved.resume_ckpt, stop_flag=stop.requested, launch=opened.launch)
        health.memory_mark("trained")
        # what training freed (activations, gradient buckets: kept by the CPU ranks' allocator settings) goes back
        # to the OS before the export, its check and the report allocate their own
        health.release_host_memory()
        if state.step < total_steps:  # fit stopped early on a signal; every rank agreed on the step
            logger.warning(f"stopped at step {state.step} of {total_steps}; resume with --resume (a requeued "
                           f"Slurm job resumes by itself)")
            return stop.exit_code()

        if cfg.export:
            ckpt = ckpt_utils.checkpoints_dir(run_dir) / f"step{state.step}"
            if rank == 0:
                export_checkpoint(ckpt, run_dir / "export", keep_previous=True)
            dist_utils.barrier()
            verify_export(engine, splits.validation, collator, run_dir, ds, recipe)
            if cfg.train.sample_prompt and rank == 0 and recipe.MODEL_CLASS.__name__ == "AutoModelForCausalLM":
                from finetune.generation import sample_text

                t = cfg.train
                sample = sample_text(run_dir / "export", t.sample_prompt, t.sample_tokens, t.sample_temperature,
                                     t.sample_top_k, t.seed)
                (run_dir / "sample.txt").write_text(sample + "\n")
                logger.info(f"{'sample' if t.sample_temperature > 0 else 'greedy sample'} (sample.txt): {sample!r}")
        if rank == 0:
            _write_report(run_dir)
        logger.info(f"done: {state.step} steps; run folder {run_dir}")
        return 0
    except (ConfigError, StopRequested):
        raise
    except TrainingDiverged as e:
        logger.error(f"rank {rank}: {e}")
        raise
    except BaseException as e:
        health.failed(e)  # first, so that the other ranks' diagnosis finds it
        logger.exception(f"rank {rank} failed: {type(e).__name__}: {e}{_failure_hint(e)}")
        raise
    finally:
        if opened.lock is not None:
            opened.lock.release()
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001  (best effort at shutdown)
                pass


def _write_report(run_dir: Path) -> None:
    """``run_dir/report.png`` (finetune/report.py); a report that cannot be drawn is a warning, not a failed run."""
    from finetune.logs import logger
    from finetune.report import write_report

    skipped: dict[str, int] = {}
    try:
        logger.info(f"report {write_report([run_dir], run_dir / 'report.png', skipped)}")
        if skipped.get(str(run_dir)):
            logger.warning(f"metrics.jsonl: {skipped[str(run_dir)]} damaged line(s) skipped in report.png (torn by a "
                           f"kill or a full disk)")
    except Exception as e:  # noqa: BLE001  (matplotlib or a damaged metrics.jsonl must not fail a finished run)
        logger.warning(f"report.png not written (an older one is stale): {type(e).__name__}: {e}")


def _failure_hint(e: BaseException) -> str:
    """Extra words for a failed rank's log line when a collective broke because another rank went away:
    which rank, from the ranks' heartbeat/exit-status records (finetune/health.py; waits up to ~15 s)."""
    from finetune import health

    if not health.is_peer_failure(e):
        return ""
    who = health.diagnose() or "another rank probably died or hung (no rank records yet); see the launcher's output"
    return f" (a collective failed because of another rank: {who})"


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


def _lazy(module: str):
    """``main`` of ``finetune.<module>`` (a command in its own module), imported only when it runs."""
    def run(argv):
        import importlib

        return importlib.import_module(f"finetune.{module}").main(argv)
    return run


def main(argv: list[str] | None = None) -> int:
    """``finetune <train|export|plan|doctor|report> ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train_main, "export": export_main, "plan": _lazy("plan"), "doctor": _lazy("doctor"),
                "report": _lazy("report")}
    if not argv or argv[0] not in commands:
        print(f"usage: finetune {{{','.join(commands)}}} ...  (finetune train --help)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
