"""Nothing lost, nothing silent (issue 51, items 1, 2, 4 and the completion-file half of 12): checkpoints carry the
size and SHA-256 of their files and a resume checks them before it loads anything; a damaged checkpoint named by
path is refused in one line, ``--resume`` otherwise falls back to the newest one that verifies and says so; a resume
from an earlier step sets the abandoned lineage and the later completion rows aside (renamed, never deleted); weights
that are not finite are never saved as complete; an export whose check fails is moved aside.

One 2-rank run (6 steps, checkpoints at 2, 4 and 6) is copied and damaged by each test; the refusals run in this
process; one resumed launch checks the fallback, the set-aside and the NaN guard together.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from conftest import CONFIGS, cpu_env, free_port, launch, ok, refused_here, train_losses
from finetune.errors import ConfigError, TrainingDiverged
from finetune.lifecycle import checkpoint as ckpt_utils
from finetune.lifecycle import resume as resume_policy

CONFIG = CONFIGS / "tiny_gpt.yaml"
BASE = ["train.max_steps=6", "train.save_every=2", "train.eval_every=0", "train.eval_max_batches=1", "export=false"]
FAULTS = "tests/faults.py"
SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 2-rank run (ZeRO-2, fp32) with complete checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    ok(launch(CONFIG, [f"output_dir={run}", *BASE]))
    return run


def copy_of(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def flip_middle(path: Path, n: int = 4096) -> None:
    """Invert ``n`` bytes in the middle of ``path``: same size, other bytes (a bit rot, a bad sector)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2 - n // 2)
        data = f.read(n)
        f.seek(size // 2 - n // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    assert path.stat().st_size == size


def truncate_half(path: Path) -> tuple[int, int]:
    """Cut ``path`` to half its size (a copy or a write cut short); returns ``(new size, old size)``."""
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return size // 2, size


def error_lines(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.startswith("finetune: error:")]


def rows_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_manifest_lists_every_file_with_size_and_sha256(base):
    """Each checkpoint's manifest lists its files with their sizes and SHA-256 (each hashed by the rank that wrote
    it), and the ``COMPLETE`` marker records the manifest's own SHA-256."""
    import hashlib

    ck = base / "checkpoints" / "step6"
    meta = ckpt_utils.marker(ck)["manifest"]
    text = (ck / ckpt_utils.MANIFEST).read_bytes()
    assert meta["sha256"] == hashlib.sha256(text).hexdigest()
    files = json.loads(text)["files"]
    on_disk = sorted(p.name for p in ck.iterdir() if p.name not in (ckpt_utils.MARKER, ckpt_utils.MANIFEST))
    assert sorted(files) == on_disk and SHARD.format(1) in files and "rng_state_rank1.pt" in files
    for name, entry in files.items():
        assert entry["size"] == (ck / name).stat().st_size
        assert entry["sha256"] == hashlib.sha256((ck / name).read_bytes()).hexdigest(), name
    assert meta["files"] == len(files) and meta["bytes"] == sum(e["size"] for e in files.values())
    assert ckpt_utils.writer_rank(SHARD.format(1), 2) == 1 and ckpt_utils.writer_rank("mp_rank_00_model_states.pt", 2) == 0


def test_damaged_checkpoint_named_by_path_is_refused_in_one_line(base, tmp_path, capsys):
    """``--resume <checkpoint>``: a truncated shard is refused by the launch's checks (exit 2, one line naming the
    file, before any model); a shard with 4 KiB flipped (same size) is refused by the hash check the ranks run once
    their process group exists (here on one rank, in this process). Without a path, the newest that verifies is
    taken. A checkpoint saved before manifests existed still loads, said to be unverified."""
    run = copy_of(base, tmp_path)
    step2, step4, step6 = (run / "checkpoints" / f"step{s}" for s in (2, 4, 6))
    now, was = truncate_half(step4 / SHARD.format(0))
    flip_middle(step6 / SHARD.format(1))

    code, printed = refused_here(["--config", CONFIG, f"output_dir={run}", *BASE, "--resume", step4], capsys,
                                 RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                 MASTER_PORT=str(free_port()))
    assert code == 2 and "Traceback" not in printed and "model:" not in printed
    assert error_lines(printed) == [f"finetune: error: --resume: '{step4}' is damaged: {SHARD.format(0)} is {now:,} "
                                    f"bytes, its manifest says {was:,}; resume another checkpoint (--resume with its "
                                    f"run folder takes the newest that verifies)"]

    # Same size, other bytes: only the hash check sees it.
    assert ckpt_utils.size_problem(step6) is None
    with pytest.raises(ConfigError) as refused:
        resume_policy.verified(step6, fall_back=False)
    assert refused.value.problems == [f"--resume: '{step6}' is damaged (step6: {SHARD.format(1)} does not match its "
                                      f"SHA-256 in the manifest (same size, other bytes)); resume another checkpoint "
                                      f"(--resume with its run folder takes the newest that verifies)"]
    assert resume_policy.verified(step6, fall_back=True) == step2  # step4's truncated shard is passed over too

    # The launch's checks pass over the truncated step4 when they meet it as the newest.
    shutil.rmtree(step6)
    ckpt, problem, notes = ckpt_utils.resolve_resume("latest", str(run))
    assert (ckpt, problem) == (step2, None)
    assert notes == [f"--resume: damaged checkpoint passed over (step4: {SHARD.format(0)} is {now:,} bytes, its "
                     f"manifest says {was:,}): resuming {step2}, the newest checkpoint that verifies"]

    # Saved before manifests existed: loads, unverified, and says so.
    meta = ckpt_utils.marker(step2)
    del meta["manifest"]
    (step2 / ckpt_utils.MARKER).write_text(json.dumps(meta))
    ckpt, problem, notes = ckpt_utils.resolve_resume(str(step2), str(run))
    assert ckpt == step2 and problem is None and notes == [
        f"--resume: '{step2}' has no {ckpt_utils.MANIFEST} (saved before checkpoints recorded their files' SHA-256): "
        f"it loads unverified"]
    assert resume_policy.verified(step2, fall_back=False) == step2


def test_resume_falls_back_sets_the_abandoned_lineage_aside_and_never_saves_nan(base, tmp_path):
    """``--resume`` with the newest checkpoint's rank-1 shard flipped (same size) and the next one's rank-0 shard
    truncated: the ranks verify their own files, rank 0 names both damaged files in one line and the launch resumes
    step 2 (its losses are the uninterrupted run's). Before training, the later checkpoints (the abandoned lineage)
    and the completion rows and files of later steps are set aside in ``abandoned/launch2/``, never deleted, so
    ``latest`` is this lineage's newest and the resumed steps append no duplicates. Then step 4 runs with a NaN
    learning rate (``tests/faults.py``; ``train.muon_lr=nan`` before ``--check`` refused it): its save is refused,
    the run ends with one line and exit status 3, and no complete checkpoint holds NaN."""
    run = copy_of(base, tmp_path)
    ckdir = run / "checkpoints"
    flip_middle(ckdir / "step6" / SHARD.format(1))
    now, was = truncate_half(ckdir / "step4" / SHARD.format(0))
    # What grpo writes (recipes/grpo.py _log_sample, _write_eval_records): rows keyed by their optimizer step
    (run / "completions.jsonl").write_text("".join(json.dumps({"step": s, "prompt": "p", "completion": "c",
                                                               "reward": 1.0}) + "\n" for s in range(1, 7)))
    (run / "eval").mkdir()
    for s in (2, 4, 6):
        (run / "eval" / f"step{s}_completions.jsonl").write_text(json.dumps({"step": s, "index": 0}) + "\n")

    proc = launch(CONFIG, [f"output_dir={run}", *BASE], resume="latest", script=FAULTS,
                  env=cpu_env(FAULT_NAN_LR_AT_STEP="4"))
    out = proc.stdout
    assert (f"--resume: damaged checkpoints passed over (step6: {SHARD.format(1)} does not match its SHA-256 in the "
            f"manifest (same size, other bytes); step4: {SHARD.format(0)} is {now:,} bytes, its manifest says "
            f"{was:,}): resuming {ckdir / 'step2'}, the newest checkpoint that verifies") in out, out[-4000:]
    assert f"resumed from {ckdir / 'step2'}: step 2" in out
    resumed = {r["step"]: r["train/loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r.get("launch") == 2 and "train/loss" in r}
    reference = train_losses(base)
    assert sorted(resumed) == [3, 4]
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), f"step {step}"

    # The NaN update of step 4: one line, exit 3, nothing saved from it.
    assert proc.returncode == 3, out[-4000:]
    assert "Traceback" not in out
    lines = error_lines(out)
    assert len(lines) == 1 and lines[0].startswith("finetune: error: training diverged: the weights are not finite "
                                                   "after step 4 (NaN or inf in "), lines
    assert f"last complete checkpoint: {ckdir / 'step2'}" in lines[0]
    assert ckpt_utils.complete_checkpoints(ckdir) == [ckdir / "step2"] and not (ckdir / "step4").exists()
    assert not (run / "export").exists()

    # The abandoned lineage and the later rows: renamed, never deleted; latest is this lineage's newest.
    aside = run / "abandoned" / "launch2"
    assert f"--resume from step 2: what the run folder held of later steps is set aside in {aside}" in out
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step4", "step6"]
    assert (aside / "checkpoints" / "step4" / SHARD.format(0)).stat().st_size == now
    assert ckpt_utils.is_complete(aside / "checkpoints" / "step6")
    assert ckpt_utils.resolve_resume("latest", str(run))[0] == ckdir / "step2"
    assert rows_steps(run / "completions.jsonl") == [1, 2]
    assert rows_steps(aside / "completions.jsonl") == [3, 4, 5, 6]
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["step2_completions.jsonl"]
    assert sorted(p.name for p in (aside / "eval").iterdir()) == ["step4_completions.jsonl", "step6_completions.jsonl"]


def test_final_evaluation_that_is_not_finite_stops_before_the_last_save(base):
    """The final evaluation's loss decides (the other metrics may be NaN when they had nothing to measure): NaN or inf
    ends the run with :class:`TrainingDiverged` naming the last complete checkpoint; a finite loss passes."""
    from finetune.lifecycle.checkpoint import TrainState
    from finetune.training.trainer import require_finite

    require_finite({"eval/loss": 2.5, "eval/rewards/chosen": math.nan}, TrainState(step=6), base)
    for bad in (math.nan, math.inf):
        with pytest.raises(TrainingDiverged, match=rf"the final evaluation at step 6 is not finite \(eval/loss {bad}\); "
                                                    rf"nothing was saved or exported from this state; last complete "
                                                    rf"checkpoint: {base / 'checkpoints' / 'step6'}"):
            require_finite({"eval/loss": bad}, TrainState(step=6), base)


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_failed_export_check_moves_the_export_aside(base, tmp_path):
    """An export whose check fails (weights shifted after writing, ``tests/faults.py``) ends the launch with one line
    and exit status 4 (no traceback from any rank); the failed folder is moved aside as ``export.failed-step6`` with
    its ``export_check.json``, and the earlier export the launch had kept aside is back in ``export/``."""
    run = copy_of(base, tmp_path)
    earlier = run / "export"
    earlier.mkdir()
    (earlier / "finetune_export.json").write_text(json.dumps({"checkpoint": str(run / "checkpoints" / "step4"),
                                                              "step": 4}))
    proc = launch(CONFIG, [f"output_dir={run}", *BASE[:-1], "export=true"], resume="latest", script=FAULTS,
                  env=cpu_env(FAULT_EXPORT_NOISE="1.0"))
    out = proc.stdout
    assert proc.returncode == 4, out[-4000:]
    assert "Traceback" not in out
    failed = run / "export.failed-step6"
    assert error_lines(out) == [f"finetune: error: export check failed: exported logits differ from the engine's by "
                                f"{_diff(failed):.3g} (tolerance 0.0001); the export was moved aside to {failed}; the "
                                f"earlier export (export-step4) is back in export/"]
    assert json.loads((run / "export" / "finetune_export.json").read_text())["step"] == 4
    assert not (run / "export-step4").exists() and not (run / "export.partial").exists()
    assert json.loads((failed / "finetune_export.json").read_text())["step"] == 6
    assert (failed / "model.safetensors").is_file() and not (run / "export_check.json").exists()


def _diff(failed: Path) -> float:
    return json.loads((failed / "export_check.json").read_text())["max_abs_logit_diff"]


class _RunsCode:
    """Pickles as a call of ``os.system(command)``: what a crafted checkpoint file holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def rehash(ckpt: Path, name: str) -> None:
    """Record ``ckpt/name``'s new size and SHA-256 in the manifest and the manifest's in the ``COMPLETE`` marker:
    what someone who changed the file on purpose does, so that the manifest cannot see it."""
    import hashlib

    files = json.loads((ckpt / ckpt_utils.MANIFEST).read_text())["files"]
    data = (ckpt / name).read_bytes()
    write_manifest(ckpt, {**files, name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}})


def write_manifest(ckpt: Path, files: dict) -> None:
    """Replace ``ckpt``'s manifest by one listing ``files``, its SHA-256 recorded in the ``COMPLETE`` marker."""
    import hashlib

    manifest = json.loads((ckpt / ckpt_utils.MANIFEST).read_text())
    text = json.dumps({**manifest, "files": files})
    (ckpt / ckpt_utils.MANIFEST).write_text(text)
    meta = ckpt_utils.marker(ckpt)
    meta["manifest"]["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (ckpt / ckpt_utils.MARKER).write_text(json.dumps(meta))


def test_a_checkpoint_file_that_runs_code_is_refused_by_export_resume_and_every_load(base, tmp_path):
    """Issue 68 item 10: a checkpoint whose model states (and another whose RNG state) hold a pickle that calls
    ``os.system``, manifest and marker updated to match, runs nothing: ``finetune export`` and the resume's
    verification refuse it in one line naming the file, and every load of it (finetune's, and DeepSpeed's own
    ``torch.load(weights_only=False)`` under :func:`safe_load.weights_only`) raises instead of running it. Sound
    files load."""
    from finetune.errors import RunFailure
    from finetune.lifecycle import safe_load
    from finetune.lifecycle.export import export_checkpoint

    import torch

    run = copy_of(base, tmp_path)
    step4, step6 = run / "checkpoints" / "step4", run / "checkpoints" / "step6"
    ran = tmp_path / "ran"
    states = step6 / "mp_rank_00_model_states.pt"
    assert safe_load.code_in(states) == [] and safe_load.code_in(step6 / SHARD.format(0)) == []
    sound = safe_load.load(states)
    torch.save({**sound, "x": _RunsCode(f"touch {ran}")}, states)
    rehash(step6, states.name)
    rng = step4 / "rng_state_rank1.pt"
    assert safe_load.code_in(rng) == []
    torch.save({**safe_load.load(rng), "x": _RunsCode(f"touch {ran}")}, rng)
    rehash(step4, rng.name)
    assert ckpt_utils.size_problem(step6) is None and ckpt_utils.size_problem(step4) is None

    with pytest.raises(ConfigError) as refused:
        export_checkpoint(step6, tmp_path / "export")
    assert len(refused.value.problems) == 1 and "mp_rank_00_model_states.pt names posix.system" in \
        refused.value.problems[0] and "would run code" in refused.value.problems[0]
    assert not (tmp_path / "export").exists()
    with pytest.raises(ConfigError) as refused:
        resume_policy.verified(step6, fall_back=False)
    assert "mp_rank_00_model_states.pt names posix.system" in refused.value.problems[0]
    with pytest.raises(ConfigError) as refused:  # without a manifest the pickles are scanned all the same
        meta = ckpt_utils.marker(step4)
        del meta["manifest"]
        (step4 / ckpt_utils.MARKER).write_text(json.dumps(meta))
        resume_policy.verified(step4, fall_back=False)
    assert "rng_state_rank1.pt names posix.system" in refused.value.problems[0]
    assert resume_policy.verified(step6, fall_back=True) == run / "checkpoints" / "step2"
    for path in (states, rng):
        with pytest.raises(RunFailure, match=f"'{path.name}' is refused.*posix.system"):
            safe_load.load(path)
        with safe_load.weights_only(), pytest.raises(RunFailure, match="posix.system"):
            torch.load(path, weights_only=False)  # DeepSpeed's call
    assert not ran.exists()
    assert torch.load is not safe_load._forced and safe_load.load(step6 / SHARD.format(1))["optimizer_state_dict"]


def _inf_over_storages(path: Path, n: int = 64) -> None:
    """Write +inf (float32) over the first ``n`` bytes of every tensor storage of ``path`` in place (same size)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        spots = []
        for info in z.infolist():
            if "/data/" in info.filename and info.file_size >= n:
                with open(path, "rb") as f:
                    f.seek(info.header_offset + 26)
                    name_len, extra_len = struct.unpack("<HH", f.read(4))
                spots.append(info.header_offset + 30 + name_len + extra_len)
    with open(path, "r+b") as f:
        for at in spots:
            f.seek(at)
            f.write(struct.pack(f"<{n // 4}f", *[math.inf] * (n // 4)))


def test_export_of_a_checkpoint_with_infinite_weights_writes_nothing(base, tmp_path):
    """Issue 68 item 11: +inf written over 64 bytes of every storage of a ZeRO optimizer shard (the fp32 master
    weights; size unchanged): the export refuses it as damaged (its manifest), and with the manifest updated to match,
    refuses the non-finite weights; nothing is written either way. The sound checkpoint exports."""
    from finetune.lifecycle.export import export_checkpoint

    run = copy_of(base, tmp_path)
    step6 = run / "checkpoints" / "step6"
    shard = step6 / SHARD.format(0)
    size = shard.stat().st_size
    _inf_over_storages(shard)
    assert shard.stat().st_size == size
    with pytest.raises(ConfigError, match=f"'{step6}' is damaged .*{SHARD.format(0)} does not match its SHA-256"):
        export_checkpoint(step6, tmp_path / "export")
    rehash(step6, shard.name)
    with pytest.raises(ConfigError) as refused:
        export_checkpoint(step6, tmp_path / "export")
    assert "holds weights that are not finite: transformer.wte.weight (" in refused.value.problems[0]
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.partial").exists()
    assert (export_checkpoint(run / "checkpoints" / "step4", tmp_path / "export") / "model.safetensors").is_file()


def test_a_manifest_naming_files_outside_its_checkpoint_is_damaged(base, tmp_path):
    """Issue 68, by reading: manifest names are joined to the checkpoint folder; one that leaves it (``../``, an
    absolute path) makes the checkpoint damaged instead of being stat'ed and hashed."""
    run = copy_of(base, tmp_path)
    step6 = run / "checkpoints" / "step6"
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"x" * 10)
    for name in ("../../../elsewhere.bin", str(outside)):
        write_manifest(step6, {name: {"size": 10, "sha256": "0" * 64}})
        assert ckpt_utils.size_problem(step6) == (f"{ckpt_utils.MANIFEST} names '{name}', which is not a file inside "
                                                  f"the checkpoint (a manifest finetune writes lists the folder's own "
                                                  f"files only)")


def test_disk_full_at_the_manifest_write_is_one_line_and_leaves_no_temporary(tmp_path):
    """Issue 68, item 15: the disk filling up exactly when rank 0 writes ``manifest.json`` (the kernel's ENOSPC from
    ``/dev/full``, where the temporary manifest goes) raised an OSError, a traceback, and left ``.manifest.json.tmp``;
    it is one RunFailure line naming the folder and its free space, and nothing is left."""
    from finetune.errors import RunFailure

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    ck = tmp_path / "checkpoints" / "step2"
    ck.mkdir(parents=True)
    (ck / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    tmp = ck / f".{ckpt_utils.MANIFEST}.tmp"
    tmp.symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    with pytest.raises(RunFailure) as e:
        ckpt_utils.write_manifest(ck)
    line = str(e.value)
    assert "\n" not in line and f"writing '{ck / ckpt_utils.MANIFEST}' failed (OSError: [Errno 28] No space left " \
        f"on device" in line and f"GiB free in '{ck}'" in line, line
    assert sorted(p.name for p in ck.iterdir()) == ["mp_rank_00_model_states.pt"]
    assert not ckpt_utils.is_complete(ck)
