"""Resume on another world size (universal checkpoints) and ``train.keep_last_checkpoints`` (issue 12, items 1 and 4).

Three real launches of the parity GPT config (tiny GPT-2, dropout off, fp32, 7 steps per epoch) at ZeRO-3 with
LoRA+ (ratio 16: the B matrices train at 16 x the A matrices' rate; DeepSpeed's ZeRO-3 universal load gives every
group group 0's rate, which :func:`finetune.lifecycle.checkpoint.load` repairs from the restored schedule):
an uninterrupted 2-rank run of 8 steps (the reference; checkpoints every 2 steps), a 1-rank resume of its
step 2 (accumulation doubled by itself, so the global batch stays 8 rows) and a 2-rank resume of the
1-rank run's step 6. The per-step losses of both resumes equal the reference's; each resume converts its
checkpoint once into ``step<N>.universal``; ``keep_last_checkpoints`` prunes around the resumed-from one.
What validation decides (global batch kept or refused, the requeue path, layouts that cannot convert) is
checked in-process on the reference's folder, without launches.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import CONFIGS, finished_run, launch, ok, read_metrics, train_losses

CONFIG = CONFIGS / "parity_gpt.yaml"
COMMON = ["ds.zero_optimization.stage=3", "model.lora.r=4", "model.lora.loraplus_lr_ratio=16", "train.max_steps=8",
          "train.save_every=2", "train.log_every=1", "train.eval_every=0", "export=false"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory, CONFIG, COMMON)


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step"))


def launch_losses(run: Path, launch_no: int) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run) if r.get("launch") == launch_no and "train/loss" in r}


def test_two_ranks_to_one_and_back_reproduce_the_uninterrupted_run(reference, tmp_path):
    """2 ranks -> 1 rank (accumulation 1 -> 2) -> 2 ranks: the losses of every resumed step equal the
    uninterrupted 2-rank run's (fp32, 1e-5), across the epoch boundary at step 7; keep-last never removes
    the checkpoint a launch resumed from; a second resume of a converted checkpoint does not convert again."""
    from finetune.lifecycle import checkpoint as ckpt_utils

    expected = train_losses(reference)
    assert sorted(expected) == list(range(1, 9)) and checkpoints(reference) == ["step2", "step4", "step6", "step8"]

    run = tmp_path / "run"  # the reference as it was at step 2
    shutil.copytree(reference, run)
    for step in (4, 6, 8):
        shutil.rmtree(run / "checkpoints" / f"step{step}")

    # Leg 2: one rank, the same config: the accumulation doubles by itself and the checkpoint is converted.
    proc = ok(launch(CONFIG, [f"output_dir={run}", *COMMON, "train.keep_last_checkpoints=2"], nproc=1, resume="latest"))
    assert "world size 2 -> 1: train.gradient_accumulation_steps 1 -> 2 keeps the global batch of 8 rows" in proc.stdout
    assert "universal checkpoint" in proc.stdout and f"{run / 'checkpoints' / 'step2.universal'} written" in proc.stdout
    resumed = launch_losses(run, 2)
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=0), f"1 rank, step {step}"
    # keep 2: step4 went once step8 was complete; step2 stays because this launch resumed from it
    assert checkpoints(run) == ["step2", "step2.universal", "step6", "step8"]
    assert ckpt_utils.marker(run / "checkpoints" / "step8")["world_size"] == 1
    assert not list((run / "checkpoints").glob(".*tmp*")), "the conversion left its temporary folder"

    # A second resume of step2 on another layout reuses its universal copy (the call every rank makes on resume).
    universal = run / "checkpoints" / "step2.universal"
    stamp = (universal / ckpt_utils.MARKER).stat().st_mtime_ns
    assert ckpt_utils.to_universal(run / "checkpoints" / "step2") == universal
    assert (universal / ckpt_utils.MARKER).stat().st_mtime_ns == stamp, "converted again"

    # Leg 3: back to two ranks from the 1-rank checkpoint of step 6, the run's own config (accumulation 1) again.
    proc = ok(launch(CONFIG, [f"output_dir={run}", *COMMON, "train.keep_last_checkpoints=1"], nproc=2,
                     resume=str(run / "checkpoints" / "step6")))
    assert "same global batch of 8 rows, new split (micro batch 4 x accumulation 2 x world 1 -> 4 x 1 x 2)" in \
        proc.stdout
    resumed = launch_losses(run, 3)
    assert sorted(resumed) == [7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=0), f"back on 2 ranks, step {step}"
    # keep 1: only step8 and the resumed-from step6 (with its universal copy); step2 and its copy are gone
    assert checkpoints(run) == ["step6", "step6.universal", "step8"]


def test_layout_and_global_batch_decisions_before_anything_is_built(reference, tmp_path, monkeypatch):
    """Validation only: another world size keeps the global batch by itself (also on the Slurm requeue path);
    a changed global batch is refused, and resumes as a warning with --resume-allow-changes; a layout the
    universal checkpoint cannot reach is refused in one line."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.lifecycle.run_folder import resolve_output_dir
    from finetune.preflight.validate import validate_run

    monkeypatch.chdir(CONFIGS.parent.parent)
    step8 = reference / "checkpoints" / "step8"

    # A requeued job (SLURM_RESTART_COUNT > 0, no --resume) on one node instead of two: it resumes by itself.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    cfg = load_run_config(CONFIG, [f"output_dir={reference}", *COMMON])
    resume, note = resolve_output_dir(cfg, None)
    assert resume == "latest" and "restarted (SLURM_RESTART_COUNT=1)" in note
    resolved = validate_run(cfg, resume, world_size=1, on_cpu=True)
    assert resolved.resume_ckpt == step8 and resolved.universal
    assert resolved.ds["checkpoint"] == {"load_universal": True}
    assert cfg.train.gradient_accumulation_steps == 2 and resolved.ds["train_batch_size"] == 8
    monkeypatch.delenv("SLURM_RESTART_COUNT")

    # Same world size: nothing to convert, nothing changed.
    resolved = validate_run(load_run_config(CONFIG, [f"output_dir={reference}", *COMMON]), "latest", 2, True)
    assert not resolved.universal and "checkpoint" not in resolved.ds

    # The accumulation given explicitly makes a global batch of 12 rows: refused, or a warning when allowed.
    changed = [f"output_dir={reference}", *COMMON, "train.gradient_accumulation_steps=3"]
    with pytest.raises(ConfigError) as refused:
        validate_run(load_run_config(CONFIG, changed), "latest", 1, True)
    assert refused.value.problems == [
        "--resume: the global batch changed from 8 to 12 rows (micro batch 4 x accumulation 1 x world 2 -> 4 x 3 x 1)"
        ": a different run; keep micro batch x accumulation x world size = 8, or start a new run (drop --resume), "
        "or pass --resume-allow-changes to continue anyway"]
    resolved = validate_run(load_run_config(CONFIG, changed), "latest", 1, True, allow_changes=True)
    assert resolved.universal and any("global batch changed from 8 to 12" in n and
                                      "continuing as --resume-allow-changes asks" in n for n in resolved.resume_notes)

    # Three ranks cannot keep 8 rows with micro batch 4: refused (the accumulation is left alone).
    with pytest.raises(ConfigError) as refused:
        validate_run(load_run_config(CONFIG, [f"output_dir={reference}", *COMMON]), "latest", 3, True)
    assert len(refused.value.problems) == 1 and "global batch changed from 8 to 12" in refused.value.problems[0]

    # ZeRO-3 shards cannot become ZeRO-0 or ZeRO-2 state: one line each, naming the way out.
    for stage, why in ((0, "only into its ZeRO 1-3 optimizers"), (2, "between ZeRO-3 and ZeRO 1/2")):
        with pytest.raises(ConfigError) as refused:
            validate_run(load_run_config(CONFIG, [f"output_dir={reference}", *COMMON,
                                                  f"ds.zero_optimization.stage={stage}"]), "latest", 1, True)
        assert len(refused.value.problems) == 1 and why in refused.value.problems[0]
        assert "ds.zero_optimization.stage=3" in refused.value.problems[0]


def test_keep_last_spares_the_exported_and_unfinished_checkpoints(tmp_path):
    """``prune`` on a run folder's layout: the newest N stay, so do the checkpoint the export came from
    (``export/finetune_export.json``) and a folder without ``COMPLETE`` (a save in progress); a removed
    checkpoint's universal copy goes with it."""
    import json

    from finetune.lifecycle import checkpoint as ckpt_utils

    ckdir = tmp_path / "run" / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        (ckdir / f"step{step}").mkdir(parents=True)
        if step != 10:  # step10 is being written
            (ckdir / f"step{step}" / ckpt_utils.MARKER).write_text(json.dumps({"step": step}))
    (ckdir / "step4.universal").mkdir()
    (tmp_path / "run" / "export").mkdir()
    (tmp_path / "run" / "export" / "finetune_export.json").write_text(
        json.dumps({"checkpoint": str(ckdir / "step2"), "step": 2}))
    removed = ckpt_utils.prune(ckdir, keep_last=1, protect=ckdir / "step6")
    assert sorted(p.name for p in removed) == ["step4"]
    assert checkpoints(tmp_path / "run") == ["step10", "step2", "step6", "step8"]
