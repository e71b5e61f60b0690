"""Bad inputs: each gives one clear error line naming the file or key, exits non-zero, and trains nothing.

The single-rank cases run the launch's entry point (``finetune/run.py``'s ``main``) in the test's process
(``conftest.refused_here``: no interpreter start) to stay fast; the several-problems case runs ``python
finetune/run.py`` itself, and one case goes through the deepspeed launcher with 2 ranks to show the launch as a
whole exits non-zero.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import launch, refused_here, run_python

BASE = ["--config", "tests/configs/tiny_gpt.yaml"]


def errors_of(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("finetune: error:")]


def expect_one_error(args: list[str], *needles: str, out: Path, capsys) -> str:
    code, printed = refused_here([*BASE, f"output_dir={out}", *args], capsys)
    errs = [line for line in printed.splitlines() if line.startswith("finetune: error:")]
    assert code == 2, printed[-3000:]
    assert len(errs) == 1, printed[-3000:]
    for needle in needles:
        assert needle in errs[0], errs[0]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    return errs[0]


@pytest.fixture
def bad_files(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    wrong = tmp_path / "wrong_column.parquet"
    pq.write_table(pa.table({"content": ["a b c"], "label": [1]}), wrong)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all\n" * 10)
    return {"empty": empty, "wrong": wrong, "garbage": garbage}


def test_missing_model_folder(tmp_path, capsys):
    expect_one_error(["model.path=/nonexistent/tiny-gpt2"], "model.path", "/nonexistent/tiny-gpt2",
                     "does not exist", out=tmp_path / "run", capsys=capsys)


def test_missing_text_column_lists_columns(tmp_path, bad_files, capsys):
    expect_one_error([f"data.train_files=[{bad_files['wrong']}]"], "data.train_files", str(bad_files["wrong"]),
                     "no column 'text'", "columns: content, label", out=tmp_path / "run", capsys=capsys)


def test_empty_parquet(tmp_path, bad_files, capsys):
    expect_one_error([f"data.train_files=[{bad_files['empty']}]"], str(bad_files["empty"]), "is empty (0 rows)",
                     out=tmp_path / "run", capsys=capsys)


def test_unreadable_parquet(tmp_path, bad_files, capsys):
    expect_one_error([f"data.validation_files=[{bad_files['garbage']}]"], "data.validation_files",
                     str(bad_files["garbage"]), "not a readable parquet file", out=tmp_path / "run", capsys=capsys)


def test_unknown_key_suggests_nearest(tmp_path, capsys):
    expect_one_error(["train.learning_rate=1e-4"], "unknown key 'train.learning_rate'", "did you mean 'lr'",
                     out=tmp_path / "run", capsys=capsys)


def test_batch_size_contradiction(tmp_path, capsys):
    expect_one_error(["ds.train_batch_size=100", "train.micro_batch_size=4", "train.gradient_accumulation_steps=3"],
                     "train_batch_size=100", "train.micro_batch_size=4", "train.gradient_accumulation_steps=3",
                     "data-parallel size=1", out=tmp_path / "run", capsys=capsys)


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    expect_one_error(["--resume"], "--resume", "no complete checkpoint", out=tmp_path / "run", capsys=capsys)


def test_resume_of_incomplete_checkpoint_is_refused(tmp_path, capsys):
    """A checkpoint folder without the COMPLETE marker (interrupted save) is never loaded."""
    half = tmp_path / "run" / "checkpoints" / "step8"
    half.mkdir(parents=True)
    (half / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    expect_one_error(["--resume", str(half)], "is incomplete", out=tmp_path / "run2", capsys=capsys)


def test_several_problems_reported_together(tmp_path, bad_files):
    proc = run_python(["finetune/run.py", *BASE, f"output_dir={tmp_path}/run", "model.path=/nope",
                       f"data.train_files=[{bad_files['empty']}]", "train.lr=-1"], timeout=180)
    assert proc.returncode == 2
    errs = "\n".join(errors_of(proc))
    assert "model.path" in errs and "is empty" in errs and "train.lr: must be > 0" in errs


def test_two_rank_launch_exits_nonzero_before_training(tmp_path):
    proc = launch("tests/configs/tiny_gpt.yaml", [f"output_dir={tmp_path}/run", "model.path=/nonexistent"],
                  nproc=2, timeout=300)
    assert proc.returncode != 0
    assert len(errors_of(proc)) == 1 and "model.path" in errors_of(proc)[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("error", "rank", "status", "printed"), [
    ("config", "0", 2, ["finetune: error: a", "finetune: error: b"]),
    ("config", "1", 2, []),  # every rank meets the same input: rank 0 prints it
    ("diverged", "0", 3, ["finetune: error: training diverged"]),
    ("run", "1", 4, ["finetune: error: rank 1: checkpoint: writing failed"]),  # the failing rank names itself
    ("stop", "1", 128 + 15, ["finetune: rank 1 stopped by SIGTERM before training started"]),
])
def test_each_kind_of_failure_has_its_exit_status_and_printer(error, rank, status, printed, capsys, monkeypatch):
    from finetune import errors

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(errors, "RANK0_REPORT_GRACE_S", 0.0)
    e = {"config": errors.ConfigError(["a", "b"]), "diverged": errors.TrainingDiverged("training diverged"),
         "run": errors.RunFailure("checkpoint: writing failed"), "stop": errors.StopRequested(15)}[error]
    assert errors.report(e) == status
    assert capsys.readouterr().err.splitlines() == printed
    with pytest.raises(TypeError):
        errors.report(ValueError("a crash is not reported here"))
