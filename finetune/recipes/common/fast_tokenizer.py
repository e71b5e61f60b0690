"""The tokenizer the span and tag recipes need (``token_cls``: word ids; ``qa``: character offsets and overflowing
windows): a fast (Rust, ``tokenizer.json``) tokenizer that can pad."""

from __future__ import annotations

from finetune.errors import ConfigError


def require_fast(tokenizer, recipe: str, needs: str):
    """``tokenizer`` itself when it is a fast one with a pad token.

    Args:
        tokenizer: the loaded tokenizer.
        recipe: the recipe's name, for the message.
        needs: what the recipe reads from a fast tokenizer (``"word ids"``), for the message.

    Raises:
        ConfigError: a slow (Python) tokenizer, or one without a pad token (one line naming the tokenizer).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"model.tokenizer_path: '{tokenizer.name_or_path}' is a slow tokenizer; {recipe} reads a "
                          f"fast tokenizer's {needs} (a folder with tokenizer.json)")
    if tokenizer.pad_token is None:
        raise ConfigError(f"model.tokenizer_path: '{tokenizer.name_or_path}' has no pad token; set one in the "
                          f"tokenizer folder")
    return tokenizer
