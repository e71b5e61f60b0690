"""Logging and metrics: loguru (rank-tagged, console on rank 0, one file per rank) and scalar sinks.

Scalars go to TensorBoard through DeepSpeed's own monitor (``engine.monitor``, enabled by the
``tensorboard`` section :func:`tensorboard_section` adds to the DeepSpeed config; it writes on rank 0
only) and, for scripts and tests, to ``metrics.jsonl`` in the run folder (one JSON object per event).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from loguru import logger

__all__ = ["logger", "setup_logging", "tensorboard_section", "MetricsSink"]

_FORMAT = "{time:YYYY-MM-DD HH:mm:ss} | {level:<7} | rank {extra[rank]} | {message}"


def setup_logging(run_dir: Path | None, rank: int) -> None:
    """Console sink (INFO on rank 0, WARNING elsewhere; written through tqdm so bars stay intact) and,
    when ``run_dir`` is given, ``run_dir/logs/rank{rank}.log`` at DEBUG."""
    from tqdm import tqdm

    logger.remove()
    logger.configure(extra={"rank": rank})
    logger.add(lambda m: tqdm.write(m, end="", file=sys.stderr), format=_FORMAT,
               level="INFO" if rank == 0 else "WARNING", colorize=False)
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        logger.add(run_dir / "logs" / f"rank{rank}.log", format=_FORMAT, level="DEBUG", enqueue=False)


def tensorboard_section(run_dir: Path) -> dict:
    """DeepSpeed ``tensorboard`` monitor section writing under ``run_dir/tensorboard``."""
    return {"enabled": True, "output_path": str(run_dir), "job_name": "tensorboard"}


class MetricsSink:
    """Writes scalar events to DeepSpeed's monitor (TensorBoard) and ``metrics.jsonl``; rank 0 only.

    Every ``metrics.jsonl`` row is ``{"step": int, "launch": int, "<tag>": float | null, ...}``: ``launch`` is
    the launch that wrote it (a resumed run re-runs the steps after its checkpoint, so a step can have rows
    of two launches: the later launch's row is the one that counts), and a non-finite value is ``null`` so
    every line stays valid JSON.

    Args:
        engine: the DeepSpeed engine (``engine.monitor.write_events`` takes ``[(tag, value, step)]``).
        run_dir: run folder for ``metrics.jsonl``.
        enabled: False on ranks other than 0.
        launch: this launch's number in the run folder.
    """

    def __init__(self, engine, run_dir: Path, enabled: bool, launch: int = 1):
        self.engine = engine
        self.enabled = enabled
        self.launch = launch
        self.path = run_dir / "metrics.jsonl"

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (tag -> float) at optimizer step ``step``."""
        if not self.enabled:
            return
        self.engine.monitor.write_events([(tag, float(v), step) for tag, v in scalars.items()])
        row = {"step": step, "launch": self.launch,
               **{k: (float(v) if math.isfinite(float(v)) else None) for k, v in scalars.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
