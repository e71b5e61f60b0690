"""The training curves of run folders as one PNG (``finetune report``, and ``report.png`` at the end of a run).

Reads each run folder's ``metrics.jsonl`` (:class:`finetune.logs.MetricsSink`; for a step written by two
launches, the later launch's row counts) and draws seven panels against the optimizer step: train and eval
loss, eval perplexity, accuracy (``eval/accuracy``, ``eval/masked_accuracy``, preference ``rewards/accuracies``),
reward (``grpo``'s ``train/reward`` and ``eval/reward``), learning rate, gradient
norm and training tokens/s (loss, perplexity and gradient norm on a log scale). Rendered off-screen with
matplotlib's Agg backend, so it works on a login node without a display. ``finetune train`` writes
``report.png`` into the run folder at the end of every run (rank 0).
"""

from __future__ import annotations

import json
from pathlib import Path


from finetune.errors import ConfigError
from finetune.logs import logger, read_metrics_file

PANELS = ("loss", "perplexity", "accuracy", "reward", "learning rate", "grad norm", "throughput")
"""Panel titles, in drawing order (row-major, 2 rows x 4 columns, the last slot empty)."""
_SERIES = {  # panel -> (metrics.jsonl key, legend suffix) drawn in it
    "loss": (("train/loss", "train"), ("eval/loss", "eval")),
    "perplexity": (("eval/perplexity", "eval"),),
    "accuracy": (("eval/accuracy", "eval"), ("eval/masked_accuracy", "eval, masked tokens"),
                 ("train/rewards/accuracies", "train, reward accuracy"),
                 ("eval/rewards/accuracies", "eval, reward accuracy"),
                 ("eval/generation_exact_match", "eval, generation exact match"), ("eval/rougeL", "eval, ROUGE-L")),
    "reward": (("train/reward", "train, mean over completions"), ("eval/reward", "eval, greedy")),
    "learning rate": (("train/lr", ""),),
    "grad norm": (("train/grad_norm", ""),),
    "throughput": (("train/tokens_per_s", ""),),
}
_YLABEL = {"loss": "cross entropy (nats/token)", "perplexity": "exp(eval loss)", "accuracy": "fraction correct", "reward": "reward (weighted sum)",
           "learning rate": "lr", "grad norm": "L2 norm before clipping", "throughput": "tokens/s (all ranks)"}
_LOG = {"loss", "perplexity", "grad norm"}


def read_run(run_dir: Path, skipped: dict[str, int] | None = None) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` from ``run_dir/metrics.jsonl``, steps ascending, later launches winning
    (a step whose winning value is null, i.e. non-finite, has no point).

    Lines that are not JSON objects (a row torn by a kill or a full disk, garbage bytes) and rows without an
    integer ``step`` or with non-numeric values are skipped (:func:`finetune.logs.read_metrics_file`); their
    number goes to ``skipped[run_dir]`` when ``skipped`` is given.

    Raises:
        ConfigError: no ``metrics.jsonl`` in ``run_dir``.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"report: '{run_dir}' has no metrics.jsonl (is it a run folder of finetune train?)")
    rows, bad = read_metrics_file(path)
    latest: dict[str, dict[int, tuple[int, float]]] = {}
    for row in rows:
        step, launch = row.get("step"), row.get("launch", 1)
        values = {k: v for k, v in row.items() if k not in ("step", "launch")}
        if not isinstance(step, int) or not isinstance(launch, int) or not all(
                v is None or isinstance(v, (int, float)) for v in values.values()):
            bad += 1
            continue
        for k, v in values.items():
            old = latest.setdefault(k, {}).get(step)
            if old is None or launch >= old[0]:  # null (non-finite) included: the later launch's null wins
                latest[k][step] = (launch, None if v is None else float(v))
    if skipped is not None:
        skipped[str(run_dir)] = bad
    return {k: sorted((s, v) for s, (_, v) in d.items() if v is not None) for k, d in latest.items()}


def build_figure(runs: dict[str, dict[str, list[tuple[int, float]]]]):
    """The report figure (``matplotlib.figure.Figure``, Agg canvas) of ``runs`` (label -> :func:`read_run`).

    One axis per :data:`PANELS` entry (``ax.get_title()`` is the panel name); each drawn line's label is
    ``"<run label>"`` or ``"<run label> (<train|eval...>)"``; a panel without data says so in its middle.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # here: the ranks' start-up does without it
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(19, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 4)
    axes.flat[-1].remove()  # 7 panels in 8 slots
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, panel in zip(axes.flat, PANELS):
        ax.set_title(panel)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(_YLABEL[panel])
        ax.grid(True, alpha=0.3)
        drawn = False
        for color, (label, series) in zip(colors, runs.items()):
            for i, (key, part) in enumerate(_SERIES[panel]):
                points = series.get(key)
                if not points:
                    continue
                steps, values = zip(*points)
                eval_like = key.startswith("eval/")
                ax.plot(steps, values, color=color, linestyle="--" if (eval_like and panel == "loss") else "-",
                        marker="o" if eval_like else None, markersize=3,
                        label=f"{label} ({part})" if part else label)
                drawn = True
        if drawn:
            ys = [v for line in ax.get_lines() for v in line.get_ydata()]
            if panel in _LOG and min(ys) > 0 and max(ys) / min(ys) > 20:  # log only where it spans decades

                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, ... labelled
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(NullFormatter())
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"no {panel} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    fig.suptitle("finetune report: " + ", ".join(runs))
    fig.tight_layout()
    return fig


def write_report(run_dirs: list[Path], out: Path, skipped: dict[str, int] | None = None) -> Path:
    """Draw the runs in ``run_dirs`` (labelled by folder name) into the PNG ``out``; returns ``out``.

    ``skipped`` (when given) receives, per run folder, the number of ``metrics.jsonl`` lines that could not be
    read (:func:`read_run`)."""
    runs = {}
    for d in run_dirs:
        label = Path(d).resolve().name
        while label in runs:
            label += "'"
        runs[label] = read_run(Path(d), skipped)
    return save_figure(runs, out)


def save_figure(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> Path:
    """:func:`build_figure` of ``runs`` (label -> :func:`read_run`) written to the PNG ``out``; returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    build_figure(runs).savefig(out)
    return out


def write_run_report(run_dir: Path) -> str:
    """``run_dir/report.png`` at the end of a run (rank 0); returns :func:`eval_summary` of the same reading of
    ``metrics.jsonl``. A report that cannot be drawn (matplotlib, a damaged ``metrics.jsonl``) is a warning, never
    a failed run; damaged lines are skipped and counted in the log."""
    skipped: dict[str, int] = {}
    series: dict = {}
    try:
        series = read_run(run_dir, skipped)
        logger.info(f"report {save_figure({Path(run_dir).resolve().name: series}, run_dir / 'report.png')}")
        if skipped.get(str(run_dir)):
            logger.warning(f"metrics.jsonl: {skipped[str(run_dir)]} damaged line(s) skipped in report.png (torn by a "
                           f"kill or a full disk)")
    except Exception as e:  # noqa: BLE001  (a finished run stays finished)
        logger.warning(f"report.png not written (an older one is stale): {type(e).__name__}: {e}")
    return eval_summary(series)


def eval_summary(series: dict[str, list[tuple[int, float]]]) -> str:
    """One line of how the run's evaluation moved: ``eval/loss`` and ``eval/perplexity`` at their first and last
    steps (a resumed run's later launch winning), e.g. ``eval/loss 5.56 (step 0) -> 1.62 (step 300)``; "" when the
    run has no evaluation. ``series`` is :func:`read_run` of the run folder."""
    parts = []
    for key in ("eval/loss", "eval/perplexity", "eval/rewards/accuracies", "eval/reward"):
        points = series.get(key)
        if points and not (key == "eval/loss" and all(v == 0 for _, v in points)):  # grpo's evaluation has no loss
            (s0, v0), (s1, v1) = points[0], points[-1]
            parts.append(f"{key} {v0:.4g} (step {s0}) -> {v1:.4g} (step {s1})")
    return "; ".join(parts)


def eval_answers(run_dir: Path, n: int = 3) -> list[str]:
    """The first ``n`` held-out greedy answers of the run's first and last evaluation, one line each, from the
    records an online-RL evaluation writes (``grpo``: ``eval/step<N>_completions.jsonl``): the prompt's last user
    message, then the answer and its rewards before and after, e.g.
    ``'What is 59 + 63? ...': step 0 'To add 59 and 63, we need' (exact_match 0) -> step 10 '122' (exact_match 1)``.
    [] when the run has fewer than two such evaluations or a file cannot be read (a report, never a failure)."""
    def step_of(p: Path) -> int:
        return int(p.name.removeprefix("step").split("_", 1)[0])

    files = sorted((Path(run_dir) / "eval").glob("step*_completions.jsonl"), key=step_of)
    if len(files) < 2:
        return []
    try:
        first, last = ([json.loads(line) for line in f.read_text().splitlines()[:n]] for f in (files[0], files[-1]))
    except (OSError, ValueError):
        return []

    def prompt(p) -> str:
        users = [m.get("content") for m in p if isinstance(m, dict) and m.get("role") == "user"] if isinstance(p, list) else []
        text = users[-1] if users else p
        return " ".join(str(text).split())[-120:]

    def rewards(r: dict) -> str:
        return ", ".join(f"{k} {v:.3g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in r.get("rewards", {}).items())

    return [f"held-out answer to {prompt(a.get('prompt'))!r}: step {a.get('step')} {a.get('completion')!r} ({rewards(a)}) "
            f"-> step {b.get('step')} {b.get('completion')!r} ({rewards(b)})" for a, b in zip(first, last)]
