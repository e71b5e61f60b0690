"""Sequence classification (sentiment, topic, NLI, ...) with any ``AutoModelForSequenceClassification``.

Rows are ``data.text_column`` (and ``data.text_pair_column`` for sentence pairs, tokenized as a pair:
``[CLS] a [SEP] b [SEP]``), truncated to ``data.max_seq_len`` and padded per batch. The class of each row
is ``data.label_column``: ints or strings. The label set is read from the training files, sorted (numbers
numerically, strings alphabetically) so the mapping is the same on every rank and every run; class id
``i`` is the ``i``-th label. It is written into the model config (``num_labels``, ``id2label``,
``label2id``), so the export works with ``transformers.pipeline("text-classification", model=export_dir)``
and returns label names. :func:`check_labels` rejects, before any model is built, a missing label
column, missing (null) labels, float labels, and validation labels the training files never had.

Loss (``forward``): cross-entropy per example, summed; ``count_targets`` counts examples, so the loop's token
weighting becomes example weighting (the loss is the exact mean over the global batch's examples).
Eval metrics: loss, accuracy, macro-F1 and, for 2 classes, ``f1`` of the second label (the positive
class of 0/1 or negative/positive labels); the per-class confusion matrix (rows: true class, columns:
predicted) is written to ``<run folder>/eval/step<N>_confusion_matrix.json`` and as an image to
TensorBoard at each evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from finetune.data.batch import LossOutput, model_inputs
from finetune.config import DataConfig, RunConfig
from finetune.data.dataset import file_columns, read_column, sorted_values
from finetune.recipes import Capabilities, Recipe, pad_with_eos
from finetune.recipes.common.labels import name_classes

MODEL_CLASS = AutoModelForSequenceClassification


def prepare_tokenizer(tokenizer):
    """Check the tokenizer can pad.

    Raises:
        ConfigError: no ``pad_token`` (set one, or use the EOS token, in the tokenizer folder).
    """
    return pad_with_eos(tokenizer, "seq_cls")


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenizer reads: text, optional pair text, label."""
    return [data_cfg.text_column] + ([data_cfg.text_pair_column] if data_cfg.text_pair_column else []) + \
        [data_cfg.label_column]


def _label_kind(arrow_type) -> str:
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str"
    if pa.types.is_floating(arrow_type):
        return "float"
    return str(arrow_type)


def label_names(data_cfg: DataConfig) -> list:
    """Sorted distinct labels (int or str) of the training files: class id ``i`` is ``label_names[i]``.

    Raises:
        ConfigError: no training file matches (checked earlier by :func:`check_labels` in a normal run).
    """
    return sorted_values(data_cfg.train_files, "data.train_files", data_cfg.label_column)


def check_labels(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the label (and pair text) columns before any model is built; append one line per problem.

    Problems: a file without ``data.label_column`` (or ``data.text_pair_column``); a label column that is not
    int or string (floats: this is a classification recipe); null labels; a validation label the training
    files never had; ``num_labels`` in ``model.config_overrides`` (or a pretrained ``config.json`` with
    ``id2label``) that disagrees with the number of training labels. Each names the file, the column
    and an example value. Unreadable files are skipped (``check_parquet_files`` reports them).
    """
    train_labels: set = set()
    val_labels: dict[str, list] = {}
    kinds: dict[str, str] = {}  # label kind (int, str) -> first file holding it
    for key, f, names in file_columns(train_files, validation_files):
        if cfg.data.text_pair_column and cfg.data.text_pair_column not in names:
            problems.append(f"{key}: '{f}' has no column '{cfg.data.text_pair_column}' (columns: {', '.join(names)}); "
                            f"set data.text_pair_column (or leave it empty for single texts)")
        if cfg.data.label_column not in names:
            problems.append(f"{key}: '{f}' has no label column '{cfg.data.label_column}' (columns: {', '.join(names)}); "
                            f"set data.label_column")
            continue
        col = read_column(f, cfg.data.label_column)
        kind = _label_kind(col.type)
        if kind not in ("int", "str"):
            example = next((v for v in col.to_pylist() if v is not None), None)
            fix = ("convert them, e.g. 1.0 -> 1" if kind == "float" else
                   "cast the column to string or int, e.g. pandas df[col] = df[col].astype(str)")
            problems.append(f"{key}: '{f}' column '{cfg.data.label_column}' holds {kind} values (e.g. {example!r}); "
                            f"seq_cls needs int or string class labels ({fix})")
            continue
        kinds.setdefault(kind, f)
        if col.null_count:
            row = col.to_pylist().index(None)
            problems.append(f"{key}: '{f}' column '{cfg.data.label_column}' has {col.null_count} missing (null) "
                            f"label(s), e.g. row {row}; every row needs a label")
        values = [v for v in col.unique().to_pylist() if v is not None]
        if key == "data.train_files":
            train_labels |= set(values)
        else:
            val_labels[f] = values
    if len(kinds) > 1:
        problems.append(f"data: column '{cfg.data.label_column}' holds int labels in '{kinds['int']}' but string labels in "
                        f"'{kinds['str']}'; every file must use the same label type (convert one of them, e.g. "
                        f"0 -> '0')")
        return
    if train_labels:
        for f, values in val_labels.items():
            unknown = sorted(set(values) - train_labels, key=str)
            if unknown:
                problems.append(f"data.validation_files: '{f}' column '{cfg.data.label_column}' has label {unknown[0]!r} "
                                f"that no training file has (training labels: "
                                f"{', '.join(map(str, sorted(train_labels)[:20]))})")
        if len(train_labels) < 2:
            problems.append(f"data.train_files: column '{cfg.data.label_column}' has only the label "
                            f"{next(iter(train_labels))!r}; classification needs at least 2 classes")
        n = len(train_labels)
        want = cfg.model.config_overrides.get("num_labels")
        if want is not None and want != n:
            problems.append(f"model.config_overrides.num_labels: {want}, but the training data has {n} labels "
                            f"({', '.join(map(str, sorted(train_labels)[:20]))}); remove it (it is set from the data)")
        config_json = Path(cfg.model.path) / "config.json"
        if cfg.model.init == "pretrained" and config_json.is_file():
            try:
                have = json.loads(config_json.read_text()).get("id2label")
            except (OSError, json.JSONDecodeError):
                have = None
            if have and len(have) != n:
                problems.append(f"model.path: '{config_json}' is a classifier with {len(have)} labels (id2label) but "
                                f"the training data has {n}; use a checkpoint without a classification head or "
                                f"data with the same classes")


def prepare_model_config(model_config, data_cfg: DataConfig):
    """Set ``num_labels``, ``id2label`` (id -> label as str) and ``label2id`` from the training labels."""
    name_classes(model_config, label_names(data_cfg))
    model_config.problem_type = "single_label_classification"
    return model_config


def tokenize_function(tokenizer, data_cfg: DataConfig):
    """Batched map function: text (pair) and label -> ``input_ids``, ``attention_mask`` (+ ``token_type_ids``),
    ``labels`` (int class id). Rows with an empty text are dropped."""
    col, pair, label_col = data_cfg.text_column, data_cfg.text_pair_column, data_cfg.label_column
    class_id = {name: i for i, name in enumerate(label_names(data_cfg))}
    max_len = data_cfg.max_seq_len

    def fn(batch):
        keep = [i for i, t in enumerate(batch[col]) if t is not None and t.strip()]
        texts = [batch[col][i] for i in keep]
        pairs = [batch[pair][i] or "" for i in keep] if pair else None
        out = tokenizer(texts, pairs, truncation=True, max_length=max_len)
        out["labels"] = [class_id[batch[label_col][i]] for i in keep]
        return out

    return fn


def make_collator(tokenizer, data_cfg: DataConfig):
    """``DataCollatorWithPadding``: pads ``input_ids``/``attention_mask`` per batch; ``labels`` int64 [micro_batch]."""
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=data_cfg.pad_to_multiple_of or None,
                                   return_tensors="pt")


def forward(model, batch: dict, metrics: bool = False) -> LossOutput:
    """Classification loss of one micro-batch: cross-entropy of the logits [batch, classes] (upcast to float32)
    summed over examples whose ``labels`` [batch] is not -100 (eval filler rows).

    Args:
        model: the engine (or a transformers classifier); called with :func:`~finetune.recipes.model_inputs` of
            ``batch``.
        batch: ``input_ids``, ``attention_mask`` (, ``token_type_ids``) and ``labels`` (int64, [batch]).
        metrics: also return accuracy sums (``accuracy``) and the confusion counts (``counts``, see
            :func:`confusion_counts`) for :func:`eval_report`.

    Returns:
        :class:`~finetune.recipes.LossOutput`.
    """
    labels = batch["labels"]
    logits = model(**model_inputs(batch)).logits.float()
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    n = count_targets(batch)
    if not metrics:
        return LossOutput(loss, n)
    mask = labels != -100
    correct = ((logits.argmax(dim=-1) == labels) & mask).sum()
    return LossOutput(loss, n, {"accuracy": (correct, n)}, confusion_counts(logits, labels))


def count_targets(batch: dict) -> torch.Tensor:
    """Examples with a label (``labels != -100``) in the batch's ``labels`` [batch]; 0-dim int64."""
    return (batch["labels"] != -100).sum()


def confusion_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Confusion counts [classes, classes] (float64; row = true class, column = predicted) of the labelled rows of
    ``logits`` [batch, classes] and ``labels`` [batch] (-100: not counted)."""
    n = logits.shape[-1]
    mask = labels != -100
    pred = logits.argmax(dim=-1)[mask]
    flat = labels[mask] * n + pred
    return torch.bincount(flat, minlength=n * n).reshape(n, n).double()


def eval_report(counts: torch.Tensor, model_config) -> tuple[dict[str, float], dict]:
    """Macro-F1 (and ``f1`` of class 1 for 2 classes) from the summed confusion counts [classes, classes].

    Returns:
        ``({"macro_f1": float[, "f1": float]}, {"confusion_matrix": {"labels": [...], "matrix": [[int]]}})``;
        the F1 of a class that is never true nor predicted counts as 0.
    """
    c = counts.double()
    tp = c.diag()
    precision_den, recall_den = c.sum(0), c.sum(1)
    f1 = torch.where(precision_den + recall_den > 0, 2 * tp / (precision_den + recall_den).clamp(min=1e-12),
                     torch.zeros_like(tp))
    metrics = {"macro_f1": f1.mean().item()}
    if c.shape[0] == 2:
        metrics["f1"] = f1[1].item()
    id2label = getattr(model_config, "id2label", None) or {}
    labels = [str(id2label.get(i, i)) for i in range(c.shape[0])]
    return metrics, {"confusion_matrix": {"labels": labels, "matrix": c.round().long().tolist()}}


RECIPE = Recipe(name="seq_cls", model_class=MODEL_CLASS,
                capabilities=Capabilities(eval_metrics=("accuracy", "macro_f1", "f1"), one_target_per_row=True,
                                          mixes_sources=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, columns=columns, check_data=check_labels,
                prepare_model_config=prepare_model_config, eval_report=eval_report)
