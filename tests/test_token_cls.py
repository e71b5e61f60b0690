"""Recipe ``token_cls`` (named-entity recognition) on the shipped WNUT-17 slice.

In process (default suite): the word-piece labels equal transformers' ``run_ner.py`` alignment (both
``label_all_tokens`` settings); the windows of long rows are a fast tokenizer's own overflowing windows
(``return_overflowing_tokens``, ``stride``) and every token's logits come from the window where it has the most
context; the CoNLL reader; every bad input as one line naming file, row and column.

Launched (extended: 3 launches of ``tests/configs/parity_token_cls.yaml``, 2 CPU ranks, micro-batch 4 x accumulation
2, windows of 24 tokens overlapping by 8, so most rows run as several windows): ZeRO 0 and ZeRO 3 against one device
on the whole global batch (:mod:`parity_reference`: losses 1e-5, grad norms 1e-4 at ZeRO 0 and 1e-5 at ZeRO 3,
exported weights 1e-5), the step-0 entity precision, recall and F1 summed over both ranks equal to
``seqeval.metrics`` on the whole validation split, a resume from step 3 that repeats steps 4-6, and the export
through ``pipeline("token-classification", aggregation_strategy="simple")``.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from conftest import (REPO, assert_one_device, assert_resume_repeats, cpu_env, lazy_runs, one_refusal, read_metrics,
                      refusals)

CONFIG = REPO / "tests" / "configs" / "parity_token_cls.yaml"
SHIPPED = REPO / "finetune" / "recipes" / "configs" / "token_cls_wnut17.yaml"
TRAIN, DEV = REPO / "data" / "wnut17" / "train.parquet", REPO / "data" / "wnut17" / "validation.parquet"
TOKENIZER = REPO / "data" / "models" / "bert-base-uncased-tokenizer"
WINDOWS = ["data.max_seq_len=24", "data.doc_stride=8"]


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _data_cfg(*overrides: str):
    from finetune.config import load_run_config

    return load_run_config(CONFIG, list(overrides)).data


def run_ner_labels(tokenizer, words: list[list[str]], tags: list[list[str]], label_list: list[str],
                   label_all_tokens: bool) -> list[list[int]]:
    """transformers' ``examples/pytorch/token-classification/run_ner.py``: ``tokenize_and_align_labels`` with its
    ``b_to_i_label``, as written there."""
    label_to_id = {label: i for i, label in enumerate(label_list)}
    b_to_i_label = []
    for idx, label in enumerate(label_list):
        if label.startswith("B-") and label.replace("B-", "I-") in label_list:
            b_to_i_label.append(label_list.index(label.replace("B-", "I-")))
        else:
            b_to_i_label.append(idx)
    tokenized = tokenizer(words, is_split_into_words=True, truncation=False)
    labels = []
    for i, label in enumerate(tags):
        word_ids = tokenized.word_ids(batch_index=i)
        previous_word_idx = None
        label_ids = []
        for word_idx in word_ids:
            if word_idx is None:
                label_ids.append(-100)
            elif word_idx != previous_word_idx:
                label_ids.append(label_to_id[label[word_idx]])
            else:
                label_ids.append(b_to_i_label[label_to_id[label[word_idx]]] if label_all_tokens else -100)
            previous_word_idx = word_idx
        labels.append(label_ids)
    return labels


@pytest.mark.parametrize("all_tokens", [False, True])
def test_labels_are_run_ners(all_tokens):
    from finetune.recipes.token_cls import tag_names, tokenize_function

    data_cfg = _data_cfg(f"data.label_all_tokens={str(all_tokens).lower()}")
    rows = pq.read_table(TRAIN).slice(0, 200).to_pydict()
    tok = _tokenizer()
    fn = tokenize_function(tok, data_cfg)
    got = fn(rows)
    names = tag_names(data_cfg)
    assert names[:2] == ["B-corporation", "B-creative-work"] and names[-1] == "O" and len(names) == 13
    want = run_ner_labels(tok, rows["tokens"], rows["ner_tags"], names, all_tokens)
    assert got["labels"] == want
    # the words' first sub-tokens, whatever label_all_tokens says
    assert [sum(s) for s in got["word_starts"]] == [len(w) for w in rows["tokens"]]
    split = sum(len(x) - 2 - sum(s) for x, s in zip(got["input_ids"], got["word_starts"]))
    assert split > 50, "words cut into several pieces must be in the sample"
    assert "200 rows, 200 sentences kept" in fn.summary()


def test_windows_are_the_tokenizers_overflow_and_keep_the_most_context():
    """Rows longer than ``data.max_seq_len`` run as the fast tokenizer's own overflowing windows; every token's
    logits are the logits of the window where it has the most context (BERT's rule), computed here window by
    window with the plain model."""
    from transformers import BertConfig, BertForTokenClassification

    from finetune.recipes.token_cls import make_collator, max_context_score, tokenize_function, windowed_logits

    data_cfg = _data_cfg(*WINDOWS)
    tok = _tokenizer()
    rows = pq.read_table(TRAIN).slice(0, 40).to_pydict()
    long = [i for i, w in enumerate(rows["tokens"]) if len(tok(w, is_split_into_words=True)["input_ids"]) > 40][:3]
    short = next(i for i, w in enumerate(rows["tokens"]) if len(tok(w, is_split_into_words=True)["input_ids"]) < 20)
    assert len(long) == 3
    batch_rows = {k: [v[i] for i in long] + [v[short]] for k, v in rows.items()}  # and a short one, padded
    enc = tokenize_function(tok, data_cfg)(batch_rows)
    batch = make_collator(tok, data_cfg)([{k: enc[k][i] for k in enc} for i in range(4)])
    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=64, num_labels=13,
                                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    with torch.no_grad():
        got = windowed_logits(model, batch, 24, 8)
        for r, i in enumerate(long):
            overflow = tok(rows["tokens"][i], is_split_into_words=True, truncation=True, max_length=24, stride=8,
                           return_overflowing_tokens=True)["input_ids"]
            assert len(overflow) >= 2
            n = int(batch["attention_mask"][r].sum())
            inner = batch["input_ids"][r, 1:n - 1].tolist()
            starts = []  # where each overflowing window's tokens begin in the row
            for w in overflow:
                starts.append(next(s for s in range(len(inner)) if inner[s:s + len(w) - 2] == w[1:-1]))
                assert w[0] == tok.cls_token_id and w[-1] == tok.sep_token_id and len(w) <= 24
            assert starts == sorted(starts) and inner[starts[-1]:] == overflow[-1][1:-1]
            per_window = [model(input_ids=torch.tensor([w])).logits[0].float() for w in overflow]
            for j in range(len(inner)):
                scores = [max_context_score(s, len(w) - 2, j) if s <= j < s + len(w) - 2 else -1
                          for s, w in zip(starts, overflow)]
                k = scores.index(max(scores))
                # batched with padding: float rounding differs (1e-7), another window's context would differ by 1e-2
                assert torch.allclose(got[r, 1 + j], per_window[k][1 + j - starts[k]], rtol=0, atol=1e-5), (r, j)
        short = model(input_ids=batch["input_ids"][3:, :len(enc["input_ids"][3])]).logits[0]
        assert torch.allclose(got[3, 1:len(enc["input_ids"][3]) - 1], short[1:-1], atol=1e-6)


def test_read_conll(tmp_path):
    from finetune.errors import ConfigError
    from finetune.recipes.token_cls import read_conll

    path = tmp_path / "a.conll"
    path.write_text("-DOCSTART- O\n\nEmpire\tB-location\nState\tI-location\n\t\nhi O\n")
    assert read_conll(str(path)) == [{"tokens": ["Empire", "State"], "ner_tags": ["B-location", "I-location"]},
                                     {"tokens": ["hi"], "ner_tags": ["O"]}]
    path.write_text("Empire B-location\nState\n")
    with pytest.raises(ConfigError, match="line 2: 'State' has one field"):
        read_conll(str(path))


def test_bad_rows_are_one_line_errors(tmp_path):
    words = pa.array([["a", "b"], ["c"], ["d", "e"]])

    def write(name: str, **cols) -> Path:
        pq.write_table(pa.table(cols), tmp_path / name)
        return tmp_path / name

    short = write("short.parquet", tokens=words, ner_tags=pa.array([["O", "B-x"], ["O"], ["O"]]))
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {short}]")
    assert str(short) in err and "row 2" in err and "'ner_tags' has 1 tags for 2 words in 'tokens'" in err

    unseen = write("unseen.parquet", tokens=words, ner_tags=pa.array([["O", "O"], ["B-new"], ["O", "O"]]))
    err = one_refusal(CONFIG, f"data.validation_files=[{unseen}]")
    assert str(unseen) in err and "'B-new'" in err and "no training file has" in err

    null = write("null.parquet", tokens=words, ner_tags=pa.array([["O", "O"], None, ["O", "O"]]))
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {null}]")
    assert str(null) in err and "row 1" in err and "is null" in err

    text = write("text.parquet", tokens=pa.array(["a b", "c", "d e"]), ner_tags=pa.array([["O", "O"], ["O"], ["O"] * 2]))
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {text}]")
    assert str(text) in err and "'tokens' holds string values" in err and "a list per row" in err

    errs = refusals(CONFIG, "data.tags_column=tags")  # one line per file
    assert len(errs) == 2 and all("has no column 'tags'" in e and "data.tags_column" in e for e in errs)
    assert "data/wnut17/train.parquet" in errs[0] and "data/wnut17/validation.parquet" in errs[1]

    err = one_refusal(CONFIG, "data.max_seq_len=24", "data.doc_stride=22")
    assert "data.doc_stride: 22" in err and "hold 22 tokens" in err


# ---------------------------------------------------------------------------------------------------------------
# Launched: parity with one device at ZeRO 0 and 3, the entity metrics against seqeval, resume, the export
# ---------------------------------------------------------------------------------------------------------------

RUNS = {"z0": ["ds.zero_optimization.stage=0", "export=false"], "z3": ["ds.zero_optimization.stage=3"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("token_cls"), CONFIG, RUNS, WINDOWS)


@pytest.fixture(scope="module")
def reference():
    from finetune.config import load_run_config
    from finetune.recipes.token_cls import windowed_logits
    from parity_reference import reference_run

    cfg = load_run_config(CONFIG, [*WINDOWS, f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"])

    def loss_sum(model, b):  # the textbook cross-entropy over every labelled token of the rejoined windows
        logits = windowed_logits(model, b, cfg.data.max_seq_len, cfg.data.doc_stride)
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum")

    return reference_run(cfg, 2, cfg.train.max_steps, loss_fn=loss_sum)


@pytest.mark.extended
@pytest.mark.parametrize("stage", ["z0", "z3"])
def test_token_cls_matches_one_device(runs, reference, stage):
    """2 ranks x micro 4 x accumulation 2 give one device's losses on the whole global batch (weighted by the global
    count of labelled tokens, which differs between micro-batches), grad norms and, at ZeRO 3, exported weights."""
    assert_one_device(runs(stage), reference, stage == "z3", "classifier.weight")


@pytest.mark.extended
def test_entity_metrics_are_seqevals_and_resume_and_export(runs, tmp_path):
    """The step-0 evaluation (both ranks' shards summed) equals ``seqeval.metrics`` on the whole validation split
    run through the same initial weights on one process; a resume from step 3 repeats steps 4-6; the export loads in
    ``pipeline("token-classification")`` with the tag names."""
    from seqeval.metrics import f1_score, precision_score, recall_score
    from transformers import pipeline

    from conftest import scratch_model
    from finetune.config import load_run_config
    from finetune.recipes import get_recipe
    from finetune.recipes.token_cls import make_collator, tokenize_function, windowed_logits

    run = runs("z3")
    cfg = load_run_config(CONFIG, [*WINDOWS])
    model = scratch_model(cfg).eval()
    tok = get_recipe("token_cls").prepare_tokenizer(_tokenizer())
    rows = pq.read_table(DEV).to_pydict()
    enc = tokenize_function(tok, cfg.data)(rows)
    collate = make_collator(tok, cfg.data)
    id2label = model.config.id2label
    y_pred = []
    with torch.no_grad():
        for lo in range(0, len(rows["tokens"]), 50):
            batch = collate([{k: enc[k][i] for k in enc} for i in range(lo, min(lo + 50, len(rows["tokens"])))])
            predicted = windowed_logits(model, batch, 24, 8).argmax(-1)
            for r in range(predicted.shape[0]):
                y_pred.append([id2label[int(t)] for t in predicted[r][batch["word_starts"][r] == 1]])
    y_true = rows["ner_tags"]
    step0 = next(r for r in read_metrics(run) if r["step"] == 0 and "eval/f1" in r)
    assert step0["eval/f1"] > 0 and step0["eval/precision"] > 0
    assert step0["eval/precision"] == pytest.approx(precision_score(y_true, y_pred), rel=1e-9)
    assert step0["eval/recall"] == pytest.approx(recall_score(y_true, y_pred), rel=1e-9)
    assert step0["eval/f1"] == pytest.approx(f1_score(y_true, y_pred), rel=1e-9)
    assert (run / "eval" / "step0_entities.json").is_file()

    assert_resume_repeats(CONFIG, [*WINDOWS, *RUNS["z3"]], run, tmp_path / "resumed")

    tagger = pipeline("token-classification", model=str(run / "export"), aggregation_strategy="simple")
    found = tagger("Empire State Building is in New York")
    assert isinstance(found, list) and all({"entity_group", "word", "start", "end"} <= set(e) for e in found)
    assert set(tagger.model.config.id2label.values()) == set(id2label.values())


def test_bundle_starts_a_token_cls_config_for_tag_columns(tmp_path):
    """``finetune bundle``'s starting run config: a dataset with Hugging Face's ``tokens``/``ner_tags`` columns
    (conll2003, wnut_17, wikiann) starts a ``token_cls`` run on them."""
    from finetune.airgap.bundle import Source, _recipe_guess

    data = Source("dataset", "wnut17", "wnut17", splits={"train": {"rows": 3, "columns": ["id", "tokens", "ner_tags"]}})
    assert _recipe_guess([], [data], tmp_path) == ("token_cls", {"tokens_column": "tokens", "tags_column": "ner_tags"})
