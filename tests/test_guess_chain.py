"""The shipped guess-number chain (``finetune/recipes/configs/sft_guess_number.yaml``, then
``grpo_guess_number.yaml`` from its export): SFT on expert trajectories of ``data/environments/guess_number.py``
rendered with the tool schemas, then multi-turn GRPO against the environment.

* :func:`test_sft_rows_render_grpo_prompts` (default suite, no launch): each SFT conversation, rendered with its
  ``data.tools_column`` schemas, begins with exactly the token ids of the prompt that ``grpo`` builds for the same
  game (the environment's schemas, ``apply_chat_template(tools=...)``), and its first trained tokens are the
  assistant's ``guess`` tool call; without the tools column it does not (the gap the column closes).
* :func:`test_bad_tools_row_is_one_line` (default suite): a tools row that is not JSON is refused before any model,
  one line naming the file, the row and the column.
* :func:`test_shipped_chain_improves_held_out_success` (extended): the chain itself, both shipped configs as they
  are except the SFT run's output folder and the GRPO run's start (that folder's export); it asserts that the SFT
  export wins some held-out games but not all (room for GRPO), that the GRPO rollouts call the tool, and that
  GRPO's greedy held-out success (the 100 games of ``data/guess_number/test.parquet``, a game won when its
  ``GuessNumber`` reward is above 0 in ``<run>/eval/step<N>_completions.jsonl``) is above the SFT export's by at
  least ``MARGIN`` games. docs/performance.md has the measured figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO, check_files, launch, ok, read_metrics, write_parquet

SFT = REPO / "finetune" / "recipes" / "configs" / "sft_guess_number.yaml"
GRPO = REPO / "finetune" / "recipes" / "configs" / "grpo_guess_number.yaml"
MARGIN = 5
"""Games of the 100 held-out ones that GRPO must win beyond the SFT export (the measured gain is larger:
docs/performance.md)."""


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_sft_rows_render_grpo_prompts():
    from finetune.config import load_run_config
    from finetune.recipes import sft
    from finetune.recipes.grpo import prompts as grpo_prompts
    from finetune.recipes.grpo.agent import agent_of

    s = load_run_config(SFT)
    g = load_run_config(GRPO, [f"model.tokenizer_path={s.model.tokenizer_path}"])  # the export has the SFT one
    tok = sft.prepare_tokenizer(sft.AutoTokenizer.from_pretrained(s.model.tokenizer_path))
    assert s.data.chat_template == g.data.chat_template and s.data.tools_column
    template = sft.template_text(s.data)
    rows = pq.read_table(s.data.train_files[0]).to_pylist()[:8]
    games = pq.read_table(g.data.train_files[0]).to_pylist()[:8]
    schemas = agent_of(g).schemas
    prompts = grpo_prompts.tokenize_function(tok, g.data, tools=schemas)
    for row, game in zip(rows, games):
        assert row["messages"][0]["content"] == game["prompt"][0]["content"]  # the same game
        assert sft.row_tools(row[s.data.tools_column]) == schemas
        prompt = prompts.encode(game["prompt"])
        ids, labels = sft.encode_messages(tok, row["messages"], template, sft.row_tools(row[s.data.tools_column]))
        assert ids[:len(prompt)] == prompt, "the SFT row does not begin with the prompt grpo shows the model"
        assert all(x == -100 for x in labels[:len(prompt)]) and labels[len(prompt)] != -100
        first = tok.decode([t for t, x in zip(ids, labels) if x != -100][:40])
        assert first.startswith('<tool_call>\n{"name": "guess", "arguments": {"number":')
        bare, _ = sft.encode_messages(tok, row["messages"], template)
        assert bare[:len(prompt)] != prompt  # without the column: no tools in the system turn
    # and through the recipe's own map function (what training tokenizes)
    out = sft.tokenize_function(tok, s.data)({c: [r[c] for r in rows[:1]] for c in sft.columns(s.data)})
    prompt = prompts.encode(games[0]["prompt"])
    assert out["input_ids"][0][:len(prompt)] == prompt


def test_bad_tools_row_is_one_line(tmp_path, capsys):
    rows = pq.read_table(REPO / "data" / "guess_number" / "train_chat.parquet").slice(0, 4).to_pydict()
    rows["tools"][2] = "[{not json"
    bad = write_parquet(tmp_path / "bad.parquet", rows)
    assert check_files(SFT, tmp_path, [bad]) == 2
    out = capsys.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if "data.train_files" in x and "column 'tools'" in x]
    assert len(lines) == 1, out.out + out.err
    assert "bad.parquet' row 2 of column 'tools' is not JSON" in lines[0] and "data.tools_column" in lines[0]


def held_out(run: Path) -> dict[int, tuple[int, int]]:
    """Evaluation step -> (games won, games played) from ``<run>/eval/step<N>_completions.jsonl``."""
    out = {}
    for f in (run / "eval").glob("step*_completions.jsonl"):
        records = [json.loads(x) for x in f.read_text().splitlines()]
        out[int(f.name[4:].split("_")[0])] = (sum((r["rewards"]["GuessNumber"] or 0) > 0 for r in records),
                                              len(records))
    return out


@pytest.mark.extended  # two launches, several minutes on 2 CPU cores
def test_shipped_chain_improves_held_out_success(tmp_path):
    sft_run, grpo_run = tmp_path / "sft", tmp_path / "grpo"
    ok(launch(SFT, [f"output_dir={sft_run}"], timeout=900))
    assert (sft_run / "export" / "config.json").is_file()
    ok(launch(GRPO, [f"output_dir={grpo_run}", f"model.path={sft_run / 'export'}"], timeout=900))
    steps = held_out(grpo_run)
    last = max(steps)
    (before, n), (after, m) = steps[0], steps[last]
    assert n == m == 100, steps
    assert 0 < before < n, f"the SFT export wins {before}/{n} held-out games: no room to improve, or no start"
    calls = [r["train/tools/call_frequency"] for r in read_metrics(grpo_run) if "train/tools/call_frequency" in r]
    assert calls and min(calls) > 1, calls  # every logged step's rollouts play the game through the tool
    assert after >= before + MARGIN, f"held-out games won: {before} after SFT, {after} after GRPO (step {last})"
