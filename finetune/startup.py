"""What a training launch keeps from importing: optional packages the run cannot use.

bitsandbytes (``model.quantization``, QLoRA) is imported by peft whenever it is installed, and its import compiles
functions with ``torch.compile``, which loads TorchInductor: about 2 s and 45 MB per rank at every launch. A launch
whose run config and command line never mention ``quantization`` cannot build a quantized base, so
:func:`skip_unused` makes bitsandbytes look absent to that process (``sys.modules`` entry ``None``: the standard
"not importable" marker; peft and transformers then treat it as not installed).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPTIONAL = {"bitsandbytes": "quantization"}
"""Package -> the word a run config or command line that needs it contains."""


def _config_text(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else \
            arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if path:
            try:
                return Path(path).read_text(errors="replace")
            except OSError:  # the launch's own checks report an unreadable config
                return ""
    return ""


def skip_unused(argv: list[str]) -> list[str]:
    """Block the :data:`OPTIONAL` packages that neither ``argv`` nor the ``--config`` file mentions (a word match:
    a mention that is not a key only costs the import). Call before transformers or peft is imported.

    Returns:
        The packages blocked.
    """
    text = " ".join(argv) + "\n" + _config_text(argv)
    blocked = []
    for package, word in OPTIONAL.items():
        if package in sys.modules or word in text or importlib.util.find_spec(package) is None:
            continue
        sys.modules[package] = None  # type: ignore[assignment]
        blocked.append(package)
    return blocked
