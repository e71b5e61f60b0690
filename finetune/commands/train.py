"""``finetune train`` (what ``deepspeed finetune/run.py`` runs): one launch of a training run.

The order of work, one call per step into the module that owns it::

    config + checks      finetune.preflight.validate.check_launch      every problem before any model (exit 2)
    process group        finetune.parallel.distributed.init
    run folder           finetune.lifecycle.run_folder.open_run / write_launch
    data                 finetune.data.dataset.build_train_data      tokenize (rank 0 first), samplers, loaders
    engine               finetune.engine.model.build_engine        model, LoRA, DeepSpeed
    before training      recipe.before_training              a pass with the initial weights (dpo's reference)
    resume               finetune.lifecycle.resume.settle / restore    verified checkpoint (universal copy on a new layout)
    fit                  finetune.training.trainer.fit                the loop: log, eval, checkpoint
    export + verify      finetune.lifecycle.export.export_and_verify   Hugging Face folder, checked against the engine
    sample               finetune.training.generation.write_sample    causal LMs with train.sample_prompt
    report               finetune.lifecycle.report.write_run_report    report.png

How a launch that does not finish ends (exit statuses, who prints) is :mod:`finetune.errors`.
"""

from __future__ import annotations

import argparse
import sys


from finetune import patches
from finetune.lifecycle import checkpoint as ckpt_utils
from finetune.parallel import distributed as dist_utils
from finetune.lifecycle import gguf_export, health
from finetune.parallel import layout, sequence
from finetune.data.dataset import build_train_data
from finetune.engine.ds_config import describe_precision
from finetune.engine.model import build_engine, load_model_config, load_tokenizer
from finetune.errors import ConfigError, RunFailure, StopRequested, TrainingDiverged
from finetune.errors import report as report_error
from finetune.lifecycle.export import export_and_verify
from finetune.training.generation import EvalGeneration, write_sample
from finetune.logs import StartupClock, logger, monitor_sections, setup_logging
from finetune.lifecycle.preemption import StopSignal
from finetune.recipes import recipe_for
from finetune.lifecycle.report import eval_answers, write_run_report
from finetune.lifecycle.resume import restore, settle
from finetune.lifecycle.run_folder import open_run, write_launch
from finetune.training.trainer import fit
from finetune.preflight.validate import Resolved, check_launch

USAGE_EXAMPLE = ("deepspeed --num_gpus 2 finetune/run.py --config finetune/recipes/configs/gpt_clm_wikitext2.yaml "
                 "train.lr=3e-5 ds.zero_optimization.stage=3")


def parser() -> argparse.ArgumentParser:
    """The command line of ``finetune train`` / ``finetune/run.py``."""
    p = argparse.ArgumentParser(prog="finetune train", description="Fine-tune a Hugging Face model with DeepSpeed.",
                                epilog=f"example: {USAGE_EXAMPLE}")
    p.add_argument("--config", required=True, help="run config (YAML or JSON)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-5 "
                   "ds.zero_optimization.stage=3 (precedence: defaults < file < these)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest complete checkpoint in output_dir (with output_root: of the "
                        "newest run under it), or from the given checkpoint or run folder")
    p.add_argument("--resume-allow-changes", action="store_true",
                   help="on --resume, continue even when the config changes what the run is (data, seed, global "
                        "batch, ...): printed as notes instead of refused")
    p.add_argument("--print-config", action="store_true",
                   help="run every check a launch runs, print the resolved run and DeepSpeed configs, exit "
                        "(status 2 and one line per problem when something is wrong)")
    p.add_argument("--check", action="store_true",
                   help="run every check a launch runs (config, files, model/tokenizer/data compatibility, "
                        "resume target) and exit: 0 when all is well, 2 with one line per problem")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``finetune/run.py`` and ``finetune train``. Returns the process exit status."""
    args = parser().parse_args(argv)
    try:
        cfg, resolved, launcher = check_launch(args.config, args.overrides, args.resume, args.resume_allow_changes,
                                               announce=not (args.print_config or args.check),
                                               weights=not (args.print_config or args.check))
        if args.print_config or args.check:
            return resolved.print_check(cfg, args.config, args.print_config)
    except ConfigError as e:
        return report_error(e)
    try:
        # SIGTERM/SIGUSR1: during start-up stop at once; once training runs, checkpoint and stop (preemption.py)
        with StopSignal() as stop:
            code = train(cfg, resolved, launcher, stop)
    except (ConfigError, RunFailure, TrainingDiverged, StopRequested) as e:
        code = report_error(e)
    return health.finish(code)  # this rank's exit status in its record (finetune/lifecycle/health.py), for the others


def export_step(engine, run_dir, state, cfg, ds: dict) -> tuple[int, dict]:
    """The step whose checkpoint is exported and why (``export_check.json``'s ``chosen_by``): ``train.keep_best``'s
    best one, loaded into the engine so that the export is checked against its logits (through its universal copy
    when it was saved with another world size, ZeRO stage or parallel layout: an elastic resume), or the last step.
    All ranks call it.

    Raises:
        RunFailure: the best checkpoint could not be converted or loaded.
    """
    kb, best = cfg.train.keep_best, state.best_step
    last = {"last_step": state.step, **({"early_stopping": cfg.train.early_stopping.metric} if state.early_stopped
                                        else {})}
    if not kb.metric:
        return state.step, last
    chosen = {"keep_best": {"metric": kb.metric, "mode": kb.mode, "value": state.best_value, "step": best}}
    if best < 0:
        logger.warning(f"train.keep_best: no evaluation gave a finite {kb.metric}; exporting the last step {state.step}")
        return state.step, {**last, "keep_best": {"metric": kb.metric, "unavailable": "no finite evaluation"}}
    if best == state.step:
        return best, chosen
    ckpt = ckpt_utils.checkpoints_dir(run_dir) / f"step{best}"
    why = None if ckpt_utils.is_complete(ckpt) else f"the best checkpoint {ckpt} is missing or incomplete"
    lay = layout.layout(cfg)
    now = (lay.world, engine.zero_optimization_stage(), lay.sp, lay.tp)
    universal = why is None and ckpt_utils.saved_layout(ckpt) != now
    if universal:
        problems, _, _ = ckpt_utils.resume_layout(ckpt, lay.world, ds, lay.pp)
        why = problems[0].replace("--resume: ", "") if problems else None
        universal = ckpt_utils.is_sharded(ckpt)  # a ZeRO-0 fp32 checkpoint loads on any layout as it is
    if why:
        logger.warning(f"train.keep_best: cannot load the best checkpoint (step {best}): {why}; exporting the last "
                       f"step {state.step} instead")
        return state.step, {**last, "keep_best": {"metric": kb.metric, "best_step": best, "unavailable": why}}
    if universal:
        copy = ckpt_utils.to_universal(ckpt)
        with ckpt_utils.universal_loading(engine):
            ckpt_utils.load(engine, ckpt, copy, what="train.keep_best: loaded the best checkpoint (universal copy)")
    else:
        ckpt_utils.load(engine, ckpt, what="train.keep_best: loaded the best checkpoint")
    logger.info(f"train.keep_best: exporting step {best} ({kb.metric}={state.best_value:.6g}), not the last step "
                f"{state.step}")
    return best, chosen


def train(cfg, resolved: Resolved, launcher: str, stop: StopSignal) -> int:
    """One launch after its checks passed, from the process group to the report. Returns the exit status."""
    clock = StartupClock()
    clock.mark("imports and checks")
    dist_utils.init(cfg.train.dist_timeout_minutes, cfg.train.op_build_dir)
    clock.mark("process group")
    opened = open_run(cfg)  # rank 0 creates/locks the folder; refused launches raise here, having written nothing
    run_dir, rank = opened.run_dir, dist_utils.rank()
    try:
        setup_logging(run_dir, rank)
        logger.info(dist_utils.describe())  # every rank's log: rank, world, local rank, launcher, host, pid
        # heartbeat/exit-status record read by the other ranks when one fails; faulthandler into the rank's log
        health.start(run_dir / "launches" / str(opened.launch) / "ranks", run_dir / "logs" / f"rank{rank}.log")
        for note in resolved.resume_notes:
            logger.warning(note)
        resolved = settle(resolved, run_dir, opened.launch)  # checkpoint hashes, later steps set aside: no model yet
        recipe = recipe_for(cfg)
        ds = monitor_sections(resolved.ds, run_dir)  # TensorBoard, and csv/wandb (offline) when enabled
        tokenizer, model_config = load_tokenizer(cfg, recipe), load_model_config(cfg, recipe)
        precision = describe_precision(cfg, dist_utils.on_cpu())
        if rank == 0:
            write_launch(run_dir, opened.launch, cfg, ds, tokenizer, model_config, launcher, precision,
                         dist_utils.world_size())
            print(f"finetune: run folder {run_dir} (launch {opened.launch})", file=sys.stderr, flush=True)
        logger.info(f"run folder {run_dir} (launch {opened.launch}); world size {dist_utils.world_size()} "
                    f"({launcher}); recipe {cfg.recipe}; DeepSpeed config {cfg.deepspeed}")
        logger.info("precision {precision} ({why})".format(**precision))

        clock.mark("run folder, tokenizer")
        data = build_train_data(recipe, cfg, tokenizer)
        clock.mark("data")
        lay = layout.layout(cfg)
        global_batch = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * lay.dp
        logger.info(f"global batch {global_batch} rows = micro batch {cfg.train.micro_batch_size} x "
                    f"accumulation {cfg.train.gradient_accumulation_steps} x data-parallel size {lay.dp}; "
                    f"{data.steps_per_epoch} steps/epoch; {data.total_steps} steps; {lay.describe()}")
        # start-up's freed heap (validation, tokenization) back to the OS; CPU ranks: no page-fault churn per step
        allocator = health.prepare_host_memory(dist_utils.on_cpu())
        if allocator:
            logger.info(f"host allocator: {allocator}; {dist_utils.set_cpu_threads()}")
        health.memory_mark("before_model")  # host memory before/after: what `finetune plan` is checked against
        engine = build_engine(cfg, recipe, model_config, ds, data.total_steps).engine
        ckpt_utils.check_free_space(run_dir, engine)
        clock.mark("model and engine")
        data = recipe.before_training(engine, data, cfg)  # initial weights (dpo: reference log-probabilities)
        state = restore(engine, resolved, cfg, data.total_steps)
        clock.mark("before training and resume")
        logger.info(clock.summary())

        stop.defer_to_loop()
        generation = EvalGeneration(tokenizer, recipe, cfg) if cfg.train.eval_generate.prompts else None
        state = fit(cfg, engine, recipe, data.train_loader, data.eval_loader, state, data.total_steps, run_dir,
                    resume_from=resolved.resume_ckpt, stop_flag=stop.requested, launch=opened.launch,
                    generation=generation)
        health.memory_mark("trained")
        # what training freed (activations, gradient buckets) goes back to the OS before the export allocates
        health.release_host_memory()
        if state.step < data.total_steps and not state.early_stopped:  # a signal stopped it; all ranks agreed
            logger.warning(f"stopped at step {state.step} of {data.total_steps}; resume with --resume (a requeued "
                           f"Slurm job resumes by itself)")
            return stop.exit_code()

        if cfg.export:
            with sequence.sequence_parallel_off():  # whole sequences on every rank, checked against the export
                step, chosen_by = export_step(engine, run_dir, state, cfg, ds)
                export_and_verify(engine, run_dir, step, data.splits.validation, data.collator, ds, recipe,
                                  chosen_by=chosen_by)
        if rank == 0 and cfg.export and cfg.export_gguf:  # llama.cpp's file beside the checked export
            try:
                gguf_export.export_gguf(run_dir / "export", run_dir / "export", cfg.export_gguf,
                                        check=cfg.export_gguf_check)
            except ConfigError as e:
                raise RunFailure(f"{e}; the Hugging Face export in {run_dir / 'export'} is complete and checked")
        if rank == 0:
            summary = write_run_report(run_dir)
            if summary:
                logger.info(f"evaluation: {summary}")
            for line in eval_answers(run_dir):  # grpo: a few held-out greedy answers, before and after
                logger.info(line)
            if cfg.export and cfg.train.sample_prompt and recipe.capabilities.generates_text:
                with sequence.sequence_parallel_off():
                    sample = write_sample(run_dir, cfg)
                logger.info(f"{'sample' if cfg.train.sample_temperature > 0 else 'greedy sample'} (sample.txt): "
                            f"{sample!r}")
        logger.info(f"done: {state.step} steps; run folder {run_dir}")
        return 0
    except (ConfigError, StopRequested):
        raise
    except (TrainingDiverged, RunFailure) as e:
        logger.error(f"rank {rank}: {e}")
        raise
    except BaseException as e:
        health.failed(e)  # first, so that the other ranks' diagnosis finds it
        logger.exception(f"rank {rank} failed: {type(e).__name__}: {e}{health.failure_hint(e)}")
        raise
    finally:
        if opened.lock is not None:
            opened.lock.release()
        dist_utils.shutdown()
        patches.restore_all()  # the libraries' own objects again, whoever runs next in this process
