"""Logging and metrics: loguru (rank-tagged, console on rank 0, one file per rank) and scalar sinks.

Scalars go to TensorBoard through DeepSpeed's own monitor (``engine.monitor``, enabled by the
``tensorboard`` section :func:`tensorboard_section` adds to the DeepSpeed config; it writes on rank 0
only) and, for scripts and tests, to ``metrics.jsonl`` in the run folder (one JSON object per event).
Eval artefacts (seq_cls: the confusion matrix) go to ``eval/step<N>_<name>.json`` in the run folder and,
when they are matrices, as an image (rendered with matplotlib) to the same TensorBoard writer.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from loguru import logger

__all__ = ["logger", "setup_logging", "tensorboard_section", "monitor_sections", "MetricsSink"]

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


def monitor_sections(ds: dict, run_dir: Path) -> dict:
    """``ds`` with DeepSpeed's monitor sections pointed into the run folder (DeepSpeed writes every scalar of
    :class:`MetricsSink` to each enabled monitor through ``engine.monitor``; no other code path).

    * ``tensorboard``: added when absent (:func:`tensorboard_section`): ``run_dir/tensorboard``.
    * ``csv_monitor`` (``ds.csv_monitor.enabled=true``): ``output_path`` defaults to the run folder and
      ``job_name`` to ``csv``: one ``run_dir/csv/<tag>.csv`` per scalar (``step,value`` rows).
    * ``wandb`` (``ds.wandb.enabled=true``, needs the ``wandb`` package): offline by default
      (``WANDB_MODE=offline`` unless set; air-gapped clusters), files under the run folder (``WANDB_DIR``
      unless set); ``wandb sync run_dir/wandb/offline-run-*`` uploads them later from a machine with internet.
    """
    import os

    ds = dict(ds)
    ds.setdefault("tensorboard", tensorboard_section(run_dir))
    csv = ds.get("csv_monitor")
    if isinstance(csv, dict) and csv.get("enabled"):
        ds["csv_monitor"] = {"output_path": str(run_dir), "job_name": "csv", **csv}
    wandb = ds.get("wandb")
    if isinstance(wandb, dict) and wandb.get("enabled"):
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(run_dir))
    return ds


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

    def write_artefacts(self, step: int, artefacts: dict[str, dict]) -> None:
        """Write each artefact (name -> JSON-able dict) to ``eval/step<N>_<name>.json``; one with ``labels`` and
        ``matrix`` also goes to TensorBoard as image ``eval/<name>`` (through DeepSpeed's monitor's writer)."""
        if not self.enabled or not artefacts:
            return
        folder = self.path.parent / "eval"
        folder.mkdir(exist_ok=True)
        for name, value in artefacts.items():
            (folder / f"step{step}_{name}.json").write_text(json.dumps({"step": step, **value}, indent=1))
            tb = getattr(getattr(self.engine, "monitor", None), "tb_monitor", None)
            writer = getattr(tb, "summary_writer", None)
            if writer is not None and "matrix" in value and "labels" in value:
                writer.add_image(f"eval/{name}", matrix_image(value["matrix"], value["labels"]), step,
                                 dataformats="HWC")
                writer.flush()


def matrix_image(matrix: list[list[int]], labels: list[str]):
    """RGB image (uint8 ``numpy`` array [height, width, 3]) of a confusion matrix with counts in the cells
    (rows: true class, columns: predicted class), rendered off-screen with matplotlib's Agg backend."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m = np.asarray(matrix)
    size = 1.5 + 0.5 * len(labels)
    fig = Figure(figsize=(size + 1, size), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(m, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            ax.text(j, i, str(m[i, j]), ha="center", va="center",
                    color="white" if m[i, j] > m.max() / 2 else "black")
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
