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


def test_env_redacts_credentials_in_urls_and_secret_names(capsys, monkeypatch):
    """Issue 51 item 11: credentials inside URLs are redacted whatever the variable's name (the Hub mirror, W&B's
    server, the proxies), and names the old filter missed (``*_PASS``, ``*_PWD``, ``*_PSK``) are left out; names that
    say nothing of a secret are printed as they are."""
    secrets = {"HF_ENDPOINT": "https://alice:hf_tok3n@mirror.corp:8443/hub",
               "WANDB_BASE_URL": "https://wandbkey9@wandb.corp",
               "HTTPS_PROXY": "http://bob:pr0xy@proxy.corp:3128",
               "http_proxy": "carol:s3cret@proxy.corp:3128",
               "HF_HUB_DOWNLOAD_URL": "https://cdn.corp/x?sig=s1gnature&region=eu",
               "NCCL_SOCKET_PASS": "p4ss", "SLURM_DB_PWD": "pwd123", "NCCL_IB_PSK": "psk456",
               "HF_API_TOKEN_FILE": "/run/t0ken", "WANDB_CREDENTIALS": "cr3d"}
    plain = {"MASTER_ADDR": "node-1.corp", "NO_PROXY": "localhost,127.0.0.1,.corp", "HF_HOME": "/scratch/hf",
             "NCCL_BYPASS_CHECK": "1", "LD_PRELOAD": "/usr/lib/libjemalloc.so"}
    for name, value in {**secrets, **plain}.items():
        monkeypatch.setenv(name, value)
    assert env.main(["--json"]) == 0
    printed = capsys.readouterr().out
    shown = json.loads(printed)["environment"]
    for leak in ("hf_tok3n", "alice", "wandbkey9", "bob", "pr0xy", "carol", "s3cret", "s1gnature", "p4ss", "pwd123",
                 "psk456", "t0ken", "cr3d"):
        assert leak not in printed, leak
    assert shown["HF_ENDPOINT"] == "https://***@mirror.corp:8443/hub"
    assert shown["WANDB_BASE_URL"] == "https://***@wandb.corp"
    assert shown["HTTPS_PROXY"] == "http://***@proxy.corp:3128" and shown["http_proxy"] == "***@proxy.corp:3128"
    assert shown["HF_HUB_DOWNLOAD_URL"] == "https://cdn.corp/x?sig=***&region=eu"
    assert not {"NCCL_SOCKET_PASS", "SLURM_DB_PWD", "NCCL_IB_PSK", "HF_API_TOKEN_FILE", "WANDB_CREDENTIALS"} & set(shown)
    assert {k: shown[k] for k in plain} == plain, "names and values without a secret are printed untouched"
    assert env.main([]) == 0  # the Markdown lines take the same values
    lines = capsys.readouterr().out
    assert "  - HF_ENDPOINT: https://***@mirror.corp:8443/hub" in lines and "hf_tok3n" not in lines
