"""Reading checkpoint files without running code: every ``.pt`` file of a checkpoint is unpickled with
``torch.load(weights_only=True)`` and an allow-list of the few classes DeepSpeed's and finetune's states hold.

A ``.pt`` file is a pickle, and a pickle can name any function to call while it loads: ``torch.load(weights_only=
False)`` (what DeepSpeed 0.19.8's loaders pass, and ``zero_to_fp32``) runs whatever the file says. The checkpoint's
manifest (:mod:`finetune.lifecycle.checkpoint`) guards against damage, not against a file that someone else wrote
and hashed (checkpoints on shared scratch are written by other people), so two guards stand before DeepSpeed reads a
checkpoint:

* :func:`code_in`: a static scan of a file's pickle (torch's ``get_unsafe_globals_in_checkpoint``: the pickle is
  disassembled, not run) for anything outside :data:`SAFE_GLOBALS`; the resume's verification and ``finetune
  export`` refuse such a file in one line naming it, before any rank loads anything (no rank is left waiting in a
  collective for one that failed);
* :func:`weights_only`: within the block, ``torch.load`` always loads with ``weights_only=True`` and
  :data:`SAFE_GLOBALS`, whatever its caller passes (DeepSpeed's ``load_checkpoint``, ``zero_to_fp32``, the universal
  converter); a file that needs anything else raises :class:`~finetune.errors.RunFailure` naming it.

The allow-list is the one torch documents for NumPy arrays (``numpy.random.get_state`` in ``rng_state_rank<r>.pt``)
plus DeepSpeed's ZeRO optimizer states (its loss scaler, the ZeRO stage enum, the parameter-fragment addresses):
classes whose reconstruction only sets attributes. Source: PyTorch's "weights_only" serialization notes
(``torch.serialization.add_safe_globals``).
"""

from __future__ import annotations

import contextlib
import pickle
import runpy
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from finetune import patches
from finetune.errors import RunFailure

SAFE_GLOBALS: list = [
    LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address,
    np.ndarray, np.dtype, np._core.multiarray._reconstruct,
    *{type(np.dtype(t)) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                  "uint64", "float16", "float32", "float64")},
]
"""What a checkpoint's pickles may name besides torch's own allow-list (tensors, plain containers, ``OrderedDict``)."""

_REAL_LOAD = torch.load


def _names() -> set[str]:
    return {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}


def code_in(path: Path) -> list[str]:
    """The globals ``path``'s pickle names that are not checkpoint data (outside torch's allow-list and
    :data:`SAFE_GLOBALS`): what loading it with ``weights_only=False`` would import and may call. Empty for a sound
    file. The pickle is disassembled, never run.

    Returns:
        Dotted names (``os.system``, ``builtins.eval``), or one ``"not a torch.save file (...)"`` entry for a file
        torch's zip reader cannot open (the legacy format cannot be scanned; ``weights_only`` loading refuses it
        too).
    """
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (ValueError, RuntimeError, OSError, KeyError, pickle.UnpicklingError) as e:
        return [f"not a torch.save file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"]
    return sorted(set(found) - _names())


def refusal(path: Path, names: list[str]) -> str:
    """The one line that refuses ``path`` for the globals ``names`` (:func:`code_in`)."""
    return (f"{path.name} names {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} in its pickle, which is "
            f"not checkpoint data and would run code when loaded: not loaded (a checkpoint written by finetune "
            f"never holds it; if you trust the file's author, load it yourself with torch.load)")


def load(path, map_location=None, **kwargs):
    """``torch.load(path, weights_only=True)`` with :data:`SAFE_GLOBALS` allowed; what every checkpoint file is read
    with.

    Raises:
        RunFailure: the file needs a global outside the allow-list (one line naming the file and the global).
    """
    kwargs.pop("weights_only", None)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return _REAL_LOAD(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        name = getattr(path, "name", path)
        why = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                   str(e).splitlines()[0] if str(e) else "")
        raise RunFailure(f"checkpoint file '{name}' is refused: {why} (not checkpoint data: loading it would run "
                         f"code); if you trust the file's author, load it yourself with torch.load") from None


def _forced(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    return load(f, map_location=map_location, **kwargs)


@contextlib.contextmanager
def weights_only() -> Iterator[None]:
    """Within the block every ``torch.load`` (DeepSpeed's loaders included, which pass ``weights_only=False``) loads
    with ``weights_only=True`` and :data:`SAFE_GLOBALS` (:func:`load`)."""
    why = ("DeepSpeed 0.19.8 loads checkpoint files with torch.load(weights_only=False), which runs any code a "
           "crafted pickle names; no DeepSpeed option turns it off (not filed upstream)")
    with patches.applied(patches.Patch(torch, "load", _forced, why)):
        yield


def main(argv: list[str]) -> None:
    """``python -m finetune.lifecycle.safe_load MODULE ARGS...``: run module ``MODULE`` as ``python -m`` would, with
    every ``torch.load`` under :func:`weights_only` (DeepSpeed's ``ds_to_universal`` converter, which reads every
    file of a checkpoint, in its own process). Its worker processes are forked and keep the patch."""
    module, sys.argv = argv[0], argv
    with weights_only():
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
