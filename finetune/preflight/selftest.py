"""The node self-test: the numerics and collectives a run relies on, checked on the node it runs on.

Every check runs a tiny model or tensor on this node's accelerator (all its GPUs under a launcher) and compares it
with a reference computed here in fp32, unfused, on one device, against a stated tolerance. A check that needs what
the node does not have (a GPU, Liger, flash-attn) is skipped with the reason, so the same command runs on a
laptop and on a GPU node. Checks (``CHECKS``):

* ``collectives``: all-reduce, all-gather, broadcast and all-to-all over the process group's backend (NCCL on
  GPUs, gloo on CPU ranks; all-to-all is what Ulysses sequence parallelism uses); small integers, so exact.
* ``chunked_head``: finetune's chunked output-head cross-entropy against the full logits, in both forms (several
  chunks, checkpointed and recomputed in backward: :func:`finetune.recipes.lm_loss.chunked_cross_entropy`; gradients
  computed in the forward pass: :class:`finetune.recipes.lm_loss.LinearCrossEntropy`): loss and head gradient, fp32.
* ``liger_fused_ce``: Liger's fused linear cross-entropy (what causal-LM heads use on CUDA) against the same
  reference: loss and gradients (CUDA and ``liger-kernel`` only).
* ``bf16_forward``: a tiny Llama's loss and logits in bf16 against fp32 (bf16 keeps 8 bits of mantissa).
* ``flash_attention``: ``attn_implementation="flash_attention_2"`` against ``sdpa`` in bf16 (CUDA and flash-attn).
* ``flash_packing``: a micro-batch of 4 packed rows, flattened into one row as a run with packing and flash
  attention flattens it, through ``flash_attention_2`` against its examples one by one (loss and gradients, bf16;
  CUDA and flash-attn; the same check runs on CPU in the tests through a PyTorch kernel with flash-attn's
  variable-length contract).
* ``sdpa_packing``: the same 4 packed rows, not flattened, through PyTorch's SDPA (the default
  ``attn_implementation``) with transformers' block-diagonal mask, forced onto the kernel SDPA picks for a masked
  call (memory-efficient on CUDA GPUs, math on CPUs), against the examples one by one through SDPA's flash kernel:
  loss and gradients (bf16 on GPUs, fp32 on CPUs).
* ``zero2_step``, ``zero3_step``: three optimizer steps of a DeepSpeed engine (ZeRO 2 / 3, fp32, AdamW, the global
  batch split over the ranks) against plain PyTorch AdamW on the whole batch in one process: the per-step losses.
* ``fp16_step``: three DeepSpeed steps in fp16 with dynamic loss scaling against the fp32 engine's losses (GPUs:
  DeepSpeed's CPU accelerator has no fp16).
* ``sequence_parallel``: one step of DeepSpeed Ulysses over all the ranks (SP = world size, finetune's own path:
  :func:`finetune.parallel.sequence.start_sequence_parallel`, :func:`~finetune.parallel.sequence.shard_batch` and
  :func:`~finetune.parallel.sequence.fix_zero3_average`) at ZeRO-3 against the same padded batch on one device in one
  process: the loss and the global gradient norm (a reduce-scatter that divides by the world size instead of the
  data-parallel size halves the norm at SP = 2). Needs 2 or more ranks.
* ``expert_parallel``: three steps of DeepSpeed AutoEP over all the ranks (EP = world size; a tiny Qwen3-MoE with
  ``2 x world`` experts, finetune's settings of :mod:`finetune.parallel.expert`) against transformers' own MoE
  blocks on the whole batch in one process: the per-step losses. On GPU nodes it runs what CPU ranks never select
  (DeepSpeed's Triton grouped GEMM, NCCL's all-to-all); see docs/parallelism.md. Needs 2 or more ranks.

Tolerances are relative differences ``|a - b| / max(|b|, 1e-12)`` (max over elements) unless the check is exact.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from finetune import patches
from finetune.parallel import distributed as dist_utils
from finetune.parallel import layout, sequence
from finetune.config import RunConfig
from finetune.recipes.lm_loss import LinearCrossEntropy, chunked_cross_entropy


@dataclass
class Check:
    """One row of the self-test.

    Attributes:
        name: the check (``collectives``, ``zero3_step``, ...).
        status: ``pass``, ``FAIL`` or ``skip``.
        measured: the largest difference measured (relative unless ``detail`` says exact), or None when skipped.
        tolerance: the largest difference that passes.
        detail: what was compared, or why the check was skipped.
        seconds: wall time of the check.
    """

    name: str
    status: str
    measured: float | None
    tolerance: float
    detail: str
    seconds: float = 0.0


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max(|b|, 1e-12)`` over the elements, in float64 on the CPU."""
    a, b = a.detach().double().cpu().flatten(), b.detach().double().cpu().flatten()
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max()) if a.numel() else 0.0


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return torch.device(f"{name}:{dist_utils.local_rank()}" if name == "cuda" else name)


def _judge(name: str, measured: float, tolerance: float, detail: str) -> Check:
    ok = math.isfinite(measured) and measured <= tolerance
    return Check(name, "pass" if ok else "FAIL", measured, tolerance, detail)


def check_collectives() -> Check:
    """All-reduce, all-gather, broadcast and all-to-all of small integers: exact (tolerance 0)."""
    import torch.distributed as dist

    dev, w, r = _device(), dist_utils.world_size(), dist_utils.rank()
    err = 0.0
    t = torch.full((4,), float(r + 1), device=dev)
    dist.all_reduce(t)
    err = max(err, float((t - w * (w + 1) / 2).abs().max()))
    parts = [torch.zeros(3, device=dev) for _ in range(w)]
    dist.all_gather(parts, torch.full((3,), float(r), device=dev))
    err = max(err, max(float((p - i).abs().max()) for i, p in enumerate(parts)))
    b = torch.full((2,), float(r + 7), device=dev)
    dist.broadcast(b, src=0)
    err = max(err, float((b - 7).abs().max()))
    send = torch.arange(w, device=dev, dtype=torch.float32) + 100 * r  # element j goes to rank j
    recv = torch.empty(w, device=dev)
    dist.all_to_all_single(recv, send)
    err = max(err, float((recv - (torch.arange(w, device=dev) * 100 + r)).abs().max()))
    return _judge("collectives", err, 0.0, f"{dist.get_backend()}, {w} rank(s): all_reduce, all_gather, broadcast, "
                                            "all_to_all_single (exact)")


def _head_case(dev: torch.device, n: int = 96, hidden: int = 64, vocab: int = 1000):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.05)
    h = torch.randn(n, hidden, generator=g)
    y = torch.randint(0, vocab, (n,), generator=g)
    return head.to(dev), h.to(dev), y.to(dev)


def _reference_ce(head: torch.nn.Linear, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head.zero_grad()
    loss = F.cross_entropy(head(h).float(), y, reduction="sum")
    loss.backward()
    return loss.detach(), head.weight.grad.detach().clone()


def check_chunked_head() -> Check:
    """Chunked head cross-entropy, 4 chunks, both forms (checkpointed and recomputed in backward; gradients in the
    forward pass, :class:`LinearCrossEntropy`) vs full logits: loss and weight gradient."""
    head, h, y = _head_case(_device())
    ref_loss, ref_grad = _reference_ce(head, h, y)
    diff = 0.0
    for run in (lambda: chunked_cross_entropy(head, h, y, chunk=24)[0],
                lambda: LinearCrossEntropy.apply(h, head.weight, head.bias, y, 24)):
        head.zero_grad()
        loss = run()
        loss.backward()
        diff = max(diff, rel_diff(loss, ref_loss),
                   float((head.weight.grad - ref_grad).abs().max() / ref_grad.abs().max()))
    return _judge("chunked_head", diff, 1e-5, "loss sum and head gradient, 96 rows in 4 chunks (checkpointed; "
                                              "gradients in forward) vs full logits, fp32")


def _gpu_skip(name: str, tolerance: float, module: str, package: str, why: str = "") -> Check | None:
    """The skipped row of a check that needs a CUDA GPU and ``module`` (from the ``package`` distribution), or
    None when this node has both."""
    if _device().type != "cuda":
        return Check(name, "skip", None, tolerance, f"needs a CUDA GPU{why}")
    if importlib.util.find_spec(module) is None:
        return Check(name, "skip", None, tolerance, f"{package} not installed"
                     + (" (pip install -e .[gpu])" if package == "liger-kernel" else ""))
    return None


def check_liger() -> Check:
    """Liger's fused linear cross-entropy vs full logits (CUDA and liger-kernel only)."""
    skip = _gpu_skip("liger_fused_ce", 1e-4, "liger_kernel", "liger-kernel", " (causal-LM heads use it only there)")
    if skip:
        return skip
    dev = _device()
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    head, h, y = _head_case(dev)
    ref_loss, ref_grad = _reference_ce(head, h, y)
    head.zero_grad()
    hh = h.clone().requires_grad_(True)  # Liger computes the weight gradient through the input's
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)(head.weight, hh, y)
    loss.backward()
    diff = max(rel_diff(loss, ref_loss), float((head.weight.grad - ref_grad).abs().max() / ref_grad.abs().max()))
    return _judge("liger_fused_ce", diff, 1e-4, "loss sum and head gradient vs full logits, fp32")


def tiny_llama(attn: str = "sdpa", seed: int = 0):
    """A 2-layer Llama (hidden 64, 4 heads, 2 key/value heads, vocabulary 512), seeded, fp32, with weights drawn
    10x wider than transformers' default (``initializer_range`` 0.2) so that its logits are far from uniform and
    precision differences show."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, attn_implementation=attn)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _batch(rows: int = 8, seq: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (rows, seq), generator=torch.Generator().manual_seed(seed))


def scaled_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``: the largest error relative to the tensor's scale (for logits, where single
    elements near 0 make element-wise relative errors meaningless)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_bf16() -> Check:
    """A tiny Llama in bf16 vs fp32 on this device: the loss (relative) and the logits (scaled), 1e-1."""
    dev = _device()
    ids = _batch().to(dev)
    model = tiny_llama().to(dev)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids)
        low = model.to(torch.bfloat16)(input_ids=ids, labels=ids)
    diff = max(rel_diff(low.loss.float(), ref.loss), scaled_diff(low.logits.float(), ref.logits))
    return _judge("bf16_forward", diff, 1e-1, f"tiny Llama loss and logits, bf16 vs fp32 on {dev.type} (a broken "
                                               "bf16 path is off by O(1))")


def check_flash_attention() -> Check:
    """flash_attention_2 vs sdpa, bf16 forward of a tiny Llama (CUDA and flash-attn only)."""
    skip = _gpu_skip("flash_attention", 1e-2, "flash_attn", "flash-attn")
    if skip:
        return skip
    dev = _device()
    ids = _batch().to(dev)
    with torch.no_grad():
        ref = tiny_llama("sdpa").to(dev, torch.bfloat16)(input_ids=ids, labels=ids).loss.float()
        got = tiny_llama("flash_attention_2").to(dev, torch.bfloat16)(input_ids=ids, labels=ids).loss.float()
    return _judge("flash_attention", rel_diff(got, ref), 1e-2, "tiny Llama loss, flash_attention_2 vs sdpa, bf16")


PACKED_EXAMPLES = ((7, 5, 9), (12, 4), (3, 6, 6, 2), (10,))
"""Lengths of the packed examples of the 4 rows of :func:`packed_rows_diff` (the rows padded to 22 tokens with a
pad segment of their own, as ``sft``'s ``PackedCollator`` pads)."""


def packed_batch(seed: int = 3) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A collated micro-batch of 4 packed rows, as ``sft`` packs them (``input_ids``, ``labels``, ``position_ids``
    restarting at 0 per example and for the pad tail, ``num_tokens``; int64 ``[4, 22]``), and its examples one by
    one as ``(input_ids [1, n], labels [1, n])``. The first two tokens of every example are prompt (label -100)."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in PACKED_EXAMPLES) + 1
    rows, examples = {"input_ids": [], "labels": [], "position_ids": []}, []
    for lengths in PACKED_EXAMPLES:
        ids, labels, pos = [], [], []
        for n in lengths:
            ex = torch.randint(0, 512, (n,), generator=g)
            lab = ex.clone()
            lab[:2] = -100
            examples.append((ex[None], lab[None]))
            ids += ex.tolist()
            labels += lab.tolist()
            pos += list(range(n))
        pad = width - len(ids)
        rows["input_ids"].append(ids + [0] * pad)
        rows["labels"].append(labels + [-100] * pad)
        rows["position_ids"].append(pos + list(range(pad)))
    batch = {k: torch.tensor(v) for k, v in rows.items()}
    batch["num_tokens"] = torch.tensor(sum(map(sum, PACKED_EXAMPLES)))
    return batch, examples


def packed_rows_diff(attn: str, dev: torch.device, dtype: torch.dtype = torch.float32,
                     flatten_rows: bool = True) -> float:
    """The loss and gradients of a micro-batch of 4 packed rows through attention ``attn``, against its examples
    run one by one with ``sdpa``: ``max(loss relative difference, gradient scaled difference)``.

    The micro-batch goes through the data pipeline's :func:`finetune.data.batch.flatten` (one row, what a run with
    a flash-attention kernel and packing does) unless ``flatten_rows`` is False (4 rows: what transformers'
    flash-attention path computes then, examples attending across each other, for the tests). The loss is
    ``gpt_clm``'s (``sft``'s): next-token cross-entropy summed over the targets.
    """
    from finetune.data.batch import flatten
    from finetune.recipes import gpt_clm

    batch, examples = packed_batch()
    model = tiny_llama(attn).to(dev, dtype)
    reference = tiny_llama("sdpa").to(dev, dtype)
    packed = flatten(batch) if flatten_rows else batch
    loss = gpt_clm.forward(model, {k: v.to(dev) for k, v in packed.items()}).loss_sum
    loss.backward()
    want = sum(gpt_clm.forward(reference, {"input_ids": ids.to(dev), "labels": lab.to(dev)}).loss_sum
               for ids, lab in examples)
    want.backward()
    grads = max(scaled_diff(p.grad.float(), q.grad.float())
                for p, q in zip(model.parameters(), reference.parameters()))
    return max(rel_diff(loss.detach().float(), want.detach().float()), grads)


def check_flash_packing() -> Check:
    """4 packed rows, flattened as a run flattens them, through flash_attention_2 vs their examples one by one with
    sdpa, bf16: loss and gradients (CUDA and flash-attn only)."""
    skip = _gpu_skip("flash_packing", 2e-2, "flash_attn", "flash-attn")
    if skip:
        return skip
    diff = packed_rows_diff("flash_attention_2", _device(), torch.bfloat16)
    return _judge("flash_packing", diff, 2e-2, "4 packed rows (examples 2-12 tokens) flattened through "
                                               "flash_attention_2 vs the examples alone with sdpa, bf16: loss and "
                                               "gradients")


SDPA_BACKENDS = {"cuda": ("EFFICIENT_ATTENTION", "FLASH_ATTENTION"), "cpu": ("MATH", "FLASH_ATTENTION")}
"""Per device type, ``(the backend the packed rows run through, the backend the examples alone run through)`` in
:func:`check_sdpa_packing`: PyTorch's SDPA dispatches a call with an explicit mask (the packed rows' block-diagonal
causal mask) to the memory-efficient kernel on CUDA GPUs (the flash kernel takes no mask) and to the math kernel on
CPUs; a causal call without a mask (one example alone) to the flash kernel on both."""


def check_sdpa_packing() -> Check:
    """The packing contract through PyTorch's SDPA kernels (``model.attn_implementation: sdpa``, the default): a
    micro-batch of 4 packed rows as ``sft`` packs them (``position_ids`` restarting per example, no attention
    mask; transformers builds the block-diagonal causal mask from them) through the kernel SDPA picks for a masked
    call (memory-efficient on CUDA GPUs, math on CPUs: :data:`SDPA_BACKENDS`), against its examples one by one
    through the flash kernel (causal, no mask), each kernel forced with ``torch.nn.attention.sdpa_kernel``: loss and
    gradients, bf16 on GPUs (tolerance 2e-2), fp32 on CPUs (1e-4). A packed row that attended across its examples
    would be off by far more."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from finetune.recipes import gpt_clm

    dev = _device()
    packed_backend, alone_backend = (getattr(SDPBackend, b) for b in SDPA_BACKENDS[dev.type if dev.type == "cuda"
                                                                                    else "cpu"])
    dtype, tol = (torch.bfloat16, 2e-2) if dev.type == "cuda" else (torch.float32, 1e-4)
    batch, examples = packed_batch()
    model, reference = tiny_llama("sdpa").to(dev, dtype), tiny_llama("sdpa").to(dev, dtype)
    model.config.use_cache = False  # as sft sets it for packed rows: with a cache transformers builds no packed mask
    with sdpa_kernel([packed_backend]):
        loss = gpt_clm.forward(model, {k: v.to(dev) for k, v in batch.items()}).loss_sum
        loss.backward()
    with sdpa_kernel([alone_backend]):
        want = sum(gpt_clm.forward(reference, {"input_ids": ids.to(dev), "labels": lab.to(dev)}).loss_sum
                   for ids, lab in examples)
        want.backward()
    grads = max(scaled_diff(p.grad.float(), q.grad.float()) for p, q in zip(model.parameters(), reference.parameters()))
    diff = max(rel_diff(loss.detach().float(), want.detach().float()), grads)
    return _judge("sdpa_packing", diff, tol, f"4 packed rows through sdpa's {packed_backend.name.lower()} kernel vs the "
                                             f"examples alone through its {alone_backend.name.lower()} kernel, "
                                             f"{str(dtype).removeprefix('torch.')}: loss and gradients")


def _plain_losses(steps: int, lr: float, model=None, ids: torch.Tensor | None = None) -> list[float]:
    """Plain PyTorch: AdamW on the whole batch in one process, fp32 on the CPU (the reference); by default the tiny
    Llama on :func:`_batch`."""
    model, ids = (tiny_llama(), _batch()) if model is None else (model, ids)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def _mean_losses(engine, ids: torch.Tensor, steps: int, w: int) -> list[float]:
    """``steps`` optimizer steps of ``engine`` on this rank's ``ids`` (labels = inputs); per step the mean over the
    ``w`` ranks of their losses."""
    out = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        out.append(float(mean) / w)
    return out


def _engine_losses(stage: int, steps: int, lr: float, fp16: bool = False) -> list[float]:
    """DeepSpeed: the same batch split over the ranks (equal rows, no padding: the mean of the ranks' means is
    the batch mean), ZeRO ``stage``, fp32 (or fp16 with dynamic loss scaling)."""
    import deepspeed

    w, r = dist_utils.world_size(), dist_utils.rank()
    ids = _batch()
    if ids.shape[0] % w:
        raise ValueError(f"the self-test's batch of {ids.shape[0]} rows does not split over {w} ranks")
    mine = ids.chunk(w)[r].to(_device())
    model = tiny_llama()
    ds = {"train_micro_batch_size_per_gpu": mine.shape[0], "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
          "fp16": {"enabled": fp16, "initial_scale_power": 8}, "steps_per_print": 10**9,
          "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    out = _mean_losses(engine, mine, steps, w)
    engine.destroy()
    return out


def check_zero_step(stage: int, steps: int = 3, lr: float = 1e-3) -> Check:
    """``steps`` DeepSpeed ZeRO-``stage`` steps vs plain AdamW on one process: the largest per-step loss difference."""
    name = f"zero{stage}_step"
    dev = _device()
    tol = 1e-5 if dev.type == "cpu" else 1e-4  # GPU kernels (TF32 off) sum in other orders
    got, ref = _engine_losses(stage, steps, lr), _plain_losses(steps, lr)
    diff = max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, ref))
    return _judge(name, diff, tol, f"{steps} steps, fp32 AdamW, batch split over {dist_utils.world_size()} rank(s) "
                                   f"vs one process: losses {', '.join(f'{x:.6f}' for x in got)}")


def check_fp16_step(steps: int = 3, lr: float = 1e-3) -> Check:
    """DeepSpeed fp16 (dynamic loss scaling) vs fp32 engine losses over ``steps`` steps (GPUs only)."""
    if _device().type != "cuda":
        return Check("fp16_step", "skip", None, 2e-2, "needs a GPU: DeepSpeed's CPU accelerator has no fp16")
    got, ref = _engine_losses(2, steps, lr, fp16=True), _engine_losses(2, steps, lr)
    diff = max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, ref))
    return _judge("fp16_step", diff, 2e-2, f"{steps} ZeRO-2 steps, fp16 with loss scaling vs fp32")


def check_hybrid_rollout(new_tokens: int = 8) -> Check:
    """DeepSpeed's hybrid engine generating through finetune's rollout (``train.grpo.generation_backend:
    hybrid_engine``; CUDA only): a tiny Llama under ``DeepSpeedHybridEngine`` (ZeRO-0, fp32, DeepSpeed's inference
    kernels in eval mode), 4 prompts of 16 tokens, one greedy completion each through
    :class:`finetune.engine.rollout.HybridEngineGenerate`; then, back in training mode, the model's own forward on
    prompt + completion: every generated token must be its argmax at that position. Measured: the largest gap
    between the top logit and the generated token's, over the logits' largest magnitude (0 when every token is the
    argmax; near-ties within kernel rounding pass)."""
    name, tol = "hybrid_rollout", 1e-2
    if _device().type != "cuda":
        return Check(name, "skip", None, tol, "needs a CUDA GPU (DeepSpeed's hybrid engine runs its inference kernels "
                                              "there)")
    from types import SimpleNamespace

    import deepspeed

    from finetune.engine.rollout import HybridEngineGenerate, RolloutRequest, SamplingConfig

    dev = _device()
    model = tiny_llama()
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9,
          "hybrid_engine": {"enabled": True, "max_out_tokens": 16 + new_tokens, "inference_tp_size": 1,
                            "release_inference_cache": False}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = _batch(rows=4, seq=16).clamp(min=2)  # 0 is the pad token, 1 the EOS: neither in the prompts
    rollout = HybridEngineGenerate(engine, SimpleNamespace(pad_token_id=0, eos_token_id=1))
    with rollout.weights():
        out = rollout.generate(RolloutRequest(ids, torch.ones_like(ids)),
                               SamplingConfig(max_new_tokens=new_tokens, temperature=0.0), seed=0)
    engine.train()
    with torch.no_grad():
        logits = engine.module(input_ids=out.input_ids.to(dev)).logits[:, 15:-1].double()
    chosen = logits.gather(-1, out.input_ids[:, 16:].to(dev)[..., None]).squeeze(-1)
    real = out.attention_mask[:, 16:].to(dev).bool()
    gap = float(((logits.max(-1).values - chosen) * real).max() / logits.abs().max())
    engine.destroy()
    return _judge(name, gap, tol, f"{int(real.sum())} greedy tokens of DeepSpeed's HybridEngineRollout on its hybrid "
                                  "engine vs the training forward's argmax, tiny Llama, fp32")


def sp_llama(sp: int, seed: int = 0):
    """A 2-layer Llama whose heads split over ``sp`` sequence-parallel ranks: ``lcm(4, sp)`` attention heads of
    dimension 16, 2 key/value heads when ``sp`` is even (DeepSpeed replicates them over the ranks, so grouped-query
    attention is exercised) and as many as the attention heads when it is odd; vocabulary 512, seeded, fp32,
    ``initializer_range`` 0.2 (logits far from uniform)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 4 * sp // math.gcd(4, sp)
    cfg = LlamaConfig(vocab_size=512, hidden_size=16 * heads, intermediate_size=32 * heads, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=2 if sp % 2 == 0 else heads,
                      max_position_embeddings=256, initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _sp_batch(sp: int) -> dict:
    """4 right-padded rows of ``16 sp - 1`` tokens at most (lengths full, full - 5, half, 3): a length that is not a
    multiple of ``sp``, so :func:`finetune.parallel.sequence.shard_batch` pads, and padding inside the shards."""
    seq = 16 * sp - 1
    ids = _batch(4, seq, seed=2)
    mask = torch.zeros_like(ids)
    for row, n in enumerate((seq, seq - 5, seq // 2, 3)):
        mask[row, :n] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _sp_reference(sp: int, batch: dict) -> tuple[float, float]:
    """The whole batch on one device, plain attention: mean token loss and the global gradient norm (fp64 sum)."""
    model = sp_llama(sp)
    loss = model(**batch).loss
    loss.backward()
    norm = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in model.parameters()]).norm()
    return float(loss), float(norm)


def check_sequence_parallel(lr: float = 1e-3) -> Check:
    """Ulysses over all ranks at ZeRO-3 vs one device: the loss and the gradient norm of one step (relative).

    Every rank holds the whole batch, takes its slice of every sequence (:func:`finetune.parallel.sequence.shard_batch`: labels
    shifted before the cut, padded to a multiple of SP), sums its slice's token losses and divides by the target
    count of all slices, as the training loop does (data-parallel size 1); DeepSpeed sums the ranks' gradients and
    divides by the data-parallel size (with finetune's ZeRO-3 repair). The reference is the same model on the whole
    batch in one process, in fp32 with transformers' own attention. Skipped on one rank.
    """
    w = dist_utils.world_size()
    tol = 1e-5 if _device().type == "cpu" else 1e-4
    if w < 2:
        return Check("sequence_parallel", "skip", None, tol, "needs 2 or more ranks (SP = the ranks of the node): run "
                                                             "it under a launcher")
    import deepspeed

    batch = _sp_batch(w)
    ref_loss, ref_norm = _sp_reference(w, batch)  # before Ulysses replaces the attention
    cfg = RunConfig()
    cfg.model.attn_implementation, cfg.train.micro_batch_size = "sdpa", batch["input_ids"].shape[0]
    cfg.parallel.sequence_parallel_size = w
    lay = layout.layout(cfg)
    model = sp_llama(w)
    try:
        mpu = sequence.start_sequence_parallel(model, cfg, lay)
        ds = {"train_micro_batch_size_per_gpu": cfg.train.micro_batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=mpu)
        repaired = sequence.fix_zero3_average(engine, lay)
        dev = _device()
        shard = {k: v.to(dev) for k, v in sequence.shard_batch(batch, lay.sp, lay.sp_rank).items()}
        targets = (shard["shift_labels"] != -100).sum().float()
        torch.distributed.all_reduce(targets)
        logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), shard["shift_labels"].flatten(), ignore_index=-100,
                               reduction="sum") * lay.dp / targets
        engine.backward(loss)
        engine.step()
        norm = float(engine.get_global_grad_norm())
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        got_loss = float(total) / lay.dp
        engine.destroy()
    finally:
        patches.restore_all()  # transformers' own attention again for whatever runs next
    loss_diff = rel_diff(torch.tensor(got_loss), torch.tensor(ref_loss))
    norm_diff = rel_diff(torch.tensor(norm), torch.tensor(ref_norm))
    return _judge("sequence_parallel", max(loss_diff, norm_diff), tol,
                  f"Ulysses, {w} ranks = sequence-parallel {lay.sp}, ZeRO-3{'' if repaired else ' (unrepaired)'}, "
                  f"tiny Llama, 4 padded rows vs one device: loss {got_loss:.6f} vs {ref_loss:.6f} ({loss_diff:.1e}), "
                  f"grad norm {norm:.6f} vs {ref_norm:.6f} ({norm_diff:.1e})")


def tiny_moe(experts: int, seed: int = 0):
    """A tiny Qwen3-MoE (2 layers, hidden 64, ``experts`` experts of 32, top-2, vocabulary 128), fp32, no
    dropout, the same weights from ``seed``."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=experts, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def check_expert_parallel(steps: int = 3, lr: float = 1e-2) -> Check:
    """DeepSpeed AutoEP over all ranks (EP = world size, ``2 x world`` experts, ZeRO-2, finetune's AutoEP settings:
    :mod:`finetune.parallel.expert`) against the same tiny Qwen3-MoE with transformers' own MoE blocks on the whole
    batch in one process (EP = 1): the per-step losses. On GPUs this runs the kernels CPU ranks never select
    (DeepSpeed's Triton grouped GEMM on sm80/sm86, NCCL's all-to-all). Skipped on one rank."""
    from finetune.parallel import expert

    w, r = dist_utils.world_size(), dist_utils.rank()
    tol = 1e-5 if _device().type == "cpu" else 1e-4
    if w < 2:
        return Check("expert_parallel", "skip", None, tol, "needs 2 or more ranks (EP = the ranks of the node): run "
                                                           "it under a launcher")
    import deepspeed

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2 * w, 16), generator=g)
    ref = _plain_losses(steps, lr, tiny_moe(2 * w), ids)
    mine = ids.chunk(w)[r].to(_device())
    model = tiny_moe(2 * w)
    cfg = RunConfig()
    cfg.parallel.expert_parallel_size = w
    ds = {"train_micro_batch_size_per_gpu": mine.shape[0], "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, "expert_parallel": expert.ds_section(cfg),
          "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
          "steps_per_print": 10**9, "wall_clock_breakdown": False}
    fix = [p for p in [expert.registry_patch()] if p is not None]
    with patches.applied(*fix):
        engine, *_ = deepspeed.initialize(model=model, config=ds,
                                          model_parameters=expert.name_groups([{"params": list(model.parameters())}]))
    got = _mean_losses(engine, mine, steps, w)
    layers = len(expert._layers(engine.module))
    engine.destroy()
    diff = max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, ref))
    return _judge("expert_parallel", diff, tol,
                  f"DeepSpeed AutoEP, EP = {w} ({layers} MoE layers replaced, {2 * w} experts, top-2, ZeRO-2) vs "
                  f"transformers' MoE in one process: losses {', '.join(f'{x:.6f}' for x in got)}")


def check_pipeline(steps: int = 3, lr: float = 1e-3) -> Check:
    """Two pipeline stages over all ranks (``world / 2`` data-parallel, DeepSpeed's ``PipelineEngine`` and 1F1B, 2
    micro-batches a step, finetune's layers, loss scaling and gradient guard: :mod:`finetune.engine.pipeline`) against
    the tiny Llama on the whole batch in one process: the per-step losses. On GPUs this runs the stages' sends and
    receives over NCCL. Skipped on an odd number of ranks."""
    from finetune.engine import pipeline

    w, r = dist_utils.world_size(), dist_utils.rank()
    tol = 1e-5 if _device().type == "cpu" else 1e-4
    if w < 2 or w % 2:
        return Check("pipeline", "skip", None, tol, f"needs an even number of ranks (2 stages x data-parallel), "
                                                     f"{w} here: run it under a launcher")
    import deepspeed

    ids, dp, gas = _batch(), w // 2, 2
    ref = _plain_losses(steps, lr, tiny_llama(), ids)
    cfg = RunConfig()
    cfg.parallel.pipeline_parallel_size, cfg.train.gradient_accumulation_steps = 2, gas
    pipe = pipeline.to_pipeline(tiny_llama(), cfg, w)
    mine = ids.chunk(dp)[r % dp]  # the data-parallel index is inner: stage r // dp
    micro = [{"input_ids": m, "labels": m} for m in mine.chunk(gas)]
    ds = {"train_micro_batch_size_per_gpu": micro[0]["input_ids"].shape[0], "gradient_accumulation_steps": gas,
          "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
          "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()], config=ds)
    pipeline.install_step_guard(engine, 0.0)
    targets = torch.tensor(float(ids.shape[0] * (ids.shape[1] - 1)), dtype=torch.float64)
    got = [float(pipeline.train_step(engine, micro, targets)[0]) for _ in range(steps)]
    engine.destroy()
    diff = max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, ref))
    return _judge("pipeline", diff, tol, f"DeepSpeed's pipeline engine, 2 stages x {dp} data-parallel, 1F1B over "
                                         f"{gas} micro-batches, vs one process: losses {', '.join(f'{x:.6f}' for x in got)}")


CHECKS = {
    "collectives": check_collectives,
    "chunked_head": check_chunked_head,
    "liger_fused_ce": check_liger,
    "bf16_forward": check_bf16,
    "flash_attention": check_flash_attention,
    "flash_packing": check_flash_packing,
    "sdpa_packing": check_sdpa_packing,
    "zero2_step": lambda: check_zero_step(2),
    "zero3_step": lambda: check_zero_step(3),
    "fp16_step": check_fp16_step,
    "sequence_parallel": check_sequence_parallel,
    "hybrid_rollout": check_hybrid_rollout,
    "expert_parallel": check_expert_parallel,
    "pipeline": check_pipeline,
}
"""Check name -> function returning a :class:`Check`; run in this order, on every rank in lockstep."""


def run_checks(names: list[str] | None = None) -> list[Check]:
    """Run the named checks (default: all) on every rank; a check that raises is a ``FAIL`` with the error.

    Every rank runs every check (the collectives and engines need all of them); the rows are rank 0's, and a
    ``FAIL`` on any rank makes the row ``FAIL`` everywhere (the statuses are all-reduced).
    """
    rows = []
    for name in names or list(CHECKS):
        start = time.perf_counter()
        try:
            row = CHECKS[name]()
        except Exception as e:  # noqa: BLE001  (the self-test reports failures, it does not stop at one)
            row = Check(name, "FAIL", None, 0.0, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        failed = torch.tensor([1.0 if row.status == "FAIL" else 0.0], device=_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(failed)
        if failed.item() and row.status != "FAIL":
            row.status, row.detail = "FAIL", row.detail + " (failed on another rank)"
        row.seconds = time.perf_counter() - start
        rows.append(row)
    return rows


def render(rows: list[Check]) -> str:
    """The rows as a text table, then ``N passed, N failed, N skipped``."""
    lines = [f"{'check':<18} {'status':<6} {'measured':>10} {'tolerance':>10} {'seconds':>8}  detail"]
    for r in rows:
        m = "-" if r.measured is None else f"{r.measured:.2e}"
        lines.append(f"{r.name:<18} {r.status:<6} {m:>10} {r.tolerance:>10.0e} {r.seconds:>8.1f}  {r.detail}")
    count = {s: sum(r.status == s for r in rows) for s in ("pass", "FAIL", "skip")}
    lines.append(f"{count['pass']} passed, {count['FAIL']} failed, {count['skip']} skipped")
    return "\n".join(lines)


def as_dicts(rows: list[Check]) -> list[dict]:
    """The rows as JSON-ready dicts."""
    return [asdict(r) for r in rows]
