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
import torch.nn.functional as F

NOT_MODEL_INPUTS = ("labels", "shift_labels", "row_targets", "num_tokens", "reference_logps", "margin", "desirable",
                    "kto_kl", "word_starts", "window_prefix", "window_suffix", "start_positions", "end_positions",
                    "window_row", "offsets", "context_chars", "answer_chars", "pair_score", "eval_row", "eval_rows",
                    "text_key", "embed_grad", "embed_loss", "_rng")
"""Keys of a collated batch that never reach the model: the loss targets (``shift_labels``: next-token targets of a
sequence-parallel slice, and ``row_targets``: the whole rows' target counts, :mod:`finetune.parallel.sequence`), the
real-token count of packed rows, the reference model's log-probabilities of preference pairs, the pairs' margins
(``reward``), ``kto``'s row labels and KL estimate, ``token_cls``'s word starts and window tokens, and ``qa``'s span
labels, windows' rows, character offsets, contexts and gold answers, and ``embed``'s pair scores, texts' keys,
validation row indices and gradient cache."""


def model_inputs(batch: dict) -> dict:
    """The keys of ``batch`` the model is called with: all but :data:`NOT_MODEL_INPUTS`."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def padded_length(rows: list[dict], multiple: int = 0) -> int:
    """The width a micro-batch of ``rows`` is right-padded to: its longest ``input_ids``, rounded up to a multiple of
    ``multiple`` (``data.pad_to_multiple_of``; 0: not rounded)."""
    longest = max(len(r["input_ids"]) for r in rows)
    return -(-longest // multiple) * multiple if multiple else longest


def real_tokens(batch: dict):
    """Real (non-pad) tokens of a collated micro-batch (0-dim int64 tensor, or int): the ``attention_mask`` ones,
    else ``num_tokens`` (packed rows), else every position of ``input_ids``."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if "num_tokens" in batch:
        return batch["num_tokens"]
    return batch["input_ids"].numel()


def flattens(cfg, recipe) -> bool:
    """True when the run's micro-batches go to the model as one row (:func:`flatten`): packed rows
    (``data.packing`` and a recipe that packs, ``Capabilities.packs_rows``: its loss takes next-token targets,
    ``shift_labels``, ``position_ids``, no ``attention_mask``), and a flash-attention kernel
    (transformers' ``is_flash_attention_requested``: ``flash_attention_2/3/4`` and the ``kernels`` variants).

    transformers runs flash attention's variable-length kernel only on one row: ``_is_packed_sequence`` is False
    whenever the batch has more than one row, and packed rows then attend across their examples.
    """
    from transformers.utils.generic import is_flash_attention_requested

    return bool(cfg.data.packing and recipe.capabilities.packs_rows
                and is_flash_attention_requested(requested_attention_implementation=cfg.model.attn_implementation))


def flatten(batch: dict) -> dict:
    """A micro-batch of unpadded rows as one row, as transformers' ``DataCollatorWithFlattening`` makes it.

    Input: ``input_ids`` and ``labels`` (or ``shift_labels``) ``[B, S]``, with packed rows' ``position_ids`` (no
    ``attention_mask``) or an all-ones ``attention_mask`` (packed ``gpt_clm`` blocks). Output: ``input_ids``,
    ``position_ids`` and ``shift_labels`` ``[1, B x S]`` (int64): the labels are shifted row by row **before** the
    rows are joined, so no row's last token predicts the next row's first; ``position_ids`` restart at every example
    and every row (``arange`` per row where the batch had none), which is what flash attention's variable-length
    path reads (``prepare_fa_kwargs_from_position_ids``: a sequence starts wherever the position is the minimum);
    ``num_tokens`` (0-dim int64: the real tokens, for tokens/s) is kept or counted. The loss and the target count of
    the recipe's ``forward`` are those of the rows (the same targets, summed).

    Raises:
        ValueError: a row is padded with a 0 in ``attention_mask`` (padded rows keep their mask and are not
            flattened).
    """
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError("flatten: the rows are padded (zeros in attention_mask); only unpadded or packed rows "
                         "are flattened")
    ids = batch["input_ids"]
    rows, seq = ids.shape
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, dtype=torch.long).expand(rows, seq)
    shift = batch["shift_labels"] if "shift_labels" in batch else F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    count = batch.get("num_tokens", torch.tensor(ids.numel(), dtype=torch.long))
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "shift_labels", "attention_mask",
                                                        "position_ids", "num_tokens")}
    out.update(input_ids=ids.reshape(1, -1), position_ids=pos.reshape(1, -1).contiguous(),
               shift_labels=shift.reshape(1, -1).contiguous(), num_tokens=count)
    return out


def to_device(batch: dict, device) -> dict:
    """Move every tensor of ``batch`` to ``device`` (non-blocking from pinned memory); other values (``grpo``'s raw
    prompts and reward columns) stay as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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
    aux_loss: torch.Tensor | None = None
    """A loss already averaged within the micro-batch, added to its loss *after* the token weighting (0-dim float32,
    differentiable), or None: a mixture-of-experts model's load-balancing loss times its ``router_aux_loss_coef``
    (:func:`finetune.engine.moe.router_terms`). The loop optimizes ``loss_sum`` over the global batch's targets /
    their number + the mean of ``aux_loss`` over the global batch's micro-batches (:mod:`finetune.training.trainer`);
    evaluation reports the ``loss_sum`` part only."""
