"""What one device computes: a plain single-process PyTorch loop (no DeepSpeed, no process group).

:func:`reference_run` reproduces a toolkit run's global batches exactly and in the same order, then
trains the same model the textbook way:

* Data: the package's own tokenized splits (``finetune.data.dataset.load_splits``, same cache), one
  training sampler per simulated rank (``finetune.data.dataset.train_sampler``, length grouping included) with the
  world size and rank given explicitly,
  each feeding a DataLoader with the recipe's collator behind ``RowSeededCollate`` (so the per-rank
  micro-batches, their padding and their MLM masks are the very tensors rank ``r`` collates), the
  same epoch bookkeeping as ``finetune.training.trainer.fit`` (``micro_per_epoch``, ``set_epoch``).
* Model: ``torch.manual_seed(train.seed)``, then ``from_pretrained`` in fp32, or for ``init: scratch`` the
  model built as transformers builds it under ZeRO-3 (torch's default layer inits skipped, then the
  model's own ``_init_weights``), ``model.config_overrides`` applied; train mode.
* Optimizer: ``torch.optim.AdamW(fused=True)`` (as the engine on CPU ranks) over ``finetune.engine.model.param_groups``;
  transformers ``get_scheduler``; gradients clipped to ``train.max_grad_norm`` (global norm accumulated in fp64).
* Loss of a step (:func:`full_logits_loss_sum`, from the full logits): ``sum over every target token of the
  global batch / number of targets`` (token weighting) or, with ``train.loss_weighting: micro_batch``, the
  mean over all micro-batches of each micro-batch's own mean. The micro-batches are run one after the other
  and their gradients accumulated, which is the same gradient as one forward over the whole global batch.

Imports nothing from DeepSpeed; the tests compare the real toolkit's ``metrics.jsonl`` and export with it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from finetune.config import RunConfig
from finetune.data.dataset import IndexedRows, RowSeededCollate, load_splits, train_sampler
from finetune.engine.model import load_model_config, load_tokenizer, param_groups
from finetune.data.batch import model_inputs
from finetune.recipes import get_recipe


_SPLITS: dict = {}  # (recipe, data config, seed) -> Splits: tokenized datasets, loaded once per process


@dataclass
class Reference:
    """Result of :func:`reference_run`."""

    losses: list[float] = field(default_factory=list)
    """Global-batch train loss of each optimizer step (step 1 first), as the toolkit logs ``train/loss``."""
    token_losses: list[float] = field(default_factory=list)
    """Per step, at the same weights: sum of all target losses / number of targets."""
    micro_batch_losses: list[float] = field(default_factory=list)
    """Per step, at the same weights: mean over micro-batches of each micro-batch's mean target loss."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm before clipping (accumulated in fp64), per step."""
    targets: list[int] = field(default_factory=list)
    """Target tokens in each step's global batch."""
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    """Final fp32 weights (CPU tensors), parameter name -> tensor."""


def full_logits_loss_sum(recipe: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The textbook loss sum from the model's full logits, independent of the recipes' ``forward`` (which runs the
    head at target positions only): cross-entropy over every position (causal LMs, ``gpt_clm`` and ``sft``: ``logits[:, t]``
    predicts ``labels[:, t + 1]``; ``seq_cls``: one row per example), -100 ignored, summed, fp32."""
    if recipe in ("gpt_clm", "sft", "vlm_sft"):
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def reference_run(cfg: RunConfig, world: int, steps: int, loss_fn=None, before_step=None) -> Reference:
    """Train ``steps`` optimizer steps of ``cfg`` on one device, as ``world`` ranks would split the data.

    Args:
        cfg: the run config the toolkit was launched with (overrides applied); ``train.micro_batch_size``,
            ``train.gradient_accumulation_steps`` and ``world`` decide the micro-batches; ``data.cache_dir``
            should be the launches' tokenization cache.
        world: number of ranks of the run being reproduced.
        steps: optimizer steps (the LR schedule is as long as ``steps``, like ``train.max_steps``).
        loss_fn: ``(model, batch) -> loss sum`` (0-dim) in place of :func:`full_logits_loss_sum` of the model's
            logits (``distill``: the teacher's and the student's full logits).
        before_step: ``(model, micro-batches of one rank, step) -> micro-batches``, called per simulated rank
            before the step runs (``distill``'s on-policy samples, drawn as that rank draws them).

    Returns:
        :class:`Reference`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks (OMP_NUM_THREADS=1); 2 threads crawl on a busy 2-core machine
    try:
        return _reference_run(cfg, world, steps, loss_fn, before_step)
    finally:
        torch.set_num_threads(threads)


def _reference_run(cfg: RunConfig, world: int, steps: int, loss_fn=None, before_step=None) -> Reference:
    cfg = copy.deepcopy(cfg)
    t = cfg.train
    weighting = t.loss_weighting  # token or micro_batch: what is trained on and returned as ``losses``
    mb, gas = t.micro_batch_size, t.gradient_accumulation_steps
    recipe = get_recipe(cfg.recipe)
    tokenizer = load_tokenizer(cfg, recipe)
    key = (cfg.recipe, repr(cfg.data), t.seed)
    if key not in _SPLITS:
        _SPLITS[key] = load_splits(recipe, tokenizer, cfg.data, t.seed)
    splits = _SPLITS[key]
    collator = recipe.make_collator(tokenizer, cfg.data)
    rows = IndexedRows(splits.train)
    samplers = [train_sampler(rows, cfg.data, mb * gas * world, world, r, t.seed) for r in range(world)]
    collates = [RowSeededCollate(collator, t.seed) for _ in range(world)]
    loaders = [DataLoader(rows, batch_size=mb, sampler=s, collate_fn=c, drop_last=True)
               for s, c in zip(samplers, collates)]
    micro_per_epoch = (samplers[0].num_samples // mb) // gas * gas
    assert micro_per_epoch > 0, "no full global batch"

    from transformers import get_scheduler

    model_config = load_model_config(cfg, recipe)
    torch.manual_seed(t.seed)
    if cfg.model.init == "pretrained":
        model = recipe.model_class.from_pretrained(cfg.model.path, config=model_config, local_files_only=True,
                                                   dtype=torch.float32,
                                                   attn_implementation=cfg.model.attn_implementation)
    else:  # what transformers' from_config does inside deepspeed.zero.Init, on one device
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = recipe.model_class.from_config(model_config, dtype=torch.float32,
                                                   attn_implementation=cfg.model.attn_implementation)
        model.initialize_weights()
        model.tie_weights()
    if cfg.model.lora is not None:  # peft's adapters, drawn as the engine draws them (seeded, base frozen)
        from finetune.engine.lora import wrap

        model = wrap(model, cfg.model.lora, recipe.model_class, t.seed)
    if cfg.model.freeze:  # the same parameters left out of training
        from finetune.engine.freeze import apply

        apply(model, list(cfg.model.freeze))
    if cfg.model.fused_kernels:  # the engine computes the same function with the same kernels
        from finetune.engine.kernels import fuse

        fuse(model)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                            eps=t.adam_eps, fused=True)  # what the engine runs on CPU ranks (finetune.engine.ds_config)
    sched = get_scheduler(t.lr_scheduler, opt, num_warmup_steps=t.warmup_steps, num_training_steps=steps)
    params = [p for p in model.parameters() if p.requires_grad]

    out = Reference()
    epoch, used, its = 0, 0, None
    for step in range(steps):
        if its is None or used >= micro_per_epoch:
            if its is not None:
                epoch, used = epoch + 1, 0
            for s, c in zip(samplers, collates):
                s.set_epoch(epoch)
                c.set_epoch(epoch)
            its = [iter(dl) for dl in loaders]
        micro = [next(it) for it in its for _ in range(gas)]  # rank 0's micro-batches, then rank 1's, ...
        used += gas
        if before_step is not None:
            micro = [b for r in range(world) for b in before_step(model, micro[r * gas:(r + 1) * gas], step)]
        n_targets = int(sum(recipe.count_targets(b) for b in micro))
        token_loss = micro_loss = 0.0
        for b in micro:
            labels = b["labels"]
            summed = (loss_fn(model, b) if loss_fn is not None else
                      full_logits_loss_sum(cfg.recipe, model(**model_inputs(b)).logits, labels))
            token = summed / max(n_targets, 1)
            micro_mean = summed / recipe.count_targets(b).clamp(min=1) / len(micro)
            (token if weighting == "token" else micro_mean).backward()
            token_loss += token.item()
            micro_loss += micro_mean.item()
        # Global norm accumulated in fp64 (the exact value to ~1e-12); fp32 sums over a 100k-element
        # embedding gradient drift by ~1e-5 on CPU. clip_grads_with_norm_: coefficient max / (norm + 1e-6).
        norm = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params
                            if p.grad is not None]).norm()
        if t.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, t.max_grad_norm, norm.float())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.token_losses.append(token_loss)
        out.micro_batch_losses.append(micro_loss)
        out.losses.append(token_loss if weighting == "token" else micro_loss)
        out.grad_norms.append(float(norm))
        out.targets.append(n_targets)
    out.state_dict = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return out
