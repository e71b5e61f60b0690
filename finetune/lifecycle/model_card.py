"""The model card of an export: ``README.md`` beside ``config.json``, a YAML header the Hub reads and a Markdown body.

Every Hugging Face folder needs one to be published, and a folder copied off the cluster without one loses what
it is: which model it started from, on which data, with which recipe and settings, how well it did and which step
of the run it is. The card says it from the run folder alone (no Hub, no network), in the form of HF Trainer's
``create_model_card`` (``transformers/modelcard.py``: ``library_name: transformers``, ``base_model``, ``datasets``,
tags, a ``model-index`` of the evaluation results, the hyperparameters and framework versions as lists) and TRL's
``generate_model_card`` (``trl/trainer/utils.py``: a :class:`huggingface_hub.ModelCardData` rendered to YAML, the
tool's own tag and the trainer's name as tags).

What goes into the header (``ModelCard.load(path).data``):

* ``base_model``: what the weights started from, with ``model.init: pretrained`` only (``scratch`` starts from
  nothing, as HF Trainer's "trained from scratch"): the Hub id when the folder says it (a model of a
  ``finetune bundle``, whose ``MANIFEST.json`` records it, or a Hugging Face cache snapshot
  ``models--<org>--<name>/snapshots/<commit>``), else the local folder's name; the body gives the path.
* ``datasets``: one name per dataset of the run (``data.train_files`` or each of ``data.sources``): the Hub id of a
  bundled dataset, else the folder name of its first file.
* ``library_name: transformers``, ``pipeline_tag`` (from the recipe's model class), ``tags`` (``finetune``, the
  recipe, ``deepspeed``, and ``lora``/``peft`` with adapters), ``license`` when the bundle records the base
  model's.
* ``model-index``: the last evaluation at or before the exported step (``metrics.jsonl``, ``eval/*``), one result
  per finite metric; absent when the run never evaluated.
* ``finetune``: the rest, machine-readable: version, recipe, model path and init, where the model and each dataset
  came from (:func:`source_of`, with their files), the exported step and why it was chosen (``chosen_by``), the
  hyperparameters under their run-config names, the parallel layout, the evaluation with its step, the export check
  (``max_abs_logit_diff``, from ``export_check.json``) and the versions of the export and of the training launch.

A missing optional piece (no ``metrics.jsonl``, no evaluation, no export check of this step, no launch record)
leaves its part out; nothing here fails an export for it.
"""

from __future__ import annotations

import json
import math
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.constants import REPOCARD_NAME

import finetune
from finetune.config import RunConfig
from finetune.data import mixture
from finetune.lifecycle import checkpoint
from finetune.logs import logger, read_metrics_file
from finetune.parallel.layout import Layout
from finetune.recipes import get_recipe

CARD = REPOCARD_NAME
"""File name of the card in the export folder (``README.md``, what the Hub shows)."""

PIPELINE_TAGS = {"AutoModelForCausalLM": "text-generation", "AutoModelForMaskedLM": "fill-mask",
                 "AutoModelForSequenceClassification": "text-classification",
                 "AutoModelForTokenClassification": "token-classification",
                 "AutoModelForQuestionAnswering": "question-answering", "AutoModel": "sentence-similarity",
                 "AutoModelForImageTextToText": "image-text-to-text"}
"""A recipe's model class -> the Hub's ``pipeline_tag`` (the task widget and filter); a class not listed gets none."""

VERSIONS = ("torch", "transformers", "deepspeed", "peft", "datasets", "tokenizers", "safetensors", "huggingface_hub")
"""Distributions whose installed versions the card lists beside finetune's (those that wrote and can read the
export)."""

EXPORT_CHECK = "export_check.json"
"""The run folder's record of the end-of-run export check (:func:`finetune.lifecycle.export.verify_export`)."""

_BUNDLE_MANIFEST = "MANIFEST.json"  # finetune.airgap.manifest.MANIFEST (a sibling layer: read, not imported)
_HF_CACHE_REPO = re.compile(r"^(models|datasets)--(.+)$")


def installed_versions() -> dict[str, str]:
    """``{"finetune": ..., "torch": ..., ...}``: the versions of finetune and :data:`VERSIONS` in this process's
    environment (``importlib.metadata``); a distribution that is not installed is left out."""
    found = {"finetune": finetune.__version__}
    for name in VERSIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def source_of(path: str | Path, kind: str) -> dict:
    """Where a local model or dataset folder came from, as far as the folder itself tells.

    Args:
        path: the folder (a model's) or a file in it (a dataset's parquet); relative to the working directory.
        kind: ``"model"`` or ``"dataset"``.

    Returns:
        ``{"name": str, "hub_id": str | None, "revision": str | None, "license": str | None}``: ``hub_id`` and
        ``revision`` from a Hugging Face cache snapshot path or from the ``MANIFEST.json`` of the ``finetune bundle``
        the folder is in (``<bundle>/models/<name>``, ``<bundle>/data/<name>``; ``license`` from there too);
        ``name`` is the Hub id when known, else the folder's name.
    """
    path = Path(path)
    folder = path if kind == "model" else path.parent
    found = {"name": folder.resolve().name, "hub_id": None, "revision": None, "license": None}
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and _HF_CACHE_REPO.match(parts[-3]):
        repo = _HF_CACHE_REPO.match(parts[-3]).group(2).replace("--", "/")
        return {**found, "name": repo, "hub_id": repo, "revision": parts[-1]}
    manifest = folder.parent.parent / _BUNDLE_MANIFEST
    if folder.parent.name not in ("models", "data") or not manifest.is_file():
        return found
    try:
        sources = json.loads(manifest.read_text()).get("sources", [])
    except (OSError, ValueError, AttributeError) as e:
        logger.warning(f"model card: {manifest} is not readable JSON ({e}); the card names '{folder.name}' by its "
                       f"folder")
        return found
    for src in sources:
        if isinstance(src, dict) and src.get("kind") == kind and src.get("name") == folder.name:
            hub_id = src.get("spec", "").split("@")[0].split(":")[0] if src.get("origin") == "hub" else None
            return {**found, "name": hub_id or folder.name, "hub_id": hub_id or None,
                    "revision": src.get("resolved_revision"), "license": src.get("license")}
    return found


def datasets_of(run_cfg: RunConfig) -> list[dict]:
    """One entry per dataset of the run: ``{"name", "hub_id", "train_files", "validation_files"}``, the name and Hub
    id from :func:`source_of` on the first training file (``data.sources``: one per source, in order)."""
    sources = mixture.sources_of(run_cfg.data, []) or [None]
    found = []
    for src in sources:
        data = run_cfg.data if src is None else src.data
        files = [str(f) for f in data.train_files]
        info = source_of(files[0], "dataset") if files else {"name": "unknown", "hub_id": None}
        found.append({"name": info["name"], "hub_id": info["hub_id"], "train_files": files,
                      "validation_files": [str(f) for f in data.validation_files],
                      **({"source": src.name} if src is not None else {})})
    return found


def last_evaluation(rows: list[dict], step: int) -> dict | None:
    """The last evaluation at or before optimizer step ``step`` in the rows of ``metrics.jsonl``.

    A resumed run logs the steps after its checkpoint again; the later launch's row of a step is the one that
    counts (:class:`finetune.logs.MetricsSink`), and the rows of one step and launch are merged.

    Returns:
        ``{"step": int, "launch": int | None, "metrics": {"eval/<name>": float | None}}`` (None: a non-finite
        value), or None when no row up to ``step`` holds an ``eval/`` value.
    """
    evals: dict[int, dict] = {}
    for row in rows:
        at, values = row.get("step"), {k: v for k, v in row.items() if k.startswith("eval/")}
        if not values or not isinstance(at, int) or at > step:
            continue
        seen = evals.get(at)
        if seen is not None and seen["launch"] == row.get("launch"):
            seen["metrics"].update(values)
        else:
            evals[at] = {"step": at, "launch": row.get("launch"), "metrics": values}
    return evals[max(evals)] if evals else None


def training_launch(run_dir: Path, rows: list[dict], step: int) -> dict | None:
    """``meta.json`` of the launch that trained up to ``step`` (the launch of the last ``metrics.jsonl`` row at or
    before it; without such a row the run's newest launch), or None without a launch record."""
    before = [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= step and "launch" in r]
    launches = run_dir / "launches"
    if before:
        launch = max(before, key=lambda r: (r["step"] == step, r["step"], r["launch"]))["launch"]
    else:
        numbers = [int(p.name) for p in launches.glob("*") if p.name.isdigit()] if launches.is_dir() else []
        launch = max(numbers, default=None)
    meta = launches / str(launch) / "meta.json"
    if launch is None or not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text())
    except ValueError as e:
        logger.warning(f"model card: {meta} is not JSON ({e}); the card leaves out the training launch")
        return None


def export_check_of(run_dir: Path, step: int) -> dict | None:
    """The run folder's ``export_check.json`` when it checked an export of ``step`` (its ``checkpoint_step``), else
    None (no check yet, or the check of another step)."""
    path = run_dir / EXPORT_CHECK
    if not path.is_file():
        return None
    try:
        check = json.loads(path.read_text())
    except ValueError as e:
        logger.warning(f"model card: {path} is not JSON ({e}); the card leaves out the export check")
        return None
    return check if isinstance(check, dict) and check.get("checkpoint_step") == step else None


def hyperparameters(run_cfg: RunConfig, lay: Layout, zero_stage: int | None, precision: str | None) -> dict:
    """The settings that decide what was trained, under their run-config names (``train.lr``, ...), plus the derived
    ``global_batch_size`` (rows per optimizer step: micro batch x accumulation x data-parallel size), the ZeRO stage
    and the precision of the training launch (None: not recorded)."""
    t = run_cfg.train
    found = {"train.lr": t.lr, "train.lr_scheduler": t.lr_scheduler, "train.warmup_steps": t.warmup_steps,
             "train.weight_decay": t.weight_decay, "train.max_grad_norm": t.max_grad_norm,
             "train.micro_batch_size": t.micro_batch_size,
             "train.gradient_accumulation_steps": t.gradient_accumulation_steps,
             "global_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * lay.dp,
             **({"train.max_steps": t.max_steps} if t.max_steps > 0 else {"train.epochs": t.epochs}),
             "train.loss_weighting": t.loss_weighting, "train.seed": t.seed,
             "data.max_seq_len": run_cfg.data.max_seq_len, "zero_stage": zero_stage, "precision": precision}
    lora = run_cfg.model.lora
    if lora is not None:
        found.update({"model.lora.r": lora.r, "model.lora.alpha": lora.alpha, "model.lora.dropout": lora.dropout,
                      "model.lora.target_modules": list(lora.target_modules)})
    return {k: v for k, v in found.items() if v is not None}


def card_facts(ckpt: Path, run_dir: Path, run_cfg: RunConfig, chosen_by: dict | None = None) -> dict:
    """Everything the card says about checkpoint ``ckpt`` of run folder ``run_dir``, as one JSON-able dict: the
    header's ``finetune`` entry, from which :func:`build_card` takes the Hub's keys (``model``: :func:`source_of` of
    ``model.path``; ``datasets``: :func:`datasets_of`).

    Args:
        ckpt: the complete checkpoint folder being exported (its ``COMPLETE`` marker gives the step and layout).
        run_dir: its run folder (``metrics.jsonl``, ``launches/``, ``export_check.json``).
        run_cfg: the run config the checkpoint was trained with.
        chosen_by: why this step (``export_check.json``'s form: ``{"last_step": N}``, ``{"keep_best": {...}}``); None:
            the export check's when it checked this step, else the checkpoint was named by the caller
            (``finetune export``).
    """
    marker = checkpoint.marker(ckpt)
    step = marker["step"]
    lay = Layout(world=marker.get("world_size") or 1, sp=marker.get("sequence_parallel_size", 1),
                 tp=marker.get("tensor_parallel_size", 1))
    metrics = run_dir / "metrics.jsonl"
    rows, skipped = read_metrics_file(metrics) if metrics.is_file() else ([], 0)
    if skipped:
        logger.warning(f"model card: {metrics}: {skipped} damaged line(s) skipped")
    meta = training_launch(run_dir, rows, step)
    check = export_check_of(run_dir, step)
    model_class = get_recipe(run_cfg.recipe).model_class.__name__
    precision = (meta or {}).get("precision", {}).get("precision")
    facts = {"version": finetune.__version__, "recipe": run_cfg.recipe, "model_class": model_class,
             "model_path": run_cfg.model.path, "init": run_cfg.model.init,
             "model": source_of(run_cfg.model.path, "model"), "datasets": datasets_of(run_cfg),
             "checkpoint": f"checkpoints/{ckpt.name}", "checkpoint_step": step,
             "chosen_by": chosen_by or (check or {}).get("chosen_by") or {"named": ckpt.name},
             "hyperparameters": hyperparameters(run_cfg, lay, marker.get("zero_stage"), precision),
             "layout": {"world_size": lay.world, "data_parallel_size": lay.dp, "sequence_parallel_size": lay.sp,
                        "tensor_parallel_size": lay.tp},
             "versions": installed_versions()}
    evaluation = last_evaluation(rows, step)
    if evaluation is not None:
        facts["evaluation"] = evaluation
    if check is not None:
        facts["export_check"] = {k: check[k] for k in ("max_abs_logit_diff", "max_abs_logit_diff_adapter", "tolerance")
                                 if k in check}
    if meta is not None:
        facts["training_launch"] = {"launch": meta.get("launch"), "git": meta.get("git"),
                                    **meta.get("versions", {})}
    return facts


def _number(value) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _lines(items: dict) -> str:
    return "\n".join(f"- {k}: {_number(v)}" for k, v in items.items())


def chosen_text(chosen_by: dict) -> str:
    """``chosen_by`` (``export_check.json``'s form) as a phrase: ``the last step of the run``, ``train.keep_best: the
    best eval/loss (2.13)``, ``the checkpoint named to the export``; keys it does not know are listed as JSON."""
    said = []
    if "keep_best" in chosen_by and "unavailable" not in chosen_by["keep_best"]:
        best = chosen_by["keep_best"]
        said.append(f"train.keep_best: the {'lowest' if best.get('mode') == 'min' else 'highest'} {best.get('metric')} "
                    f"({_number(best.get('value'))})")
    elif "last_step" in chosen_by:
        said.append("the last step of the run")
    if "early_stopping" in chosen_by:
        said.append(f"early stopping on {chosen_by['early_stopping']}")
    if "keep_best" in chosen_by and "unavailable" in chosen_by["keep_best"]:
        said.append(f"train.keep_best unavailable: {chosen_by['keep_best']['unavailable']}")
    if "named" in chosen_by:
        said.append("the checkpoint named to the export (finetune export)")
    known = {"keep_best", "last_step", "early_stopping", "named"}
    said += [json.dumps({k: v}) for k, v in chosen_by.items() if k not in known]
    return "; ".join(said)


def card_text(facts: dict) -> str:
    """The Markdown body of the card (after the YAML header), from :func:`card_facts` and the model's name: what the
    model is, how it was chosen and evaluated, the data, the hyperparameters, the layout, the versions, and how to
    load it."""
    base, datasets = facts["model"], facts["datasets"]
    revision = f", revision `{base['revision']}`" if base.get("revision") else ""
    start = (f"a fine-tuned version of `{base['name']}` (`model.path`: `{facts['model_path']}`{revision})"
             if facts["init"] == "pretrained"
             else f"trained from scratch (random weights) with the architecture of `{facts['model_path']}/config.json`")
    names = ", ".join(f"`{d['name']}`" for d in datasets)
    text = [f"# {facts['model_name']}", "",
            "<!-- Written by finetune from the run folder; proofread and complete it before publishing. -->", "",
            f"This model is {start}, with finetune's `{facts['recipe']}` recipe ({facts['model_class']}) on {names}.",
            f"It is the checkpoint of optimizer step {facts['checkpoint_step']} (`{facts['checkpoint']}` of the run "
            f"folder), chosen as {chosen_text(facts['chosen_by'])}.", ""]
    evaluation = facts.get("evaluation")
    text += ["## Evaluation", ""]
    if evaluation:
        text += [f"On the validation data, at step {evaluation['step']} (`metrics.jsonl`):", "",
                 _lines({k: ("not finite" if v is None else v) for k, v in evaluation["metrics"].items()}), ""]
    else:
        text += ["The run logged no evaluation up to this step.", ""]
    check = facts.get("export_check")
    if check:
        text += [f"Export check: the largest absolute difference between this folder's logits and the training "
                 f"engine's on a fixed batch of validation rows is {_number(check.get('max_abs_logit_diff'))} "
                 f"(tolerance {_number(check.get('tolerance'))}; `export_check.json`).", ""]
    text += ["## Training data", ""]
    for d in datasets:
        text += [f"- `{d['name']}`" + (f" (source `{d['source']}`)" if "source" in d else "")
                 + f": train {', '.join(f'`{f}`' for f in d['train_files'])}; validation "
                 + (", ".join(f"`{f}`" for f in d["validation_files"]) or "held out from the training rows")]
    text += ["", "## Training procedure", "", "### Hyperparameters", "", _lines(facts["hyperparameters"]), "",
             "### Layout", "", _lines(facts["layout"]), "", "### Framework versions", "",
             _lines(facts["versions"]), ""]
    launch = facts.get("training_launch")
    if launch:
        text += [f"Training launch {launch.get('launch')}: "
                 + ", ".join(f"{k} {v}" for k, v in launch.items() if k != "launch" and v), ""]
    cls = facts["model_class"]
    multimodal = cls == "AutoModelForImageTextToText"  # its processor (tokenizer and image processor) is in the folder
    loader, name = ("AutoProcessor", "processor") if multimodal else ("AutoTokenizer", "tokenizer")
    text += ["## How to load", ""]
    if multimodal:
        text += ["A multimodal (image-text-to-text) model: it reads images and text, and the folder holds its "
                 "processor.", ""]
    text += ["```python", f"from transformers import {loader}, {cls}{', pipeline' if multimodal else ''}", "",
             f"model = {cls}.from_pretrained(\"path/to/this/folder\")",
             f"{name} = {loader}.from_pretrained(\"path/to/this/folder\")"]
    if multimodal:
        text.append("pipe = pipeline(\"image-text-to-text\", model=\"path/to/this/folder\")")
    text += ["```", ""]
    if "model.lora.r" in facts["hyperparameters"]:
        text += ["The LoRA adapters are merged into these weights; `adapter/` holds them alone (PEFT).", ""]
    return "\n".join(text)


def build_card(ckpt: Path, run_dir: Path, run_cfg: RunConfig, chosen_by: dict | None = None) -> ModelCard:
    """The card of checkpoint ``ckpt`` (see the module docstring): a :class:`huggingface_hub.ModelCard` whose
    ``data`` is the header (:class:`~huggingface_hub.ModelCardData`) and whose ``text`` is :func:`card_text`.
    Arguments as :func:`card_facts`."""
    facts = card_facts(Path(ckpt), Path(run_dir), run_cfg, chosen_by)
    base, datasets = facts["model"], facts["datasets"]
    pipeline_tag = PIPELINE_TAGS.get(facts["model_class"])
    facts["model_name"] = f"{base['name'].split('/')[-1]}-{run_cfg.recipe}"
    tags = ["finetune", run_cfg.recipe, "deepspeed"] + (["lora", "peft"] if run_cfg.model.lora is not None else [])
    evaluation = facts.get("evaluation") or {"metrics": {}}
    dataset_names = [d["name"] for d in datasets]
    results = [EvalResult(task_type=pipeline_tag, dataset_type="+".join(dataset_names),
                          dataset_name=" + ".join(dataset_names), dataset_split="validation",
                          metric_type=name.removeprefix("eval/"), metric_name=name, metric_value=value)
               for name, value in evaluation["metrics"].items()
               if pipeline_tag and isinstance(value, (int, float)) and math.isfinite(value)]
    data = ModelCardData(base_model=base["name"] if run_cfg.model.init == "pretrained" else None,
                         datasets=dataset_names, library_name="transformers", pipeline_tag=pipeline_tag, tags=tags,
                         license=base["license"] if run_cfg.model.init == "pretrained" else None,
                         model_name=facts["model_name"] if results else None, eval_results=results or None,
                         finetune={k: v for k, v in facts.items() if k != "model_name"})
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{card_text(facts)}")


def write_card(folder: Path, ckpt: Path, run_dir: Path, run_cfg: RunConfig, chosen_by: dict | None = None) -> Path:
    """Write :func:`build_card`'s card to ``folder/README.md`` (an export folder: ours, written whole each time).
    Arguments as :func:`card_facts`.

    Returns:
        The card's path.

    Raises:
        FileNotFoundError: ``ckpt`` has no ``COMPLETE`` marker (the export refuses such a checkpoint before).
        OSError: ``folder`` cannot be written.
    """
    path = Path(folder) / CARD
    build_card(ckpt, run_dir, run_cfg, chosen_by).save(path)
    return path
