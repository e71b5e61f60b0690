"""Run folders: a new folder per launch under ``output_root``, resume-the-newest, a requeued job finds its own
run, one launch per folder (the lock), unwritable folders refused in one line (issues 13 and 7)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, CONFIGS, REPO, cpu_env, free_port, launch, ok, read_metrics, refused_here, run_python
from launch_helpers import wait_for

from finetune.lifecycle import run_folder

CONFIG = CONFIGS / "tiny_gpt.yaml"
SHORT = ["train.max_steps=2", "train.save_every=0", "train.eval_every=0", "train.log_every=1", "export=false"]


def errors(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("finetune: error:")]


@pytest.mark.extended  # suite budget: the README test checks one new run folder per launch
def test_each_launch_gets_its_own_folder_and_resume_takes_the_newest(tmp_path):
    """The shipped-config pattern: the same command twice makes two runs; --resume takes the newer one; a requeued
    Slurm job continues its own run even when a newer run exists."""
    root = tmp_path / "runs"
    common = ["output_dir=", f"output_root={root}", *SHORT]
    # one rank per launch: folder naming and picking do not depend on the world size (and it is quicker)
    ok(launch(CONFIG, common, nproc=1, env=cpu_env(SLURM_JOB_ID="4242")))
    first = run_folder.runs_under(root)
    assert len(first) == 1 and first[0].name.endswith("-job4242")
    time.sleep(1.1)  # names carry the second of the launch
    proc = ok(launch(CONFIG, common, nproc=1))
    runs = run_folder.runs_under(root)
    assert len(runs) == 2 and runs[0] == first[0]
    newest = runs[1]
    assert f"run folder {newest}" in proc.stdout
    before = {p: p.stat().st_mtime_ns for p in first[0].rglob("*") if p.is_file()}

    # --resume picks the newest run under the root (the resume itself is tested in test_train/test_launchers)
    from finetune.config import load_run_config
    from finetune.lifecycle.run_folder import resolve_output_dir

    cfg = load_run_config(CONFIG, common)
    assert resolve_output_dir(cfg, "latest") == ("latest", None) and cfg.output_dir == str(newest)
    assert {p: p.stat().st_mtime_ns for p in first[0].rglob("*") if p.is_file()} == before, "old run was touched"

    # A requeued job (same SLURM_JOB_ID, SLURM_RESTART_COUNT=1, no --resume) resumes its own, older run.
    proc = ok(launch(CONFIG, ["output_dir=", f"output_root={root}", *SHORT, "train.max_steps=3"], nproc=1,
                     env=cpu_env(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1")))
    assert f"resuming from the latest complete checkpoint in {first[0]}" in proc.stdout
    assert sorted(p.name for p in (first[0] / "launches").iterdir()) == ["1", "2"]
    assert sorted(p.name for p in (newest / "launches").iterdir()) == ["1"], "the newer run was touched"
    assert len(run_folder.runs_under(root)) == 2


def test_second_launch_into_a_busy_folder_is_refused(tmp_path):
    """Two launches into one output_dir: the second is refused in one line and writes nothing; the first finishes."""
    run = tmp_path / "run"
    STEPS = 24
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "finetune/run.py",
           "--config", str(CONFIG), f"output_dir={run}", f"train.max_steps={STEPS}", "train.save_every=0",
           "train.eval_every=0", "export=false"]
    first = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        def holder_info():
            try:
                return json.loads((run / ".lock").read_text()) or None
            except (OSError, ValueError):  # not there yet, or created and not yet written
                return None

        holder = wait_for(lambda: holder_info() or first.poll() is not None, 300, what="lock")
        assert first.poll() is None and holder["pid"] > 0 and holder["host"]
        # The first launch holds the lock: freeze it (launcher and ranks) while the second one starts and
        # validates, so that the first cannot finish before (its lock, not its finished run, must refuse it).
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            second = launch(CONFIG, [f"output_dir={run}", "train.max_steps=2", "export=false"])
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        assert second.returncode != 0
        lines = errors(second)
        assert len(lines) == 1 and "is in use by another launch" in lines[0] and f"pid {holder['pid']}" in lines[0], \
            second.stdout[-4000:]
        out, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, out[-3000:]
    assert sorted(p.name for p in (run / "launches").iterdir()) == ["1"]
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "metrics of two launches interleaved"


def test_stale_lock_of_a_dead_process_is_replaced(tmp_path):
    """A lock whose process is gone (same host) does not block; a live holder does."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": pid, "since_utc": "x"}))
    assert run_folder.lock_problem(tmp_path) is None
    lock = run_folder.RunLock(tmp_path)
    assert lock.acquire() is None and json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    other = run_folder.RunLock(tmp_path)  # this process is alive: a second taker is refused
    assert "in use by another launch" in (other.acquire() or "")
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_unwritable_output_dirs_are_one_line_errors(tmp_path, capsys):
    """Refused by the launch's checks (run in the test's process: ``conftest.refused_here``)."""
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for out, needle in ((f"/proc/finetune-{os.getpid()}", "kernel file system"), (f"{a_file}/run", "is a file")):
        code, printed = refused_here(["--config", CONFIG, f"output_dir={out}"], capsys)
        assert code == 2 and "Traceback" not in printed, printed[-2000:]
        assert any(needle in ln for ln in printed.splitlines() if ln.startswith("finetune: error:")), printed[-2000:]


def test_disk_without_room_for_a_checkpoint_is_refused_before_training(tmp_path):
    """output_dir on an 8 MiB tmpfs: the 2.1M-parameter BERT needs ~28 MiB per checkpoint: one error line naming
    the folder and both sizes, exit 2, no step trained. Needs root to mount (as CI and this machine have)."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        proc = run_python(["finetune/run.py", "--config", str(CONFIGS / "tiny_bert.yaml"), f"output_dir={small}/run",
                           "export=false"])
        lines = errors(proc)
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-3000:]
        assert f"'{small}/run' has" in lines[0] and "MiB free, one checkpoint needs about" in lines[0], lines
        assert not (small / "run" / "metrics.jsonl").exists() and not (small / "run" / "checkpoints").exists()
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
