"""QLoRA's quantized base model (``model.quantization``): bitsandbytes 4- or 8-bit linear layers through
transformers' ``BitsAndBytesConfig``, prepared for adapter training by peft's ``prepare_model_for_kbit_training``
(Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"; transformers' and TRL's QLoRA recipe).

* The base is quantized as ``from_pretrained`` loads it (each rank its own copy, on its own device); the quantized
  weights are frozen, so DeepSpeed's ZeRO 1-2 never see them (only the adapters are in the optimizer's groups).
* ZeRO-3 is refused (:func:`problems`): DeepSpeed 0.19.8 partitions the packed weights like any parameter (DeepSpeed
  issue #7096; with ``bnb_4bit_quant_storage`` set to the compute dtype, as transformers documents, the steps run,
  but the packed bytes then live in float tensors that the run's finiteness checks read as NaN, and checkpoints,
  resume and export of a partitioned quantized base are not built); 8-bit layers under ZeRO-3 were reported to train
  to a wrong loss (bitsandbytes issue #1451).
* Checkpoints hold the packed weights with their quantization state (bitsandbytes' ``_save_to_state_dict``);
  a resume rebuilds the same base from ``model.path`` and loads them back over it.
* The export dequantizes the checkpoint's packed base (the weights training quantized, on whatever device) to the
  compute dtype (:func:`dequantized_base`) before merging the adapters, so the merged model computes what the engine
  computed; the adapter folder is for the 4-bit base (:func:`load_base`).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from transformers import PreTrainedModel

from finetune.config import QuantizationConfig, RunConfig

INSTALL = 'pip install "finetune[qlora]"'
"""How to install bitsandbytes at the version finetune pins."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

BLOCK = 64
"""bitsandbytes' 4-bit block size: one absmax scale per 64 weights."""
DOUBLE_QUANT_BLOCK = 256
"""Double quantization: the fp32 absmax scales are themselves quantized to 8 bits in blocks of 256."""


def available() -> bool:
    """True when bitsandbytes can be imported (found on the path; not imported here)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def compute_dtype(q: QuantizationConfig, precision: str) -> torch.dtype:
    """``q.compute_dtype``, ``auto`` resolved to the run's ``precision`` (``fp32``/``bf16``/``fp16``)."""
    return RUN_DTYPES[precision] if q.compute_dtype == "auto" else DTYPES[q.compute_dtype]


def bnb_config(q: QuantizationConfig, precision: str):
    """transformers' ``BitsAndBytesConfig`` for ``model.quantization``; ``precision`` is the run's (``fp32``, ``bf16``,
    ``fp16``), used when ``compute_dtype`` is ``auto``."""
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(q, precision))


def device_map() -> dict | None:
    """Each rank loads (and so quantizes) its copy on its own accelerator, as accelerate's QLoRA recipes pass
    ``device_map={"": local_rank}``; None on CPU ranks (bitsandbytes' CPU backend quantizes in place)."""
    if not torch.cuda.is_available():
        return None
    return {"": torch.cuda.current_device()}


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """peft's ``prepare_model_for_kbit_training`` without its gradient checkpointing (``model.gradient_checkpointing``
    does that, non-reentrant): every parameter frozen, the non-quantized fp16/bf16 ones (norms, embeddings, the
    output layer) cast to fp32 for stable adapter training.

    bitsandbytes' CPU inference path is switched off (``support_avx512bf16_for_cpu``): on a CPU with AVX512-BF16 a
    ``Linear4bit`` in eval mode without grad repacks its weight in place and from then on multiplies in bf16 through
    a kernel with no backward, in training too; evaluation would then differ from training, and later training steps
    would pass no gradient through the layer's input."""
    import peft

    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        if getattr(getattr(module, "weight", None), "quant_state", None) is not None:
            module.register_load_state_dict_pre_hook(_check_quant_state)
    return model


def _check_quant_state(module, state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook of a 4-bit layer (a resume): the checkpoint's quantization state of its weight
    (bitsandbytes writes it beside the packed weight, and ``torch.nn.Module`` cannot load it back) must equal the
    state the rebuilt base has, and is then dropped; the packed weight loads as usual.

    Raises:
        RuntimeError: they differ: ``model.path`` no longer holds the weights the checkpoint was trained on.
    """
    mine = module.weight.quant_state.as_dict(packed=True)
    for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
        name = key[len(prefix + "weight."):]
        theirs = state_dict.pop(key)
        ours = mine.get(name)
        if ours is None or theirs.shape != ours.shape or not torch.equal(theirs.to(ours.device), ours):
            raise RuntimeError(f"{prefix}weight: the checkpoint's quantization state ({name}) differs from the base "
                               f"quantized from model.path now; resume with the model.path the run was trained on")


def quantized_weight_bytes(out_features: int, in_features: int, q: QuantizationConfig) -> float:
    """Bytes one quantized ``nn.Linear`` weight of ``out_features x in_features`` takes (its bias stays as it is).

    4-bit: half a byte a weight, plus one fp32 absmax per :data:`BLOCK` weights, or with double quantization one
    byte per block plus one fp32 scale per :data:`DOUBLE_QUANT_BLOCK` blocks, and the code maps (bitsandbytes'
    ``QuantState``);
    8-bit (LLM.int8): one byte a weight plus one fp32 scale per output row (``SCB``).
    """
    n = out_features * in_features
    if q.bits == 8:
        return n + 4 * out_features
    blocks = -(-n // BLOCK)
    # per layer: the 16-value fp32 code map; double quantization adds its 256-value fp32 code map and an fp32 offset
    scales = blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK) + 4 * 256 + 4 if q.double_quant else 4 * blocks
    return n / 2 + scales + 4 * 16


def problems(cfg: RunConfig, zero_stage: int, parallel: dict) -> list[str]:
    """One line per reason ``model.quantization`` cannot run with this config (checked before any model is built).

    Args:
        cfg: run config.
        zero_stage: the resolved DeepSpeed ZeRO stage.
        parallel: layout sizes that must be 1, by key (``parallel.tensor_parallel_size``, ...).
    """
    q = cfg.model.quantization
    if q is None:
        return []
    out = []
    if q.bits not in (4, 8):
        out.append(f"model.quantization.bits: must be 4 or 8, got {q.bits}")
    if cfg.model.lora is None:
        out.append("model.quantization: a quantized base is frozen, so it needs LoRA adapters to train (QLoRA); set "
                   "model.lora.r=16 (or another rank), or remove model.quantization")
    if cfg.model.init != "pretrained":
        out.append("model.quantization: quantizes pretrained weights as they load; needs model.init=pretrained "
                   "(a scratch model has nothing worth quantizing)")
    if zero_stage == 3:
        out.append("model.quantization: ZeRO stage 3 cannot partition a bitsandbytes-quantized base (DeepSpeed issue "
                   "#7096: DeepSpeed 0.19.8 splits the packed weights like ordinary parameters, apart from their "
                   "quantization state); use ds.zero_optimization.stage=2 (stages 0, 1 and 2 work: the quantized base "
                   "is frozen and whole on every rank, the adapters' optimizer state and gradients are partitioned)")
    for key, size in parallel.items():
        if size > 1:
            out.append(f"model.quantization: {key}={size} splits the weights across ranks, which a bitsandbytes-"
                       f"quantized base cannot take; set {key}=1")
    if cfg.train.optimizer == "muon":
        out.append("model.quantization: train.optimizer=muon orthogonalises whole weight matrices; with QLoRA only the "
                   "adapters train: use train.optimizer=adamw")
    if not out and not available():
        out.append(f"model.quantization: bitsandbytes is not installed; {INSTALL} (bitsandbytes 0.50.2, which has a "
                   f"CPU backend too)")
    return out


def _quiet_cpu_kernel_notice() -> None:
    """bitsandbytes warns at import on an AVX512-BF16 CPU that its optional ``kernels`` package is missing; that
    kernel serves only the inference path :func:`prepare` switches off."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _quantized(model_class, path: str, model_config, q: QuantizationConfig, precision: str, devices, attn: str):
    """``model_class.from_pretrained(path)`` quantized by ``model.quantization`` on ``devices`` (a ``device_map``)."""
    from transformers.utils import logging as hf_logging

    _quiet_cpu_kernel_notice()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return model_class.from_pretrained(path, config=model_config, local_files_only=True,
                                           quantization_config=bnb_config(q, precision), device_map=devices,
                                           dtype=compute_dtype(q, precision), attn_implementation=attn)
    finally:
        hf_logging.set_verbosity(level)


def load_base(model_class, path: str, model_config, q: QuantizationConfig, precision: str, attn: str = "sdpa"):
    """``model_class.from_pretrained(path)`` quantized by ``model.quantization`` (on this rank's device), then
    :func:`prepare`. The base a QLoRA run trains on, and the one its adapter folder is for."""
    return prepare(_quantized(model_class, path, model_config, q, precision, device_map(), attn))


def dequantized_base(model_class, path: str, model_config, q: QuantizationConfig, precision: str,
                     saved=None):
    """The quantized base dequantized to fp32 ``nn.Linear`` layers (transformers' ``dequantize``): the weights the
    engine's matmuls used, for a merged export.

    The base is built as :func:`load_base` builds it, on the CPU; with ``saved`` each quantized layer's weight is then
    replaced by the one training used (:func:`use_saved`) before it is dequantized. Quantizing ``model.path`` again is
    not the same: bitsandbytes' CUDA kernel and its CPU backend round differently in places (a last partial 64-weight
    block divided by its absmax on the CPU, multiplied by the reciprocal on CUDA; double quantization's offset, a mean,
    summed in each device's order; the nested 8-bit codes by two implementations), so weights at a code boundary can
    get the neighbouring code; dequantization is one multiplication (and the offset's addition) on both.

    Args:
        saved: ``layer name -> {key: tensor}``: the layer's own entries of the module state training saved (its
            ``state_dict``: the packed weight with its quantization state, or the 8-bit weight with ``SCB``).
    """
    model = _quantized(model_class, path, model_config, q, precision, "cpu", "sdpa")
    if saved is not None:
        for name, module in quantized_layers(model).items():
            use_saved(module, saved(name))
    return model.dequantize().float()


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``name -> layer`` of ``model``'s bitsandbytes layers (``Linear4bit``, ``Linear8bitLt``)."""
    import bitsandbytes as bnb

    return {n: m for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def use_saved(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Give the bitsandbytes layer ``module`` the quantized weight of ``saved`` (the layer's ``state_dict`` as
    training saved it), with bitsandbytes' own loading: 4-bit, the packed ``weight`` and the quantization state its
    ``weight.*`` entries hold (``Params4bit.from_prequantized``, as transformers loads a pre-quantized checkpoint);
    8-bit, ``weight`` and ``SCB`` (``Linear8bitLt``'s ``load_state_dict``)."""
    import bitsandbytes as bnb

    if isinstance(module, bnb.nn.Linear4bit):
        stats = {k[len("weight."):]: v for k, v in saved.items() if k.startswith("weight.")}
        module.weight = bnb.nn.Params4bit.from_prequantized(saved["weight"], stats, requires_grad=False,
                                                            device=module.weight.device, module=module)
    else:
        module.load_state_dict({k: v for k, v in saved.items() if k in ("weight", "SCB", "weight_format")},
                               strict=False)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights as stored: transformers' ``get_memory_footprint`` (parameters and buffers at their
    stored size: a 4-bit weight packed two to a byte; a ZeRO-3 partition its local part), plus what it leaves out: for
    each bitsandbytes 4-bit weight its quantization state (absmax scales, code maps; double quantization's nested
    ones) and for each 8-bit weight its row scales (``SCB``)."""
    n = PreTrainedModel.get_memory_footprint(model)  # only parameters() and buffers(): any torch module
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            n += sum(t.numel() * t.element_size() for t in _state_tensors(state))
        scb = getattr(p, "SCB", None)  # 8-bit: one fp32 scale per output row
        n += scb.numel() * scb.element_size() if isinstance(scb, torch.Tensor) else 0
    return n


def _state_tensors(state) -> list[torch.Tensor]:
    out = [t for t in (state.absmax, state.code, getattr(state, "offset", None)) if isinstance(t, torch.Tensor)]
    if getattr(state, "state2", None) is not None:
        out += _state_tensors(state.state2)
    return out


def planned(model: torch.nn.Module, q: QuantizationConfig) -> tuple[int, float]:
    """``(parameters, bytes)`` of the weights bitsandbytes would quantize in ``model`` (a meta-device model built from
    the config, before LoRA): what transformers' ``replace_with_bnb_linear`` replaces (``nn.Linear`` and GPT-2's
    ``Conv1D``), less what ``get_keys_to_not_convert`` keeps (the output layer, tied weights), each at
    :func:`quantized_weight_bytes`. Their biases stay in the run's precision and are not counted here."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = get_keys_to_not_convert(model)
    n, size = 0, 0.0
    for name, module in model.named_modules():
        if not should_convert_module(name, keep):
            continue
        if type(module) is torch.nn.Linear:
            out_f, in_f = module.out_features, module.in_features
        elif isinstance(module, Conv1D):
            in_f, out_f = module.weight.shape
        else:
            continue
        n += out_f * in_f
        size += quantized_weight_bytes(out_f, in_f, q)
    return n, size
