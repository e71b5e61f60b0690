"""The shipped sbatch scripts and ``srun`` on a real one-node Slurm (tests/slurm_cluster.py), 2 CPU ranks.

* ``scripts/slurm_single_node.sbatch`` (deepspeed launcher) writes the whole run folder: per-rank logs,
  TensorBoard events, a complete checkpoint, the export; one Slurm log per job id.
* ``srun python finetune/run.py`` in an allocation: ranks from ``SLURM_*``, port from the job id.
* Preemption: ``scancel --signal=USR1 --batch`` (what ``#SBATCH --signal=B:USR1@<s>`` does before the time
  limit) mid-run, through both scripts (deepspeed's local launcher, and deepspeed's Slurm backend, which
  runs ``srun``): every rank gets the signal, they stop at one step with a complete checkpoint, the job
  requeues itself, resumes from that checkpoint by itself and finishes with the uninterrupted run's losses.
* ``scancel`` (SIGTERM to every process of the job, as on preemption) mid-run: the job ends only after the
  ranks have exited with a ``COMPLETE`` checkpoint (the deepspeed launcher itself exits at once on SIGTERM).

The scripts are submitted as shipped; sbatch options on the command line only shrink the resources
(2 GPUs stand for 2 CPU ranks: ``FINETUNE_GPUS_PER_NODE=2``, ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from conftest import BIN, REPO, cpu_env
from launch_helpers import (CONFIG, RUN_OVERRIDES, STEPS, assert_same_losses, assert_wiring, logged_steps,
                            reference_run, wait_for, wiring)
from slurm_cluster import SlurmUnavailable, start_cluster

pytestmark = pytest.mark.slow

SINGLE = REPO / "scripts" / "slurm_single_node.sbatch"
MULTI = REPO / "scripts" / "slurm_multi_node.sbatch"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster for the session (skips where its daemons cannot run)."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm: {e}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted ``deepspeed --num_gpus 2`` run (shared with test_launchers.py)."""
    return reference_run(tmp_path_factory)


def _job_env(slurm, **extra) -> dict:
    env = cpu_env(**slurm_env(slurm), FINETUNE_GPUS_PER_NODE="2", **extra)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


def slurm_env(slurm) -> dict:
    """SLURM_CONF of the test cluster and the Python environment the scripts should activate."""
    env = {"SLURM_CONF": slurm.env["SLURM_CONF"]}
    if (BIN / "activate").exists():
        env["FINETUNE_VENV"] = str(BIN.parent)
    return env


def _options(slurm, tmp: Path, script: Path) -> list[str]:
    """Command-line sbatch options that shrink the scripts' resources to 2 CPU ranks on this node."""
    opts = [f"--output={tmp}/slurm-%x-%j.out", "--time=15", f"--gpus-per-node={slurm.gpus}"]
    if script == SINGLE:
        opts += ["--cpus-per-task=2"]
    else:
        opts += ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    return opts


def _job_log(tmp: Path, job_id: int) -> str:
    return (tmp / f"slurm-finetune-{job_id}.out").read_text(errors="replace")


def _assert_done(slurm, info: dict, tmp: Path, job_id: int) -> None:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
        f"{info}\n{_job_log(tmp, job_id)[-5000:]}\n{slurm.logs_tail()}"


def test_single_node_script_writes_run_folder(slurm, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = slurm.sbatch(SINGLE, str(CONFIG), f"output_dir={run_dir}", *RUN_OVERRIDES, "export=true",
                       options=_options(slurm, tmp_path, SINGLE), env=_job_env(slurm), cwd=REPO)
    info = slurm.wait(job, timeout=400)
    _assert_done(slurm, info, tmp_path, job)
    log = _job_log(tmp_path, job)  # one log per job id, with the launcher's and rank 0's output
    assert f"job {job} (restart 0)" in log and f"done: {STEPS} steps" in log
    assert_wiring(run_dir, "deepspeed")
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["launcher"] == "deepspeed" and meta["world_size"] == 2
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank0.log", "rank1.log"}
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    ck = run_dir / "checkpoints" / f"step{STEPS}"
    assert (ck / "COMPLETE").is_file() and (ck / "rng_state_rank1.pt").is_file()
    export = run_dir / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert (export / "tokenizer.json").is_file() or (export / "tokenizer_config.json").is_file()
    assert json.loads((run_dir / "export_check.json").read_text())["max_abs_logit_diff"] <= 1e-4
    assert_same_losses(run_dir, reference[1])


def test_srun_in_allocation(slurm, reference, tmp_path):
    """Plain ``srun python finetune/run.py``: nothing exports RANK/MASTER_*; SLURM_* and the job id suffice."""
    run_dir = tmp_path / "run"
    cmd = (f"srun --kill-on-bad-exit=1 {sys.executable} -u finetune/run.py --config {CONFIG} "
           f"output_dir={run_dir} {' '.join(RUN_OVERRIDES)}")
    job = slurm.sbatch(None, options=["--job-name=finetune", "--ntasks=2", "--cpus-per-task=1",
                                    f"--output={tmp_path}/slurm-%x-%j.out", "--time=15", f"--chdir={REPO}",
                                    f"--wrap={cmd}"], env=_job_env(slurm))
    info = slurm.wait(job, timeout=400)
    _assert_done(slurm, info, tmp_path, job)
    w = assert_wiring(run_dir, "srun")
    assert w[0]["master"].startswith(f"{slurm.node}:")  # the head node from SLURM_JOB_NODELIST
    assert json.loads((run_dir / "meta.json").read_text())["launcher"] == "srun"
    assert_same_losses(run_dir, reference[1])


@pytest.mark.parametrize("script,launcher", [
    # suite budget: the single-node script's run is test_single_node_script_writes_run_folder; its requeue: extended
    pytest.param(SINGLE, "deepspeed", marks=pytest.mark.extended), (MULTI, "srun")],
    ids=["single_node-deepspeed", "multi_node-deepspeed_slurm_backend"])
def test_usr1_checkpoints_requeues_and_resumes(slurm, reference, tmp_path, script, launcher):
    run_dir = tmp_path / "run"
    job = slurm.sbatch(script, str(CONFIG), f"output_dir={run_dir}", *RUN_OVERRIDES,
                       options=_options(slurm, tmp_path, script), env=_job_env(slurm), cwd=REPO)
    wait_for(lambda: logged_steps(run_dir) >= 3 or slurm.job(job).get("JobState") not in ("PENDING", "RUNNING"),
             300, what="step 3 of the first run")
    signalled_at = logged_steps(run_dir)
    assert signalled_at < STEPS - 2, f"the run was not mid-way when signalled: {_job_log(tmp_path, job)[-3000:]}"
    slurm.run("scancel", "--signal=USR1", "--batch", str(job))  # = #SBATCH --signal=B:USR1@<s> at the time limit
    info = slurm.wait(job, timeout=400)
    _assert_done(slurm, info, tmp_path, job)
    log = _job_log(tmp_path, job)
    assert info["Restarts"] == "1", f"job was not requeued once: {info}\n{log[-5000:]}"
    assert "batch shell got SIGUSR1" in log and f"requeueing job {job}" in log and f"job {job} (restart 1)" in log

    ranks = {r: (run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    stops = set()
    for r, text in ranks.items():  # every rank got the signal and stopped at the same step
        assert "received SIGUSR1" in text, f"rank {r} never saw SIGUSR1"
        stops |= {int(s) for s in re.findall(r"stopped at step (\d+) of", text)}
    assert len(stops) == 1, f"ranks stopped at different steps: {stops}"
    stopped = stops.pop()
    assert signalled_at <= stopped < STEPS
    ck = run_dir / "checkpoints"
    assert (ck / f"step{stopped}" / "COMPLETE").is_file() and (ck / f"step{STEPS}" / "COMPLETE").is_file()
    assert f"resumed from {ck / f'step{stopped}'}: step {stopped}" in ranks[0]  # by itself: no --resume given
    assert_wiring(run_dir, launcher)
    assert_same_losses(run_dir, reference[1])  # steps after the resume equal the uninterrupted run's


def test_scancel_ends_job_after_checkpoint_is_complete(slurm, tmp_path):
    """scancel mid-run: Slurm sends SIGTERM to the batch shell, the launcher and the ranks at once; the deepspeed
    launcher exits at once, and the job must still end only after the ranks wrote their COMPLETE checkpoint."""
    import psutil

    run_dir = tmp_path / "run"
    job = slurm.sbatch(SINGLE, str(CONFIG), f"output_dir={run_dir}", *RUN_OVERRIDES,
                       options=_options(slurm, tmp_path, SINGLE), env=_job_env(slurm), cwd=REPO)
    wait_for(lambda: logged_steps(run_dir) >= 3 or slurm.job(job).get("JobState") not in ("PENDING", "RUNNING"),
             300, what="step 3")
    pids = [w["pid"] for w in wiring(run_dir).values()]
    assert len(pids) == 2 and logged_steps(run_dir) < STEPS - 2, _job_log(tmp_path, job)[-3000:]
    slurm.run("scancel", str(job))
    info = slurm.wait(job, states=("CANCELLED",), timeout=120)  # not COMPLETING: every process of the job is gone
    ended = time.time()

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    log = _job_log(tmp_path, job)
    assert not [p for p in pids if alive(p)], f"ranks outlived the job {info}\n{log[-3000:]}"
    complete = [ck for ck in (run_dir / "checkpoints").glob("step*") if (ck / "COMPLETE").is_file()]
    assert len(complete) == 1, f"complete checkpoints when the job ended: {complete}\n{log[-3000:]}"
    marker = json.loads((complete[0] / "COMPLETE").read_text())
    assert 3 <= marker["step"] < STEPS and marker["time"] < ended
    # the batch shell's last lines come after the ranks exited, i.e. after the marker was written
    last = re.findall(r"^\[finetune ([\d-]+ [\d:.]+)\] every process of the launch has exited \(got SIGTERM\); "
                      r"launcher status (\d+)", log, re.M)
    assert last, log[-3000:]
    assert datetime.strptime(last[-1][0], "%Y-%m-%d %H:%M:%S.%f").timestamp() >= marker["time"], log[-3000:]
    assert f"launcher and ranks exited with status {last[-1][1]}" in log
    for r in (0, 1):
        text = (run_dir / "logs" / f"rank{r}.log").read_text()
        assert "received SIGTERM" in text and f"stopped at step {marker['step']} of {STEPS}" in text
