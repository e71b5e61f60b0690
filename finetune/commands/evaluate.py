"""``finetune evaluate RUN_OR_EXPORT --config X [key=value ...]``: the evaluation of an export, no training.

Loads the Hugging Face export (``<run>/export`` of a run folder, or an export folder itself) as the run config's
model (``model.init: pretrained``, its own tokenizer, no LoRA, no ``config_overrides``: the export's
``config.json`` already has them), reads and tokenizes the run config's data exactly as a launch does (the
validation files, or the held-out share of the training files) and runs the loop's evaluation
(:func:`finetune.training.trainer.evaluate`) on every rank: loss, perplexity and the recipe's metrics (accuracy, F1,
masked-token accuracy, ...), and with ``train.eval_generate`` the generated answers and their scores (exact match,
ROUGE-L; the answers go into the JSON). Rank 0 prints a table and writes the metrics to a new JSON file beside the export
(``evaluation-<time>.json``, or ``--out``).

Multi-rank like training (every rank evaluates its shard, ZeRO-3 gathers parameters)::

    finetune evaluate runs/sft/export --config finetune/recipes/configs/sft_gsm8k.yaml
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module finetune evaluate runs/sft --config ... data.validation_files=[x]
    torchrun --nproc_per_node 2 -m finetune evaluate ...

The same model, data and ``train.eval_max_batches`` give the run's own final ``eval/loss`` (the export is checked
against the engine's logits at the end of every run). The engine has no optimizer (no optimizer state, no fp32 master
weights: ZeRO 1/2 run as stage 0, ZeRO-3 partitions the parameters only; :func:`finetune.engine.model.inference_ds_config`),
so an evaluation needs about the memory of inference. ``grpo`` is evaluated as its training run evaluates: one greedy
completion per validation prompt, scored by the run config's reward functions (``eval/reward``, the weighted sum, and
``eval/rewards/<function>/mean``; its ``eval/loss`` is 0, as in the run: no loss is computed on prompts), the
completions and their rewards in the JSON under ``completions``; ``train.grpo.beta`` is pinned to 0 (no KL term is
evaluated, and an export has no LoRA base to be the reference). Refused before any model is built (exit 2, one line):
``dpo`` and ``kto`` (their metrics are measured against the reference model, which an export alone does not carry:
``Capabilities.evaluates_exports``), an export whose ``config.json`` ``architectures`` is not of the recipe's model
class (:func:`architecture_problem`), and an ``--out`` that exists or cannot be written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path


from finetune import patches
from finetune.parallel import distributed as dist_utils
from finetune.parallel import sequence
from finetune.commands.selftest import check_output_file
from finetune.config import load_run_config
from finetune.data.dataset import build_train_data
from finetune.engine import gguf
from finetune.engine.model import build_engine, load_model_config, load_tokenizer
from finetune.training.generation import EvalGeneration
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.logs import logger
from finetune.recipes import RECIPES, get_recipe, recipe_for
from finetune.training.trainer import evaluate
from finetune.preflight.validate import check_launch


def parser() -> argparse.ArgumentParser:
    """The command line of ``finetune evaluate``."""
    p = argparse.ArgumentParser(prog="finetune evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="a run folder (its export/ is evaluated) or a Hugging Face export folder")
    p.add_argument("--config", required=True, help="run config whose recipe and data to evaluate with")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.validation_files=[x.parquet]")
    p.add_argument("--out", default="", help="JSON file to write (default: <export>/evaluation-<time>.json; an "
                                             "existing file is never overwritten)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def export_folder(target: str) -> Path:
    """The export to evaluate: ``target/export`` of a run folder, or ``target`` itself (a folder, or a ``.gguf`` file
    that the launch's checks convert: :func:`finetune.preflight.validate.resolve_model_files`).

    Raises:
        ConfigError: neither holds a ``config.json``.
    """
    path = Path(target)
    if gguf.is_gguf(path) and path.is_file():  # the model of a GGUF file, converted by the launch's checks
        return path
    for candidate in (path / "export", path):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"evaluate: '{target}' is neither a run folder with an export/ nor an export folder (no "
                      f"config.json); export a checkpoint first with finetune export")


def _auto_class_names(model_class) -> set[str]:
    """The architecture names a transformers auto class builds (``AutoModelForCausalLM`` -> ``LlamaForCausalLM``,
    ``BertLMHeadModel``, ...), from its mapping of model types to class names."""
    mapping = getattr(model_class, "_model_mapping", None)
    names: set[str] = set()
    for value in list(getattr(mapping, "_model_mapping", {}).values()) + [
            c.__name__ for c in getattr(mapping, "_extra_content", {}).values()]:
        names.update([value] if isinstance(value, str) else value)
    return names


def architecture_problem(model_dir: Path, recipe_name: str) -> str | None:
    """One problem line when ``model_dir/config.json`` names ``architectures`` none of which the recipe's model class
    builds (a ``BertForSequenceClassification`` export for a causal-LM recipe: the LM head would be new random
    weights and the perplexity meaningless), naming both and the recipes that do train it; None when it fits, when
    ``architectures`` is absent (a bare ``config.json``) or when the recipe or the file is not readable (reported
    elsewhere).

    Args:
        model_dir: a Hugging Face model folder.
        recipe_name: a key of :data:`finetune.recipes.RECIPES`.
    """
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if recipe_name not in RECIPES or not architectures:
        return None
    model_class = get_recipe(recipe_name).model_class
    if set(architectures) & _auto_class_names(model_class):
        return None
    fits = [name for name in RECIPES if set(architectures) & _auto_class_names(get_recipe(name).model_class)]
    return (f"model.path: '{model_dir}/config.json' is a {', '.join(architectures)} (architectures), but recipe "
            f"{recipe_name} builds {model_class.__name__} models, which would get a new randomly initialised head; "
            + (f"use a config of a recipe that trains it ({', '.join(fits)}), or the export of a {recipe_name} run"
               if fits else f"use the export of a {recipe_name} run"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``finetune evaluate``. Returns the process exit status (2: bad input)."""
    args = parser().parse_intermixed_args(argv)
    try:
        export = export_folder(args.target)
        stamp = time.strftime('%Y%m%d-%H%M%S')
        out = (Path(args.out) if args.out else export.with_name(f"{export.name}.evaluation-{stamp}.json")
               if gguf.is_gguf(export) else export / f"evaluation-{stamp}.json")
        check_output_file("--out", out, command="evaluate: ")
        with tempfile.TemporaryDirectory(prefix="finetune-evaluate-") as scratch:
            # train.grpo.beta: the evaluation computes no KL term, and beta > 0 is refused without the LoRA base
            # an export does not have (read by grpo alone; the other recipes ignore train.grpo); a pipeline run's
            # config evaluates its export data-parallel (the engine without an optimizer is no pipeline)
            pinned = [f"model.path={export}", f"model.tokenizer_path={export}", "model.init=pretrained",
                      "model.lora=null", "model.config_overrides={}", "export=false", "output_root=",
                      f"output_dir={Path(scratch) / 'run'}", "train.grpo.beta=0", "parallel.pipeline_parallel_size=1"]
            wrong = architecture_problem(export, load_run_config(args.config, [*args.overrides, *pinned], []).recipe)
            if wrong:  # before the other checks: the tokenizer of another task's export has its own complaints
                raise ConfigError(f"evaluate: {wrong}")
            cfg, resolved, _ = check_launch(args.config, [*args.overrides, *pinned], None, False, announce=False)
            if not get_recipe(cfg.recipe).capabilities.evaluates_exports:
                raise ConfigError(f"evaluate: recipe {cfg.recipe} measures against its reference model, which an "
                                  f"export does not carry; its evaluation is part of the training run")
            metrics = run_evaluation(cfg, resolved.ds)
            completions = recorded_completions(Path(cfg.output_dir))
    except ConfigError as e:
        return report_error(e)
    if dist_utils.is_main():
        generations = metrics.pop("generations", None)
        width = max(map(len, metrics))
        print("\n".join(f"{k:<{width}}  {v:.6g}" for k, v in metrics.items()))
        out.parent.mkdir(parents=True, exist_ok=True)
        finite = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}  # NaN: nothing measured
        out.write_text(json.dumps({"export": str(export), "config": args.config, "overrides": args.overrides,
                                   "recipe": cfg.recipe, "validation_files": cfg.data.validation_files,
                                   "world_size": dist_utils.world_size(), "metrics": finite,
                                   **({"generations": generations} if generations else {}),
                                   **({"completions": completions} if completions else {})}, indent=2) + "\n")
        print(f"finetune: evaluation written to {out}", file=sys.stderr)
    return 0


def recorded_completions(run_dir: Path) -> list[dict]:
    """The completions an evaluation wrote into its (scratch) run folder, ``run_dir/eval/step*_completions.jsonl``
    (``grpo``: prompt, greedy completion and each reward function's score per validation row, written by rank 0), in
    row order, without their ``step``; empty when there are none (other recipes, other ranks)."""
    records = []
    for path in sorted((run_dir / "eval").glob("step*_completions.jsonl")):
        records += [{k: v for k, v in json.loads(line).items() if k != "step"}
                    for line in path.read_text().splitlines() if line.strip()]
    return records


def run_evaluation(cfg, ds: dict) -> dict:
    """Process group, data, engine (the export's weights, no optimizer) and one evaluation on
    every rank; returns the metrics (``eval/loss``, ``eval/perplexity``, the recipe's; with ``train.eval_generate``
    also ``eval/rougeL``, ``eval/generation_exact_match`` and the records under ``generations``)."""
    dist_utils.init(cfg.train.dist_timeout_minutes, cfg.train.op_build_dir)
    try:
        if dist_utils.on_cpu():
            logger.info(dist_utils.set_cpu_threads())
        recipe = recipe_for(cfg)
        tokenizer, model_config = load_tokenizer(cfg, recipe), load_model_config(cfg, recipe)
        data = build_train_data(recipe, cfg, tokenizer)
        engine = build_engine(cfg, recipe, model_config, ds, total_steps=1, optimizer=False).engine
        metrics = evaluate(engine, data.eval_loader, recipe, cfg)
        if cfg.train.eval_generate.prompts:  # answers generated and scored as during training
            with sequence.sequence_parallel_off():  # whole sequences, each rank its own prompts
                scores, records = EvalGeneration(tokenizer, recipe, cfg).run(engine)
            metrics.update(scores)
            metrics["generations"] = records
        return metrics
    finally:
        dist_utils.shutdown()
        patches.restore_all()  # the libraries' own objects again, whoever runs next in this process
