"""Helpers for the launcher, Slurm and preemption tests: installing what they need, run configs, reading wiring.

The tests start the real toolkit under every launcher with the same tiny run config (:data:`RUN_OVERRIDES`),
so their per-step losses can be compared with one reference run. Each rank writes a wiring line to its
``logs/rank<r>.log`` (see ``finetune.parallel.distributed.describe``), which :func:`wiring` reads back.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import BIN, REPO, launch, ok, train_losses

# The run every launcher test trains: tiny GPT-2, fp32, STEPS steps, no evaluation or checkpoint before the end
# (long enough for a signal to land mid-run; the LR schedule depends on it, so resumed runs use it too).
CONFIG = REPO / "tests" / "configs" / "tiny_gpt.yaml"
STEPS = 20
RUN_OVERRIDES = [f"train.max_steps={STEPS}", "train.eval_every=0", "train.eval_max_batches=1", "train.save_every=0",
                 "train.log_every=1", "export=false"]

_WIRING = re.compile(r"wiring: rank (\d+) of (\d+), local rank (\d+), launcher (\S+), host (\S+), pid (\d+), "
                     r"master (\S+):(\d+)")


_REFERENCE: dict = {}


def reference_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """Run ``deepspeed --num_gpus 2`` on :data:`RUN_OVERRIDES` once per session; ``(run folder, step -> loss)``."""
    if "run" not in _REFERENCE:
        run_dir = tmp_path_factory.mktemp("reference") / "run"
        ok(launch(CONFIG, [f"output_dir={run_dir}", *RUN_OVERRIDES]))
        _REFERENCE["run"] = (run_dir, train_losses(run_dir))
    return _REFERENCE["run"]


def apt_install(packages) -> None:
    """``apt-get update`` then ``apt-get install -y packages`` (root only); raises RuntimeError on failure."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(f"cannot install {' '.join(packages)}: not root or no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    for cmd in (["apt-get", *lock, "update", "-qq"], ["apt-get", *lock, "install", "-y", "-qq", *packages]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")


def ensure_openmpi() -> str:
    """``mpirun`` (Debian ``openmpi-bin libopenmpi-dev``) and ``mpi4py`` in this venv; returns mpirun's path."""
    if not shutil.which("mpirun") or not shutil.which("mpicc"):  # mpicc: libopenmpi-dev, in case pip builds mpi4py
        apt_install(["openmpi-bin", "libopenmpi-dev"])
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mpi4py>=4"], capture_output=True,
                             text=True, timeout=1200)
        if out.returncode != 0:
            raise RuntimeError(f"pip install mpi4py failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return shutil.which("mpirun")


def wiring(run_dir: Path) -> dict[int, dict]:
    """Rank -> {world, local_rank, launcher, host, pid, master} from the wiring lines of ``logs/rank*.log``.

    A rank that logged several wiring lines (a resumed run) reports its last one.
    """
    found = {}
    for log in sorted((Path(run_dir) / "logs").glob("rank*.log")):
        for m in _WIRING.finditer(log.read_text(errors="replace")):
            found[int(m.group(1))] = {"world": int(m.group(2)), "local_rank": int(m.group(3)),
                                      "launcher": m.group(4), "host": m.group(5), "pid": int(m.group(6)),
                                      "master": f"{m.group(7)}:{m.group(8)}"}
    return found


def assert_wiring(run_dir: Path, launcher: str, world: int = 2) -> dict[int, dict]:
    """Every rank 0..world-1 logged one wiring line with this world size and launcher, distinct pids, one master."""
    w = wiring(run_dir)
    assert sorted(w) == list(range(world)), f"ranks that logged their wiring: {sorted(w)}"
    assert {v["world"] for v in w.values()} == {world}
    assert {v["launcher"] for v in w.values()} == {launcher}, w
    assert len({v["pid"] for v in w.values()}) == world
    assert len({v["master"] for v in w.values()}) == 1, w
    assert sorted(v["local_rank"] for v in w.values()) == list(range(world))  # one node here
    return w


def assert_same_losses(run_dir: Path, reference: dict[int, float], steps=None, rel: float = 1e-6) -> None:
    """Per-step train losses of ``run_dir`` equal ``reference`` (relative ``rel``) on ``steps`` (default: all)."""
    got = train_losses(run_dir)
    steps = sorted(reference) if steps is None else list(steps)
    assert set(steps) <= set(got), f"steps logged: {sorted(got)}, expected {steps}"
    for s in steps:
        assert abs(got[s] - reference[s]) <= rel * abs(reference[s]), \
            f"step {s}: loss {got[s]!r} differs from the reference {reference[s]!r}"


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate()`` until it returns a truthy value; returns it (raises TimeoutError)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached after {timeout}s")


def logged_steps(run_dir: Path) -> int:
    """Highest optimizer step in ``metrics.jsonl`` so far (0 when none; tolerates a half-written line)."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return 0
    steps = re.findall(r'^\{"step": (\d+), (?:"launch": \d+, )?"train/loss"', p.read_text(), re.M)
    return max(map(int, steps), default=0)


__all__ = ["BIN", "REPO", "CONFIG", "STEPS", "reference_run", "RUN_OVERRIDES", "apt_install", "ensure_openmpi", "wiring", "assert_wiring",
           "assert_same_losses", "wait_for", "logged_steps"]
