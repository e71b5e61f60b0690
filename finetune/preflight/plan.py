"""The memory model of ``finetune plan``: memory per GPU and node for each ZeRO stage x offload x checkpointing.

Needs only the run config and the model's ``config.json`` (the model is built on the meta device: no weights,
no GPU). For each option it adds up, per rank:

* **Model states** (bytes per parameter ``N``, world size ``W``; the byte counts are DeepSpeed's own, see
  ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`` and
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``: "2 = params_16bit, 18 = 2_grads_16bit
  + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"), generalised to the run's precision ``w``
  (2 bytes for bf16/fp16, 4 for fp32):

  ===========  ======================  ==================  ======================================================
  ZeRO stage   parameters (w bytes)    gradients (w)       fp32 master + fp32 gradients (mixed only) + Adam m, v
  ===========  ======================  ==================  ======================================================
  0            N                       N                   4N + 4N (mixed) + 8N
  1            N                       N                   (4N + 4N (mixed) + 8N) / W
  2            N                       N / W               (4N + 4N (mixed) + 8N) / W
  3            N / W + largest layer   N / W               (4N + 4N (mixed) + 8N) / W
  ===========  ======================  ==================  ======================================================

  With ``train.optimizer: muon`` the ``M`` parameters of the hidden matrices (:mod:`finetune.engine.muon`) keep one
  fp32 momentum buffer (``4M``, DeepSpeed's ``MuonWithAuxAdam``) instead of Adam's ``m, v`` (``8M``); the rest keep
  AdamW's ``8(N - M)``.
  Exception: bf16 ZeRO 1 runs DeepSpeed's ``BF16_Optimizer`` (``engine._do_optimizer_sanity_check``), whose
  fp32 gradient buffer is the whole model's (4N, not 4N/W). ZeRO 1-3 keep an fp32 copy of their parameter
  partition even in fp32 (``.clone().float()`` in DeepSpeed's ZeRO optimizers), so the 4N/W master copy is
  counted in fp32 too. With **CPU offload**
  (``offload_optimizer``; ZeRO 3 also ``offload_param``) the optimizer states, the fp32 gradients and master
  weights (and under ZeRO 3 the 16-bit parameters) move to CPU RAM: per node, ``gpus_per_node`` times the
  rank's share. The same bytes go to NVMe instead with ``device: nvme``.
* **Activations** for the config's micro batch ``b`` and sequence length ``s`` per transformer layer, from
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198),
  section 4.1: ``sbh(34 + 5as/h)`` bytes in 16-bit, i.e. in elements ``sbh(1 + 2 + 1 + 1)`` (attention inputs:
  QKV input, Q and K, V, output projection input) + ``2sbh`` (two LayerNorm inputs) + ``sbh + 2sbI`` (MLP input,
  its up-projection and activation outputs, ``I`` the intermediate size; gated MLPs (Llama family) keep 4 tensors
  of ``sbI``; a fused activation, as ``model.fused_kernels`` makes GPT-2's ``gelu_new``; with that option off,
  such a Python-written activation keeps 3 more) + ``2as^2b`` (attention scores and their softmax, only with
  eager attention: SDPA/flash attention keep none) and one byte per dropout mask (``2sbh + as^2b``, only when dropout is on). Gradient checkpointing
  (full recomputation, section 4.1 "2sbh") keeps each layer's input and one layer's activations at a time.
  The head adds the logits. LM heads run only at target positions (``sb`` x the MLM masking probability for
  ``bert_mlm``, ``sb`` for causal LMs), in chunks of at most ``LOGITS_CHUNK_ELEMENTS``
  (:mod:`finetune.recipes.lm_loss`): one chunk's logits in the activation dtype, their fp32 copy (mixed
  precision) and one fp32 gradient-sized tensor (cross-entropy's saved log-softmax, then its gradient); ``seq_cls``
  (``V`` = the number of labels, one position per row) also keeps the fp32 log-softmax and its gradient.
* **DeepSpeed buffers** from the DeepSpeed config: ZeRO 1/2 ``reduce_bucket_size`` (x2 with ``overlap_comm``)
  and ``allgather_bucket_size``; ZeRO 3 ``reduce_bucket_size`` and ``stage3_prefetch_bucket_size``; ZeRO 0 one
  flat gradient bucket for the all-reduce; each in the gradient dtype and never more than the model itself.
* **Mixtures of experts** (:mod:`finetune.engine.moe`): the model states count every parameter (all experts are
  trained and kept), the activations those of the ``k`` experts each token passes (intermediate size ``k x`` the
  expert's), and under ZeRO 3 the largest gather is a whole sparse MoE block (a leaf module, gathered at once). The
  header gives total and active parameters: active = the non-expert ones + ``k / E`` of the expert ones
  (``E`` routed experts, top-``k``). With expert parallelism (``parallel.expert_parallel_size`` = ``EP``, AutoEP) a
  rank holds ``1 / EP`` of the experts: that is what ZeRO 0 keeps of parameters, gradients and optimizer states,
  ZeRO 1 of parameters and gradients, ZeRO 2 of parameters; ZeRO then partitions the experts over the ``world /
  EP`` ranks of their expert-data-parallel group, the same ``1 / world`` share as without EP.
* **QLoRA** (``model.quantization``, :mod:`finetune.engine.quantize`): the weights bitsandbytes quantizes (every
  linear layer but the output one) count at their packed size, 4-bit: half a byte a weight plus the block scales and
  code maps (``quantized_weight_bytes``), 8-bit: one byte plus a scale per row; the rest of the base in the run's
  precision. ZeRO 3 is not an option (refused with a quantized base).
* **Generation** of a recipe with a rollout (``grpo``, ``Recipe.rollout``), before the step's forward passes: one
  ``generate`` call per rank holds the sequences of all the step's ``gradient_accumulation_steps`` micro batches
  (their KV cache and the prefill's working set, :func:`generation_bytes`), and under ZeRO 3 the whole model gathered
  next to the rank's partition; the activations column holds the larger of that and training.
* **Frozen models** the recipe runs beside the trained one (``Recipe.frozen_models``, ``distill``'s teacher): their
  weights in the params column (``w`` bytes a parameter; under ZeRO 3 ``/ W`` plus their largest layer), no
  gradients or optimizer states, and their forward without gradients in the activations (:func:`frozen_bytes`).
* **CPU RAM per node** also holds each rank's copy of the model while it is loaded (fp32, ``4N``; under ZeRO 3
  ``zero.Init`` builds it partitioned: one layer), as in DeepSpeed's estimators.

The recommendation is the fastest option that fits (rough relative step costs: ZeRO 0/1/2 cheapest, ZeRO 3
+15% for the parameter all-gathers, gradient checkpointing +33% for the recomputed forward, offload +100% for
CPU Adam and PCIe traffic) and the largest micro batch that still fits it (activations grow linearly with the
micro batch). "Fits" leaves 10% of the GPU memory for the CUDA context and allocator fragmentation.

Checked against measured peak memory: ``tests/test_train.py::test_plan_matches_measured_rss`` (CPU ranks,
``peak_rss_train_mib - rss_before_model_mib`` from :mod:`finetune.lifecycle.health`, within 50%;
CPU-rank RSS moves with the allocator; on CPU ranks a fixed
:data:`CPU_RUNTIME_BYTES` is added for the runtime's lazily allocated workspace).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field

import torch

from finetune.parallel import layout, pipeline
from finetune.config import RunConfig, deep_merge
from finetune.engine.ds_config import (
    choose_precision,
    load_ds_json,
    optimizer_offloaded,
    resolve_ds_config,
    zero_stage,
)
from finetune.engine.model import load_model_config
from finetune.errors import ConfigError
from finetune.engine import freeze, lora, moe, muon, quantize
from finetune.engine.kernels import fusable
from finetune.recipes import get_recipe
from finetune.recipes.lm_loss import chunk_tokens

GIB = 2**30
CPU_RUNTIME_BYTES = 150 * 2**20
"""Host memory a CPU rank adds while it builds the engine and trains beyond model states, activations and
buffers: DeepSpeed's shared-memory all-reduce buffer of the CPU accelerator (``/dev/shm/deepspeed_allreduce_
buffer_*``, 66 MiB per rank), autograd and oneDNN workspaces, glibc heap fragmentation, evaluation and checkpoint
saving. Sized so that the plan stays above the peaks of the tiny 16-step runs of ``tests/test_train.py`` (GPT-2
and BERT, ZeRO 2 and 3), where this share is more than half of the total (figures: docs/commands.md). A constant:
it matters less the bigger the model, and GPUs have no such share in ``torch.cuda.max_memory_allocated`` (their
CUDA context is outside it)."""
GPU_HEADROOM = 0.10
"""Fraction of the GPU memory a plan leaves free (CUDA context, fragmentation of the caching allocator)."""
STEP_COST = {"stage": {0: 0.0, 1: 0.01, 2: 0.02, 3: 0.15}, "checkpointing": 0.33, "offload": 1.0}
"""Rough relative step-time costs used to order the options (see the module docstring)."""
_GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo", "olmo2",
          "granite", "cohere", "starcoder2")


@dataclass
class ModelShape:
    """What the memory formulas need from a model, read from a model built on the meta device."""

    model_type: str
    params: int
    """Parameters (shared ones once)."""
    largest_layer: int
    """Parameters of the largest module (its own, not its children's): what ZeRO 3 gathers at once."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    head_outputs: int
    """Logits per position: the vocabulary (LM heads) or the number of labels (sequence classification)."""
    head_positions_per_row: bool
    """True when the head produces logits at every position (LM heads), False for one per row (seq_cls)."""
    gated_mlp: bool
    eager_attention: bool
    dropout: bool
    target_fraction: float = 1.0
    """Fraction of positions where the LM head runs (``bert_mlm``: ``data.mlm_probability``; causal LMs: 1)."""
    python_activation: bool = False
    """The MLP activation stays a Python chain of ops (``model.fused_kernels: false`` on a ``gelu_new`` model):
    autograd keeps 3 more ``sbI`` tensors per layer (:mod:`finetune.engine.kernels`)."""
    trainable: int = 0
    """Parameters that train (``model.lora``: the adapters; the base is frozen and has no gradients or optimizer
    states); 0 means all of ``params``."""
    muon: int = 0
    """Parameters Muon trains (``train.optimizer: muon``, :func:`finetune.engine.muon.split`: the 2-D hidden
    matrices): one fp32 momentum buffer each (4 bytes) instead of Adam's two moments (8); 0 with AdamW."""
    expert_params: int = 0
    """Parameters of the routed experts of a mixture of experts (:func:`finetune.engine.moe.expert_parameter_count`);
    0 for a dense model."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    top_k: int = 0
    """Experts each token passes (0: dense)."""
    expert_parallel: int = 1
    """``parallel.expert_parallel_size``: under AutoEP a rank holds ``1 / expert_parallel`` of each layer's experts
    (:mod:`finetune.parallel.expert`), before ZeRO partitions them over the expert-data-parallel group."""
    aux_loss_coef: float = 0.0
    """The router's load-balancing loss coefficient (``router_aux_loss_coef``; 0 for a dense model)."""
    sequences_per_row: int = 1
    """Sequences the model runs per data row (``dpo``: chosen and rejected, 2): the activations of a micro batch
    of ``b`` rows are those of ``b x sequences_per_row`` sequences (no reference model is resident: its
    log-probabilities are computed before training)."""
    kv_heads: int = 0
    """Key-value heads (grouped-query attention; 0: ``heads``), for the generation's KV cache."""
    head_dim: int = 0
    """Size of one attention head (0: ``hidden / heads``)."""
    generation: tuple[int, int] | None = None
    """The recipe's ``rollout``: ``(sequences per row, tokens per sequence)`` generated every step (``grpo``), else
    None."""
    quantized_params: int = 0
    """Base weights stored quantized (``model.quantization``, QLoRA: the linear layers but the output one); 0: none."""
    quantized_bytes: float = 0.0
    """Bytes those weights take quantized (:func:`finetune.engine.quantize.quantized_weight_bytes`: 4-bit 0.5 byte
    a weight plus the block scales, 8-bit 1 byte plus a scale per row), in place of ``quantized_params`` x the
    precision's bytes."""
    vision_params: int = 0
    """An image-text model's vision tower and projector parameters (``model.freeze``'s ``vision_tower`` and
    ``projector``; counted in ``params``, run by every row's images: their activations are not in the estimate)."""
    image_tokens: int = 0
    """Tokens of the sequence one image takes (the image placeholders of :func:`image_tokens_per_image`); 0: a text
    model, or no processor to ask."""
    image_size: str = ""
    """The image size ``image_tokens`` was measured at (``WxH``)."""
    frozen_params: int = 0
    """Parameters of the models the recipe runs beside the trained one without training them (``Recipe.frozen_models``;
    ``distill``'s teacher): their weights only (no gradients, no optimizer states), partitioned under ZeRO-3."""
    frozen_largest: int = 0
    """The largest layer of those models (what ZeRO-3 gathers at once)."""
    frozen_hidden: int = 0
    """Their hidden size (the widest), for their forward's working set."""
    frozen_intermediate: int = 0
    """Their MLP's intermediate size (the widest)."""
    frozen_vocab: int = 0
    """Their output heads' size (the largest), for their logits, one chunk at a time."""
    frozen_names: str = ""
    """Where they were read from, for the plan's header."""
    generation_micro_batches: int = 1
    """Micro batches whose rows one generation holds at once: ``train.gradient_accumulation_steps`` (``grpo`` joins
    the step's micro batches into one ``generate`` call per rank, ``grpo.join_prompts``)."""


def active_parameters(shape: ModelShape) -> int:
    """Parameters one token passes through: all of a dense model's; for a mixture of experts the non-expert ones
    plus ``top_k / experts`` of the expert ones (:func:`finetune.engine.moe.active_parameters`)."""
    if not shape.experts:
        return shape.params
    return moe.active_parameters(shape.params, shape.expert_params,
                                 moe.MoeShape(experts=shape.experts, top_k=shape.top_k, aux_loss_coef=0.0))


@dataclass
class Estimate:
    """One option's memory, in bytes: ``gpu`` per GPU (rank), ``cpu`` and ``nvme`` per node, by component."""

    stage: int
    offload: bool
    checkpointing: bool
    micro_batch: int
    gpu: dict = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)
    nvme: dict = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return int(sum(self.gpu.values()))

    @property
    def cpu_total(self) -> int:
        return int(sum(self.cpu.values()))

    @property
    def nvme_total(self) -> int:
        return int(sum(self.nvme.values()))

    @property
    def cost(self) -> float:
        return STEP_COST["stage"][self.stage] + STEP_COST["checkpointing"] * self.checkpointing \
            + STEP_COST["offload"] * self.offload

    @property
    def name(self) -> str:
        return (f"ZeRO {self.stage}{' + offload' if self.offload else ''}"
                f"{' + grad ckpt' if self.checkpointing else ''}")


def model_shape(cfg: RunConfig) -> ModelShape:
    """Build the run's model on the meta device (no memory, no weights) and read its shape.

    Raises:
        ConfigError: the model config cannot be read or the recipe's model class cannot build it.
    """
    recipe = get_recipe(cfg.recipe)
    try:
        config = load_model_config(cfg, recipe)
        with torch.device("meta"):
            model = recipe.model_class.from_config(config)
        quantized = (quantize.planned(model, cfg.model.quantization) if cfg.model.quantization is not None
                     else (0, 0.0))
        if cfg.model.lora is not None:  # the adapters, built on the meta device too
            model = lora.wrap(model, cfg.model.lora, recipe.model_class, cfg.train.seed)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (transformers raises many types for a config it cannot build)
        raise ConfigError(f"model.path: cannot build the model of '{cfg.model.path}/config.json' on the meta "
                          f"device: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from e
    trainable, params = lora.count_parameters(model)
    vision = sum(p.numel() for n, p in model.named_parameters()
                 if any(freeze.matches(n, k) for k in ("vision_tower", "projector"))) \
        if getattr(config, "vision_config", None) is not None else 0
    tokens, size = image_tokens_per_image(cfg, config) if vision else (0, "")
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    # a multimodal model's language model: its layers run the sequence (the vision tower's parameters are counted)
    config = config.get_text_config(decoder=True)
    hidden = config.hidden_size
    routed = moe.moe_shape(config)
    gated = config.model_type in _GATED or routed is not None
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    expert_params = 0
    if routed is not None:  # the k experts a token passes; ZeRO-3 gathers each sparse block whole (a leaf module)
        intermediate = routed.top_k * (getattr(config, "moe_intermediate_size", None) or intermediate)
        expert_params = moe.expert_parameter_count(model)
        largest = max([largest] + [sum(p.numel() for p in b.parameters()) for b in moe.sparse_blocks(model)])
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    dropout = any(isinstance(v, float) and v > 0 for k, v in config.to_dict().items()
                  if "dropout" in k or k.endswith("_pdrop"))
    per_row = recipe.capabilities.one_target_per_row
    frozen = frozen_shape(recipe.frozen_models(cfg))
    return ModelShape(**frozen, model_type=config.model_type, params=params, largest_layer=largest,
                      layers=config.num_hidden_layers, hidden=hidden, intermediate=intermediate,
                      heads=config.num_attention_heads,
                      head_outputs=getattr(config, "num_labels", 2) if per_row or recipe.capabilities.label_head
                      else config.vocab_size,
                      head_positions_per_row=not per_row, gated_mlp=gated, eager_attention=attn == "eager",
                      dropout=dropout,
                      target_fraction=recipe.target_fraction(cfg.data),
                      python_activation=not cfg.model.fused_kernels and fusable(model) > 0,
                      sequences_per_row=(recipe.rollout(cfg) or (recipe.capabilities.sequences_per_row,))[0],
                      kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                      head_dim=getattr(config, "head_dim", None) or hidden // config.num_attention_heads,
                      generation=recipe.rollout(cfg),
                      generation_micro_batches=cfg.train.gradient_accumulation_steps if recipe.rollout(cfg) else 1,
                      vision_params=vision, image_tokens=tokens, image_size=size,
                      trainable=trainable if trainable < params else 0,
                      muon=muon.muon_parameter_count(model) if cfg.train.optimizer == "muon" else 0,
                      quantized_params=quantized[0], quantized_bytes=quantized[1],
                      expert_params=expert_params, experts=routed.experts if routed else 0,
                      top_k=routed.top_k if routed else 0, aux_loss_coef=routed.aux_loss_coef if routed else 0.0,
                      expert_parallel=cfg.parallel.expert_parallel_size if routed else 1)


def frozen_shape(folders: list[str]) -> dict:
    """:class:`ModelShape`'s ``frozen_*`` fields for the model folders ``folders`` (built on the meta device as causal
    LMs); a folder without a readable ``config.json`` is left out (named in ``frozen_names``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = dict(frozen_params=0, frozen_largest=0, frozen_hidden=0, frozen_intermediate=0, frozen_vocab=0)
    names = []
    for folder in folders:
        try:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception:  # noqa: BLE001  (not there yet: a chain's first command writes it)
            names.append(f"{folder} (not found: not counted)")
            continue
        text = config.get_text_config()
        n = sum(p.numel() for p in model.parameters())
        names.append(f"{folder} ({n:,} parameters)")
        out["frozen_params"] += n
        out["frozen_largest"] = max(out["frozen_largest"], max(sum(p.numel() for p in m.parameters(recurse=False))
                                                               for m in model.modules()))
        out["frozen_hidden"] = max(out["frozen_hidden"], text.hidden_size)
        out["frozen_intermediate"] = max(out["frozen_intermediate"],
                                         getattr(text, "intermediate_size", None) or 4 * text.hidden_size)
        out["frozen_vocab"] = max(out["frozen_vocab"], text.vocab_size)
    return {**out, "frozen_names": ", ".join(names)}


def frozen_bytes(shape: ModelShape, stage: int, world: int, micro_batch: int, seq_len: int, w: int) -> dict:
    """What the frozen models (:func:`frozen_shape`) add per rank (bytes): ``weights`` (``w`` bytes a parameter,
    ``/ world`` plus the largest layer under ZeRO-3) and ``forward``: their forward without gradients, one layer at a
    time (the residual stream, the normalised input and the attention output, ``3 sbh``, and the MLP's ``3 sbI``),
    the hidden states kept at the trained positions (``sbh``) and one chunk of their fp32 logits."""
    if not shape.frozen_params:
        return {"weights": 0, "forward": 0}
    sb = micro_batch * seq_len
    weights = (shape.frozen_params * w / world + shape.frozen_largest * w if stage == 3
               else shape.frozen_params * w)
    forward = (4 * sb * shape.frozen_hidden + 3 * sb * shape.frozen_intermediate) * w \
        + min(sb, chunk_tokens(shape.frozen_vocab)) * shape.frozen_vocab * 4
    return {"weights": int(weights), "forward": int(forward)}


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int,
                     checkpointing: bool) -> dict:
    """Activation memory of one rank (bytes) for one micro batch: ``{"activations": ..., "logits": ...}``.

    Args:
        shape: the model.
        micro_batch: rows per micro batch ``b``.
        seq_len: tokens per row ``s``.
        act_bytes: 2 (bf16/fp16) or 4 (fp32).
        checkpointing: gradient checkpointing (each layer's input kept, one layer recomputed at a time).
    """
    s, b, h, a, inter = seq_len, micro_batch, shape.hidden, shape.heads, shape.intermediate
    sbh = s * b * h
    mlp = sbh + (4 if shape.gated_mlp else 2) * s * b * inter + (3 * s * b * inter if shape.python_activation else 0)
    elements = 5 * sbh + 2 * sbh + mlp + (2 * a * s * s * b if shape.eager_attention else 0)
    masks = (2 * sbh + (a * s * s * b if shape.eager_attention else 0)) if shape.dropout else 0
    layer = elements * act_bytes + masks
    if checkpointing:
        layers = shape.layers * sbh * act_bytes + layer
    else:
        layers = shape.layers * layer
    layers += 3 * sbh * act_bytes  # embedding output, final LayerNorm input, head input
    if shape.head_positions_per_row:  # LM heads run at target positions only, in chunks (recipes/lm_loss.py)

        positions = min(math.ceil(s * b * shape.target_fraction), chunk_tokens(shape.head_outputs))
        per_element = act_bytes + (4 if act_bytes == 2 else 0) + 4  # head output (+ fp32 copy), its fp32 gradient
    else:
        positions, per_element = b, act_bytes + (4 if act_bytes == 2 else 0) + 4 + 4
    return {"activations": layers, "logits": positions * shape.head_outputs * per_element}


def kv_cache_bytes(shape: ModelShape, rows: int, act_bytes: int) -> int:
    """The KV cache of the generation for ``rows`` prompt rows (bytes): ``2 (keys, values) x layers x key-value heads
    x head size x sequences x tokens x bytes``, sequences = ``rows x`` the rollout's sequences per row, tokens = its
    tokens per sequence (``grpo``: prompt + ``max_completion_length``); 0 without a rollout. One step's generation
    holds ``micro batch x generation_micro_batches`` rows (:func:`generation_bytes`)."""
    if shape.generation is None:
        return 0
    per_row, tokens = shape.generation
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * rows * per_row * tokens * act_bytes


def generation_bytes(shape: ModelShape, micro_batch: int, act_bytes: int) -> dict[str, int]:
    """What one step's generation holds beyond the model states (bytes), for ``micro_batch`` rows per micro batch:
    ``{"KV cache": ..., "forward": ...}``, both empty (0) without a rollout.

    The step's one ``generate`` call per rank holds the sequences of all its ``generation_micro_batches`` micro
    batches, ``S = micro_batch x generation_micro_batches x`` sequences per row, of up to ``T`` tokens each:

    * ``KV cache``: :func:`kv_cache_bytes` of those ``micro_batch x generation_micro_batches`` rows;
    * ``forward``: the prefill's working set without gradients, one layer at a time, counted for all ``S`` sequences
      of ``T`` tokens (transformers' ``generate`` prefills every copy of a prompt; fast generation prefills each prompt
      once: an upper bound): the residual stream, the normalised layer input and the attention output (``3 STh``),
      the MLP's intermediate tensors (``3 STI`` gated, ``2 STI`` otherwise), eager attention's scores and
      probabilities (``2 a T^2 S``), plus the sampling's logits of one position per sequence (fp32 logits and
      probabilities, ``2 x 4 S V`` bytes).
    """
    if shape.generation is None:
        return {"KV cache": 0, "forward": 0}
    per_row, tokens = shape.generation
    rows = micro_batch * shape.generation_micro_batches
    st = rows * per_row * tokens
    layer = 3 * st * shape.hidden + (3 if shape.gated_mlp else 2) * st * shape.intermediate
    if shape.eager_attention:
        layer += 2 * shape.heads * tokens * st
    return {"KV cache": kv_cache_bytes(shape, rows, act_bytes),
            "forward": layer * act_bytes + 2 * 4 * rows * per_row * shape.head_outputs}


def _bucket(ds: dict, key: str, default: float) -> int:
    return int(float(ds.get("zero_optimization", {}).get(key, default)))


def estimate(shape: ModelShape, ds: dict, stage: int, offload: bool, checkpointing: bool, micro_batch: int,
             seq_len: int, gpus_per_node: int, nodes: int, precision: str) -> Estimate:
    """Memory of one option (see the module docstring for every formula and its source).

    Args:
        shape: the model (:func:`model_shape`).
        ds: the resolved DeepSpeed dict (bucket sizes).
        stage: ZeRO stage 0-3.
        offload: optimizer (and, for ZeRO 3, parameter) offload to the CPU.
        checkpointing: gradient checkpointing.
        micro_batch: rows per micro batch.
        seq_len: tokens per row.
        gpus_per_node: ranks per node.
        nodes: nodes.
        precision: ``fp32``, ``bf16`` or ``fp16``.

    Returns:
        :class:`Estimate` (bytes; ``gpu`` per rank, ``cpu``/``nvme`` per node).
    """
    n, world = shape.params, gpus_per_node * nodes
    # expert parallelism (AutoEP; no LoRA or Muon with it): a rank holds 1/EP of the experts; ZeRO then partitions
    # them over the world / EP ranks of their expert-data-parallel group, which comes to the same 1/world share
    held = n - shape.expert_params + shape.expert_params // shape.expert_parallel
    t_held = shape.trainable or held  # LoRA: only the adapters have gradients and optimizer states
    t = t_held if stage == 0 else shape.trainable or n  # what the states count before "/ shard"
    w = 4 if precision == "fp32" else 2
    mixed = w == 2
    shard = 1 if stage == 0 else world
    e = Estimate(stage, offload, checkpointing, micro_batch)
    # QLoRA: the quantized weights at their packed size (stages 0-2 only: finetune.engine.quantize refuses 3)
    params = n * w / world + shape.largest_layer * w if stage == 3 else \
        (held - shape.quantized_params) * w + shape.quantized_bytes
    grads = t * w / world if stage >= 2 else t_held * w
    states = {"fp32 master weights": 4 * t / shard if (mixed or stage > 0) else 0,
              # bf16 ZeRO 1 runs DeepSpeed's BF16_Optimizer, which accumulates the whole gradient in fp32
              "fp32 gradients": (4 * t_held if precision == "bf16" and stage == 1 and not offload else 4 * t / shard)
              if mixed else 0,
              "Adam moments (fp32)": 8 * (t - shape.muon) / shard}
    if shape.muon:  # Muon: one momentum buffer per parameter (DeepSpeed's state["momentum_buffer"])
        states["Muon momentum (fp32)"] = 4 * shape.muon / shard
    if offload and stage == 3:
        e.gpu["parameters"] = shape.largest_layer * w * 2  # the gathered layer (and the next, prefetched)
        e.cpu["parameters (offloaded)"] = n * w / world * gpus_per_node
    else:
        e.gpu["parameters"] = params
    e.gpu["gradients"] = grads
    for k, v in states.items():
        if offload:
            e.cpu[k + " (offloaded)"] = v * gpus_per_node
        else:
            e.gpu[k] = v
    if offload:
        e.nvme = {k.replace("(offloaded)", "(nvme offload)"): v for k, v in e.cpu.items()}
    e.gpu.update(activation_bytes(shape, micro_batch * shape.sequences_per_row, seq_len, w, checkpointing))
    frozen = frozen_bytes(shape, stage, world, micro_batch * shape.sequences_per_row, seq_len, w)
    e.gpu["parameters"] += frozen["weights"]  # a teacher: weights only, in the params column
    e.gpu["activations"] += frozen["forward"]
    if shape.generation is not None:  # generation, before the forward passes: a KV cache, and ZeRO-3 gathers the model
        # ZeRO 3: the whole model gathered (GatheredParameters) next to the rank's partition (on the GPU unless
        # offloaded), instead of the gathered layers of training
        gathered = n * w + (0 if offload else n * w / world) - e.gpu["parameters"] if stage == 3 else 0
        during = sum(generation_bytes(shape, micro_batch, w).values()) + max(0, gathered)
        e.gpu["generation beyond training"] = max(0, during - e.gpu["activations"] - e.gpu["logits"])
    zero = ds.get("zero_optimization", {})
    if stage == 0:
        buffers = held * w
    elif stage in (1, 2):
        reduce = _bucket(ds, "reduce_bucket_size", 5e8) * (2 if zero.get("overlap_comm", False) else 1)
        buffers = min(reduce, n) * w + min(_bucket(ds, "allgather_bucket_size", 5e8), n) * w
    else:
        buffers = (min(_bucket(ds, "reduce_bucket_size", 5e8), n)
                   + min(_bucket(ds, "stage3_prefetch_bucket_size", 5e7), n)) * w
    e.gpu["DeepSpeed buffers"] = buffers
    e.cpu["model while loading (fp32)"] = ((shape.largest_layer + shape.frozen_largest) if stage == 3
                                           else n + shape.frozen_params) * 4 * gpus_per_node
    return e


def cpu_rank_bytes(e: Estimate, gpus_per_node: int) -> int:
    """What option ``e`` should add to the host memory (RSS) of one rank on the CPU accelerator, from just
    before the model is built to the end of training: the "GPU" part (it lives in host memory there), the
    offloaded part of this rank, and :data:`CPU_RUNTIME_BYTES`. (The model being loaded is the "GPU" copy.)"""
    offloaded = sum(v for k, v in e.cpu.items() if "offloaded" in k) / gpus_per_node
    return int(e.gpu_total + offloaded + CPU_RUNTIME_BYTES)


def plan_options(shape: ModelShape, ds: dict, micro_batch: int, seq_len: int, gpus_per_node: int, nodes: int,
                 precision: str) -> list[Estimate]:
    """Every ZeRO stage 0-3 x offload (stages 1-3) x gradient checkpointing, fastest first (QLoRA: stages 0-2; Muon: stages 1-3, the ones
    it runs with, :func:`finetune.engine.muon.check`)."""
    out = [estimate(shape, ds, z, off, gc, micro_batch, seq_len, gpus_per_node, nodes, precision)
           for z in range(1 if shape.muon else 0, 3 if shape.quantized_params else 4) for off in ((False,) if z == 0 else (False, True)) for gc in (False, True)]
    return sorted(out, key=lambda e: (e.cost, e.stage))


def largest_micro_batch(e: Estimate, shape: ModelShape, ds: dict, seq_len: int, gpus_per_node: int, nodes: int,
                        precision: str, gpu_bytes: float, cpu_bytes: float | None) -> int:
    """The largest micro batch with which option ``e`` fits (0: not even 1 row), by doubling then bisection."""
    def fits(b: int) -> bool:
        x = estimate(shape, ds, e.stage, e.offload, e.checkpointing, b, seq_len, gpus_per_node, nodes, precision)
        return x.gpu_total <= gpu_bytes * (1 - GPU_HEADROOM) and (cpu_bytes is None or x.cpu_total <= cpu_bytes)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 65536:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def parse_size(text: str) -> float:
    """``80GiB``, ``512GB``, ``1.5TiB``, ``64G`` (binary units for G/T/M without B) -> bytes.

    Raises:
        ValueError: not a size, or not more than 0 bytes.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*", text, re.I)
    if not m:
        raise ValueError(f"'{text}' is not a memory size such as 80GiB or 512GB")
    number, unit, binary, b = m.groups()
    power = "KMGT".index(unit.upper()) + 1 if unit else 0
    base = 1000 if (b and not binary) else 1024
    size = float(number) * base**power
    if size <= 0:
        raise ValueError(f"'{text}' is no memory at all; give the memory of one device, e.g. 80GiB")
    return size


def _fmt(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"


def image_tokens_per_image(cfg: RunConfig, config) -> tuple[int, str]:
    """How many tokens of a row one image takes: the model's processor (``model.tokenizer_path`` or ``model.path``)
    run on one blank image at its image processor's size (``size``'s ``longest_edge``, ``height`` x ``width``, or
    ``shortest_edge``; 224 when it names none), its image placeholder tokens counted (``image_token_id``). Returns
    ``(tokens, "WxH")``, ``(0, "")`` when the processor cannot be built here (Qwen2.5-VL's wants torchvision)."""
    from PIL import Image

    from finetune.data import images

    try:
        processor = images.load_processor(cfg.model.tokenizer_path or cfg.model.path)
        size = getattr(processor.image_processor, "size", None) or {}
        side = size.get("longest_edge") or size.get("height") or size.get("shortest_edge") or 224
        width = size.get("width") or side
        token = getattr(config, "image_token_id", None)
        if token is None:
            token = getattr(config, "image_token_index", None)
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
        ids = processor(text=[text], images=[[Image.new("RGB", (width, side))]], return_tensors="np")["input_ids"]
        return int((ids == token).sum()), f"{width}x{side}"
    except Exception:  # noqa: BLE001  (no processor here: the plan goes on without the image tokens)
        return 0, ""


def pipeline_lines(cfg: RunConfig, shape: ModelShape, precision: str, seq: int, world: int) -> list[str]:
    """The plan's pipeline section (``parallel.pipeline_parallel_size`` > 1): each stage's parameters under the run's
    ``parallel.pipeline_partition_method`` (:func:`finetune.parallel.pipeline.stage_parameters`), its model
    states at ZeRO 0 (weights, gradients and AdamW's fp32 state: 16 bytes a parameter, 4 + 4 + 8 in fp32 and
    2 + 2 + 12 with bf16/fp16 master weights), its activations (1F1B keeps at most ``P - s`` micro-batches in flight on
    stage ``s``, each its layers' share of :func:`activation_bytes`), and the bubble fraction
    (:func:`finetune.parallel.pipeline.bubble_fraction`)."""
    pp, m = cfg.parallel.pipeline_parallel_size, cfg.train.gradient_accumulation_steps
    lay_dp = world // pp
    config = load_model_config(cfg, get_recipe(cfg.recipe))
    method = cfg.parallel.pipeline_partition_method
    share = shape.target_fraction  # the share of positions the head runs at
    counts = pipeline.stage_parameters(config, pp, method, share)
    act = activation_bytes(shape, cfg.train.micro_batch_size, seq, 4 if precision == "fp32" else 2,
                           cfg.model.gradient_checkpointing)["activations"] / max(shape.layers, 1)
    layers = pipeline.stage_layers(config, pp, method, share)
    stages = [f"stage {s}: {n:,} parameters, {_fmt(16 * n)} model states + {_fmt(act * k * min(pp - s, m))} "
              f"activations ({k} layer(s), {min(pp - s, m)} micro batch(es) in flight)"
              for s, (n, k) in enumerate(zip(counts, layers))]
    return [f"pipeline parallelism {pp} (DeepSpeed's 1F1B schedule, {m} micro batches a step): bubble (P - 1) / "
            f"(m + P - 1) = {pipeline.bubble_fraction(pp, m):.3f} of each stage's time idle; per rank (model states at "
            f"ZeRO 0; ZeRO 1 splits the optimizer state over the stage's {max(1, lay_dp)} data-parallel rank(s)):",
            *[f"  {line}" for line in stages],
            "  (the table below is for the whole model on one rank; a stage holds its share of it)"]


def render(cfg: RunConfig, shape: ModelShape, ds: dict, options: list[Estimate], precision: str, gpus_per_node: int,
           nodes: int, gpu_bytes: float, cpu_bytes: float | None, best: tuple[Estimate, int] | None,
           seq: int | None = None) -> str:
    """The plan as text: a header, one table row per option, the recommendation. ``seq``: tokens per row and rank
    (``data.max_seq_len`` / the sequence-parallel size; default ``data.max_seq_len``)."""
    seq = cfg.data.max_seq_len if seq is None else seq
    lines = [f"model: {shape.model_type} from {cfg.model.path}, {shape.params:,} parameters "
             f"({shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads; largest layer "
             f"{shape.largest_layer:,} parameters"
             + (f"; LoRA: {shape.trainable:,} trainable, the only ones with gradients and optimizer states"
                if shape.trainable else "")
             + (f"; quantized base: {shape.quantized_params:,} weights in {_fmt(shape.quantized_bytes)}"
                if shape.quantized_params else "")
             + (f"; Muon: {shape.muon:,} in matrices with one fp32 momentum buffer, the rest AdamW's two moments"
                if shape.muon else "")
             + (f"; mixture of experts: {shape.experts} experts, top-{shape.top_k}, {active_parameters(shape):,} "
                f"active per token (non-expert + {shape.top_k}/{shape.experts} of the {shape.expert_params:,} expert "
                f"parameters)" if shape.experts else "")
             + (f"; expert-parallel size {shape.expert_parallel}: {shape.expert_params // shape.expert_parallel:,} "
                f"expert parameters per rank" if shape.expert_parallel > 1 else "")
             + (f"; vision tower and projector: {shape.vision_params:,} parameters, counted, their activations not"
                if shape.vision_params else "")
             + (f"; one {shape.image_size} image: {shape.image_tokens} tokens of a row's data.max_seq_len"
                if shape.image_tokens else "")
             + (f"; frozen beside it (no gradients or optimizer states): {shape.frozen_names}, its weights in params "
                f"and its forward in activ." if shape.frozen_names else "") + ")",
             f"run: micro batch {cfg.train.micro_batch_size} x seq len {cfg.data.max_seq_len}, precision {precision}, "
             f"{nodes} node(s) x {gpus_per_node} GPU(s) = world size {nodes * gpus_per_node}; GPU memory "
             f"{_fmt(gpu_bytes)} ({int(GPU_HEADROOM * 100)}% kept free)"
             + (f", CPU RAM {_fmt(cpu_bytes)} per node" if cpu_bytes is not None else "")]
    sp, tp = cfg.parallel.sequence_parallel_size, cfg.parallel.tensor_parallel_size
    if sp > 1:
        lines.append(f"sequence parallelism {sp}: activations of {math.ceil(cfg.data.max_seq_len / sp)} tokens per row "
                     f"and rank (Ulysses' all-to-all trades sequence for heads at the same size)")
    if shape.generation:
        per_row, tokens = shape.generation
        w = 4 if precision == "fp32" else 2
        gen = generation_bytes(shape, cfg.train.micro_batch_size, w)
        accumulation = shape.generation_micro_batches
        held = cfg.train.micro_batch_size * accumulation * per_row
        lines.append(f"generation every step: {per_row} sequences per row of up to {tokens} tokens, trained as "
                     f"{cfg.train.micro_batch_size * per_row} sequences per micro batch; one generate call per rank "
                     f"holds the {accumulation} micro batch(es) of the step (train.gradient_accumulation_steps): "
                     f"{held} sequences, KV cache {_fmt(gen['KV cache'])} (2 x {shape.layers} layers x "
                     f"{shape.kv_heads} key-value heads x {shape.head_dim} x {held} x {tokens} tokens), prefill "
                     f"{_fmt(gen['forward'])} (one layer at a time, no gradients), plus the whole model gathered under "
                     f"ZeRO 3 (train.grpo.gather_for_generation); 'activ.' holds the larger of training and generation")
    if cfg.parallel.pipeline_parallel_size > 1:
        lines += pipeline_lines(cfg, shape, precision, seq, nodes * gpus_per_node)
    if tp > 1:
        lines.append(f"tensor parallelism {tp}: not modelled; the table is for tensor-parallel size 1 (AutoTP splits "
                     f"the layers' weights and most activations by about {tp})")
    lines.append("")
    head = ("option", "params", "grads", "optim", "activ.", "buffers", "GPU/rank", "CPU/node", "NVMe/node*",
            "fits", "max micro")
    now = None
    rows = []
    for e in options:
        g = e.gpu
        optim = sum(v for k, v in g.items() if k.startswith(("fp32", "Adam", "Muon")))
        fits = e.gpu_total <= gpu_bytes * (1 - GPU_HEADROOM) and (cpu_bytes is None or e.cpu_total <= cpu_bytes)
        mb = largest_micro_batch(e, shape, ds, seq, gpus_per_node, nodes, precision, gpu_bytes, cpu_bytes)
        if fits and now is None:
            now = e
        rows.append((e.name, _fmt(g["parameters"]), _fmt(g["gradients"]), _fmt(optim),
                     _fmt(g["activations"] + g["logits"] + g.get("generation beyond training", 0)),
                     _fmt(g["DeepSpeed buffers"]), _fmt(e.gpu_total),
                     _fmt(e.cpu_total), _fmt(e.nvme_total) if e.offload else "-", "yes" if fits else "no",
                     str(mb) if mb else "-"))

    current = (zero_stage(ds), optimizer_offloaded(ds), False)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines += [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) + ("  <- this config" if (e.stage, e.offload, e.checkpointing) == current else "")
              for e, r in zip(options, rows)]
    lines += ["", f"Columns: per-rank GPU memory by part, at micro batch {cfg.train.micro_batch_size}; 'fits': at that micro "
              f"batch; 'max micro': the largest micro batch that fits.",
              "* NVMe/node: what offload_optimizer/offload_param with device nvme put on NVMe instead of CPU RAM.",
              "Formulas: DeepSpeed's ZeRO estimators (model states), Korthikanti et al. 2022 (activations); "
              "see finetune/preflight/plan.py."]
    if best is None:
        lines.append("recommendation: nothing fits even with micro batch 1; add GPUs or nodes (--nodes), shorten "
                     "data.max_seq_len, or use GPUs with more memory")
    else:
        e, mb = best
        lines.append(f"recommendation: {e.name} (the fastest option that fits), train.micro_batch_size up to {mb} "
                     f"(now {cfg.train.micro_batch_size}); DeepSpeed JSON: zero_optimization.stage={e.stage}"
                     f"{', offload_optimizer.device=cpu' if e.offload else ''}"
                     f"{', offload_param.device=cpu' if e.offload and e.stage == 3 else ''}"
                     f"{'; gradient checkpointing on' if e.checkpointing else ''}")
        if mb < cfg.train.micro_batch_size:
            lines.append(f"  (a smaller micro batch changes the global batch unless train.gradient_accumulation_steps "
                         f"grows to match; at micro batch {cfg.train.micro_batch_size} the fastest that fits is "
                         f"{now.name if now else 'none'})")
    return "\n".join(lines)


def cfg_ds(cfg: RunConfig, world: int, precision: str) -> dict:
    """The run's DeepSpeed dict for ``world`` ranks (bucket sizes), without DeepSpeed's own checks."""
    ds, _ = resolve_ds_config(cfg, world, on_cpu=precision == "fp32", accelerator=_Bf16Gpu(),
                              deepspeed_checks=False)
    return ds


class _Bf16Gpu:
    """Stand-in accelerator for ``train.precision: auto`` on a login node: a GPU with bf16 (Ampere or newer)."""

    def device_name(self):
        return "cuda"

    def is_bf16_supported(self):
        return True

    def is_fp16_supported(self):
        return True


def run_precision(cfg: RunConfig) -> str:
    """The precision the run trains in on GPUs: the explicit one (run config or DeepSpeed JSON); ``auto`` with
    neither is taken as bf16 (GPUs of the Ampere generation or newer; set train.precision=fp16 for V100/T4)."""
    ds = deep_merge(load_ds_json(cfg.deepspeed), copy.deepcopy(cfg.ds))
    precision, _, problems = choose_precision(cfg.train.precision, ds, cfg.deepspeed, False, _Bf16Gpu())
    if problems:
        raise ConfigError(problems)
    return precision


def make_plan(cfg: RunConfig, gpus_per_node: int, nodes: int, gpu_bytes: float, cpu_bytes: float | None
              ) -> tuple[str, list[Estimate], tuple[Estimate, int] | None]:
    """The plan of a run config: ``(text, options fastest first, (recommended option, its max micro batch))``."""
    shape = model_shape(cfg)
    precision = run_precision(cfg)
    world = gpus_per_node * nodes
    lay = layout.layout(cfg, world=world, rank=0)
    ds = cfg_ds(cfg, lay.dp, precision)
    tokens = shape.generation[1] if shape.generation else cfg.data.max_seq_len  # grpo: prompt + completion
    seq = math.ceil(tokens / lay.sp)  # Ulysses: every activation holds seq / sp tokens' worth per rank
    options = plan_options(shape, ds, cfg.train.micro_batch_size, seq, gpus_per_node, nodes, precision)
    best = None
    for e in options:
        mb = largest_micro_batch(e, shape, ds, seq, gpus_per_node, nodes, precision, gpu_bytes, cpu_bytes)
        if mb:
            best = (e, mb)
            break
    return (render(cfg, shape, ds, options, precision, gpus_per_node, nodes, gpu_bytes, cpu_bytes, best, seq), options,
            best)
