"""``finetune/run.py`` with one fault injected, for tests/test_checkpoint_integrity.py, chosen by environment variable:

* ``FAULT_NAN_LR_AT_STEP=k``: optimizer step ``k`` runs with a NaN learning rate in every parameter group, as
  ``train.muon_lr=nan`` did before ``--check`` refused it (issue 51): the gradient is finite, so the step counts as
  applied, and the update writes NaN into every weight. The schedule sets a finite rate again at the next step.
* ``FAULT_EXPORT_NOISE=x``: ``x`` is added to every weight of the end-of-run export's ``model.safetensors`` once it is
  written, so the export check (the export's logits against the engine's) fails as a wrong export would.

The replacements are set on finetune's modules for this process only (the wrapper is the process's entry point);
everything else, DeepSpeed included, runs as in a launch of ``finetune/run.py``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _nan_lr_at(step: int) -> None:
    from finetune.training import trainer

    real = trainer.train_step

    def train_step(engine, *args, **kwargs):
        if engine.global_steps + 1 == step:  # the step about to run
            for group in engine.optimizer.param_groups:
                group["lr"] = float("nan")
        return real(engine, *args, **kwargs)

    trainer.train_step = train_step


def _export_noise(x: float) -> None:
    from safetensors.torch import load_file, save_file

    from finetune.lifecycle import export

    real = export.export_checkpoint

    def export_checkpoint(*args, **kwargs):
        out = real(*args, **kwargs)
        weights = Path(out) / "model.safetensors"
        state = load_file(weights)
        save_file({k: v + x if v.is_floating_point() else v for k, v in state.items()}, weights,
                  metadata={"format": "pt"})
        return out

    export.export_checkpoint = export_checkpoint


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if os.environ.get("FAULT_NAN_LR_AT_STEP"):
        _nan_lr_at(int(os.environ["FAULT_NAN_LR_AT_STEP"]))
    if os.environ.get("FAULT_EXPORT_NOISE"):
        _export_noise(float(os.environ["FAULT_EXPORT_NOISE"]))
    sys.argv[0] = str(REPO / "finetune/run.py")
    runpy.run_path(str(REPO / "finetune/run.py"), run_name="__main__")
