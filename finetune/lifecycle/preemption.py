"""Stop on a scheduler's signal: finish the current step, save a complete checkpoint, exit.

Slurm sends ``SIGUSR1`` ahead of a time limit when asked (``#SBATCH --signal=B:USR1@<seconds>``) and
``SIGTERM`` when it preempts or cancels. :class:`StopSignal` only records that a signal arrived; the loop
asks :meth:`StopSignal.requested` once per optimizer step and all ranks agree through one all-reduce
(``finetune.parallel.distributed.any_rank``), so a signal that reached one rank stops all of them at the same
step, after which every rank saves the same checkpoint and the launch exits with ``128 + signal``.

Signals have to reach the ranks. ``SIGTERM`` from Slurm reaches every process of the job. ``B:USR1``
reaches only the batch shell, and neither the ``deepspeed`` launcher nor ``torchrun`` forwards ``SIGUSR1``
(its default action would even kill them), so the shipped sbatch scripts trap it and run
``python -m finetune.lifecycle.preemption forward USR1 <launcher pid>`` (:func:`forward`), which signals exactly the
ranks under that launcher (processes whose environment has ``RANK`` and ``LOCAL_RANK``) and any ``srun``
below it (``srun`` forwards ``SIGUSR1`` to its tasks on every node).

The launcher is not the end of a launch. On ``SIGTERM`` the ``deepspeed`` command exits at once (143)
while its ``launch.py`` child and the ranks go on to checkpoint for seconds; a batch shell that waited on
the launcher's pid would end the job (Slurm then kills or loses the ranks) before ``COMPLETE`` is written.
So the sbatch scripts start the launcher through ``python -m finetune.lifecycle.preemption run -- <launcher ...>``
(:func:`run_launcher`): a child subreaper that returns only once the launcher *and every process below
it* (the ranks, orphaned or not, ``srun``) have exited.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psutil

from finetune.errors import StopRequested
from finetune.logs import logger

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager for ``SIGUSR1``/``SIGTERM``/``SIGINT`` (previous handlers restored on exit).

    Before :meth:`defer_to_loop` (start-up: data, model, engine) a signal raises :class:`StopRequested`:
    there is nothing to checkpoint yet, so the rank stops at once, with one line. After it, a signal only sets the
    flag the training loop polls. A second signal does not kill the process then: under Slurm a rank can get
    ``SIGTERM`` both from Slurm and from its launcher, and a Ctrl-C in a terminal reaches the ranks as ``SIGINT``
    and again as the launcher's ``SIGTERM``; the checkpoint must still be written. Only a second ``SIGINT`` (Ctrl-C
    pressed twice) raises ``KeyboardInterrupt`` at once, without a checkpoint, as Python's default handler does.
    ``SIGKILL`` remains the hard stop.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}
        self._deferred = False
        self._interrupted = False

    def _handle(self, signum, frame):  # noqa: ARG002
        if not self._deferred:
            self.signum = signum
            raise StopRequested(signum)
        if signum == signal.SIGINT:
            if self._interrupted:
                raise KeyboardInterrupt
            self._interrupted = True
        if self.signum is None:
            again = " (Ctrl-C again: stop at once, no checkpoint)" if signum == signal.SIGINT else ""
            logger.warning(f"received {signal.Signals(signum).name}: will checkpoint after this step and stop{again}")
        self.signum = signum

    def defer_to_loop(self) -> None:
        """From now on a signal only sets the flag (:meth:`requested`) the training loop checks every step."""
        self._deferred = True

    def __enter__(self) -> "StopSignal":
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def requested(self) -> bool:
        """True once a stop signal arrived on this rank."""
        return self.signum is not None

    def exit_code(self) -> int:
        """Exit status after a signal-triggered stop: ``128 + signal number``, as a shell reports a signal.

        A stop that came from another rank (no signal here) reports ``128 + SIGTERM``.
        """
        return 128 + (self.signum or signal.SIGTERM)


def rank_processes(root_pid: int) -> list:
    """Processes at or below ``root_pid`` to signal: ranks (``RANK`` and ``LOCAL_RANK`` in their environment, which
    every launcher but ``srun`` and ``mpirun`` sets and no launcher process has) and ``srun``/``mpirun``
    processes, which forward the signal to their tasks. Launchers themselves are left alone."""
    try:
        root = psutil.Process(root_pid)
        below = [root] + root.children(recursive=True)  # the root itself may be srun
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in below:
        try:
            if p.name() in ("srun", "mpirun", "mpiexec", "orterun", "prterun"):
                found.append(p)
                continue
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            found.append(p)
    return found


def forward(signum: int, root_pid: int) -> list[int]:
    """Send ``signum`` to the ranks (and ``srun``/``mpirun``) under ``root_pid``; returns the pids signalled."""
    sent = []
    for p in rank_processes(root_pid):
        try:
            p.send_signal(signum)
            sent.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return sent


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _say(msg: str) -> None:
    """One line in the job log, stamped like the sbatch scripts' own lines (milliseconds: tests compare them)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"[finetune {stamp}] {msg}", file=sys.stderr, flush=True)


def _become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux ``PR_SET_CHILD_SUBREAPER``); False elsewhere."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _shell_status(returncode: int) -> int:
    """A Python return code (negative: killed by that signal) as a shell reports it (128 + signal)."""
    return returncode if returncode >= 0 else 128 - returncode


def run_launcher(cmd: list[str], poll_s: float = 60.0) -> int:
    """Run a launcher and return once it and every process it started have exited.

    The calling process becomes a child subreaper, so ranks whose launcher exits first (``deepspeed`` on
    ``SIGTERM``: the runner dies at once, its ``launch.py`` child gives the ranks up to 30 s) are re-parented
    here and reaped here: nothing of the launch outlives this function. ``SIGTERM``/``SIGUSR1``/``SIGINT``
    sent to this process are only noted (the ranks get them from Slurm or from the batch shell's trap, and
    must be left to checkpoint); Slurm's ``KillWait`` ``SIGKILL`` still ends everything.

    Args:
        cmd: the launcher command line (``deepspeed ...``, ``torchrun ...``, ``srun ...``).
        poll_s: seconds between "still waiting for ..." lines while left-over processes run.

    Returns:
        The launcher's exit status (128 + signal when a signal killed it).
    """
    subreaper = _become_subreaper()
    signals: list[int] = []

    def note(signum, frame):  # noqa: ARG001
        signals.append(signum)

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        launcher = subprocess.Popen(cmd)  # caught signals are reset to their defaults in the child (exec)
        rc = _shell_status(launcher.wait())
        if not subreaper:
            _say(f"launcher exited with status {rc} (cannot wait for processes it left: no child subreaper here)")
            return rc
        left = [p for p in psutil.Process().children(recursive=True)]
        if left:
            _say(f"launcher exited with status {rc}; waiting for the {len(left)} process(es) it left running "
                 f"(ranks finishing their checkpoint): {' '.join(str(p.pid) for p in left)}")
        statuses = []
        deadline = time.time() + poll_s
        while True:
            try:  # orphans are our children now: reap each as it exits
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                statuses.append(f"{pid}:{_shell_status(os.waitstatus_to_exitcode(code))}")
                continue
            if time.time() > deadline:
                alive = []
                for p in psutil.Process().children(recursive=True):
                    try:
                        alive.append(f"{p.pid} ({' '.join(p.cmdline()[:3])})")
                    except psutil.Error:
                        pass
                _say(f"still waiting for: {' '.join(alive)}")
                deadline = time.time() + poll_s
            time.sleep(0.1)
        if statuses:
            _say(f"left-over processes exited (pid:status): {' '.join(statuses)}")
        got = f" (got {', '.join(sorted({signal.Signals(x).name for x in signals}))})" if signals else ""
        _say(f"every process of the launch has exited{got}; launcher status {rc}")
        return rc
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    """``python -m finetune.lifecycle.preemption forward <SIGNAL> <launcher pid>`` (what the sbatch scripts' traps run) and
    ``python -m finetune.lifecycle.preemption run -- <launcher ...>`` (how they start the launcher)."""
    p = argparse.ArgumentParser(prog="python -m finetune.lifecycle.preemption",
                                description="Forward a stop signal from a batch shell to the ranks under a launcher; "
                                            "run a launcher until every rank it started has exited.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a launcher; return once it and every process below it have exited")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="the launcher command line (after --)")
    f = sub.add_parser("forward", help="signal the ranks (and srun/mpirun) below a launcher process")
    f.add_argument("signal", help="signal name or number, e.g. USR1, TERM, 10")
    f.add_argument("pid", type=int, help="the launcher's pid (e.g. $! after starting it in the background)")
    args = p.parse_args(argv)
    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            p.error("run: give the launcher command after --")
        return run_launcher(cmd)
    name = args.signal.upper()
    signum = int(name) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    sent = forward(signum, args.pid)
    print(f"finetune.lifecycle.preemption: sent {signal.Signals(signum).name} to {len(sent)} process(es) under pid "
          f"{args.pid}: {' '.join(map(str, sent)) or '-'}", file=sys.stderr, flush=True)
    return 0 if sent else 1


if __name__ == "__main__":
    sys.exit(main())
