"""Every check of the parallel layout of a run, in one entry point, before any model is built.

:func:`check` runs the size rules of :mod:`finetune.parallel.layout` once, then each dimension's own rules
(:mod:`finetune.parallel.sequence`, :mod:`finetune.parallel.tensor`, :mod:`finetune.parallel.expert`,
:mod:`finetune.parallel.pipeline`);
:func:`check_zero_stage` those that need
the resolved DeepSpeed config. A new dimension adds its module's ``check`` here and its name to the recipes'
``Capabilities.parallel``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from finetune.config import RunConfig
from finetune.parallel import expert, pipeline, sequence, tensor
from finetune.parallel.layout import size_problems


def check(cfg: RunConfig, model_config, world: int | None, supported: Collection[str], problems: list[str],
          offered: Mapping[str, str] | None = None) -> None:
    """What the run's parallel sizes and memory levers need, one problem line each.

    Args:
        cfg: the run config.
        model_config: the transformers config (head counts, model type), or None.
        world: the world size of the launch, or None when unknown (``finetune doctor`` without ``--world-size``).
        supported: the parallel dimensions the recipe supports (its ``Capabilities.parallel``: ``"sequence"``,
            ``"tensor"``, ``"expert"``).
        problems: where the lines go.
        offered: dimension name -> the recipes that support it, as the lines say them (``"gpt_clm and sft"``).
    """
    if world is not None:
        problems += size_problems(world, max(1, cfg.parallel.sequence_parallel_size),
                                  max(1, cfg.parallel.tensor_parallel_size), max(1, cfg.parallel.expert_parallel_size),
                                  max(1, cfg.parallel.pipeline_parallel_size))
    offered = offered or {}
    sequence.check(cfg, model_config, supported, problems, offered.get(sequence.DIMENSION, ""))
    tensor.check(cfg, model_config, supported, problems, offered.get(tensor.DIMENSION, ""))
    expert.check(cfg, model_config, supported, problems, offered.get(expert.DIMENSION, ""))
    pipeline.check(cfg, model_config, supported, problems, offered.get(pipeline.DIMENSION, ""))


def check_zero_stage(cfg: RunConfig, stage: int, problems: list[str]) -> None:
    """What the parallel dimensions need of the ZeRO stage (``stage`` from the resolved DeepSpeed config), one line
    each: tensor parallelism at ZeRO 1-2 (:func:`finetune.parallel.tensor.check_zero_stage`), ZeRO-3 under sequence
    parallelism on a checked DeepSpeed (:func:`finetune.parallel.sequence.check_zero3_average`)."""
    tensor.check_zero_stage(cfg, stage, problems)
    pipeline.check_zero_stage(cfg, stage, problems)
    problem = sequence.check_zero3_average(stage, cfg.parallel.sequence_parallel_size)
    if problem:
        problems.append(problem)
