"""Recipe ``qa`` (extractive question answering) on the shipped SQuAD 2.0 slice.

In process (default suite): each question's windows and their start/end labels equal transformers' ``run_qa.py``
``prepare_train_features`` (transcribed below) on every training question; the answer chosen from a question's
windows equals ``run_qa.py``'s ``utils_qa.postprocess_qa_predictions`` (transcribed below) on random logits, with and
without the null answer; the SQuAD answer normalization on known cases; every bad input as one line naming file, row
and column; ``finetune bundle``'s guess.

Launched (extended: 3 launches of ``tests/configs/parity_qa.yaml``, 2 CPU ranks, micro-batch 4 x accumulation 2,
windows of 64 tokens overlapping by 16): ZeRO 0 and ZeRO 3 against one device on the whole global batch, the
reference running every window alone through the plain model with transformers' own QA loss (losses 1e-5, grad norms
1e-4 at ZeRO 0 and 1e-5 at ZeRO 3, exported weights 1e-5 but for the two biases whose gradient is 0); the step-0 exact match and F1 summed over both ranks equal
to the transcribed ``run_qa.py`` pipeline (features, post-processing, SQuAD 2.0 scores) on the whole validation split;
a resume from step 3 that repeats steps 4-6; the export through ``AutoModelForQuestionAnswering`` and the same
post-processing (transformers 5 removed ``pipeline("question-answering")``).
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import (REPO, assert_one_device, assert_resume_repeats, cpu_env, lazy_runs, one_refusal, read_metrics,
                      refusals)

CONFIG = REPO / "tests" / "configs" / "parity_qa.yaml"
TRAIN, DEV = REPO / "data" / "squad_v2" / "train.parquet", REPO / "data" / "squad_v2" / "validation.parquet"
TOKENIZER = REPO / "data" / "models" / "bert-base-uncased-tokenizer"


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _data_cfg(*overrides: str):
    from finetune.config import load_run_config

    return load_run_config(CONFIG, list(overrides)).data


def run_qa_features(tokenizer, examples: dict, max_len: int, stride: int, train: bool) -> dict:
    """transformers' ``examples/pytorch/question-answering/run_qa.py``: ``prepare_train_features`` (``train``) or
    ``prepare_validation_features``, as written there (question first, no padding)."""
    examples["question"] = [q.lstrip() for q in examples["question"]]
    tokenized = tokenizer(examples["question"], examples["context"], truncation="only_second", max_length=max_len,
                          stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    sample_mapping = tokenized.pop("overflow_to_sample_mapping")
    if not train:
        tokenized["example_id"] = []
        for i in range(len(tokenized["input_ids"])):
            sequence_ids = tokenized.sequence_ids(i)
            tokenized["example_id"].append(examples["id"][sample_mapping[i]])
            tokenized["offset_mapping"][i] = [(o if sequence_ids[k] == 1 else None)
                                              for k, o in enumerate(tokenized["offset_mapping"][i])]
        return tokenized
    offset_mapping = tokenized.pop("offset_mapping")
    tokenized["start_positions"], tokenized["end_positions"], tokenized["sample"] = [], [], []
    for i, offsets in enumerate(offset_mapping):
        input_ids = tokenized["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        sequence_ids = tokenized.sequence_ids(i)
        sample_index = sample_mapping[i]
        tokenized["sample"].append(sample_index)
        answers = examples["answers"][sample_index]
        if len(answers["answer_start"]) == 0:
            tokenized["start_positions"].append(cls_index)
            tokenized["end_positions"].append(cls_index)
        else:
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            token_start_index = 0
            while sequence_ids[token_start_index] != 1:
                token_start_index += 1
            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != 1:
                token_end_index -= 1
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                tokenized["start_positions"].append(cls_index)
                tokenized["end_positions"].append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                tokenized["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                tokenized["end_positions"].append(token_end_index + 1)
    return tokenized


def run_qa_postprocess(contexts: list[str], features: list[list[int]], offsets: list, start_logits: list,
                       end_logits: list, version_2: bool, n_best_size: int = 20, max_answer_length: int = 30,
                       null_score_diff_threshold: float = 0.0) -> list[str]:
    """``utils_qa.postprocess_qa_predictions`` as written there (numpy arg-sorts; ``features[e]``: the feature
    indices of example ``e``), returning the predictions in example order."""
    out = []
    for example_index, context in enumerate(contexts):
        min_null_prediction = None
        prelim_predictions = []
        for feature_index in features[example_index]:
            start = np.asarray(start_logits[feature_index])
            end = np.asarray(end_logits[feature_index])
            offset_mapping = offsets[feature_index]
            feature_null_score = start[0] + end[0]
            if min_null_prediction is None or min_null_prediction["score"] > feature_null_score:
                min_null_prediction = {"offsets": (0, 0), "score": feature_null_score, "start_logit": start[0],
                                       "end_logit": end[0]}
            start_indexes = np.argsort(start)[-1: -n_best_size - 1: -1].tolist()
            end_indexes = np.argsort(end)[-1: -n_best_size - 1: -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    if (start_index >= len(offset_mapping) or end_index >= len(offset_mapping)
                            or offset_mapping[start_index] is None or offset_mapping[end_index] is None):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > max_answer_length:
                        continue
                    prelim_predictions.append({"offsets": (offset_mapping[start_index][0],
                                                           offset_mapping[end_index][1]),
                                               "score": start[start_index] + end[end_index],
                                               "start_logit": start[start_index], "end_logit": end[end_index]})
        if version_2:
            prelim_predictions.append(min_null_prediction)
            null_score = min_null_prediction["score"]
        predictions = sorted(prelim_predictions, key=lambda x: x["score"], reverse=True)[:n_best_size]
        if version_2 and not any(p["offsets"] == (0, 0) for p in predictions):
            predictions.append(min_null_prediction)
        for pred in predictions:
            o = pred.pop("offsets")
            pred["text"] = context[o[0]: o[1]]
        if len(predictions) == 0 or (len(predictions) == 1 and predictions[0]["text"] == ""):
            predictions.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        if not version_2:
            out.append(predictions[0]["text"])
            continue
        i = 0
        while predictions[i]["text"] == "":
            i += 1
        best = predictions[i]
        score_diff = null_score - best["start_logit"] - best["end_logit"]
        out.append("" if score_diff > null_score_diff_threshold else best["text"])
    return out


def test_windows_and_labels_are_run_qas():
    """Every training question's windows, in order, are ``run_qa.py``'s features: the same token ids, token types
    and start/end labels (answers outside a window and unanswerable questions at [CLS])."""
    from finetune.recipes.qa import tokenize_function

    data_cfg = _data_cfg()
    tok = _tokenizer()
    rows = pq.read_table(TRAIN).to_pydict()
    got = tokenize_function(tok, data_cfg)(dict(rows))
    want = run_qa_features(tok, dict(rows), data_cfg.max_seq_len, data_cfg.doc_stride, train=True)
    assert len(got["input_ids"]) == len(rows["question"])
    w = 0
    for r in range(len(rows["question"])):
        at = 0
        for k, n in enumerate(got["window_lengths"][r]):
            assert want["sample"][w] == r
            assert got["input_ids"][r][at:at + n] == want["input_ids"][w]
            assert got["token_type_ids"][r][at:at + n] == want["token_type_ids"][w]
            assert (got["start_positions"][r][k], got["end_positions"][r][k]) == \
                (want["start_positions"][w], want["end_positions"][w])
            at, w = at + n, w + 1
    assert w == len(want["input_ids"])
    several = sum(len(x) > 1 for x in got["window_lengths"])
    inside = sum(s > 0 for x in got["start_positions"] for s in x)
    assert several > 100 and inside > 100  # windows and labelled spans are exercised


@pytest.mark.parametrize("version_2", [False, True])
def test_answers_are_run_qas_postprocessing(version_2):
    """:func:`finetune.recipes.qa.predict` on random logits (with the padding at the float32 minimum, as
    ``span_logits`` gives them) picks ``postprocess_qa_predictions``'s answer for every validation question."""
    from finetune.recipes.qa import make_collator, predict, tokenize_function

    data_cfg = _data_cfg()
    tok = _tokenizer()
    rows = pq.read_table(DEV).to_pydict()
    enc = tokenize_function(tok, data_cfg)(dict(rows))
    batch = make_collator(tok, data_cfg)([{k: enc[k][i] for k in enc} for i in range(len(rows["question"]))])
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(batch["input_ids"].shape, generator=gen) * 3
    end = torch.randn(batch["input_ids"].shape, generator=gen) * 3
    start[:, 0] += 7  # [CLS] about as likely as the best span: some questions get the null answer, some a span
    end[:, 0] += 7
    pad = batch["attention_mask"] == 0
    start, end = start.masked_fill(pad, torch.finfo(torch.float32).min), end.masked_fill(pad, torch.finfo(torch.float32).min)
    feats = run_qa_features(tok, dict(rows), data_cfg.max_seq_len, data_cfg.doc_stride, train=False)
    by_example = collections.defaultdict(list)
    for i, e in enumerate(feats["example_id"]):
        by_example[rows["id"].index(e)].append(i)
    lengths = [len(x) for x in feats["input_ids"]]
    want = run_qa_postprocess(rows["context"], [by_example[e] for e in range(len(rows["id"]))],
                              feats["offset_mapping"], [start[i, :n].numpy() for i, n in enumerate(lengths)],
                              [end[i, :n].numpy() for i, n in enumerate(lengths)], version_2)
    got = []
    for r in range(len(rows["id"])):
        at = (batch["window_row"] == r).nonzero().flatten()
        got.append(predict(start[at], end[at], batch["offsets"][at], rows["context"][r], with_null=version_2))
    assert got == want
    assert len(set(got)) > 50 and (0 < got.count("") < 150 if version_2 else "" not in got)


def test_short_windows_run_at_their_own_width():
    """A micro-batch whose short windows would be mostly padding runs them as a second, narrower pass: the same
    logits on every real token as one pass over the whole micro-batch, the float32 minimum on the padding."""
    from transformers import BertConfig, BertForQuestionAnswering

    from finetune.recipes.common.widths import width_groups
    from finetune.recipes.qa import span_logits

    assert width_groups([256, 256, 100]) == [([0, 1], 256), ([2], 104)]
    assert width_groups([256, 250, 240]) == [([0, 1, 2], 256)]  # would save under 10% of the positions: one pass
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=32)).eval()
    mask = torch.zeros(3, 40, dtype=torch.long)
    for i, n in enumerate([40, 3, 40]):
        mask[i, :n] = 1
    batch = {"input_ids": torch.randint(1, 50, (3, 40)) * mask, "attention_mask": mask,
             "token_type_ids": torch.zeros_like(mask)}
    with torch.no_grad():
        start, end = span_logits(model, batch)
        whole = model(**batch)
    real = mask.bool()
    torch.testing.assert_close(start[real], whole.start_logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end[real], whole.end_logits[real], rtol=1e-5, atol=1e-5)
    assert (start[~real] == torch.finfo(torch.float32).min).all() and (end[~real] == start[~real]).all()


def test_squad_answer_comparison():
    """The official SQuAD 2.0 script's normalization and scores on known cases."""
    from finetune.recipes.qa import normalize_answer, scores

    assert normalize_answer("The  Norman, Conquest!") == "norman conquest"
    assert scores(["Denmark, Iceland and Norway"], "Iceland and Norway") == (0, pytest.approx(6 / 7))
    assert scores(["the 10th century", "10th"], "10th") == (1, 1.0)
    assert scores([], "") == (1, 1.0) and scores([], "Rollo") == (0, 0.0)
    assert scores(["Rollo"], "") == (0, 0.0)


def test_bad_rows_are_one_line_errors(tmp_path):
    ctx = ["Rollo led the Norse.", "The Rhine flows north.", "Cologne is big."]
    q = ["Who led?", "Where?", "What is big?"]

    def write(name: str, **cols) -> Path:
        pq.write_table(pa.table({"question": q, "context": ctx, **cols}), tmp_path / name)
        return tmp_path / name

    def answers(*items):
        return pa.array([{"text": t, "answer_start": s} for t, s in items],
                        type=pa.struct([("text", pa.list_(pa.string())), ("answer_start", pa.list_(pa.int64()))]))

    moved = write("moved.parquet", answers=answers((["Rollo"], [0]), (["north"], [3]), (["Cologne"], [0])))
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {moved}]")
    assert str(moved) in err and "row 1 column 'answers'" in err and "'north' at answer_start 3" in err

    counts = write("counts.parquet", answers=answers((["Rollo"], [0]), (["Rhine"], []), (["Cologne"], [0])))
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {counts}]")
    assert "row 1 column 'answers' has 1 answer texts and 0 answer_start" in err

    none = write("none.parquet", answers=answers((["Rollo"], [0]), ([], []), (["Cologne"], [0])))
    err = one_refusal(CONFIG, f"data.train_files=[{none}]", "data.validation_files=[]", "data.version_2_with_negative=false")
    assert str(none) in err and "row 1" in err and "version_2_with_negative" in err

    flat = write("flat.parquet", answers=pa.array(["Rollo", "north", "Cologne"]))
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {flat}]")
    assert "'answers' holds string" in err and "SQuAD's form" in err

    pq.write_table(pa.table({"question": ["Who led?", " ", "x"], "context": ctx,
                             "answers": answers((["Rollo"], [0]), ([], []), ([], []))}), tmp_path / "blank.parquet")
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {tmp_path / 'blank.parquet'}]")
    assert "row 1 column 'question' is empty" in err

    errs = refusals(CONFIG, "data.context_column=passage")  # one line per file
    assert len(errs) == 2 and all("has no column 'passage'" in e and "data.context_column" in e for e in errs)

    err = one_refusal(CONFIG, "data.doc_stride=61")
    assert "data.doc_stride: 61" in err and "hold 61 tokens" in err


def test_bundle_starts_a_qa_config_for_squad_columns(tmp_path):
    """``finetune bundle``'s starting run config: a dataset with SQuAD's ``question``/``context``/``answers`` columns
    starts a ``qa`` run on them."""
    from finetune.airgap.bundle import Source, _recipe_guess

    data = Source("dataset", "squad", "squad",
                  splits={"train": {"rows": 3, "columns": ["id", "title", "context", "question", "answers"]}})
    assert _recipe_guess([], [data], tmp_path) == (
        "qa", {"question_column": "question", "context_column": "context", "answers_column": "answers"})


# ---------------------------------------------------------------------------------------------------------------
# Launched: parity with one device at ZeRO 0 and 3, the metrics against run_qa.py's pipeline, resume, the export
# ---------------------------------------------------------------------------------------------------------------

RUNS = {"z0": ["ds.zero_optimization.stage=0", "export=false"], "z3": ["ds.zero_optimization.stage=3"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("qa"), CONFIG, RUNS)


@pytest.fixture(scope="module")
def reference():
    from finetune.config import load_run_config
    from parity_reference import reference_run

    cfg = load_run_config(CONFIG, [f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"])

    def loss_sum(model, b):  # every window alone, unpadded, through transformers' own QA loss
        total = torch.zeros(())
        for k in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][k].sum())
            out = model(input_ids=b["input_ids"][k:k + 1, :n], token_type_ids=b["token_type_ids"][k:k + 1, :n],
                        start_positions=b["start_positions"][k:k + 1], end_positions=b["end_positions"][k:k + 1])
            total = total + out.loss
        return total

    return reference_run(cfg, 2, cfg.train.max_steps, loss_fn=loss_sum)


@pytest.mark.extended
@pytest.mark.parametrize("stage", ["z0", "z3"])
def test_qa_matches_one_device(runs, reference, stage):
    """2 ranks x micro 4 x accumulation 2 give one device's losses on the whole global batch (weighted per window;
    micro-batches hold different numbers of windows), grad norms and, at ZeRO 3, exported weights."""
    # a bias that shifts every position's start (end) logit alike has a gradient of exactly 0 (the softmax over
    # positions is shift-invariant): the head's bias and the last layer's output LayerNorm bias, which reaches the
    # logits only through the head. Adam turns their rounding-level gradients into steps of about the learning
    # rate, so they carry no information
    assert_one_device(runs(stage), reference, stage == "z3", "qa_outputs.weight",
                      skip=("qa_outputs.bias", "bert.encoder.layer.1.output.LayerNorm.bias"))


@pytest.mark.extended
def test_squad_metrics_are_run_qas_and_resume_and_export(runs, tmp_path):
    """The step-0 evaluation (both ranks' shards summed) equals ``run_qa.py``'s pipeline (its validation features,
    each alone through the same initial weights, its post-processing, the SQuAD 2.0 scores) on the whole validation
    split; a resume from step 3 repeats steps 4-6; the export answers through ``AutoModelForQuestionAnswering``."""
    from conftest import scratch_model
    from finetune.config import load_run_config
    from finetune.recipes.qa import scores

    run = runs("z3")
    cfg = load_run_config(CONFIG, [])
    model = scratch_model(cfg).eval()
    tok = _tokenizer()
    rows = pq.read_table(DEV).to_pydict()
    feats = run_qa_features(tok, dict(rows), cfg.data.max_seq_len, cfg.data.doc_stride, train=False)
    starts, ends = [], []
    with torch.no_grad():
        for i in range(len(feats["input_ids"])):
            out = model(input_ids=torch.tensor([feats["input_ids"][i]]),
                        token_type_ids=torch.tensor([feats["token_type_ids"][i]]))
            starts.append(out.start_logits[0].numpy())
            ends.append(out.end_logits[0].numpy())
    by_example = collections.defaultdict(list)
    for i, e in enumerate(feats["example_id"]):
        by_example[rows["id"].index(e)].append(i)
    preds = run_qa_postprocess(rows["context"], [by_example[e] for e in range(len(rows["id"]))],
                               feats["offset_mapping"], starts, ends, version_2=True)
    em_f1 = [scores(a["text"], p) for a, p in zip(rows["answers"], preds)]
    step0 = next(r for r in read_metrics(run) if r["step"] == 0 and "eval/f1" in r)
    assert step0["eval/exact_match"] == pytest.approx(np.mean([e for e, _ in em_f1]), rel=1e-9)
    assert step0["eval/f1"] == pytest.approx(np.mean([f for _, f in em_f1]), rel=1e-9)
    assert step0["eval/f1"] > 0
    has = [bool(a["text"]) for a in rows["answers"]]
    assert step0["eval/has_answer_f1"] == pytest.approx(np.mean([f for (_, f), h in zip(em_f1, has) if h]), rel=1e-9)

    assert_resume_repeats(CONFIG, RUNS["z3"], run, tmp_path / "resumed")

    # transformers 5 removed pipeline("question-answering"); the export is what AutoModelForQuestionAnswering loads
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    from finetune.recipes.qa import predict

    model = AutoModelForQuestionAnswering.from_pretrained(run / "export", local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(run / "export", local_files_only=True)
    context = "The Norse, under their leader Rollo, settled Normandy."
    enc = tok("Who led the Norse?", context, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0]
    offsets[torch.tensor([s != 1 for s in enc.sequence_ids(0)])] = -1
    with torch.no_grad():
        out = model(**enc)
    answer = predict(out.start_logits, out.end_logits, offsets[None], context)
    assert answer and answer in context
    assert model.config.architectures == ["BertForQuestionAnswering"]
