"""NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"): uniform noise on the
input embeddings in training forwards only, as transformers' ``neftune_post_forward_hook`` adds it (``Trainer``'s
and TRL's ``neftune_noise_alpha``): ``U(-a, a)`` with ``a = alpha / sqrt(L * d)``, ``L`` the row's length in
positions and ``d`` the hidden size.

Off in every forward whose embedding module is not training: evaluation, generation (the engine's ``eval()``),
the no-gradient passes of ``dpo``'s reference and the export's check, and the export itself (a hook is not part of
the weights). Under sequence parallelism each rank embeds a slice of the row, so ``L`` is the slice's length times
the SP size: the same magnitude as on one rank.
"""

from __future__ import annotations

import math

import torch

from finetune.parallel import sequence


def hook(alpha: float):
    """A forward hook for the input-embedding module (``Module.register_forward_hook``): the noise on the output
    ``[batch, positions, hidden]`` when the module is training, the output unchanged otherwise."""

    def neftune(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        group = sequence.sequence_group()
        sp = torch.distributed.get_world_size(group) if group is not None else 1
        magnitude = alpha / math.sqrt(output.size(1) * sp * output.size(2))
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return neftune


def activate(model: torch.nn.Module, alpha: float):
    """Register :func:`hook` on ``model``'s input embeddings (a ``PeftModel``'s base model's); None when ``alpha``
    is 0.

    Returns:
        The hook's ``RemovableHandle``, or None.
    """
    if not alpha:
        return None
    return model.get_input_embeddings().register_forward_hook(hook(alpha))
