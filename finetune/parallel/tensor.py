"""Tensor parallelism through DeepSpeed's AutoTP (``"tensor_parallel": {"autotp_size": tp}`` in the DeepSpeed
config, written by :mod:`finetune.engine.ds_config`): what a run needs of it, checked before any model is built.

AutoTP splits the attention and MLP linears of each layer over the ``tp`` ranks of a group (``q/k/v_proj`` and
``gate/up_proj`` by output columns, ``o_proj`` and ``down_proj`` by input rows, with an all-reduce after them);
the LM head runs on the gathered output, so the recipes' head loss is unchanged.
"""

from __future__ import annotations

from collections.abc import Collection

from finetune.config import RunConfig
from finetune.parallel.layout import SIZE_KEYS, head_problems

AUTOTP_CHECKED = ("llama", "qwen2", "qwen3")
"""Model types whose AutoTP training finetune checked against one device (separate ``q/k/v_proj`` and
``gate/up/down_proj`` linears, dense MLPs). Others are refused: fused ``qkv_proj`` / ``gate_up_proj`` layers (Phi-3)
split along the wrong axis, and mixture-of-experts layers are no dense MLPs; AutoTP itself accepts them silently."""

DIMENSION = "tensor"
"""The name of this dimension in a recipe's ``Capabilities.parallel``."""


def check(cfg: RunConfig, model_config, supported: Collection[str], problems: list[str], offered: str = "") -> None:
    """What tensor parallelism needs of the run, one problem line each (the world size and the ZeRO stage are
    :mod:`finetune.parallel.checks`').

    Args:
        cfg: the run config.
        model_config: the transformers config, or None.
        supported: the parallel dimensions the recipe supports (its ``Capabilities.parallel``).
        offered: the recipes tested with tensor parallelism, for the lines (``"gpt_clm and sft"``).
        problems: where the lines go.
    """
    tp, key = cfg.parallel.tensor_parallel_size, SIZE_KEYS["tp"]
    if tp < 1:
        problems.append(f"{key}: {tp} must be 1 (off) or more")
        return
    if tp == 1:
        return
    if cfg.parallel.sequence_parallel_size > 1:
        problems.append(f"{key}: tensor and sequence parallelism are not combined here; set one of "
                        f"parallel.tensor_parallel_size and parallel.sequence_parallel_size to 1")
    if DIMENSION not in supported:
        problems.append(f"{key}: recipe {cfg.recipe} is not tested with tensor parallelism"
                        f"{f' ({offered} are)' if offered else ''}; set {key}=1")
    if cfg.train.eval_generate.prompts:
        problems.append(f"{key}: train.eval_generate shares prompts among all ranks, but a tensor-parallel group must "
                        f"run the same ones; set train.eval_generate.prompts=0 (finetune evaluate on the export "
                        f"generates without tensor parallelism)")
    if cfg.model.lora is not None:
        problems.append(f"{key}: LoRA does not combine with AutoTP (it replaces the adapted layers, so the adapters "
                        f"are lost); train without model.lora or set {key}=1")
    if model_config is not None:
        mtype = getattr(model_config, "model_type", "")
        if mtype not in AUTOTP_CHECKED:
            problems.append(f"{key}: model type '{mtype}' is not checked with DeepSpeed's AutoTP here (checked: "
                            f"{', '.join(AUTOTP_CHECKED)}; fused attention/MLP projections and mixture-of-experts "
                            f"layers are not split correctly); set {key}=1")
    problems += head_problems(model_config, tp, key, f"each tensor-parallel rank holds heads / {tp}")


def check_zero_stage(cfg: RunConfig, stage: int, problems: list[str]) -> None:
    """Tensor parallelism runs with ZeRO 1-2 (AutoTP training's tested stages; at stage 0 each rank would clip and
    skip on the norm of its own slices); one line when the stage is another."""
    tp = cfg.parallel.tensor_parallel_size
    if tp > 1 and stage in (0, 3):
        problems.append(f"{SIZE_KEYS['tp']}: {tp} with ZeRO stage {stage}; tensor parallelism runs with "
                        f"ZeRO 1-2 (ds.zero_optimization.stage=1 or 2, or a zero1/zero2 JSON)"
                        + ("; at stage 0 each rank's gradient norm covers only its own weight slices, so clipping and "
                           "the skip of non-finite steps would differ between ranks" if stage == 0 else ""))
