"""Recipe ``seq_cls`` on the shipped SST-2 slice: real 2-rank runs at ZeRO 0 and 3 (fp32 CPU), export through
``transformers.pipeline``, exact resume, int and string labels, and every bad-label case as one error line.

Launch budget: 3 launches. ZeRO 3 (string labels, as shipped; 120 steps) carries accuracy, eval artefacts, the
pipeline export and is resumed from its step-100 checkpoint; ZeRO 0 runs on a copy of the data with int labels
(120 steps, evaluated at steps 0 and 120 only, no export). A ZeRO-2 run (measured 0.71 too) left the suite to
keep it within its 25-minute budget. Measured (seed 42,
global batch 32, 2 ranks): dev accuracy 0.71 after 120 steps (ZeRO 0, 2, 3) and 0.65 after 60, against a
majority class of 0.509 (444 of 872 positive); the asserted margin is 0.12. (80-step runs, whose LR decays
sooner, reached only 0.54.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, launch, ok, read_metrics, refused_here, train_losses

CONFIG = REPO / "finetune/recipes/configs/seq_cls_sst2.yaml"
TRAIN, DEV = REPO / "data/sst2/train.parquet", REPO / "data/sst2/validation.parquet"
MAJORITY = 444 / 872
MARGIN = 0.12
STEPS = {"zero3": ["train.max_steps=120", "train.eval_every=60", "train.save_every=100", "train.log_every=1"],
         "zero0": ["train.max_steps=120", "train.eval_every=0", "train.log_every=1", "export=false"],
         "zero2": ["train.max_steps=120", "train.eval_every=0", "train.log_every=1", "export=false"]}
EVAL_STEPS = {"zero3": [0, 60, 120], "zero0": [0, 120], "zero2": [0, 120]}


def _dev_majority() -> float:
    labels = pq.read_table(DEV, columns=["label"]).column("label").to_pylist()
    return max(labels.count(v) for v in set(labels)) / len(labels)


@pytest.fixture(scope="module")
def int_label_files(tmp_path_factory) -> tuple[Path, Path]:
    """The shipped slice with ``label`` as int64 (0 = negative, 1 = positive)."""
    root = tmp_path_factory.mktemp("int_labels")
    out = []
    for src in (TRAIN, DEV):
        t = pq.read_table(src)
        ids = [{"negative": 0, "positive": 1}[v] for v in t.column("label").to_pylist()]
        dst = root / src.name
        pq.write_table(pa.table({"text": t.column("text"), "label": pa.array(ids, pa.int64())}), dst)
        out.append(dst)
    return out[0], out[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, int_label_files):
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("seq_cls")
    extra = {"zero3": [], "zero2": [],
             "zero0": [f"data.train_files=[{int_label_files[0]}]", f"data.validation_files=[{int_label_files[1]}]"]}

    def get(stage: str) -> Path:
        if stage not in cache:
            out = root / stage
            ok(launch(CONFIG, [f"output_dir={out}", f"deepspeed=ds_configs/{stage}.json", *STEPS[stage],
                               *extra[stage]]))
            cache[stage] = out
        return cache[stage]

    return get


# suite budget: the ZeRO-0 run (int labels) is extended; int labels' order: test_label_order_pairs_and_metrics
@pytest.mark.parametrize("stage", ["zero3", pytest.param("zero0", marks=pytest.mark.extended)])
def test_beats_majority_class(runs, stage):
    assert _dev_majority() == pytest.approx(MAJORITY)
    run = runs(stage)
    evals = {r["step"]: r for r in read_metrics(run) if "eval/accuracy" in r}
    assert sorted(evals) == EVAL_STEPS[stage], "eval_on_start gives a step-0 evaluation"
    last = EVAL_STEPS[stage][-1]
    final = evals[last]
    assert final["eval/accuracy"] >= MAJORITY + MARGIN, final
    assert final["eval/loss"] < evals[0]["eval/loss"]
    assert 0.0 < final["eval/f1"] <= 1.0 and 0.0 < final["eval/macro_f1"] <= 1.0
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, last + 1)) and all(math.isfinite(v) for v in losses.values())
    # labels sorted: negative/positive (strings) or 0/1 (ints), in the run folder's model config
    config = json.loads((run / "model_config" / "config.json").read_text())
    assert config["id2label"] == ({"0": "0", "1": "1"} if stage == "zero0" else {"0": "negative", "1": "positive"})
    meta = json.loads((run / "meta.json").read_text())
    assert meta["precision"]["precision"] == "fp32" and "auto" in meta["precision"]["why"]


def test_confusion_matrix_artefacts(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs("zero3")
    cm = json.loads((run / "eval" / "step120_confusion_matrix.json").read_text())
    assert cm["labels"] == ["negative", "positive"]
    m = torch.tensor(cm["matrix"])
    assert m.shape == (2, 2) and m.sum().item() == 872 and m[1].sum().item() == 444
    final = [r for r in read_metrics(run) if r["step"] == 120 and "eval/accuracy" in r][0]
    assert final["eval/accuracy"] == pytest.approx(m.diag().sum().item() / 872)
    tp, fp, fn = m[1, 1].item(), m[0, 1].item(), m[1, 0].item()
    assert final["eval/f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert "eval/confusion_matrix" in acc.Tags()["images"]
    assert [e.step for e in acc.Images("eval/confusion_matrix")] == [0, 60, 120]


def test_export_pipeline_returns_label_names(runs):
    from transformers import pipeline

    run = runs("zero3")
    clf = pipeline("text-classification", model=str(run / "export"), device="cpu")
    texts = ["a gorgeous , witty , seductive movie .", "a dull , tedious and pointless mess ."]
    out = clf(texts)
    assert [o["label"] for o in out] == ["positive", "negative"], out
    # the export gives the engine's logits on the saved fixed batch
    check = json.loads((run / "export_check.json").read_text())  # a summary of the engine's logits
    with torch.no_grad():
        logits = clf.model(**{k: torch.tensor(v) for k, v in check["inputs"].items()}).logits
    assert check["finite"] and check["max_abs_logit_diff"] <= 1e-5
    assert logits.reshape(-1)[:8].tolist() == pytest.approx(check["engine_logits_head"], abs=1e-5)


def test_resume_is_exact(runs, tmp_path):
    full = runs("zero3")
    out = tmp_path / "resumed"
    ok(launch(CONFIG, [f"output_dir={out}", "deepspeed=ds_configs/zero3.json", *STEPS["zero3"], "export=false"],
              resume=str(full / "checkpoints" / "step100")))
    resumed, reference = train_losses(out), train_losses(full)
    assert sorted(resumed) == list(range(101, 121))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), f"step {step}"
    evals = [r for r in read_metrics(out) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [120], "no step-0 eval when resuming"
    ref = [r for r in read_metrics(full) if r["step"] == 120 and "eval/accuracy" in r][0]
    assert evals[0]["eval/loss"] == pytest.approx(ref["eval/loss"], rel=1e-6)
    assert evals[0]["eval/accuracy"] == ref["eval/accuracy"]


# ---------------------------------------------------------------------------------------------------------------
# Bad labels: one error line, exit 2, nothing built (single process, no launcher)
# ---------------------------------------------------------------------------------------------------------------

def _write(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _one_problem(*overrides: str) -> str:
    """The single problem ``validate_run`` reports (what the CLI prints as ``finetune: error: ...``)."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    cfg = load_run_config(CONFIG, ["output_dir=/nonexistent/run", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, world_size=2, on_cpu=True)
    assert len(err.value.problems) == 1, err.value.problems
    return err.value.problems[0]


def _one_error(tmp_path: Path, capsys, *overrides: str) -> str:
    """The launch's ``finetune: error:`` line (its ``main`` in this process: ``conftest.refused_here``)."""
    out = tmp_path / "run"
    code, printed = refused_here(["--config", CONFIG, f"output_dir={out}", *overrides], capsys)
    errs = [line for line in printed.splitlines() if line.startswith("finetune: error:")]
    assert code == 2 and len(errs) == 1, printed[-3000:]
    assert not out.exists() or not any(out.iterdir()), "nothing may be written before the error"
    return errs[0]


def test_bad_labels_are_one_line_errors(tmp_path, capsys):
    """The launch's case (exit 2, one line, nothing written; its ``main`` in this process) once; the other cases
    through ``validate_run`` itself."""
    texts = pa.array(["good", "bad", "fine"])
    unseen = _write(tmp_path / "unseen.parquet", text=texts, label=pa.array(["positive", "neutral", "negative"]))
    err = _one_error(tmp_path, capsys, f"data.validation_files=[{unseen}]")
    assert str(unseen) in err and "'label'" in err and "'neutral'" in err and "no training file" in err

    nulls = _write(tmp_path / "nulls.parquet", text=texts, label=pa.array(["positive", None, "negative"]))
    err = _one_problem(f"data.train_files=[{nulls}]")
    assert str(nulls) in err and "'label'" in err and "missing (null)" in err and "row 1" in err

    floats = _write(tmp_path / "floats.parquet", text=texts, label=pa.array([0.5, 1.0, 0.0]))
    err = _one_problem(f"data.train_files=[{floats}]")
    assert str(floats) in err and "'label'" in err and "float" in err and "0.5" in err

    stars = _write(tmp_path / "stars.parquet", text=texts, stars=pa.array([5, 1, 3]))
    err = _one_problem(f"data.train_files=[{stars}]")
    assert str(stars) in err and "no label column 'label'" in err and "columns: text, stars" in err

    err = _one_problem("model.config_overrides={num_labels: 3}")
    assert "model.config_overrides.num_labels: 3" in err and "2 labels" in err


def test_pretrained_without_head_logs_new_weights_in_one_line(tmp_path, capfd):
    """A plain BERT checkpoint (masked-LM weights, no classifier) loads for seq_cls: the head is initialised and
    named in one log line; transformers' per-weight warnings stay quiet."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertConfig, BertForMaskedLM

    from finetune.engine.model import load_pretrained
    from finetune.logs import logger

    plain = tmp_path / "plain-bert"
    BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(plain)
    config = AutoConfig.from_pretrained(plain)
    config.num_labels = 3
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        model = load_pretrained(AutoModelForSequenceClassification, str(plain), config)
    finally:
        logger.remove(sink)
    assert model.classifier.out_features == 3
    new = [line for line in lines if "newly initialised" in line]
    assert len(new) == 1 and "classifier.weight" in new[0] and "classifier.bias" in new[0], lines
    assert "bert.encoder" not in new[0], "only the head is new"
    err = capfd.readouterr().err
    assert "newly initialized" not in err.lower() and "TRAIN this model" not in err, err


def test_label_order_pairs_and_metrics(tmp_path):
    """Int labels sort numerically (2 < 10), sentence pairs are tokenized as pairs, F1 from the confusion counts."""
    from transformers import AutoTokenizer

    from finetune.config import load_run_config
    from finetune.recipes import seq_cls

    f = _write(tmp_path / "pairs.parquet", premise=pa.array(["a cat sits", "dogs run", "it rains"]),
               hypothesis=pa.array(["an animal sits", "nobody runs", "it is wet"]), label=pa.array([10, 2, 10]))
    cfg = load_run_config(CONFIG, [f"data.train_files=[{f}]", "data.text_column=premise",
                                   "data.text_pair_column=hypothesis"])
    assert seq_cls.label_names(cfg.data) == [2, 10]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "data/models/bert-base-uncased-tokenizer")
    out = seq_cls.tokenize_function(tokenizer, cfg.data)(pq.read_table(f).to_pydict())
    assert out["labels"] == [1, 0, 1]
    assert tokenizer.decode(out["input_ids"][0]) == "[CLS] a cat sits [SEP] an animal sits [SEP]"
    assert set(out["token_type_ids"][0]) == {0, 1}

    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([1, 0, 1, 0, -100])  # the last row is an eval filler: not counted
    counts = seq_cls.confusion_counts(logits, labels)
    assert counts.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    metrics, artefacts = seq_cls.eval_report(counts, type("C", (), {"id2label": {0: "neg", 1: "pos"}})())
    assert metrics == {"macro_f1": pytest.approx(0.5), "f1": pytest.approx(0.5)}
    assert artefacts["confusion_matrix"] == {"labels": ["neg", "pos"], "matrix": [[1, 1], [1, 1]]}
