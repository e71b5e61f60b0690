"""``finetune selftest``: the CPU subset on 2 CPU ranks under DeepSpeed's launcher (rows, skips with reasons, JSON into
a folder that did not exist, the sequence-parallel row at ZeRO-3 and the expert-parallel row (DeepSpeed AutoEP)
against one device), and the checks' power to fail: a head loss off by 0.1% and a check that raises are ``FAIL``
rows; bad arguments (an unknown check, an existing or unwritable ``--json``) are one line and exit 2 before any check
runs."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import torch

from conftest import REPO, cpu_env, free_port
from finetune.preflight import selftest


def test_selftest_cpu_subset_on_two_ranks(tmp_path):
    out = tmp_path / "not_yet" / "selftest.json"  # its folder is created
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "--module", "finetune", "selftest", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == list(selftest.CHECKS)
    for name in ("collectives", "chunked_head", "bf16_forward", "sdpa_packing", "zero2_step", "zero3_step",
                 "sequence_parallel", "expert_parallel", "pipeline"):
        assert rows[name]["status"] == "pass", rows[name]
        assert rows[name]["measured"] <= rows[name]["tolerance"]
    assert "gloo, 2 rank(s)" in rows["collectives"]["detail"]
    assert rows["bf16_forward"]["measured"] > 1e-4  # bf16 really ran: its error is visible, and bounded
    for name, why in (("liger_fused_ce", "needs a CUDA GPU"), ("flash_attention", "needs a CUDA GPU"),
                      ("flash_packing", "needs a CUDA GPU"), ("hybrid_rollout", "needs a CUDA GPU"),
                      ("fp16_step", "DeepSpeed's CPU accelerator has no fp16")):
        assert rows[name]["status"] == "skip" and why in rows[name]["detail"], rows[name]
    # Ulysses over both ranks at ZeRO-3 against one device: loss and grad norm (the latter was half the reference
    # without finetune.parallel.sequence.fix_zero3_average)
    sp = rows["sequence_parallel"]
    assert "sequence-parallel 2, ZeRO-3" in sp["detail"] and "grad norm" in sp["detail"], sp
    assert sp["tolerance"] <= 1e-4
    # DeepSpeed AutoEP over both ranks (2 experts each) against transformers' MoE in one process
    assert "EP = 2 (2 MoE layers replaced, 4 experts" in rows["expert_parallel"]["detail"], rows["expert_parallel"]
    assert "sdpa's math kernel vs the examples alone through its flash_attention kernel" in rows["sdpa_packing"]["detail"]
    # DeepSpeed's pipeline engine, 2 stages over both ranks, against the whole batch in one process
    assert "2 stages x 1 data-parallel, 1F1B over 2 micro-batches" in rows["pipeline"]["detail"], rows["pipeline"]
    assert "9 passed, 0 failed, 5 skipped" in proc.stdout
    assert proc.stdout.count("check              status") == 1  # rank 0 prints the table


def test_selftest_checks_can_fail(monkeypatch):
    real = selftest.chunked_cross_entropy

    def off_by_a_thousandth(*args, **kwargs):
        loss, correct = real(*args, **kwargs)
        return loss * 1.001, correct

    monkeypatch.setattr(selftest, "chunked_cross_entropy", off_by_a_thousandth)
    monkeypatch.setitem(selftest.CHECKS, "broken", lambda: torch.ones(2) @ torch.ones(3))
    rows = selftest.run_checks(["chunked_head", "broken"])
    assert [r.status for r in rows] == ["FAIL", "FAIL"]
    assert 9e-4 < rows[0].measured < 1.1e-3
    assert rows[1].detail.startswith("RuntimeError: ")
    table = selftest.render(rows)
    assert table.splitlines()[-1] == "0 passed, 2 failed, 0 skipped"


def test_selftest_bad_arguments(tmp_path, capsys):
    from finetune.commands.selftest import main

    assert main(["--checks", "collectives,warp_drive"]) == 2
    assert "--checks: unknown check 'warp_drive'" in capsys.readouterr().err
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    assert main(["--json", str(taken)]) == 2
    assert "exists; it is never overwritten" in capsys.readouterr().err
    # a JSON that cannot be written is refused before the checks run (as root a chmod'ed folder is writable: a
    # path under a regular file cannot be created by anyone)
    assert main(["--json", str(taken / "rows.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--json" in err[0] and "is a file, not a folder" in err[0], err
