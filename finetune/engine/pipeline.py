"""The pipeline model and its engine hooks (``parallel.pipeline_parallel_size > 1``): the layers, the loss, the step,
evaluation, the gradient-norm guard and the export's gathering. What pipeline parallelism is, which runs it accepts
and the layout it makes: :mod:`finetune.parallel.pipeline`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from finetune.config import RunConfig
from finetune.data.batch import to_device
from finetune.parallel.layout import SIZE_KEYS
from finetune.parallel.pipeline import ENCODERS, LAYERS_FILE, LEARNED_POSITIONS, ROTARY, SUPPORTED, num_layers
from finetune.recipes.common.targets import next_token_targets
from finetune.recipes.lm_loss import (FUSED_HEAD_MAX_ELEMENTS, LinearCrossEntropy, chunk_tokens,
                                      chunked_cross_entropy)


# ------------------------------------------------------------------------------------------------------------ layers

class _Shared:
    """What every layer of one pipeline reads at run time: the mode of the last layer (``"loss"`` or ``"logits"``),
    whether to count correct argmaxes, the head's chunk size and whether targets are shifted."""

    def __init__(self, shift: bool, chunk: int):
        self.mode, self.count_correct, self.shift, self.chunk = "loss", False, shift, chunk


class _Named(nn.Module):
    """A stage layer that holds transformers submodules under short names; ``hf_names`` maps each short name to the
    submodule's qualified name in the original model (for the export)."""

    hf_names: dict

    def _hold(self, names: dict, **modules) -> None:
        for attr, module in modules.items():
            if module is not None:
                setattr(self, attr, module)
        self.hf_names = {attr: names[id(module)] for attr, module in modules.items()
                         if module is not None and id(module) in names}


class Embedding(_Named):
    """The token embedding: on the first stage ``(input_ids, *rest) -> (embeddings, *rest)``; as the tied head on the
    last stage (``head=True``) it runs the vocabulary projection with the same weight (:class:`Head`'s forward)."""

    def __init__(self, embedding: nn.Embedding, names: dict, shared: _Shared, head: bool = False,
                 bias: nn.Parameter | None = None):
        super().__init__()
        self._hold(names, embed=embedding)
        self.shared, self.is_head = shared, head
        if bias is not None:
            self.bias = bias
            self.hf_names["bias"] = names[id(bias)]

    def forward(self, inputs):
        if self.is_head:
            return _head_forward(self.shared, inputs, self.embed.weight, getattr(self, "bias", None))
        return (self.embed(inputs[0]), *inputs[1:])


class Head(_Named):
    """An untied LM head (``lm_head``): ``(hidden, targets) ->`` the micro-batch's loss sum (and correct count), or
    the logits in ``"logits"`` mode."""

    def __init__(self, head: nn.Linear, names: dict, shared: _Shared):
        super().__init__()
        self._hold(names, head=head)
        self.shared = shared

    def forward(self, inputs):
        return _head_forward(self.shared, inputs, self.head.weight, self.head.bias)


def _head_forward(shared: _Shared, inputs, weight, bias):
    """The last layer: ``(hidden [b, s, h], targets [b, s]) -> (loss_sum, correct)`` (0-dim float32 and int64) at the
    target positions, or the full logits ``[b, s, vocab]`` in ``"logits"`` mode (the export check). In training the
    head and its cross-entropy run as :class:`finetune.recipes.lm_loss.LinearCrossEntropy` (each chunk's gradients in
    the forward pass) where the recipes' loss takes that path (a head of at most ``FUSED_HEAD_MAX_ELEMENTS``, more than
    one chunk of targets), else as :func:`finetune.recipes.lm_loss.chunked_cross_entropy`."""
    hidden, targets = inputs[0], inputs[-1]

    def head_fn(x):
        return nn.functional.linear(x, weight, bias)

    if shared.mode == "logits":
        return head_fn(hidden).float()
    pick = targets != -100
    h, y = hidden[pick], targets[pick]
    if (torch.is_grad_enabled() and not shared.count_correct and h.shape[0] > shared.chunk
            and weight.numel() <= FUSED_HEAD_MAX_ELEMENTS):  # gradients in the forward pass, nothing recomputed
        return (LinearCrossEntropy.apply(h, weight, bias, y, shared.chunk),
                torch.zeros((), dtype=torch.long, device=hidden.device))
    loss, correct = chunked_cross_entropy(head_fn, h, y, shared.chunk, count_correct=shared.count_correct)
    if correct is None:
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    return loss.float(), correct


class Positions(_Named):
    """GPT-2's learned positions and embedding dropout: ``hidden + wpe(position_ids)``, then ``drop``."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Module, names: dict):
        super().__init__()
        self._hold(names, wpe=wpe, drop=drop)

    def forward(self, inputs):
        h, position_ids = inputs[0], inputs[1]
        return (self.drop(h + self.wpe(position_ids).to(h.dtype)), *inputs[1:])


def _mask_arg(attention_mask: torch.Tensor):
    """The 2-D mask a layer passes on: None when nothing is masked (packed rows, or a batch without padding), so that
    transformers derives packed rows' boundaries from ``position_ids``."""
    return None if bool(attention_mask.all()) else attention_mask


class Decoder(_Named):
    """One decoder layer: ``(hidden, position_ids, attention_mask, targets)`` in and out, the layer's causal (or
    sliding-window) mask and rotary embedding rebuilt from them with transformers' own functions."""

    def __init__(self, layer: nn.Module, index: int, config, rotary: nn.Module | None, names: dict):
        super().__init__()
        self._hold(names, layer=layer)
        self.index, self.config = index, config
        self.rotary = [rotary]  # not a submodule: its inv_freq buffer stays out of the stage's state dict
        types = getattr(config, "layer_types", None)
        kind = types[index] if types else ("sliding_attention" if getattr(config, "sliding_window", None)
                                           and config.model_type == "mistral" else "full_attention")
        self.sliding = kind == "sliding_attention"

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        h, position_ids, attention_mask, targets = inputs
        make = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = make(config=self.config, inputs_embeds=h, attention_mask=_mask_arg(attention_mask),
                    past_key_values=None, position_ids=position_ids)
        kwargs = {"attention_mask": mask, "position_ids": position_ids, "past_key_values": None, "use_cache": False}
        rotary = self.rotary[0]
        if rotary is not None:
            rotary.to(h.device)
            kwargs["position_embeddings"] = rotary(h, position_ids)
        out = self.layer(h, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out, position_ids, attention_mask, targets


class Final(_Named):
    """The final norm (decoders) or the MLM head's transform (BERT): ``(hidden, ..., targets) -> (f(hidden),
    targets)``."""

    def __init__(self, module: nn.Module, names: dict):
        super().__init__()
        self._hold(names, norm=module)

    def forward(self, inputs):
        return self.norm(inputs[0]), inputs[-1]


class EncoderEmbeddings(_Named):
    """The rest of ``BertEmbeddings`` after the word embedding (token types, positions, LayerNorm, dropout), run by
    ``BertEmbeddings.forward`` itself on ``inputs_embeds``: ``(embeds, token_type_ids, attention_mask, targets) ->
    (hidden, attention_mask, targets)``."""

    def __init__(self, embeddings: nn.Module, names: dict):
        super().__init__()
        self._forward = type(embeddings).forward
        parts = {n: getattr(embeddings, n) for n in ("token_type_embeddings", "position_embeddings", "LayerNorm",
                                                     "dropout")}
        self._hold(names, **parts)
        self.hf_names = {n: f"{names[id(embeddings)]}.{n}" for n in parts}
        for buffer in ("position_ids", "token_type_ids"):
            if hasattr(embeddings, buffer):
                self.register_buffer(buffer, getattr(embeddings, buffer), persistent=False)

    def forward(self, inputs):
        embeds, token_type_ids, attention_mask, targets = inputs
        return self._forward(self, token_type_ids=token_type_ids, inputs_embeds=embeds), attention_mask, targets


class Encoder(_Named):
    """One ``BertLayer``: ``(hidden, attention_mask, targets)`` in and out, its bidirectional mask rebuilt with
    transformers' ``create_bidirectional_mask``."""

    def __init__(self, layer: nn.Module, config, names: dict):
        super().__init__()
        self._hold(names, layer=layer)
        self.config = config

    def forward(self, inputs):
        from transformers.masking_utils import create_bidirectional_mask
        h, attention_mask, targets = inputs
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=_mask_arg(attention_mask))
        out = self.layer(h, mask)
        return out[0] if isinstance(out, tuple) else out, attention_mask, targets


# ------------------------------------------------------------------------------------------------------- conversion

def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (LoRA), or the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def layer_specs(model: nn.Module, shared: _Shared) -> tuple[list, list[dict]]:
    """DeepSpeed layer specs of a transformers LM (``model``, peft-wrapped or not) and, for each, what
    :data:`LAYERS_FILE` records (``{"tied": key or None, "names": {short name: Hugging Face prefix}}``).

    Raises:
        ValueError: the model type is not in :data:`SUPPORTED`.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    base = _base(model)
    config = base.config
    mtype = config.model_type
    names = {id(m): n for n, m in model.named_modules()}
    for n, p in model.named_parameters():  # a shared parameter under its first name (BERT: cls.predictions.bias)
        names.setdefault(id(p), n)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    specs: list = []

    def add(spec_cls, *args, key=None, **kwargs):
        specs.append(TiedLayerSpec(key, spec_cls, *args, tied_weight_attr="embed.weight", **kwargs) if key
                     else LayerSpec(spec_cls, *args, **kwargs))

    if mtype in ROTARY or mtype in LEARNED_POSITIONS:
        inner = base.model if mtype in ROTARY else base.transformer
        embed = inner.embed_tokens if mtype in ROTARY else inner.wte
        add(Embedding, embed, names, shared, key="embed" if tied else None)
        if mtype in LEARNED_POSITIONS:
            add(Positions, inner.wpe, inner.drop, names)
        rotary = getattr(inner, "rotary_emb", None)
        blocks = inner.layers if mtype in ROTARY else inner.h
        for i, block in enumerate(blocks[:num_layers(config)]):
            add(Decoder, block, i, config, rotary, names)
        add(Final, inner.norm if mtype in ROTARY else inner.ln_f, names)
        if tied:
            add(Embedding, embed, names, shared, head=True, key="embed")
        else:
            add(Head, base.lm_head, names, shared)
    elif mtype in ENCODERS:
        bert, predictions = base.bert, base.cls.predictions
        add(Embedding, bert.embeddings.word_embeddings, names, shared, key="embed" if tied else None)
        add(EncoderEmbeddings, bert.embeddings, names)
        for layer in bert.encoder.layer:
            add(Encoder, layer, config, names)
        add(Final, predictions.transform, names)
        if tied:
            add(Embedding, bert.embeddings.word_embeddings, names, shared, head=True, key="embed",
                bias=predictions.bias)
        else:
            add(Head, predictions.decoder, names, shared)
    else:
        raise ValueError(f"{SIZE_KEYS['pp']}: model type '{mtype}' is not split into pipeline stages (supported: "
                         f"{', '.join(SUPPORTED)})")
    # the names each layer holds: a built wrapper only references the model's modules, so building one is cheap
    records = [{"tied": getattr(spec, "key", None), "names": dict(spec.build().hf_names)} for spec in specs]
    return specs, records


class StageLoss:
    """The pipeline's ``loss_fn`` on the last stage: ``(loss_sum, correct)`` of a micro-batch -> what DeepSpeed
    backpropagates, ``loss_sum x gas x dp / N`` (``N``: :attr:`targets`, the step's global target count, set by the
    loop before each step); in evaluation (:attr:`evaluating`) the sums themselves, stacked ``[loss_sum, correct]``."""

    def __init__(self, gas: int, dp: int):
        self.gas, self.dp, self.targets, self.evaluating = gas, dp, 1.0, False
        self.__name__ = "StageLoss"

    def __call__(self, outputs, labels):
        if not isinstance(outputs, tuple):  # "logits" mode: nothing to reduce
            return outputs.sum() * 0
        loss_sum, correct = outputs
        if self.evaluating:
            return torch.stack([loss_sum.detach().double(), correct.double()])
        return loss_sum * (self.gas * self.dp / max(float(self.targets), 1.0))


def _pipe_class():
    from deepspeed.pipe import PipelineModule

    class Pipe(PipelineModule):
        """``PipelineModule`` whose ``parameters`` partition can weigh each layer by given numbers
        (:func:`compute_weights`) instead of its parameter count."""

        def __init__(self, *args, weights=None, **kwargs):
            self._finetune_weights = weights
            super().__init__(*args, **kwargs)

        def _count_layer_params(self):
            if self._finetune_weights is None:
                return super()._count_layer_params()
            return list(self._finetune_weights)

    return Pipe


def compute_weights(specs: list, target_share: float) -> list[float]:
    """Each pipeline layer's matrix-multiply work per token, for the ``compute`` partition: a transformer layer's
    parameters, the head's ``vocab x hidden`` times the share of positions that are targets (the recipe's
    ``target_fraction``: the head runs at the targets only), the final norm's parameters; 0 for
    the embeddings (lookups). Balancing parameters instead puts the embedding's ``vocab x hidden`` on the first stage
    as if it cost a head's work."""
    out = []
    for spec in specs:
        kind, args, kwargs = spec.typename, spec.module_args, spec.module_kwargs
        if kind is Embedding and kwargs.get("head"):
            out.append(args[0].weight.numel() * target_share)
        elif kind is Head:
            out.append(args[0].weight.numel() * target_share)
        elif kind in (Embedding, Positions, EncoderEmbeddings):
            out.append(0.0)
        else:
            out.append(float(sum(p.numel() for p in args[0].parameters())))
    return out


def to_pipeline(model: nn.Module, cfg: RunConfig, world: int, target_share: float = 1.0):
    """The ``PipelineModule`` of ``model`` for ``parallel.pipeline_parallel_size`` stages over ``world`` ranks
    (``PipeDataParallelTopology``: data-parallel index inner), partitioned by ``parallel.pipeline_partition_method``
    (``compute``: :func:`compute_weights` balanced by DeepSpeed's ``partition_balanced``; or DeepSpeed's own
    ``parameters``, ``uniform``, ``type:<regex>``), ``dynamic_shape`` on (padded micro-batches differ in length).
    ``target_share``: the share of positions that are loss targets (the recipe's ``target_fraction``), which the
    ``compute`` split weighs the head by.

    Returns:
        The ``PipelineModule``, with ``finetune_shared`` (:class:`_Shared`), ``finetune_loss`` (:class:`StageLoss`) and
        ``finetune_layers`` (the :data:`LAYERS_FILE` records) attached.
    """
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    pp = cfg.parallel.pipeline_parallel_size
    dp = world // pp
    base = _base(model)
    shared = _Shared(shift=base.config.model_type not in ENCODERS,
                     chunk=chunk_tokens(base.config.get_text_config().vocab_size))
    specs, records = layer_specs(model, shared)
    loss = StageLoss(cfg.train.gradient_accumulation_steps, dp)
    method = cfg.parallel.pipeline_partition_method
    weights = compute_weights(specs, target_share) if method == "compute" else None
    pipe = _pipe_class()(layers=specs, loss_fn=loss, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                         partition_method="parameters" if method == "compute" else method, dynamic_shape=True,
                         weights=weights)
    for key, tied in pipe.tied_modules.items():  # DeepSpeed marks every parameter of a tied module's second copy
        for name, p in tied.named_parameters():    # as replicated; only the tied weight is (BERT's head bias is not)
            if name not in pipe.tied_weight_attrs[key]:
                p.ds_pipe_replicated = False
    pipe.finetune_shared, pipe.finetune_loss, pipe.finetune_layers = shared, loss, records
    pipe.finetune_config = base.config
    return pipe


def is_pipeline(engine) -> bool:
    """True when ``engine`` is DeepSpeed's ``PipelineEngine`` over a module :func:`to_pipeline` built."""
    return is_pipeline_module(getattr(engine, "module", None))


def is_pipeline_module(module) -> bool:
    """True when ``module`` is a ``PipelineModule`` :func:`to_pipeline` built."""
    return hasattr(module, "finetune_shared")


# ------------------------------------------------------------------------------------------------------------ batches

def stage_batch(batch: dict, shift: bool) -> tuple[tuple, torch.Tensor]:
    """``(inputs, labels)`` of one micro-batch for ``PipelineEngine``: the first stage's inputs ``(input_ids,
    position_ids, attention_mask, targets)`` (decoders; encoders ``(input_ids, token_type_ids, attention_mask,
    targets)``) and a placeholder label (the targets travel with the activations, so the last layer takes the loss
    at the target positions only).

    ``targets``: the next token for decoders (:func:`finetune.recipes.common.targets.next_token_targets`), the labels
    as they are for a masked LM. A batch without ``attention_mask`` (packed rows) gets an all-ones one;
    ``position_ids`` default to ``0..seq-1``.
    """
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.to(torch.long)
    targets = next_token_targets(batch) if shift else batch["labels"]
    if shift:
        pos = batch.get("position_ids")
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids) if pos is None else pos
        first = (ids, pos.contiguous(), mask, targets)
    else:
        tt = batch.get("token_type_ids")
        first = (ids, torch.zeros_like(ids) if tt is None else tt, mask, targets)
    return first, torch.zeros(1, device=ids.device)


def train_step(engine, micro: list[dict], targets: torch.Tensor, timed: bool = False) -> tuple[torch.Tensor,
                                                                                              float | None]:
    """One optimizer step of the pipeline engine over the step's micro-batches (``engine.train_batch``).

    Args:
        engine: the ``PipelineEngine``.
        micro: this pipeline's ``gas`` micro-batches (every stage of the pipeline draws the same rows).
        targets: the step's global target count (0-dim float64, the loop's all-reduce).
        timed: measure this rank's idle share of the schedule (:func:`install_timing`).

    Returns:
        ``(loss, idle)``: the step's loss (0-dim float64; the mean over the global batch's targets, the same on
        every rank) and, when ``timed``, the share of this stage's pipeline-schedule time not spent in its forward and
        backward passes (the measured bubble, waits for the neighbouring stages' sends included; the optimizer step
        and the gradient all-reduces are outside it), else None.
    """
    module = engine.module
    module.finetune_loss.targets = float(targets)
    items = [stage_batch(to_device(b, engine.device), module.finetune_shared.shift) for b in micro]
    timing = getattr(engine, "finetune_timing", None)
    if timed and timing is not None:
        timing.update(on=True, compute=0.0, outside=0.0)
        _sync(engine)
        t0 = time.perf_counter()
    loss = engine.train_batch(iter(items)).detach().double()  # already averaged over the data-parallel ranks
    if not (timed and timing is not None):
        return loss, None
    _sync(engine)
    wall = time.perf_counter() - t0 - timing["outside"]
    timing["on"] = False
    return loss, max(0.0, 1.0 - timing["compute"] / wall) if wall > 0 else None


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def install_timing(engine) -> None:
    """Time this engine's pipeline instructions when :func:`train_step` asks: forward and backward passes as compute,
    the optimizer step and the gradient all-reduces as outside the schedule (synchronising the device around each on
    a GPU, timed steps only). DeepSpeed looks each instruction up in ``self._INSTRUCTION_MAP`` per call, so an
    instance attribute of the same name wraps them for this engine alone."""
    from deepspeed.runtime.pipe import schedule
    timing = {"on": False, "compute": 0.0, "outside": 0.0}
    table = dict(type(engine)._INSTRUCTION_MAP)

    def wrap(fn, bucket):
        def run(self, *args, **kwargs):
            if not timing["on"]:
                return fn(self, *args, **kwargs)
            _sync(self)
            t0 = time.perf_counter()
            out = fn(self, *args, **kwargs)
            _sync(self)
            timing[bucket] += time.perf_counter() - t0
            return out
        return run

    for kind, bucket in ((schedule.ForwardPass, "compute"), (schedule.BackwardPass, "compute"),
                         (schedule.OptimizerStep, "outside"), (schedule.ReduceGrads, "outside"),
                         (schedule.ReduceTiedGrads, "outside")):
        table[kind] = wrap(table[kind], bucket)
    engine._INSTRUCTION_MAP = table
    engine.finetune_timing = timing


@torch.no_grad()
def eval_sums(engine, batch: dict) -> torch.Tensor:
    """``[loss_sum, correct]`` (float64) of one evaluation batch on this pipeline, the same on every stage (broadcast
    from the last). All ranks call it the same number of times (``eval_batch`` meets at a barrier)."""
    module = engine.module
    module.finetune_loss.evaluating, module.finetune_shared.count_correct = True, True
    engine.total_loss = None  # eval_batch adds to the last train_batch's total (a 0-dim loss) otherwise
    try:
        out = engine.eval_batch(iter([stage_batch(to_device(batch, engine.device), module.finetune_shared.shift)]),
                                compute_loss=True, reduce_output=None, bcast_loss=False, num_micro_batches=1)
    finally:
        module.finetune_loss.evaluating, module.finetune_shared.count_correct = False, False
    sums = out[0].to(engine.device) if engine.is_last_stage() else torch.zeros(2, dtype=torch.float64,
                                                                                device=engine.device)
    dist.broadcast(sums, src=engine.grid.stage_to_global(engine.num_stages - 1),
                   group=engine.grid.get_pipe_parallel_group())
    return sums


@torch.no_grad()
def logits(engine, inputs: dict) -> torch.Tensor:
    """The full logits ``[batch, seq, vocab]`` (float32, CPU) of ``inputs`` through the pipeline, on every rank (sent
    from the last stage to the others of its pipeline). All ranks call it."""
    module = engine.module
    batch = {k: v for k, v in inputs.items()}
    batch.setdefault("labels", torch.full_like(inputs["input_ids"], -100))
    module.finetune_shared.mode = "logits"
    engine.total_loss = None
    try:
        _, out = engine.eval_batch(iter([stage_batch(to_device(batch, engine.device), module.finetune_shared.shift)]),
                                   return_logits=True, compute_loss=False, bcast_loss=False, num_micro_batches=1)
    finally:
        module.finetune_shared.mode = "loss"
    box = [out.float().cpu() if engine.is_last_stage() else None]
    dist.broadcast_object_list(box, src=engine.grid.stage_to_global(engine.num_stages - 1),
                               group=engine.grid.get_pipe_parallel_group())
    return box[0]


# ---------------------------------------------------------------------------------------- gradient norm and clipping

def install_step_guard(engine, max_norm: float) -> None:
    """At ZeRO 0: wrap the optimizer's ``step`` so that it first computes the global gradient norm over all stages
    (the tied weight once: ``ds_pipe_replicated``), skips a step whose norm is not finite (DeepSpeed then counts it as
    skipped through the optimizer's ``overflow`` flag, as for its ZeRO optimizers) and clips by ``max_norm`` (0: no
    clipping) as ``torch.nn.utils.clip_grad_norm_`` does. The norm is kept in ``engine.finetune_grad_norm``.

    Every stage reaches ``OptimizerStep`` once per ``train_batch`` (the last instruction of DeepSpeed's schedule), so
    the all-reduce inside meets on every rank.
    """
    optimizer = engine.optimizer
    step = optimizer.step
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group = engine.grid.get_pipe_parallel_group()

    def guarded(*args, **kwargs):
        squares = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2 for p in params
                   if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=engine.device)
        dist.all_reduce(total, group=group)
        norm = float(total.sqrt())
        engine.finetune_grad_norm = norm
        if not math.isfinite(norm):
            optimizer.overflow = True
            return None
        optimizer.overflow = False
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return step(*args, **kwargs)

    guarded._wrapped_by_lr_sched = True  # the step still runs before the LR schedule's (torch's order check)
    optimizer.step = guarded
    optimizer.overflow = False
    engine.finetune_grad_norm = None


def total_parameters(module, device) -> int:
    """The whole model's parameters, every stage's (a tied weight once), for MFU's FLOPs per token: each device runs
    its stage's share of them on every token of its pipeline. ``module``: this stage's ``PipelineModule``. All ranks
    call it (an all-reduce over the pipe group)."""
    n = sum(p.numel() for p in module.parameters() if not getattr(p, "ds_pipe_replicated", False))
    total = torch.tensor(float(n), dtype=torch.float64, device=device)
    dist.all_reduce(total, group=module._grid.get_pipe_parallel_group())
    return int(total.item())


def grad_norm(engine) -> float | None:
    """The last step's global gradient norm before clipping: :func:`install_step_guard`'s at ZeRO 0, DeepSpeed's
    ZeRO optimizer's at ZeRO 1."""
    norm = getattr(engine, "finetune_grad_norm", None)
    if norm is None:
        gn = engine.get_global_grad_norm()
        norm = float(gn) if gn is not None else None
    return norm


# ------------------------------------------------------------------------------------------------------------ export

def hf_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict under the Hugging Face (or peft) names on rank 0, gathered from data-parallel
    rank 0 of every stage (fp32 CPU tensors); None on the other ranks. All ranks call it."""
    module = engine.module
    mine: dict[str, torch.Tensor] = {}
    if engine.grid.data_parallel_id == 0:
        mine = stage_state(module)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)  # to rank 0 only: the other ranks never hold the whole model
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in (part or {}).items():
            out.setdefault(k, v)
    return out


def stage_state(module) -> dict[str, torch.Tensor]:
    """This stage's layers' tensors under their Hugging Face names (fp32 CPU)."""
    out = {}
    layers = list(module.forward_funcs)
    for layer in layers:
        if not isinstance(layer, _Named):
            continue
        out.update(renamed(layer.state_dict(), layer.hf_names))
    return out


def renamed(state: dict, hf_names: dict) -> dict[str, torch.Tensor]:
    """A pipeline layer's ``state`` under the Hugging Face names (``hf_names``: short name -> prefix), fp32 CPU; keys
    of no named submodule (buffers a layer borrows) are left out."""
    out = {}
    for key, t in state.items():
        head, _, tail = key.partition(".")
        if head not in hf_names:
            continue
        name = hf_names[head] + (f".{tail}" if tail else "")
        out[name] = t.detach().float().cpu() if t.is_floating_point() else t.detach().cpu()
    return out


def write_layers_file(engine, ckpt: Path) -> None:
    """Rank 0: :data:`LAYERS_FILE` into checkpoint folder ``ckpt`` (before its manifest)."""
    (ckpt / LAYERS_FILE).write_text(json.dumps({"format": 1, "stages": engine.num_stages,
                                                "layers": engine.module.finetune_layers}, indent=1))
