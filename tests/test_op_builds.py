"""DeepSpeed's just-in-time op builds: a lock a killed build left behind is named, not waited on in silence
(:mod:`finetune.parallel.op_builds`), ``train.op_build_dir`` and ``finetune doctor``'s row.

Every lock here lives in a temporary build folder: a stale lock in the real ``~/.cache/torch_extensions`` would hang
every launch on this machine.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from conftest import CONFIGS, REPO, cpu_env

from finetune.commands import doctor
from finetune.errors import ConfigError
from finetune.parallel import op_builds

OP = "deepspeed_shm_comm"  # the op DeepSpeed's CPU accelerator builds inside init_distributed


def _stale_lock(root: Path, age_s: float = 0.0) -> Path:
    """A lock as a killed build leaves it: the file exists and no process holds it."""
    lock = root / OP / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    if age_s:
        os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_launch_names_a_stale_build_lock(tmp_path):
    """A launch whose op build folder holds a lock left by a killed build (issue 68, item 8: it waited in
    init_distributed forever, printing nothing) says so in one line naming the file and the rm command, while it
    waits; the folder is ``train.op_build_dir`` with ``{job}`` replaced by the Slurm job id."""
    lock = _stale_lock(tmp_path / "ext_4242", age_s=3 * 3600)
    env = cpu_env(SLURM_JOB_ID="4242")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "finetune/run.py", "--config", str(CONFIGS / "tiny_gpt.yaml"),
                             f"output_dir={tmp_path / 'run'}", f"train.op_build_dir={tmp_path / 'ext_{job}'}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, deadline, found = [], time.monotonic() + 120, None
    try:
        while time.monotonic() < deadline and found is None and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                out.append(line)
                found = line if "no process on this host holds" in line else None
    finally:
        proc.kill()
        proc.wait()
    assert found is not None, "no line about the stale lock within 120 s:\n" + "".join(out)[-3000:]
    assert f"rm {lock}" in found and "created 3.0 h ago" in found, found
    assert not (tmp_path / "run").exists()  # it waits before the run folder exists, as the issue describes


def test_only_an_unheld_lock_is_reported(tmp_path):
    """The watch reports a lock nobody holds after its wait, once, while DeepSpeed's wait (torch's ``FileBaton``)
    goes on; removing the file ends that wait. A lock a live build holds (a process with it open, as ``FileBaton``
    keeps it for the whole build) is never reported."""
    stale = _stale_lock(tmp_path / "a")
    lines = []
    watch = op_builds.LockWatch(tmp_path / "a", lines.append, after=1.0, poll=0.1).start()
    waiter = threading.Thread(target=FileBaton(str(stale)).wait, daemon=True)
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert len(lines) == 1 and f"rm {stale}" in lines[0], lines
        assert waiter.is_alive()
        stale.unlink()
        waiter.join(timeout=5)
        assert not waiter.is_alive()
    finally:
        watch.stop()

    held = tmp_path / "b" / OP / "lock"
    held.parent.mkdir(parents=True)
    builder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
                                f"assert FileBaton({str(held)!r}).try_acquire()\nprint('held', flush=True)\n"
                                "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        quiet = []
        watch = op_builds.LockWatch(tmp_path / "b", quiet.append, after=0.5, poll=0.1).start()
        time.sleep(2.0)
        watch.stop()
        assert quiet == [] and op_builds.holders(held) == [builder.pid]
    finally:
        builder.kill()
        builder.wait()
    assert op_builds.stale_locks(tmp_path / "b") == [(held, pytest.approx(0, abs=120))]  # its builder was killed


def test_extensions_root_is_torchs(tmp_path, monkeypatch):
    """The folder watched is the one torch builds in: with ``TORCH_EXTENSIONS_DIR`` and with torch's default."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert Path(cpp_extension._get_build_directory("probe", False)).parent == op_builds.extensions_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert Path(cpp_extension._get_build_directory("probe", False)).parent == op_builds.extensions_root()


def test_op_build_dir_unwritable(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"train\.op_build_dir: cannot create or write .*file/ext"):
        op_builds.use_build_dir(str(blocker / "ext"))
    assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_doctor_reports_a_stale_build_lock(capsys, tmp_path, monkeypatch):
    """``finetune doctor`` names a lock left in the op build folder: a blocker when hours old, a warning when it may
    be another host's build in progress."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    lock = _stale_lock(tmp_path / "ext", age_s=3 * 3600)
    args = [str(CONFIGS / "tiny_gpt.yaml"), f"output_dir={tmp_path / 'run'}", f"train.op_build_dir={tmp_path / 'ext'}"]
    assert doctor.main(args) == 2
    row = next(line for line in capsys.readouterr().out.splitlines() if str(lock) in line)
    assert row.split()[:2] == ["ops", "FAIL"] and f"rm {lock}" in row, row
    os.utime(lock)  # a minute-old lock: maybe a build on another node
    doctor.main(args)
    row = next(line for line in capsys.readouterr().out.splitlines() if str(lock) in line)
    assert row.split()[:2] == ["ops", "warn"], row
