"""``--resume`` with a changed config, a changed layout, and runs that diverge (issue 7, items 1-4 and 10).

One real 8-step run (2 CPU ranks, ZeRO-2, tiny GPT-2, checkpoint at step 4) is the base; each resume
works on a copy of it. Refusals are checked by launches run in the test's process (``conftest.refused_here``, one
with the base run's rank environment, ``WORLD_SIZE=2``): validation refuses before any process group or model
exists.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import (CONFIGS, finetune_here, finished_run, free_port, launch, ok, read_metrics, refused_here,
                      train_losses)

CONFIG = CONFIGS / "tiny_gpt.yaml"
BASE = ["train.max_steps=8", "train.save_every=4", "train.eval_every=0", "train.log_every=1", "export=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory, CONFIG, BASE)


def copy_of(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def two_rank_env() -> dict:
    """Rank 0 of a 2-rank world, for validation-only launches (refused before the process group starts)."""
    return dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def errors(proc) -> list[str]:
    return error_lines(proc.stdout)


def error_lines(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.startswith("finetune: error:")]


def snapshot(run: Path) -> dict[str, float]:
    """Every file of the run folder -> mtime (a refused launch must leave all of them as they were)."""
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


def test_run_records_and_checkpoint_config(base):
    """The checkpoint keeps its resolved config; the launch record is in launches/1; rows are marked by launch."""
    ck = base / "checkpoints" / "step4"
    assert (ck / "run_config.yaml").is_file() and "lr: 0.02" in (ck / "run_config.yaml").read_text()
    assert sorted(p.name for p in (base / "launches").iterdir()) == ["1"]
    for name in ("run_config.yaml", "ds_config.json", "meta.json"):
        assert (base / "launches" / "1" / name).read_text() == (base / name).read_text()
    rows = read_metrics(base)
    assert {r["launch"] for r in rows} == {1} and all("train/bad_steps" in r for r in rows if "train/loss" in r)
    assert not (base / ".lock").exists(), "the lock is released at the end"
    log = (base / "logs" / "rank0.log").read_text()
    assert "fused kernels: NewGELUActivation x2 -> F.gelu(approximate='tanh')" in log


def test_changes_that_make_another_run_are_refused_all_at_once(base, tmp_path, capsys):
    """Data files, seed, global batch and ZeRO stage: one line each, exit 2, nothing written."""
    run = copy_of(base, tmp_path)
    before = snapshot(run)
    code, printed = refused_here(["--config", CONFIG, f"output_dir={run}", *BASE,
                                  "data.train_files=[data/wikitext2/validation.parquet]", "train.seed=7",
                                  "train.micro_batch_size=2", "ds.zero_optimization.stage=3", "--resume"], capsys,
                                 **two_rank_env())
    assert code == 2, printed[-3000:]
    lines = error_lines(printed)
    assert any("data.train_files changed" in ln and "--resume-allow-changes" in ln for ln in lines), lines
    assert any("train.seed changed (42 -> 7)" in ln for ln in lines), lines
    assert any("global batch changed from 8 to 4" in ln for ln in lines), lines
    assert any("ZeRO stage 2" in ln and "ds.zero_optimization.stage=2" in ln for ln in lines), lines
    assert len(lines) == 4, lines
    assert snapshot(run) == before, "a refused launch wrote into the run folder"


def test_world_size_change_with_another_global_batch_refused_before_anything_is_built(base, tmp_path, capsys):
    """One rank with micro batch 3 makes a global batch of 3 rows instead of 8: refused before anything is built.
    (Another world size that keeps the global batch resumes: tests/test_world_size_resume.py.)"""
    run = copy_of(base, tmp_path)
    before = snapshot(run)
    code, printed = refused_here(["--config", CONFIG, f"output_dir={run}", *BASE, "train.micro_batch_size=3",
                                  "--resume"], capsys)
    assert code == 2
    lines = error_lines(printed)
    assert len(lines) == 1 and "global batch changed from 8 to 3 rows" in lines[0], printed[-3000:]
    assert "Traceback" not in printed and "model:" not in printed
    assert snapshot(run) == before, "a refused launch rewrote meta.json or something else"


def test_export_onto_a_file_is_a_one_line_error(base, tmp_path, capsys):
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    code, printed = finetune_here(["export", base / "checkpoints" / "step8", a_file], capsys)
    assert code == 2 and "Traceback" not in printed
    assert error_lines(printed) == [f"finetune: error: export: '{a_file}' is a file, not a folder; give the path of a "
                                    f"new folder"]


def test_lr_change_is_applied_and_split_change_repeats_no_row(base, tmp_path):
    """``train.lr`` on resume rebuilds the schedule from the resumed step; a new micro batch x accumulation split
    of the same global batch continues with exactly the uninterrupted run's losses (no row repeated or skipped)."""
    reference = train_losses(base)

    run = copy_of(base, tmp_path / "lr")
    proc = ok(launch(CONFIG, [f"output_dir={run}", *BASE, "train.lr=0.1"], resume=str(run / "checkpoints" / "step4")))
    assert "train.lr: 0.02 -> 0.1 (applied" in proc.stdout
    lr = {r["step"]: r["train/lr"] for r in read_metrics(run) if r.get("launch") == 2 and "train/lr" in r}
    # linear schedule, 2 warmup steps, 8 steps: lr(s) = peak * (8 - s) / 6 after step s
    assert lr[5] == pytest.approx(0.1 * 3 / 6, rel=1e-6) and lr[7] == pytest.approx(0.1 / 6, rel=1e-6)
    assert sorted(p.name for p in (run / "launches").iterdir()) == ["1", "2"]
    assert "lr: 0.1" in (run / "launches" / "2" / "run_config.yaml").read_text()
    assert "lr: 0.02" in (run / "run_config.yaml").read_text(), "the first launch's record was rewritten"
    steps = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8]  # rows of both launches, told apart by "launch"

    run = copy_of(base, tmp_path / "split")
    proc = ok(launch(CONFIG, [f"output_dir={run}", *BASE, "train.micro_batch_size=2",
                              "train.gradient_accumulation_steps=2"], resume=str(run / "checkpoints" / "step4")))
    assert "same global batch of 8 rows, new split" in proc.stdout
    resumed = {r["step"]: r["train/loss"] for r in read_metrics(run) if r.get("launch") == 2 and "train/loss" in r}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), f"step {step}: rows differ from the uninterrupted run"


def test_skipped_nonfinite_steps_leave_weights_unchanged(tmp_path):
    """ZeRO-0: once the loss is NaN each step is skipped (weights as at the last good step), counted, logged as
    null (valid JSON); the final evaluation is NaN, so the run ends with one line, exit status 3, before its last save
    and the export (issue 51). ``train.keep_best`` saves a checkpoint at every evaluation, skipped steps included."""
    run = tmp_path / "run"
    proc = launch(CONFIG, [f"output_dir={run}", "deepspeed=ds_configs/zero0.json", "train.lr=1e30",
                           "train.max_steps=5", "train.save_every=1", "train.eval_every=1", "train.eval_max_batches=1",
                           "train.keep_best.metric=eval/loss", "train.log_every=1", "train.max_bad_steps=100"])
    assert proc.returncode == 3, proc.stdout[-3000:]
    lines = errors(proc)
    assert len(lines) == 1 and "the final evaluation at step 5 is not finite" in lines[0], lines
    assert not (run / "checkpoints" / "step5").exists() and not (run / "export").exists()
    rows = read_metrics(run)  # every line parses (json.loads): no bare NaN
    bad = {r["step"]: r["train/bad_steps"] for r in rows if "train/bad_steps" in r}
    first_bad = min(s for s, n in bad.items() if n > 0)
    assert bad[5] == 5 - first_bad + 1 and 2 <= first_bad <= 4, bad
    assert all(r["train/loss"] is None for r in rows if "train/loss" in r and r["step"] >= first_bad)
    good = torch.load(run / "checkpoints" / f"step{first_bad - 1}" / "mp_rank_00_model_states.pt",
                      weights_only=False)["module"]
    last = torch.load(run / "checkpoints" / "step4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.equal(good[k], last[k]) for k in good), "a skipped step changed the weights"


def test_divergence_stops_the_run_without_saving_or_exporting(tmp_path):
    """ZeRO-2: ``train.max_bad_steps`` consecutive bad steps end the run with one error line, exit status 3."""
    run = tmp_path / "run"
    proc = launch(CONFIG, [f"output_dir={run}", "train.lr=1e30", "train.max_steps=30", "train.save_every=10",
                           "train.eval_every=0", "train.log_every=1"])
    assert proc.returncode != 0
    lines = errors(proc)
    assert len(lines) == 1 and "training diverged: 3 consecutive optimizer steps" in lines[0], proc.stdout[-3000:]
    assert "last good checkpoint: none" in lines[0]
    assert not (run / "export").exists() and not list((run / "checkpoints").glob("step*"))
    assert max(r["step"] for r in read_metrics(run)) < 10


def test_allow_changes_turns_refusals_into_warnings(base, tmp_path, monkeypatch):
    """``--resume-allow-changes``: the same changes validate, each reported as a warning line."""
    from finetune.config import load_run_config
    from finetune.preflight.validate import validate_run

    monkeypatch.chdir(CONFIG.parent.parent.parent)
    run = copy_of(base, tmp_path)
    cfg = load_run_config(CONFIG, [f"output_dir={run}", *BASE, "data.train_files=[data/wikitext2/validation.parquet]",
                                   "train.micro_batch_size=2"])
    resolved = validate_run(cfg, "latest", world_size=2, on_cpu=True, allow_changes=True)
    assert resolved.resume_ckpt == run / "checkpoints" / "step8"
    notes = [n for n in resolved.resume_notes if "continuing as --resume-allow-changes asks" in n]
    assert any("data.train_files changed" in n for n in notes) and any("global batch changed" in n for n in notes)


def test_non_finite_loss_with_finite_gradients_is_skipped(tmp_path):
    """IPO with ``beta`` 1e-20 (ZeRO-2, 1 rank): the square overflows to inf in the forward while its gradient (about
    1e20) stays finite, so the gradient-norm checks alone would train on (loss inf at every step, exit 0). The loop
    turns a non-finite loss into NaN gradients: each step is skipped and counted, and ``train.max_bad_steps`` in a
    row end the run with one line, exit status 3."""
    run = tmp_path / "run"
    proc = launch(CONFIGS / "parity_dpo.yaml", [f"output_dir={run}", "train.dpo.loss_type=ipo", "train.dpo.beta=1e-20",
                                                "train.dpo.label_smoothing=0", "train.dpo.rpo_alpha=0",
                                                "train.max_bad_steps=2", "train.save_every=0", "export=false"],
                  nproc=1)
    assert proc.returncode == 3, proc.stdout[-3000:]
    lines = errors(proc)
    assert len(lines) == 1 and "training diverged: 2 consecutive optimizer steps" in lines[0], proc.stdout[-3000:]
    bad = {r["step"]: r["train/bad_steps"] for r in read_metrics(run) if "train/bad_steps" in r}
    assert bad == {1: 1}, bad  # step 2's row is not written: the run stops there


def test_resume_that_changes_the_schedule_keeps_loraplus_rates_and_decays(tmp_path, monkeypatch):
    """Issue 68 item 5: LoRA+ (ratio 16) with ``modules_to_save`` (the final layer norm: 1-D, lr x ratio, no decay)
    on a real 1-rank ZeRO-2 engine; a resume that changes ``train.lr``, ``train.warmup_steps`` and
    ``train.weight_decay`` (:func:`finetune.lifecycle.resume.apply`, the groups as the checkpoint restores them) gives
    every group the rate and decay the new config builds: the A matrices at lr, the B matrices and the norm at
    lr x 16, decay on both matrix groups, none on the norm."""
    from finetune import patches
    from finetune.config import config_to_dict, load_run_config
    from finetune.engine.model import build_engine, load_model_config
    from finetune.lifecycle import resume
    from finetune.parallel import distributed as dist_utils
    from finetune.preflight.validate import validate_run
    from finetune.recipes import recipe_for

    lora = ["model.lora.r=4", "model.lora.loraplus_lr_ratio=16", "model.lora.modules_to_save=[ln_f]",
            f"output_dir={tmp_path / 'run'}"]
    parity = CONFIGS / "parity_gpt.yaml"
    old = load_run_config(parity, [*lora, "train.lr=1e-4", "train.weight_decay=0.01"])
    new = load_run_config(parity, [*lora, "train.lr=2e-4", "train.warmup_steps=0", "train.weight_decay=0.1"])
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(CONFIG.parent.parent.parent)
    ds = validate_run(old, None, 1, True).ds
    dist_utils.init(5.0)
    try:
        recipe = recipe_for(old)
        engine = build_engine(old, recipe, load_model_config(old, recipe), ds, total_steps=20).engine
        groups = engine.optimizer.param_groups
        assert [g["initial_lr"] for g in groups] == pytest.approx([1e-4, 1.6e-3, 1.6e-3])
        assert [g["weight_decay"] for g in groups] == [0.01, 0.01, 0.0]
        resume.apply(engine, config_to_dict(old), new, total_steps=20)
        groups = engine.optimizer.param_groups
        assert [g["initial_lr"] for g in groups] == pytest.approx([2e-4, 3.2e-3, 3.2e-3])
        assert [g["lr"] for g in groups] == pytest.approx([2e-4, 3.2e-3, 3.2e-3])  # no warmup: the peak at step 0
        assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0]
    finally:
        dist_utils.shutdown()
        patches.restore_all()
