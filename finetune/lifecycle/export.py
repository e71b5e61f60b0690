"""Hugging Face export from a DeepSpeed checkpoint: ``config.json``, tokenizer files, ``model.safetensors``.

With LoRA (``model.lora``) the checkpoint holds the ``PeftModel``'s state (frozen base and adapters): the
export rebuilds that ``PeftModel``, writes the adapter folder ``adapter/`` (``PeftModel.save_pretrained``) and
then the merged model (``merge_and_unload``) as the plain Hugging Face folder.

Weights are consolidated by DeepSpeed's own ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``:
the fp32 master weights of ZeRO stage 1-3, merged across ranks); a stage-0 checkpoint already holds the
full module state. The result is checked before anything is written: every parameter of the model must be
present (or tied to one that is) with its full shape, never an empty ZeRO-3 placeholder. The folder is
written under a temporary name and renamed, so a failed export never leaves a half folder, and an export whose
check fails is moved aside as ``export.failed-step<N>`` (:func:`export_and_verify`). The folder's
``README.md`` is its model card (:mod:`finetune.lifecycle.model_card`), rewritten by the end-of-run export once the
export check has run.

Command line: ``finetune export <checkpoint folder> <out folder>`` (or ``python -m finetune export``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from peft import PeftModel
from transformers import AutoConfig, AutoTokenizer
from transformers.integrations import deepspeed as hf_ds

from finetune.parallel import distributed as dist_utils
from finetune.parallel import expert
from finetune.parallel.pipeline import LAYERS_FILE, is_pipeline_checkpoint
from finetune.engine import lora, pipeline, quantize
from finetune.engine.ds_config import precision_of
from finetune.lifecycle import safe_load
from finetune.lifecycle.checkpoint import checkpoints_dir, is_complete, verify
from finetune.lifecycle.model_card import CARD, write_card
from finetune.config import load_run_config
from finetune.engine.model import load_pretrained
from finetune.errors import ConfigError, RunFailure
from finetune.logs import logger
from finetune.recipes import get_recipe
from finetune.lifecycle.run_folder import MODEL_META, copy_processor_files


@contextlib.contextmanager
def plain_model_construction():
    """Build models normally inside this block even while a ZeRO-3 ``HfDeepSpeedConfig`` is alive.

    Under ZeRO-3, transformers wraps ``from_pretrained``/``from_config`` in ``deepspeed.zero.Init``, a
    collective operation: building the export model on rank 0 alone would hang. The training
    engine's config is set back afterwards.
    """
    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full fp32 state dict of checkpoint folder ``ckpt`` (CPU tensors, parameter name -> tensor).

    Raises:
        ConfigError: ``ckpt`` holds no DeepSpeed model states.
    """
    if is_pipeline_checkpoint(ckpt):  # one file per pipeline layer: joined under the Hugging Face names
        return pipeline_state_dict(ckpt)
    if (ckpt / "mp_rank_01_model_states.pt").is_file():
        raise ConfigError(f"export: '{ckpt}' is a tensor-parallel checkpoint (one file per tensor-parallel rank); the "
                          f"training launch exports it at its end; to export this step, resume it for 0 more steps "
                          f"(--resume {ckpt} train.max_steps=<its step>)")
    if list(ckpt.glob("layer_*_expert_*_model_states.pt")):
        raise ConfigError(f"export: '{ckpt}' is an expert-parallel (AutoEP) checkpoint (one file per expert); the "
                          f"training launch exports it at its end, gathering the experts; to export this step, resume "
                          f"it for 0 more steps (--resume {ckpt} train.max_steps=<its step>)")
    if list(ckpt.glob("*zero_pp_rank_*optim_states.pt")) and not list(ckpt.glob("bf16_zero_*")):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    states = ckpt / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise ConfigError(f"export: '{ckpt}' is not a DeepSpeed checkpoint folder (no model states)")
    module = safe_load.load(states, map_location="cpu")["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def pipeline_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of a pipeline checkpoint (fp32 CPU tensors): every ``layer_XX-model_states.pt``
    (DeepSpeed's ``PipelineModule.save_state_dict``, one file per pipeline layer) renamed through the
    :data:`~finetune.parallel.pipeline.LAYERS_FILE` the save wrote (each layer's submodules' Hugging Face prefixes);
    a tied embedding saved by the first and the last stage is taken once.

    Raises:
        ConfigError: a layer file that the record lists is missing.
    """
    record = json.loads((ckpt / LAYERS_FILE).read_text())
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(record["layers"]):
        path = ckpt / f"layer_{i:02d}-model_states.pt"
        if not path.is_file():
            raise ConfigError(f"export: '{ckpt}' has no {path.name}, which its {LAYERS_FILE} lists; export another "
                              f"checkpoint")
        for k, v in pipeline.renamed(safe_load.load(path, map_location="cpu"), layer["names"]).items():
            out.setdefault(k, v)
    return out


def verified_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """:func:`consolidated_state_dict` of ``ckpt`` once it verifies as a resume verifies it (every file against its
    manifest, every pickle scanned for code: :func:`finetune.lifecycle.checkpoint.verify`), read with
    ``weights_only`` loading (:mod:`finetune.lifecycle.safe_load`). This process alone checks every file, with no
    collective call (``finetune export``; rank 0 of a launch).

    Raises:
        ConfigError: a file does not match the manifest or names code (one line naming the files).
    """
    check = verify(ckpt, alone=True)
    if check.problems:
        raise ConfigError(f"export: '{ckpt}' is damaged or not checkpoint data ({'; '.join(check.problems[:3])}"
                          f"{' ...' if len(check.problems) > 3 else ''}); export another checkpoint")
    if not check.manifest:
        logger.warning(f"export: '{ckpt}' has no manifest (saved before checkpoints recorded their files' SHA-256): "
                       f"exported unverified")
    with safe_load.weights_only():  # zero_to_fp32 passes weights_only=False
        return consolidated_state_dict(ckpt)


def non_finite(state: dict[str, torch.Tensor]) -> list[str]:
    """``"name (n of N)"`` for each floating-point tensor of ``state`` holding a NaN or an infinity."""
    bad = []
    for name, t in state.items():
        if t.is_floating_point() and not (ok := torch.isfinite(t)).all():
            bad.append(f"{name} ({int((~ok).sum()):,} of {t.numel():,})")
    return bad


def _check_and_load(model: torch.nn.Module, state: dict[str, torch.Tensor], ckpt: Path) -> None:
    expected = model.state_dict()
    problems = []
    for name, tensor in state.items():
        if name not in expected:
            continue
        if tensor.numel() == 0 and expected[name].numel() > 0:
            problems.append(f"'{name}' is empty (shape {tuple(tensor.shape)}, model expects "
                            f"{tuple(expected[name].shape)}): a ZeRO-3 partition was not gathered")
        elif tensor.shape != expected[name].shape:
            problems.append(f"'{name}' has shape {tuple(tensor.shape)}, the model expects {tuple(expected[name].shape)}")
    if problems:
        raise ConfigError([f"export: {ckpt}: {p}" for p in problems])
    result = model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    provided_ptrs = {model.state_dict()[k].data_ptr() for k in state if k in expected}
    for name in result.missing_keys:
        if model.state_dict()[name].data_ptr() not in provided_ptrs:  # tied weights share storage: fine
            problems.append(f"'{name}' is missing from the checkpoint")
    if problems:
        raise ConfigError([f"export: {ckpt}: {p}" for p in problems])


def _load_trained(model: torch.nn.Module, state: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Load the trained parameters of ``model`` (the adapters, ``modules_to_save``) from ``state``; the frozen base
    stays as built. Every one must be in ``state`` with its shape."""
    problems, trained = [], {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name not in state:
            problems.append(f"'{name}' is missing from the checkpoint")
        elif state[name].shape != p.shape:
            problems.append(f"'{name}' has shape {tuple(state[name].shape)}, the model expects {tuple(p.shape)}")
        else:
            trained[name] = state[name]
    if problems:
        raise ConfigError([f"export: {ckpt}: {p}" for p in problems])
    model.load_state_dict(trained, strict=False)


_LAYER_KEYS = ("weight", "bias", "SCB", "weight_format")
"""A bitsandbytes layer's own ``state_dict`` entries (with ``weight.*``, a 4-bit weight's quantization state)."""


def saved_quantized_layer(ckpt: Path):
    """``layer name -> {key: tensor}``: a QLoRA base layer's entries of the module state in ``ckpt`` (its
    ``mp_rank_00_model_states.pt``, read with :func:`finetune.lifecycle.safe_load.load`; ``zero_to_fp32`` leaves the
    quantization state out), for :func:`finetune.engine.quantize.dequantized_base`: the packed weights training
    used. The layer is looked up as the ``PeftModel`` names it (``base_model.model.<name>.base_layer`` with adapters
    on it, else ``base_model.model.<name>``), or by its own name.

    Raises:
        ConfigError: the checkpoint has no model states, or no packed weight for a layer (one line naming both).
    """
    states = ckpt / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise ConfigError(f"export: '{ckpt}' is not a DeepSpeed checkpoint folder (no model states)")
    module = safe_load.load(states, map_location="cpu")["module"]

    def entries(name: str) -> dict[str, torch.Tensor]:
        for prefix in (f"base_model.model.{name}.base_layer.", f"base_model.model.{name}.", f"{name}."):
            got = {k[len(prefix):]: v for k, v in module.items() if k.startswith(prefix)
                   and (k[len(prefix):] in _LAYER_KEYS or k[len(prefix):].startswith("weight."))}
            if "weight" in got:
                return got
        raise ConfigError(f"export: {ckpt}: {name}: the checkpoint holds no packed weight of this quantized layer "
                          f"(its module state lacks base_model.model.{name}.base_layer.weight); export a checkpoint "
                          f"finetune saved from a model.quantization run")

    return entries


def run_precision(run_dir: Path) -> str:
    """``fp32``, ``bf16`` or ``fp16``: what the run in ``run_dir`` trained in (its ``ds_config.json``; fp32 without)."""
    ds = run_dir / "ds_config.json"
    return precision_of(json.loads(ds.read_text())) if ds.is_file() else "fp32"


PROVENANCE = "finetune_export.json"
"""File in every export naming the checkpoint and step it came from."""


def _step_of(ckpt: Path) -> int | None:
    marker = ckpt / "COMPLETE"
    return json.loads(marker.read_text()).get("step") if marker.is_file() else None


def run_config_of(ckpt: Path, run_dir: Path) -> Path:
    """The run config checkpoint ``ckpt`` was trained with: its own ``run_config.yaml``, else the run folder's."""
    return ckpt / "run_config.yaml" if (ckpt / "run_config.yaml").is_file() else run_dir / "run_config.yaml"


def source_use_cache(run_cfg) -> bool:
    """``use_cache`` of the model the run started from, for the export's ``config.json`` and the generation config
    derived from it: ``model.config_overrides``' value, else ``model.path``'s config's, else True (a source that
    cannot be read any more: the transformers default of causal LMs). The run's own model config may say False:
    ``sft``'s packing trains without a KV cache (:func:`finetune.recipes.sft.prepare_model_config`), which the
    export's users should not inherit (``generate`` would recompute every token's past)."""
    if "use_cache" in run_cfg.model.config_overrides:
        return bool(run_cfg.model.config_overrides["use_cache"])
    try:
        source = AutoConfig.from_pretrained(run_cfg.model.path, local_files_only=True)
    except Exception:  # noqa: BLE001  (moved or deleted since training: the default)
        return True
    return bool(getattr(source, "use_cache", True))


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, run_dir: str | Path | None = None,
                      keep_previous: bool = False, state: dict[str, torch.Tensor] | None = None,
                      chosen_by: dict | None = None) -> Path:
    """Write a Hugging Face folder for checkpoint ``ckpt`` that ``from_pretrained`` loads, with its model card
    (``README.md``, :func:`finetune.lifecycle.model_card.write_card`). Its ``config.json`` is the run's model config
    with the source model's ``use_cache`` (:func:`source_use_cache`), and so is its derived ``generation_config.json``.

    Args:
        ckpt: a complete checkpoint folder (``.../checkpoints/step<N>``).
        out_dir: the folder to create; must not exist yet, or be empty (unless ``keep_previous``).
        run_dir: the run folder (default: ``ckpt/../..``), for the model config, tokenizer and recipe.
        keep_previous: when ``out_dir`` holds an earlier export (a resumed run finishing again), move it
            to ``<out_dir>-step<N>`` once the new export is complete instead of refusing.
        state: the full state dict to write instead of the checkpoint's (a tensor- or expert-parallel engine's,
            gathered by :func:`engine_state_dict`; the checkpoint holds one file per tensor-parallel rank, or each
            rank's experts apart).
        chosen_by: why this checkpoint, for the model card (``export_check.json``'s ``chosen_by``); None: the
            caller named it.

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: missing inputs, ``out_dir`` not empty, or missing/empty tensors.
    """
    ckpt, out_dir = Path(ckpt), Path(out_dir)
    run_dir = Path(run_dir) if run_dir else ckpt.parent.parent
    meta = run_dir / MODEL_META
    if not is_complete(ckpt):
        raise ConfigError(f"export: '{ckpt}' is not a complete checkpoint (no COMPLETE marker)")
    run_config = run_config_of(ckpt, run_dir)
    if not (meta / "config.json").is_file() or not run_config.is_file():
        raise ConfigError(f"export: run folder '{run_dir}' lacks {MODEL_META}/config.json or run_config.yaml")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"export: '{out_dir}' is a file, not a folder; give the path of a new folder")
    if out_dir.exists() and any(out_dir.iterdir()) and not keep_previous:
        raise ConfigError(f"export: '{out_dir}' exists and is not empty; choose a new folder")
    parent = out_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"export: cannot create '{out_dir}' ('{parent}' is not a writable folder); choose "
                          f"another folder")
    run_cfg = load_run_config(run_config)
    recipe = get_recipe(run_cfg.recipe)

    state = verified_state_dict(ckpt) if state is None else state
    bad = non_finite(state)
    if bad:
        raise ConfigError(f"export: '{ckpt}' holds weights that are not finite: {', '.join(bad[:4])}"
                          f"{' ...' if len(bad) > 4 else ''}; nothing was written (a checkpoint finetune saved never "
                          f"holds them: the files were changed after the save); export another checkpoint")
    config = AutoConfig.from_pretrained(meta, local_files_only=True)
    config.use_cache = source_use_cache(run_cfg)  # sft's packing trains without; the export generates with a cache
    q = run_cfg.model.quantization
    with plain_model_construction():
        if q is not None:  # QLoRA: the checkpoint's packed base dequantized, the adapters from the checkpoint
            model = quantize.dequantized_base(recipe.model_class, run_cfg.model.path, config, q, run_precision(run_dir),
                                              saved=saved_quantized_layer(ckpt))
        else:
            model = recipe.model_class.from_config(config, dtype=torch.float32)
        if run_cfg.model.lora is not None:  # the checkpoint holds the PeftModel's state (base + adapters)
            model = lora.wrap(model, run_cfg.model.lora, recipe.model_class, 0)
            model.peft_config["default"].base_model_name_or_path = (
                str(Path(run_cfg.model.path).resolve()) if run_cfg.model.init == "pretrained" else None)
    if q is not None:
        _load_trained(model, state, ckpt)
    else:
        _check_and_load(model, state, ckpt)

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if run_cfg.model.lora is not None:
            model.save_pretrained(tmp / lora.ADAPTER_DIR)  # adapter_config.json + adapter_model.safetensors
            model = model.merge_and_unload()  # W + (alpha / r) B A, a plain transformers model again
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(meta, local_files_only=True).save_pretrained(tmp)
        copy_processor_files(Path(meta), tmp)  # a multimodal model's processor, as the run began with it
        (tmp / PROVENANCE).write_text(json.dumps({"checkpoint": str(ckpt.resolve()), "step": _step_of(ckpt)}))
        recipe.export_files(run_cfg, tmp)  # embed: the sentence-transformers modules
        write_card(tmp, ckpt, run_dir, run_cfg, chosen_by)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves no folder behind
        raise
    if out_dir.exists() and any(out_dir.iterdir()):
        old = json.loads((out_dir / PROVENANCE).read_text()) if (out_dir / PROVENANCE).is_file() else {}
        aside = out_dir.with_name(f"{out_dir.name}-step{old.get('step', 'unknown')}")
        while aside.exists():
            aside = aside.with_name(aside.name + "-old")
        out_dir.rename(aside)
        logger.info(f"previous export kept as {aside}")
    elif out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    n = sum(t.numel() for t in model.parameters())
    logger.info(f"exported {ckpt} -> {out_dir} ({n:,} parameters, model.safetensors, model card {CARD}"
                f"{'; LoRA merged, adapter in ' + lora.ADAPTER_DIR + '/' if run_cfg.model.lora is not None else ''})")
    return out_dir


def _adapter_diff(run_dir: Path, recipe, inputs: dict, ref: torch.Tensor) -> float | None:
    """Max |logits| difference between ``export/adapter`` on its base model (``peft.PeftModel.from_pretrained``)
    and the engine's ``ref``; None when the run has no LoRA.

    The base is what a user would load: ``model.path`` (with the run's model config) for ``init: pretrained``;
    for ``init: scratch`` the random base exists only in the checkpoint, so it is rebuilt from there (the
    ``PeftModel`` state loaded, then ``unload()``: adapters removed, not merged).
    """
    export = run_dir / "export"
    ckpt = Path(json.loads((export / PROVENANCE).read_text())["checkpoint"])
    run_cfg = load_run_config(run_config_of(ckpt, run_dir))
    if run_cfg.model.lora is None:
        return None
    config = AutoConfig.from_pretrained(run_dir / MODEL_META, local_files_only=True)
    with plain_model_construction():
        if run_cfg.model.quantization is not None:  # the adapter is for the quantized base, as QLoRA users load it
            base = quantize.load_base(recipe.model_class, run_cfg.model.path, config, run_cfg.model.quantization,
                                      run_precision(run_dir))
        elif run_cfg.model.init == "pretrained":
            base = load_pretrained(recipe.model_class, run_cfg.model.path, config)
        else:
            peft_model = lora.wrap(recipe.model_class.from_config(config, dtype=torch.float32), run_cfg.model.lora,
                                   recipe.model_class, 0)
            with safe_load.weights_only():
                _check_and_load(peft_model, consolidated_state_dict(ckpt), ckpt)
            base = peft_model.unload()
        adapted = PeftModel.from_pretrained(base, export / lora.ADAPTER_DIR).eval()
    with torch.no_grad():
        got = output_logits(adapted(**inputs))
    return (got - ref).abs().max().item()


def output_logits(out) -> torch.Tensor:
    """A model output's logits as float32: ``logits``, for a question-answering head its start and end logits
    stacked on a last axis of 2 (``[batch, seq, 2]``), for a model without a head (``AutoModel``: ``embed``) its last
    hidden states."""
    if getattr(out, "logits", None) is None and getattr(out, "start_logits", None) is not None:
        return torch.stack([out.start_logits, out.end_logits], dim=-1).float()
    if getattr(out, "logits", None) is None and getattr(out, "last_hidden_state", None) is not None:
        return out.last_hidden_state.float()
    return out.logits.float()


def verify_export(engine, validation, collator, run_dir: Path, ds: dict, recipe, provenance: dict | None = None) -> None:
    """Compare the export's logits with the engine's on a fixed batch; all ranks call it (ZeRO-3 gathers).

    The batch is the first 4 validation rows (collated under a fixed seed). Rank 0 reloads
    ``run_dir/export`` with plain ``from_pretrained`` and writes ``export_check.json``: the maximum absolute
    logit difference, the input batch (token ids and attention mask, or position ids of packed rows) and a small summary of the engine's
    logits (shape, mean, std, the first 8 logits of the first position), never the full tensors. A non-finite difference (NaN/inf logits) never
    passes, and the JSON stays valid (``null`` for a non-finite number). With LoRA the adapter folder is checked
    too (:func:`_adapter_diff`, ``max_abs_logit_diff_adapter``), under the same limits.

    Raises:
        RunFailure: on every rank (``agreed``: rank 0 prints it), when the difference is not finite or above
            :func:`logit_tolerance` (in fp32 1e-4 or a small share of the largest logit, a share of the logits'
            spread in bf16/fp16).
    """
    rows = [validation[i] for i in range(min(4, len(validation)))]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        batch = collator(rows)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")
              if k in batch}  # sft packs
    engine.eval()
    with torch.no_grad():
        if pipeline.is_pipeline(engine):  # through every stage; the last one's logits, on every rank
            ref = pipeline.logits(engine, inputs)
        else:
            ref = output_logits(engine(**{k: v.to(engine.device) for k, v in inputs.items()})).cpu()
    engine.train()
    verdict = None
    if dist_utils.is_main():
        with plain_model_construction():
            exported = recipe.model_class.from_pretrained(run_dir / "export", local_files_only=True,
                                                          dtype=torch.float32).eval()
        exported.config.use_cache = False  # one forward as training ran it (packed rows' masks need no KV cache)
        with torch.no_grad():
            got = output_logits(exported(**inputs))
        diff = (got - ref).abs().max().item()
        adapter_diff = _adapter_diff(run_dir, recipe, inputs, ref)

        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        summary = {**(provenance or {}), "max_abs_logit_diff": finite(diff), "finite": math.isfinite(diff),
                   "inputs": {k: v.tolist() for k, v in inputs.items()}, "logits_shape": list(ref.shape),
                   "engine_logits_mean": finite(ref.mean().item()), "engine_logits_std": finite(ref.std().item()),
                   "engine_logits_head": [finite(v) for v in ref.reshape(-1)[:8].tolist()]}
        if adapter_diff is not None:
            summary["max_abs_logit_diff_adapter"] = finite(adapter_diff)
            diff = max(diff, adapter_diff) if math.isfinite(adapter_diff) else adapter_diff
        low_precision = bool(ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled")) or _int8_base(run_dir)
        tolerance = logit_tolerance(ref, low_precision)
        summary["tolerance"] = finite(tolerance)
        (run_dir / "export_check.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
        logger.info(f"export check: max |logits(export) - logits(engine)| = {diff:.3g} on a fixed batch"
                    + (f" (adapter on its base: {adapter_diff:.3g})" if adapter_diff is not None else "")
                    + f"; tolerance {tolerance:.3g}")
        try:
            check_logit_diff(diff, tolerance)
        except RuntimeError as e:
            verdict = str(e)
    verdict = dist_utils.all_gather_object(verdict)[0]  # rank 0's; also the barrier the ranks met at before
    if verdict:
        raise RunFailure(verdict, agreed=True)


LOW_PRECISION_SPREAD = 0.2
"""bf16/fp16 runs: the export check's tolerance as a share of the standard deviation of the engine's logits."""

FP32_RELATIVE = 2e-5
"""fp32 runs: the export check's tolerance as a share of the engine's largest absolute logit (when above 1e-4)."""


def _int8_base(run_dir: Path) -> bool:
    """True when the run's base is quantized to 8 bits (LLM.int8 rounds each activation row to 8 bits in every
    matmul, which the dequantized merged export does not: its logits differ as a low-precision run's do)."""
    q = load_run_config(run_dir / "run_config.yaml").model.quantization
    return q is not None and q.bits == 8


def logit_tolerance(ref: torch.Tensor, low_precision: bool) -> float:
    """The largest max-absolute logit difference the export check accepts.

    fp32: 1e-4, or :data:`FP32_RELATIVE` x the largest absolute logit when that is more. The same weights in the
    same dtype differ only by rounding: the kernels' summation order, and with LoRA the merged export's ``W + BA``
    against the engine's ``Wx + B(Ax)``. That rounding is relative (fp32 keeps 24 bits), so it grows with the logits'
    scale and the depth: a pretrained 30-layer model's logits reach tens, where a fixed 1e-4 fails a correct merged
    export. A wrong export moves the logits by about their spread and fails either way. bf16/fp16: the
    engine computes in 8 or 11 mantissa bits while the export is reloaded in fp32, so the difference scales with the
    logits: :data:`LOW_PRECISION_SPREAD` x their standard deviation. A wrong export (a tensor-parallel slice gathered
    in the wrong place, weights of another step) moves logits by about their whole spread and fails.

    Args:
        ref: the engine's logits (any shape, float32).
        low_precision: the run trains in bf16 or fp16, or on an 8-bit base (``model.quantization.bits=8``).
    """
    if not low_precision:
        largest = ref.float().abs().max().item() if ref.numel() else 0.0
        return max(1e-4, FP32_RELATIVE * largest) if math.isfinite(largest) else float("nan")
    spread = ref.float().std().item()
    return LOW_PRECISION_SPREAD * spread if math.isfinite(spread) else float("nan")


def check_logit_diff(diff: float, tolerance: float) -> None:
    """Raise when the export check's maximum absolute logit difference ``diff`` is not finite or above ``tolerance``.

    Raises:
        RuntimeError: the logits are not finite (the model diverged), or differ by more than ``tolerance``.
    """
    if not math.isfinite(diff):
        raise RuntimeError(f"export check failed: the logits are not finite (max difference {diff}); the model "
                           f"diverged")
    if not diff <= tolerance:
        raise RuntimeError(f"export check failed: exported logits differ from the engine's by {diff:.3g} (tolerance "
                           f"{tolerance:.3g})")


def engine_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Under expert parallelism (AutoEP): the engine's state dict in the Hugging Face layout on rank 0, the experts
    gathered (:func:`finetune.parallel.expert.hf_state_dict`); the checkpoint holds each rank's experts apart. Under
    tensor parallelism (AutoTP): the engine's full state dict on rank 0 (fp32 CPU tensors of the original
    shapes; DeepSpeed's ``_consolidated_16bit_state_dict`` gathers the split layers, in the training dtype), None on
    the other ranks. None without tensor parallelism (the export reads the checkpoint). All ranks call it.

    DeepSpeed's public ``save_16bit_model`` gathers ZeRO-3 partitions but saves each rank's AutoTP slices as they
    are (``module_state_dict``), so the private method is the only gatherer of AutoTP weights; accelerate's
    ``get_state_dict`` calls it too.

    Raises:
        RunFailure: the engine has no ``_consolidated_16bit_state_dict`` (renamed upstream).
    """
    if expert.uses_autoep(engine):  # AutoEP: each rank holds experts / ep; gathered back into the HF layout
        return expert.hf_state_dict(engine)
    if pipeline.is_pipeline(engine):  # each stage's layers, under their Hugging Face names
        return pipeline.hf_state_dict(engine)
    if getattr(engine, "autotp_size", lambda: 0)() <= 1:
        return None
    gather = getattr(engine, "_consolidated_16bit_state_dict", None)
    if not callable(gather):
        raise RunFailure(f"tensor parallelism: {type(engine).__name__} has no _consolidated_16bit_state_dict to gather "
                         f"the AutoTP slices for the export; install the DeepSpeed version finetune pins")
    state = gather()
    if not dist_utils.is_main():
        return None
    return {k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu() for k, v in state.items()}


def _set_aside_failed(run_dir: Path, step: int, kept: set[Path]) -> str:
    """Rank 0, after a failed export check: move ``export/`` (with the check's ``export_check.json``) to
    ``export.failed-step<step>`` (``-2``, ... when taken) and the earlier export this launch kept aside (``kept``: at
    most one ``export-step<M>``) back to ``export/``. Returns the words for the error line."""
    failed = run_dir / f"export.failed-step{step}"
    k = 1
    while failed.exists():
        k += 1
        failed = run_dir / f"export.failed-step{step}-{k}"
    (run_dir / "export").rename(failed)
    if (run_dir / "export_check.json").is_file():  # the failed check's record goes with what it checked
        (run_dir / "export_check.json").rename(failed / "export_check.json")
    words = f"; the export was moved aside to {failed} (with its export_check.json; nothing is left in export/)"
    if len(kept) == 1:
        previous = kept.pop()
        previous.rename(run_dir / "export")
        words = f"; the export was moved aside to {failed}; the earlier export ({previous.name}) is back in export/"
    logger.error(words.removeprefix("; "))
    return words


def export_and_verify(engine, run_dir: Path, step: int, validation, collator, ds: dict, recipe,
                      chosen_by: dict | None = None) -> Path:
    """End of a run: rank 0 exports checkpoint ``step<step>`` to ``run_dir/export`` (an earlier export is kept aside
    as ``export-step<N>``), then every rank takes part in :func:`verify_export`. All ranks call it. The engine must
    hold that checkpoint's weights; ``export_check.json`` records ``checkpoint_step`` and ``chosen_by`` (why this
    step: the last one, or ``train.keep_best``'s metric and value). Rank 0 then rewrites the export's model card with
    the check's result.

    A failed check leaves no export behind: rank 0 moves the new folder (and ``export_check.json``) aside as
    ``export.failed-step<N>`` (named in the error) and an earlier export it had kept aside back to ``export/``.

    Returns:
        The export folder.

    Raises:
        RunFailure: the export's logits differ from the engine's (:func:`verify_export`), on every rank; rank 0's
            message names where the export went.
    """
    state = engine_state_dict(engine)
    ckpt, chosen_by = checkpoints_dir(run_dir) / f"step{step}", chosen_by or {"last_step": step}
    before = set(run_dir.glob("export-step*"))
    if dist_utils.is_main():
        export_checkpoint(ckpt, run_dir / "export", keep_previous=True, state=state, chosen_by=chosen_by)
    dist_utils.barrier()
    try:
        verify_export(engine, validation, collator, run_dir, ds, recipe,
                      {"checkpoint_step": step, "chosen_by": chosen_by})
    except RunFailure as e:
        where = _set_aside_failed(run_dir, step, set(run_dir.glob("export-step*")) - before) if \
            dist_utils.is_main() else ""
        raise RunFailure(f"{e}{where}", agreed=True) from None
    if dist_utils.is_main():  # the card again, now with export_check.json's max_abs_logit_diff
        write_card(run_dir / "export", ckpt, run_dir, load_run_config(run_config_of(ckpt, run_dir)), chosen_by)
    return run_dir / "export"
