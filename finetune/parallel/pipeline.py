"""Pipeline parallelism (``parallel.pipeline_parallel_size: P``) on DeepSpeed's ``PipelineModule`` / ``PipelineEngine``:
what it is, what it accepts (:func:`check`) and its plan (:func:`bubble_fraction`, :func:`stage_parameters`); the
model and its engine hooks are :mod:`finetune.engine.pipeline`.

Each of ``P`` pipeline stages holds a contiguous slice of the model's layers; the micro-batches of an optimizer step
flow through them on DeepSpeed's 1F1B schedule (``TrainSchedule``: each stage alternates one forward and one
backward once the pipe is full; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM"). The ranks are ``P x dp`` with the data-parallel index inner (DeepSpeed's
``PipeDataParallelTopology``: stage ``s`` holds ranks ``[s x dp, (s + 1) x dp)``).

**The model** (:func:`finetune.engine.pipeline.to_pipeline`) is built from the transformers model's own modules:

* decoders (:data:`ROTARY`: Llama, Qwen2, Qwen3, Mistral; :data:`LEARNED_POSITIONS`: GPT-2): the token embedding
  (and GPT-2's position embedding and dropout), each decoder layer, the final norm, and the LM head;
* BERT masked LM (:data:`ENCODERS`): the word embedding, the rest of ``BertEmbeddings`` (its own ``forward``, given
  ``inputs_embeds``), each ``BertLayer``, the MLM head's transform, and the vocabulary projection.

A tied head (``tie_word_embeddings``: SmolLM2, Qwen3's small models, GPT-2, BERT) is a ``TiedLayerSpec``: the
embedding on the first stage and the head on the last share one weight, DeepSpeed all-reduces its gradient between
the two stages (``ReduceTiedGrads``), so there is one gradient and one weight. What travels between stages is a tuple
of tensors: the hidden states (the only one with a gradient), ``position_ids`` (decoders), the 2-D attention mask,
and the step's targets. Each layer rebuilds its attention mask and rotary embedding from them with transformers' own
``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_bidirectional_mask`` and the model's
``rotary_emb``; a batch without padding passes no mask, so packed rows (``position_ids`` restarting at 0) get the
block-diagonal mask transformers derives from ``position_ids`` on every stage: packed rows never attend across
examples. Mistral's sliding window and Qwen's ``layer_types`` are read per layer, as their models do. The layers are
split into stages of equal matrix-multiply work per token by default (``parallel.pipeline_partition_method:
compute``).

**The loss** is the exact mean over the global batch's targets, as for every other layout: the last layer runs the
head and the cross-entropy at target positions only (:mod:`finetune.recipes.lm_loss`'s fused or chunked path) and
returns the micro-batch's loss sum; :class:`finetune.engine.pipeline.StageLoss` scales it by ``gas x dp / N`` (``N``:
the step's global target count from the loop's one all-reduce), so that after DeepSpeed's ``1 / gas`` and the
data-parallel average the gradient is that of ``sum / N`` over the whole global batch. Decoders predict the next token
(labels shifted by one, :func:`finetune.recipes.common.targets.shift_labels`), BERT the masked tokens (labels as they
are).

**Gradient norm, clipping and non-finite steps** (ZeRO 0): DeepSpeed's own clipping is turned off for the pipeline
engine (``gradient_clipping: 0``) and :func:`finetune.engine.pipeline.install_step_guard` wraps the optimizer's
``step``: it computes the global gradient norm (each stage's squares, the tied weight counted once: DeepSpeed's
``ds_pipe_replicated``; all-reduced over the pipe group), clips by ``train.max_grad_norm`` as
``torch.nn.utils.clip_grad_norm_`` does, and skips a step whose norm is not finite on every rank alike. ZeRO 1 leaves
all three to DeepSpeed's ZeRO optimizer, which reduces over the pipeline grid.

**Not offered**: ZeRO 2-3 (DeepSpeed's ``PipelineEngine`` asserts ZeRO < 2), sequence, tensor and expert
parallelism together with it, the interleaved (virtual-stage) schedule (DeepSpeed's engine has only 1F1B), recipes
other than :data:`RECIPES`. Each is refused in one line by :func:`check`.
"""

from __future__ import annotations

from collections.abc import Collection

from finetune.config import RunConfig
from finetune.parallel.layout import SIZE_KEYS

DIMENSION = "pipeline"
"""The name of this dimension in a recipe's ``Capabilities.parallel``."""

ROTARY = ("llama", "qwen2", "qwen3", "mistral")
"""Decoder families with rotary position embeddings (``model.rotary_emb``) whose layers take ``position_embeddings``."""
LEARNED_POSITIONS = ("gpt2",)
"""Decoder families with a learned position embedding added to the token embedding (GPT-2's ``wpe``)."""
ENCODERS = ("bert",)
"""Encoder families (masked LM)."""
SUPPORTED = ROTARY + LEARNED_POSITIONS + ENCODERS
"""Model types :func:`to_pipeline` splits."""

RECIPES = ("gpt_clm", "sft", "bert_mlm")
"""The recipes tested with pipeline parallelism (token losses whose head the last stage runs)."""

LAYERS_FILE = "pipeline_layers.json"
"""Written into every pipeline checkpoint: for each pipeline layer, the Hugging Face prefix of each of its
submodules, so that ``finetune export`` joins the stages' ``layer_XX-model_states.pt`` into one state dict."""


# ------------------------------------------------------------------------------------------------------------ checks

def check(cfg: RunConfig, model_config, supported: Collection[str], problems: list[str], offered: str = "") -> None:
    """What pipeline parallelism needs of the run, one problem line each (the world size is
    :func:`finetune.parallel.layout.size_problems`', the ZeRO stage :func:`check_zero_stage`'s).

    Args:
        cfg: the run config.
        model_config: the transformers config, or None.
        supported: the recipe's ``Capabilities.parallel``.
        problems: where the lines go.
        offered: the recipes that accept it, for the lines.
    """
    pp, key = cfg.parallel.pipeline_parallel_size, SIZE_KEYS["pp"]
    if pp < 1:
        problems.append(f"{key}: {pp} must be 1 (off) or more")
        return
    if pp == 1:
        return
    par = cfg.parallel
    method = par.pipeline_partition_method
    if method not in ("compute", "parameters", "uniform") and not method.startswith("type:"):
        problems.append(f"parallel.pipeline_partition_method: '{method}' is not one of compute, parameters, uniform "
                        f"or type:<regex>")
    for size, other in ((par.sequence_parallel_size, "sequence_parallel_size"),
                        (par.tensor_parallel_size, "tensor_parallel_size"),
                        (par.expert_parallel_size, "expert_parallel_size")):
        if size > 1:
            problems.append(f"{key}: pipeline parallelism is not combined with parallel.{other} here; set one of them "
                            f"to 1")
    if DIMENSION not in supported:
        problems.append(f"{key}: recipe {cfg.recipe} does not run on the pipeline engine"
                        f"{f' ({offered} do)' if offered else ''}; set {key}=1")
    if par.tiled_mlp:
        problems.append(f"{key}: parallel.tiled_mlp is not combined with pipeline parallelism; set it to false")
    if cfg.train.eval_generate.prompts:
        problems.append(f"{key}: train.eval_generate needs the whole model on each rank; set "
                        f"train.eval_generate.prompts=0 (finetune evaluate on the export generates)")
    if cfg.model.quantization is not None:
        problems.append(f"{key}: QLoRA (model.quantization) is not combined with pipeline parallelism; train with "
                        f"LoRA or set {key}=1")
    if cfg.train.loss_weighting != "token":
        problems.append(f"{key}: train.loss_weighting must be token (the pipeline's loss is the exact mean over the "
                        f"global batch's targets)")
    if cfg.model.offload_activations:
        problems.append(f"{key}: model.offload_activations is not combined with pipeline parallelism; set it to "
                        f"false")
    if cfg.train.neftune_noise_alpha:
        problems.append(f"{key}: NEFTune (train.neftune_noise_alpha) is not combined with pipeline parallelism; set "
                        f"it to 0")
    if cfg.train.optimizer == "muon":
        problems.append(f"{key}: Muon is not combined with pipeline parallelism; use train.optimizer=adamw")
    if model_config is not None:
        mtype = getattr(model_config, "model_type", "")
        if mtype not in SUPPORTED:
            problems.append(f"{key}: model type '{mtype}' is not split into pipeline stages here (supported: "
                            f"{', '.join(SUPPORTED)}); set {key}=1")
        else:
            n = num_layers(model_config)
            if n + 2 < pp:
                problems.append(f"{key}: {pp} stages for a model of {n} layers (with the embedding and the head "
                                f"{n + 2} pipeline layers); choose at most {n + 2}")


def check_zero_stage(cfg: RunConfig, stage: int, problems: list[str]) -> None:
    """DeepSpeed's pipeline engine runs with ZeRO 0-1 (it asserts ZeRO < 2); one line when the stage is another."""
    pp = cfg.parallel.pipeline_parallel_size
    if pp > 1 and stage >= 2:
        problems.append(f"{SIZE_KEYS['pp']}: {pp} with ZeRO stage {stage}; DeepSpeed's pipeline engine runs with "
                        f"ZeRO 0-1 (ds.zero_optimization.stage=0 or 1, or ds_configs/zero1.json)")


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of each stage's time idle in one 1F1B (or GPipe) step: ``(P - 1) / (m + P - 1)`` for ``P`` stages and
    ``m`` micro-batches (Huang et al. 2019, "GPipe"; Narayanan et al. 2021)."""
    return (stages - 1) / (micro_batches + stages - 1) if stages > 1 else 0.0


def num_layers(config) -> int:
    """Transformer layers of a transformers config (``num_hidden_layers``, GPT-2's ``n_layer``)."""
    return int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0) or 0)


def _split(model_config, stages: int, method: str, target_share: float) -> list[int]:
    """DeepSpeed's ``partition_balanced`` boundaries of the estimated pipeline layers (:func:`_layer_estimates`) for
    ``method`` (``compute``, ``parameters`` or ``uniform``; ``type:`` methods as ``uniform``)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    params, work = _layer_estimates(model_config, target_share)
    if method == "compute":
        return partition_balanced(weights=work, num_parts=stages)
    if method == "parameters":
        return partition_balanced(weights=params, num_parts=stages)
    return partition_uniform(num_items=len(params), num_parts=stages)


def stage_parameters(model_config, stages: int, method: str = "compute", target_share: float = 1.0) -> list[int]:
    """Parameters on each of ``stages`` stages when the layers are split as
    :func:`finetune.engine.pipeline.to_pipeline` splits them (an estimate from the config's shapes: embedding, equal
    layers, final norm, head), for ``finetune plan``. ``target_share``: the share of positions the head runs at."""
    params, _ = _layer_estimates(model_config, target_share)
    parts = _split(model_config, stages, method, target_share)
    return [sum(params[parts[s]:parts[s + 1]]) for s in range(stages)]


def stage_layers(model_config, stages: int, method: str = "compute", target_share: float = 1.0) -> list[int]:
    """Transformer layers on each of ``stages`` stages under the same split as :func:`stage_parameters`."""
    parts = _split(model_config, stages, method, target_share)
    params, _ = _layer_estimates(model_config, target_share)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    first = 2 if text.model_type in LEARNED_POSITIONS + ENCODERS else 1
    last = len(params) - 2
    return [sum(1 for i in range(parts[s], parts[s + 1]) if first <= i < last) for s in range(stages)]


def _layer_estimates(config, target_share: float) -> tuple[list[int], list[float]]:
    """Per pipeline layer: its parameters (a tied head counts the embedding again, as DeepSpeed counts its copy) and
    its matrix-multiply work per token as :func:`finetune.engine.pipeline.compute_weights` weighs it."""
    params = _layer_param_counts(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    lookups = 2 if text.model_type in LEARNED_POSITIONS + ENCODERS else 1
    work = [0.0] * lookups + [float(n) for n in params[lookups:-1]] + [params[-1] * target_share]
    return params, work


def _layer_param_counts(config) -> list[int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = int(getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0))
    v = int(text.vocab_size)
    inter = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h)
    heads = int(getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 1))
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    mtype = text.model_type
    if mtype in ROTARY:
        layer = h * head_dim * (heads * 2 + kv * 2) + 3 * h * inter + 2 * h
    else:
        layer = 4 * h * h + 2 * h * inter + 9 * h + inter
    n = num_layers(text)
    extra = [h * 1024] if mtype in LEARNED_POSITIONS else [h * 512] if mtype in ENCODERS else []
    final = h if mtype in ROTARY else 2 * h if mtype in LEARNED_POSITIONS else h * h + 3 * h  # RMSNorm, LayerNorm, MLM
    return [v * h, *extra, *([layer] * n), final, v * h]


def is_pipeline_checkpoint(ckpt) -> bool:
    """True when checkpoint folder ``ckpt`` (a ``Path``) was saved by a pipeline engine (it holds
    :data:`LAYERS_FILE`)."""
    return (ckpt / LAYERS_FILE).is_file()
