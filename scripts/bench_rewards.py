"""The reward functions of ``scripts/bench.py``'s ``grpo`` preset, loaded by both contenders: ``finetune`` as
``train.grpo.rewards`` entries ``scripts/bench_rewards.py:<function>``, TRL's ``GRPOTrainer`` as its
``reward_funcs`` (``scripts/bench_trl.py``). One module, so both sides score every completion with the same code.

TRL's signature (``f(prompts, completions, **columns) -> list[float | None]``; ``columns`` holds the dataset's other
columns, here ``answer``, one value per completion). They equal the ``grpo`` recipe's built-ins
(``finetune/recipes/rewards.py``) at its defaults:

* :func:`format_reward`: the built-in ``format`` with ``train.grpo.format_pattern`` :data:`FORMAT_PATTERN` (the shipped
  ``grpo_gsm8k.yaml``'s: the completion writes GSM8K's answer marker): 1.0 when the pattern matches the completion
  (``re.search``, dot matches newline), else 0.0;
* :func:`exact_match`: the built-in ``exact_match`` with ``answer_pattern`` :data:`ANSWER_PATTERN` (its default) on
  the ``answer`` column: 1.0 when the completion's answer equals the reference's (thousands separators, ``$`` and a
  trailing period removed), 0.0 when not, ``None`` when the reference has none.
"""

from __future__ import annotations

import re

FORMAT_PATTERN = "####"
ANSWER_PATTERN = "#### (-?[0-9.,]+)"


def _answer(text: str) -> str | None:
    m = re.search(ANSWER_PATTERN, text)
    if m is None:
        return None
    return (m.group(1) or "").replace(",", "").replace("$", "").strip().rstrip(".").strip()


def format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 when :data:`FORMAT_PATTERN` matches the completion, else 0.0."""
    regex = re.compile(FORMAT_PATTERN, re.DOTALL)
    return [float(regex.search(c) is not None) for c in completions]


def exact_match(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion's ``#### <number>`` equals the ``answer`` column's, 0.0 when not, None when the
    reference has none."""
    out = []
    for completion, reference in zip(completions, answer):
        want = _answer(str(reference)) if reference is not None else None
        out.append(None if want is None else float(_answer(completion) == want))
    return out
