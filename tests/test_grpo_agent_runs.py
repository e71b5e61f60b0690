"""Launched multi-turn ``grpo`` runs with tools and an environment (issue 53's acceptance lines), 2 CPU ranks, ZeRO-3
with every parameter partitioned (``stage3_param_persistence_threshold: 0``), LoRA with a KL term (``model.lora.r:
4``, ``train.grpo.beta: 0.04``: LoRA is required whenever ``beta > 0``), the model gathered once per step for
generation.

One pair of launches serves every assertion: a 3-step run, and the same run resumed from its step-1 checkpoint.

* Tools that raise, sleep past ``train.grpo.tool_timeout_s``, or return a dict, None or a number: each call is
  counted (``tools/failure_frequency`` > 0), the model reads the error (or TRL's ``str(result)``), the run goes on.
* The environment's ``reset(**row)`` returns the first observation (how many tools to use), which becomes part of
  the rollout's prompt; the rows ask for 0 to 3 tool turns, so the two ranks' rollouts take different numbers of
  turns and lengths every step, and different numbers of continuation turns (``generate`` calls after the first):
  at step 1 one rank makes none (both its rows ask for no tool) while the other makes two, at steps 2 and 3 one
  makes one and the other three (the test reads each rank's generation calls). The run finishes within its
  timeout: with LoRA (a ``PeftModel`` over the ZeRO-3 module) DeepSpeed's top-level forward pre-hook ran once per
  ``generate`` call and broadcast, so before ``zero3_hooks_off`` removed it (issue 68, item 3) these runs hung.
* Resume between steps is exact: steps 2 and 3 of the resumed run log the same loss, KL, rewards, grad norm and
  tool counts as the uninterrupted run, the same transcripts, and the same continuation turns on each rank.

The model does not choose the turns: this file, run as a script (``launch(script=...)``), is ``finetune/run.py``
with the grpo rollout's ``generate`` running the real model (the same forward passes, inside the gathered weights)
and then answering with scripted turns drawn from the context (:func:`scripted_turn`), so that real tool turns
happen. Everything else (the tool loop, the tools, the environment, LoRA, DeepSpeed, checkpoints) runs as in a
launch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import runpy
import sys
from pathlib import Path

import torch
from grpo_tool_forced import as_generated

REPO = Path(__file__).resolve().parent.parent
TOOLS = '''
import time


def explode(x: str) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise ZeroDivisionError("the tool divided by zero")


def nap(seconds: float) -> str:
    """Sleeps, then says so (past the run's tool_timeout_s).

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def shape(kind: str):
    """Returns something that is not text.

    Args:
        kind: dict, none or number.
    """
    return {"dict": {"kind": kind, "n": 2}, "none": None}.get(kind, 7.5)
'''
ENVIRONMENT = '''
class Panel:
    """A panel of buttons; reset says how many tools the task asks for (the row's ``calls``)."""

    def reset(self, answer, calls, **row):
        self._presses = 0
        return f" Use {int(calls)} tools."

    def press(self, button: int) -> str:
        """Press a button.

        Args:
            button: Which.
        """
        self._presses += 1
        return f"button {button} pressed"

    def get_reward(self) -> float:
        """0.5 per press, at most 1."""
        return min(1.0, 0.5 * self._presses)
'''
CALLS = [0, 3, 1, 2, 1, 0, 0, 1]
"""Each row's tool turns (its ``calls`` column, which the environment's observation states). Seed 42's order gives
the ranks rows 6, 0 | 3, 7 at step 1 (0 | 2 continuation turns), 2, 4 | 1, 5 at step 2 and 4, 7 | 5, 1 at step 3
(1 | 3 each)."""
TOOL_NAMES = ["calculate", "explode", "nap", "shape", "press"]


def _call(name: str, gen: torch.Generator) -> str:
    a, b = (int(x) for x in torch.randint(1, 99, (2,), generator=gen))
    arguments = {"calculate": {"expression": f"{a} + {b}"}, "explode": {"x": "boom"}, "nap": {"seconds": 5},
                 "shape": {"kind": ["dict", "none", "number"][a % 3]}, "press": {"button": b}}[name]
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(arguments))


def scripted_turn(context: list[int], index: int, tokenizer, budget: int) -> list[int]:
    """The turn that continues ``context`` (prompt + completion so far) as rollout ``index`` of its generate call:
    while the results read are fewer than the observation's ``Use K tools``, a call of one of the tools (chosen by
    the results read and the index), else 1-6 random GPT-2 ids; always ending with EOS; at most ``budget`` ids."""
    text = tokenizer.decode(context)
    wanted = int(re.search(r"Use (\d) tools", text).group(1))
    done = text.count("</tool_response>")
    gen = torch.Generator().manual_seed((sum((i + 1) * t for i, t in enumerate(context)) + 7919 * index) % (2 ** 31))
    if done < wanted:
        ids = tokenizer(_call(TOOL_NAMES[(done + index) % len(TOOL_NAMES)], gen), add_special_tokens=False)["input_ids"]
    else:
        ids = torch.randint(100, 5000, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
    return (ids + [tokenizer.eos_token_id])[:budget]


def _scripted_generate(original):
    def generate(engine, batch, g, tokenizer, n, sample, seed, synced):
        # the model's forward passes inside the gathered weights, as many calls as the turns take (a few tokens
        # each: the scripted turns replace them)
        original(engine, batch, dataclasses.replace(g, max_completion_length=4), tokenizer, n, sample, seed, synced)
        rows, read = [], 0
        for j, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"])):
            read = max(read, tokenizer.decode(ids[mask.bool()]).count("</tool_response>"))
            for k in range(n):
                rows.append(scripted_turn(ids[mask.bool()].tolist(), j * n + k, tokenizer, g.max_completion_length))
        # read: the tool results the contexts hold (0: a first turn, else a continuation turn); sample: a training
        # step's rollouts (else the end-of-run evaluation's greedy completions)
        with open(Path(os.environ["AGENT_RUN_LOG"]) / f"generate_rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
            f.write(json.dumps({"rows": len(rows), "read": read, "sample": sample}) + "\n")
        return as_generated(rows, tokenizer)
    return generate


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from finetune.recipes.grpo import rollout

    rollout.generate = _scripted_generate(rollout.generate)
    sys.argv[0] = str(REPO / "finetune/run.py")
    runpy.run_path(str(REPO / "finetune/run.py"), run_name="__main__")


import pyarrow as pa  # noqa: E402  (the tests' imports: the script above needs none of them)
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
from conftest import CONFIGS, cpu_env, launch, ok, read_metrics  # noqa: E402

CONFIG = CONFIGS / "tiny_grpo.yaml"
TEMPLATE = REPO / "data/chat_templates/chatml_tools.jinja"
METRICS = ("train/loss", "train/kl", "train/reward", "train/rewards/Panel/mean", "train/rewards/has_digit/mean",
           "train/tools/call_frequency", "train/tools/failure_frequency", "train/tools/turns_mean",
           "train/completions/mean_length", "train/grad_norm")


def _overrides(tmp: Path) -> list[str]:
    """The runs' overrides, their tools, environment and rows written under ``tmp``."""
    (tmp / "tools.py").write_text(TOOLS)
    (tmp / "panel.py").write_text(ENVIRONMENT)
    data = tmp / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": f"Task {i}."}], "answer": "x",
                                          "calls": k} for i, k in enumerate(CALLS)]), data)
    return [f"data.train_files=[{data}]", f"data.validation_files=[{data}]", "data.prompt_column=prompt",
            "data.reward_columns=[answer,calls]", f"data.chat_template={TEMPLATE}", "data.max_seq_len=640",
            f"data.cache_dir={tmp / 'cache'}", "deepspeed=ds_configs/zero3.json",
            "model.lora.r=4", "train.grpo.beta=0.04",  # LoRA with a KL term (issue 68, item 3)
            "ds.zero_optimization.stage3_param_persistence_threshold=0",
            "model.config_overrides={max_position_embeddings: 1024}",  # the five tools' schemas: a long prompt
            f"train.grpo.tools=[{REPO}/data/tools/calculator.py:calculate,{tmp}/tools.py:explode,{tmp}/tools.py:nap,"
            f"{tmp}/tools.py:shape]", f"train.grpo.environment={tmp}/panel.py:Panel",
            "train.grpo.max_tool_calling_iterations=3", "train.grpo.tool_timeout_s=0.5",
            "train.grpo.max_completion_length=320", "train.grpo.rewards=[tests/grpo_rewards.py:has_digit]",
            "train.grpo.reward_weights=[]", "train.grpo.length_cache=0", "train.grpo.log_completions=16",
            "train.max_steps=3", "train.save_every=1"]


def _continuation_turns(folder: Path) -> dict[int, list[int]]:
    """Each rank's continuation turns per training step of the run in ``folder``: its sampling ``generate`` calls
    after each step's first (a first turn's contexts hold no tool result, a continuation's do)."""
    turns = {}
    for rank in (0, 1):
        steps = []
        for line in (folder / "gen" / f"generate_rank{rank}.jsonl").read_text().splitlines():
            call = json.loads(line)
            if not call["sample"]:  # the evaluation's
                continue
            if call["read"] == 0:
                steps.append(0)
            else:
                steps[-1] += 1
        turns[rank] = steps
    return turns


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 3-step run and the run resumed from its step-1 checkpoint: ``(run, resumed)`` folders, each with the
    ranks' generate logs in ``gen/``."""
    tmp = tmp_path_factory.mktemp("agent_runs")
    overrides = _overrides(tmp)
    folders = []
    for name, resume in (("run", None), ("resumed", tmp / "run" / "checkpoints" / "step1")):
        (tmp / name / "gen").mkdir(parents=True)
        ok(launch(CONFIG, [f"output_dir={tmp / name}", *overrides], resume=str(resume) if resume else None,
                  timeout=300, env=cpu_env(AGENT_RUN_LOG=str(tmp / name / "gen")), script="tests/test_grpo_agent_runs.py"))
        folders.append(tmp / name)
    return folders


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_failing_tools_are_counted_and_ranks_with_different_turns_never_hang(runs):
    run, _ = runs
    rows = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    assert sorted(rows) == [1, 2, 3]  # finished within the launch's timeout: no collective hung
    for r in rows.values():
        assert r["train/tools/call_frequency"] > 0 and r["train/tools/failure_frequency"] > 0, r
        assert r["train/tools/failure_frequency"] < 1, r  # the calculator, shape and press succeed
        # per tool: every offered tool's calls per completion, (unknown) for calls naming none; they add up
        per_tool = {k.split("/")[2]: v for k, v in r.items() if k.startswith("train/tools/") and k.count("/") == 3}
        assert set(per_tool) == {"calculate", "explode", "nap", "shape", "press", "(unknown)"}, r
        assert sum(per_tool.values()) == pytest.approx(r["train/tools/call_frequency"], rel=1e-6), r
    # each rank's generate calls: its rollouts' turns differ from the other rank's (different rows ask for 0-3)
    calls = {rank: [json.loads(x)["rows"] for x in (run / "gen" / f"generate_rank{rank}.jsonl").read_text().splitlines()]
             for rank in (0, 1)}
    assert calls[0] != calls[1], calls
    # and so do the numbers of generate calls: every step, the ranks make different numbers of continuation turns,
    # and at some step one rank makes none while the other makes some (issue 68, item 3: with LoRA at ZeRO-3 the
    # broadcasts of DeepSpeed's top-level pre-hook followed the calls, and such a step hung)
    turns = _continuation_turns(run)
    assert len(turns[0]) == len(turns[1]) == 3, turns
    assert all(a != b for a, b in zip(turns[0], turns[1])), turns
    assert any(min(a, b) == 0 < max(a, b) for a, b in zip(turns[0], turns[1])), turns
    assert "train/kl" in rows[1] and any(r["train/kl"] > 0 for r in rows.values()), rows  # LoRA, beta > 0
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    results = [t["content"] for r in logged for t in r["turns"] if t["role"] == "tool"]
    names = {t["name"] for r in logged for t in r["turns"] if t["role"] == "tool"}
    assert {"calculate", "explode", "nap", "shape", "press"} <= names, names
    assert '{"error": "ZeroDivisionError: the tool divided by zero"}' in results
    assert '{"error": "the tool \'nap\' did not return within 0.5 s"}' in results
    assert {"{'kind': 'dict', 'n': 2}", "None", "7.5"} & set(results), results  # TRL's str(result)
    assert any(re.fullmatch(r"button \d+ pressed", x) for x in results)
    # the environment's observation is the prompt's: each logged prompt ends with it
    assert all(re.search(r"Task \d\. Use [0-3] tools\.$", r["prompt"][-1]["content"]) for r in logged), logged[0]
    turns = {len([t for t in r["turns"] if t["role"] == "tool"]) for r in logged}
    assert len(turns) > 1, turns  # rollouts of 0 to 3 tool turns
    # the end-of-run evaluation's greedy answers take their tool turns too, and their calls are counted: calls per
    # answer, and the share of answers with a call (one batch of rows asking for 0-3 tools)
    final = [r for r in read_metrics(run) if "eval/reward" in r][-1]
    assert 0 < final["eval/tools/any_call_rate"] < 1, final
    assert final["eval/tools/call_frequency"] > final["eval/tools/any_call_rate"], final


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_a_resume_between_steps_with_tools_and_an_environment_is_exact(runs):
    run, resumed = runs
    first = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    again = {r["step"]: r for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(again) == [2, 3]
    for step in (2, 3):
        for key in METRICS:
            assert again[step][key] == pytest.approx(first[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert any(first[s]["train/loss"] != 0 for s in (2, 3))  # the comparison is not of zeros
    logged = (run / "completions.jsonl").read_text().splitlines()
    assert (resumed / "completions.jsonl").read_text().splitlines() == logged[len(logged) // 3:]
    again_turns = _continuation_turns(resumed)
    assert again_turns == {rank: t[1:] for rank, t in _continuation_turns(run).items()}, again_turns
