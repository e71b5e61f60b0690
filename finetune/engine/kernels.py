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
"""

from __future__ import annotations

from collections import Counter

import torch
from transformers import activations as act

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
