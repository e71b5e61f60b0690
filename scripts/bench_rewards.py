"""The reward functions of ``scripts/bench.py``'s ``grpo`` preset, loaded by both contenders: ``finetune`` as
``train.grpo.rewards`` entries ``scripts/bench_rewards.py:<function>``, TRL's ``GRPOTrainer`` as its
``reward_funcs`` (``scripts/bench_trl.py``). One module, so both sides score every completion with the same code.

TRL's signature (``f(prompts, completions, **columns) -> list[float | None]``; ``columns`` holds the dataset's other
columns, here ``answer``, one value per completion). They equal the ``grpo`` recipe's built-ins
(``finetune/recipes/common/rewards.py``) at its defaults:

* :func:`format_reward`: the built-in ``format`` with ``train.grpo.format_pattern`` :data:`FORMAT_PATTERN` (the shipped
  ``grpo_gsm8k.yaml``'s: the completion writes GSM8K's answer marker): 1.0 when the pattern matches the completion
  (``re.search``, dot matches newline), else 0.0;
* :func:`exact_match`: the built-in ``exact_match`` with ``answer_pattern`` :data:`ANSWER_PATTERN` (its default) on
  the ``answer`` column: 1.0 when the completion's answer equals the reference's (thousands separators, ``$`` and a
  trailing period removed), 0.0 when not, ``None`` when the reference has none;
* :func:`last_integer_match`: the built-in ``exact_match`` with ``answer_pattern`` :data:`LAST_INTEGER` (the shipped
  ``grpo_smollm2_arithmetic.yaml``'s: the completion's last integer) on the ``answer`` column (the ``grpo_smollm2``
  preset).

A conversational prompt's completions reach TRL's functions as one assistant message each (``[{"role": "assistant",
"content": text}]``) and the toolkit's as text: :func:`_text` reads both.
"""

from __future__ import annotations

import re

FORMAT_PATTERN = "####"
ANSWER_PATTERN = "#### (-?[0-9.,]+)"
LAST_INTEGER = r"(-?[0-9]+)(?![\s\S]*[0-9])"


def _text(completion) -> str:
    """A completion as text: TRL hands a conversational prompt's completion over as a list of messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion)
    return completion


def _answer(text: str, pattern: str = ANSWER_PATTERN) -> str | None:
    m = re.search(pattern, text)
    if m is None:
        return None
    return (m.group(1) or "").replace(",", "").replace("$", "").strip().rstrip(".").strip()


def format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 when :data:`FORMAT_PATTERN` matches the completion, else 0.0."""
    regex = re.compile(FORMAT_PATTERN, re.DOTALL)
    return [float(regex.search(_text(c)) is not None) for c in completions]


def exact_match(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion's ``#### <number>`` equals the ``answer`` column's, 0.0 when not, None when the
    reference has none."""
    out = []
    for completion, reference in zip(completions, answer):
        want = _answer(str(reference)) if reference is not None else None
        out.append(None if want is None else float(_answer(_text(completion)) == want))
    return out


def last_integer_match(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion's last integer equals the ``answer`` column's, 0.0 when not, None when the reference
    has none."""
    out = []
    for completion, reference in zip(completions, answer):
        want = _answer(str(reference), LAST_INTEGER) if reference is not None else None
        out.append(None if want is None else float(_answer(_text(completion), LAST_INTEGER) == want))
    return out
