"""Reward functions for tests/test_grpo.py, loaded by path (``train.grpo.rewards``) with TRL's signature."""

import os


def has_digit(prompts, completions, **kwargs):
    """1.0 for a completion with a digit, else 0.0; None for an empty completion (not scored)."""
    return [None if not c else float(any(ch.isdigit() for ch in c)) for c in completions]


def fails_on_rank1(prompts, completions, **kwargs):
    """Raises on rank 1 from its second call on (the first step trains): the failure must stop every rank."""
    fails_on_rank1.calls = getattr(fails_on_rank1, "calls", 0) + 1
    if os.environ.get("RANK") == "1" and fails_on_rank1.calls > 1:
        raise ZeroDivisionError("the scorer divided by zero")
    return [0.0] * len(completions)


def wrong_length(prompts, completions, **kwargs):
    """One value too few."""
    return [0.0] * (len(completions) - 1)


def returns_nan(prompts, completions, **kwargs):
    """NaN for every completion."""
    return [float("nan")] * len(completions)


def returns_inf(prompts, completions, **kwargs):
    """An infinity for every completion."""
    return [float("inf")] * len(completions)


def calls_exit(prompts, completions, **kwargs):
    """Exits the interpreter (``sys.exit``) instead of raising."""
    raise SystemExit(3)


def scores_nothing(prompts, completions, **kwargs):
    """None for every completion: nothing scored."""
    return [None] * len(completions)


def no_kwargs(prompts, completions):
    """TRL's signature needs **kwargs: refused by --check."""
    return [0.0] * len(completions)
