"""Stop on a scheduler's signal: finish the current step, save a complete checkpoint, exit.

Slurm sends ``SIGUSR1`` ahead of a time limit when asked (``#SBATCH --signal=B:USR1@<seconds>``) and
``SIGTERM`` when it preempts or cancels. :class:`StopSignal` only records that a signal arrived; the loop
asks :meth:`StopSignal.requested` once per optimizer step and all ranks agree through one all-reduce
(``finetune.distributed.any_rank``), so a signal that reached one rank stops all of them at the same
step, after which every rank saves the same checkpoint and the launch exits with ``128 + signal``.

Signals have to reach the ranks. ``SIGTERM`` from Slurm reaches every process of the job. ``B:USR1``
reaches only the batch shell, and neither the ``deepspeed`` launcher nor ``torchrun`` forwards ``SIGUSR1``
(its default action would even kill them), so the shipped sbatch scripts trap it and run
``python -m finetune.preemption forward USR1 <launcher pid>`` (:func:`forward`), which signals exactly the
ranks under that launcher (processes whose environment has ``RANK`` and ``LOCAL_RANK``) and any ``srun``
below it (``srun`` forwards ``SIGUSR1`` to its tasks on every node).
"""

from __future__ import annotations

import argparse
import signal
import sys

from finetune.logs import logger

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequested(BaseException):
    """Raised by :class:`StopSignal`'s handler for a signal that arrives before training starts."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before training started")
        self.signum = signum


class StopSignal:
    """Context manager for ``SIGUSR1``/``SIGTERM`` (previous handlers restored on exit).

    Before :meth:`defer_to_loop` (start-up: data, model, engine) a signal raises :class:`StopRequested`:
    there is nothing to checkpoint yet, so the rank stops at once. After it, a signal only sets the flag
    the training loop polls. A second signal does not kill the process then: under Slurm a rank can get
    ``SIGTERM`` both from Slurm and from its launcher, and the checkpoint must still be written.
    ``SIGKILL`` remains the hard stop.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}
        self._deferred = False

    def _handle(self, signum, frame):  # noqa: ARG002
        if not self._deferred:
            self.signum = signum
            raise StopRequested(signum)
        if self.signum is None:
            logger.warning(f"received {signal.Signals(signum).name}: will checkpoint after this step and stop")
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
    import psutil

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
    import psutil

    sent = []
    for p in rank_processes(root_pid):
        try:
            p.send_signal(signum)
            sent.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return sent


def main(argv: list[str] | None = None) -> int:
    """``python -m finetune.preemption forward <SIGNAL> <launcher pid>`` (what the sbatch scripts' traps run)."""
    p = argparse.ArgumentParser(prog="python -m finetune.preemption",
                                description="Forward a stop signal from a batch shell to the ranks under a launcher.")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("forward", help="signal the ranks (and srun/mpirun) below a launcher process")
    f.add_argument("signal", help="signal name or number, e.g. USR1, TERM, 10")
    f.add_argument("pid", type=int, help="the launcher's pid (e.g. $! after starting it in the background)")
    args = p.parse_args(argv)
    name = args.signal.upper()
    signum = int(name) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    sent = forward(signum, args.pid)
    print(f"finetune.preemption: sent {signal.Signals(signum).name} to {len(sent)} process(es) under pid "
          f"{args.pid}: {' '.join(map(str, sent)) or '-'}", file=sys.stderr, flush=True)
    return 0 if sent else 1


if __name__ == "__main__":
    sys.exit(main())
