"""Breaks a cluster user met (issue 22), each tried the way the user tried it.

In process where the command runs in one process (``finetune doctor``, ``finetune plan``, ``finetune report``),
``finetune/run.py --check`` (one process, no model) where a launch refuses bad input before any model is built
(the launch runs the same :func:`finetune.preflight.validate.validate_run` before it starts the process group). The breaks
that need a training launch are asserted on runs other modules make anyway: the ZeRO-3 causal-LM sample
(``tests/test_lora.py``), the LoRA change on ``--resume`` (``tests/test_lora.py``), the torn ``metrics.jsonl``
before ``--resume`` (``tests/test_train.py``) and the ``mpirun`` exit status (``tests/test_launchers.py``,
extended).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import CONFIGS, EXPORT_STAND_INS, REPO, check_here

from finetune.lifecycle import report
from finetune.commands import doctor
from finetune.commands import plan as plan_cmd
from finetune.commands import report as report_cmd

SHIPPED = sorted((REPO / "finetune" / "recipes" / "configs").glob("*.yaml"))
# Shipped configs that name files a user brings: pointed at the shipped config-only model and data instead.
LOCAL = {"bert_large_mlm_wikitext2_zero3.yaml": [
    "model.path=data/models/bert-large-config", "model.tokenizer_path=data/models/bert-base-uncased-tokenizer",
    "model.init=scratch", "data.train_files=[data/wikitext2/test.parquet]",
    "data.validation_files=[data/wikitext2/validation.parquet]"],
    **EXPORT_STAND_INS}


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # run configs name repo-relative paths


@pytest.mark.parametrize("config", SHIPPED, ids=[c.stem for c in SHIPPED])
def test_doctor_passes_every_shipped_config(config, capsys, tmp_path):
    """Every shipped config (the user-path one pointed at shipped files) has no blocker, the data rows included:
    the data check reads the recipe's columns (sft: question/answer or messages), not ``data.text_column``."""
    code = doctor.main([str(config), f"output_dir={tmp_path / 'run'}", "output_root=", *LOCAL.get(config.name, [])])
    out = capsys.readouterr().out
    assert code == 0, out
    data_rows = [line for line in out.splitlines() if line.startswith("data ")]
    assert data_rows and all("  ok  " in line for line in data_rows), out
    assert "every check of a launch passes" in out


def test_doctor_data_row_names_the_recipes_missing_column(capsys, tmp_path):
    code = doctor.main([str(REPO / "finetune/recipes/configs/sft_gsm8k.yaml"), f"output_dir={tmp_path / 'run'}",
                        "output_root=", "data.prompt_column=prompt"])
    out = capsys.readouterr().out
    assert code == 2
    assert "no column 'prompt', which recipe sft reads" in out, out


@pytest.mark.parametrize(("argv", "expected"), [
    (["doctor", "--world-size", "-3"], "--world-size: must be >= 1 (the ranks of the planned launch), got -3"),
    (["doctor", "--world-size", "0"], "--world-size: must be >= 1 (the ranks of the planned launch), got 0"),
    (["plan", "--gpu-memory", "0GiB"], "--gpu-memory/--cpu-memory: '0GiB' is no memory at all"),
    (["plan", "--cpu-memory", "0"], "--gpu-memory/--cpu-memory: '0' is no memory at all"),
])
def test_absurd_numbers_are_one_line_and_exit_2(argv, expected, capsys):
    command, *flags = argv
    main = {"doctor": doctor.main, "plan": plan_cmd.main}[command]
    code = main([str(CONFIGS / "tiny_gpt.yaml"), *flags])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"finetune: error: {expected}"), (out, err)
    assert out == ""


def _check(config: Path, overrides: list[str], capsys):
    """``finetune/run.py --config config overrides --check`` in this process (no model): ``.returncode`` and
    ``.stdout`` (everything printed)."""
    code, out = check_here(["--config", config, *overrides], capsys)
    return SimpleNamespace(returncode=code, stdout=out)


def _error_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("finetune: error:")]


def test_seq_cls_label_types_that_differ_between_files_are_one_line(tmp_path, capsys):
    """int labels in the training file, string labels in the validation file: refused before any model, in one
    line naming both files (the launch used to crash sorting the labels)."""
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pq.write_table(pa.table({"text": ["good film", "bad film", "fine"], "label": [1, 0, 1]}), train)
    pq.write_table(pa.table({"text": ["great", "awful"], "label": ["1", "0"]}), val)
    proc = _check(CONFIGS / "parity_cls.yaml", [f"output_dir={tmp_path / 'run'}", f"data.train_files=[{train}]",
                                                f"data.validation_files=[{val}]"], capsys)
    errors = _error_lines(proc.stdout)
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-3000:]
    assert f"int labels in '{train}' but string labels in '{val}'" in errors[0], errors


def test_categorical_labels_get_a_hint_that_fits(tmp_path):
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    train = tmp_path / "train.parquet"
    labels = pa.array(["pos", "neg", "pos"]).dictionary_encode()
    pq.write_table(pa.table({"text": ["good", "bad", "fine"], "label": labels}), train, use_dictionary=True,
                   store_schema=True)
    assert pa.types.is_dictionary(pq.read_schema(train).field("label").type)
    cfg = load_run_config(CONFIGS / "parity_cls.yaml", [f"output_dir={tmp_path / 'run'}",
                                                        f"data.train_files=[{train}]", f"data.validation_files=[{train}]"])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, 1, True)
    line = next(p for p in err.value.problems if "label" in p)
    assert "cast the column to string or int" in line and "1.0 -> 1" not in line, line


@pytest.mark.parametrize(("config", "column", "make"), ids=["gpt_clm", "sft"], argvalues=[
    (CONFIGS / "tiny_gpt.yaml", "text", lambda bad: {"text": bad}),
    (REPO / "finetune/recipes/configs/sft_gsm8k.yaml", "question",
     lambda bad: {"question": bad, "answer": pa.array(["a", "b", "c"])}),
])
def test_a_string_cell_that_is_not_utf8_is_one_line_naming_file_row_column(config, column, make, tmp_path, capsys):
    """Bytes ``\\xff\\xfe`` in a parquet string column (other tools can write them): refused before any model,
    naming the file, the row and the column (the launch used to fail in tokenization with four tracebacks)."""
    bad = pa.array([b"a fine row of text", b"also fine", b"bad \xff\xfe bytes"], pa.binary()).view(pa.string())
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.table(make(bad)), f)
    proc = _check(config, [f"output_dir={tmp_path / 'run'}", "output_root=", f"data.train_files=[{f}]"], capsys)
    errors = _error_lines(proc.stdout)
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-3000:]
    assert f"'{f}' row 2 column '{column}' is not valid UTF-8 text" in errors[0], errors


def _metrics(run: Path, text: bytes) -> Path:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(text)
    return run


def test_report_draws_a_damaged_metrics_file_and_counts_what_it_skipped(capsys, tmp_path):
    rows = b"".join(json.dumps({"step": s, "launch": 1, "train/loss": 5.0 - s / 10, "train/lr": 1e-3}).encode() + b"\n"
                    for s in range(1, 6))
    run = _metrics(tmp_path / "run", rows + b"\xff\xfe garbage\n" + b'{"step": 6, "launch": 1, "train/lo')
    code = report_cmd.main([str(run)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 line(s) skipped" in err and (run / "report.png").stat().st_size > 10_000
    got = report.read_run(run)
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4, 5]


def test_report_skips_rows_of_the_wrong_shape(tmp_path):
    run = _metrics(tmp_path / "run", b'{"step": 1, "launch": 1, "train/loss": 2.0}\n[1, 2]\n'
                                     b'{"step": "x", "train/loss": 1.0}\n{"step": 2, "train/loss": "nan?"}\n')
    skipped: dict[str, int] = {}
    got = report.read_run(run, skipped)
    assert got["train/loss"] == [(1, 2.0)] and skipped == {str(run): 3}

