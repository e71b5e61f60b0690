"""The training meter: throughput (real tokens/s and positions/s), padding, the step-time split and MFU.

MFU follows the PaLM paper's definition (Chowdhery et al. 2022, appendix B): model FLOPs per token
(6 x parameters + attention) times tokens/s, over the GPU's peak dense FLOP/s (:data:`PEAK_FLOPS`).
"""

from __future__ import annotations

import time

import torch

from finetune.engine import pipeline
from finetune.data.batch import real_tokens
from finetune.parallel import sequence

__all__ = ["StepMeter", "PEAK_FLOPS", "peak_flops", "model_flops_per_token"]


PEAK_FLOPS: dict[str, tuple[float, float]] = {
    # device name fragment -> (dense bf16/fp16 tensor FLOP/s, dense TF32 FLOP/s), vendor data sheets (SXM parts)
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "L4": (121e12, 60e12),
    "A10G": (70e12, 35e12),
    "A10": (125e12, 62.5e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
}
"""Peak dense FLOP/s per GPU of known models, for MFU; a GPU not listed (and any CPU) gets no MFU."""


def peak_flops(device, half_precision: bool) -> float | None:
    """Peak dense FLOP/s of ``device`` (a ``torch.device``) from :data:`PEAK_FLOPS`, bf16/fp16 tensor cores when
    ``half_precision`` else TF32; None on CPUs and unknown GPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "A10G" before "A10"
        if key in name:
            return PEAK_FLOPS[key][0 if half_precision else 1]
    return None


def model_flops_per_token(model, seq_len: float, n_params: int | None = None) -> float:
    """Training FLOPs per token: ``6 N + 12 L H T`` (weights: forward 2N, backward 4N; attention scores and
    values at context ``T``), the estimate of PaLM's appendix B and nanoGPT's ``estimate_mfu``.

    Args:
        model: the ``transformers`` model (``engine.module``); ``N`` counts its parameters (ZeRO-3 partitioned
            ones by their full size, ``ds_numel``), ``L``/``H`` are ``num_hidden_layers``/``hidden_size`` of its
            config (``n_layer``/``n_embd`` for GPT-2 configs).
        seq_len: mean positions per row of the measured batches (``T``).
        n_params: ``N`` when already counted.
    """
    n = n_params if n_params is not None else sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    config = getattr(model, "config", None) or getattr(model, "finetune_config", None)  # a pipeline: the model's
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0) or 0
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 0
    return 6.0 * n + 12.0 * layers * hidden * seq_len


class StepMeter:
    """Throughput, padding and where the step time goes, for the training log (one per ``fit``).

    The loop calls :meth:`begin` at the start of every optimizer step and :meth:`lap` after each phase
    (``data_wait``, ``before_step``, ``forward``, ``backward``, ``optimizer``). Only on a sampled step (the logged ones) does
    :meth:`lap` synchronize the device and read the clock, so the other steps run without extra
    synchronisation; on those the two calls cost a bool test. The split is per optimizer step, in seconds,
    summed over its micro-batches: ``backward`` includes the gradient reduction ZeRO runs in backward hooks
    (waiting for the slowest rank shows there), ``optimizer`` is ``engine.step()``; ``forward`` of the first
    micro-batch includes the target-count all-reduce and the copy of the batch to the device; ``before_step`` is the
    recipe's whole-batch work before it (``grpo``: generation, scoring, the no-gradient log-probabilities; ``kto``: its
    KL pass; about 0 for the others).

    Args:
        model: the trained module (for MFU's FLOPs per token).
        device: the engine's device (``torch.device``).
        world: world size.
        half_precision: bf16/fp16 training (selects the peak of :data:`PEAK_FLOPS`).
    """

    PHASES = ("data_wait", "before_step", "forward", "backward", "optimizer")

    def __init__(self, model, device, world: int, half_precision: bool):
        self.model, self.device, self.world = model, device, world
        self.peak = peak_flops(device, half_precision)
        self.n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) if self.peak else 0
        if pipeline.is_pipeline_module(model):  # MFU: every stage's weights run on every token (a collective)
            self.n_params = pipeline.total_parameters(model, device)
        self.sampling = False
        self.split = dict.fromkeys(self.PHASES, 0.0)
        self._t = 0.0

        self.window = torch.zeros(3, dtype=torch.float64, device=device)
        """This rank's [non-pad tokens, positions, rows] since the last log line (the loop all-reduces, zeroes it)."""
        self.epoch = torch.zeros(2, dtype=torch.float64, device=device)
        """This rank's [non-pad tokens, positions] of the current epoch."""

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def count(self, batch: dict) -> None:
        """Count one collated micro-batch on the device, without a synchronisation: its real (non-pad) tokens
        (:func:`finetune.recipes.real_tokens`: the ``attention_mask`` ones, or ``num_tokens`` of packed rows),
        positions and rows (``input_ids``: ``[rows, positions]``). Under sequence parallelism a micro-batch that
        still holds its ``attention_mask`` is whole on every rank of the SP group (``grpo`` builds its sequences
        itself and cuts them in its loss; :class:`finetune.parallel.sequence.SequenceShard` slices the others and
        drops the mask): the group's first rank counts it, the others nothing, so the sums over all ranks count each
        token once."""
        if "attention_mask" in batch and sequence.sequence_rank() > 0:
            return
        real, ids = real_tokens(batch), batch["input_ids"]
        self.window[0] += real
        self.window[1] += ids.numel()
        self.window[2] += ids.shape[0]
        self.epoch[0] += real
        self.epoch[1] += ids.numel()

    def begin(self, sample: bool) -> None:
        """Start an optimizer step; ``sample``: time its phases (True on logged steps)."""
        self.sampling = sample
        if sample:
            self.split = dict.fromkeys(self.PHASES, 0.0)
            self._sync()
            self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the previous lap (or :meth:`begin`) to ``phase`` (sampled steps only)."""
        if self.sampling:
            self._sync()
            now = time.perf_counter()
            self.split[phase] += now - self._t
            self._t = now

    def scalars(self, tokens: float, positions: float, rows: float, seconds: float) -> dict[str, float]:
        """Scalars of one log window from all-reduced counts.

        Args:
            tokens: non-pad tokens of all ranks (attention mask ones).
            positions: positions of all ranks' batches (pad included).
            rows: rows of all ranks.
            seconds: wall time of the window.

        Returns:
            ``train/tokens_per_s`` (all ranks), ``train/tokens_per_s_per_device``, ``train/padding_ratio`` (real
            tokens / positions, 1.0 = no padding), ``time/<phase>_s`` of the last sampled step and, on GPUs of
            :data:`PEAK_FLOPS`, ``train/mfu`` (fraction of the device's peak; real tokens only).
        """
        per_device = tokens / seconds / self.world if seconds > 0 else float("nan")
        out = {"train/tokens_per_s": per_device * self.world, "train/tokens_per_s_per_device": per_device,
               "train/padding_ratio": tokens / positions if positions else float("nan")}
        out.update({f"time/{k}_s": v for k, v in self.split.items()})
        if self.peak and rows:
            flops = model_flops_per_token(self.model, positions / rows, self.n_params)
            out["train/mfu"] = per_device * flops / self.peak
        return out

    def describe_mfu(self, scalars: dict[str, float]) -> str:
        """MFU for the progress bar: a percentage, or ``n/a`` (CPU, unknown GPU)."""
        return f"{100 * scalars['train/mfu']:.1f}%" if "train/mfu" in scalars else "n/a"
