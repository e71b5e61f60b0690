"""Hugging Face export from a DeepSpeed checkpoint: ``config.json``, tokenizer files, ``model.safetensors``.

Weights are consolidated by DeepSpeed's own ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``:
the fp32 master weights of ZeRO stage 1-3, merged across ranks); a stage-0 checkpoint already holds the
full module state. The result is checked before anything is written: every parameter of the model must be
present (or tied to one that is) with its full shape, never an empty ZeRO-3 placeholder. The folder is
written under a temporary name and renamed, so a failed export never leaves a half folder.

Command line: ``finetune export <checkpoint folder> <out folder>`` (or ``python -m finetune export``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from finetune.config import ConfigError
from finetune.logs import logger

MODEL_META = "model_config"
"""Run-folder subfolder with the model ``config.json`` and tokenizer files, written at the start of a run."""


@contextlib.contextmanager
def plain_model_construction():
    """Build models normally inside this block even while a ZeRO-3 ``HfDeepSpeedConfig`` is alive.

    Under ZeRO-3, transformers wraps ``from_pretrained``/``from_config`` in ``deepspeed.zero.Init``, a
    collective operation: building the export model on rank 0 alone would hang. The training
    engine's config is set back afterwards.
    """
    from transformers.integrations import deepspeed as hf_ds

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
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if list(ckpt.glob("*zero_pp_rank_*optim_states.pt")) and not list(ckpt.glob("bf16_zero_*")):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    states = ckpt / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise ConfigError(f"export: '{ckpt}' is not a DeepSpeed checkpoint folder (no model states)")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


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


PROVENANCE = "finetune_export.json"
"""File in every export naming the checkpoint and step it came from."""


def _step_of(ckpt: Path) -> int | None:
    marker = ckpt / "COMPLETE"
    return json.loads(marker.read_text()).get("step") if marker.is_file() else None


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, run_dir: str | Path | None = None,
                      keep_previous: bool = False) -> Path:
    """Write a Hugging Face folder for checkpoint ``ckpt`` that ``from_pretrained`` loads.

    Args:
        ckpt: a complete checkpoint folder (``.../checkpoints/step<N>``).
        out_dir: the folder to create; must not exist yet, or be empty (unless ``keep_previous``).
        run_dir: the run folder (default: ``ckpt/../..``), for the model config, tokenizer and recipe.
        keep_previous: when ``out_dir`` holds an earlier export (a resumed run finishing again), move it
            to ``<out_dir>-step<N>`` once the new export is complete instead of refusing.

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: missing inputs, ``out_dir`` not empty, or missing/empty tensors.
    """
    from finetune.checkpoint import is_complete
    from finetune.config import load_run_config
    from finetune.recipes import get_recipe
    from transformers import AutoConfig, AutoTokenizer

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    run_dir = Path(run_dir) if run_dir else ckpt.parent.parent
    meta = run_dir / MODEL_META
    if not is_complete(ckpt):
        raise ConfigError(f"export: '{ckpt}' is not a complete checkpoint (no COMPLETE marker)")
    if not (meta / "config.json").is_file() or not (run_dir / "run_config.yaml").is_file():
        raise ConfigError(f"export: run folder '{run_dir}' lacks {MODEL_META}/config.json or run_config.yaml")
    if out_dir.exists() and any(out_dir.iterdir()) and not keep_previous:
        raise ConfigError(f"export: '{out_dir}' exists and is not empty; choose a new folder")
    recipe = get_recipe(load_run_config(run_dir / "run_config.yaml").recipe)

    state = consolidated_state_dict(ckpt)
    config = AutoConfig.from_pretrained(meta, local_files_only=True)
    with plain_model_construction():
        model = recipe.MODEL_CLASS.from_config(config, dtype=torch.float32)
    _check_and_load(model, state, ckpt)

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(meta, local_files_only=True).save_pretrained(tmp)
    (tmp / PROVENANCE).write_text(json.dumps({"checkpoint": str(ckpt.resolve()), "step": _step_of(ckpt)}))
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
    logger.info(f"exported {ckpt} -> {out_dir} ({n:,} parameters, model.safetensors)")
    return out_dir
