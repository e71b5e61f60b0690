"""Mixture-of-experts (MoE) models: which models are, what ZeRO-3 must fetch whole, the router's loss and statistics.

A transformers causal LM is a mixture of experts when its config names an expert count (``num_experts``:
Qwen2-MoE, Qwen3-MoE, OLMoE; ``num_local_experts``: Mixtral, GPT-OSS) and a top-k (``num_experts_per_tok``):
:func:`moe_shape`. For such a model finetune does three things:

* **ZeRO-3 leaf modules** (:func:`mark_leaf_modules`). Every module with a child named ``experts`` (the sparse
  MoE block: ``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock``,
  ...) is flagged with DeepSpeed's ``set_z3_leaf_modules`` before ``deepspeed.initialize``: ZeRO-3 then gathers
  all the block's parameters (router and every expert) when the block starts and installs no hooks below it. A
  rank whose tokens reach no token of some expert then still takes part in every all-gather the others do, so it
  cannot leave them waiting (the classic MoE hang of ZeRO-3 with experts as separate modules), and the varying
  order in which experts run cannot confuse ZeRO-3's prefetcher (DeepSpeed's ``set_z3_leaf_modules`` docstring).
  The rule is structural, not a list of class names, so a new MoE architecture of transformers is covered as
  long as it keeps its experts in a child called ``experts`` (all of transformers 5.23's do); DeepSpeed 0.19.8
  also flags the Mixtral and Qwen2/Qwen3-MoE blocks itself (``zero_optimization.leaf_module``), which does the same.
* **The router's load-balancing loss** (:func:`router_terms`): the recipes ask the model for its router logits
  (``output_router_logits=True``) and take its own ``aux_loss`` (transformers' ``load_balancing_loss_func``,
  Switch Transformer eq. 4-6, Fedus et al. 2021: ``E x sum_e f_e x P_e`` over the micro-batch's tokens and all
  layers, where ``f_e`` is the share of top-k assignments that went to expert ``e`` and ``P_e`` its mean router
  probability; padding excluded through ``attention_mask``), times the model's ``router_aux_loss_coef``, as the
  model adds it to its own loss. The loop adds that term to each micro-batch's loss *after* the token weighting
  (:class:`finetune.data.batch.LossOutput.aux_loss`), so a step optimizes
  ``sum of the LM losses over the global batch's targets / targets + coef x mean over the global batch's
  micro-batches of their aux losses`` (:mod:`finetune.training.trainer`; ``docs/moe.md``).
* **Router statistics** (also :func:`router_terms`), returned as metrics ``(numerator, denominator)`` so that
  the loop sums them over micro-batches and ranks and logs them every ``train.log_every`` steps (``train/...``)
  and at every evaluation (``eval/...``): ``aux_loss`` (the aux loss without its coefficient, mean per
  micro-batch), ``router/expert<e>_share`` (share of all top-k assignments of all layers that went to expert
  ``e``: ``1 / E`` when balanced), ``router/max_load`` (per layer and micro-batch, tokens of the busiest expert /
  the mean per expert: 1 when balanced, at most ``E / k``; averaged over layers and micro-batches) and
  ``router/idle_experts`` (per micro-batch, how many (layer, expert) pairs got no token at all; averaged over
  micro-batches).

Packed rows (``data.packing``) carry no ``attention_mask`` (there is no padding in them): the aux loss and the
statistics then count every position, and the load shares span the packed examples of the micro-batch as those
of one long sequence would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXPERTS_CHILD = "experts"
"""Name of the child module that holds a sparse MoE block's experts; its parent is the block."""


@dataclass(frozen=True)
class MoeShape:
    """What finetune needs to know about a mixture-of-experts config."""

    experts: int
    """Routed experts per MoE layer (``num_experts`` or ``num_local_experts``)."""
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    aux_loss_coef: float
    """The load-balancing loss's coefficient (``router_aux_loss_coef``; 0 when the config has none)."""


def moe_shape(config) -> MoeShape | None:
    """The MoE shape of a transformers config, or None for a dense model.

    Args:
        config: a ``transformers.PretrainedConfig`` (or any object with its attributes).

    Returns:
        :class:`MoeShape` when the config has more than one routed expert (``num_experts`` or
        ``num_local_experts``) and a top-k (``num_experts_per_tok``); None otherwise.
    """
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int) or experts < 2 or top_k < 1:
        return None
    return MoeShape(experts=experts, top_k=top_k, aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0)
                                                                       or 0.0))


def sparse_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks of ``model``: every module that has a direct child named ``experts``
    (:data:`EXPERTS_CHILD`), outermost first; a block inside another block is not listed again."""
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(getattr(module, EXPERTS_CHILD, None), torch.nn.Module) \
                and EXPERTS_CHILD in dict(module.named_children()):
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def mark_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Flag the sparse MoE blocks of ``model`` as ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``),
    before ``deepspeed.initialize``.

    Returns:
        The class names of the flagged blocks (sorted, each once); empty for a dense model (nothing flagged).
    """
    from deepspeed.utils import set_z3_leaf_modules

    blocks = sparse_blocks(model)
    if not blocks:
        return []
    classes = sorted({type(b) for b in blocks}, key=lambda c: c.__name__)
    set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def expert_parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the routed experts: those under the ``experts`` child of every sparse MoE block (a shared
    expert, which every token passes, is not among them). Works on the meta device."""
    return sum(p.numel() for block in sparse_blocks(model) for p in getattr(block, EXPERTS_CHILD).parameters())


def active_parameters(total: int, experts_params: int, shape: MoeShape) -> int:
    """Parameters one token passes through: the non-expert ones plus ``top_k / experts`` of the expert ones
    (each routed expert of a layer has the same size)."""
    return total - experts_params + experts_params * shape.top_k // shape.experts


def router_inputs(config) -> dict:
    """Extra keyword inputs for a forward of a model with transformers config ``config``:
    ``{"output_router_logits": True}`` for an MoE model (transformers returns router logits and ``aux_loss``
    only when asked: ``config.output_router_logits`` defaults to False), else ``{}``."""
    return {"output_router_logits": True} if moe_shape(config) is not None else {}


def router_terms(config, out, attention_mask: torch.Tensor | None) -> dict:
    """The loss term and the statistics of the router from one forward of an MoE model.

    Args:
        config: the transformers config of the model that ran.
        out: its output, run with ``output_router_logits=True``: ``aux_loss`` (0-dim, the model's
            ``load_balancing_loss_func`` over all layers) and ``router_logits`` (one ``[tokens, experts]`` tensor
            per MoE layer, tokens = rows x positions of the micro-batch).
        attention_mask: ``[rows, seq]`` the forward got (0 = padding, left out of the statistics), or None
            (packed or flattened rows: every position counts).

    Returns:
        ``{}`` for a dense model or an output without router logits; else ``{"aux_loss": coef x aux_loss}``
        (0-dim float32, differentiable: the term the loop adds after the token weighting) and ``"metrics"``:
        ``name -> (numerator, denominator)`` 0-dim float64 tensors (module docstring: ``aux_loss``,
        ``router/expert<e>_share``, ``router/max_load``, ``router/idle_experts``).
    """
    shape = moe_shape(config)
    logits = getattr(out, "router_logits", None)
    aux = getattr(out, "aux_loss", None)
    if shape is None or not logits or not isinstance(aux, torch.Tensor):
        return {}
    with torch.no_grad():
        keep = attention_mask.reshape(-1).bool() if attention_mask is not None else None
        counts = []
        for layer in logits:
            chosen = layer.topk(shape.top_k, dim=-1).indices  # the router's choice (top-k of softmax = of logits)
            if keep is not None and keep.numel() == chosen.shape[0]:
                chosen = chosen[keep]
            counts.append(torch.bincount(chosen.reshape(-1), minlength=shape.experts)[:shape.experts])
        counts = torch.stack(counts).double()  # [layers, experts]
        one = torch.ones((), dtype=torch.float64, device=counts.device)
        per_layer = counts.sum(dim=-1)
        max_load = (counts.max(dim=-1).values * shape.experts / per_layer.clamp(min=1)).sum()
        metrics = {"aux_loss": (aux.detach().double().to(counts.device), one),
                   "router/max_load": (max_load, one * counts.shape[0]),
                   "router/idle_experts": ((counts == 0).sum().double(), one)}
        total = counts.sum()
        for e in range(shape.experts):
            metrics[f"router/expert{e}_share"] = (counts[:, e].sum(), total)
    return {"aux_loss": shape.aux_loss_coef * aux.float(), "metrics": metrics}
