"""The benchmark itself (``scripts/bench.py``) on a few steps: it runs, prints every contender, ratios are finite.

One smoke run of the packed ``gpt_clm`` preset (its contenders: the toolkit, the bare engine loop on the toolkit's
batches, and Hugging Face Trainer + DeepSpeed with ``group_texts``), tiny model, 1 CPU rank, 3 steps, 1 round. No
timed assertions: the numbers are only checked to be there, finite and consistent with each other. And one smoke run
of the ``dpo_realistic`` preset against TRL's ``DPOTrainer`` at its defaults and at its best (``trl`` is in the
``test`` extra for it) and one of ``scripts/bench_startup.py``: extended (about a minute each), like the ``gpt_clm``
smoke run (suite budget). The ``reward`` preset against TRL's ``RewardTrainer`` at its best runs in the default suite
(no warm-up launch: about 40 s).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from conftest import REPO, leftover_shm, run_python, shm_buffers

pytestmark = pytest.mark.slow


def test_bench_rewards_score_as_the_builtins_on_text_and_on_trls_messages():
    """``scripts/bench_rewards.py``, which both sides of the grpo presets load, scores as the grpo recipe's built-ins
    with the shipped configs' patterns (``####`` and the last integer), on the toolkit's text completions and on
    TRL's conversational ones (one assistant message each)."""
    from finetune.config import load_run_config
    from finetune.recipes.common import rewards

    spec = importlib.util.spec_from_file_location("bench_rewards", REPO / "scripts" / "bench_rewards.py")
    bench_rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_rewards)
    completions = ["59 + 63 equals 122.", "It is 12, not 122 or 13", "no number", "-5", "so #### 1,234", "#### 7 then 8"]
    answer = ["122", "122", "3", "-5", "#### 1234", "#### 7"]
    messages = [[{"role": "assistant", "content": c}] for c in completions]
    for ours, pattern in ((bench_rewards.last_integer_match, bench_rewards.LAST_INTEGER),
                          (bench_rewards.exact_match, bench_rewards.ANSWER_PATTERN)):
        want = rewards.exact_match(prompts=[""] * 6, completions=completions, completion_ids=None, pattern=pattern,
                                   reference_column="answer", answer=answer)
        assert ours([""] * 6, completions, answer) == want
        assert ours([""] * 6, messages, answer) == want
    assert bench_rewards.last_integer_match([""] * 6, messages, answer)[:4] == [1.0, 0.0, 0.0, 1.0]
    assert bench_rewards.format_reward([""] * 6, messages) == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    shipped = load_run_config(REPO / "finetune" / "recipes" / "configs" / "grpo_smollm2_arithmetic.yaml")
    assert shipped.train.grpo.answer_pattern == bench_rewards.LAST_INTEGER


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_benchmark_prints_every_contender_with_finite_ratios(tmp_path):
    shm_before = shm_buffers()
    proc = run_python(["scripts/bench.py", "--preset", "gpt_clm", "--steps", "3", "--skip", "1", "--rounds", "1",
                       "--nproc", "1", "--tiny", "--no-warm-up", "--keep", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
    assert [r["contender"] for r in rows] == ["finetune", "bare", "hf"], proc.stdout[-3000:]
    table = proc.stdout[proc.stdout.index("gpt_clm:\ncontender"):]
    for r in rows:
        assert r["bench"] == "gpt_clm" and r["rounds"] == 1 and r["timed_steps"] == 2
        assert f"\n{r['contender']} " in table
        for key in ("real_tokens_per_s", "positions_per_s", "step_time_median_s", "time_to_first_step_s",
                    "peak_rss_per_rank_mb", "final_loss", "ratio_ours_over_this"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["contender"], key, r[key])
        # packed blocks: every position is a real token; 2 timed steps x 4 rows x 64 tokens in the step times
        assert r["positions_per_s"] == pytest.approx(r["real_tokens_per_s"], rel=1e-9)
        assert r["step_time_median_s"] < r["time_to_first_step_s"]
    ours, bare, hf = rows
    assert ours["ratio_ours_over_this"] == 1.0
    for other in (bare, hf):
        assert other["ratio_ours_over_this"] == pytest.approx(ours["real_tokens_per_s"] / other["real_tokens_per_s"])
        # one round: the round-by-round ratio is that round's, the pooled one
        assert other["ratio_ours_over_this_median_of_rounds"] == pytest.approx(other["ratio_ours_over_this"])
    assert abs(ours["final_loss"] - hf["final_loss"]) < 0.5, "same model, data and steps: close losses"
    # the bare loop trains the toolkit's own batches, model and loss: the same losses, to float rounding
    assert bare["final_loss"] == pytest.approx(ours["final_loss"], rel=1e-5)
    assert "gpt_clm: loop overhead of finetune over the bare engine loop on its own batches: " in proc.stdout
    assert not leftover_shm(shm_before), "a launch left /dev/shm buffers"


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_dpo_benchmark_against_trl(tmp_path):
    """The ``dpo_realistic`` preset (its tiny model, the 8,192-token BPE): the toolkit against TRL's ``DPOTrainer``
    (``scripts/bench_trl.py``) with its defaults and at its best (precomputed reference), 1 rank, 3 steps.

    All start from a policy equal to its reference, so the first losses are log 2 on every side, and from the same
    weights, so finetune's cached reference log-probabilities equal TRL's reference model's (1e-5 relative). The
    end-to-end figures (launch to last step, reference passes included) are there and below the timed steps'."""
    shm_before = shm_buffers()
    proc = run_python(["scripts/bench.py", "--preset", "dpo_realistic", "--steps", "3", "--skip", "1", "--rounds",
                       "1", "--nproc", "1", "--tiny", "--no-warm-up", "--keep", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
    assert [r["contender"] for r in rows] == ["finetune", "trl", "trl_best"], proc.stdout[-3000:]
    ours, trl, best = rows
    for r in rows:
        for key in ("real_tokens_per_s", "rows_per_s", "step_time_median_s", "peak_rss_per_rank_mb", "final_loss",
                    "e2e_real_tokens_per_s", "e2e_seconds_per_launch", "e2e_ratio_ours_over_this"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["contender"], key, r[key])
        assert 0.0 <= r["final_reward_accuracy"] <= 1.0
        assert r["e2e_real_tokens_per_s"] < r["real_tokens_per_s"]  # start-up and reference pass included
        assert abs(r["final_loss"] - math.log(2)) < 0.05
    for other in (trl, best):
        assert other["ratio_ours_over_this"] == pytest.approx(ours["real_tokens_per_s"] / other["real_tokens_per_s"])
        assert other["e2e_ratio_ours_over_this"] == pytest.approx(ours["e2e_real_tokens_per_s"]
                                                                  / other["e2e_real_tokens_per_s"])
    assert "dpo_realistic: LM-head share of the matmul FLOPs per position " in proc.stdout
    # trl_best precomputes its reference before training (trl runs its reference model on every batch instead)
    assert "Computing reference log probs for train dataset" in (tmp_path / "dpo_realistic-trl_best-0.log").read_text()
    assert "Computing reference log probs" not in (tmp_path / "dpo_realistic-trl-0.log").read_text()
    # the same initial weights on both sides: finetune's cached reference = TRL's reference model's, pair by pair
    line = next(x for x in proc.stdout.splitlines() if x.startswith("dpo: reference log-probabilities of the first"))
    assert float(line.split("max relative difference ")[1].split(";")[0]) < 1e-5, line
    assert not leftover_shm(shm_before), "a launch left /dev/shm buffers"


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_startup_benchmark_times_cold_warm_and_prepare_against_hf(tmp_path):
    """``scripts/bench_startup.py`` on a 1 MB corpus, 1 rank, 2 steps, no warm-up launch (the suite's launches
    built DeepSpeed's CPU ops already): every contender's time to its first step;
    finetune's second launch and the launch after ``finetune prepare`` hit the cache (no data phase of their own);
    the anonymous peak is at most the resident peak; the ratio lines are printed; no /dev/shm buffer is left."""
    shm_before = shm_buffers()
    proc = run_python(["scripts/bench_startup.py", "--corpus-mb", "1", "--nproc", "1", "--steps", "2",
                       "--no-warm-up", "--keep", str(tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = {r["contender"]: r for r in (json.loads(line) for line in proc.stdout.splitlines()
                                        if line.startswith('{"bench": "startup"'))}
    assert list(rows) == ["finetune cold", "finetune warm", "prepare + launch", "hf cold", "hf warm"], proc.stdout[-3000:]
    for name, r in rows.items():
        assert math.isfinite(r["first_step_s"]) and r["first_step_s"] > 0 and r["peak_mb"] > 0, (name, r)
    cold, warm, prepared = rows["finetune cold"], rows["finetune warm"], rows["prepare + launch"]
    assert cold["data_s"] > 0 and warm["data_s"] is None and prepared["data_s"] is None
    assert "cache hit" in (tmp_path / "ft-warm" / "logs" / "rank0.log").read_text()
    assert "cache hit" in (tmp_path / "ft-prepared" / "logs" / "rank0.log").read_text()
    assert cold["startup"].startswith("start-up ") and " data " in cold["startup"]
    for r in (cold, warm):
        assert 0 < r["peak_anon_mb"] <= r["peak_mb"]
    assert 0 < prepared["prepare_s"] < prepared["first_step_s"]
    assert 0 < prepared["prepare_peak_anon_mb"] <= prepared["prepare_peak_mb"]
    assert rows["hf cold"]["data_s"] > 0
    assert "time to first step, hf cold / finetune cold: " in proc.stdout
    assert not leftover_shm(shm_before), "a launch left /dev/shm buffers"


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_reward_benchmark_against_trl_best(tmp_path):
    """The ``reward_prompt_only`` preset (the ``reward`` preset on pairs that share only their prompt): the toolkit's
    reward recipe, with prefix sharing and without (a ``finetune[key=value]`` contender), against TRL's
    ``RewardTrainer`` at its best (no checkpointing, length-grouped batches; ``scripts/bench_trl.py``), tiny, 1 rank,
    3 steps, no warm-up launch: every figure there and finite, the held-out accuracy of the test pairs in [0, 1] on
    both sides, losses near log 2 (the scores of a random score head are close), the shared share of the pairs'
    tokens reported (the prompts: some, not most), the LM-head share printed (0%: a one-output score head)."""
    shm_before = shm_buffers()
    separate = "finetune[train.reward.share_prefix=false]"
    proc = run_python(["scripts/bench.py", "--preset", "reward_prompt_only", "--steps", "3", "--skip", "1",
                       "--rounds", "1", "--nproc", "1", "--tiny", "--no-warm-up", "--contenders",
                       f"finetune,trl_best,{separate}", "--keep", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
    assert [r["contender"] for r in rows] == ["finetune", "trl_best", separate], proc.stdout[-3000:]
    ours, best, apart = rows
    assert 0.05 < ours["shared_tokens"] < 0.5 and apart["shared_tokens"] == 0 and best["shared_tokens"] is None
    rows = rows[:2]
    for r in rows:
        for key in ("real_tokens_per_s", "rows_per_s", "step_time_median_s", "peak_rss_per_rank_mb", "final_loss",
                    "e2e_real_tokens_per_s", "e2e_ratio_ours_over_this"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["contender"], key, r[key])
        assert 0.0 <= r["heldout_accuracy"] <= 1.0 and 0.0 <= r["final_reward_accuracy"] <= 1.0
        assert abs(r["final_loss"] - math.log(2)) < 0.1
    # pairs/s: 3 - 1 timed steps of 2 pairs over their wall time, the same definition on both sides
    assert best["rows_per_s"] == pytest.approx(2 / best["step_time_median_s"], rel=0.5)
    assert best["ratio_ours_over_this"] == pytest.approx(ours["real_tokens_per_s"] / best["real_tokens_per_s"])
    assert "reward_prompt_only: LM-head share of the matmul FLOPs per position 0.0% (no LM head" in proc.stdout
    assert "reward_prompt_only:\ncontender" in proc.stdout and "held-out acc" in proc.stdout
    assert not leftover_shm(shm_before), "a launch left /dev/shm buffers"


def _against_trl_best(preset: str, steps: int, tmp_path) -> tuple:
    """A tiny smoke run of ``preset``, finetune against ``trl_best``, 1 rank, ``steps`` steps (the first untimed), no
    warm-up launch: the process and its two JSON result rows (finetune's first)."""
    proc = run_python(["scripts/bench.py", "--preset", preset, "--steps", str(steps), "--skip", "1", "--rounds", "1",
                       "--nproc", "1", "--tiny", "--no-warm-up", "--contenders", "finetune,trl_best",
                       "--keep", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench"')]
    assert [r["contender"] for r in rows] == ["finetune", "trl_best"], proc.stdout[-3000:]
    return proc, rows


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_grpo_tools_benchmark_against_trl_best(tmp_path):
    """The ``grpo_tools`` preset (multi-turn GRPO on the guess-the-number environment) against TRL's
    ``GRPOTrainer(environment_factory=...)`` at its best, tiny, 1 rank, 2 steps, no warm-up launch: completions/s,
    peak memory, the mean reward and ``tools/call_frequency`` on both sides (a random model calls no tool: 0), the
    environment's reward in [0, 1], and the ratio line."""
    proc, rows = _against_trl_best("grpo_tools", 2, tmp_path)
    for r in rows:
        for key in ("completions_per_s", "real_tokens_per_s", "peak_rss_per_rank_mb", "step_time_median_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["contender"], key, r[key])
        assert 0.0 <= r["mean_reward"] <= 1.0 and r["tool_call_frequency"] is not None
        assert r["completions_per_s"] == pytest.approx(8 / r["step_time_median_s"], rel=1e-6)  # 2 prompts x 4
    assert "grpo_tools: completions/s" in proc.stdout and "tools/call_frequency" in proc.stdout
    # the grpo summary's trl_best line (the wide table's row may hold the same ratio text)
    lines = [x for x in proc.stdout.splitlines() if x.strip().startswith("trl_best")
             and "finetune/trl_best: completions/s " in x and "tool calls/rollout" in x]
    assert len(lines) == 1, proc.stdout[-3000:]


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_vlm_sft_benchmark_against_trl_best(tmp_path):
    """The ``vlm_sft`` preset (the tiny SmolVLM on the digits) against TRL's ``SFTTrainer`` at its best, tiny, 1 rank,
    3 steps, no warm-up launch: samples/s, tokens/s, peak memory and a finite loss on both sides, and the ratio."""
    _, rows = _against_trl_best("vlm_sft", 3, tmp_path)
    for r in rows:
        for key in ("rows_per_s", "real_tokens_per_s", "peak_rss_per_rank_mb", "final_loss"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["contender"], key, r[key])
    assert rows[1]["ratio_ours_over_this"] > 0
