"""Kernel substitutions: modules of a built model replaced by one fused kernel computing the same function.

transformers writes some activations as chains of elementwise operations in Python. GPT-2's ``gelu_new``
(``NewGELUActivation``, also used by GPT-J, GPT-Neo, CodeGen and Phi) is
``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``: eight passes over the ``[tokens, d_ff]``
up-projection output, and autograd keeps three more tensors of that size per layer for the backward pass
(``tanh``'s output and both operands of the last product). PyTorch's ``F.gelu(approximate="tanh")`` is the same
function in one kernel that keeps only its input, which the next layer keeps anyway.

Peak resident memory per rank falls accordingly, with less CPU per step (figures: docs/performance.md). The
values agree to fp32 rounding: over 10^7 inputs in [-16, 16] the largest difference is 4.8e-7, and both are
equally far (4.3e-7) from the float64 formula. In bf16 and fp16 they differ by up to one unit in the last place
(bf16: 0.0156 at |x| near 8-16), the fused kernel being the closer to the float64 formula
(``tests/test_kernels.py``).

The same idea in libraries: transformers marks these classes as replaceable by a hub kernel
(``@use_kernel_forward_from_hub("NewGELU")``, which needs the Hub, so it is not used here), and Liger Kernel
swaps modules of a built model for fused ones on GPUs (``liger_kernel.transformers.apply_liger_kernel_to_*``).

Only exact module types are replaced (a subclass may do something else), in place on the parent module, before
LoRA and before ``deepspeed.initialize`` (these modules hold no parameters, so nothing ZeRO partitions moves).
The model's config is not touched: an export names the model's own activation and loads with it (the export
check compares its logits with the engine's at 1e-4). ``model.fused_kernels: false`` keeps every module as built.

Attention with dropout on CPU (:func:`light_dropout_sdpa`): PyTorch's CPU attention kernels take no dropout, so
``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (transformers' ``sdpa`` of BERT, GPT-2 and other models
with attention dropout, in training) runs its composite math path, where autograd keeps three float32
``[batch, heads, queries, keys]`` tensors per layer for the backward pass: the softmax output, the dropout noise
(``bernoulli_`` then ``div_(1 - p)``, ``at::native::dropout``) and their product. :class:`DropoutAttention` is
the same computation (scale, mask, softmax, dropout, product with the values) with a hand-written backward that
keeps the softmax output and a 1-byte keep mask: 5 bytes per score instead of 12. Its mask is drawn as
``at::dropout`` draws it (``bernoulli_(1 - p)`` over the same shape from the same generator: the same positions
are dropped for the same seed), and its outputs and gradients are SDPA's bit for bit (``tests/test_kernels.py``). The substitution is a patch of transformers' attention table for ``sdpa``
(:func:`finetune.patches.attention_function`; transformers' ``AttentionInterface.register`` under a new name would
change ``config._attn_implementation``, which transformers' mask builders key on): calls on GPUs (whose SDPA kernels
apply dropout inside the kernel), without dropout, without gradients, or with grouped key/value heads, a
position bias, a soft-cap or a paged cache go to transformers' own function unchanged.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from transformers import activations as act

from finetune import patches

_TANH = "F.gelu(approximate='tanh')"


def _replacement(module: torch.nn.Module) -> tuple[str, str, torch.nn.Module] | None:
    """``(what it is, what replaces it, the fused module)`` for a tanh-GELU computed as a Python chain of ops."""
    kind = type(module)
    if kind in (act.NewGELUActivation, act.FastGELUActivation, act.AccurateGELUActivation):
        return kind.__name__, _TANH, act.GELUTanh()
    bound = getattr(getattr(module, "act", None), "__func__", None)  # the Python variants bind a method as .act
    if kind is act.GELUTanh and bound is act.GELUTanh._gelu_tanh_python:
        return "GELUTanh (Python)", _TANH, act.GELUTanh()
    # Not replaced: the Python erf GELU (``gelu_python``). torch's CPU ``F.gelu`` is up to 1.2e-6 off the float64
    # formula near x = -3.5, where the Python chain stays within 4.4e-7: not "the same values" at fp32 rounding.
    return None


def fusable(model: torch.nn.Module) -> int:
    """How many modules of ``model`` :func:`fuse` would replace (works on a meta-device model too)."""
    return sum(_replacement(child) is not None for child in model.modules())


def fuse(model: torch.nn.Module) -> str:
    """Replace, in place, every module of ``model`` that has a fused equivalent (see the module docstring).

    Args:
        model: a built transformers model (any module tree; modules without a fused equivalent are left alone).

    Returns:
        One line for the log, e.g. ``"NewGELUActivation x2 -> F.gelu(approximate='tanh')"``, or
        ``"nothing to replace"``.
    """
    replaced: Counter[tuple[str, str]] = Counter()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swap = _replacement(child)
            if swap is None:
                continue
            was, now, fused = swap
            fused.train(child.training)
            parent._modules[name] = fused  # also the numbered children of ModuleList / Sequential
            replaced[was, now] += 1
    if not replaced:
        return "nothing to replace"
    return ", ".join(f"{was} x{n} -> {now}" for (was, now), n in replaced.items())


class DropoutAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) -> dropout(p) -> @ v``, as ``torch.nn.functional.scaled_dot_product_attention``'s
    math path computes it, keeping the softmax output and a bool keep mask for the backward pass (module docstring).

    ``forward(q, k, v, mask, p, scale)``: ``q`` ``[B, H, L, E]``, ``k`` ``[B, H, S, E]``, ``v`` ``[B, H, S, Ev]``
    (same floating dtype); ``mask`` None, bool (True: attend) or additive float, broadcastable to ``[B, H, L, S]``;
    ``p`` the dropout probability (0 < p < 1); ``scale`` the score scale. Returns ``[B, H, L, Ev]``. A query whose
    keys are all masked gets zeros (``at::_safe_softmax``, as SDPA).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, p: float, scale: float):
        root = scale ** 0.5  # SDPA's math path scales q and k by sqrt(scale) each before the product
        scores = torch.matmul(q * root, k.transpose(-2, -1) * root)
        if mask is not None:
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, float("-inf"))
            else:
                scores.add_(mask)
        probs = torch._safe_softmax(scores, -1)
        del scores
        keep = torch.empty(probs.shape, dtype=torch.bool, device=probs.device).bernoulli_(1 - p)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.gain, ctx.scale = 1.0 / (1.0 - p), scale
        return torch.matmul(probs.mul(keep).mul_(ctx.gain), v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, probs, keep = ctx.saved_tensors
        dropped = probs.mul(keep).mul_(ctx.gain)
        dv = torch.matmul(dropped.transpose(-2, -1), grad)
        del dropped
        dprobs = torch.matmul(grad, v.transpose(-2, -1)).mul_(keep).mul_(ctx.gain)
        dscores = torch._softmax_backward_data(dprobs, probs, -1, probs.dtype)
        del dprobs
        root = ctx.scale ** 0.5  # autograd's order through the forward's scaled q and k
        dq = torch.matmul(dscores, k * root).mul_(root)
        dk = torch.matmul(dscores.transpose(-2, -1), q * root).mul_(root)
        return dq, dk, dv, None, None, None


def light_dropout_sdpa(sdpa: Callable) -> Callable:
    """transformers' ``sdpa`` attention function ``sdpa`` with :class:`DropoutAttention` for the calls it covers
    (module docstring); same signature and return value ``(output [B, L, H, Ev], None)``."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
        plain = (not dropout or query.device.type != "cpu" or not torch.is_grad_enabled()
                 or not (query.requires_grad or key.requires_grad or value.requires_grad)
                 or key.shape[1] != query.shape[1] or getattr(module, "num_key_value_groups", 1) != 1
                 or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache", "s_aux")))
        if plain:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
        length, keys = query.shape[2], key.shape[2]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = attention_mask
        if mask is None and causal and length > 1:  # sdpa_attention_forward's is_causal; SDPA's upper-left tril
            mask = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril()
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = DropoutAttention.apply(query, key, value, mask, float(dropout), float(scale))
        return out.transpose(1, 2).contiguous(), None

    attention.light_dropout = True
    return attention


def attention_dropout(config) -> float:
    """The attention dropout probability of a transformers config (its text config's ``attention_probs_dropout_prob``,
    ``attn_pdrop`` or ``attention_dropout``, BERT's, GPT-2's and Llama's names; 0.0 when none is set)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max(float(getattr(text, k, 0.0) or 0.0) for k in ("attention_probs_dropout_prob", "attn_pdrop",
                                                               "attention_dropout"))


def lighten_attention_dropout() -> str | None:
    """Route transformers' ``sdpa`` attention through :func:`light_dropout_sdpa` (an active patch of its attention
    table, undone by :func:`finetune.patches.restore_all`); returns a line for the log, or None when it already is."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "light_dropout", False):
        return None
    patches.apply(patches.attention_function(
        "sdpa", light_dropout_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"]),
        "PyTorch's CPU SDPA kernels take no dropout; its math path keeps 12 bytes per attention score for the "
        "backward, DropoutAttention 5 (no upstream issue: a missing CPU kernel feature)"))
    return ("sdpa attention with dropout on CPU -> DropoutAttention (a 1-byte dropout mask kept for the backward "
            "instead of SDPA's float32 noise and product)")
