"""What a collated micro-batch holds, and what a recipe's loss returns for one.

A batch is a dict of int64 tensors ``[micro_batch, seq]``: ``input_ids``, ``attention_mask`` (or, for packed
rows, ``position_ids`` that restart per example and a 0-dim ``num_tokens``), and ``labels`` (-100 where no loss is
taken; ``[micro_batch]`` for sequence classification). Everything but :data:`NOT_MODEL_INPUTS` goes to the model.
A recipe whose rows hold several sequences stacks them along the batch: ``dpo``'s micro-batch of ``B`` pairs is
``[2B, seq]``, the chosen responses of rows ``0..B-1`` first, then their rejected ones, with ``reference_logps``
``[2B]`` (float32) in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NOT_MODEL_INPUTS = ("labels", "shift_labels", "num_tokens", "reference_logps")
"""Keys of a collated batch that never reach the model: the loss targets (``shift_labels``: next-token targets of a
sequence-parallel slice, :mod:`finetune.parallel.sequence`), the real-token count of packed rows and the reference model's
log-probabilities of preference pairs."""


def model_inputs(batch: dict) -> dict:
    """The keys of ``batch`` the model is called with: all but :data:`NOT_MODEL_INPUTS`."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def real_tokens(batch: dict):
    """Real (non-pad) tokens of a collated micro-batch (0-dim int64 tensor, or int): the ``attention_mask`` ones,
    else ``num_tokens`` (packed rows), else every position of ``input_ids``."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if "num_tokens" in batch:
        return batch["num_tokens"]
    return batch["input_ids"].numel()


def to_device(batch: dict, device) -> dict:
    """Move every tensor of ``batch`` to ``device`` (non-blocking from pinned memory)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class LossOutput:
    """What a recipe's ``forward`` returns for one micro-batch."""

    loss_sum: torch.Tensor
    """Loss summed over the micro-batch's targets: 0-dim float32, differentiable (the loop divides it)."""
    targets: torch.Tensor
    """Targets it sums over (0-dim int64), equal to ``count_targets(batch)``."""
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """With ``metrics=True``: extra eval metrics as ``name -> (numerator, denominator)`` sums (0-dim tensors),
    reduced over batches and ranks and logged as ``eval/<name>`` = numerator / denominator."""
    counts: torch.Tensor | None = None
    """With ``metrics=True``, optionally: a fixed-shape float64 tensor summed over eval batches and ranks and
    handed to the recipe's ``eval_report`` (``seq_cls``: the confusion matrix)."""
