"""``train.optimizer: muon``: which parameters DeepSpeed's Muon trains, and what a run must not combine with it.

DeepSpeed 0.19.8's Muon (``"optimizer": {"type": "Muon"}``, ``deepspeed/runtime/zero/muon/``) is one optimizer,
``MuonWithAuxAdam``, that splits every parameter group by the ``use_muon`` attribute of its parameters
(``DeepSpeedEngine._muon_param_groups``): Muon (momentum, Newton-Schulz orthogonalisation) for ``use_muon=True``,
an auxiliary AdamW for the rest. Which parameters are matrices of the hidden layers is decided here, once, by module
type (:func:`tag`), as Jordan et al. 2024 ("Muon") and Liu et al. 2025 ("Muon is Scalable for LLM Training",
Moonlight) do: the weights of ``nn.Embedding`` modules, the output head (``get_output_embeddings()``; a model
without one, sequence classification, has its task head, the modules outside ``base_model``) and every parameter
with fewer than 2 dimensions (norms, biases) go to AdamW; every other 2-D weight to Muon.

DeepSpeed's ``deepspeed.initialize`` tags the parameters itself (``deepspeed.set_optimizer_flags``) by name: a
2-D parameter whose name holds neither ``embed`` nor ``lm_head`` is Muon's, which would put GPT-2's ``wte`` and
``wpe`` embeddings on Muon. :func:`keep_tags` is the patch (:mod:`finetune.patches`) that keeps finetune's tags
during ``deepspeed.initialize``.

ZeRO stages: DeepSpeed runs Muon's orthogonalisation inside its ZeRO optimizers (ZeRO 1/2:
``DeepSpeedZeroOptimizer`` orthogonalises each whole gradient before it is partitioned, ``get_flat_partition``; ZeRO-3:
``DeepSpeedZeroOptimizer_Stage3`` in its sub-group loop; bf16 ZeRO 1: ``BF16_Optimizer``'s Muon path), so ZeRO 1-3
are supported. Without ZeRO (stage 0) a bf16/fp16 run goes through DeepSpeed's ``FP16_Optimizer``, whose flat
fp32 master copies are 1-D: ``MuonWithAuxAdam.step`` takes a 1-D Muon parameter for a ZeRO partition whose gradient
already holds the orthogonalised update and applies the raw gradient (plain SGD); stage 0 is refused.
"""

from __future__ import annotations

import torch

from finetune import patches
from finetune.config import RunConfig

KEEP_TAGS_WHY = ("deepspeed.initialize tags use_muon by parameter name ('embed', 'lm_head'), which puts GPT-2's wte "
                 "and wpe embeddings on Muon; finetune tags by module type before (finetune.engine.muon.tag); no "
                 "upstream issue filed")


def _shape(p: torch.nn.Parameter) -> tuple:
    """The parameter's shape as a layer (under ZeRO-3 ``zero.Init`` its data is a flat partition: ``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", None) or p.numel())


def adamw_parameters(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter that goes to the auxiliary AdamW by module (not by shape): embeddings, the output
    head (``get_output_embeddings()``, else the modules outside ``base_model``)."""
    out = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        out |= {id(p) for p in head.parameters()}
    else:
        base = getattr(model, "base_model", model)
        if base is not model:
            inside = {id(p) for p in base.parameters()}
            out |= {id(p) for p in model.parameters() if id(p) not in inside}
    return out


def split(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """``(muon, adamw)``: the model's parameters (shared ones once, frozen ones included) as ``(name, parameter)``."""
    aux = adamw_parameters(model)
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if len(_shape(p)) >= 2 and id(p) not in aux else adamw).append((name, p))
    return muon, adamw


def muon_parameter_count(model: torch.nn.Module) -> int:
    """Elements of the parameters Muon would train (trainable ones only), for ``finetune plan``."""
    muon, _ = split(model)
    return sum(_numel(p) for _, p in muon if p.requires_grad)


def tag(model: torch.nn.Module) -> str:
    """Set ``use_muon`` on every parameter of ``model`` (:func:`split`) and return the log line with the counts."""
    muon, adamw = split(model)
    for _, p in muon:
        p.use_muon = True
    for _, p in adamw:
        p.use_muon = False
    m = [p for _, p in muon if p.requires_grad]
    a = [p for _, p in adamw if p.requires_grad]
    return (f"optimizer: Muon on {len(m)} matrices ({sum(map(_numel, m)):,} parameters), AdamW on {len(a)} tensors "
            f"({sum(map(_numel, a)):,} parameters)")


def _keep_flags(config_class, model) -> None:
    """Stands in for ``deepspeed.set_optimizer_flags`` during ``deepspeed.initialize``: the ``use_muon`` tags are
    finetune's (:func:`tag`); no per-head Newton-Schulz (``per_head_muon`` is not set)."""
    for p in model.parameters():
        if not hasattr(p, "use_muon"):
            raise RuntimeError("train.optimizer=muon: a parameter without a use_muon tag reached deepspeed.initialize")
        p.muon_num_heads = None
        p.muon_head_dim = None


MUON_CHECKED = ("0.19.8",)
"""DeepSpeed versions whose ``set_optimizer_flags`` / ``_muon_param_groups`` contract :func:`keep_tags` was read
against and tested with (``tests/test_muon.py``)."""


def version_problem(version: str | None = None) -> str | None:
    """The problem line when this DeepSpeed is not one of :data:`MUON_CHECKED` (None when it is)."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if version in MUON_CHECKED:
        return None
    return (f"train.optimizer=muon replaces DeepSpeed's set_optimizer_flags during deepspeed.initialize, checked for "
            f"DeepSpeed {', '.join(MUON_CHECKED)} only (this is {version}); install deepspeed=={MUON_CHECKED[-1]} "
            f"or use train.optimizer=adamw")


def keep_tags():
    """The patch of ``deepspeed.set_optimizer_flags`` for :func:`finetune.patches.applied` around
    ``deepspeed.initialize``; only on the DeepSpeed versions of :data:`MUON_CHECKED`.

    Raises:
        RunFailure: another DeepSpeed version (:func:`finetune.patches.require_version`).
    """
    import deepspeed

    patches.require_version("deepspeed", deepspeed.__version__, MUON_CHECKED,
                            "finetune's use_muon tags by module type (DeepSpeed's set_optimizer_flags replaced)")
    return patches.module_global(deepspeed, "set_optimizer_flags", _keep_flags, KEEP_TAGS_WHY)


def universal_problem(ckpt, saved: dict, world_size: int, stage: int) -> str:
    """The line that refuses resuming the Muon checkpoint ``ckpt`` through a universal copy (another world size or
    ZeRO stage): DeepSpeed 0.19.8's ``ds_to_universal`` converts the Adam moments (``exp_avg``, ``exp_avg_sq``) of
    every parameter group and stops with ``KeyError: 'exp_avg'`` on Muon's ``momentum_buffer`` (ZeRO 1-3), and its
    universal loaders read those two keys only. ``saved``: the checkpoint's ``COMPLETE`` marker."""
    old_world, old_stage = saved.get("world_size"), saved.get("zero_stage")
    return (f"--resume: '{ckpt}' was saved by train.optimizer=muon with world size {old_world} and ZeRO stage "
            f"{old_stage}, this launch has world size {world_size} and ZeRO stage {stage}: another layout needs a "
            f"universal copy of the checkpoint, and DeepSpeed's ds_to_universal cannot convert Muon's momentum "
            f"(it converts Adam's exp_avg/exp_avg_sq only); resume with {old_world} ranks and "
            f"ds.zero_optimization.stage={old_stage}, or export it (finetune export {ckpt} <dir>) and start a new run "
            f"from the export")


def check(cfg: RunConfig, stage: int, problems: list[str]) -> None:
    """Append one line per setting ``train.optimizer: muon`` cannot run with (before any model is built)."""
    if cfg.train.optimizer != "muon":
        return
    problems += [line for line in (version_problem(),) if line]
    if stage == 0:
        problems.append("train.optimizer=muon needs ZeRO stage 1, 2 or 3 (DeepSpeed runs Muon inside its ZeRO "
                        "optimizers; without ZeRO a bf16/fp16 run would silently take SGD steps): use "
                        "ds_configs/zero1.json, zero2.json or zero3.json (or ds.zero_optimization.stage=1)")
    if cfg.model.lora is not None:
        problems.append("train.optimizer=muon is for full fine-tuning: model.lora trains low-rank adapter factors, "
                        "which Muon's orthogonalised updates do not fit; drop model.lora or use train.optimizer=adamw")
    if cfg.parallel.tensor_parallel_size > 1:
        problems.append("train.optimizer=muon with parallel.tensor_parallel_size > 1: Muon would orthogonalise each "
                        "rank's shard of a matrix, not the matrix; set parallel.tensor_parallel_size=1 or use "
                        "train.optimizer=adamw")
    if cfg.parallel.sequence_parallel_size > 1:
        problems.append("train.optimizer=muon with parallel.sequence_parallel_size > 1 is not supported yet (not "
                        "tested with DeepSpeed's Muon); set parallel.sequence_parallel_size=1 or use "
                        "train.optimizer=adamw")

