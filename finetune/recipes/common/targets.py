"""Next-token targets and the causal-LM loss that every causal-LM recipe trains with (``gpt_clm``, ``sft``,
``vlm_sft``, ``distill``'s cross-entropy term, ``dpo``'s sequence log-probabilities): labels shifted by one
position, the targets counted, and the chunked LM head + cross-entropy at the target positions only
(:func:`finetune.recipes.lm_loss.token_loss_sum`). One loss path, so the exact-mean guarantee (the summed loss over
the global batch's target count) is proved once for all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.data.batch import LossOutput, model_inputs
from finetune.recipes.lm_loss import token_loss_sum


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets [batch, seq] of ``labels`` [batch, seq]: position ``t`` predicts ``labels[:, t + 1]``; the
    last position gets -100. Row by row, so packed rows with ``position_ids`` shift the same way."""
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def forward(model, batch: dict, metrics: bool = False) -> LossOutput:
    """Next-token loss of one micro-batch: labels are shifted first (:func:`shift_labels`), then the LM head and the
    cross-entropy run only at positions whose next token is a target, in chunks
    (:func:`finetune.recipes.lm_loss.token_loss_sum`). Usable as is by any causal-LM recipe whose collator puts
    -100 where no loss is taken (e.g. prompt tokens).

    Args:
        model: the engine (or a transformers causal LM, peft-wrapped or not); called with
            :func:`~finetune.recipes.model_inputs` of ``batch`` (``position_ids`` of packed rows pass through).
        batch: ``input_ids``, ``attention_mask`` (, ``position_ids``) and ``labels`` (int64, [batch, seq]); or a
            sequence-parallel slice with ``shift_labels`` instead of ``labels`` (:mod:`finetune.parallel.sequence`).
        metrics: no extra metrics beyond loss and perplexity (accepted for the contract).

    Returns:
        :class:`~finetune.recipes.LossOutput` with the cross-entropy summed over targets (0-dim float32, as
        transformers' ``ForCausalLMLoss`` with a sum).  For a mixture-of-experts model also its router's load-balancing
        loss term (``aux_loss``) and router statistics as metrics (:func:`finetune.engine.moe.router_terms`).
    """
    router: dict = {}  # a mixture of experts: its load-balancing loss term and router statistics
    loss, _ = token_loss_sum(model, model_inputs(batch), next_token_targets(batch), router=router)
    return LossOutput(loss, count_targets(batch), router.get("metrics", {}), aux_loss=router.get("aux_loss"))


def next_token_targets(batch: dict) -> torch.Tensor:
    """``[batch, seq]`` int64: what each position predicts: the batch's ``shift_labels`` when it has them (a
    sequence-parallel slice, shifted before the cut: :mod:`finetune.parallel.sequence`), else :func:`shift_labels` of its
    ``labels``."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])


def count_targets(batch: dict) -> torch.Tensor:
    """Positions predicted after the one-token shift (``labels[:, 1:] != -100``, or ``shift_labels != -100`` in a
    sequence-parallel slice); 0-dim int64."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != -100).sum()
    return (batch["labels"][:, 1:] != -100).sum()
