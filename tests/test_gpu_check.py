"""``scripts/gpu_check.sh --cpu-dry-run``: the GPU proof's every section on CPU ranks with tiny shapes, so that the
script cannot rot between the runs that have a GPU (docs/gpu-check.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("selftest", "precision", "throughput", "longest", "generation", "hybrid")


def _script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_refusals_come_before_any_work(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("a user's file")
    done = _script("--cpu-dry-run", str(used))
    assert done.returncode == 2 and "exists and is not empty; it is never overwritten" in done.stderr
    assert sorted(p.name for p in used.iterdir()) == ["mine.txt"]
    done = _script("--gpu-please")
    assert done.returncode == 2 and "unknown option '--gpu-please'" in done.stderr


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_cpu_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "out"
    done = _script("--cpu-dry-run", str(out), timeout=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["figures.jsonl", "log.txt", "selftest.json", "selftest_hybrid.json", "summary.md"]  # at most 8
    rows = [json.loads(line) for line in (out / "figures.jsonl").read_text().splitlines()]
    by = {s: {r["name"]: r for r in rows if r["section"] == s} for s in SECTIONS}
    assert all(by[s] for s in SECTIONS) and not any(r["name"] == "section_failed" for r in rows)
    assert all(r["dry_run"] and r["met"] is None and r["card"] == "cpu" for r in rows)  # no target judged on CPUs
    assert by["selftest"]["sdpa_packing"]["value"] == "pass" and by["hybrid"]["hybrid_rollout"]["value"] == "skip"
    assert by["precision"]["sft_grad_norm_rel_diff"]["value"] < 5e-2
    assert by["throughput"]["finetune_tokens_per_s"]["value"] > 0  # (HF Trainer's launch: the longest section's)
    assert by["longest"]["hf_trainer_longest"]["value"] == 64 and by["longest"]["finetune_longest"]["value"] == 256
    assert by["generation"]["greedy_completions_identical"]["value"] == 1.0  # fast on and off: the same tokens
    assert by["generation"]["completions_per_s_fast_on"]["value"] > 0
    summary = (out / "summary.md").read_text()
    assert "CPU dry run" in summary and summary.count("\n| ") == len(rows) + 2  # header, rule, a line per figure
    assert (out / "log.txt").read_text().count("=== gpu_check: ") == 2 * len(SECTIONS)


def test_a_relative_out_dir_is_the_callers(tmp_path):
    """Issue 68, item 15: ``scripts/gpu_check.sh --cpu-dry-run myout`` run from another folder wrote ``<repo>/myout``
    (the script works from the repository root); a relative OUT_DIR is the caller's. The sections run with a Python
    that fails at once (``PYTHON=false``): only where the files go is checked here."""
    name = f"gpu_check_relative_{os.getpid()}"
    env = {**os.environ, "PYTHON": "false"}
    try:
        done = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--cpu-dry-run", name], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # every section failed: exit 1
        assert (tmp_path / name / "log.txt").is_file() and not (REPO / name).exists()
        (tmp_path / "used").mkdir()
        (tmp_path / "used" / "mine.txt").write_text("a user's file")
        done = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--cpu-dry-run", "used"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and f"'{tmp_path / 'used'}' exists and is not empty" in done.stderr, done.stderr
    finally:
        if (REPO / name).is_dir():  # the defect's leftover
            for p in (REPO / name).iterdir():
                p.unlink()
            (REPO / name).rmdir()
