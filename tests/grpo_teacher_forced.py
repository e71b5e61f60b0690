"""``finetune/run.py`` with the ``grpo`` recipe's generation replaced by fixed completions (tests/test_grpo.py's
parity runs: "with fixed completions, teacher-forced, no sampling").

A prompt's completions are drawn from a generator seeded with its token ids (:func:`fixed_completions`), so they are
the same whatever the rank, micro-batch, accumulation split or ZeRO stage, and the one-process reference draws the
very same ones. The replacement is set on the module that holds ``generate`` (:mod:`finetune.recipes.grpo.rollout`,
where the recipe's step and its evaluation look it up) for this process only (the wrapper is the process's entry
point); everything else, DeepSpeed included, runs as in a launch of ``finetune/run.py``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LENGTH = 10
"""Completion tokens at most (the test config's ``train.grpo.max_completion_length``)."""


def fixed_completions(prompt: list[int], n: int, eos: int, pad: int, length: int = LENGTH) -> list[list[int]]:
    """``n`` completions of ``prompt`` (its real token ids): random GPT-2 ids, and an EOS at a random place or none;
    each a list of up to ``length`` ids (ending with EOS when it has one)."""
    seed = sum((i + 1) * t for i, t in enumerate(prompt)) % (2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(100, 5000, (length,), generator=gen).tolist()
        stop = int(torch.randint(0, length + 1, (1,), generator=gen))  # length: no EOS
        out.append(ids if stop == length else ids[:stop] + [eos])
    return out


def _generate(engine, batch, g, tokenizer, n, sample, seed, synced):
    rows = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        rows += fixed_completions(ids[mask.bool()].tolist(), n, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                  g.max_completion_length)
    width = max(len(r) for r in rows)
    completion = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    cmask = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        completion[i, :len(r)] = torch.tensor(r)
        cmask[i, :len(r)] = 1
    terminated = torch.tensor([r[-1] == tokenizer.eos_token_id for r in rows])
    return {"completion_ids": completion, "completion_mask": cmask, "terminated": terminated,
            "lengths": cmask.sum(1).long()}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from finetune.recipes.grpo import rollout

    rollout.generate = _generate
    sys.argv[0] = str(REPO / "finetune/run.py")
    runpy.run_path(str(REPO / "finetune/run.py"), run_name="__main__")
