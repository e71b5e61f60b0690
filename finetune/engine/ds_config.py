"""The DeepSpeed JSON: load it, apply ``ds.*`` overrides, check it strictly, and fill in what the run config owns.

The run config is the single source of truth for batch sizes, the optimizer and gradient clipping:
:func:`resolve_ds_config` writes ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``train_batch_size = micro x accumulation x world size``, ``gradient_clipping``, an AdamW (or, with
``train.optimizer: muon``, a Muon) ``optimizer`` block and the ``bf16``/``fp16`` sections (``train.precision``, :func:`choose_precision`)
into the dict handed to ``deepspeed.initialize``. A JSON value that contradicts them is an error
(DeepSpeed would silently prefer one or assert mid-start-up).

DeepSpeed ignores unknown top-level keys (a typo such as ``"zero_optimisation"`` silently trains without
ZeRO); :func:`check_ds_config` rejects them, using the keys DeepSpeed's own ``DeepSpeedConfig`` reads.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
from pathlib import Path

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig

from finetune.config import RunConfig, deep_merge
from finetune.errors import ConfigError
from finetune.parallel import expert

# Top-level keys read outside DeepSpeedConfig.__init__ (optional sections, launcher and op settings).
_EXTRA_TOP_LEVEL_KEYS = {
    "optimizer", "scheduler", "aio", "activation_checkpointing", "flops_profiler", "autotuning",
    "zero_allow_untested_optimizer", "mics_shard_size", "mics_hierarchical_params_gather",
    "sequence_parallel_size",
}


@functools.lru_cache(maxsize=1)
def known_top_level_keys() -> frozenset[str]:
    """Top-level keys DeepSpeed understands, recorded from what its own ``DeepSpeedConfig`` looks up.

    Returns:
        A frozenset of key names (about 60 for DeepSpeed 0.19).
    """
    seen: set[str] = set()

    class _Recorder(dict):
        def get(self, k, *a):
            seen.add(k)
            return super().get(k, *a)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def __copy__(self):
            return self

    DeepSpeedConfig(_Recorder({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}))
    return frozenset(k for k in seen if isinstance(k, str)) | _EXTRA_TOP_LEVEL_KEYS


def load_ds_json(path: str) -> dict:
    """Read a DeepSpeed JSON file.

    Raises:
        ConfigError: missing file, invalid JSON, or not an object.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed: config file '{p}' does not exist (see ds_configs/ for shipped ones)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed: '{p}' is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed: '{p}' must hold a JSON object")
    return data


def zero_stage(ds: dict) -> int:
    """ZeRO stage (0-3) of a DeepSpeed config dict."""
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def optimizer_offloaded(ds: dict) -> bool:
    """True when the optimizer state lives on the CPU or NVMe (DeepSpeed then requires its own CPU Adam)."""
    dev = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return dev in ("cpu", "nvme")


def check_ds_config(ds: dict, source: str) -> list[str]:
    """Problems with a merged DeepSpeed config dict: unknown top-level keys, then DeepSpeed's own checks.

    Args:
        ds: the DeepSpeed config after ``ds.*`` overrides.
        source: file name used in messages.

    Returns:
        One message per problem (empty when fine).
    """
    problems = []
    known = known_top_level_keys()
    for key in ds:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"deepspeed: unknown top-level key '{key}' in {source}{hint}; DeepSpeed would ignore it")
    for key in ("optimizer", "scheduler"):
        if key in ds:
            problems.append(
                f"deepspeed: {source} sets '{key}'; the optimizer and LR schedule come from the run config "
                f"(train.lr, train.weight_decay, train.lr_scheduler, train.warmup_steps): remove '{key}'")
    return problems




def auto_precision(accelerator) -> tuple[str, str]:
    """What ``train.precision: auto`` picks on ``accelerator``, and why.

    Args:
        accelerator: a DeepSpeed accelerator (``deepspeed.accelerator.get_accelerator()``) or anything with
            its capability queries ``device_name()``, ``is_bf16_supported()``, ``is_fp16_supported()``.

    Returns:
        ``(precision, reason)``: ``fp32`` on CPUs (bf16 runs there but is ~2.4x slower than fp32 without
        AMX/avx512_bf16 cores, fp16 is unsupported); on GPUs ``bf16`` when supported (Ampere and newer),
        else ``fp16`` (V100, T4) when supported, else ``fp32``.
    """
    name = accelerator.device_name()
    if name == "cpu":
        return "fp32", "auto: CPU accelerator (bf16 is slow without bf16 hardware, fp16 unsupported)"
    if accelerator.is_bf16_supported():
        return "bf16", f"auto: {name} accelerator supports bf16"
    if accelerator.is_fp16_supported():
        return "fp16", f"auto: {name} accelerator has no bf16 but supports fp16"
    return "fp32", f"auto: {name} accelerator supports neither bf16 nor fp16"


def _json_precision(ds: dict) -> str | None:
    """The precision a DeepSpeed dict states explicitly (a bf16/fp16 ``enabled`` of true or false), else None."""
    stated = {s: ds[s]["enabled"] for s in ("bf16", "fp16")
              if isinstance(ds.get(s), dict) and isinstance(ds[s].get("enabled"), bool)}
    if not stated:
        return None
    on = [s for s, v in stated.items() if v]
    return on[0] if len(on) == 1 else ("fp32" if not on else "both")


def choose_precision(requested: str, ds: dict, source: str, on_cpu: bool, accelerator=None
                     ) -> tuple[str, str, list[str]]:
    """Resolve ``train.precision`` against the DeepSpeed JSON (after ``ds.*`` overrides).

    Rule: an explicit ``train.precision`` (fp32/bf16/fp16) is used, and a JSON whose bf16/fp16 ``enabled``
    says otherwise is a contradiction (an error, as with batch sizes). With ``auto`` the JSON's explicit
    choice wins (bf16 or fp16 ``enabled: true``; ``enabled: false`` everywhere means fp32); a JSON without
    one gets :func:`auto_precision` (fp32 on the CPU accelerator, without querying it).

    Args:
        requested: ``train.precision``.
        ds: merged DeepSpeed dict.
        source: the JSON file name, for messages.
        on_cpu: True on DeepSpeed's CPU accelerator.
        accelerator: the accelerator to query for ``auto`` (default ``deepspeed.accelerator.get_accelerator()``).

    Returns:
        ``(precision, reason, problems)`` with precision one of fp32/bf16/fp16.
    """
    stated = _json_precision(ds)
    if stated == "both":
        return "fp32", "", [f"deepspeed: {source} enables both bf16 and fp16; enable at most one "
                            f"(or remove both and set train.precision)"]
    if requested != "auto":
        if stated is not None and stated != requested:
            return requested, "", [
                f"deepspeed: precision contradiction: {source} gives {stated} (bf16/fp16 'enabled') but "
                f"train.precision={requested}; remove the bf16/fp16 sections' 'enabled' from the JSON or set "
                f"train.precision=auto (the JSON's choice is then used)"]
        return requested, f"train.precision={requested}", []
    if stated is not None:
        return stated, f"auto: {source} sets it explicitly", []
    if on_cpu:
        return "fp32", "auto: CPU accelerator (bf16 is slow without bf16 hardware, fp16 unsupported)", []
    if accelerator is None:
        accelerator = get_accelerator()
    precision, reason = auto_precision(accelerator)
    return precision, reason, []


def describe_precision(cfg: RunConfig, on_cpu: bool) -> dict:
    """``{"precision": ..., "why": ...}`` for the run folder's ``meta.json`` and the log (as resolved by
    :func:`resolve_ds_config`)."""
    ds = deep_merge(load_ds_json(cfg.deepspeed), copy.deepcopy(cfg.ds))
    precision, why, _ = choose_precision(cfg.train.precision, ds, cfg.deepspeed, on_cpu)
    return {"precision": precision, "why": why}


def precision_of(ds: dict) -> str:
    """``bf16``, ``fp16`` or ``fp32``: what a resolved DeepSpeed dict trains in."""
    stated = _json_precision(ds)
    return stated if stated in ("bf16", "fp16") else "fp32"


def engine_precision(engine) -> str:
    """``bf16``, ``fp16`` or ``fp32``: what a built DeepSpeed engine trains in (its public ``bfloat16_enabled`` and
    ``fp16_enabled``), the same names as :func:`precision_of` gives for a DeepSpeed dict."""
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def resolve_ds_config(cfg: RunConfig, world_size: int, on_cpu: bool, accelerator=None,
                      deepspeed_checks: bool = True) -> tuple[dict, list[str]]:
    """The DeepSpeed dict for ``deepspeed.initialize``: JSON file + ``cfg.ds`` overrides + run-config values.

    Args:
        cfg: the run config (``cfg.deepspeed`` names the JSON file).
        world_size: number of data-parallel ranks.
        on_cpu: True on the CPU accelerator (picks ``torch.optim.AdamW(fused=True)`` instead of DeepSpeed's fused
            CUDA Adam).
        accelerator: queried for ``train.precision: auto`` on GPUs (see :func:`choose_precision`); default
            DeepSpeed's ``get_accelerator()``.
        deepspeed_checks: also run DeepSpeed's own config parser (when ours found no problem); the caller
            passes False when the run config's numbers are already known to be wrong (e.g. a micro batch of 0).

    Returns:
        ``(ds_dict, problems)``: the resolved dict and every problem found (batch-size
        contradictions name micro batch, accumulation, world size and the JSON's value).

    Raises:
        ConfigError: the JSON file is missing or unparsable.
    """
    raw = load_ds_json(cfg.deepspeed)
    ds = deep_merge(raw, copy.deepcopy(cfg.ds))
    problems = check_ds_config(ds, f"'{cfg.deepspeed}' (+ ds.* overrides)")

    mb, gas = cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps
    expected = mb * gas * world_size
    for key, want in (("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", gas),
                      ("train_batch_size", expected)):
        have = ds.get(key, "auto")
        if have != "auto" and have != want:
            problems.append(
                f"deepspeed: batch-size contradiction: {cfg.deepspeed} has {key}={have}, but the run config gives "
                f"train.micro_batch_size={mb} x train.gradient_accumulation_steps={gas} x data-parallel size={world_size} "
                f"= train_batch_size {expected}; remove '{key}' from the JSON (the run config is the source of truth)")
    ds["train_micro_batch_size_per_gpu"] = mb
    ds["gradient_accumulation_steps"] = gas
    ds["train_batch_size"] = expected
    if ds.get("gradient_clipping", "auto") not in ("auto", cfg.train.max_grad_norm):
        problems.append(f"deepspeed: {cfg.deepspeed} has gradient_clipping={ds['gradient_clipping']} but "
                        f"train.max_grad_norm={cfg.train.max_grad_norm}; remove it from the JSON")
    ds["gradient_clipping"] = cfg.train.max_grad_norm
    if cfg.parallel.sequence_parallel_size > 1:  # zero.Init (ZeRO-3) reads it for the data-parallel size
        ds["sequence_parallel_size"] = cfg.parallel.sequence_parallel_size
    tp = cfg.parallel.tensor_parallel_size
    if tp > 1:
        # AutoTP training; the lm_head's output is gathered (full logits: finetune's head loss and the export check
        # read them). DeepSpeed checks train_batch_size against every rank (its config exists before the TP groups),
        # so it gets micro x accumulation x world; the rows of a step are still micro x accumulation x dp.
        ds["tensor_parallel"] = {**ds.get("tensor_parallel", {}), "autotp_size": tp, "vocab_parallel_lm_head": False}
        ds["train_batch_size"] = expected * tp
    ep_section = expert.ds_section(cfg)
    if ep_section:  # AutoEP: experts over ep-rank groups; the rows (and train_batch_size) stay data-parallel over all
        ds["expert_parallel"] = ep_section
    if cfg.train.grpo.generation_backend == "hybrid_engine":  # grpo's generation on DeepSpeed's hybrid engine
        problems += hybrid_engine_problems(cfg, on_cpu, zero_stage(ds))
        # DeepSpeedHybridEngine: inference kernels for generation; its workspace holds prompt + completion tokens
        ds["hybrid_engine"] = {**ds.get("hybrid_engine", {}), "enabled": True, "inference_tp_size": 1,
                               "release_inference_cache": False,
                               "max_out_tokens": cfg.data.max_seq_len + cfg.train.grpo.max_completion_length}
    ds.setdefault("steps_per_print", 10**9)  # our own loop logs; keep DeepSpeed's periodic prints quiet
    if "optimizer" not in ds and "scheduler" not in ds:
        params = {"lr": cfg.train.lr, "betas": [cfg.train.adam_beta1, cfg.train.adam_beta2], "eps": cfg.train.adam_eps,
                  "weight_decay": cfg.train.weight_decay}
        if on_cpu and not optimizer_offloaded(ds):
            # torch.optim.AdamW(fused=True): torch's one-pass CPU kernel (4.5x faster than the default foreach
            # path on a 5.5M-element partition, one core); DeepSpeed's own FusedAdam is CUDA-only
            params.update({"torch_adam": True, "fused": True})
        if cfg.train.optimizer == "muon":
            # DeepSpeed's MuonWithAuxAdam: "lr", betas, eps go to the auxiliary AdamW, "muon_lr" and "momentum" to
            # the Muon matrices, weight_decay to both (DeepSpeedEngine._muon_param_groups)
            params.update({"muon_lr": cfg.train.muon_lr, "momentum": cfg.train.muon_momentum})
            ds["optimizer"] = {"type": "Muon", "params": params}
            if zero_stage(ds) == 3:
                # DeepSpeed's ZeRO-3 refuses Muon with reduce_scatter (its default: true; "Muon and reduce scatter
                # cannot be used together"): gradients are then averaged with an all-reduce
                ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "reduce_scatter": False}
        else:
            ds["optimizer"] = {"type": "AdamW", "params": params}
    precision, _, precision_problems = choose_precision(cfg.train.precision, ds, cfg.deepspeed, on_cpu, accelerator)
    problems += precision_problems
    for section in ("bf16", "fp16"):
        ds[section] = {**ds.get(section, {}), "enabled": precision == section}
    if on_cpu:
        # Page-locked host memory serves copies to a GPU; DeepSpeed's CPU accelerator pins nothing (its pin_memory
        # returns the tensor), yet ZeRO-3's offload set-up is far slower with pin_memory: true. The shipped offload
        # configs (made for GPUs) therefore run on CPU ranks unpinned.
        for key in ("offload_optimizer", "offload_param"):  # ds is this call's own copy (JSON + overrides)
            section = ds.get("zero_optimization", {}).get(key)
            if isinstance(section, dict) and section.get("pin_memory"):
                section["pin_memory"] = False
    if ds.get("fp16", {}).get("enabled") is True and on_cpu:
        problems.append(f"deepspeed: fp16 is enabled in {cfg.deepspeed} but the CPU accelerator does not support "
                        f"fp16; use a bf16 or fp32 config (ds.fp16.enabled=false)")
    if not problems and deepspeed_checks:
        problems += _deepspeed_own_checks(ds, world_size, cfg.deepspeed)
    return ds, problems


def hybrid_engine_problems(cfg: RunConfig, on_cpu: bool, stage: int) -> list[str]:
    """What ``train.grpo.generation_backend: hybrid_engine`` (DeepSpeed's hybrid engine,
    :class:`finetune.engine.rollout.HybridEngineGenerate`) cannot run with, one line each: the CPU accelerator
    (DeepSpeed 0.19.8 has no CPU build of its inference kernels), LoRA (the kernels copy the base weights; the
    adapters would not generate), ZeRO-3, a model type without DeepSpeed inference kernels."""
    from finetune.engine.rollout import HYBRID_ENGINE_MODELS

    key, fix = "train.grpo.generation_backend: hybrid_engine", "use generation_backend=hf_generate"
    problems = []
    if on_cpu:
        problems.append(f"{key} needs CUDA GPUs (DeepSpeed's hybrid engine runs its inference kernels there, and "
                        f"DeepSpeed has no CPU build of them); {fix}")
    if cfg.model.lora is not None:
        problems.append(f"{key} cannot generate with LoRA adapters (its kernels copy the base weights); {fix}")
    if stage == 3:
        problems.append(f"{key} is not supported under ZeRO-3 here; use ZeRO 0-2 or {fix}")
    try:
        model_type = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):  # reported by the model checks
        model_type = None
    if model_type is not None and model_type not in HYBRID_ENGINE_MODELS:
        problems.append(f"{key}: DeepSpeed's hybrid engine has no inference kernels for model type "
                        f"'{model_type}' (it has: {', '.join(HYBRID_ENGINE_MODELS)}); {fix}")
    return problems


def _deepspeed_own_checks(ds: dict, world_size: int, source: str) -> list[str]:
    """Run DeepSpeed's own config parser (pydantic models reject unknown keys inside sections)."""
    probe = copy.deepcopy(ds)
    # Parse as a single rank: DeepSpeed derives world size from the process group, which may not exist yet.
    probe["train_batch_size"] = probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig(probe)
    except Exception as e:  # pydantic ValidationError, AssertionError, ValueError from DeepSpeed
        msg = " ".join(str(e).split())
        return [f"deepspeed: {source} rejected by DeepSpeed: {msg[:600]}"]
    return []
