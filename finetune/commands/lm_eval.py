"""``finetune lm-eval RUN_OR_EXPORT --tasks T[,T...] [--include-path DIR] ...``: EleutherAI's lm-evaluation-harness
on an export, offline, its scores into the run folder and the export's model card.

The harness's own ``simple_evaluate`` with its ``hf`` model on the export folder (``<run>/export`` of a run folder,
or an export folder), with the arguments of its command line (``lm_eval --model hf --model_args
pretrained=<export>,dtype=<dtype> --tasks ... --include_path ... --num_fewshot ... --limit ... --batch_size ...
--device ... --gen_kwargs ...``), so the scores are the harness CLI's own. Nothing is downloaded: the Hub and
``datasets`` are switched offline before the harness is imported, so a task must read local files (a task YAML
with ``dataset_path: parquet`` and ``data_files``, as the shipped ``scripts/lm_eval_tasks/gsm8k_local.yaml`` and
``wikitext2_local.yaml``; ``--include-path`` names the folder). A task folder's ``!function`` entries run that
folder's Python: name only folders you trust.

Rank 0 alone, one process (the harness's ``hf`` model: ``--device cuda:0`` on a GPU node). It writes
``<run>/lm_eval/results-<time>.json`` (for a bare export folder ``<export>/lm_eval/``; ``--out`` names another
file; an existing file is never overwritten) with the harness's results, configs and versions, and adds each task's
metrics to the ``model-index`` of the export's ``README.md`` (the card :mod:`finetune.lifecycle.model_card` wrote),
replacing an earlier result of the same task, metric and few-shot count. Refused before any model is loaded (exit 2,
one line): no export, an export without tokenizer files (transformers would build an empty tokenizer from its
``config.json`` and every score would be of no tokens), a ``--limit`` that is not above 0, a task that is not in the
harness's registry nor in ``--include-path``, an ``--out`` that exists, the harness not installed (``pip install
lm-eval==0.4.13``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard

from finetune.commands.evaluate import export_folder
from finetune.commands.selftest import check_output_file
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.lifecycle.model_card import CARD
from finetune.preflight.validate import TOKENIZER_FILES


def parser() -> argparse.ArgumentParser:
    """The command line of ``finetune lm-eval``."""
    p = argparse.ArgumentParser(prog="finetune lm-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="a run folder (its export/ is evaluated) or a Hugging Face export folder")
    p.add_argument("--tasks", required=True, help="comma-separated task names (the harness's, or --include-path's)")
    p.add_argument("--include-path", default="", help="folder of task YAMLs (e.g. scripts/lm_eval_tasks)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--limit", type=float, default=None, help="examples per task (an int), or a fraction of them")
    p.add_argument("--batch-size", default="1", help="the harness's batch size (an int, or auto)")
    p.add_argument("--device", default="cpu", help="the harness's device: cpu, cuda:0, ...")
    p.add_argument("--dtype", default="auto", help="the weights' dtype for the hf model (auto: the export's)")
    p.add_argument("--gen-kwargs", default=None, help="generation arguments, e.g. max_gen_toks=256,temperature=0")
    p.add_argument("--seed", type=int, default=0, help="the harness's random seed (its CLI's default: 0)")
    p.add_argument("--out", default="", help="JSON file to write (default: <run>/lm_eval/results-<time>.json; an "
                                             "existing file is never overwritten)")
    return p


def _harness():
    """``(simple_evaluate, TaskManager)`` of lm-evaluation-harness, offline; ConfigError when it is not installed."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("lm-eval: lm-evaluation-harness is not installed; pip install lm-eval==0.4.13 (in the test "
                          "extra; on an offline cluster, from your bundle's wheels)") from None
    return simple_evaluate, TaskManager


def model_index(results: dict, num_fewshot: dict) -> list[EvalResult]:
    """The harness's ``results`` (task -> ``{"<metric>,<filter>": value}``) as model-card results: one per finite
    number (standard errors left out), the task as the dataset, the metric with its filter as the metric's name."""
    out = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value):  # "<metric>,<filter>" only (not alias, sample_len)
                continue
            metric, _, how = key.partition(",")
            shots = num_fewshot.get(task)
            out.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                  metric_type=metric, metric_name=f"{metric} ({how})" if how and how != "none" else metric,
                                  metric_value=float(value), source_name="lm-evaluation-harness",
                                  source_url="https://github.com/EleutherAI/lm-evaluation-harness",
                                  **({"metric_args": {"num_fewshot": shots}} if shots is not None else {})))
    return out


def add_to_card(export: Path, results: list[EvalResult]) -> bool:
    """Add ``results`` to the ``model-index`` of ``export/README.md``, replacing those of the same task, metric and
    arguments; False (nothing written) when the export has no card."""
    path = export / CARD
    if not path.is_file():
        return False
    card = ModelCard.load(path)
    keep = [r for r in (card.data.eval_results or []) if not any(
        (r.dataset_type, r.metric_name, r.metric_args) == (n.dataset_type, n.metric_name, n.metric_args)
        for n in results)]
    card.data.eval_results = keep + results
    if not card.data.model_name:
        card.data.model_name = export.parent.name if export.name == "export" else export.name
    card.save(path)
    return True


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``finetune lm-eval``. Returns the process exit status (2: bad input)."""
    args = parser().parse_args(argv)
    try:
        if args.limit is not None and not args.limit > 0:  # NaN too
            raise ConfigError(f"lm-eval: --limit: must be > 0 (examples per task, or a fraction of them below 1), got "
                              f"{args.limit:g}; leave it out to evaluate every example")
        export = export_folder(args.target).resolve()
        if not any((export / f).is_file() for f in TOKENIZER_FILES):
            # transformers then builds a tokenizer from config.json alone that turns every text into no tokens
            raise ConfigError(f"lm-eval: the export '{export}' has no tokenizer files (none of "
                              f"{', '.join(TOKENIZER_FILES)}); save the run's tokenizer there "
                              f"(AutoTokenizer.from_pretrained(<model.tokenizer_path>).save_pretrained('{export}')), "
                              f"or export again with finetune export, which writes it")
        home = export.parent if export.name == "export" else export
        out = Path(args.out) if args.out else home / "lm_eval" / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
        check_output_file("--out", out, command="lm-eval: ")
        simple_evaluate, TaskManager = _harness()
        if args.include_path and not Path(args.include_path).is_dir():
            raise ConfigError(f"lm-eval: --include-path '{args.include_path}' is not a folder of task YAMLs")
        tasks = [t for t in args.tasks.split(",") if t]
        manager = TaskManager(include_path=args.include_path or None)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown or not tasks:
            raise ConfigError(f"lm-eval: --tasks: {', '.join(unknown) or 'none given'} not in the harness's tasks"
                              f"{' nor in ' + args.include_path if args.include_path else ''}; name a task folder with "
                              f"--include-path (e.g. scripts/lm_eval_tasks: gsm8k_local, wikitext2_local)")
    except ConfigError as e:
        return report_error(e)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = simple_evaluate(model="hf", model_args=f"pretrained={export},dtype={args.dtype}", tasks=tasks,
                              num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size,
                              device=args.device, gen_kwargs=args.gen_kwargs, task_manager=manager,
                              random_seed=args.seed, log_samples=False)
    scores = results["results"]
    shots = results.get("n-shot", {})
    width = max((len(f"{t} {k}") for t, m in scores.items() for k in m), default=0)
    for task, metrics in scores.items():
        for key, value in metrics.items():
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)):
                print(f"{task + ' ' + key:<{width}}  {value:.6g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"export": str(export), "tasks": tasks, "include_path": args.include_path,
                               "num_fewshot": args.num_fewshot, "limit": limit, "results": scores, "n-shot": shots,
                               "configs": results.get("configs", {}), "versions": results.get("versions", {})},
                              indent=2, default=str) + "\n")
    carded = add_to_card(export, model_index(scores, shots))
    print(f"finetune: lm-eval results written to {out}" + (f"; model-index of {export / CARD} updated" if carded
                                                             else ""), file=sys.stderr)
    return 0
