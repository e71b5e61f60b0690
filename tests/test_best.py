"""``train.early_stopping`` and ``train.keep_best`` on real 2-rank runs (tiny GPT-2, ZeRO-2, CPU).

Launch 1 (4 steps, evaluations at 2 and at the end, 2 ranks) then a resume to 12 steps on 1 rank (the global batch
kept; the checkpoint loads through its universal copy): early stopping (patience 2, a
``min_delta`` no evaluation can beat, so the count is forced) stops at step 8, the second evaluation of the
resumed launch: the patience count of launch 1 carried over (without it the stop would come at step 10). Keep-best
by the highest eval loss (``mode: max``, so that the best is an early checkpoint, not the last one) keeps that
checkpoint through ``keep_last_checkpoints: 1`` and the resume, and the export is made from it: its logits equal
the engine's after loading it (``finetune evaluate`` of an export: ``tests/test_evaluate.py``), and
``export_check.json`` names it; the best checkpoint was saved on 2 ranks and is loaded through its universal copy.
A third launch (a requeue after the early stop) trains nothing and leaves the same export.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import CONFIGS, check_here, launch, ok, read_metrics
from finetune.training.trainer import improved

pytestmark = pytest.mark.slow

TINY = CONFIGS / "tiny_gpt.yaml"
BEST = ["train.eval_every=2", "train.eval_max_batches=2", "train.save_every=0", "train.keep_last_checkpoints=1",
        "train.early_stopping.patience=2", "train.early_stopping.min_delta=100", "train.keep_best.metric=eval/loss",
        "train.keep_best.mode=max", "train.lr_scheduler=constant", "train.warmup_steps=0", "train.log_every=1"]


def test_early_stopping_and_keep_best_through_a_resume(tmp_path):
    run = tmp_path / "run"
    ok(launch(TINY, [f"output_dir={run}", "train.max_steps=4", *BEST]))
    ckdir = run / "checkpoints"
    first = sorted(p.name for p in ckdir.glob("step*") if (p / "COMPLETE").is_file())
    # launch 2 on 1 rank (an elastic requeue: the global batch is kept, the checkpoint loads through its universal copy)
    proc = ok(launch(TINY, [f"output_dir={run}", "train.max_steps=12", *BEST], resume="latest", nproc=1))
    assert "world size 2 -> 1" in proc.stdout, proc.stdout[-3000:]
    log = (run / "logs" / "rank0.log").read_text()
    assert "train.early_stopping: eval/loss=" in log and "evaluation(s) (patience 2): stopping" in log, proc.stdout[-3000:]
    evals = {r["step"]: r["eval/loss"] for r in read_metrics(run) if "eval/loss" in r}
    assert sorted(evals) == [2, 4, 6, 8]  # launch 1: 2 and its final eval at 4; launch 2: 6, 8, then the stop
    assert max(r["step"] for r in read_metrics(run)) == 8
    best = max(evals, key=evals.get)
    assert f"train.keep_best: best eval/loss={evals[best]:.6g} at step {best}" in log
    complete = sorted(int(p.name[4:]) for p in ckdir.glob("step*") if p.name[4:].isdigit() and (p / "COMPLETE").is_file())
    # keep_last 1 (step 8), the one launch 2 resumed from (step 4) and the best, which survived launch 1's pruning
    assert first == sorted({f"step{best}", "step4"}) and complete == sorted({best, 4, 8}), (complete, first)
    check = json.loads((run / "export_check.json").read_text())
    assert check["checkpoint_step"] == best and check["chosen_by"]["keep_best"]["step"] == best
    assert check["chosen_by"]["keep_best"]["value"] == pytest.approx(evals[best], rel=1e-12)
    assert check["max_abs_logit_diff"] <= 1e-4
    assert best in (2, 4), evals  # saved on 2 ranks: loaded through its universal copy on 1
    assert f"train.keep_best: exporting step {best}" in log and "best checkpoint (universal copy)" in log
    exported = (run / "export" / "model.safetensors").read_bytes()

    # a requeue after the early stop (the job was preempted during its export): nothing is trained, the same export
    proc = ok(launch(TINY, [f"output_dir={run}", "train.max_steps=12", *BEST], resume="latest", nproc=1))
    assert "train.early_stopping ended this run at step 8" in proc.stdout, proc.stdout[-3000:]
    assert max(r["step"] for r in read_metrics(run)) == 8
    assert json.loads((run / "export_check.json").read_text())["checkpoint_step"] == best
    assert (run / "export" / "model.safetensors").read_bytes() == exported


def test_improved_and_config_checks(capsys):
    assert improved(1.0, None, "min") and improved(0.5, 1.0, "min") and not improved(0.95, 1.0, "min", 0.1)
    assert improved(2.0, 1.0, "max") and not improved(1.05, 1.0, "max", 0.1) and not improved(math.nan, 1.0, "min")
    code, out = check_here(["--config", TINY, "train.eval_every=0", "train.early_stopping.patience=-1",
                            "train.early_stopping.min_delta=-1", "train.keep_best.metric=loss",
                            "train.early_stopping.metric=eval/perplexity"], capsys)
    assert code == 2
    lines = [line for line in out.splitlines() if line.startswith("finetune: error: train.")]
    assert "finetune: error: train.early_stopping.patience: must be >= 0 (0: off), got -1" in lines
    assert "finetune: error: train.early_stopping.min_delta: must be >= 0, got -1.0" in lines
    assert any(line.startswith("finetune: error: train.keep_best.metric: 'loss' is not an evaluation metric")
               for line in lines), lines
    assert "finetune: error: train.keep_best: needs evaluations during training; set train.eval_every (steps " \
           "between evaluations), e.g. train.eval_every=100" in lines
    code, dpo = check_here(["--config", CONFIGS / "parity_dpo.yaml", "train.eval_every=2",
                            "train.early_stopping.patience=1", "train.early_stopping.metric=eval/perplexity",
                            "train.keep_best.metric=eval/rewards/accuracy"], capsys)
    assert code == 2 and "recipe dpo reports no eval/perplexity" in dpo
    # a misspelt metric is refused before training, not at the first evaluation hours in
    assert "train.keep_best.metric: 'eval/rewards/accuracy' is not among the metrics this run's evaluation reports " \
           "(did you mean 'eval/rewards/accuracies'?)" in dpo, dpo[-2000:]


def test_nan_evaluations_are_never_an_improvement():
    """A NaN evaluation is logged as no improvement: keep-best keeps the finite best, early stopping counts it against
    its patience and stops (its log line formats a best that does not exist yet)."""
    from finetune.lifecycle.checkpoint import TrainState
    from finetune.config import load_run_config
    from finetune.training.trainer import Evaluations

    cfg = load_run_config(TINY, ["train.early_stopping.patience=2", "train.keep_best.metric=eval/loss"])
    evals = Evaluations(None, None, None, cfg, None, None)
    state = TrainState(step=2)
    assert evals.decide(state, {"eval/loss": math.nan}) == (True, False)
    assert state.best_step == -1 and state.early_best is None and state.early_waited == 1
    state.step = 4
    assert evals.decide(state, {"eval/loss": math.nan}) == (True, True)  # patience 2 used up by two NaNs
    assert state.early_stopped and state.best_step == -1

    state = TrainState(step=2)
    evals.decide(state, {"eval/loss": 1.5})
    state.step = 4
    assert evals.decide(state, {"eval/loss": math.nan}) == (True, False)
    assert (state.best_step, state.best_value, state.early_best) == (2, 1.5, 1.5)
