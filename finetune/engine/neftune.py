"""NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"): uniform noise on the
input embeddings in training forwards only, ``U(-a, a)`` with ``a = alpha / sqrt(L * d)``, ``L`` the length of the
example a position belongs to and ``d`` the hidden size, as in the paper's algorithm and its code
(``neelsjain/NEFTune``: the length of each example from its attention mask, no noise on pads).

transformers 5.23's ``neftune_post_forward_hook`` (``Trainer``'s and TRL's ``neftune_noise_alpha``) is not called:
a forward hook on the embedding sees only the token ids, and it takes ``L`` from the embeddings' shape, the padded
length of the micro-batch, or of a whole packed row: with ``sft`` packing one ``L`` for all the examples of a row,
and under flash attention's flattened micro-batch (:func:`finetune.data.batch.flatten`, ``[1, B x S]``) ``B`` times
the row's, the noise ``sqrt(B)`` times too small. Here a forward pre-hook on the model reads the call's
``position_ids`` (a new example wherever they do not grow by one, transformers' rule for packed rows,
``masking_utils.find_packed_sequence_indices``) and ``attention_mask`` (the real positions), and the embedding hook
draws transformers' noise for each example at its own length; a row without either is one example.

Off in every forward whose embedding module is not training: evaluation, generation (the engine's ``eval()``),
the no-gradient passes of ``dpo``'s reference and the export's check, and the export itself (a hook is not part of
the weights). Under sequence parallelism each rank embeds a slice of every row: the slices' ``position_ids`` are
gathered over the SP group, so an example cut by a slice boundary has its whole length on every rank (a right-padded
row is one example there: the SP shard carries no mask, :class:`finetune.parallel.sequence.SequenceShard`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.parallel import sequence


def lengths(shape: torch.Size, position_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The length ``L`` of the example each position of a ``[batch, seq]`` input belongs to (float ``[batch, seq]``;
    0 at pads).

    Args:
        shape: ``(batch, seq)``.
        position_ids: int ``[batch, seq]`` (or ``[1, seq]``, shared by the rows): a new example wherever a position
            is not the previous one plus one (packed rows restart at 0). None: each row is one example.
        attention_mask: ``[batch, seq]``, 0 at pads (not counted, and ``L`` 0 there). None: no pads.
    """
    rows, seq = shape
    real = (attention_mask.bool() if attention_mask is not None
            else torch.ones(rows, seq, dtype=torch.bool, device=position_ids.device if position_ids is not None
                            else None))
    if position_ids is None:
        starts = F.pad(torch.zeros(rows, seq - 1, dtype=torch.bool, device=real.device), (1, 0), value=True)
    else:
        pos = position_ids.expand(rows, seq)
        starts = F.pad(pos[:, 1:] != pos[:, :-1] + 1, (1, 0), value=True)
    example = starts.reshape(-1).long().cumsum(0) - 1  # every example of every row numbered, in order
    # at most one example a position: no host sync for the count
    count = torch.zeros(rows * seq, device=real.device).scatter_add_(0, example, real.reshape(-1).float())
    return (count[example] * real.reshape(-1)).reshape(rows, seq)


def _whole_rows(position_ids: torch.Tensor, group) -> tuple[torch.Tensor, slice]:
    """``position_ids`` ``[batch, seq / sp]`` of this SP rank's slice -> those of the whole rows (gathered over
    ``group``) and this rank's slice of them."""
    parts = [torch.empty_like(position_ids) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, position_ids.contiguous(), group=group)
    rank, width = torch.distributed.get_rank(group), position_ids.size(-1)
    return torch.cat(parts, dim=-1), slice(rank * width, (rank + 1) * width)


class NEFTune:
    """NEFTune on ``model``'s input embeddings (a ``PeftModel``'s base model's): :func:`activate` makes one.

    A forward pre-hook on ``model`` keeps the call's ``position_ids`` and ``attention_mask`` (keyword arguments, as
    the engine passes a batch) for the embedding's forward hook of the same call, which adds the noise when the
    embedding module is training. Called alone (``model.get_input_embeddings()(ids)``), the embedding treats each row
    as one example.
    """

    def __init__(self, model: torch.nn.Module, alpha: float):
        self.alpha = alpha
        self._inputs: dict = {}
        self._handles = [model.register_forward_pre_hook(self._keep, with_kwargs=True),
                         model.get_input_embeddings().register_forward_hook(self.hook)]

    def _keep(self, module, args, kwargs) -> None:
        self._inputs = {k: kwargs.get(k) for k in ("position_ids", "attention_mask")}

    def hook(self, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        """The embedding's forward hook: ``output`` ``[batch, positions, hidden]`` plus the noise when ``module`` is
        training, unchanged otherwise."""
        inputs, self._inputs = self._inputs, {}
        if not module.training:
            return output
        rows, seq, hidden = output.shape
        pos, mask = inputs.get("position_ids"), inputs.get("attention_mask")
        if pos is not None and (pos.dim() != 2 or pos.size(-1) != seq or pos.size(0) not in (1, rows)):
            pos = None  # not this embedding's positions (another call's shape)
        if mask is not None and tuple(mask.shape) != (rows, seq):
            mask = None
        group = sequence.sequence_group()
        if group is not None:  # a slice of every row: the examples' lengths come from the whole rows
            if pos is None:
                pos = torch.arange(seq, device=output.device).expand(rows, seq) + sequence.sequence_rank() * seq
            pos, part = _whole_rows(pos, group)
            length = lengths((rows, pos.size(-1)), pos)[:, part]
        else:
            length = lengths((rows, seq), pos, mask)
        length = length.to(output.device, torch.float32)  # in fp32: bf16 holds integers exactly only to 256
        magnitude = torch.where(length > 0, self.alpha / torch.sqrt(length.clamp(min=1) * hidden),
                                torch.zeros_like(length))
        return output + torch.zeros_like(output).uniform_(-1, 1) * magnitude.to(output.dtype).unsqueeze(-1)

    def remove(self) -> None:
        """Remove both hooks."""
        for handle in self._handles:
            handle.remove()


def activate(model: torch.nn.Module, alpha: float) -> NEFTune | None:
    """NEFTune with noise ``alpha`` on ``model`` (:class:`NEFTune`, whose ``remove()`` takes it off again); None when
    ``alpha`` is 0."""
    if not alpha:
        return None
    return NEFTune(model, alpha)
