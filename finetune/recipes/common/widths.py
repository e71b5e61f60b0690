"""Rows of one micro-batch run at their own width: a micro-batch whose rows differ much in length (a long context's
last QA window beside full ones; an embedding batch of short queries and long passages) runs as two forwards, each
padded only to its own longest row, instead of one padded to the micro-batch's longest. The outputs on real tokens
are the same (a row's tokens attend only to its own real tokens); fewer padded positions are computed and kept for
the backward pass. sentence-transformers pads each text column to its own width for the same reason.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist


def width_groups(lengths: list[int], min_saving: float = 0.1) -> list[tuple[list[int], int]]:
    """The rows as one or two groups ``(indices, width)``, each padded only to its own longest row (rounded up to a
    multiple of 8, for tensor cores).

    The split (the longest ``k`` rows, then the rest) is the one with the fewest padded positions; it is taken only
    when it saves at least ``min_saving`` of them.

    Args:
        lengths: real tokens of each row.
        min_saving: the fraction of padded positions a split must save (``-inf``: always split two or more rows;
            ``inf``: never split).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    widest = lengths[order[0]]
    if len(order) == 1:
        return [([0], widest)]
    width = [min(widest, -(-lengths[i] // 8) * 8) for i in order]  # each row's width were it the group's longest
    positions, k = min((split * widest + (len(order) - split) * width[split], split) for split in range(1, len(order)))
    if positions > (1 - min_saving) * len(order) * widest:
        return [(list(range(len(lengths))), widest)]
    return [(sorted(order[:k]), widest), (sorted(order[k:]), width[k])]


def agreed_groups(model, lengths: list[int]) -> list[tuple[list[int], int]]:
    """:func:`width_groups`, the same number of forwards on every rank where a forward is a collective call.

    Under ZeRO-3 every forward all-gathers the parameters (and a mixture of experts sends tokens between ranks), so
    a rank that ran one forward where another ran two would leave the other waiting. There the ranks agree (one
    all-reduce of two flags): two forwards everywhere when any rank's rows gain from a split and every rank has at
    least two rows to split, else one."""
    groups = width_groups(lengths)
    stage = getattr(model, "zero_optimization_stage", None)
    collective = (callable(stage) and stage() == 3) or bool(getattr(model, "has_moe_layers", False))
    if not collective or not dist.is_initialized() or dist.get_world_size() == 1:
        return groups
    device = getattr(model, "device", None) or torch.device("cpu")
    flags = torch.tensor([len(groups) > 1, len(lengths) < 2], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    split = bool(flags[0]) and not bool(flags[1])
    return width_groups(lengths, float("-inf") if split else float("inf"))


def by_width(model, inputs: dict, mask: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, object]]:
    """Run ``model`` over the micro-batch once per :func:`agreed_groups` group.

    Args:
        model: the engine or a transformers model.
        inputs: the model's inputs, each ``[N, T]`` (``input_ids``, ``attention_mask``, ``token_type_ids``).
        mask: the attention mask ``[N, T]`` (1 on real tokens).

    Yields:
        ``(index, mask, output)``: the group's rows (int64 ``[n]``, on ``mask``'s device), their attention mask cut to
        the group's width ``[n, w]``, and the model's output on them.
    """
    for rows, width in agreed_groups(model, mask.sum(1).tolist()):
        index = torch.tensor(rows, device=mask.device)
        part = {k: v.index_select(0, index)[:, :width] for k, v in inputs.items()}
        yield index, mask.index_select(0, index)[:, :width], model(**part)
