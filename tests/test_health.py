"""finetune/lifecycle/health.py without a launch: how a rank reads the other ranks' records after a collective broke.

The real dead-rank launches (rank 0 and rank 1 killed, rank 1 raising) are in test_launchers.py; these cover
the branches a one-node launch cannot reach: a rank on another host that stopped heartbeating, a hung rank
that still heartbeats (it is asked for a stack dump), records of an earlier launch, and the blame order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, cpu_env
from finetune.lifecycle import health
from launch_helpers import wait_for


def _record(folder, rank, launch="L", **fields):
    rec = {"launch": launch, "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "create_time": None,
           "started": time.time(), "time": time.time(), "beat": 3, "state": "running", "where": "x.py:1 f", **fields}
    (folder / f"rank{rank}.json").write_text(json.dumps(rec))


@pytest.fixture
def me(tmp_path):
    """Rank 0 of a world of 4 whose records live in tmp_path (no heartbeat thread)."""
    return health.RankHealth(tmp_path, rank=0, world=4, launch="L")


def test_blames_the_rank_that_failed_on_its_own_first(me, tmp_path, monkeypatch):
    monkeypatch.setattr(health, "STALE_S", 0.5)
    _record(tmp_path, 1, state="failed", error="RuntimeError: Connection closed by peer", peer_failure=True)
    _record(tmp_path, 2, state="running", host="node-elsewhere", pid=1)  # never beats again
    _record(tmp_path, 3, launch="an earlier launch", state="failed", error="OSError: old", peer_failure=False)
    t0 = time.time()
    line = me.diagnose(wait_s=5)
    assert time.time() - t0 < 3
    assert line.startswith("rank 2 (host node-elsewhere, pid 1) stopped heartbeating at "), line
    assert "rank 1 (host" in line and "Connection closed by peer" in line  # a victim, named after the culprit
    assert "OSError: old" not in line  # another launch's record


def test_dead_pid_on_this_host_and_exit_status(me, tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record(tmp_path, 1, pid=gone.pid)
    _record(tmp_path, 2, state="exited", exit_code=143)
    line = me.diagnose(wait_s=5)
    assert f"rank 1 (host {socket.gethostname()}, pid {gone.pid}) died at about" in line, line
    assert "without an exit status" in line and "exited with status 143 at" in line


def test_hung_rank_is_named_with_where_and_dumps_its_stacks(me, tmp_path):
    """Nobody failed (a timeout): the ranks still heartbeating are listed with their main thread's place, and
    those on this host dump their stacks into their logs (faulthandler on SIGUSR2; the rank keeps running)."""
    log = tmp_path / "rank1.log"
    code = (f"from pathlib import Path; import time\nfrom finetune.lifecycle.health import install_faulthandler\n"
            f"install_faulthandler(Path({str(log)!r}))\nprint('ready', flush=True)\n"
            f"def stuck_in_all_reduce():\n    time.sleep(60)\nstuck_in_all_reduce()\n")
    hung = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert hung.stdout.readline().strip() == "ready"
        for r in (1, 2, 3):
            _record(tmp_path, r, pid=hung.pid if r == 1 else os.getpid(), where="finetune/training/trainer.py:171 fit")
        me.world = 2
        line = me.diagnose(wait_s=0.5)
        assert line.startswith("no other rank failed or exited: rank 1 ("), line
        assert "still heartbeats, main thread in finetune/training/trainer.py:171 fit; its stacks: logs/rank1.log" in line
        wait_for(lambda: "stuck_in_all_reduce" in log.read_text(), 10, what="stack dump in the hung rank's log")
        assert hung.poll() is None
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait()


def test_own_record_heartbeat_and_exit(tmp_path, monkeypatch):
    monkeypatch.setattr(health, "HEARTBEAT_S", 0.05)
    me = health.RankHealth(tmp_path, rank=0, world=1, launch="L").start()
    rec = lambda: json.loads((tmp_path / "rank0.json").read_text())  # noqa: E731
    wait_for(lambda: rec()["beat"] >= 2, 10, what="two heartbeats")
    assert rec()["where"]  # the main thread's place (here: this test function)
    me.failed(RuntimeError("gloo: Connection closed by peer"))
    me.finish(1)
    final = rec()
    assert final["state"] == "failed" and final["peer_failure"] is True and final["exit_code"] == 1
    beat = final["beat"]
    time.sleep(0.2)
    assert rec()["beat"] == beat  # the heartbeat stopped


_FAULTS = """
import resource, sys, torch
from finetune.lifecycle import health
print(health.tune_cpu_allocator() if sys.argv[1] == "tune" else "default", flush=True)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
x = torch.randn(2048, 256)
def step():  # the allocation pattern of a training step: activations of 1-8 MiB made and freed every step
    m(x).square().mean().backward()
    for p in m.parameters():
        p.grad = None
for _ in range(3):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
"""


def test_cpu_allocator_tuning_stops_page_fault_churn_and_yields_to_the_environment():
    """``tune_cpu_allocator`` (called by every CPU rank before the model is built): a step that makes and frees
    the same tensors no longer faults their pages back in each time (measured: ~917 -> ~205 minor faults per
    step of this loop; ~4,000-7,000 -> ~480 per step of the gpt_clm bench preset), and malloc settings in the
    environment are left alone."""
    env = {k: v for k, v in cpu_env().items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}

    def faults(mode, **extra):
        proc = subprocess.run([sys.executable, "-c", _FAULTS, mode], cwd=REPO, env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said, per_step = proc.stdout.split("\n")[:2]
        return said, float(per_step)

    said, tuned = faults("tune")
    assert said == "mallopt M_MMAP_THRESHOLD=33554432 M_TRIM_THRESHOLD=134217728"
    # at most two thirds of the default's faults: ~102-332 vs ~917-1,500 per step on an AMD EPYC VM, but ~102 vs ~203
    # on a 2.1 GHz Xeon VM, where halving was the line itself (102.4 vs 203.2 failed once). glibc's default raises its
    # mmap threshold after the first frees, and in about one run in three here it has done so before the measured
    # steps and faults no more than the tuning (102.4 vs 128.0). So every one of three tuned runs must stay under
    # two thirds of the default's churn, the most of up to four default runs (an allocator setting that did nothing
    # would churn in one of three runs with probability 26/27).
    tuned = max([tuned] + [faults("tune")[1] for _ in range(2)])
    _, default = faults("default")
    for _ in range(3):
        if tuned < default * 2 / 3:
            break
        default = max(default, faults("default")[1])
    assert tuned < default * 2 / 3, (tuned, default)
    said, _ = faults("tune", MALLOC_TOP_PAD_="0")
    assert said == "left to the environment (MALLOC_TOP_PAD_)"
    said, _ = faults("tune", GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")
    assert said == "left to the environment (GLIBC_TUNABLES)"


def test_exit_process_runs_every_atexit_handler_then_skips_the_teardown(tmp_path):
    """``health.exit_process(3)``: exit status 3, buffered stdout written, an ``atexit`` handler registered after
    the import (as a library's is) still runs, and an object's ``__del__`` left for the interpreter's teardown does
    not (the teardown was skipped). An exception escaping instead exits the usual way (status 1, teardown run)."""
    code = f"""
import atexit, sys
sys.path.insert(0, {str(REPO)!r})
from finetune.lifecycle import health
from pathlib import Path
out = Path({str(tmp_path)!r})
atexit.register(lambda: (out / "atexit").write_text("ran"))
class Teardown:
    def __del__(self):
        (out / "teardown").write_text("ran")
keep = Teardown()
print("buffered, not flushed", end="")
if sys.argv[1] == "exit":
    health.exit_process(3)
raise RuntimeError("escaped")
"""
    proc = subprocess.run([sys.executable, "-c", code, "exit"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == "buffered, not flushed", (proc.returncode, proc.stderr)
    assert (tmp_path / "atexit").read_text() == "ran" and not (tmp_path / "teardown").exists()
    (tmp_path / "atexit").unlink()
    proc = subprocess.run([sys.executable, "-c", code, "raise"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "RuntimeError: escaped" in proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "teardown").read_text() == "ran"
