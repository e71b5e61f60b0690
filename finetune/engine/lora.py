"""Model surgery for memory: LoRA adapters (``peft``) and gradient checkpointing (``model.lora``,
``model.gradient_checkpointing``).

Applied by :func:`apply` in :func:`finetune.engine.model.build_engine`, after the model is built and before
``deepspeed.initialize``, so the DeepSpeed optimizer only ever sees the adapters (and, for ``seq_cls``, the
classifier head: peft's ``SEQ_CLS`` task type keeps it trainable as a ``modules_to_save`` copy).

* The base model is frozen by ``peft.get_peft_model``; :func:`finetune.engine.model.param_groups` skips frozen
  parameters, so they get no AdamW state and no gradient.
* ZeRO-3: the model is built inside ``deepspeed.zero.Init`` (partitioned), peft reads the partitioned layers'
  shapes from ``ds_shape`` and adds ordinary adapter tensors; ``deepspeed.initialize`` converts those to ZeRO-3
  parameters (``_convert_to_zero_parameters``). The adapters are initialised from a freshly seeded torch RNG
  (``train.seed``), so they are the same at every ZeRO stage whatever building the model drew.
* Checkpoints stay DeepSpeed's (the whole ``PeftModel`` state, frozen weights included); the export
  (:mod:`finetune.lifecycle.export`) rebuilds the ``PeftModel``, writes the adapter folder and the merged model.
"""

from __future__ import annotations

import warnings

import peft
import torch
from peft.tuners.tuners_utils import NoMatchingPeftModuleError

from finetune.config import LoraConfig, RunConfig
from finetune.logs import logger

ALL_LINEAR = "all-linear"
ADAPTER_DIR = "adapter"
"""Subfolder of the export with the adapter (``adapter_config.json``, ``adapter_model.safetensors``)."""

# peft task type by the recipe's transformers auto class; None (plain PeftModel) for the others, e.g. masked LM.
_TASK_TYPES = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForCausalOrImageTextLM": "CAUSAL_LM",
               "AutoModelForSequenceClassification": "SEQ_CLS",
               "AutoModelForTokenClassification": "TOKEN_CLS", "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM",
               "AutoModel": "FEATURE_EXTRACTION"}


def peft_config(lora: LoraConfig, model_class):
    """``peft.LoraConfig`` for ``model.lora`` and the recipe's ``model_class`` (which sets the task type)."""
    targets = [str(t) for t in lora.target_modules]
    return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
                           use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                           modules_to_save=[str(m) for m in lora.modules_to_save] or None,
                           task_type=_TASK_TYPES.get(model_class.__name__))


class _Groups(list):
    """Stands in for the optimizer class of ``peft.optimizers.create_loraplus_optimizer``: keeps the parameter groups
    peft builds (``[{"params", "lr", "weight_decay"}, ...]``) instead of allocating an optimizer."""

    def __init__(self, groups, **_defaults):
        super().__init__(groups)


def loraplus_groups(model: torch.nn.Module, groups: list[dict], lr: float, ratio: float) -> list[dict]:
    """LoRA+ (Hayou et al. 2024, "LoRA+: Efficient Low Rank Adaptation of Large Models"): ``groups`` (AdamW's,
    :func:`finetune.engine.model.param_groups`) split by the learning rate peft 0.21's ``create_loraplus_optimizer``
    gives each parameter (its grouping is called, not copied): the adapters of a peft ``lora.Embedding`` layer at
    1e-6 (peft's ``loraplus_lr_embedding``), the ``lora_B`` matrices and every 1-D trained parameter (biases, DoRA's
    magnitudes, a ``modules_to_save`` norm) at ``lr`` x ``ratio``, the rest (the ``A`` matrices, ``modules_to_save``
    matrices) at ``lr``.

    Each part keeps its group's weight decay (our rule of :func:`~finetune.engine.model.param_groups`, as transformers'
    ``Trainer`` decides it: peft's would decay the ``A`` matrices by ``loraplus_weight_decay``, 0 by default) and
    gets its own ``lr``, which the LR schedule scales (``LambdaLR`` per group). The order is fixed (the groups' order,
    then each rate in the order of its first parameter), so a checkpoint's optimizer groups meet the same groups on
    resume (:func:`finetune.lifecycle.resume.apply` rebuilds the rates and decays from the config by it).

    Returns:
        The groups, each with ``params``, ``weight_decay`` and ``lr`` (absolute, in the config's units).
    """
    from peft.optimizers import create_loraplus_optimizer

    rates = {id(p): g["lr"] for g in create_loraplus_optimizer(model, _Groups, lr=lr, loraplus_lr_ratio=ratio)
             for p in g["params"]}
    out = []
    for group in groups:
        parts: dict[float, list] = {}
        for p in group["params"]:
            parts.setdefault(rates[id(p)], []).append(p)
        out += [{**group, "params": ps, "lr": rate} for rate, ps in parts.items()]
    return out


def wrap(model: torch.nn.Module, lora: LoraConfig, model_class, seed: int):
    """``peft.get_peft_model(model, ...)`` with adapters drawn from ``torch.manual_seed(seed)`` in a forked RNG
    (the caller's RNG state is left as it was).

    Returns:
        The ``PeftModel`` (base frozen, adapters trainable, fp32 adapters).
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    # the global RNG streams (dropout, ...) continue as if no adapters had been drawn
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft's notices about GPT-2's Conv1D layout and a transformers deprecation
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        config = peft_config(lora, model_class)
        if config.target_modules == ALL_LINEAR:
            config.target_modules = all_linear(model)
        return peft.get_peft_model(model, config)


def all_linear(model: torch.nn.Module) -> str | list[str]:
    """What ``all-linear`` adapts in ``model``: peft's ``all-linear`` (every linear layer but the output head), or,
    in a multimodal model (one with a language model part beside others, :mod:`finetune.engine.freeze`'s aliases),
    the linear layers of its language model only, by their full names: the vision tower and the projector keep
    their weights, as LLaMA-Factory's LoRA does by default (its ``freeze_vision_tower``)."""
    from finetune.engine.freeze import matches

    names = [n for n, _ in model.named_parameters()]
    inside = [n for n in names if matches(n, "language_model")]
    if not inside or all(n in inside or n.startswith(("lm_head.", "model.lm_head.")) for n in names):
        return ALL_LINEAR
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and matches(f"{n}.weight", "language_model")]


def gather_dora_inputs(model: torch.nn.Module) -> int:
    """ZeRO-3: register, with every DoRA module of ``model`` (peft's ``lora_magnitude_vector`` entries), the
    parameters it reads outside their own modules' forwards (``deepspeed.zero.register_external_parameter``), so
    DeepSpeed gathers them whenever the DoRA module runs.

    peft 0.21's ``DoraLinearLayer.forward`` reads ``lora_A.weight`` (its shape, for the identity it multiplies), the
    base layer's weight (the column norm) and its bias, and the embedding variant both adapter matrices; a partitioned
    parameter read that way is empty (``IndexError`` in ``dora.py``) unless DeepSpeed gathers it. DeepSpeed finds
    such parameters by itself only inside an engine forward (``ZeROOrderedDict``, ``_in_forward``), so generation
    through the model before any engine forward (``grpo``, on-policy ``distill`` with ``gather_for_generation:
    false``) crashed. Call before or after ``deepspeed.initialize`` (the registration is by parameter identity).

    Returns:
        How many DoRA modules got their parameters registered.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    from peft.tuners.lora import LoraLayer

    n = 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for name, dora in layer.lora_magnitude_vector.items():
            params = list(layer.get_base_layer().parameters())
            for adapters in (layer.lora_A, layer.lora_B):
                if name in adapters:
                    params += list(adapters[name].parameters())
            for adapters in (layer.lora_embedding_A, layer.lora_embedding_B):
                if name in adapters:
                    params.append(adapters[name])
            for p in params:
                register_external_parameter(dora, p)
            n += 1
    return n


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts; ZeRO-3 partitioned parameters and bitsandbytes' packed 4-bit weights
    count with their full size."""
    trainable = total = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)  # Params4bit: two weights a byte, the shape in its QuantState
        n = state.shape.numel() if state is not None else getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def apply(model: torch.nn.Module, cfg: RunConfig, recipe) -> torch.nn.Module:
    """Gradient checkpointing and LoRA as the run config asks; logs trainable vs total parameters.

    Gradient checkpointing is transformers' ``gradient_checkpointing_enable`` with ``use_reentrant=False``
    (bit-identical gradients in fp32). With LoRA the embedding output is made to require grad
    (``enable_input_require_grads``), so a checkpointed block whose own weights are all frozen still passes
    gradients to the adapters of the blocks before it.

    Returns:
        The model to hand to ``deepspeed.initialize`` (a ``PeftModel`` with LoRA).
    """
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.model.lora is not None:
        if cfg.model.gradient_checkpointing:
            model.enable_input_require_grads()
        model = wrap(model, cfg.model.lora, recipe.model_class, cfg.train.seed)
        trainable, total = count_parameters(model)
        targets = sorted({n.rsplit(".", 1)[-1] for n in model.targeted_module_names})
        variants = [k for k, on in (("DoRA", cfg.model.lora.use_dora), ("rsLoRA", cfg.model.lora.use_rslora),
                                    (f"LoRA+ ratio {cfg.model.lora.loraplus_lr_ratio:g}", cfg.model.lora.loraplus_lr_ratio),
                                    (f"modules_to_save {cfg.model.lora.modules_to_save}", cfg.model.lora.modules_to_save))
                    if on]
        logger.info(f"LoRA{' (' + ', '.join(variants) + ')' if variants else ''} r={cfg.model.lora.r} "
                    f"alpha={cfg.model.lora.alpha:g} dropout={cfg.model.lora.dropout:g} on "
                    f"{len(model.targeted_module_names)} modules ({', '.join(targets)}): trainable parameters "
                    f"{trainable:,} of {total:,} ({100 * trainable / total:.3f}%)")
    if cfg.model.gradient_checkpointing:
        logger.info("gradient checkpointing on (non-reentrant)")
    if recipe.capabilities.disables_dropout:
        n = disable_dropout(model)
        if n and cfg.model.lora is not None and cfg.model.lora.dropout > 0:
            logger.warning(f"model.lora.dropout={cfg.model.lora.dropout:g} is not applied: recipe {recipe.name} "
                           f"compares log-probabilities with a deterministic reference, so every dropout module is "
                           f"off ({n} modules)")
    return model


def disable_dropout(model: torch.nn.Module) -> int:
    """Every ``torch.nn.Dropout`` (and subclass) of ``model`` gets ``p = 0`` (TRL 1.16's ``disable_dropout_in_model``),
    and so does every float module attribute ending in ``dropout`` (transformers' attention modules keep their
    ``attention_dropout`` probability as a float and pass it to the attention kernel in training): a train-mode
    forward is then deterministic, LoRA's ``lora_dropout`` included. TRL's function is not called: TRL is no runtime
    dependency of finetune (its test and benchmark extras only; its import costs seconds a launch), and it leaves the
    attention modules' float probabilities on. Returns how many were above 0."""
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            n += 1
        for key, value in vars(module).items():
            if key.endswith("dropout") and isinstance(value, float) and value > 0:
                setattr(module, key, 0.0)
                n += 1
    return n


def _module_names(model: torch.nn.Module, limit: int = 8) -> str:
    """A few distinct names of the model's weight-carrying modules, with their types: what target_modules can name."""
    seen: dict[str, str] = {}
    for name, module in model.named_modules():
        if name and not list(module.children()) and getattr(module, "weight", None) is not None:
            seen.setdefault(name.rsplit(".", 1)[-1], type(module).__name__)
    shown = [f"{n} ({t})" for n, t in list(seen.items())[:limit]]
    return ", ".join(shown) + (", ..." if len(seen) > limit else "")


def check(cfg: RunConfig, model_class, meta_model, where: str, problems: list[str]) -> None:
    """Check ``model.lora`` and ``model.gradient_checkpointing`` against the model, before any model is built.

    The model, built on the meta device from its config (no memory, no weights read:
    :func:`finetune.engine.model.meta_model`), is wrapped by peft there (in place), so every problem peft would
    raise at start-up is found now.

    Args:
        cfg: run config.
        model_class: the recipe's ``model_class``.
        meta_model: the model on the meta device (``model.config_overrides`` applied), or None when its class
            cannot build it (reported by the model checks).
        where: how to name the model in messages (its ``config.json`` and model type).
        problems: one line per problem is appended: ``r``/``alpha``/``dropout`` out of range, empty
            ``target_modules``, target modules that match no module (a few module names are listed),
            target modules of a type peft cannot adapt, a model without gradient checkpointing support.
    """
    lora = cfg.model.lora
    if lora is not None:
        before = len(problems)
        if lora.r <= 0:
            problems.append(f"model.lora.r: must be > 0, got {lora.r}")
        if lora.alpha <= 0:
            problems.append(f"model.lora.alpha: must be > 0, got {lora.alpha}")
        if not 0.0 <= lora.dropout < 1.0:
            problems.append(f"model.lora.dropout: must be in [0, 1), got {lora.dropout}")
        if not lora.target_modules:
            problems.append(f"model.lora.target_modules: empty; name modules to adapt or use {ALL_LINEAR}")
        if not 0 <= lora.loraplus_lr_ratio < float("inf"):
            problems.append(f"model.lora.loraplus_lr_ratio: must be a finite number >= 0 (the LoRA+ paper suggests "
                            f"16; 0: off), got {lora.loraplus_lr_ratio}")
        if len(problems) > before:
            return
    if lora is None and not cfg.model.gradient_checkpointing:
        return

    model = meta_model
    if model is None:  # the model type's own problems are reported by validate
        return
    if cfg.model.gradient_checkpointing and not model.supports_gradient_checkpointing:
        problems.append(f"model.gradient_checkpointing: {type(model).__name__} ({where}) does not support gradient "
                        f"checkpointing in transformers; set model.gradient_checkpointing=false")
    if lora is None:
        return

    names = _module_names(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrap(model, lora, model_class, 0)
    except NoMatchingPeftModuleError:
        problems.append(f"model.lora.target_modules: {lora.target_modules} match no module of "
                        f"{type(model).__name__} ({where}); its modules are named e.g. {names}; use some of "
                        f"these names or {ALL_LINEAR}")
    except Exception as e:  # noqa: BLE001  (peft raises ValueError/TypeError/... for what it cannot wrap)
        problems.append(f"model.lora: peft cannot add LoRA adapters to {type(model).__name__} ({where}) with "
                        f"target_modules {lora.target_modules}: {' '.join(str(e).split())[:300]} (its modules are "
                        f"named e.g. {names})")
