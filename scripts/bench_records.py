"""Shared by the Trainer-based contenders of ``scripts/bench.py`` (``bench_hf.py``, ``bench_st.py``, ``bench_trl.py``,
launched from this folder): the callback that records each optimizer step's end and logged loss, and the way every
contender process leaves."""

from __future__ import annotations

import os
import sys
import time


def step_meter(step_ends: list[float], step_cpu: list[float], losses: dict[int, float],
               logged: dict[str, dict[int, float]] | None = None):
    """A ``transformers.TrainerCallback`` appending the wall time (Unix seconds) and the process CPU time at the end
    of each optimizer step to ``step_ends`` and ``step_cpu``, each logged loss to ``losses`` by step, and each
    value logged under a key of ``logged`` (e.g. ``{"reward": rewards}``) to that key's dict by step."""
    from transformers import TrainerCallback

    records = {"loss": losses, **(logged or {})}

    class Meter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.time())
            step_cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            for key, values in records.items():
                if logs and key in logs:
                    values[state.global_step] = float(logs[key])

    return Meter()


def leave() -> None:
    """End the process without the interpreter's teardown, after a last barrier when a process group is up.

    With Trainer's process group still up, gloo's threads torn down at exit aborted a finished launch ("terminate
    called without an active exception", 1 launch in ~30), and ``destroy_process_group()`` first did not prevent it.
    Every rank is past its last collective after the barrier."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
