"""One run config under every launcher: same rank wiring, same per-step losses; signals and dead ranks.

Launchers: ``deepspeed --num_gpus 2`` (the reference run), ``deepspeed --hostfile``, ``torchrun`` and
``mpirun`` (OpenMPI, installed with apt when missing, plus mpi4py). ``srun`` and DeepSpeed's Slurm
backend are in ``test_slurm.py``. Then: SIGTERM to a whole ``deepspeed`` launch leaves a complete
checkpoint (never a half-written one marked complete) that resumes to the uninterrupted losses, and a rank
killed or failing mid-run ends the whole launch quickly with a non-zero status, and the survivors' logs and
the launch output name that rank, its host and pid (finetune/lifecycle/health.py).
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
from finetune.parallel import distributed as dist_utils
from finetune.errors import ConfigError
from finetune.lifecycle.preemption import forward
from launch_helpers import (RUN_OVERRIDES, STEPS, apt_install, assert_same_losses, assert_wiring, ensure_openmpi,
                            logged_steps, reference_run, wait_for, wiring)

CONFIG = REPO / "tests" / "configs" / "tiny_gpt.yaml"


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted ``deepspeed --num_gpus 2`` run every other launch is compared with."""
    return reference_run(tmp_path_factory)


def _run(cmd: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    # stdin from /dev/null: mpirun forwards its stdin to rank 0 and, on pytest's captured stdin, slows the
    # whole launch down several-fold
    return subprocess.run(cmd, cwd=REPO, env=env or cpu_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _train_args(run_dir: Path) -> list[str]:
    return ["finetune/run.py", "--config", str(CONFIG), f"output_dir={run_dir}", *RUN_OVERRIDES]


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


@pytest.mark.slow
def test_deepspeed_num_gpus(reference):
    run_dir, losses = reference
    assert_wiring(run_dir, "deepspeed")
    assert _meta(run_dir)["launcher"] == "deepspeed" and _meta(run_dir)["world_size"] == 2
    assert sorted(losses) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.extended  # suite budget; the deepspeed launcher across nodes: test_slurm's multi-node script
def test_deepspeed_hostfile(reference, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run_dir = tmp_path / "run"
    # one host: DeepSpeed launches locally, but without these two it ssh-es to it (check, master address)
    ok(_run([str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port",
             str(free_port()), *_train_args(run_dir)]))
    assert_wiring(run_dir, "deepspeed")
    assert_same_losses(run_dir, reference[1])


@pytest.mark.slow
def test_torchrun(reference, tmp_path):
    run_dir = tmp_path / "run"
    ok(_run([str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(free_port()), *_train_args(run_dir)]))
    assert_wiring(run_dir, "torchrun")
    assert _meta(run_dir)["launcher"] == "torchrun" and _meta(run_dir)["world_size"] == 2
    assert_same_losses(run_dir, reference[1])


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_mpirun(reference, tmp_path):
    try:
        mpirun = ensure_openmpi()
    except RuntimeError as e:
        pytest.skip(f"OpenMPI/mpi4py cannot be installed here: {e}")
    run_dir = tmp_path / "run"
    # TORCH_EXTENSIONS_DIR: mpirun called by its absolute path acts as --prefix /usr and puts /usr/bin first on the
    # ranks' PATH, so torch builds DeepSpeed's CPU ops with the system's ninja, whose command hashes differ from the
    # venv's ninja's: in the shared ~/.cache/torch_extensions every later launch would rebuild them (35-50 s each)
    env = {**cpu_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_ext")}
    # as root OpenMPI wants --allow-run-as-root; no core binding, like the other launchers
    ok(_run([mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--stdin", "none", "-np", "2",
             "-x", "TORCH_EXTENSIONS_DIR", sys.executable, *_train_args(run_dir)], env=env))
    w = assert_wiring(run_dir, "mpi")
    assert w[0]["master"].startswith("127.0.0.1:")  # one node: rank 0 broadcast loopback and a free port
    assert _meta(run_dir)["launcher"] == "mpi" and _meta(run_dir)["world_size"] == 2
    assert_same_losses(run_dir, reference[1])


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: ``[(namespace, interface, address), ...]`` (removed after)."""
    import random
    import shutil

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not shutil.which("ip"):
        try:
            apt_install(["iproute2"])
        except RuntimeError as e:
            pytest.skip(f"no ip command: {e}")
    tag, net = f"{os.getpid() % 100000}", f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
    hosts = [(f"ftnsa{tag}", f"fta{tag}", f"{net}.1"), (f"ftnsb{tag}", f"ftb{tag}", f"{net}.2")]
    cmds = [["ip", "netns", "add", hosts[0][0]], ["ip", "netns", "add", hosts[1][0]],
            ["ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]]]
    for ns, ifname, addr in hosts:
        cmds += [["ip", "link", "set", ifname, "netns", ns], ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname],
                 ["ip", "-n", ns, "link", "set", ifname, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for c in cmds:
            out = subprocess.run(c, capture_output=True, text=True)
            if out.returncode != 0:
                pytest.skip(f"cannot build two network namespaces here: {' '.join(c)}: {out.stderr.strip()}")
        yield hosts
    finally:
        for ns, _, _ in hosts:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow
@pytest.mark.extended
def test_torchrun_two_nodes_in_network_namespaces(reference, tmp_path, two_hosts):
    """``torchrun --nnodes 2``, one node per network namespace, one rank per node, over a veth pair."""
    run_dir = tmp_path / "run"
    master = two_hosts[0][2]
    port = str(free_port())
    procs = []
    for node, (ns, ifname, _) in enumerate(two_hosts):
        # gloo binds the address the host name resolves to (127.0.0.1 here) unless told the interface
        env = cpu_env(GLOO_SOCKET_IFNAME=ifname)
        cmd = ["ip", "netns", "exec", ns, str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", master, "--master_port", port, *_train_args(run_dir)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    w = wiring(run_dir)
    assert sorted(w) == [0, 1] and {v["world"] for v in w.values()} == {2}
    assert [w[r]["local_rank"] for r in (0, 1)] == [0, 0]  # one rank on each "node"
    assert {v["launcher"] for v in w.values()} == {"torchrun"} and {v["master"] for v in w.values()} == {f"{master}:{port}"}
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


def _start(run_dir: Path, overrides=RUN_OVERRIDES, script: str = "finetune/run.py") -> subprocess.Popen:
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), script,
           "--config", str(CONFIG), f"output_dir={run_dir}", *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.launch.log", "w")
    # SIGINT as the ranks' default (a test run started in the background by a shell inherits it ignored)
    return subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.extended)])
def test_sigterm_leaves_complete_checkpoint_that_resumes(reference, tmp_path, how):
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C in the terminal) to the launch's process group: ranks stop at one
    step, save it, and a resume continues with the same losses."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    wait_for(lambda: logged_steps(run_dir) >= 3 or proc.poll() is not None, 300, what="step 3")
    assert proc.poll() is None, "the run ended before it could be signalled"
    os.killpg(proc.pid, getattr(signal, how))
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
    assert len(complete) == 1, f"complete checkpoints after {how}: {complete}"
    stopped = complete[0]
    assert 3 <= stopped < STEPS
    for r in (0, 1):
        log = (run_dir / "logs" / f"rank{r}.log").read_text()
        assert f"received {how}" in log and f"stopped at step {stopped} of {STEPS}" in log
        assert "KeyboardInterrupt" not in log
    ok(launch(CONFIG, [f"output_dir={run_dir}", *RUN_OVERRIDES], resume="latest"))
    assert f"resumed from {ckdir / f'step{stopped}'}" in (run_dir / "logs" / "rank0.log").read_text()
    assert_same_losses(run_dir, reference[1])  # steps before the stop from the first launch, the rest resumed


@pytest.mark.slow
@pytest.mark.parametrize("how,victim", [("SIGKILL", 0), ("SIGALRM", 1)], ids=["SIGKILL-rank0", "exception-rank1"])
def test_dead_rank_ends_launch(tmp_path, how, victim):
    """Rank 0 killed (SIGKILL) or rank 1 failing with an exception (``tests/fails_on_sigalrm.py``: SIGALRM raises
    ``RuntimeError`` in the rank) mid-run: the
    launch exits non-zero within seconds (not after train.dist_timeout_minutes), and the survivor's log and the
    launch output name the rank that failed, its host and pid (DeepSpeed's own line names the last rank it
    started, whichever died). Before rank 1 is interrupted, ``kill -USR2`` dumps its stacks into its own log."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, [*RUN_OVERRIDES, "train.max_steps=500"], script="tests/fails_on_sigalrm.py")
    wait_for(lambda: logged_steps(run_dir) >= 2 or proc.poll() is not None, 300, what="step 2")
    assert proc.poll() is None
    w = wiring(run_dir)
    pid, survivor = w[victim]["pid"], 1 - victim
    victim_log = run_dir / "logs" / f"rank{victim}.log"
    if victim == 1:  # faulthandler: a hang dump on demand lands in the rank's own log
        os.kill(pid, signal.SIGUSR2)
        # faulthandler writes the dump thread by thread (the main thread, in trainer.py, comes last): wait for it
        wait_for(lambda: "trainer.py" in victim_log.read_text(errors="replace").partition("most recent call first")[2]
                 or proc.poll() is not None, 30, what="stack dump")
        assert proc.poll() is None  # dumped, still running
    t0 = time.time()
    os.kill(pid, getattr(signal, how))
    rc = proc.wait(timeout=120)
    elapsed = time.time() - t0
    _wait_group_gone(proc, 60)
    assert rc != 0
    assert elapsed < 60, f"launch took {elapsed:.0f}s to fail"
    out = (tmp_path / "run.launch.log").read_text(errors="replace")
    survivor_log = (run_dir / "logs" / f"rank{survivor}.log").read_text(errors="replace")
    name = f"rank {victim} (host {w[victim]['host']}, pid {pid})"
    # the surviving rank says which rank it is, what broke, and which rank caused it; so does the launch output
    assert f"rank {survivor} failed: " in survivor_log, survivor_log[-3000:]
    what = f"{name} died at about" if how == "SIGKILL" else f"{name} failed at"
    assert what in survivor_log and what in out, f"{survivor_log[-3000:]}\n---\n{out[-3000:]}"
    records = {r: json.loads((run_dir / "launches" / "1" / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert records[survivor]["state"] == "failed" and records[survivor]["peer_failure"] is True
    assert (records[victim]["pid"], records[victim]["rank"]) == (pid, victim)
    if how == "SIGKILL":
        assert records[victim]["state"] == "running"  # no exit status: the survivor saw its pid gone
    else:
        assert "RuntimeError" in survivor_log.split(what, 1)[1].splitlines()[0]
        assert records[victim]["state"] == "failed" and records[victim]["error"].startswith("RuntimeError")
        assert f"rank {victim} failed: RuntimeError" in victim_log.read_text(errors="replace")
    assert train_losses(run_dir), "no step was logged before the failure"


def test_faulthandler_writes_fatal_signal_to_rank_log(tmp_path):
    """A rank dying of a fatal signal (here SIGSEGV) leaves its Python stack in its own log file."""
    log = tmp_path / "logs" / "rank0.log"
    code = f"""
import os, signal
from pathlib import Path
from finetune.lifecycle.health import install_faulthandler
install_faulthandler(Path({str(log)!r}))
def deep_inside_training():
    os.kill(os.getpid(), signal.SIGSEGV)
deep_inside_training()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cpu_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert out.returncode == -signal.SIGSEGV
    text = log.read_text()
    assert "Fatal Python error: Segmentation fault" in text and "deep_inside_training" in text, text


# ---- rank environment from each launcher's variables (in-process, no launch) -------------------------------

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "LOCAL_SIZE",
                  "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def rank_env():
    """Set a launcher's variables (and nothing else of that kind) in os.environ; restore all of it afterwards
    (export_rank_env adds variables of its own, which monkeypatch would not undo)."""
    saved = dict(os.environ)

    def set_env(**env: str) -> os._Environ:
        for k in list(os.environ):
            if k in _LAUNCHER_VARS or k.startswith(("OMPI_", "SLURM_")):
                del os.environ[k]
        os.environ.update(env)
        return os.environ
    yield set_env
    os.environ.clear()
    os.environ.update(saved)


def test_rank_env_deepspeed_and_torchrun(rank_env):
    five = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="23456")
    rank_env(**five, CROSS_RANK="0", LOCAL_SIZE="2")
    assert dist_utils.export_rank_env() == "deepspeed"
    rank_env(**five, TORCHELASTIC_RUN_ID="none")
    assert dist_utils.export_rank_env() == "torchrun"
    env = rank_env(**five)
    assert dist_utils.export_rank_env() == "env" and env["MASTER_PORT"] == "23456"


def test_rank_env_srun(rank_env):
    env = rank_env(SLURM_PROCID="5", SLURM_STEP_ID="0", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8",
                    SLURM_LOCALID="1", SLURM_JOB_ID="4321", SLURM_JOB_NODELIST="gpu[07-08]")
    assert dist_utils.export_rank_env() == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("5", "8", "1", "gpu07")
    port = env["MASTER_PORT"]
    assert 20000 <= int(port) < 30000
    rank_env(SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="8", SLURM_LOCALID="0",
              SLURM_JOB_ID="4321", SLURM_JOB_NODELIST="gpu[07-08]")
    dist_utils.export_rank_env()
    assert os.environ["MASTER_PORT"] == port  # every task of the step derives the same port
    env = rank_env(SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID="0",
                    SLURM_JOB_ID="1", SLURM_JOB_NODELIST="n1", MASTER_ADDR="n9", MASTER_PORT="29999")
    dist_utils.export_rank_env()
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("n9", "29999")  # exported by a script: they win


def test_rank_env_batch_script_is_a_world_of_one(rank_env):
    """Inside sbatch but outside srun (no SLURM_STEP_ID), SLURM_NTASKS is the allocation, not this launch."""
    env = rank_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n1")
    assert dist_utils.export_rank_env() == "single" and env["WORLD_SIZE"] == "1"


def test_rank_env_mpirun_without_mpi4py(rank_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails: the job-id fallback
    ompi = dict(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
                OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid="1286209537")
    env = rank_env(**ompi)
    assert dist_utils.export_rank_env() == "mpi"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "2", "1", "127.0.0.1")
    assert 20000 <= int(env["MASTER_PORT"]) < 30000
    rank_env(**{**ompi, "OMPI_COMM_WORLD_SIZE": "4"})  # two nodes, nobody names rank 0's host
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        dist_utils.export_rank_env()


def test_rank_env_partial_is_an_error(rank_env):
    rank_env(RANK="1", WORLD_SIZE="2")
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        dist_utils.export_rank_env()
    env = rank_env()
    assert dist_utils.export_rank_env() == "single" and env["WORLD_SIZE"] == "1"


def test_forward_signals_ranks_not_launchers():
    """What the sbatch traps run: only processes with RANK and LOCAL_RANK (the ranks) get the signal."""
    tree = subprocess.Popen(["bash", "-c", "RANK=0 LOCAL_RANK=0 sleep 30 & sleep 30 & wait"],
                            start_new_session=True)
    try:
        import psutil

        def both_exec_sleep():
            # a forked child keeps bash's environment until it has exec'd ``sleep``: wait for both to have
            kids = psutil.Process(tree.pid).children()
            return len(kids) == 2 and all(k.name() == "sleep" for k in kids) and kids

        kids = wait_for(both_exec_sleep, 10, what="two children running sleep")
        rank = next(p for p in kids if "RANK" in p.environ())
        other = next(p for p in kids if p is not rank)
        assert forward(signal.SIGTERM, tree.pid) == [rank.pid]
        rank.wait(10)
        assert other.is_running() and tree.poll() is None
    finally:
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait()


def test_stop_signal_raises_at_startup_then_defers_to_the_loop():
    """Before training a signal stops the rank at once (nothing to save); during training it is a flag."""
    from finetune.errors import StopRequested
    from finetune.lifecycle.preemption import StopSignal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopRequested, match="SIGTERM before training started"):
        with StopSignal():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises as soon as the signal is delivered
    with StopSignal() as stop:
        stop.defer_to_loop()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal (Slurm and the launcher) changes nothing
        wait_for(stop.requested, 5)
        assert stop.exit_code() in (128 + signal.SIGUSR1, 128 + signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == before  # previous handlers back
    # Ctrl-C: a stop request like SIGTERM (one line before training, a checkpoint after); twice: at once
    with pytest.raises(StopRequested, match="SIGINT before training started"):
        with StopSignal():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    with StopSignal() as stop:
        stop.defer_to_loop()
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(stop.requested, 5)
        assert stop.exit_code() == 128 + signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)


def test_tokenization_workers_do_not_inherit_the_stop_handler(capfd):
    """The forked tokenization pool, started while a rank's stop handler is active and ended as ``Pool`` ends its
    workers (``SIGTERM``): no worker raises ``StopRequested`` (what a successful run printed as ``Process
    ForkPoolWorker-2 ... StopRequested: stopped by SIGTERM before training started``)."""
    from finetune.data import tokenization
    from finetune.lifecycle.preemption import StopSignal

    for _ in range(3):  # a worker ended before its initializer ran must not raise it either
        with StopSignal():
            with tokenization.fork_pool(2) as pool:
                assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
            with tokenization.fork_pool(2):
                pass  # ended at once: SIGTERM may reach a worker still starting
            time.sleep(0.5)  # the workers' stderr, if any
    err = capfd.readouterr().err
    assert "StopRequested" not in err and "ForkPoolWorker" not in err, err  # other tests' log noise may share fd 2


def test_init_timeout_covers_deepspeed_groups_and_shm_buffer_is_unlinked(tmp_path):
    """dist_utils.init: groups DeepSpeed creates later get train.dist_timeout_minutes too (not torch's 30 min),
    and the CPU backend's /dev/shm all-reduce buffer is unlinked once mapped (no RAM left behind)."""
    port = free_port()
    code = f"""
import os
from datetime import timedelta
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="{port}")
from finetune.parallel import distributed as d
d.init(0.5)
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
assert c10d._get_default_timeout(dist.Backend.GLOO) == timedelta(minutes=0.5)
g = dist.new_group([0])  # as DeepSpeed's ZeRO data-parallel group is made
name = f"/dev/shm/deepspeed_allreduce_buffer_{{os.getuid()}}_127.0.0.1_{port}_0"
assert not os.path.exists(name), name
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cpu_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-3000:]


def test_cpu_threads_are_a_share_of_the_cores(monkeypatch):
    """CPU ranks: torch threads = cores // ranks on the node, unless OMP_NUM_THREADS says otherwise."""
    import torch

    from finetune.parallel import distributed as dist_utils

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher, 2 ranks on this node
        assert dist_utils.set_cpu_threads().startswith(f"torch threads per rank: {max(1, cores // 2)} ")
        assert torch.get_num_threads() == max(1, cores // 2)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert "OMP_NUM_THREADS=3" in dist_utils.set_cpu_threads() and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
