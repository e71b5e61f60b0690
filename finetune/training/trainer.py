"""The one training loop every recipe shares.

Per optimizer step, on every rank::

    micro = [next(batches) for _ in range(gradient_accumulation_steps)]
    micro = recipe.before_step(engine, micro, cfg)                      # whole-batch values (kto's KL estimate)
    N, stop = all_reduce([sum(count_targets(b) for b in micro), stop signal here?])  # the step's collective
    if stop: save a checkpoint of the last step, return
    for b in micro:
        out = recipe.forward(engine, b)                                 # batch -> loss sum (recipe runs the model)
        loss = out.loss_sum * dp * gas / N                              # summed token loss, token-weighted
        engine.backward(loss)                                           # DeepSpeed divides by gas ...
        engine.step()                                                   # ... and averages over ranks
    bad = not engine.was_step_applied()                                 # the same on every rank, no collective

One small all-reduce per step (the target count and the stop signal together; none at all with
``loss_weighting: micro_batch`` and no stop signal to watch), plus one on logged steps for the log totals:
each is a synchronisation point of all ranks, and on GPUs a wait of the host for the device.

Under pipeline parallelism (:mod:`finetune.engine.pipeline`) DeepSpeed's ``train_batch`` runs the step's
micro-batches through the stages (1F1B), the backward passes and the optimizer step; its last stage takes each
micro-batch's loss sum times the same ``D x G / N``, and evaluation sums come from ``eval_batch``. The rest of the
loop is this one.

Token-weighted loss (``train.loss_weighting: token``, default). DeepSpeed averages gradients with equal
weight per micro-batch and per rank, which is not the gradient of the mean over all target tokens when
micro-batches hold different numbers of targets (padding, MLM masking): the gradient-accumulation loss
bug transformers fixed in 2024 (``num_items_in_batch``). Here each micro-batch loss is
``sum_i l_i * (D * G) / N`` (``D`` data-parallel ranks, ``G`` accumulation steps, ``N`` targets in the whole
global batch); after DeepSpeed's ``1/G`` scaling and ``1/D`` averaging the gradient is exactly
``grad(sum over all targets l_i / N)``, as one device would compute on the whole global batch. Under sequence
parallelism (:mod:`finetune.parallel.sequence`) each rank sums its slice of every sequence, ``N`` counts every slice's
targets once, and DeepSpeed sums the gradients of all ``D x SP`` ranks and divides by ``D``: the same gradient.
``loss_weighting: micro_batch``: each micro-batch loss is its own mean (``sum_i l_i / n_micro``) and the
optimized loss is the mean of those means, DeepSpeed's plain behaviour.
A loss that is a mean of its own (``LossOutput.aux_loss``: a mixture of experts' load-balancing loss times its
coefficient) is added to the micro-batch loss after the weighting, so the gradient gets ``mean over the D x G
micro-batches of aux`` (:mod:`finetune.engine.moe`); ``train/loss`` is the token part only.
The loss sum comes from the recipe (``forward``: "batch -> loss sum", see :mod:`finetune.recipes`), never from
the model: models do not all honour ``num_items_in_batch`` (``BertForMaskedLM`` ignores it and always returns
its own mean); the LM recipes run the output head and the cross-entropy at target positions only.

Non-finite steps. A step whose global gradient norm is not finite (a non-finite loss on any rank makes it
so) is skipped: ZeRO 1-3 skip it themselves (DeepSpeed's check of the global norm; for ZeRO 1/2 in bf16 it
needs ``check_grad_overflow``, kept on in ``engine.build_engine``); at stage 0 the loop checks the all-reduced
gradient norm before ``engine.step`` and makes that step a no-op. Either way ``engine.was_step_applied()`` says so, alike on every rank.
Skipped steps are counted (``train/bad_steps``); ``train.max_bad_steps`` in a row raise
:class:`TrainingDiverged`. A finite gradient can still make the weights non-finite (a NaN learning rate, an
optimizer setting that divides by zero): every save checks the weights first and a final evaluation whose loss is
not finite stops the run before its last save (:func:`require_finite`), both with :class:`TrainingDiverged`, so no
complete checkpoint and no export ever holds NaN. The position in the epoch is counted in rows of the global order
(``TrainState.samples_in_epoch``), so a resume with another micro-batch split continues at the next row.

Logging every ``train.log_every`` steps: train loss (mean over the logged steps of the global-batch loss),
learning rate, gradient norm (before clipping), tokens/s (non-pad tokens of all ranks over wall time) and
per device, non-pad tokens trained so far, the padding ratio (real tokens / positions), the step-time split of
the logged step (data wait, forward, backward, optimizer; timed on that step only, so the others run without
extra synchronisation) and MFU on known GPUs (:class:`finetune.training.meter.StepMeter`). The progress bar shows loss,
tokens/s per device, padding ratio and MFU. Each epoch's padding ratio goes to the log at its end.
Evaluation every ``train.eval_every`` steps, at the end, and at step 0 with ``train.eval_on_start``; after each,
``train.keep_best`` and ``train.early_stopping`` (:class:`Evaluations`);
checkpoints every ``train.save_every`` steps and at the end, keeping the newest
``train.keep_last_checkpoints`` (and the one resumed from).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from finetune.lifecycle import checkpoint as ckpt_utils
from finetune.parallel import distributed as dist_utils
from finetune.parallel import layout, sequence
from finetune.data.batch import to_device
from finetune.lifecycle.checkpoint import TrainState
from finetune.config import RunConfig, config_to_dict
from finetune.errors import ConfigError, TrainingDiverged
from finetune.logs import MetricsSink, logger
from finetune.training.meter import StepMeter
from finetune.engine import pipeline
from finetune.engine.ds_config import engine_precision


def _rng_fork(device):
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda")


@torch.no_grad()
def _eval_totals(engine, loader, recipe, cfg: RunConfig) -> tuple[dict[str, float], torch.Tensor | None]:
    """Sums over ``loader`` on all ranks (all-reduced): loss, targets and each metric's ``/num`` and ``/den``, and the
    recipe's ``counts`` (or None)."""
    device = engine.device
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=device))
    counts, pipe = None, pipeline.is_pipeline(engine)
    with _rng_fork(device):
        torch.manual_seed(cfg.train.seed)
        for i, batch in enumerate(loader):
            if cfg.train.eval_max_batches and i >= cfg.train.eval_max_batches:
                break
            if pipe:  # the last stage's loss sum and correct argmaxes, sent to every stage of the pipeline
                loss_sum, correct = pipeline.eval_sums(engine, batch)
                n = recipe.count_targets(batch).to(device)
                sums["loss"] += loss_sum
                sums["targets"] += n
                for name in recipe.capabilities.eval_metrics:  # top-1 accuracy at the targets (masked_accuracy)
                    if name.endswith("accuracy"):
                        sums[f"{name}/num"] += correct
                        sums[f"{name}/den"] += n
                continue
            out = recipe.forward(engine, to_device(batch, device), metrics=True)
            sums["loss"] += out.loss_sum.double()
            sums["targets"] += out.targets
            for name, (num, den) in out.metrics.items():
                sums[f"{name}/num"] += num
                sums[f"{name}/den"] += den
            if out.counts is not None:
                counts = out.counts.double() if counts is None else counts + out.counts.double()
    names = sorted(sums)
    replicas = layout.layout(cfg).replicas  # tensor-parallel ranks and a pipeline's stages evaluate the same rows
    totals = (dist_utils.all_reduce_sum(torch.stack([sums[n] for n in names])) / replicas).tolist()
    return dict(zip(names, totals)), (dist_utils.all_reduce_sum(counts).cpu() / replicas if counts is not None else None)


_UNMEASURED: set = set()


def _nothing_measured(name: str) -> None:
    """Warn once per process (rank 0) that a metric had nothing to measure in a window or evaluation."""
    if name not in _UNMEASURED:
        _UNMEASURED.add(name)
        if dist_utils.is_main():
            logger.warning(f"{name}: nothing to measure (no row or completion it applies to, e.g. every reward None "
                           f"or no rejected example); not logged as a number where that happens")


def _eval_metrics(engine, recipe, total: dict[str, float], counts, prefix: str, artefacts: dict | None) -> dict:
    loss = total["loss"] / max(total["targets"], 1.0)
    metrics = {f"{prefix}loss": loss}
    if recipe.capabilities.reports_perplexity:
        metrics[f"{prefix}perplexity"] = math.exp(min(loss, 80.0))
    for n in sorted(total):
        if n.endswith("/num"):
            base = n[: -len("/num")]
            if total[f"{base}/den"] > 0:
                metrics[f"{prefix}{base}"] = total[n] / total[f"{base}/den"]
            else:  # nothing to measure (no rejected row, no scored completion): NaN, never a made-up 0
                metrics[f"{prefix}{base}"] = float("nan")
                _nothing_measured(f"{prefix}{base}")
    if counts is not None:
        extra, made = recipe.eval_report(counts, getattr(engine.module, "config", None))
        metrics.update({f"{prefix}{k}": v for k, v in extra.items()})
        if artefacts is not None:
            artefacts.update(made)
    return metrics


def evaluate(engine, loader, recipe, cfg: RunConfig, artefacts: dict | None = None) -> dict[str, float]:
    """Token-weighted eval loss, perplexity and the recipe's extra metrics over the validation split.

    MLM masks are seeded per validation row (``finetune.data.dataset.eval_loader``), so they are the same at every
    evaluation; it runs under a forked RNG seeded with ``train.seed`` so the training RNG stream is
    untouched. All ranks must call it (ZeRO-3 gathers parameters).

    The recipe's ``forward(..., metrics=True)`` gives the loss sum, target count and extra metric sums; recipes
    returning ``counts`` (seq_cls: confusion matrix) turn their total into metrics with ``eval_report``, and
    their artefacts (name -> JSON-able dict) are put into ``artefacts`` when it is given.

    ``loader`` may be a mapping of source name -> loader (``data.sources``): each source is evaluated on its own
    (``eval/<source>/loss``, ...; ``train.eval_max_batches`` per source) and the overall metrics are those of the
    sources' sums together (the token-weighted mean over every validation row, as one split would give).

    Returns:
        ``{"eval/loss": float, "eval/perplexity": float, "eval/<metric>": float, ...}`` (no perplexity for a
        recipe without ``Capabilities.reports_perplexity``), and ``eval/<source>/...`` for each source.
    """
    engine.eval()
    metrics: dict[str, float] = {}
    if isinstance(loader, dict):
        total: dict[str, float] = defaultdict(float)
        counts = None
        for name, source_loader in loader.items():
            mine, mine_counts = _eval_totals(engine, source_loader, recipe, cfg)
            metrics.update(_eval_metrics(engine, recipe, mine, mine_counts, f"eval/{name}/", None))
            for k, v in mine.items():
                total[k] += v
            if mine_counts is not None:
                counts = mine_counts if counts is None else counts + mine_counts
        metrics = {**_eval_metrics(engine, recipe, total, counts, "eval/", artefacts), **metrics}
    else:
        total, counts = _eval_totals(engine, loader, recipe, cfg)
        metrics = _eval_metrics(engine, recipe, total, counts, "eval/", artefacts)
    engine.train()
    return metrics


def _eval_and_log(engine, eval_dl, recipe, cfg: RunConfig, sink: MetricsSink, step: int, what: str,
                  generation=None) -> dict:
    """Evaluate (all ranks), generate and score answers when ``generation`` (``train.eval_generate``) is given, then
    write scalars, artefacts and generations (rank 0) and one log line; returns the metrics."""
    artefacts: dict = {}
    metrics = evaluate(engine, eval_dl, recipe, cfg, artefacts)
    if generation is not None:
        with sequence.sequence_parallel_off():  # whole sequences, each rank its own prompts, as without SP
            scores, records = generation.run(engine)
        metrics.update(scores)
        sink.write_generations(step, records)
    sink.write(step, metrics)
    sink.write_artefacts(step, artefacts)
    logger.info(f"{what} {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    return metrics


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """True when ``value`` beats ``best`` by more than ``min_delta`` (``mode`` ``min``: lower is better; ``max``:
    higher); the first value (``best`` None) always does, a NaN never does."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


class Evaluations:
    """The run's evaluations and what follows them: ``train.keep_best`` and ``train.early_stopping``.

    Each evaluation's metrics are identical on every rank (all-reduced), so every rank takes the same decision
    without another collective. The best values, their step and the patience count live in :class:`TrainState`,
    so a resumed run continues them. With ``keep_best`` a checkpoint is saved at every evaluation during
    training (the best one is then always a checkpoint); :class:`Saver` never prunes it.
    """

    def __init__(self, engine, eval_dl, recipe, cfg: RunConfig, sink: MetricsSink, saver: "Saver", generation=None):
        self.engine, self.eval_dl, self.recipe, self.cfg, self.sink, self.saver = engine, eval_dl, recipe, cfg, sink, saver
        self.es, self.kb, self.generation = cfg.train.early_stopping, cfg.train.keep_best, generation
        self.last: dict[str, float] = {}
        """The latest evaluation's metrics (``eval/loss``, ...)."""

    def _metric(self, metrics: dict, key: str, name: str) -> float:
        if name not in metrics:
            raise ConfigError(f"{key}.metric: '{name}' is not among this run's evaluation metrics "
                              f"({', '.join(sorted(metrics))}); choose one of them")
        return float(metrics[name])

    def run(self, state: TrainState, what: str, during_training: bool = True) -> bool:
        """Evaluate at ``state.step`` and update the best values; True when early stopping ends the run now.

        Raises:
            ConfigError: the watched metric is not one this run's evaluation reports (``--check`` refuses names no
                evaluation of the recipe reports; this catches the rest).
        """
        metrics = _eval_and_log(self.engine, self.eval_dl, self.recipe, self.cfg, self.sink, state.step, what,
                                self.generation)
        self.last = metrics
        save, stop = self.decide(state, metrics, during_training)
        if save or stop:
            self.saver.save(state, unless_saved=True)
        return stop

    def final(self, state: TrainState) -> None:
        """The evaluation at the end of training; a loss that is not finite ends the run before its last save.

        Raises:
            TrainingDiverged: ``eval/loss`` is not finite (:func:`require_finite`).
        """
        self.run(state, "final eval at step", during_training=False)
        require_finite(self.last, state, self.saver.run_dir)

    def decide(self, state: TrainState, metrics: dict, during_training: bool = True) -> tuple[bool, bool]:
        """Update ``state``'s best values and patience from one evaluation's ``metrics``; returns ``(save, stop)``:
        whether this step must be checkpointed (``keep_best`` during training) and whether early stopping ends the
        run now. A NaN value is never an improvement: it is logged as such and counts against the patience."""
        save = stop = False
        if self.kb.metric:
            value = self._metric(metrics, "train.keep_best", self.kb.metric)
            if improved(value, state.best_value, self.kb.mode):
                state.best_value, state.best_step = value, state.step
                logger.info(f"train.keep_best: best {self.kb.metric}={value:.6g} at step {state.step}")
            elif math.isnan(value):
                logger.warning(f"train.keep_best: {self.kb.metric} is NaN at step {state.step}: not an improvement "
                               f"(best so far: {_best(state.best_value, state.best_step)})")
            save = during_training and state.step > 0
        if not (self.es.patience and during_training):
            return save, stop
        value = self._metric(metrics, "train.early_stopping", self.es.metric)
        if improved(value, state.early_best, self.es.mode, self.es.min_delta):
            state.early_best, state.early_waited = value, 0
            return save, stop
        state.early_waited += 1
        if math.isnan(value):
            logger.warning(f"train.early_stopping: {self.es.metric} is NaN at step {state.step}: not an improvement "
                           f"({state.early_waited} of patience {self.es.patience})")
        if state.early_waited < self.es.patience:
            return save, stop
        state.early_stopped = True
        logger.warning(f"train.early_stopping: {self.es.metric}={value:.6g} at step {state.step}, no improvement "
                       f"by more than {self.es.min_delta:g} on the best ({_best(state.early_best)}) for "
                       f"{state.early_waited} evaluation(s) (patience {self.es.patience}): stopping with a checkpoint "
                       f"of this step")
        return True, True


def _best(value: float | None, step: int | None = None) -> str:
    """A best value for the log: ``0.512 (step 40)``, or ``none yet`` before any finite evaluation."""
    if value is None:
        return "none yet"
    return f"{value:.6g}" + (f" (step {step})" if step is not None and step >= 0 else "")


def _grad_norm_stage0(engine) -> float:
    """Global gradient norm of the all-reduced gradients: torch's ``get_total_norm`` (fp32, one fused pass) over
    blocks of 65,536 elements. A float32 norm of a whole embedding-sized gradient on CPU drifts by ~1e-3 of its
    value (one running sum over millions of squares); per block it stays within ~1e-7, at a small fraction of the
    cost of an fp64 copy of every gradient."""
    blocks = [b for p in engine.module.parameters() if p.grad is not None for b in p.grad.reshape(-1).split(1 << 16)]
    if not blocks:
        return 0.0
    return float(torch.nn.utils.get_total_norm(blocks, norm_type=2.0, foreach=True))


def _shared_memory_gradients(engine) -> bool:
    """:func:`finetune.parallel.distributed.shared_memory_gradients`, said once in the log when it applies."""
    if use := dist_utils.shared_memory_gradients(engine):
        logger.info("gradients: averaged through DeepSpeed's shared-memory all-reduce (every rank on this node, "
                    "ZeRO stage 0)")
    return use


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


def _log_epoch_padding(meter: StepMeter, epoch: int, note: str, replicas: int = 1) -> None:
    """Log the padding ratio of the epoch's steps trained in this launch (all ranks: one all-reduce; ``replicas``:
    ranks that counted the same rows, :attr:`finetune.parallel.layout.Layout.replicas`)."""
    tokens, positions = (dist_utils.all_reduce_sum(meter.epoch.clone()) / replicas).tolist()
    meter.epoch.zero_()
    if positions:
        logger.info(f"epoch {epoch}{note}: padding ratio {tokens / positions:.3f} (real tokens / positions: "
                    f"{tokens:,.0f} / {positions:,.0f})")


def step_collective(recipe, micro: list[dict], token_weighted: bool, stop_flag, device,
                    replicas: int = 1) -> tuple[torch.Tensor, bool]:
    """The step's one all-reduce: the targets of this step's micro-batches on all ranks (divided by ``replicas``, the
    ranks that hold the same rows: tensor parallelism), and whether any rank was asked to stop. None at all with
    ``loss_weighting: micro_batch`` and no stop signal to watch.

    The count travels in float64, exact up to 2^53 targets (float32 stops being exact above 2^24 tokens per global
    batch, which real global batches pass: 512 rows of 32k tokens).

    Returns:
        ``(targets, stop)``: the global target count (0-dim float64; 0 when not token-weighted) and the stop flag.
    """
    head = torch.zeros(2, dtype=torch.float64, device=device)
    if token_weighted:
        head[0] = torch.stack([recipe.count_targets(b) for b in micro]).sum()
    if stop_flag is not None:
        head[1] = float(stop_flag())
    if token_weighted or stop_flag is not None:
        head = dist_utils.all_reduce_sum(head)
    return head[0] / replicas, stop_flag is not None and head[1].item() > 0


def non_finite_to_nan_grads(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged when finite; when not, the same value whose backward makes every gradient NaN.

    A loss can overflow in the forward while its gradient stays finite (IPO's square with a tiny ``beta``: the loss
    is inf, the gradient about 1e20), and the skip of non-finite steps reads the gradient norm (DeepSpeed's overflow
    check at ZeRO 1-3, :func:`_grad_norm_stage0` at stage 0). Multiplying by ``1 + where(finite, 0, nan)`` is exact
    for a finite loss (``x * 1.0``; the gradient is scaled by 1.0) and poisons the gradients otherwise, so the step is
    skipped and counted on every rank like any non-finite step, with no host synchronisation.

    Args:
        loss: 0-dim floating tensor with a gradient.
    """
    finite = torch.isfinite(loss.detach())
    return loss * (1 + torch.where(finite, 0.0, float("nan")).to(loss.dtype))


def train_step(engine, recipe, micro: list[dict], targets: torch.Tensor, token_weighted: bool, dp: int,
               meter: StepMeter, offload: bool = False,
               shm_grads: bool = False) -> tuple[torch.Tensor, float | None, dict[str, torch.Tensor]]:
    """One optimizer step over the step's micro-batches: forward (the recipe's loss sum), scale, backward, step.

    Token weighting divides each micro-batch's loss sum by ``targets / (dp * gas)`` (``dp``: the data-parallel size;
    see the module docstring);
    ``micro_batch`` weighting by its own target count. At ZeRO stage 0 a non-finite global gradient norm makes
    the step a no-op (:func:`_skip_update_stage0`); ZeRO 1-3 skip it themselves. ``offload``
    (``model.offload_activations``): the forward runs under ``torch.autograd.graph.save_on_cpu``. ``shm_grads``
    (:func:`finetune.parallel.distributed.shared_memory_gradients`): the last micro-batch's backward runs under
    DeepSpeed's ``no_sync`` and :func:`~finetune.parallel.distributed.all_reduce_gradients` averages the gradients.

    Returns:
        ``(loss, grad_norm, metrics)``: this rank's share of the step's loss (0-dim float64), at stage 0 the global
        gradient norm (None otherwise: DeepSpeed keeps it), and the sums of the metrics the recipe's ``forward``
        returned in training (``dpo``'s rewards), ``name -> [numerator, denominator]`` float64.
    """
    gas, device = len(micro), engine.device
    stage0 = engine.zero_optimization_stage() == 0
    if pipeline.is_pipeline(engine):  # DeepSpeed's 1F1B schedule runs the micro-batches, the backward and the step
        loss, idle = pipeline.train_step(engine, micro, targets, timed=meter.sampling)
        meter.lap("forward")
        for batch in micro:
            meter.count(batch)
        shares = {"pipeline_idle": torch.tensor([idle, 1.0], dtype=torch.float64, device=device)} \
            if idle is not None else {}  # train/pipeline_idle: the measured bubble, mean over ranks
        return loss, pipeline.grad_norm(engine) if stage0 else None, shares
    denom = (targets.clamp(min=1.0) / (dp * gas)).float()  # the exact count, then the loss's float32 as before
    grad_norm = None
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    metrics: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro):
        batch = to_device(batch, device)
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload \
                else contextlib.nullcontext():  # model.offload_activations: what checkpointing keeps goes to the host
            out = recipe.forward(engine, batch)  # the recipe runs the model on everything but the labels
        lm = out.loss_sum / (denom if token_weighted else out.targets.clamp(min=1))
        # an MoE router's load-balancing term is a mean of its own: added after the weighting (LossOutput.aux_loss)
        loss = non_finite_to_nan_grads(lm if out.aux_loss is None else lm + out.aux_loss)
        meter.lap("forward")
        own_reduce = shm_grads and i == gas - 1
        with engine.no_sync() if own_reduce else contextlib.nullcontext():
            engine.backward(loss)
        if own_reduce:
            dist_utils.all_reduce_gradients(engine)
        meter.lap("backward")
        if stage0 and i == gas - 1:  # grads are all-reduced: the same norm on every rank
            grad_norm = _grad_norm_stage0(engine)  # DeepSpeed keeps no norm at stage 0
            if not math.isfinite(grad_norm):
                _skip_update_stage0(engine)
        engine.step()
        meter.lap("optimizer")
        step_loss += lm.detach().double() / gas  # train/loss: the token loss (an aux loss is logged on its own)
        for name, (num, den) in out.metrics.items():
            metrics[name] = metrics.get(name, 0) + torch.stack([num.detach(), den.detach()]).double()
        meter.count(batch)  # non-pad tokens (attention mask, or num_tokens of packed rows), positions
    if stage0:
        _end_skip_stage0(engine)
    return step_loss, grad_norm, metrics


class Cadence:
    """When to log, evaluate and save, from ``train.log_every``, ``eval_every``, ``save_every`` (0: only at the end)
    and the run's last step."""

    def __init__(self, cfg: RunConfig, total_steps: int):
        t = cfg.train
        self.log_every, self.eval_every, self.save_every = t.log_every, t.eval_every, t.save_every
        self.total_steps = total_steps

    def log(self, step: int) -> bool:
        """Write the train scalars after ``step``."""
        return step % self.log_every == 0 or step == self.total_steps

    def eval(self, step: int) -> bool:
        """Evaluate after ``step`` (the last step's evaluation is the final one, after the loop)."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.total_steps

    def save(self, step: int) -> bool:
        """Checkpoint after ``step``."""
        return bool(self.save_every) and step % self.save_every == 0


class Guard:
    """Counts optimizer steps that were not applied (non-finite loss or gradient norm: DeepSpeed skipped the update,
    :func:`train_step` at stage 0) and stops the run after ``train.max_bad_steps`` in a row."""

    def __init__(self, max_bad_steps: int, run_dir: Path):
        self.max_bad_steps, self.run_dir, self.in_a_row = max_bad_steps, run_dir, 0

    def check(self, engine, state: TrainState) -> bool:
        """After a step: True when it was applied; counts and warns when not.

        Raises:
            TrainingDiverged: ``train.max_bad_steps`` steps in a row were skipped; nothing is saved from this state.
        """
        if engine.was_step_applied():  # the same on every rank, no collective
            self.in_a_row = 0
            return True
        state.bad_steps += 1
        self.in_a_row += 1
        logger.warning(f"step {state.step}: non-finite loss or gradient norm; update skipped ({self.in_a_row} in a "
                       f"row; the run stops at train.max_bad_steps={self.max_bad_steps})")
        if self.in_a_row >= self.max_bad_steps:
            last = ckpt_utils.complete_checkpoints(ckpt_utils.checkpoints_dir(self.run_dir))
            raise TrainingDiverged(
                f"training diverged: {self.in_a_row} consecutive optimizer steps up to step {state.step} had a "
                f"non-finite loss or gradient norm (train.max_bad_steps={self.max_bad_steps}); nothing was saved or "
                f"exported from this state; last good checkpoint: {last[-1] if last else 'none'}; lower train.lr or "
                f"check the data")
        return False


def require_finite(metrics: dict[str, float], state: TrainState, run_dir: Path) -> None:
    """Stop a run whose final evaluation is not finite before it saves or exports anything: its last step would be
    saved as complete and exported though the model computes NaN. ``eval/loss`` decides (the recipes' other metrics
    may be NaN when they had nothing to measure); the metrics are all-reduced, so every rank raises alike.

    Raises:
        TrainingDiverged: ``eval/loss`` is NaN or infinite (the message names the last complete checkpoint).
    """
    loss = metrics.get("eval/loss")
    if loss is None or math.isfinite(loss):
        return
    last = ckpt_utils.complete_checkpoints(ckpt_utils.checkpoints_dir(run_dir))
    raise TrainingDiverged(f"training diverged: the final evaluation at step {state.step} is not finite (eval/loss "
                           f"{loss}); nothing was saved or exported from this state; last complete checkpoint: "
                           f"{last[-1] if last else 'none'}; lower train.lr or check the data")


class LogWindow:
    """Running sums since the last train log line (loss of each applied step, applied steps, the recipe's train
    metrics; tokens, positions and rows in the meter), written as one row of scalars every ``train.log_every`` steps
    (one all-reduce)."""

    def __init__(self, engine, sink: MetricsSink, meter: StepMeter, world: int, epoch_rows: int, pbar, dp: int = 0,
                 replicas: int = 1):
        self.engine, self.sink, self.meter, self.world, self.epoch_rows, self.pbar = engine, sink, meter, world, \
            epoch_rows, pbar
        self.dp = dp or world  # data-parallel size: the ranks' loss shares sum to dp x replicas x the step's loss
        self.replicas = replicas  # ranks that hold the same rows (tensor parallelism): every sum counts them so often
        self.acc = torch.zeros(2, dtype=torch.float64, device=engine.device)
        self.metrics: dict[str, torch.Tensor] = {}
        self.restart()

    def restart(self) -> None:
        """Start the next window's clock (after a log line, an evaluation or a save)."""
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        """An applied step's loss (this rank's share) and metric sums (the same names on every rank)."""
        self.acc[0] += loss
        self.acc[1] += 1
        for name, value in metrics.items():
            self.metrics[name] = self.metrics.get(name, 0) + value

    def write(self, state: TrainState, grad_norm: float | None) -> None:
        """All-reduce the window, write the train scalars (rank 0), update the progress bar, start a new window."""
        names = sorted(self.metrics)
        totals = dist_utils.all_reduce_sum(torch.cat([self.acc, self.meter.window, *(self.metrics[n] for n in names)]))
        steps = totals[1].item() / self.world
        totals = totals / self.replicas
        recipe_metrics = {f"train/{n}": (totals[5 + 2 * i] / totals[6 + 2 * i]).item()
                          for i, n in enumerate(names) if totals[6 + 2 * i] > 0}
        for n in names:  # nothing to measure in this window: left out, never a made-up 0
            if f"train/{n}" not in recipe_metrics:
                _nothing_measured(f"train/{n}")
        elapsed = time.perf_counter() - self.t0
        if grad_norm is None:
            gn = self.engine.get_global_grad_norm()
            grad_norm = float(gn) if gn is not None else float("nan")
        tokens, positions, rows = totals[2:5].tolist()
        state.tokens_seen += int(tokens)
        scalars = {"train/loss": totals[0].item() / self.dp / steps if steps else float("nan"),
                   "train/lr": self.engine.get_lr()[0], "train/grad_norm": grad_norm,
                   **self.meter.scalars(tokens, positions, rows, elapsed),
                   "train/epoch": state.epoch + state.samples_in_epoch / (self.epoch_rows * self.dp),
                   "train/tokens_seen": state.tokens_seen, "train/bad_steps": state.bad_steps, **recipe_metrics}
        self.sink.write(state.step, scalars)
        self.pbar.set_postfix(loss=f"{scalars['train/loss']:.4f}",
                              tok_s_dev=f"{scalars['train/tokens_per_s_per_device']:.0f}",
                              pad=f"{scalars['train/padding_ratio']:.2f}", mfu=self.meter.describe_mfu(scalars),
                              refresh=False)  # drawn by the next update (tqdm's 0.1 s minimum interval)
        logger.debug(f"step {state.step}: " + ", ".join(f"{k}={v:.6g}" for k, v in scalars.items()))
        self.acc.zero_()
        self.metrics.clear()
        self.meter.window.zero_()
        self.restart()


class Saver:
    """Checkpoints of this launch: every ``train.save_every`` steps, at the end and on a stop, each step once,
    keeping the newest ``train.keep_last_checkpoints`` (never the one resumed from), with the recipe's own state of
    each rank (its ``rank_state`` hook), which a resumed launch gives back to the recipe first."""

    def __init__(self, engine, run_dir: Path, cfg: RunConfig, state: TrainState, resume_from: Path | None, recipe):
        self.engine, self.run_dir, self.config, self.rank_state = engine, run_dir, config_to_dict(cfg), \
            recipe.rank_state
        if resume_from is not None:  # what the recipe keeps between steps (grpo: a reused generation batch)
            recipe.load_rank_state(ckpt_utils.load_rank_state(resume_from))
        self.keep_last, self.resume_from = cfg.train.keep_last_checkpoints, resume_from
        self.last = state.step if resume_from else -1

    def save(self, state: TrainState, unless_saved: bool = False) -> None:
        """Save ``state`` (all ranks); with ``unless_saved`` not when this step is already saved. Never pruned: the
        checkpoint resumed from and ``train.keep_best``'s best one (``state.best_step``)."""
        if unless_saved and self.last == state.step:
            return
        best = ckpt_utils.checkpoints_dir(self.run_dir) / f"step{state.best_step}" if state.best_step >= 0 else None
        ckpt_utils.save(self.engine, self.run_dir, state, self.config, keep_last=self.keep_last,
                        protect=[self.resume_from, best], rank_state=self.rank_state())
        self.last = state.step


def _log_trained_shares(sampler, state: TrainState, step_rows: int, world: int) -> None:
    """With a mixture: log each source's share of the rows trained on since the run's first step."""
    per_epoch = sampler.num_samples // step_rows * step_rows * world  # rows of a finished epoch trained on
    shares = getattr(sampler, "trained_shares", lambda *a: None)(state.epoch, state.samples_in_epoch, per_epoch)
    if shares:
        logger.info(f"mixture, rows trained on since the run began: {shares}")


def _stopped_early(cfg: RunConfig, state: TrainState) -> bool:
    """True (and a warning) when ``train.early_stopping`` already ended the run that ``state`` comes from."""
    if state.early_stopped:
        logger.warning(f"train.early_stopping ended this run at step {state.step} ({cfg.train.early_stopping.metric}, "
                       f"patience {cfg.train.early_stopping.patience}); nothing more is trained")
    return state.early_stopped


def epoch_steps(train_dl, state: TrainState, total_steps: int, gas: int, step_rows: int, world: int,
                resume_from: Path | None, begin):
    """The micro-batches of each optimizer step left in the current epoch: lists of ``gas`` collated batches.

    Positions the sampler at ``state.samples_in_epoch`` (rows of the global order already trained on), sets the
    epoch of the sampler and of the collator (MLM masks: seed, epoch, row), and on a resume restores the RNG
    states once the batch iterator exists, exactly as in the original run. Calls ``begin()`` before fetching each
    step's batches (the step timer's start). Stops before a step the epoch cannot fill, and at ``total_steps``.
    """
    sampler = train_dl.sampler
    sampler.set_epoch(state.epoch, skip=state.samples_in_epoch // world)
    shares = getattr(sampler, "epoch_shares", lambda: None)()
    if shares:
        logger.info(f"mixture, epoch {state.epoch}: {shares}")
    getattr(train_dl.collate_fn, "set_epoch", lambda epoch: None)(state.epoch)
    batches = iter(train_dl)
    if resume_from is not None:  # after the iterator draws its seed, exactly as in the original run
        ckpt_utils.restore_rng_state(resume_from)
    while state.samples_in_epoch // world + step_rows <= sampler.num_samples and state.step < total_steps:
        begin()
        yield [next(batches) for _ in range(gas)]


def fit(cfg: RunConfig, engine, recipe, train_dl, eval_dl, state: TrainState, total_steps: int,
        run_dir: Path, resume_from: Path | None = None, stop_flag=None, launch: int = 1, generation=None) -> TrainState:
    """Train until ``total_steps`` optimizer steps, evaluating, logging and checkpointing on the way (nothing when
    ``train.early_stopping`` already ended the run).

    Args:
        cfg: run config (``parallel``: rows, loss scaling and epochs count in data-parallel ranks, ``dp``).
        engine: DeepSpeed engine.
        recipe: the task's :class:`~finetune.recipes.Recipe`.
        train_dl: training loader whose sampler is a ``ResumableDistributedSampler``.
        eval_dl: validation loader.
        state: where to start (from a checkpoint or fresh).
        total_steps: optimizer steps of the whole run.
        run_dir: run folder (metrics, checkpoints).
        resume_from: checkpoint whose RNG states to restore once the first batch iterator exists.
        stop_flag: callable, True when this rank was asked to stop (signal); agreed on by all ranks every step.
        launch: this launch's number in the run folder (marks its ``metrics.jsonl`` rows).
        generation: :class:`finetune.training.generation.EvalGeneration` for ``train.eval_generate`` (None: off).

    Returns: the final :class:`TrainState`.

    Raises:
        TrainingDiverged: non-finite steps in a row (:class:`Guard`), weights at a save, or the final evaluation.
    """
    if _stopped_early(cfg, state):  # a launch after the stop (a requeue, a resume): the export follows
        return state
    lay, offload, shm = layout.layout(cfg), cfg.model.offload_activations, _shared_memory_gradients(engine)  # rows, loss scaling: lay.dp
    gas, by_token = cfg.train.gradient_accumulation_steps, cfg.train.loss_weighting == "token"
    step_rows = cfg.train.micro_batch_size * gas  # rows per rank per optimizer step
    sink = MetricsSink(engine, run_dir, enabled=dist_utils.is_main(), launch=launch)
    meter = StepMeter(engine.module, engine.device, lay.world, engine_precision(engine) != "fp32")
    pbar = tqdm(total=total_steps, initial=state.step, disable=not dist_utils.is_main(), desc="train", dynamic_ncols=True)
    cadence, guard, saver = Cadence(cfg, total_steps), Guard(cfg.train.max_bad_steps, run_dir), \
        Saver(engine, run_dir, cfg, state, resume_from, recipe)
    window = LogWindow(engine, sink, meter, lay.world, train_dl.sampler.num_samples, pbar, lay.dp, lay.replicas)
    evals = Evaluations(engine, eval_dl, recipe, cfg, sink, saver, generation)
    engine.train()
    if cfg.train.eval_on_start and state.step == 0 and resume_from is None:
        evals.run(state, "eval before training, step")
        window.restart()
    begin = lambda: meter.begin(sample=cadence.log(state.step + 1))  # noqa: E731  (logged steps are timed)
    with pbar:  # closed however the loop ends (a stop, divergence), so that error lines start a line
        while state.step < total_steps:
            for micro in epoch_steps(train_dl, state, total_steps, gas, step_rows, lay.dp, resume_from, begin):
                meter.lap("data_wait")
                micro = recipe.before_step(engine, micro, cfg)  # the default returns them as they are
                meter.lap("before_step")
                targets, stop = step_collective(recipe, micro, by_token, stop_flag, engine.device, lay.replicas)
                if stop:  # the rows drawn for this step are trained on resume
                    saver.save(state, unless_saved=True)
                    logger.warning(f"stop requested: checkpoint of step {state.step} saved, leaving the loop")
                    return state
                loss, grad_norm, metrics = train_step(engine, recipe, micro, targets, by_token, lay.dp, meter, offload, shm)
                state.step, state.samples_in_epoch = state.step + 1, state.samples_in_epoch + step_rows * lay.dp
                pbar.update(1)
                if guard.check(engine, state):
                    window.add(loss, metrics)
                if cadence.log(state.step):  # the step just trained
                    window.write(state, grad_norm)
                if cadence.eval(state.step):
                    if evals.run(state, "step"):  # train.early_stopping: saved, the end of the run follows
                        return state
                    window.restart()
                if cadence.save(state.step) and guard.in_a_row == 0:  # after a skipped step, the save waits
                    saver.save(state, unless_saved=True)
                    window.restart()
            resume_from = None  # the RNG states are restored once, in the first epoch of the launch
            if state.samples_in_epoch // lay.dp + step_rows > train_dl.sampler.num_samples:  # the epoch is used up
                _log_epoch_padding(meter, state.epoch, "", lay.replicas)
                state.epoch, state.samples_in_epoch = state.epoch + 1, 0
    _log_epoch_padding(meter, state.epoch, " (up to the last step)", lay.replicas)
    _log_trained_shares(train_dl.sampler, state, step_rows, lay.dp)
    evals.final(state)
    saver.save(state, unless_saved=True)
    return state
