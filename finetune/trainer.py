"""The one training loop every recipe shares.

Per optimizer step, on every rank::

    micro = [next(batches) for _ in range(gradient_accumulation_steps)]
    N, stop = all_reduce([sum(count_targets(b.labels) for b in micro), stop signal here?])  # the step's collective
    if stop: save a checkpoint of the last step, return
    for b in micro:
        out = recipe.forward(engine, b)                                 # batch -> loss sum (recipe runs the model)
        loss = out.loss_sum * world * gas / N                           # summed token loss, token-weighted
        engine.backward(loss)                                           # DeepSpeed divides by gas ...
        engine.step()                                                   # ... and averages over ranks
    bad = not engine.was_step_applied()                                 # the same on every rank, no collective

One small all-reduce per step (the target count and the stop signal together; none at all with
``loss_weighting: micro_batch`` and no stop signal to watch), plus one on logged steps for the log totals:
each is a synchronisation point of all ranks, and on GPUs a wait of the host for the device.

Token-weighted loss (``train.loss_weighting: token``, default). DeepSpeed averages gradients with equal
weight per micro-batch and per rank, which is not the gradient of the mean over all target tokens when
micro-batches hold different numbers of targets (padding, MLM masking): the gradient-accumulation loss
bug transformers fixed in 2024 (``num_items_in_batch``). Here each micro-batch loss is
``sum_i l_i * (W * G) / N`` (``W`` ranks, ``G`` accumulation steps, ``N`` targets in the whole global
batch); after DeepSpeed's ``1/G`` scaling and ``1/W`` averaging the gradient is exactly
``grad(sum over all targets l_i / N)``, as one device would compute on the whole global batch.
``loss_weighting: micro_batch``: each micro-batch loss is its own mean (``sum_i l_i / n_micro``) and the
optimized loss is the mean of those means, DeepSpeed's plain behaviour.
The loss sum comes from the recipe (``forward``: "batch -> loss sum", see :mod:`finetune.recipes`), never from
the model: models do not all honour ``num_items_in_batch`` (``BertForMaskedLM`` ignores it and always returns
its own mean); the LM recipes run the output head and the cross-entropy at target positions only.

Non-finite steps. A step whose global gradient norm is not finite (a non-finite loss on any rank makes it
so) is skipped: ZeRO 1-3 skip it themselves (DeepSpeed's check of the global norm; for ZeRO 1/2 in bf16 it
needs ``check_grad_overflow``, kept on in ``engine.build_engine``); at stage 0 the loop checks the all-reduced gradient norm before ``engine.step`` and
makes that step a no-op. Either way ``engine.was_step_applied()`` says so, alike on every rank.
Skipped steps are counted (``train/bad_steps``); ``train.max_bad_steps`` in a row raise
:class:`TrainingDiverged`. The position in the epoch is counted in rows of the global order
(``TrainState.samples_in_epoch``), so a resume with another micro-batch split continues at the next row.

Logging every ``train.log_every`` steps: train loss (mean over the logged steps of the global-batch loss),
learning rate, gradient norm (before clipping), tokens/s (non-pad tokens of all ranks over wall time) and
per device, non-pad tokens trained so far, the padding ratio (real tokens / positions), the step-time split of
the logged step (data wait, forward, backward, optimizer; timed on that step only, so the others run without
extra synchronisation) and MFU on known GPUs (:class:`finetune.logs.StepMeter`). The progress bar shows loss,
tokens/s per device, padding ratio and MFU. Each epoch's padding ratio goes to the log at its end.
Evaluation every ``train.eval_every`` steps, at the end, and at step 0 with ``train.eval_on_start``;
checkpoints every ``train.save_every`` steps and at the end, keeping the newest
``train.keep_last_checkpoints`` (and the one resumed from).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from finetune import checkpoint as ckpt_utils
from finetune.batch import to_device
from finetune import distributed as dist_utils
from finetune.checkpoint import TrainState
from finetune.config import RunConfig, config_to_dict
from finetune.errors import TrainingDiverged
from finetune.logs import MetricsSink, StepMeter, logger


def _rng_fork(device):
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda")


@torch.no_grad()
def evaluate(engine, loader, recipe, cfg: RunConfig, artefacts: dict | None = None) -> dict[str, float]:
    """Token-weighted eval loss, perplexity and the recipe's extra metrics over the validation split.

    MLM masks are seeded per validation row (``finetune.data.eval_loader``), so they are the same at every
    evaluation; it runs under a forked RNG seeded with ``train.seed`` so the training RNG stream is
    untouched. All ranks must call it (ZeRO-3 gathers parameters).

    The recipe's ``forward(..., metrics=True)`` gives the loss sum, target count and extra metric sums; recipes
    returning ``counts`` (seq_cls: confusion matrix) turn their total into metrics with ``eval_report``, and
    their artefacts (name -> JSON-able dict) are put into ``artefacts`` when it is given.

    Returns:
        ``{"eval/loss": float, "eval/perplexity": float, "eval/<metric>": float, ...}``.
    """
    engine.eval()
    device = engine.device
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=device))
    counts = None
    with _rng_fork(device):
        torch.manual_seed(cfg.train.seed)
        for i, batch in enumerate(loader):
            if cfg.train.eval_max_batches and i >= cfg.train.eval_max_batches:
                break
            out = recipe.forward(engine, to_device(batch, device), metrics=True)
            sums["loss"] += out.loss_sum.double()
            sums["targets"] += out.targets
            for name, (num, den) in out.metrics.items():
                sums[f"{name}/num"] += num
                sums[f"{name}/den"] += den
            if out.counts is not None:
                counts = out.counts.double() if counts is None else counts + out.counts.double()
    names = sorted(sums)
    totals = dist_utils.all_reduce_sum(torch.stack([sums[n] for n in names])).tolist()
    total = dict(zip(names, totals))
    engine.train()
    loss = total["loss"] / max(total["targets"], 1.0)
    metrics = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 80.0))}
    for n in names:
        if n.endswith("/num"):
            base = n[: -len("/num")]
            metrics[f"eval/{base}"] = total[n] / max(total[f"{base}/den"], 1.0)
    if counts is not None:
        model_config = getattr(engine.module, "config", None)
        extra, made = recipe.eval_report(dist_utils.all_reduce_sum(counts).cpu(), model_config)
        metrics.update({f"eval/{k}": v for k, v in extra.items()})
        if artefacts is not None:
            artefacts.update(made)
    return metrics


def _eval_and_log(engine, eval_dl, recipe, cfg: RunConfig, sink: MetricsSink, step: int, what: str) -> None:
    """Evaluate (all ranks), then write scalars and artefacts (rank 0) and one log line."""
    artefacts: dict = {}
    metrics = evaluate(engine, eval_dl, recipe, cfg, artefacts)
    sink.write(step, metrics)
    sink.write_artefacts(step, artefacts)
    logger.info(f"{what} {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))


def _grad_norm_stage0(engine) -> float:
    """Global gradient norm, accumulated in fp64 as ZeRO 1-3 compute theirs (fp32 sums drift ~1e-5 on big tensors)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).norm())


def _skip_update_stage0(engine) -> None:
    """Make the coming ``engine.step()`` a no-op at ZeRO stage 0 (ZeRO 1-3 skip non-finite steps themselves).

    The optimizer's ``step`` is shadowed by a no-op for this one call (no AdamW moment, weight-decay or
    parameter change), and an ``overflow`` flag on it makes DeepSpeed count the step as skipped and hold the
    LR schedule, exactly as its ZeRO optimizers do on an overflow; DeepSpeed still clears the gradients.
    :func:`_end_skip_stage0` removes both after the step.
    """
    engine.optimizer.step = lambda *args, **kwargs: None
    engine.optimizer.overflow = True


def _end_skip_stage0(engine) -> None:
    for name in ("step", "overflow"):
        if name in vars(engine.optimizer):
            delattr(engine.optimizer, name)


def _log_epoch_padding(meter: StepMeter, epoch: int, note: str) -> None:
    """Log the padding ratio of the epoch's steps trained in this launch (all ranks: one all-reduce)."""
    tokens, positions = dist_utils.all_reduce_sum(meter.epoch.clone()).tolist()
    meter.epoch.zero_()
    if positions:
        logger.info(f"epoch {epoch}{note}: padding ratio {tokens / positions:.3f} (real tokens / positions: "
                    f"{tokens:,.0f} / {positions:,.0f})")


def fit(cfg: RunConfig, engine, recipe, train_dl, eval_dl, state: TrainState, total_steps: int,
        run_dir: Path, resume_from: Path | None = None, stop_flag=None, launch: int = 1) -> TrainState:
    """Train until ``total_steps`` optimizer steps, evaluating, logging and checkpointing on the way.

    Args:
        cfg: run config.
        engine: DeepSpeed engine.
        recipe: recipe module.
        train_dl: training loader whose sampler is a ``ResumableDistributedSampler``.
        eval_dl: validation loader.
        state: where to start (from a checkpoint or fresh).
        total_steps: optimizer steps of the whole run.
        run_dir: run folder (metrics, checkpoints).
        resume_from: checkpoint whose RNG states to restore once the first batch iterator exists.
        stop_flag: callable returning True when this rank was asked to stop (signal); checked every
            step and agreed on by all ranks, then a checkpoint is saved and the loop returns early.
        launch: this launch's number in the run folder (marks its ``metrics.jsonl`` rows).

    Returns:
        The final :class:`TrainState`.

    Raises:
        TrainingDiverged: ``train.max_bad_steps`` consecutive steps had a non-finite loss or gradient
            norm. Each such step is skipped (no parameter update) and counted; nothing is saved or
            exported from the state the run stops in.
    """
    t = cfg.train
    gas, world, device = t.gradient_accumulation_steps, dist_utils.world_size(), engine.device
    token_weighted = t.loss_weighting == "token"
    sampler = train_dl.sampler
    step_rows = t.micro_batch_size * gas  # rows per rank per optimizer step
    epoch_rows = sampler.num_samples  # rows per rank per epoch
    sink = MetricsSink(engine, run_dir, enabled=dist_utils.is_main(), launch=launch)
    stage0 = engine.zero_optimization_stage() == 0
    last_saved = state.step if resume_from else -1
    save_kw = {"keep_last": t.keep_last_checkpoints, "protect": resume_from}  # never prune the resumed-from one
    bad_in_a_row = 0
    # Running sums since the last log line: [loss of each good step, good steps]; tokens and positions: meter
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    meter = StepMeter(engine.module, device, world, half_precision=engine.bfloat16_enabled() or engine.fp16_enabled())
    t_log = time.perf_counter()
    pbar = tqdm(total=total_steps, initial=state.step, disable=not dist_utils.is_main(), desc="train",
                dynamic_ncols=True)
    engine.train()
    if t.eval_on_start and state.step == 0 and resume_from is None:
        _eval_and_log(engine, eval_dl, recipe, cfg, sink, 0, "eval before training, step")
        t_log = time.perf_counter()

    while state.step < total_steps:
        done = state.samples_in_epoch // world  # this rank's rows of the epoch already trained on
        sampler.set_epoch(state.epoch, skip=done)
        getattr(train_dl.collate_fn, "set_epoch", lambda epoch: None)(state.epoch)  # MLM masks: (seed, epoch, row)
        batches = iter(train_dl)
        if resume_from is not None:  # after the iterator draws its seed, exactly as in the original run
            ckpt_utils.restore_rng_state(resume_from)
            resume_from = None
        while done + step_rows <= epoch_rows and state.step < total_steps:
            log_now = (state.step + 1) % t.log_every == 0 or state.step + 1 == total_steps
            meter.begin(sample=log_now)
            micro = [next(batches) for _ in range(gas)]
            meter.lap("data_wait")
            # One all-reduce for both: this step's targets on all ranks, a stop signal on any rank.
            head = torch.zeros(2, dtype=torch.float32, device=device)
            if token_weighted:
                head[0] = torch.stack([recipe.count_targets(b["labels"]) for b in micro]).sum()
            if stop_flag is not None:
                head[1] = float(stop_flag())
            if token_weighted or stop_flag is not None:
                head = dist_utils.all_reduce_sum(head)
            denom = head[0].clamp(min=1.0) / (world * gas)
            if stop_flag is not None and head[1].item() > 0:  # the rows drawn for this step are trained on resume
                if last_saved != state.step:
                    ckpt_utils.save(engine, run_dir, state, config_to_dict(cfg), **save_kw)
                logger.warning(f"stop requested: checkpoint of step {state.step} saved, leaving the loop")
                pbar.close()
                return state
            grad_norm = None
            step_loss = torch.zeros((), dtype=torch.float64, device=device)
            for i, batch in enumerate(micro):
                batch = to_device(batch, device)
                out = recipe.forward(engine, batch)  # the recipe runs the model on everything but the labels
                norm = denom if token_weighted else out.targets.clamp(min=1)
                loss = out.loss_sum / norm
                meter.lap("forward")
                engine.backward(loss)
                meter.lap("backward")
                if stage0 and i == gas - 1:  # grads are all-reduced: the same norm on every rank
                    grad_norm = _grad_norm_stage0(engine)  # DeepSpeed keeps no norm at stage 0
                    if not math.isfinite(grad_norm):
                        _skip_update_stage0(engine)
                engine.step()
                meter.lap("optimizer")
                step_loss += loss.detach().double() / gas
                meter.count(batch)  # non-pad tokens (attention mask, or num_tokens of packed rows), positions
            if stage0:
                _end_skip_stage0(engine)
            state.step += 1
            state.samples_in_epoch += step_rows * world
            done += step_rows
            pbar.update(1)

            if not engine.was_step_applied():  # the global gradient norm was not finite: no update
                state.bad_steps += 1
                bad_in_a_row += 1
                logger.warning(f"step {state.step}: non-finite loss or gradient norm; update skipped "
                               f"({bad_in_a_row} in a row; the run stops at train.max_bad_steps={t.max_bad_steps})")
                if bad_in_a_row >= t.max_bad_steps:
                    pbar.close()
                    last = ckpt_utils.complete_checkpoints(ckpt_utils.checkpoints_dir(run_dir))
                    raise TrainingDiverged(
                        f"training diverged: {bad_in_a_row} consecutive optimizer steps up to step {state.step} had "
                        f"a non-finite loss or gradient norm (train.max_bad_steps={t.max_bad_steps}); nothing was "
                        f"saved or exported from this state; last good checkpoint: "
                        f"{last[-1] if last else 'none'}; lower train.lr or check the data")
            else:
                bad_in_a_row = 0
                acc[0] += step_loss
                acc[1] += 1

            if log_now:
                totals = dist_utils.all_reduce_sum(torch.cat([acc, meter.window]))
                elapsed = time.perf_counter() - t_log
                steps = totals[1].item() / world
                if grad_norm is None:
                    gn = engine.get_global_grad_norm()
                    grad_norm = float(gn) if gn is not None else float("nan")
                tokens, positions, rows = totals[2:].tolist()
                state.tokens_seen += int(tokens)
                scalars = {"train/loss": totals[0].item() / world / steps if steps else float("nan"),
                           "train/lr": engine.get_lr()[0], "train/grad_norm": grad_norm,
                           **meter.scalars(tokens, positions, rows, elapsed),
                           "train/epoch": state.epoch + state.samples_in_epoch / (epoch_rows * world),
                           "train/tokens_seen": state.tokens_seen, "train/bad_steps": state.bad_steps}
                sink.write(state.step, scalars)
                pbar.set_postfix(loss=f"{scalars['train/loss']:.4f}",
                                 tok_s_dev=f"{scalars['train/tokens_per_s_per_device']:.0f}",
                                 pad=f"{scalars['train/padding_ratio']:.2f}", mfu=meter.describe_mfu(scalars),
                                 refresh=False)  # drawn by the next update (tqdm's 0.1 s minimum interval)
                logger.debug(f"step {state.step}: " + ", ".join(f"{k}={v:.6g}" for k, v in scalars.items()))
                acc.zero_()
                meter.window.zero_()
                t_log = time.perf_counter()

            if t.eval_every and state.step % t.eval_every == 0 and state.step < total_steps:
                _eval_and_log(engine, eval_dl, recipe, cfg, sink, state.step, "step")
                t_log = time.perf_counter()
            # (not right after a skipped step: the save waits for the end or a stop)
            if t.save_every and state.step % t.save_every == 0 and bad_in_a_row == 0:
                ckpt_utils.save(engine, run_dir, state, config_to_dict(cfg), **save_kw)
                last_saved = state.step
                t_log = time.perf_counter()
        if done + step_rows > epoch_rows:
            _log_epoch_padding(meter, state.epoch, "")
            state.epoch += 1
            state.samples_in_epoch = 0
    pbar.close()
    _log_epoch_padding(meter, state.epoch, " (up to the last step)")

    _eval_and_log(engine, eval_dl, recipe, cfg, sink, state.step, "final eval at step")
    if last_saved != state.step:
        ckpt_utils.save(engine, run_dir, state, config_to_dict(cfg), **save_kw)
    return state
