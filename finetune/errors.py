"""How a launch ends when it does not finish: the kinds of failure, their exit statuses and who prints them.

=====================  ===========  ================================================================================
kind                   exit status  printed
=====================  ===========  ================================================================================
:class:`ConfigError`   2            bad input (config, files, resume target), found before any GPU time is spent:
                                    one line per problem, by rank 0 only (every rank meets the same input)
:class:`RunFailure`    4            something failed while the run was working (a disk that filled during a save,
                                    a checkpoint that could not be converted or loaded): one line, naming the rank;
                                    a failure all ranks agreed on (the export check): one line by rank 0
:class:`TrainingDiverged`  3        ``train.max_bad_steps`` non-finite steps in a row, weights that are not finite
                                    at a save, or a final evaluation that is not finite: one line by rank 0
:class:`StopRequested` 128 + signal a stop signal before training started (after it, the loop checkpoints and the
                                    launch exits with the same status)
=====================  ===========  ================================================================================

Any other exception is a crash: its traceback goes to the rank's log, and the ranks' health records name the rank
that failed first (:mod:`finetune.lifecycle.health`).
"""

from __future__ import annotations

import os
import signal
import sys
import time

BAD_INPUT, DIVERGED, RUN_FAILED = 2, 3, 4
"""Exit statuses of :class:`ConfigError`, :class:`TrainingDiverged` and :class:`RunFailure`."""

RANK0_REPORT_GRACE_S = 10.0
"""Seconds a rank other than 0 waits before leaving after an error that rank 0 reports (:func:`report`)."""


class ConfigError(ValueError):
    """A run config, DeepSpeed config or input file is wrong. ``str(err)`` lists every problem, one per line."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class RunFailure(RuntimeError):
    """The run failed while working, not because of its input: a write that failed (disk full), a checkpoint that
    could not be converted or loaded, an export whose check failed. ``str(err)`` is one line that says what failed
    and what to do.

    ``agreed``: every rank raises it with the same verdict (a check the ranks settled together, such as the export
    check), so rank 0 alone prints it, as a :class:`ConfigError`; otherwise each rank prints its own line with its
    rank.
    """

    def __init__(self, message: str, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


class TrainingDiverged(RuntimeError):
    """The model diverged: ``train.max_bad_steps`` consecutive optimizer steps had a non-finite loss or gradient norm,
    a save found weights that are not finite, or the final evaluation's loss is not finite. Nothing is saved or
    exported from that state."""


class StopRequested(BaseException):
    """A stop signal (``SIGTERM``, ``SIGUSR1``) arrived before training started (:mod:`finetune.lifecycle.preemption`)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before training started")
        self.signum = signum


def _rank() -> int:
    """This process's rank from the launcher's environment (errors can come before the process group exists)."""
    return int(os.environ.get("RANK", "0"))


def _let_rank0_report() -> None:
    """On ranks other than 0, wait :data:`RANK0_REPORT_GRACE_S` before exiting after an error only rank 0 prints.

    Every rank meets the same bad input, but only rank 0 prints it. A launcher that stops all ranks when the first
    one fails (``deepspeed``, ``torchrun``, ``mpirun``) would otherwise kill rank 0 before it prints whenever another
    rank gets there first. When rank 0 exits, such a launcher ends this rank at once, so the wait costs nothing
    there; elsewhere it delays the failed launch's end by at most this long.
    """
    if _rank() != 0:
        time.sleep(RANK0_REPORT_GRACE_S)


def report(e: BaseException) -> int:
    """Print ``e`` as its kind is printed (see the module table) and return the exit status for it.

    Raises:
        TypeError: ``e`` is not one of this module's kinds (a crash is not reported here).
    """
    if isinstance(e, ConfigError):
        if _rank() == 0:
            for line in e.problems:
                print(f"finetune: error: {line}", file=sys.stderr, flush=True)
        _let_rank0_report()
        return BAD_INPUT
    if isinstance(e, TrainingDiverged):
        if _rank() == 0:
            print(f"finetune: error: {e}", file=sys.stderr, flush=True)
        _let_rank0_report()
        return DIVERGED
    if isinstance(e, RunFailure) and e.agreed:
        if _rank() == 0:
            print(f"finetune: error: {e}", file=sys.stderr, flush=True)
        _let_rank0_report()
        return RUN_FAILED
    if isinstance(e, RunFailure):
        print(f"finetune: error: rank {_rank()}: {e}", file=sys.stderr, flush=True)
        return RUN_FAILED
    if isinstance(e, StopRequested):
        print(f"finetune: rank {_rank()} {e}", file=sys.stderr, flush=True)
        return 128 + e.signum
    raise TypeError(f"not a finetune error: {type(e).__name__}")
