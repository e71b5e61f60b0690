"""One run config under every launcher: same rank wiring, same per-step losses; signals and dead ranks.

Launchers: ``deepspeed --num_gpus 2`` (the reference run), ``deepspeed --hostfile``, ``torchrun`` and
``mpirun`` (OpenMPI, installed with apt when missing, plus mpi4py). ``srun`` and DeepSpeed's Slurm
backend are in ``test_slurm.py``. Then: SIGTERM to a whole ``deepspeed`` launch leaves a complete
checkpoint (never a half-written one marked complete) that resumes to the uninterrupted losses, and a rank
killed or failing mid-run ends the whole launch quickly with a non-zero status and a log naming the rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, REPO, cpu_env, free_port, launch, ok, train_losses
from launch_helpers import (RUN_OVERRIDES, STEPS, assert_same_losses, assert_wiring, ensure_openmpi, logged_steps,
                            reference_run, wait_for, wiring)

pytestmark = pytest.mark.slow

CONFIG = REPO / "tests" / "configs" / "tiny_gpt.yaml"


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted ``deepspeed --num_gpus 2`` run every other launch is compared with."""
    return reference_run(tmp_path_factory)


def _run(cmd: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def _train_args(run_dir: Path) -> list[str]:
    return ["finetune/run.py", "--config", str(CONFIG), f"output_dir={run_dir}", *RUN_OVERRIDES]


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def test_deepspeed_num_gpus(reference):
    run_dir, losses = reference
    assert_wiring(run_dir, "deepspeed")
    assert _meta(run_dir)["launcher"] == "deepspeed" and _meta(run_dir)["world_size"] == 2
    assert sorted(losses) == list(range(1, STEPS + 1))


def test_deepspeed_hostfile(reference, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run_dir = tmp_path / "run"
    # one host: DeepSpeed launches locally, but without these two it ssh-es to it (check, master address)
    ok(_run([str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port",
             str(free_port()), *_train_args(run_dir)]))
    assert_wiring(run_dir, "deepspeed")
    assert_same_losses(run_dir, reference[1])


def test_torchrun(reference, tmp_path):
    run_dir = tmp_path / "run"
    ok(_run([str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(free_port()), *_train_args(run_dir)]))
    assert_wiring(run_dir, "torchrun")
    assert _meta(run_dir)["launcher"] == "torchrun" and _meta(run_dir)["world_size"] == 2
    assert_same_losses(run_dir, reference[1])


def test_mpirun(reference, tmp_path):
    try:
        mpirun = ensure_openmpi()
    except RuntimeError as e:
        pytest.skip(f"OpenMPI/mpi4py cannot be installed here: {e}")
    run_dir = tmp_path / "run"
    # as root OpenMPI wants --allow-run-as-root; no core binding, like the other launchers
    ok(_run([mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
             sys.executable, *_train_args(run_dir)]))
    w = assert_wiring(run_dir, "mpi")
    assert w[0]["master"].startswith("127.0.0.1:")  # one node: rank 0 broadcast loopback and a free port
    assert _meta(run_dir)["launcher"] == "mpi" and _meta(run_dir)["world_size"] == 2
    assert_same_losses(run_dir, reference[1])


def _wait_group_gone(proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until no process of ``proc``'s group is left (the launcher may exit before its ranks)."""
    t0 = time.time()

    def gone():
        proc.poll()  # reap the launcher: a zombie still counts as a member of its group
        try:
            os.killpg(proc.pid, 0)
            return False
        except ProcessLookupError:
            return True
    wait_for(gone, timeout, interval=0.1, what=f"process group {proc.pid} gone")
    return time.time() - t0


def _start(run_dir: Path, overrides=RUN_OVERRIDES) -> subprocess.Popen:
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "finetune/run.py",
           "--config", str(CONFIG), f"output_dir={run_dir}", *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.launch.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_sigterm_leaves_complete_checkpoint_that_resumes(reference, tmp_path):
    """SIGTERM to the launch's process group (Ctrl-C style, or a scheduler): ranks stop at one step, save it."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    wait_for(lambda: logged_steps(run_dir) >= 3 or proc.poll() is not None, 300, what="step 3")
    assert proc.poll() is None, "the run ended before it could be signalled"
    os.killpg(proc.pid, signal.SIGTERM)
    _wait_group_gone(proc, 90)
    assert proc.wait() != 0
    ckdir = run_dir / "checkpoints"
    complete = []
    for ck in sorted(ckdir.glob("step*")):
        if (ck / "COMPLETE").exists():  # marked complete: every rank's files are there
            names = {p.name for p in ck.iterdir()}
            assert {"mp_rank_00_model_states.pt", "rng_state_rank0.pt", "rng_state_rank1.pt",
                    "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names
            complete.append(int(ck.name[4:]))
    assert len(complete) == 1, f"complete checkpoints after SIGTERM: {complete}"
    stopped = complete[0]
    assert 3 <= stopped < STEPS
    for r in (0, 1):
        log = (run_dir / "logs" / f"rank{r}.log").read_text()
        assert "received SIGTERM" in log and f"stopped at step {stopped} of {STEPS}" in log
    ok(launch(CONFIG, [f"output_dir={run_dir}", *RUN_OVERRIDES], resume="latest"))
    assert f"resumed from {ckdir / f'step{stopped}'}" in (run_dir / "logs" / "rank0.log").read_text()
    assert_same_losses(run_dir, reference[1])  # steps before the stop from the first launch, the rest resumed


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_dead_rank_ends_launch(tmp_path, how):
    """Rank 1 killed (SIGKILL) or failing with an exception (SIGINT: KeyboardInterrupt) mid-run: the launch
    exits non-zero within seconds (not after train.dist_timeout_minutes) and the logs name rank and error."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, [*RUN_OVERRIDES, "train.max_steps=500"])
    wait_for(lambda: logged_steps(run_dir) >= 2 or proc.poll() is not None, 300, what="step 2")
    assert proc.poll() is None
    pid = wiring(run_dir)[1]["pid"]
    t0 = time.time()
    os.kill(pid, getattr(signal, how))
    rc = proc.wait(timeout=120)
    elapsed = time.time() - t0
    _wait_group_gone(proc, 60)
    assert rc != 0
    assert elapsed < 60, f"launch took {elapsed:.0f}s to fail"
    out = (tmp_path / "run.launch.log").read_text(errors="replace")
    rank0 = (run_dir / "logs" / "rank0.log").read_text(errors="replace")
    # the surviving rank says which rank it is and what broke
    assert "rank 0 failed: " in rank0 and "another rank probably died" in rank0, rank0[-3000:]
    if how == "SIGKILL":
        assert "--local_rank=1" in out and "exits with return code = -9" in out, out[-3000:]
    else:
        rank1 = (run_dir / "logs" / "rank1.log").read_text(errors="replace")
        assert "rank 1 failed: KeyboardInterrupt" in rank1, rank1[-3000:]
    assert train_losses(run_dir), "no step was logged before the failure"
