"""Token classification (named-entity recognition, part-of-speech tagging, chunking) with any
``AutoModelForTokenClassification``.

Rows are ``data.tokens_column`` (a list of words) and ``data.tags_column`` (one tag per word: strings such as
``B-PER``/``I-PER``/``O`` in the BIO, IOB2 or BIOES scheme, read as they are, or int class ids); a CoNLL file converts
to such a parquet file with :func:`read_conll` (``scripts/make_wnut17_data.py``). The tag set is read from the
training files and sorted, so class id ``i`` is the ``i``-th tag on every rank and run; it goes into the model config
(``num_labels``, ``id2label``, ``label2id``), so ``pipeline("token-classification", aggregation_strategy="simple")``
loads the export and returns entities.

Labels are aligned to word pieces as transformers' ``run_ner.py`` aligns them: the first sub-token of a word gets
the word's tag, the others -100 (no loss), or with ``data.label_all_tokens`` the word's tag with ``B-`` turned into
``I-`` (``run_ner.py``'s ``b_to_i_label``). Special tokens get -100. Rows are not truncated: a sentence longer
than ``data.max_seq_len`` tokens runs as windows of ``max_seq_len`` tokens (each with the tokenizer's own special
tokens) that overlap by ``data.doc_stride`` tokens, and each token takes its logits from the window where it has the
most context on both sides (BERT's ``_check_is_max_context``, as transformers' token-classification pipeline
with ``stride``), so training and evaluation see one prediction per token and the windows are rejoined exactly.

Loss (``forward``): cross-entropy summed over the labelled tokens; ``count_targets`` counts them, so the loss is the
exact mean over the global batch's labelled tokens whatever the ranks and accumulation. Evaluation: token accuracy
and entity-level precision, recall and F1, overall (micro) and per entity type, over each sentence's words (its
first sub-tokens), the entities found by ``seqeval``'s ``get_entities`` (Ramshaw & Marcus 1995; conlleval's
definition, ``seqeval``'s default mode) and counted per batch, so the sums over ranks give exactly what
``seqeval.metrics.classification_report`` gives on the whole validation split; the per-type table is written to
``<run>/eval/step<N>_entities.json``.
"""

from __future__ import annotations

import functools
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from transformers import AutoModelForTokenClassification

from finetune.config import DataConfig, RunConfig
from finetune.data.batch import LossOutput, model_inputs
from finetune.data.dataset import file_schemas, missing_columns, sorted_values
from finetune.errors import ConfigError
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common.fast_tokenizer import require_fast
from finetune.recipes.common.labels import name_classes

MODEL_CLASS = AutoModelForTokenClassification

SCHEME_PREFIXES = ("B-", "I-", "E-", "S-", "L-", "U-")
"""Tag prefixes that mark an entity's type after them (BIO/IOB2/BIOES, and BILOU's L/U)."""


def read_conll(path: str, tag_field: int = -1) -> list[dict]:
    """The sentences of a CoNLL-style file: one word per line, whitespace-separated fields (the word first, the
    tag in field ``tag_field``), a blank line between sentences, ``-DOCSTART-`` lines skipped.

    Returns:
        ``[{"tokens": [str], "ner_tags": [str]}]``, one per sentence, in file order.

    Raises:
        ConfigError: a non-blank line with fewer than two fields (names the file and line).
    """
    rows: list[dict] = []
    words: list[str] = []
    tags: list[str] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if words:
                    rows.append({"tokens": words, "ner_tags": tags})
                words, tags = [], []
                continue
            if len(fields) < 2:
                raise ConfigError(f"'{path}' line {n}: '{line.strip()}' has one field; a CoNLL line is a word "
                                  f"and its tag separated by whitespace")
            words.append(fields[0])
            tags.append(fields[tag_field])
    if words:
        rows.append({"tokens": words, "ner_tags": tags})
    return rows


def prepare_tokenizer(tokenizer):
    """The tokenizer, checked to be a fast one (its word ids align the tags) that can pad.

    Raises:
        ConfigError: a slow (Python) tokenizer, or one without a pad token.
    """
    return require_fast(tokenizer, "token_cls", "word ids to align tags to word pieces")


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns read: the words and their tags."""
    return [data_cfg.tokens_column, data_cfg.tags_column]


def cache_key(data_cfg: DataConfig) -> dict:
    """Settings that decide the tokenized rows besides files and columns: the label alignment and the tag set."""
    return {"label_all_tokens": data_cfg.label_all_tokens, "tags": [str(t) for t in tag_names(data_cfg)]}


def tag_names(data_cfg: DataConfig) -> list:
    """Sorted distinct tags (str or int) of the training files: class id ``i`` is ``tag_names[i]``.

    Raises:
        ConfigError: no training file matches (checked earlier by :func:`check_tags` in a normal run).
    """
    return sorted_values(data_cfg.train_files, "data.train_files", data_cfg.tags_column, flatten=True)


def entity_types(id2label: dict) -> list[str]:
    """Sorted entity types of a tag set (``B-PER`` -> ``PER``); none for int or unprefixed tags."""
    return sorted({str(t)[2:] for t in id2label.values() if str(t)[:2] in SCHEME_PREFIXES})


def _list_problem(key: str, f: str, col, column: str) -> str | None:
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        return (f"{key}: '{f}' column '{column}' holds {col.type} values; token_cls needs a list per row (the words, "
                f"and one tag per word)")
    return None


def check_tags(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the words and tags columns before any model is built; append one line per problem, naming the file,
    the row and the column.

    Problems: a missing column; a column that is not a list per row; tags that are neither strings nor ints; a row
    whose tag list is null or differs in length from its words; a null tag; a validation tag no training file has;
    fewer than 2 tags in the training files; ``num_labels`` in ``model.config_overrides`` that disagrees.
    """
    words_col, tags_col = cfg.data.tokens_column, cfg.data.tags_column
    train_tags: set = set()
    val_tags: dict[str, set] = {}
    for key, f, schema in file_schemas(train_files, validation_files):
        line = missing_columns(key, f, schema, [words_col, tags_col],
                               "token_cls reads data.tokens_column (words) and data.tags_column (a tag per word)")
        if line:
            problems.append(line)
            continue
        table = pq.read_table(f, columns=[words_col, tags_col])
        words, tags = table.column(words_col), table.column(tags_col)
        bad = [p for p in (_list_problem(key, f, words, words_col), _list_problem(key, f, tags, tags_col)) if p]
        if bad:
            problems.extend(bad)
            continue
        value_type = tags.type.value_type
        if not (pa.types.is_integer(value_type) or pa.types.is_string(value_type)
                or pa.types.is_large_string(value_type)):
            problems.append(f"{key}: '{f}' column '{tags_col}' holds lists of {value_type}; tags are strings "
                            f"(B-PER, O, ...) or int class ids")
            continue
        n_words = pc.fill_null(pc.list_value_length(words), -1).to_pylist()
        n_tags = pc.fill_null(pc.list_value_length(tags), -1).to_pylist()
        for row, (a, b) in enumerate(zip(n_words, n_tags)):
            if b == -1:
                problems.append(f"{key}: '{f}' row {row} column '{tags_col}' is null; every row needs a tag per word")
                break
            if a != b:
                problems.append(f"{key}: '{f}' row {row} column '{tags_col}' has {b} tags for {a} words in "
                                f"'{words_col}'; give one tag per word")
                break
        flat = pc.list_flatten(tags)
        if flat.null_count:
            row = next(i for i, t in enumerate(tags.to_pylist()) if t and None in t)
            problems.append(f"{key}: '{f}' row {row} column '{tags_col}' has a null tag; every word needs a tag")
        values = {v for v in flat.unique().to_pylist() if v is not None}
        if key == "data.train_files":
            train_tags |= values
        else:
            val_tags[f] = values
    if train_tags:
        for f, values in val_tags.items():
            unknown = sorted(values - train_tags, key=str)
            if unknown:
                problems.append(f"data.validation_files: '{f}' column '{tags_col}' has tag {unknown[0]!r} that no "
                                f"training file has (training tags: {', '.join(map(str, sorted(train_tags)[:30]))})")
        if len(train_tags) < 2:
            problems.append(f"data.train_files: column '{tags_col}' has only the tag {next(iter(train_tags))!r}; "
                            f"token classification needs at least 2")
        want = cfg.model.config_overrides.get("num_labels")
        if want is not None and want != len(train_tags):
            problems.append(f"model.config_overrides.num_labels: {want}, but the training data has {len(train_tags)} "
                            f"tags; remove it (it is set from the data)")


def check_window(tokenizer, cfg: RunConfig, problems: list[str]) -> None:
    """``data.doc_stride`` must leave each window of ``data.max_seq_len`` tokens room for new tokens."""
    prefix, suffix = special_layout(tokenizer)
    width = cfg.data.max_seq_len - len(prefix) - len(suffix)
    if width < 2:
        problems.append(f"data.max_seq_len: {cfg.data.max_seq_len} leaves no room for words beside the tokenizer's "
                        f"{len(prefix) + len(suffix)} special tokens; raise it")
    elif not 0 <= cfg.data.doc_stride < width:
        problems.append(f"data.doc_stride: {cfg.data.doc_stride}, but windows of data.max_seq_len "
                        f"{cfg.data.max_seq_len} hold {width} tokens besides the special ones; the overlap must be "
                        f"at least 0 and below {width}")


def prepare_model_config(model_config, data_cfg: DataConfig):
    """Set ``num_labels``, ``id2label`` (id -> tag as str) and ``label2id`` from the training tags."""
    return name_classes(model_config, tag_names(data_cfg))


class Tokenize:
    """Batched map function: words and tags -> ``input_ids``, ``attention_mask`` (+ ``token_type_ids``), ``labels``
    (the tag's class id at each word's first sub-token, -100 elsewhere; every sub-token with
    ``data.label_all_tokens``) and ``word_starts`` (1 at each word's first sub-token). Not truncated (long rows run
    as windows in :func:`forward`). Rows without words are left out and counted (:meth:`summary`)."""

    def __init__(self, tokenizer, data_cfg: DataConfig):
        self.tokenizer, self.d = tokenizer, data_cfg
        names = tag_names(data_cfg)
        self.class_id = {name: i for i, name in enumerate(names)}
        self.as_inside = {i: self.class_id.get("I-" + str(n)[2:], i) if str(n).startswith("B-") else i
                          for i, n in enumerate(names)}
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def __call__(self, batch: dict) -> dict:
        words_col, tags_col = self.d.tokens_column, self.d.tags_column
        self.counts["rows"] += len(batch[words_col])
        keep = [i for i, w in enumerate(batch[words_col]) if w]
        self.counts["kept"] += len(keep)
        if not keep:
            return {"input_ids": [], "attention_mask": [], "labels": [], "word_starts": []}
        enc = self.tokenizer([[str(w) for w in batch[words_col][i]] for i in keep], is_split_into_words=True,
                             truncation=False)
        out = {k: enc[k] for k in enc.keys()}
        out["labels"], out["word_starts"] = [], []
        for j, i in enumerate(keep):
            tags = batch[tags_col][i]
            labels, starts, previous = [], [], None
            for w in enc.word_ids(j):
                if w is None:
                    labels.append(-100)
                    starts.append(0)
                elif w != previous:
                    labels.append(self.class_id[tags[w]])
                    starts.append(1)
                else:
                    labels.append(self.as_inside[self.class_id[tags[w]]] if self.d.label_all_tokens else -100)
                    starts.append(0)
                previous = w
            self.counts["longer"] += len(labels) > self.d.max_seq_len
            out["labels"].append(labels)
            out["word_starts"].append(starts)
        return out

    def summary(self) -> str:
        """One line: rows read, sentences kept, those without words, those that run as windows."""
        c = self.counts
        return (f"token_cls: {c['rows']:,} rows, {c['kept']:,} sentences kept ({c['rows'] - c['kept']:,} without "
                f"words left out); {c['longer']:,} longer than data.max_seq_len={self.d.max_seq_len} tokens run as "
                f"windows overlapping by data.doc_stride={self.d.doc_stride}")


def tokenize_function(tokenizer, data_cfg: DataConfig) -> Tokenize:
    """:class:`Tokenize` for ``datasets.Dataset.map(batched=True)``."""
    return Tokenize(tokenizer, data_cfg)


def special_layout(tokenizer) -> tuple[list[int], list[int]]:
    """The special token ids a tokenizer puts before and after one sequence of words (BERT: ``[CLS]``, ``[SEP]``)."""
    enc = tokenizer([["a"]], is_split_into_words=True)
    ids, words = enc["input_ids"][0], enc.word_ids(0)
    first = words.index(0)
    last = len(words) - 1 - words[::-1].index(0)
    return list(ids[:first]), list(ids[last + 1:])


def make_collator(tokenizer, data_cfg: DataConfig):
    """Pads each micro-batch to its longest row (``data.pad_to_multiple_of``): ``input_ids`` (pad id),
    ``attention_mask``, ``token_type_ids`` (0), ``labels`` (-100), ``word_starts`` (0), all int64 ``[B, T]``, and the
    tokenizer's special tokens around a sequence, ``window_prefix`` ``[B, P]`` and ``window_suffix`` ``[B, S]``, for
    the windows of rows longer than ``data.max_seq_len``."""
    prefix, suffix = special_layout(tokenizer)
    pad_id = tokenizer.pad_token_id
    multiple = data_cfg.pad_to_multiple_of

    def collate(rows: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        width = -(-width // multiple) * multiple if multiple else width
        fill = {"input_ids": pad_id, "attention_mask": 0, "token_type_ids": 0, "labels": -100, "word_starts": 0}
        batch = {k: torch.tensor([list(r[k]) + [v] * (width - len(r[k])) for r in rows], dtype=torch.long)
                 for k, v in fill.items() if k in rows[0]}
        batch["window_prefix"] = torch.tensor([prefix] * len(rows), dtype=torch.long).reshape(len(rows), len(prefix))
        batch["window_suffix"] = torch.tensor([suffix] * len(rows), dtype=torch.long).reshape(len(rows), len(suffix))
        return batch

    return collate


def window_starts(inner: int, width: int, stride: int) -> list[int]:
    """Starts of the windows of ``width`` tokens that cover ``inner`` tokens, each overlapping the previous one by
    ``stride`` tokens (the last one may be shorter): the windows of a fast tokenizer's
    ``return_overflowing_tokens=True, stride=stride``."""
    step = max(width - stride, 1)
    starts = [0]
    while starts[-1] + width < inner:
        starts.append(starts[-1] + step)
    return starts


def row_windows(ids: list[int], prefix: list[int], suffix: list[int], max_len: int,
                stride: int) -> list[tuple[int, list[int]]]:
    """The windows of one row ``ids`` (its special tokens included, no padding) longer than ``max_len``:
    ``(start, window ids)`` per window, ``start`` counted in the tokens between the special ones, each window the
    special tokens around at most ``max_len - len(prefix) - len(suffix)`` of those tokens."""
    p, s = len(prefix), len(suffix)
    inner = ids[p:len(ids) - s]
    width = max_len - p - s
    return [(start, prefix + inner[start:start + width] + suffix)
            for start in window_starts(len(inner), width, stride)]


def max_context_score(start: int, count: int, position):
    """How well a window of ``count`` tokens from ``start`` sees token ``position`` (both counted between the
    special tokens): the smaller of its context on the left and on the right plus 0.01 x the window's length (BERT's
    ``_check_is_max_context``); each token takes the window with the highest score, the first one on a tie.
    ``position``: an int, or a float tensor of positions (a score each)."""
    left, right = position - start, start + count - 1 - position
    return (left + right - abs(left - right)) / 2 + 0.01 * count  # min(left, right), for ints and tensors alike


def windowed_logits(model, batch: dict, max_len: int, stride: int) -> torch.Tensor:
    """Per-token logits ``[B, T, labels]`` (float32) of a micro-batch whose rows may exceed ``max_len`` tokens.

    A batch whose rows fit runs as it is. Otherwise every row is cut into :func:`row_windows` (its tokens between the
    special ones, in windows of ``max_len`` tokens with the special tokens around each, overlapping by ``stride``),
    all windows of the micro-batch run in one forward, and every token takes the logits of the window with the best
    :func:`max_context_score`. The special and pad positions keep the first window's logits at the same offset or
    zeros (their labels are -100)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.shape[1] <= max_len:
        return model(**model_inputs(batch)).logits.float()
    prefix, suffix = batch["window_prefix"][0].tolist(), batch["window_suffix"][0].tolist()
    p = len(prefix)
    pieces, owners = [], []  # window ids; (row, start, count of tokens between the special ones)
    for row, n in enumerate(mask.sum(dim=1).tolist()):
        for start, window in row_windows(ids[row, :n].tolist(), prefix, suffix, max_len, stride):
            pieces.append(window)
            owners.append((row, start, len(window) - len(prefix) - len(suffix)))
    longest = max(len(x) for x in pieces)
    win_ids = ids.new_zeros((len(pieces), longest))
    win_mask = torch.zeros_like(win_ids)
    for k, x in enumerate(pieces):
        win_ids[k, :len(x)] = torch.tensor(x, dtype=ids.dtype)
        win_mask[k, :len(x)] = 1
    extra = {"token_type_ids": torch.zeros_like(win_ids)} if "token_type_ids" in batch else {}
    logits = model(input_ids=win_ids.to(ids.device), attention_mask=win_mask.to(ids.device), **extra).logits.float()
    out = logits.new_zeros(ids.shape[0], ids.shape[1], logits.shape[-1])
    best = torch.full(ids.shape, -1.0, dtype=torch.float64)
    source = torch.full(ids.shape, -1, dtype=torch.long)
    for k, (row, start, count) in enumerate(owners):
        positions = torch.arange(start, start + count)
        score = max_context_score(start, count, positions.double())
        better = score > best[row, p + positions]
        best[row, p + positions[better]] = score[better]
        source[row, p + positions[better]] = k
    for k, (row, start, count) in enumerate(owners):
        at = (source[row] == k).nonzero().flatten()
        out[row, at.to(out.device)] = logits[k, (at - start).to(out.device)]
    return out


def forward(model, batch: dict, metrics: bool = False, *, max_len: int = 512, stride: int = 128) -> LossOutput:
    """Token-classification loss of one micro-batch: cross-entropy of the per-token logits (float32,
    :func:`windowed_logits`) summed over the tokens whose ``labels`` [B, T] is not -100.

    Args:
        model: the engine (or a transformers token classifier).
        batch: :func:`make_collator`'s keys.
        metrics: also return token accuracy (``accuracy``) and, in ``LossOutput.counts``, the entity counts
            ``[types, 3]`` (float64: true positives, predicted, gold per entity type of the config's ``id2label``)
            for :func:`eval_report`.
        max_len, stride: ``data.max_seq_len`` and ``data.doc_stride`` (bound by :func:`configure`).
    """
    labels = batch["labels"]
    logits = windowed_logits(model, batch, max_len, stride)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    n = count_targets(batch)
    if not metrics:
        return LossOutput(loss, n)
    labelled = labels != -100
    predicted = logits.argmax(dim=-1)
    correct = ((predicted == labels) & labelled).sum()
    id2label = getattr(model, "module", model).config.id2label
    return LossOutput(loss, n, {"accuracy": (correct, n)},
                      entity_counts(predicted, labels, batch["word_starts"], id2label))


def entity_counts(predicted: torch.Tensor, labels: torch.Tensor, word_starts: torch.Tensor,
                  id2label: dict) -> torch.Tensor:
    """Entity counts ``[types, 3]`` (float64: true positives, predicted entities, gold entities per type of
    :func:`entity_types`, sorted) over the rows' words (``word_starts`` 1 and a label), entities from ``seqeval``'s
    ``get_entities`` per sentence; no types (int tags): ``[0, 3]``."""
    from seqeval.metrics.sequence_labeling import get_entities

    types = entity_types(id2label)
    index = {t: i for i, t in enumerate(types)}
    counts = torch.zeros(len(types), 3, dtype=torch.float64)
    if not types:
        return counts
    words = (word_starts == 1) & (labels != -100)
    for row in range(labels.shape[0]):
        at = words[row].nonzero().flatten()
        if at.numel() == 0:
            continue
        gold = set(get_entities([id2label[int(i)] for i in labels[row, at]]))
        pred = set(get_entities([id2label[int(i)] for i in predicted[row, at]]))
        for kind, found in ((2, gold), (1, pred), (0, gold & pred)):
            for name, _, _ in found:
                if name in index:
                    counts[index[name], kind] += 1
    return counts


def _prf(tp: float, pred: float, gold: float) -> tuple[float, float, float]:
    precision = tp / pred if pred else 0.0
    recall = tp / gold if gold else 0.0
    return precision, recall, (2 * precision * recall / (precision + recall) if precision + recall else 0.0)


def eval_report(counts: torch.Tensor, model_config) -> tuple[dict[str, float], dict]:
    """Entity precision, recall and F1 overall (micro-averaged, seqeval's ``micro avg``) from the summed
    :func:`entity_counts`, and the per-type table.

    Returns:
        ``({"precision", "recall", "f1"}, {"entities": {type: {precision, recall, f1, support}}})``; no entity
        types (int tags): ``({}, {})``.
    """
    types = entity_types(getattr(model_config, "id2label", None) or {})
    if not types or counts.numel() == 0:
        return {}, {}
    c = counts.double()
    table = {}
    for i, t in enumerate(types):
        p, r, f = _prf(*c[i].tolist())
        table[t] = {"precision": p, "recall": r, "f1": f, "support": int(c[i, 2])}
    p, r, f = _prf(*c.sum(0).tolist())
    return {"precision": p, "recall": r, "f1": f}, {"entities": table}


def count_targets(batch: dict) -> torch.Tensor:
    """Labelled tokens (``labels != -100``) of the micro-batch; 0-dim int64."""
    return (batch["labels"] != -100).sum()


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """Bind ``data.max_seq_len`` and ``data.doc_stride`` (the windows of long rows) into ``forward``."""
    import dataclasses

    return dataclasses.replace(recipe, forward=functools.partial(forward, max_len=cfg.data.max_seq_len,
                                                                 stride=cfg.data.doc_stride))


RECIPE = Recipe(name="token_cls", model_class=MODEL_CLASS,
                capabilities=Capabilities(eval_metrics=("accuracy", "precision", "recall", "f1"),
                                          reports_perplexity=False, mixes_sources=False, checks_columns=True,
                                          label_head=True, counts_rows=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, columns=columns,
                cache_key=cache_key, check_data=check_tags, check_tokenizer=check_window, prepare_model_config=prepare_model_config,
                eval_report=eval_report)
