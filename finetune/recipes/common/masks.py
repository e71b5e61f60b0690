"""Attention masks for rows whose sequences share a prefix (the prompt computed once: Wang et al. 2024,
"Accelerating Direct Preference Optimization with Prefix Sharing", arXiv:2410.20305), as ``reward`` runs a pair's
two sequences in one row and ``grpo`` a prompt's completions: which models can take such a row
(:func:`sharing_problem`: sdpa or eager attention, full or sliding-window layers) and the 4D block mask in the form
their attention takes, with a sliding window applied by each token's place in its own sequence (:func:`block_mask`).
"""

from __future__ import annotations

import torch


SHARING_KERNELS = ("sdpa", "eager")
"""Attention implementations that take a shared-prefix row's block mask (a 4D mask, which transformers' mask
functions pass through as it is); the flash-attention kernels take no such mask."""


SHARED_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Attention layer types (``config.layer_types``) a shared-prefix row's mask is built for; a model with another
(chunked attention, linear attention, ...) runs its sequences as separate rows."""


def sliding_layout(module) -> tuple[int | None, list[str] | None]:
    """``(window, layer types)`` of ``module``'s sliding-window attention: ``(None, None)`` without one; ``(w,
    None)`` when every layer slides (Mistral, Phi-3, Starcoder2: ``config.sliding_window`` and no ``layer_types``);
    ``(w, types)`` when ``config.layer_types`` names the sliding layers (Qwen2/Qwen3 with ``use_sliding_window``,
    Gemma-2/3, Cohere2: their forwards take a ``{layer type: mask}`` dict)."""
    config = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None, None
    return int(window), (list(dict.fromkeys(types)) if types is not None else None)


def sharing_problem(module) -> str | None:
    """Why ``module`` cannot run shared-prefix rows (a block mask per row), or None when it can: its attention
    implementation takes no 4D mask (:data:`SHARING_KERNELS`), or it has layer types other than
    :data:`SHARED_LAYER_TYPES`."""
    config = getattr(module, "config", None)
    kernel = getattr(config, "_attn_implementation", None)
    if kernel not in SHARING_KERNELS:
        return f"it runs {kernel} attention, which takes no block mask (only {' or '.join(SHARING_KERNELS)} do)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    other = sorted(set(getattr(text, "layer_types", None) or []) - set(SHARED_LAYER_TYPES))
    if other:
        return f"it has {', '.join(other)} layers (config.layer_types), for which no block mask is built"
    return None


def _as_kernel_mask(module, allowed: torch.Tensor) -> torch.Tensor:
    if getattr(getattr(module, "config", None), "_attn_implementation", None) != "eager":
        return allowed
    dtype = getattr(module, "dtype", torch.float32)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def block_mask(module, allowed: torch.Tensor, position_ids: torch.Tensor):
    """A ``[B, 1, W, W]`` bool block mask (query ``q`` may attend key ``k``) as ``module``'s attention takes a 4D mask:
    as it is for sdpa, additive (0 / the dtype's minimum) for eager, which adds the mask to the scores.

    A 4D mask reaches every layer as it is, so a sliding-window model's window is applied here
    (:func:`sliding_layout`): a key is kept for a sliding layer only when ``position(q) - position(k) < window``
    (``position_ids`` ``[B, W]``: each token's place in its own sequence, which is what transformers'
    ``sliding_window_overlay`` compares in an unshared row). Every layer sliding: that mask alone; mixed layers: a
    ``{layer type: mask}`` dict, the form the forwards of such models take (``causal_mask_mapping``)."""
    window, types = sliding_layout(module)
    if window is None:
        return _as_kernel_mask(module, allowed)
    near = (position_ids[:, :, None] - position_ids[:, None, :]) < window
    sliding = allowed & near[:, None].to(allowed.device)
    if types is None:
        return _as_kernel_mask(module, sliding)
    return {t: _as_kernel_mask(module, sliding if t == "sliding_attention" else allowed) for t in types}
