"""Model, tokenizer and DeepSpeed engine set-up.

* Model and tokenizer load from local folders only (``local_files_only=True``); a ``.gguf`` ``model.path`` has been
  replaced by its converted folder before (:mod:`finetune.engine.gguf`), and the log names the file it came from.
* ``init: scratch`` builds the model from ``config.json`` alone (the recipe's ``model_class.from_config``), seeded
  so every rank builds the same weights, and the same weights at every ZeRO stage: under ZeRO-3
  transformers skips torch's default ``reset_parameters`` and runs only the model's ``_init_weights``,
  so the other stages build the model the same way (:func:`scratch_model`) to draw the same numbers.
* Under ZeRO-3 a ``transformers.integrations.HfDeepSpeedConfig`` is created before the model, so
  ``from_pretrained``/``from_config`` build it inside ``deepspeed.zero.Init`` and no rank materialises
  the full model (the object must stay alive while the model is built: it is kept on :class:`Built`).
* ``model.attn_implementation`` (``sdpa``, ``eager``, ``flash_attention_2``) is passed to ``from_pretrained`` /
  ``from_config`` (checked in :mod:`finetune.preflight.validate` before anything is built).
* AdamW (or, ``train.optimizer: muon``, DeepSpeed's Muon with its auxiliary AdamW, the parameters tagged by
  :mod:`finetune.engine.muon`) comes from the DeepSpeed config (built from the run config, see
  :mod:`finetune.engine.ds_config`);
  the LR schedule is transformers' ``get_scheduler``, handed to ``deepspeed.initialize`` so that
  ``engine.step()`` advances it once per optimizer step and checkpoints carry its state.
* ``model.fused_kernels`` (default on) replaces Python-written activations with fused kernels of the same
  function (:func:`finetune.engine.kernels.fuse`), before LoRA and ``deepspeed.initialize``, and on CPU ranks
  runs ``sdpa`` attention with dropout through :class:`finetune.engine.kernels.DropoutAttention`.
* ``model.lora`` / ``model.gradient_checkpointing`` are applied to the built model before
  ``deepspeed.initialize`` (:func:`finetune.engine.lora.apply`); only trainable parameters reach the optimizer.
* Under ZeRO-3 the sparse blocks of a mixture-of-experts model are DeepSpeed leaf modules, gathered whole
  (:func:`finetune.engine.moe.mark_leaf_modules`), before ``deepspeed.initialize``.
* ``parallel.sequence_parallel_size`` > 1: DeepSpeed's Ulysses attention is registered for the built model and its
  groups go to ``deepspeed.initialize`` as the ``mpu`` (:mod:`finetune.parallel.sequence`).
* ``build_engine(..., optimizer=False)`` (``finetune evaluate``): no optimizer, no LR schedule, no fp32 master
  weights and no gradient partitions (:func:`inference_ds_config`): ZeRO 1/2 become stage 0 (they shard only the
  optimizer's state and gradients, the weights are whole on every rank anyway), ZeRO-3 keeps its parameter
  partitioning without an optimizer (DeepSpeed's ``DeepSpeedZeRoOffload``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from transformers import AutoConfig, AutoTokenizer, get_scheduler
from transformers.initialization import no_init_weights
from transformers.integrations import HfDeepSpeedConfig
from transformers.utils import logging as hf_logging

from finetune.engine import kernels

from finetune.engine import freeze, gguf, lora, moe, muon, neftune, pipeline, quantize

from finetune.parallel import distributed, expert, layout, sequence
from finetune.config import RunConfig
from finetune.data.batch import flattens
from finetune.engine.ds_config import precision_of, zero_stage
from finetune.logs import logger
from finetune import patches

_NO_DECAY = ("bias", "layernorm", "layer_norm", "ln_", "norm.weight")


def load_tokenizer(cfg: RunConfig, recipe):
    """Tokenizer from ``model.tokenizer_path`` (or ``model.path``), prepared by the recipe."""
    path = cfg.model.tokenizer_path or cfg.model.path
    return recipe.prepare_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))


def load_model_config(cfg: RunConfig, recipe):
    """``AutoConfig`` from ``model.path`` with ``model.config_overrides`` applied, then the recipe's
    ``prepare_model_config`` (``seq_cls``: ``num_labels``, ``id2label`` from the training labels)."""
    config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    for k, v in cfg.model.config_overrides.items():
        setattr(config, k, v)
    return recipe.prepare_model_config(config, cfg.data)


def load_pretrained(model_class, path: str, model_config, attn_implementation: str = "sdpa"):
    """``model_class.from_pretrained(path)`` in fp32 that logs newly initialised weights in one line.

    A checkpoint without the task's head (a plain BERT for ``seq_cls``) gets a freshly initialised head;
    transformers' own per-weight warnings are silenced and replaced by one INFO line naming those weights.
    """
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = model_class.from_pretrained(path, config=model_config, local_files_only=True,
                                                  dtype=torch.float32, output_loading_info=True,
                                                  attn_implementation=attn_implementation)
    finally:
        hf_logging.set_verbosity(level)
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        logger.info(f"newly initialised (not in {path}): {', '.join(missing + mismatched)}")
    return model


def meta_model(model_class, model_config):
    """The model built on the meta device from ``model_config`` (no memory, no weights read), for the pre-flight
    checks that need its modules (``model.lora``, ``model.freeze``, ``model.gradient_checkpointing``); None when
    ``model_class`` cannot build it (the model checks report that)."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model_class.from_config(model_config)
    except Exception:  # noqa: BLE001  (the model type's own problems are reported by the model checks)
        return None


def scratch_model(model_class, model_config, attn_implementation: str = "sdpa"):
    """Randomly initialised fp32 model, drawing from the torch RNG exactly as transformers does under ZeRO-3.

    ``from_config`` normally runs torch's default init of every layer during construction and then the
    model's ``_init_weights`` over it; under ZeRO-3 (``zero.Init``) the first is skipped. Building under
    ``transformers.initialization.no_init_weights`` and then calling ``init_weights`` (init + tie) skips it
    here too, so a seeded scratch model has the same weights at every ZeRO stage.
    """
    with no_init_weights():
        model = model_class.from_config(model_config, dtype=torch.float32, attn_implementation=attn_implementation)
    model.init_weights()
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: no weight decay on biases and normalization weights (as HF Trainer does)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if any(s in name.lower() for s in _NO_DECAY) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict]:
    """The parameter groups handed to ``deepspeed.initialize``, in their order: :func:`param_groups` (decayed, then
    not decayed), each split by LoRA+'s rates when ``model.lora.loraplus_lr_ratio`` is set
    (:func:`finetune.engine.lora.loraplus_groups`: a group then carries its own ``lr``; without LoRA+ the groups take
    the optimizer's ``train.lr``).

    A resume rebuilds the same list from this launch's config to give the restored groups their rates and decays
    (:func:`finetune.lifecycle.resume.apply`): DeepSpeed keeps the groups' order and count (ZeRO 0-3; LoRA runs
    neither with Muon nor with expert parallelism, which split groups)."""
    groups = param_groups(model, cfg.train.weight_decay)
    if cfg.model.lora is not None and cfg.model.lora.loraplus_lr_ratio:
        groups = lora.loraplus_groups(model, groups, cfg.train.lr, cfg.model.lora.loraplus_lr_ratio)
    return groups


@dataclass
class Built:
    """The DeepSpeed engine and what was built alongside it."""

    engine: Any
    """``deepspeed.DeepSpeedEngine``: call it like the model; ``backward``/``step`` train it."""
    model_config: Any
    """The transformers ``PretrainedConfig`` the model was built from."""
    hf_ds_config: Any = None
    """``HfDeepSpeedConfig`` kept alive under ZeRO-3 (transformers holds only a weak reference)."""


def inference_ds_config(ds: dict) -> dict:
    """A copy of the DeepSpeed config ``ds`` for an engine that only runs forward passes (evaluation).

    Without ``optimizer`` and ``scheduler`` sections, ``zero_optimization.offload_optimizer`` or the gradient
    settings; ZeRO stages 1 and 2 become stage 0 (DeepSpeed 0.19.8 refuses them without an optimizer, and what they
    partition, optimizer state and gradients, does not exist here); stage 3 stays (parameter partitioning, which
    DeepSpeed runs without an optimizer). Precision (``bf16``/``fp16``), batch sizes and the rest are kept.
    """
    out = {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
    zero = dict(out.get("zero_optimization") or {})
    zero.pop("offload_optimizer", None)
    if zero_stage(ds) in (1, 2):
        zero["stage"] = 0
    out["zero_optimization"] = zero
    return out


def has_optimizer(engine) -> bool:
    """True when the DeepSpeed ``engine`` holds a real optimizer (one that allocates state to train with); False for
    an engine built with ``optimizer=False`` (DeepSpeed's wrappers around no optimizer: ``DummyOptim``,
    ``DeepSpeedZeRoOffload``, keep no optimizer state and no fp32 master weights)."""
    return engine.basic_optimizer is not None


def build_engine(cfg: RunConfig, recipe, model_config, ds: dict, total_steps: int, optimizer: bool = True) -> Built:
    """Build the model and wrap it in a DeepSpeed engine.

    Args:
        cfg: run config.
        recipe: the task's :class:`~finetune.recipes.Recipe` (its ``model_class``).
        model_config: the transformers config to build (:func:`load_model_config`).
        ds: resolved DeepSpeed config dict.
        total_steps: optimizer steps of the whole run (length of the LR schedule).
        optimizer: False for an engine that only evaluates (``finetune evaluate``): built from
            :func:`inference_ds_config` with no optimizer and no LR schedule, so no optimizer state and no fp32
            master weights are allocated (about 12-16 bytes a parameter less); ``backward``/``step`` are then
            unusable.

    Returns:
        :class:`Built`.
    """
    if not optimizer:
        ds = inference_ds_config(ds)
    hf_ds = HfDeepSpeedConfig(ds) if zero_stage(ds) == 3 else None
    torch.manual_seed(cfg.train.seed)
    attn = cfg.model.attn_implementation  # sdpa, eager, flash_attention_2 (checked in finetune.preflight.validate)
    if source := gguf.describe(cfg.model.path):  # model.path named a .gguf: its converted folder (engine/gguf.py)
        logger.info(source)
    if cfg.model.quantization is not None:  # QLoRA: the frozen base quantized as it loads (bitsandbytes)
        model = quantize.load_base(recipe.model_class, cfg.model.path, model_config, cfg.model.quantization,
                                   precision_of(ds), attn)
        q = cfg.model.quantization
        logger.info(f"quantized base: bitsandbytes {q.bits}-bit"
                    f"{f' {q.quant_type}, double quantization {q.double_quant}' if q.bits == 4 else ''}, compute "
                    f"dtype {str(quantize.compute_dtype(q, precision_of(ds))).removeprefix('torch.')}")
    elif cfg.model.init == "pretrained":
        model = load_pretrained(recipe.model_class, cfg.model.path, model_config, attn)
    elif hf_ds is not None:  # inside zero.Init; transformers runs only _init_weights, gathered per module
        model = recipe.model_class.from_config(model_config, dtype=torch.float32, attn_implementation=attn)
    else:
        model = scratch_model(recipe.model_class, model_config, attn)
    n_params = lora.count_parameters(model)[1]
    logger.info(f"model: {type(model).__name__} ({cfg.model.init}), {n_params:,} parameters "
                f"({quantize.model_bytes(model) / 2**20:.1f} MiB of weights on this rank), ZeRO stage "
                f"{zero_stage(ds)}, attention {attn}")
    if cfg.model.fused_kernels:
        logger.info(f"fused kernels: {kernels.fuse(model)}")
        if optimizer and getattr(model.config, "_attn_implementation", None) == "sdpa" and distributed.on_cpu() \
                and kernels.attention_dropout(model.config) and (note := kernels.lighten_attention_dropout()):
            logger.info(f"fused kernels: {note}")
    if zero_stage(ds) == 3 and (leaves := moe.mark_leaf_modules(model)):  # before deepspeed.initialize
        logger.info(f"mixture of experts: ZeRO-3 gathers each {', '.join(leaves)} whole (leaf modules: a rank that "
                    f"routes no token to an expert still joins every all-gather)")
    if cfg.model.freeze:  # before LoRA and deepspeed.initialize: DeepSpeed partitions the trainable parameters only
        logger.info(freeze.apply(model, list(cfg.model.freeze)))
    model = lora.apply(model, cfg, recipe)  # gradient checkpointing, LoRA (frozen base): before deepspeed.initialize
    if zero_stage(ds) == 3 and cfg.model.lora is not None and cfg.model.lora.use_dora:
        logger.info(f"DoRA at ZeRO-3: {lora.gather_dora_inputs(model)} DoRA modules gather the adapter and base "
                    f"weights they read (generation before any engine forward included)")
    if optimizer and neftune.activate(model, cfg.train.neftune_noise_alpha) is not None:
        logger.info(f"NEFTune: noise alpha {cfg.train.neftune_noise_alpha:g} on the input embeddings, training "
                    f"forwards only")
    lay = layout.layout(cfg)
    if cfg.parallel.tiled_mlp:
        logger.info(f"tiled MLP (DeepSpeed TiledMLP): {sequence.tile_mlps(model)} modules")
    # Ulysses attention and the SP groups (sp > 1): the rows the model gets per micro-batch (one when flattened; a
    # dpo pair is two sequences; a grpo prompt its num_generations completions, Recipe.rollout)
    per_row = (recipe.rollout(cfg) or (recipe.capabilities.sequences_per_row,))[0]
    rows = 1 if flattens(cfg, recipe) else cfg.train.micro_batch_size * per_row
    mpu = sequence.start_sequence_parallel(model, cfg, lay, rows)
    if mpu is not None:
        logger.info(f"sequence parallelism: DeepSpeed Ulysses over {lay.sp} ranks ({cfg.model.attn_implementation}); "
                    f"{lay.describe()}")

    def scheduler(optimizer):
        return get_scheduler(cfg.train.lr_scheduler, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                             num_training_steps=total_steps)

    # AutoEP (parallel.expert_parallel_size > 1) reads transformers' output-capture registry during initialize
    autoep = [p for p in [expert.registry_patch()] if p is not None] if "expert_parallel" in ds else []
    if not optimizer:
        with patches.applied(*autoep):
            engine, _, _, _ = deepspeed.initialize(model=model, config=ds, dist_init_required=False, mpu=mpu)
        if has_optimizer(engine):  # a DeepSpeed that builds one anyway would allocate its state: say so, loudly
            raise RuntimeError(f"DeepSpeed built an optimizer ({type(engine.optimizer).__name__}) for an engine "
                               f"without one")
        logger.info(f"engine without optimizer (evaluation): ZeRO stage {zero_stage(ds)}, no optimizer state, no "
                    f"fp32 master weights ({type(engine.optimizer).__name__ if engine.optimizer is not None else 'None'})")
        return Built(engine=engine, model_config=model_config, hf_ds_config=hf_ds)
    keep = list(autoep)
    if cfg.train.optimizer == "muon":  # use_muon on every parameter, by module type; DeepSpeed's by-name tagging off
        logger.info(muon.tag(model))
        keep.append(muon.keep_tags())
    if lay.pp > 1:  # the stages' layers, built from this model's modules (finetune.engine.pipeline)
        model = pipeline.to_pipeline(model, cfg, lay.world, recipe.target_fraction(cfg.data))
        if zero_stage(ds) == 0:  # the norm, the clipping and the skip of non-finite steps over all stages: ours
            ds = {**ds, "gradient_clipping": 0.0}
        logger.info(f"pipeline parallelism: {lay.pp} stages x {lay.dp} data-parallel; this rank holds layers "
                    f"{model._local_start}-{model._local_stop - 1} of {model._num_layers} "
                    f"({sum(p.numel() for p in model.parameters()):,} parameters); {lay.describe()}")
    with patches.applied(*keep):
        groups = optimizer_groups(model, cfg)
        if "expert_parallel" in ds:  # DeepSpeed splits each named group into its dense and expert parameters
            groups = expert.name_groups(groups)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                               config=ds, lr_scheduler=scheduler, dist_init_required=False, mpu=mpu)
    if lay.pp > 1:
        pipeline.install_timing(engine)  # the measured bubble (train/pipeline_idle) of logged steps
        if zero_stage(ds) == 0:
            pipeline.install_step_guard(engine, cfg.train.max_grad_norm)
    if sequence.fix_zero3_average(engine, lay):
        logger.info("sequence parallelism: ZeRO-3's reduce-scatter averages over the data-parallel ranks "
                    "(finetune.parallel.sequence.fix_zero3_average)")
    if engine.bfloat16_enabled() and hasattr(engine.optimizer, "check_grad_overflow"):
        # ZeRO 1/2 in bf16 skip a non-finite step only with this on (DeepSpeed's default, a JSON may turn it off);
        # in fp32 and fp16 they skip on a non-finite global gradient norm anyway, and this on would add a scan of
        # every gradient, an all-reduce and a host sync to each step
        engine.optimizer.check_grad_overflow = True
    return Built(engine=engine, model_config=model_config, hf_ds_config=hf_ds)
