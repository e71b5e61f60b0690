"""Stop on a scheduler's signal: finish the current step, save a complete checkpoint, exit.

Slurm sends ``SIGUSR1`` ahead of a time limit when asked (``#SBATCH --signal=B:USR1@<seconds>``) and
``SIGTERM`` when it preempts or cancels. :class:`StopSignal` only records that a signal arrived; the loop
asks :meth:`StopSignal.requested` once per optimizer step and all ranks agree through one all-reduce
(``finetune.distributed.any_rank``), so a signal that reached one rank stops all of them at the same
step, after which every rank saves the same checkpoint.
"""

from __future__ import annotations

import signal

from finetune.logs import logger

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignal:
    """Context manager that turns ``SIGUSR1``/``SIGTERM`` into a flag (previous handlers restored on exit)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):  # noqa: ARG002
        if self.signum is None:
            logger.warning(f"received {signal.Signals(signum).name}: will checkpoint after this step and stop")
        self.signum = signum

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
        """Exit status after a signal-triggered stop: ``128 + signal number``, as a shell reports a signal."""
        return 128 + (self.signum or 0)
