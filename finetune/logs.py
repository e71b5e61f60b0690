"""Logging and metrics: loguru (rank-tagged, console on rank 0, one file per rank) and scalar sinks.

Scalars go to TensorBoard through DeepSpeed's own monitor (``engine.monitor``, enabled by the
``tensorboard`` section :func:`tensorboard_section` adds to the DeepSpeed config; it writes on rank 0
only) and, for scripts and tests, to ``metrics.jsonl`` in the run folder (one JSON object per event).
Eval artefacts (seq_cls: the confusion matrix) go to ``eval/step<N>_<name>.json`` in the run folder and,
when they are matrices, as an image (rendered with matplotlib) to the same TensorBoard writer.
The training meter (throughput, padding, MFU) is :class:`finetune.training.meter.StepMeter`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from loguru import logger
from tqdm import tqdm


__all__ = ["logger", "setup_logging", "tensorboard_section", "monitor_sections", "MetricsSink", "read_metrics_file"]

_FORMAT = "{time:YYYY-MM-DD HH:mm:ss} | {level:<7} | rank {extra[rank]} | {message}"


def setup_logging(run_dir: Path | None, rank: int) -> None:
    """Console sink (INFO on rank 0, WARNING elsewhere; written through tqdm so bars stay intact) and,
    when ``run_dir`` is given, ``run_dir/logs/rank{rank}.log`` at DEBUG."""
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


def read_metrics_file(path: Path) -> tuple[list[dict], int]:
    """The rows of a ``metrics.jsonl`` and how many lines could not be read.

    A line cut by a kill or a full disk, or holding bytes that are not UTF-8 JSON, is skipped and counted,
    so a damaged file still gives every readable row.

    Returns:
        ``(rows, skipped)``: the JSON objects in file order and the number of non-empty lines skipped.
    """
    rows, skipped = [], 0
    for raw in Path(path).read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            skipped += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


class StartupClock:
    """Wall-clock seconds of a launch's start-up phases, the first one counted from the process's start (its
    creation time in ``/proc``, via ``psutil``: imports included).

    :meth:`mark` ends a phase; :meth:`summary` is one line such as ``start-up 14.2 s since the process started:
    imports and checks 5.1 s, process group 0.4 s, ...``.
    """

    def __init__(self):
        import psutil

        self.start = self.last = psutil.Process().create_time()
        self.parts: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        """End the phase ``name`` now."""
        now = time.time()
        self.parts.append((name, now - self.last))
        self.last = now

    def summary(self) -> str:
        """The phases so far, in seconds, with their total."""
        return (f"start-up {self.last - self.start:.1f} s since the process started: "
                + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.parts))


class MetricsSink:
    """Writes scalar events to DeepSpeed's monitor (TensorBoard) and ``metrics.jsonl``; rank 0 only.

    Every ``metrics.jsonl`` row is ``{"step": int, "launch": int, "<tag>": float | null, ..., "time": float,
    "cpu_time": float}``:
    ``launch`` is the launch that wrote it (a resumed run re-runs the steps after its checkpoint, so a step can
    have rows of two launches: the later launch's row is the one that counts), a non-finite value is ``null`` so
    every line stays valid JSON, ``time`` is the wall-clock time of the write (Unix seconds; step times and
    the time to the first step in ``scripts/bench.py``) and ``cpu_time`` the CPU seconds rank 0's process has used
    so far (all its threads; ``time.process_time``): a loop bound by the host shows it growing as fast as ``time``.

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
        # With its monitor enabled, DeepSpeed's engine writes an event of its own on every optimizer step
        # (``Train/Samples/lr``, flushed at once; ``engine.step()`` in deepspeed/runtime/engine.py): a duplicate of
        # ``train/lr`` that costs rank 0 a write and a flush per step (~1% of a 0.1 s step on a CPU rank, and the
        # writer thread's work; py-spy on the seq_cls bench preset). Turned off here, except when DeepSpeed has
        # something of its own to write there: the loss scale of fp16 runs (``Train/Samples/loss_scale``, with the
        # lr), or the timers of ``wall_clock_breakdown`` / ``flops_profiler``. ``MonitorMaster.write_events`` does
        # not read the flag, so every event of this sink still reaches every enabled monitor.
        if enabled and self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb+") as f:  # a launch killed mid-line left a torn row: start a fresh line
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        monitor = getattr(engine, "monitor", None)
        if monitor is not None and not (engine.fp16_enabled() or engine.wall_clock_breakdown()
                                        or engine.flops_profiler_enabled()):
            monitor.enabled = False

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (tag -> float) at optimizer step ``step``."""
        if not self.enabled:
            return
        self.engine.monitor.write_events([(tag, float(v), step) for tag, v in scalars.items()])
        row = {"step": step, "launch": self.launch,
               **{k: (float(v) if math.isfinite(float(v)) else None) for k, v in scalars.items()}, "time": time.time(),
               "cpu_time": time.process_time()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")

    def write_generations(self, step: int, records: list[dict], shown: int = 3) -> None:
        """``train.eval_generate``'s records (prompt, reference, output, scores) to ``eval/step<N>_generations.jsonl``,
        the first ``shown`` to TensorBoard as text ``eval/generations`` (Markdown)."""
        if not self.enabled:
            return
        folder = self.path.parent / "eval"
        folder.mkdir(exist_ok=True)
        with open(folder / f"step{step}_generations.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps({"step": step, **r}) + "\n")
        tb = getattr(getattr(self.engine, "monitor", None), "tb_monitor", None)
        writer = getattr(tb, "summary_writer", None)
        if writer is not None and records:
            def cell(t) -> str:
                return str(t).replace("|", "\\|").replace("\n", "<br>")
            rows = [f"| {cell(r['prompt'][-300:])} | {cell(r['reference'])} | {cell(r['output'])} | "
                    f"{r['exact_match'] if r['exact_match'] is not None else '-'} | {r['rougeL']:.3f} |"
                    for r in records[:shown]]
            writer.add_text("eval/generations", "\n".join(["| prompt (end) | reference | output | exact match | ROUGE-L |",
                                                          "|---|---|---|---|---|", *rows]), step)
            writer.flush()

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
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # here: the ranks' start-up does without it
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
