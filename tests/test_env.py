"""``finetune env``: the bug-report lines and their JSON form, in-process (no launch, no process group, no DeepSpeed
engine), and stdout holding nothing but the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from conftest import REPO, cpu_env
from finetune.commands import env


def test_env_lines_and_json(capsys, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "SLURM_JOB_ID": "4242", "NCCL_DEBUG": "INFO",
                        "DS_ACCELERATOR": "cpu", "HF_TOKEN": "hf_secret", "WANDB_API_KEY": "secret",
                        "UNRELATED_SETTING": "x"}.items():
        monkeypatch.setenv(name, value)
    start = time.perf_counter()
    assert env.main([]) == 0
    seconds = time.perf_counter() - start
    text = capsys.readouterr().out
    assert seconds < 5, f"finetune env took {seconds:.1f} s"
    lines = text.splitlines()
    top = dict(line[2:].split(": ", 1) for line in lines if line.startswith("- ") and ": " in line)
    assert top["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert top["torch"] == torch.__version__ and top["deepspeed"] != "not installed"
    for name in ("platform", "finetune", "transformers", "peft", "datasets", "huggingface_hub", "accelerate", "trl",
                 "cuda_available", "cpu_cores", "deepspeed_accelerator"):
        assert name in top, name
    assert top["deepspeed_accelerator"] == "cpu" and top["cuda_available"] == str(torch.cuda.is_available())
    assert top["cpu_cores"].split()[0] == str(os.cpu_count())
    set_vars = {line.strip()[2:] for line in lines if line.startswith("  - ")}
    assert {"RANK: 0", "WORLD_SIZE: 2", "SLURM_JOB_ID: 4242", "NCCL_DEBUG: INFO", "DS_ACCELERATOR: cpu"} <= set_vars
    assert "secret" not in text and "UNRELATED_SETTING" not in text, "secrets and foreign variables stay out"

    assert env.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert list(info) == list(top) + ["environment"], "the same keys in the same order as the lines"
    assert {k: str(v) for k, v in info.items() if k != "environment"} == top
    assert info["cuda_available"] is torch.cuda.is_available() and info["environment"]["SLURM_JOB_ID"] == "4242"
    assert "HF_TOKEN" not in info["environment"] and "WANDB_API_KEY" not in info["environment"]
    assert not torch.distributed.is_initialized(), "finetune env only asks"


def test_env_json_stdout_is_only_json():
    """DeepSpeed logs its accelerator choice to stdout when it has to guess (no ``DS_ACCELERATOR``, no GPU): that line
    goes to stderr, so ``finetune env --json | jq`` reads one JSON object."""
    environ = {k: v for k, v in cpu_env().items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "finetune", "env", "--json"], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["deepspeed_accelerator"] == ("cuda" if torch.cuda.is_available() else "cpu")
