"""Expert parallelism through DeepSpeed's AutoEP (``"expert_parallel": {"enabled": true, "autoep_size": ep}`` in the
DeepSpeed config, written by :mod:`finetune.engine.ds_config`): what a run needs of it, checked before any model is
built, and the gathering of the experts back into the Hugging Face layout for the export.

AutoEP (``deepspeed/module_inject/auto_ep*.py``, DeepSpeed 0.19.8) replaces each mixture-of-experts block that one of
its presets recognises (``mixtral``, ``qwen3_moe`` (also ``qwen2_moe``), ``qwen3_5_moe``, ``deepseek_v2``,
``deepseek_v3``, ``minimax_m3``) with an ``AutoEPMoELayer``: the router (``router.gate``) is replicated, the experts
are cut into ``ep`` groups of ``experts / ep`` (``experts.w1``/``w3``: ``[experts / ep, ffn, hidden]`` gate and up,
``experts.w2``: ``[experts / ep, hidden, ffn]``), and each token is sent to the ranks of its experts and back with
``all_to_all_single``. The expert-parallel groups are runs of ``ep`` consecutive ranks; every rank still reads its
own rows, so the data-parallel size of the samplers and the batch is the world size; expert gradients are averaged
over the ranks holding the same experts (DeepSpeed's expert-data-parallel groups, ``world / ep`` ranks).

On CPU ranks (gloo) it runs as on GPUs: the all-to-all is gloo's, and the experts use ``torch._grouped_mm``
(present in CPU builds of torch 2.13; DeepSpeed's Triton kernels, DeepEP and the fused combine are CUDA-only and are
never selected here). What is proved only on GPUs is listed in ``docs/parallelism.md``.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from finetune import patches
from finetune.config import RunConfig
from finetune.errors import RunFailure

DIMENSION = "expert"
"""The name of this dimension in a recipe's ``Capabilities.parallel``."""

KEY = "parallel.expert_parallel_size"
"""The run-config key of the expert-parallel size."""

EP_CHECKED = ("qwen3_moe",)
"""Model types whose AutoEP training finetune checked against EP=1 (the same losses) and whose export it gathers
back (fused ``gate_up_proj``/``down_proj`` experts, ``gate`` router, no shared experts). Other AutoEP presets are
refused until checked: their export layouts (Mixtral's per-expert ``w1/w2/w3``, shared experts) differ."""


def presets() -> dict[str, str]:
    """Hugging Face ``model_type`` -> the AutoEP preset DeepSpeed uses for it (DeepSpeed's preset registry)."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return {mtype: name for name, preset in PRESET_MODELS.items() for mtype in preset.hf_model_types}


def num_experts(model_config) -> int | None:
    """The routed experts of each MoE layer of ``model_config`` (a transformers config), read through the AutoEP
    preset's ``num_experts_attr`` (``num_experts``, ``num_local_experts``, ``n_routed_experts``); None when the model
    type has no preset or the config lacks it."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    name = presets().get(getattr(text, "model_type", ""))
    if name is None:
        return None
    value = getattr(text, PRESET_MODELS[name].num_experts_attr, None)
    return value if isinstance(value, int) else None


def check(cfg: RunConfig, model_config, supported: Collection[str], problems: list[str], offered: str = "") -> None:
    """What expert parallelism needs of the run, one problem line each, before any model is built (the world size is
    :func:`finetune.parallel.layout.size_problems`').

    Args:
        cfg: the run config.
        model_config: the transformers config, or None (not known yet).
        supported: the parallel dimensions the recipe supports (its ``Capabilities.parallel``).
        problems: where the lines go.
        offered: the recipes tested with expert parallelism, for the lines.
    """
    ep = cfg.parallel.expert_parallel_size
    if ep < 1:
        problems.append(f"{KEY}: {ep} must be 1 (off) or more")
        return
    if ep == 1:
        return
    if DIMENSION not in supported:
        problems.append(f"{KEY}: recipe {cfg.recipe} is not tested with expert parallelism"
                        f"{f' ({offered} is)' if offered else ''}; set {KEY}=1")
    if cfg.parallel.sequence_parallel_size > 1:
        problems.append(f"{KEY}: expert and sequence parallelism are not combined here (DeepSpeed builds the "
                        f"expert groups across Ulysses groups, not checked); set one of {KEY} and "
                        f"parallel.sequence_parallel_size to 1")
    if cfg.parallel.tensor_parallel_size > 1:
        problems.append(f"{KEY}: expert and tensor parallelism are not combined here (DeepSpeed's AutoEP+AutoTP "
                        f"folding; AutoTP is not checked on MoE models); set one of {KEY} and "
                        f"parallel.tensor_parallel_size to 1")
    if cfg.model.lora is not None:
        problems.append(f"{KEY}: LoRA does not combine with AutoEP (AutoEP replaces the MoE blocks and their adapted "
                        f"layers); train without model.lora or set {KEY}=1")
    if cfg.train.optimizer == "muon":
        problems.append(f"{KEY}: train.optimizer=muon would orthogonalise each rank's slice of the stacked experts, "
                        f"not each expert's matrix (not checked); use train.optimizer=adamw or set {KEY}=1")
    problem = registry_problem()
    if problem is not None:
        problems.append(problem)
    ds_ep = cfg.ds.get("expert_parallel") if isinstance(cfg.ds, dict) else None
    if isinstance(ds_ep, dict) and ds_ep:
        problems.append(f"{KEY}: ds.expert_parallel is set too; finetune writes that section from {KEY} (remove "
                        f"ds.expert_parallel)")
    if model_config is None:
        return
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    mtype = getattr(text, "model_type", "")
    known = presets()
    if mtype not in known:
        problems.append(f"{KEY}: model type '{mtype}' has no DeepSpeed AutoEP preset (presets for: "
                        f"{', '.join(sorted(known))}); set {KEY}=1")
        return
    if mtype not in EP_CHECKED:
        problems.append(f"{KEY}: model type '{mtype}' has an AutoEP preset ('{known[mtype]}') but finetune checked "
                        f"AutoEP training and its export only for {', '.join(EP_CHECKED)}; set {KEY}=1")
    experts = num_experts(model_config)
    if experts is not None and experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        problems.append(f"{KEY}: the model's {experts} experts are not divisible by {ep} (each rank of an "
                        f"expert-parallel group holds experts / {ep}); choose one of {divisors}")
    if getattr(text, "mlp_only_layers", None) or getattr(text, "decoder_sparse_step", 1) not in (1, None):
        problems.append(f"{KEY}: the model has dense MLP layers between its MoE layers (mlp_only_layers or "
                        f"decoder_sparse_step > 1), not checked with AutoEP; set {KEY}=1")


def ds_section(cfg: RunConfig) -> dict | None:
    """The DeepSpeed ``expert_parallel`` section for ``cfg`` (None when ``ep == 1``): AutoEP on with ``autoep_size``;
    DeepSpeed picks the preset from the model's ``model_type`` (checked by :func:`check`)."""
    ep = cfg.parallel.expert_parallel_size
    return {"enabled": True, "autoep_size": ep} if ep > 1 else None


def name_groups(groups: list[dict]) -> list[dict]:
    """``groups`` (optimizer parameter groups) each with a ``name`` (``group0``, ``group1``, ...; a name given is
    kept): DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` splits every group into its dense
    and its expert parameters by ``group["name"]`` and raises ``KeyError: 'name'`` without one."""
    return [{"name": f"group{i}", **g} for i, g in enumerate(groups)]


REGISTRY_WHY = ("DeepSpeed 0.19.8's AutoEP preset adapters call transformers' output-capture registry as a dict "
                "(registry.get(key, default) with a class-name key), but transformers 5 made it a _CanRecordRegistry "
                "whose get(model) takes a model and no default: AutoEP's replacement of Qwen3-MoE blocks raises "
                "'TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given' "
                "(deepspeed/module_inject/auto_ep_presets/base.py:326); no upstream issue filed")


REGISTRY_CHECKED = ("5.23.0",)
"""transformers versions whose output-capture registry :func:`registry_patch` was checked against."""


def registry_problem() -> str | None:
    """Why :func:`registry_patch` cannot patch this transformers (one line naming its version, the attribute and the
    fix), or None: ``transformers.utils.output_capturing`` must hold ``_CanRecordRegistry``, a ``dict`` whose
    ``get(self, model)`` takes a model (or already finetune's ``get``), and ``_CAN_RECORD_REGISTRY``, one of them (what
    DeepSpeed's AutoEP reads)."""
    import inspect

    import transformers

    where = "transformers.utils.output_capturing"
    try:
        from transformers.utils import output_capturing
    except ImportError:
        output_capturing, found = None, f"{where} is missing"
    else:
        cls = getattr(output_capturing, "_CanRecordRegistry", None)
        registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
        get = getattr(cls, "get", None) if isinstance(cls, type) else None
        try:
            params = list(inspect.signature(get).parameters) if callable(get) else None
        except (TypeError, ValueError):
            params = None
        if not (isinstance(cls, type) and issubclass(cls, dict)):
            found = f"{where}._CanRecordRegistry is {'missing' if cls is None else 'no dict subclass'}"
        elif not (getattr(get, "_finetune_registry_get", False) or params == ["self", "model"]):
            found = f"{where}._CanRecordRegistry.get has the signature {params} (checked: ['self', 'model'])"
        elif not isinstance(registry, cls):
            found = f"{where}._CAN_RECORD_REGISTRY is {'missing' if registry is None else type(registry).__name__}"
        else:
            return None
    return (f"{KEY}: AutoEP needs finetune's patch of transformers' private output-capture registry, but in "
            f"transformers {transformers.__version__} {found} (checked with transformers "
            f"{', '.join(REGISTRY_CHECKED)}); install transformers=={REGISTRY_CHECKED[-1]} or set {KEY}=1")


def registry_patch() -> patches.Patch:
    """The patch that lets DeepSpeed's AutoEP read transformers' output-capture registry by key (see
    :data:`REGISTRY_WHY`): ``_CanRecordRegistry.get`` accepts a string key and a default as ``dict.get`` does, a
    model as before.

    Raises:
        RunFailure: the registry is not there in the form it was checked in (:func:`registry_problem`'s line;
            :func:`check` reports it before any model is built).
    """
    problem = registry_problem()
    if problem is not None:
        raise RunFailure(problem)
    from transformers.utils import output_capturing

    cls = output_capturing._CanRecordRegistry
    original = cls.get
    if getattr(original, "_finetune_registry_get", False):  # applied already (a nested build): the same again
        return patches.Patch(target=cls, key="get", value=original, why=REGISTRY_WHY, scope="process")

    def get(self, key, default=None):
        if isinstance(key, str):
            return dict.get(self, key, default)
        return original(self, key)

    get._finetune_registry_get = True
    return patches.Patch(target=cls, key="get", value=get, why=REGISTRY_WHY, scope="process")


def _layers(module):
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [(name, m) for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]


def uses_autoep(engine) -> bool:
    """True when ``engine``'s model holds AutoEP layers."""
    return bool(_layers(engine.module))


def hf_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The engine's full state dict in the Hugging Face layout on rank 0 (fp32 CPU tensors), None on the other ranks.
    All ranks call it.

    Each AutoEP layer's local experts (``experts.w1``/``w3`` ``[experts / ep, ffn, hidden]``, ``experts.w2``
    ``[experts / ep, hidden, ffn]``) are gathered over its expert-parallel group in expert order and put back as
    ``experts.gate_up_proj`` ``[experts, 2 ffn, hidden]`` (gate rows first) and ``experts.down_proj``
    ``[experts, hidden, ffn]``; the router ``router.gate.weight`` becomes ``gate.weight`` (AutoEP's alias
    ``gate.gate.weight`` is the same tensor and is dropped). Under ZeRO-3 each parameter is gathered first
    (``deepspeed.zero.GatheredParameters``, over its own partition group).

    Raises:
        RuntimeError: an AutoEP layer holds an expert layout other than the checked one (separate ``w1/w2/w3``).
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    from finetune.parallel import distributed as dist_utils

    module = engine.module
    layers = dict(_layers(module))
    out: dict[str, torch.Tensor] = {}
    for mname, sub in module.named_modules():
        params = list(sub.named_parameters(recurse=False))
        buffers = [(n, b) for n, b in sub.named_buffers(recurse=False) if n not in sub._non_persistent_buffers_set]
        owner = next((lname for lname in layers if mname == lname or mname.startswith(lname + ".")), None)
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
            for n, t in params + buffers:
                full = f"{mname}.{n}" if mname else n
                if owner is not None and full.startswith(owner + ".experts."):
                    layer = layers[owner]
                    group = groups._get_expert_parallel_group(layer.ep_group_name)
                    parts = [torch.empty_like(t.data) for _ in range(layer.ep_size)]
                    dist.all_gather(parts, t.data.contiguous(), group=group)
                    out[full] = torch.cat(parts, 0).detach().float().cpu()
                else:
                    out[full] = t.detach().float().cpu() if t.is_floating_point() else t.detach().cpu()
    if not dist_utils.is_main():
        return None
    for lname in layers:
        keys = {k for k in out if k.startswith(lname + ".")}
        w = {k[len(lname) + 1:]: out.pop(k) for k in keys}
        if set(w) - {"router.gate.weight", "gate.gate.weight", "experts.w1", "experts.w2", "experts.w3"}:
            raise RuntimeError(f"export: AutoEP layer {lname} holds {sorted(w)}; finetune gathers only the "
                               f"checked layout (router.gate.weight, experts.w1/w2/w3)")
        out[f"{lname}.gate.weight"] = w["router.gate.weight"]
        out[f"{lname}.experts.gate_up_proj"] = torch.cat([w["experts.w1"], w["experts.w3"]], 1).contiguous()
        out[f"{lname}.experts.down_proj"] = w["experts.w2"].contiguous()
    return out
