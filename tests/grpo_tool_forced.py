"""``finetune/run.py`` with the ``grpo`` recipe's generation replaced by scripted turns that call tools
(tests/test_grpo_tools.py: "multi-turn, teacher-forced, tool results included").

Every turn the toolkit asks for is drawn from a generator seeded with the token ids it continues
(:func:`scripted_turn`), so the turns are the same whatever the rank, micro-batch, accumulation split or ZeRO
stage, and the one-process reference (:func:`reference_trajectory`) draws the very same ones. A first turn calls
the calculator or answers; a turn after a tool result answers or calls it again. Everything else, the toolkit's
tool loop (:mod:`finetune.recipes.grpo.tools`), the calculator (``data/tools/calculator.py``) and DeepSpeed included,
runs as in a launch of ``finetune/run.py``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MAX_TOOL_TURNS = 2
"""The test config's ``train.grpo.max_tool_calling_iterations``."""


def _call(tokenizer, gen: torch.Generator) -> list[int]:
    a, b = (int(x) for x in torch.randint(1, 99, (2,), generator=gen))
    text = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%d + %d"}}\n</tool_call>' % (a, b)
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def scripted_turn(context: list[int], tokenizer, budget: int) -> list[int]:
    """The turn that continues ``context`` (prompt + the completion so far, real tokens): a tool call (with EOS) or
    1-8 random GPT-2 ids ending with EOS or not; at most ``budget`` ids."""
    gen = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(context)) % (2 ** 31))
    after_result = "<tool_response>" in tokenizer.decode(context[-40:])
    if int(torch.randint(0, 3 if after_result else 2, (1,), generator=gen)) == 0:
        return _call(tokenizer, gen)[:budget]
    n = int(torch.randint(1, 9, (1,), generator=gen))
    ids = torch.randint(100, 5000, (n,), generator=gen).tolist()
    return (ids + ([tokenizer.eos_token_id] if int(torch.randint(0, 4, (1,), generator=gen)) else []))[:budget]


def _generate(engine, batch, g, tokenizer, n, sample, seed, synced):
    rows = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        context = ids[mask.bool()].tolist()
        for k in range(n):  # a prompt's n completions differ: each continues the prompt and its index
            rows.append(scripted_turn(context + ([k] if n > 1 else []), tokenizer, g.max_completion_length))
    return as_generated(rows, tokenizer)


def as_generated(rows: list[list[int]], tokenizer) -> dict:
    """Completions (token ids, one list per rollout) in ``grpo.rollout.generate``'s output form:
    ``completion_ids`` ``[N, C]`` int64 right-padded, ``completion_mask`` ``[N, C]`` float32, ``terminated`` ``[N]``
    bool (ends with EOS), ``lengths`` ``[N]`` int64."""
    width = max(max(len(r) for r in rows), 1)
    completion = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    cmask = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        completion[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        cmask[i, :len(r)] = 1
    terminated = torch.tensor([bool(r) and r[-1] == tokenizer.eos_token_id for r in rows])
    return {"completion_ids": completion, "completion_mask": cmask, "terminated": terminated,
            "lengths": cmask.sum(1).long()}


def reference_trajectory(prompt: list[int], k: int, n: int, tokenizer, max_completion_length: int,
                         template: str) -> tuple[list[int], list[int]]:
    """Rollout ``k`` of ``n`` of ``prompt`` built the textbook way: its scripted turns, and after each turn that
    calls the calculator its result rendered by the template (a ``tool`` message, then the assistant's turn opened),
    at most :data:`MAX_TOOL_TURNS` results and ``max_completion_length`` tokens. Returns ``(ids, model)``: the
    completion's ids and 1 on the model's tokens, 0 on the template's."""
    import json
    import re

    sys.path.insert(0, str(REPO / "data" / "tools"))
    from calculator import calculate

    ids = turn = scripted_turn(prompt + [k], tokenizer, max_completion_length)
    model = [1] * len(ids)
    for _ in range(MAX_TOOL_TURNS):
        calls = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", tokenizer.decode(turn), re.S)
        if not calls or not turn or turn[-1] != tokenizer.eos_token_id:
            break
        expression = json.loads(calls[-1])["arguments"]["expression"]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {}}}]}]
        before = tokenizer.apply_chat_template(dummy, chat_template=template, tokenize=True, return_dict=False)
        before = before[:max(i for i, t in enumerate(before) if t == tokenizer.eos_token_id) + 1]
        after = tokenizer.apply_chat_template(dummy + [{"role": "tool", "name": "calculate",
                                                        "content": calculate(expression)}],
                                              chat_template=template, tokenize=True, add_generation_prompt=True,
                                              return_dict=False)
        suffix = after[len(before):]
        if len(ids) + len(suffix) >= max_completion_length:
            break
        ids, model = ids + suffix, model + [0] * len(suffix)
        turn = scripted_turn(prompt + ids, tokenizer, max_completion_length - len(ids))
        ids, model = ids + turn, model + [1] * len(turn)
    return ids, model


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from finetune.recipes.grpo import rollout

    rollout.generate = _generate
    sys.argv[0] = str(REPO / "finetune/run.py")
    runpy.run_path(str(REPO / "finetune/run.py"), run_name="__main__")
