"""The shipped multi-node sbatch script on a real two-node Slurm (tests/slurm_cluster.py:start_two_node_cluster):
each node a network namespace with its own address and host name, one CPU rank per node, a shared file system.

* Across both nodes: the run folder has both hosts' records, TensorBoard, a complete checkpoint and a verified
  export; the losses equal a one-node 2-rank run's (the session's reference run).
* A node lost mid-run (its link cut, then every process on it killed: slurmd, the step, the rank): the surviving
  rank names the lost host and rank, the last complete checkpoint is intact, Slurm marks the node down and
  requeues the job (NODE_FAIL, ``--requeue``); the requeued job, shrunk to the one node left (``scontrol update
  NumNodes=1``, what an operator or a ``--nodes=1-2`` request gives), resumes by itself from that checkpoint on 1
  rank with the accumulation doubled (same global batch, through the universal checkpoint) and ends with the
  losses of the uninterrupted run.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, REPO, cpu_env
from launch_helpers import CONFIG, RUN_OVERRIDES, STEPS, assert_same_losses, logged_steps, reference_run, wait_for, wiring
from slurm_cluster import SlurmUnavailable, start_two_node_cluster

pytestmark = pytest.mark.slow

MULTI = REPO / "scripts" / "slurm_multi_node.sbatch"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two nodes, for this module (skips where namespaces or the daemons cannot run)."""
    try:
        c = start_two_node_cluster(tmp_path_factory.mktemp("slurm2"))
    except SlurmUnavailable as e:
        pytest.skip(f"no two-node Slurm here: {e}")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    return reference_run(tmp_path_factory)


def _env(cluster) -> dict:
    first = next(iter(cluster.nodes.values()))
    env = cpu_env(SLURM_CONF=cluster.env["SLURM_CONF"], FINETUNE_GPUS_PER_NODE="1", MASTER_ADDR=first,
                  GLOO_SOCKET_IFNAME="ft0")
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    if (BIN / "activate").exists():
        env["FINETUNE_VENV"] = str(BIN.parent)
    return env


def _submit(cluster, tmp: Path, run_dir: Path, *overrides: str) -> int:
    opts = [f"--output={tmp}/slurm-%x-%j.out", "--time=15", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
            f"--gpus-per-node={cluster.gpus}"]
    return cluster.sbatch(MULTI, str(CONFIG), f"output_dir={run_dir}", *RUN_OVERRIDES, *overrides, options=opts,
                          env=_env(cluster), cwd=REPO)


def _log(tmp: Path, job: int) -> str:
    p = tmp / f"slurm-finetune-{job}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def test_multi_node_script_across_two_nodes(cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(cluster, tmp_path, run_dir, "export=true")
    info = cluster.wait(job, timeout=500)
    assert info["JobState"] == "COMPLETED", f"{info}\n{_log(tmp_path, job)[-5000:]}\n{cluster.logs_tail()}"
    w = wiring(run_dir)
    assert sorted(w) == [0, 1] and {v["world"] for v in w.values()} == {2}
    assert {w[0]["host"], w[1]["host"]} == set(cluster.nodes), w  # one rank on each node
    assert [w[r]["local_rank"] for r in (0, 1)] == [0, 0]
    assert {v["master"] for v in w.values()} == {f"{cluster.nodes['ftnode1']}:{w[0]['master'].split(':')[1]}"}
    records = {r: json.loads((run_dir / "launches" / "1" / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert {records[r]["host"] for r in (0, 1)} == set(cluster.nodes)
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank0.log", "rank1.log"}
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    ck = run_dir / "checkpoints" / f"step{STEPS}"
    assert (ck / "COMPLETE").is_file() and (ck / "rng_state_rank1.pt").is_file()
    assert json.loads((run_dir / "export_check.json").read_text())["max_abs_logit_diff"] <= 1e-4
    assert_same_losses(run_dir, reference[1])


def _node_processes(ns: str) -> list[int]:
    """Pids of the processes whose network namespace is ``ns`` (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.extended  # suite budget: the one-node version runs in test_slurm.py
def test_usr1_across_two_nodes_stops_both_at_one_step(cluster, reference, tmp_path):
    """``scancel --signal=USR1 --batch`` (the time limit's warning): the batch shell on the first node forwards it
    through srun to both nodes' ranks; they stop at one step with a complete checkpoint, the job requeues itself
    onto both nodes and finishes with the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    job = _submit(cluster, tmp_path, run_dir)
    wait_for(lambda: logged_steps(run_dir) >= 3 or cluster.job(job).get("JobState") not in ("PENDING", "RUNNING"),
             400, what="step 3")
    signalled_at = logged_steps(run_dir)
    assert signalled_at < STEPS - 2, _log(tmp_path, job)[-3000:]
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    info = cluster.wait(job, timeout=500)
    log = _log(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{log[-5000:]}"
    assert f"job {job} (restart 1) nodes ftnode[1-2];" in log
    stops = set()
    for r in (0, 1):
        text = (run_dir / "logs" / f"rank{r}.log").read_text()
        assert "received SIGUSR1" in text, f"rank {r} never saw SIGUSR1"
        stops |= {int(s) for s in re.findall(r"stopped at step (\d+) of", text)}
    assert len(stops) == 1, stops
    stopped = stops.pop()
    assert (run_dir / "checkpoints" / f"step{stopped}" / "COMPLETE").is_file()
    assert {v["host"] for v in wiring(run_dir).values()} == set(cluster.nodes)
    assert_same_losses(run_dir, reference[1])


def os_kill(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGKILL)


# Last in the module: it leaves ftnode2 down (link cut, slurmd killed), so a two-node job after it would pend.
@pytest.mark.extended  # suite budget: the two-node run stays in the suite
def test_node_lost_requeue_on_one_node_resumes(cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(cluster, tmp_path, run_dir, "train.save_every=4", "train.dist_timeout_minutes=2")
    wait_for(lambda: logged_steps(run_dir) >= 9 or cluster.job(job).get("JobState") not in ("PENDING", "RUNNING"),
             400, what="step 9")
    assert cluster.job(job)["JobState"] == "RUNNING", _log(tmp_path, job)[-3000:]
    w = wiring(run_dir)
    lost_ns, lost_at = cluster.namespaces[1], logged_steps(run_dir)
    assert w[1]["host"] == "ftnode2"
    # the node dies: its link first (nothing it sends reaches node 1 any more), then everything running on it
    subprocess.run(["ip", "-n", lost_ns, "link", "set", "ft0", "down"], check=True)
    for pid in _node_processes(lost_ns):
        try:
            os_kill(pid)
        except ProcessLookupError:
            pass
    t0 = time.time()
    info = wait_for(lambda: (i := cluster.job(job)).get("Restarts", "0") != "0" and i, 300, interval=0.5,
                    what="the requeue")
    requeued_after = time.time() - t0
    node = cluster.run("scontrol", "show", "node", "ftnode2", "-o").stdout
    assert "State=DOWN" in node, node
    # shrink the requeued job to the node that is left
    cluster.run("scontrol", "update", f"JobId={job}", "NumNodes=1-1", "NumTasks=1", "NumCPUs=1")
    info = cluster.wait(job, timeout=500)
    log = _log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-6000:]}\n{cluster.logs_tail()}"
    assert requeued_after < 120, requeued_after
    survivor = (run_dir / "logs" / "rank0.log").read_text(errors="replace")
    assert f"rank 1 (host ftnode2, pid {w[1]['pid']})" in survivor, survivor[-4000:]
    ckdir = run_dir / "checkpoints"
    complete = sorted(int(p.name[4:]) for p in ckdir.glob("step*") if p.name[4:].isdigit() and (p / "COMPLETE").is_file())
    resumed = int(re.search(rf"resumed from {re.escape(str(ckdir))}/step(\d+): step", survivor)[1])
    assert 8 <= resumed <= lost_at, (resumed, lost_at)  # the newest checkpoint complete when the node was lost
    assert survivor.count("stopped heartbeating") == 1  # logged once, not at every beat
    assert "train.gradient_accumulation_steps 1 -> 2 keeps the global batch" in survivor
    assert (ckdir / f"step{resumed}.universal").is_dir()  # 2 ranks' ZeRO shards -> 1 rank: universal checkpoint
    record = json.loads((run_dir / "launches" / "1" / "ranks" / "rank0.json").read_text())
    assert record["waiting_for"].startswith(f"rank 1 (host ftnode2, pid {w[1]['pid']}) stopped heartbeating")
    assert info["Restarts"] == "1" and f"job {job} (restart 1) nodes ftnode1;" in log
    assert STEPS in complete
    assert_same_losses(run_dir, reference[1], rel=1e-5)
