"""The real-model tier (``pytest -m real``; issue 69): runs on the real pretrained SmolLM2-135M-Instruct, from its GGUF
file (``../shared/models/`` or where ``scripts/get_smollm2.sh`` put it). Minutes each, so neither in the suite nor in
the extended checks: run them before a change to a recipe, the GGUF path or the README's main command lands
(docs/development.md).

* The README's main command, from a fresh clone: fetch the model, convert it, GRPO with LoRA on two-digit additions;
  the held-out greedy accuracy rises by 15 points or more, the log prints it before and after with three held-out
  answers, and the merged export passes its check against the engine's logits.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time

import pytest

from conftest import REPO, cpu_env, read_metrics, smollm2_gguf
from test_readme import readme_block

pytestmark = [pytest.mark.real, pytest.mark.skipif(not smollm2_gguf().is_file(),
                                                   reason="the SmolLM2 GGUF file is not here (scripts/get_smollm2.sh)")]


def test_readme_main_command_fine_tunes_the_real_model(tmp_path):
    """The README's main command after its install steps (this venv stands in for the one it creates), in a fresh
    clone of the committed tree with a cold conversion cache: ``get_smollm2.sh`` places the GGUF, the launch converts it
    and trains; held-out accuracy +15 points or more, printed with three answers before and after, in under 10
    minutes (the README's promise, install excluded here)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    steps = [s.strip() for s in readme_block("<!-- main-command -->").split("&&")]
    fetch = next(s for s in steps if "get_smollm2.sh" in s)
    train = shlex.split(steps[-1])
    env_assignments = dict(a.split("=", 1) for a in train if re.match(r"^[A-Z_]+=", a))
    argv = [a for a in train if a not in {f"{k}={v}" for k, v in env_assignments.items()}]
    assert argv[0] == "deepspeed"
    env = cpu_env(**env_assignments, FINETUNE_CACHE=str(tmp_path / "cache"), SMOLLM2_SHARED_DIR=str(smollm2_gguf().parent))
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env['PATH']}" if (REPO / ".venv").exists() else env["PATH"]
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", fetch], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    proc = subprocess.run(argv, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "converted by transformers into" in proc.stdout  # a cold cache: the conversion is part of the command
    run = next((clone / "runs" / "grpo_smollm2_arithmetic").iterdir())
    evals = [r for r in read_metrics(run) if "eval/reward" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 10, evals
    before, after = evals[0]["eval/reward"], evals[-1]["eval/reward"]
    assert after - before >= 0.15, (before, after)
    assert f"eval/reward {before:.4g} (step 0) -> {after:.4g} (step 10)" in proc.stdout
    assert proc.stdout.count("held-out answer to 'What is ") == 3, proc.stdout[-3000:]
    assert (run / "export" / "model.safetensors").is_file() and (run / "export_check.json").is_file()
    assert took < 600, f"{took:.0f} s"
    print(f"README main command: {took:.0f} s, held-out accuracy {before:.3f} -> {after:.3f}", file=sys.stderr)
