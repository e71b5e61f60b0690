"""Launch target: ``deepspeed finetune/run.py --config X``, ``torchrun ... finetune/run.py``, ``python finetune/run.py``.

Run as a script, Python puts ``finetune/`` itself first on ``sys.path``, where module names such as
``data`` or ``config`` could shadow other packages; the repository root goes there instead, so the
package imports the same way whether it is installed or not.
"""

import os
import sys

if __package__ in (None, ""):
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

from finetune.startup import skip_unused  # noqa: E402, I001

skip_unused(sys.argv[1:])  # before transformers and peft: bitsandbytes only for a quantized base

# health first: its atexit handler (exit_process: no interpreter teardown) must run after every library's
from finetune.lifecycle.health import exit_process  # noqa: E402, I001
from finetune.commands.train import main as train_main  # noqa: E402

if __name__ == "__main__":
    exit_process(train_main())
