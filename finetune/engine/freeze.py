"""Parts of a model that do not train (``model.freeze``): their parameters get ``requires_grad = False`` before the
DeepSpeed engine is built, so they get no gradient, no optimizer state and no update (at every ZeRO stage: DeepSpeed
builds its optimizer partitions from the trainable parameters only), and the export holds them as they were loaded.

A key is an alias of a multimodal model's part, the names LLaMA-Factory's ``freeze_vision_tower`` /
``freeze_multi_modal_projector`` / ``freeze_language_model`` resolve to per architecture:

* ``vision_tower``: the image encoder, ``vision_tower`` (LLaVA, Gemma 3), ``vision_model`` (Idefics3/SmolVLM) or
  ``visual`` (Qwen2-VL, Qwen2.5-VL) without Qwen's ``visual.merger``;
* ``projector``: what maps image features into the language model, ``multi_modal_projector`` (LLaVA, Gemma 3),
  ``connector`` (Idefics3) or ``visual.merger`` (Qwen2-VL, Qwen2.5-VL);
* ``language_model``: ``language_model`` or ``text_model`` (the output head, ``lm_head``, is not in it);

or any dotted module path, matched as whole name segments anywhere in a parameter's name (``model.vision_model.
encoder.layers.0``, ``embed_tokens``).
"""

from __future__ import annotations

import torch

from finetune.errors import ConfigError

ALIASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vision_tower": (("vision_tower", "vision_model", "visual"), ("visual.merger",)),
    "projector": (("multi_modal_projector", "connector", "visual.merger"), ()),
    "language_model": (("language_model", "text_model"), ()),
}
"""Alias -> (module paths it covers, module paths it leaves out)."""


def _has(name: str, path: str) -> bool:
    """``path``'s segments appear, contiguous and whole, in the dotted parameter name ``name``."""
    segments, want = name.split("."), path.split(".")
    return any(segments[i:i + len(want)] == want for i in range(len(segments) - len(want) + 1))


def matches(name: str, key: str) -> bool:
    """Parameter ``name`` belongs to the part ``key`` (an alias of :data:`ALIASES` or a dotted module path)."""
    covered, left_out = ALIASES.get(key, ((key,), ()))
    return any(_has(name, p) for p in covered) and not any(_has(name, p) for p in left_out)


def unmatched(model: torch.nn.Module, keys: list[str]) -> list[str]:
    """The keys that match no parameter of ``model``."""
    names = [n for n, _ in model.named_parameters()]
    return [k for k in keys if not any(matches(n, k) for n in names)]


def apply(model: torch.nn.Module, keys: list[str]) -> str:
    """Turn off ``requires_grad`` of every parameter of the parts ``keys``; returns the log line (parameters frozen
    per key, and those left to train).

    Raises:
        ConfigError: a key matches no parameter (checked before any model by :func:`check`).
    """
    missing = unmatched(model, keys)
    if missing:
        raise ConfigError(_problem(missing, model))
    frozen = {k: 0 for k in keys}
    for name, p in model.named_parameters():
        hit = next((k for k in keys if matches(name, k)), None)
        if hit is not None:
            p.requires_grad_(False)
            frozen[hit] += getattr(p, "ds_numel", p.numel())
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    return (f"frozen: {', '.join(f'{k} ({n:,} parameters)' for k, n in frozen.items())}; {trained:,} parameters "
            f"train")


def _problem(missing: list[str], model: torch.nn.Module) -> str:
    parts = sorted({".".join(n.split(".")[:2]) for n, _ in model.named_parameters()})
    return (f"model.freeze: {', '.join(repr(k) for k in missing)} match(es) no parameter of "
            f"{type(model).__name__}; use {', '.join(ALIASES)} or a module path such as {', '.join(parts[:6])}")


def check(cfg, meta_model, problems: list[str]) -> None:
    """``model.freeze`` against the model built on the meta device (no memory, no weights:
    :func:`finetune.engine.model.meta_model`; None when its class cannot build it, which the model checks report):
    one line naming the keys that match nothing."""
    model = meta_model
    if not cfg.model.freeze or model is None:
        return
    missing = unmatched(model, list(cfg.model.freeze))
    if missing:
        problems.append(_problem(missing, model))
