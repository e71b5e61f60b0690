"""Extractive question answering (SQuAD 1.1 and 2.0) with any ``AutoModelForQuestionAnswering``.

Rows are SQuAD's form as Hugging Face ``datasets`` has it: ``data.question_column``, ``data.context_column`` (text)
and ``data.answers_column`` = ``{text: [str], answer_start: [int]}`` (character offsets into the context; empty lists
for an unanswerable question, allowed with ``data.version_2_with_negative``). ``scripts/make_squad_data.py`` turns
SQuAD's JSON files into such parquet files.

Each question is one row, tokenized as transformers' ``run_qa.py`` tokenizes it (``prepare_train_features``): the
question (left-stripped) and the context as a pair, the context cut into windows of ``data.max_seq_len`` tokens that
overlap by ``data.doc_stride`` (the fast tokenizer's ``return_overflowing_tokens`` with ``truncation="only_second"``),
and each window labelled with the first answer's start and end tokens, or the first token (``[CLS]``) when the answer
is not wholly inside the window or the question has none. A row keeps all its windows together, so evaluation sees
every window of a question in the same micro-batch and rank.

Loss (``forward``): per window, the mean of the start and end cross-entropies over the window's real tokens (the
padding is masked, so the loss does not depend on how wide a micro-batch is padded), summed over windows;
``count_targets`` counts the windows, so the loss is the exact mean over the global batch's windows ("per span", the
weighting of ``run_qa.py`` with ``Trainer``) whatever the ranks and accumulation.

Evaluation: ``run_qa.py``'s post-processing (``utils_qa.postprocess_qa_predictions``): in every window, the
``data.n_best_size`` best start and end tokens are paired into spans of the context at most
``data.max_answer_length`` tokens long, scored by the sum of their logits; with ``data.version_2_with_negative`` the
null answer (the smallest ``[CLS]`` score over the windows) is predicted when its score minus the best span's
exceeds ``data.null_score_diff_threshold``. Exact match and F1 are those of the official SQuAD 2.0 evaluation script
(answers normalized: lower case, punctuation and articles removed; the best over the gold answers; an unanswerable
question's gold answer the empty string), averaged over questions: ``eval/exact_match`` and ``eval/f1`` (fractions,
not percentages), with ``data.version_2_with_negative`` also ``eval/has_answer_f1`` and ``eval/no_answer_exact``.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter, defaultdict

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from transformers import AutoModelForQuestionAnswering

from finetune.config import DataConfig, RunConfig
from finetune.data.batch import LossOutput, model_inputs
from finetune.data.dataset import file_schemas, missing_columns
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common.fast_tokenizer import require_fast
from finetune.recipes.common.widths import by_width

MODEL_CLASS = AutoModelForQuestionAnswering


# -- the official SQuAD 2.0 evaluation script's answer comparison (Rajpurkar et al. 2018, evaluate-v2.0.py) --------

PUNCTUATION = frozenset(string.punctuation)
"""What SQuAD's ``normalize_answer`` removes besides articles."""


def normalize_answer(s: str) -> str:
    """Lower case, punctuation and the articles a/an/the removed, whitespace collapsed (SQuAD's ``normalize_answer``)."""
    s = "".join(ch for ch in s.lower() if ch not in PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s, flags=re.UNICODE).split())


def exact_match(gold: str, pred: str) -> int:
    """1 when the normalized answers are equal, else 0 (SQuAD's ``compute_exact``)."""
    return int(normalize_answer(gold) == normalize_answer(pred))


def f1_score(gold: str, pred: str) -> float:
    """Token-overlap F1 of the normalized answers; 1 or 0 when either is empty, by whether both are (SQuAD 2.0's
    ``compute_f1``)."""
    gold_toks, pred_toks = normalize_answer(gold).split(), normalize_answer(pred).split()
    if not gold_toks or not pred_toks:
        return float(gold_toks == pred_toks)
    same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def scores(golds: list[str], pred: str) -> tuple[int, float]:
    """(exact match, F1) of ``pred``, each the best over the gold answers that normalize to something; none: the
    empty answer (an unanswerable question)."""
    golds = [g for g in golds if normalize_answer(g)] or [""]
    return max(exact_match(g, pred) for g in golds), max(f1_score(g, pred) for g in golds)


# -- data ------------------------------------------------------------------------------------------------------------

def prepare_tokenizer(tokenizer):
    """The tokenizer, checked to be a fast one (character offsets map answers to tokens; overflowing windows) that
    can pad.

    Raises:
        ConfigError: a slow (Python) tokenizer, or one without a pad token.
    """
    return require_fast(tokenizer, "qa", "character offsets to map answers to tokens")


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns read: the question, the context and the answers."""
    return [data_cfg.question_column, data_cfg.context_column, data_cfg.answers_column]


def cache_key(data_cfg: DataConfig) -> dict:
    """Settings that decide the tokenized rows besides files, columns and ``max_seq_len``: the windows' overlap."""
    return {"doc_stride": data_cfg.doc_stride}


def _is_text(t) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _answers_problem(key: str, f: str, col, column: str) -> str | None:
    t = col.type
    names = {t.field(i).name: t.field(i).type for i in range(t.num_fields)} if pa.types.is_struct(t) else {}
    ok = ("text" in names and "answer_start" in names
          and all(pa.types.is_list(x) or pa.types.is_large_list(x) for x in names.values()))
    if not ok or not _is_text(names["text"].value_type) or not pa.types.is_integer(names["answer_start"].value_type):
        return (f"{key}: '{f}' column '{column}' holds {t}; qa needs SQuAD's form, a struct of 'text' (a list of "
                f"strings) and 'answer_start' (a list of ints: character offsets into the context)")
    return None


def check_answers(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check questions, contexts and answers before any model is built; append one line per problem, naming the file,
    the row and the column.

    Problems: a missing column; a question or context that is not text, or is null or empty; answers not in SQuAD's
    form; a row whose answer texts and starts differ in count; an answer whose text is not the context's characters
    at its start (``context[start:start + len(text)]``); a row without an answer when ``data.version_2_with_negative``
    is off.
    """
    d = cfg.data
    q_col, c_col, a_col = d.question_column, d.context_column, d.answers_column
    for key, f, schema in file_schemas(train_files, validation_files):
        line = missing_columns(key, f, schema, [q_col, c_col, a_col],
                               "qa reads data.question_column, data.context_column and data.answers_column")
        if line:
            problems.append(line)
            continue
        table = pq.read_table(f, columns=[q_col, c_col, a_col])
        bad = [f"{key}: '{f}' column '{c}' holds {table.column(c).type} values; qa needs text"
               for c in (q_col, c_col) if not _is_text(table.column(c).type)]
        bad += [p for p in [_answers_problem(key, f, table.column(a_col), a_col)] if p]
        if bad:
            problems.extend(bad)
            continue
        for c in (q_col, c_col):
            empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(table.column(c))), 0), True)
            if pc.any(empty).as_py():
                row = empty.to_pylist().index(True)
                problems.append(f"{key}: '{f}' row {row} column '{c}' is empty; every row needs a question and a "
                                f"context")
                break
        else:
            line = _first_bad_answer(key, f, table, d)
            if line:
                problems.append(line)


def _first_bad_answer(key: str, f: str, table, d: DataConfig) -> str | None:
    contexts = table.column(d.context_column).to_pylist()
    for row, (context, answers) in enumerate(zip(contexts, table.column(d.answers_column).to_pylist())):
        texts = (answers or {}).get("text") or []
        starts = (answers or {}).get("answer_start") or []
        where = f"{key}: '{f}' row {row} column '{d.answers_column}'"
        if len(texts) != len(starts):
            return f"{where} has {len(texts)} answer texts and {len(starts)} answer_start values; give one start each"
        if not texts and not d.version_2_with_negative:
            return (f"{where} has no answer; set data.version_2_with_negative: true for SQuAD 2.0-style unanswerable "
                    f"questions, or leave the row out")
        for text, start in zip(texts, starts):
            if text is None or start is None or not 0 <= start <= len(context) \
                    or context[start:start + len(text)] != text:
                found = context[start:start + len(text or "")] if start is not None and start >= 0 else ""
                return (f"{where}: answer {text!r} at answer_start {start} does not match the context there "
                        f"({found!r}); answer_start is the character offset of the answer text in the context")
    return None


def check_window(tokenizer, cfg: RunConfig, problems: list[str]) -> None:
    """``data.doc_stride`` must be below ``data.max_seq_len`` minus the special tokens of a pair, and the evaluation
    settings in range."""
    d = cfg.data
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    if not 0 <= d.doc_stride < d.max_seq_len - specials:
        problems.append(f"data.doc_stride: {d.doc_stride}, but windows of data.max_seq_len {d.max_seq_len} hold "
                        f"{d.max_seq_len - specials} tokens besides the special ones (question and context); the "
                        f"overlap must be at least 0 and well below that")
    for name in ("max_answer_length", "n_best_size"):
        if getattr(d, name) < 1:
            problems.append(f"data.{name}: {getattr(d, name)}; it must be at least 1")


def prepare_model_config(model_config, data_cfg: DataConfig):
    """Two outputs per token (start and end logits: ``num_labels`` sizes transformers' ``qa_outputs``)."""
    model_config.num_labels = 2
    return model_config


class Tokenize:
    """Batched map function: each question and its context -> one row holding all its windows (``run_qa.py``'s
    ``prepare_train_features`` and ``prepare_validation_features`` in one):

    ``input_ids`` (and ``token_type_ids``): the windows' tokens, one after the other; ``window_lengths``: tokens per
    window; ``start_positions``, ``end_positions``: the first answer's first and last token in each window, 0
    (``[CLS]``) where it is not wholly inside or there is none; ``offset_starts``, ``offset_ends``: each token's
    character span in the context, -1 for the question's and the special tokens; ``qa_context`` and ``qa_answers``
    (the context and the gold answer texts, for evaluation). Rows whose question leaves no room for the context are
    left out and counted (:meth:`summary`)."""

    def __init__(self, tokenizer, data_cfg: DataConfig):
        self.tokenizer, self.d = tokenizer, data_cfg
        self.question_first = tokenizer.padding_side == "right"  # run_qa.py's pad_on_right
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def _encode(self, questions: list[str], contexts: list[str]):
        pair = (questions, contexts) if self.question_first else (contexts, questions)
        return self.tokenizer(*pair, truncation="only_second" if self.question_first else "only_first",
                              max_length=self.d.max_seq_len, stride=self.d.doc_stride,
                              return_overflowing_tokens=True, return_offsets_mapping=True)

    def __call__(self, batch: dict) -> dict:
        d = self.d
        questions = [str(q).lstrip() for q in batch[d.question_column]]
        contexts = [str(c) for c in batch[d.context_column]]
        answers = batch[d.answers_column]
        self.counts["rows"] += len(questions)
        try:
            keep, enc = list(range(len(questions))), self._encode(questions, contexts)
        except Exception:  # noqa: BLE001  (a question longer than the window: find it row by row)
            keep = []
            for i in range(len(questions)):
                try:
                    self._encode([questions[i]], [contexts[i]])
                    keep.append(i)
                except Exception:  # noqa: BLE001
                    self.counts["long question"] += 1
            enc = self._encode([questions[i] for i in keep], [contexts[i] for i in keep]) if keep else None
        names = ["input_ids", "window_lengths", "start_positions", "end_positions", "offset_starts", "offset_ends",
                 "qa_context", "qa_answers"]
        if enc is not None and "token_type_ids" in enc:
            names.append("token_type_ids")
        out: dict[str, list] = {k: [[] for _ in keep] for k in names}
        out["qa_context"] = [contexts[i] for i in keep]
        out["qa_answers"] = [[str(t) for t in (answers[i] or {}).get("text") or []] for i in keep]
        if enc is None:
            return out
        side = 1 if self.question_first else 0
        for w, j in enumerate(enc["overflow_to_sample_mapping"]):
            ids, offsets, seq = enc["input_ids"][w], enc["offset_mapping"][w], enc.sequence_ids(w)
            start, end = self._label(ids, offsets, seq, side, answers[keep[j]])
            out["input_ids"][j].extend(ids)
            if "token_type_ids" in enc:
                out["token_type_ids"][j].extend(enc["token_type_ids"][w])
            out["window_lengths"][j].append(len(ids))
            out["start_positions"][j].append(start)
            out["end_positions"][j].append(end)
            out["offset_starts"][j].extend(o[0] if s == side else -1 for o, s in zip(offsets, seq))
            out["offset_ends"][j].extend(o[1] if s == side else -1 for o, s in zip(offsets, seq))
            self.counts["windows"] += 1
            self.counts["answer outside"] += bool(start == 0 and ((answers[keep[j]] or {}).get("text") or []))
        self.counts["kept"] += len(keep)
        return out

    def _label(self, ids, offsets, seq, side, answers) -> tuple[int, int]:
        """``run_qa.py``'s labels of one window: the first answer's first and last token, or ``[CLS]`` twice."""
        cls = ids.index(self.tokenizer.cls_token_id) if self.tokenizer.cls_token_id in ids else 0
        texts, starts = (answers or {}).get("text") or [], (answers or {}).get("answer_start") or []
        if not texts:
            return cls, cls
        start_char = starts[0]
        end_char = start_char + len(texts[0])
        first = seq.index(side)
        last = len(seq) - 1 - seq[::-1].index(side)
        if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
            return cls, cls
        while first < len(offsets) and offsets[first][0] <= start_char:
            first += 1
        while offsets[last][1] >= end_char:
            last -= 1
        return first - 1, last + 1

    def summary(self) -> str:
        """One line: rows read, questions kept, windows, answers not inside a window."""
        c = self.counts
        return (f"qa: {c['rows']:,} rows, {c['kept']:,} questions kept ({c['long question']:,} whose question leaves "
                f"no room for the context in data.max_seq_len={self.d.max_seq_len} left out) in {c['windows']:,} "
                f"windows (data.doc_stride={self.d.doc_stride}); {c['answer outside']:,} windows of answerable "
                f"questions do not hold the answer (labelled at [CLS])")


def tokenize_function(tokenizer, data_cfg: DataConfig) -> Tokenize:
    """:class:`Tokenize` for ``datasets.Dataset.map(batched=True)``."""
    return Tokenize(tokenizer, data_cfg)


def _chars(texts: list[str], width: int | None = None) -> torch.Tensor:
    """Texts as Unicode code points, int32 ``[n, longest]`` padded with -1 (strings ride in the batch as tensors)."""
    width = width if width is not None else max([len(t) for t in texts] + [1])
    out = torch.full((len(texts), width), -1, dtype=torch.int32)
    for i, t in enumerate(texts):
        if t:
            out[i, :len(t)] = torch.tensor([ord(ch) for ch in t], dtype=torch.int32)
    return out


def _text(chars: torch.Tensor) -> str:
    return "".join(map(chr, chars[chars >= 0].tolist()))


def make_collator(tokenizer, data_cfg: DataConfig):
    """Collates rows into the micro-batch of all their windows, each padded to the longest window
    (``data.pad_to_multiple_of``): ``input_ids``, ``attention_mask`` (+ ``token_type_ids``) int64 ``[W, T]``;
    ``start_positions``, ``end_positions`` and ``window_row`` (the row of each window) int64 ``[W]``; ``offsets``
    int64 ``[W, T, 2]`` (character spans of context tokens, -1 elsewhere); ``labels`` int64 ``[B]`` (0; -100 marks
    evaluation filler rows); ``context_chars`` int32 ``[B, C]`` and ``answer_chars`` int32 ``[B, A, L]`` (the
    contexts and gold answers as code points, -1 padded)."""
    pad_id = tokenizer.pad_token_id
    multiple = data_cfg.pad_to_multiple_of

    def collate(rows: list[dict]) -> dict:
        windows = []  # (row, offset into the row's tokens, length)
        for r, row in enumerate(rows):
            at = 0
            for n in row["window_lengths"]:
                windows.append((r, at, n))
                at += n
        width = max(n for _, _, n in windows)
        width = -(-width // multiple) * multiple if multiple else width
        w = len(windows)
        batch = {"input_ids": torch.full((w, width), pad_id, dtype=torch.long),
                 "attention_mask": torch.zeros((w, width), dtype=torch.long)}
        if "token_type_ids" in rows[0]:
            batch["token_type_ids"] = torch.zeros((w, width), dtype=torch.long)
        offsets = torch.full((w, width, 2), -1, dtype=torch.long)
        for k, (r, at, n) in enumerate(windows):
            row = rows[r]
            batch["input_ids"][k, :n] = torch.tensor(row["input_ids"][at:at + n])
            batch["attention_mask"][k, :n] = 1
            if "token_type_ids" in batch:
                batch["token_type_ids"][k, :n] = torch.tensor(row["token_type_ids"][at:at + n])
            offsets[k, :n, 0] = torch.tensor(row["offset_starts"][at:at + n])
            offsets[k, :n, 1] = torch.tensor(row["offset_ends"][at:at + n])
        batch["offsets"] = offsets
        batch["start_positions"] = torch.tensor([p for row in rows for p in row["start_positions"]], dtype=torch.long)
        batch["end_positions"] = torch.tensor([p for row in rows for p in row["end_positions"]], dtype=torch.long)
        batch["window_row"] = torch.tensor([r for r, _, _ in windows], dtype=torch.long)
        batch["labels"] = torch.zeros(len(rows), dtype=torch.long)
        batch["context_chars"] = _chars([row["qa_context"] for row in rows])
        answers = [row["qa_answers"] or [""] for row in rows]
        most, longest = max(len(a) for a in answers), max(len(t) for a in answers for t in a) or 1
        batch["answer_chars"] = torch.stack([_chars(a + [""] * (most - len(a)), longest) for a in answers])
        return batch

    return collate


def real_windows(batch: dict) -> torch.Tensor:
    """``[W]`` bool: the window belongs to a real row (evaluation filler rows have ``labels`` -100)."""
    return batch["labels"][batch["window_row"]] != -100


def count_targets(batch: dict) -> torch.Tensor:
    """Windows of real rows in the micro-batch; 0-dim int64."""
    return real_windows(batch).sum()


def span_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and end logits ``[W, T]`` (float32) of the micro-batch's windows, padding positions at the float32
    minimum (no probability), so that a window's softmax does not depend on the micro-batch's width.

    A question's windows stay in one micro-batch, and a long context's last window is usually short: the model
    runs once per :func:`finetune.recipes.common.widths.width_groups` group, each group's windows cut to its own
    width: the same logits on the real tokens, fewer padded positions computed."""
    mask = batch["attention_mask"]
    low = torch.finfo(torch.float32).min
    start = torch.full(mask.shape, low, dtype=torch.float32, device=mask.device)
    end = torch.full(mask.shape, low, dtype=torch.float32, device=mask.device)
    for index, part, out in by_width(model, model_inputs(batch), mask):
        width, real = part.shape[1], part != 0
        start[index, :width] = out.start_logits.float().masked_fill(~real, low)
        end[index, :width] = out.end_logits.float().masked_fill(~real, low)
    return start, end


def forward(model, batch: dict, metrics: bool = False, *, n_best: int = 20, max_answer: int = 30,
            with_null: bool = False, null_threshold: float = 0.0) -> LossOutput:
    """QA loss of one micro-batch: per window, (cross-entropy of the start logits at ``start_positions`` + that of
    the end logits at ``end_positions``) / 2 (``BertForQuestionAnswering``'s ``total_loss`` of one window), summed
    over the windows of real rows.

    Args:
        model: the engine (or a transformers question-answering model).
        batch: :func:`make_collator`'s keys.
        metrics: also return ``exact_match`` and ``f1`` (sums over the real rows' questions, :func:`predict` then
            :func:`scores`), with ``with_null`` also ``has_answer_f1`` (over answerable questions) and
            ``no_answer_exact`` (over unanswerable ones).
        n_best, max_answer, with_null, null_threshold: ``data.n_best_size``, ``data.max_answer_length``,
            ``data.version_2_with_negative``, ``data.null_score_diff_threshold`` (bound by :func:`configure`).
    """
    start, end = span_logits(model, batch)
    real = real_windows(batch)
    per_window = (F.cross_entropy(start, batch["start_positions"], reduction="none")
                  + F.cross_entropy(end, batch["end_positions"], reduction="none")) / 2
    loss = torch.where(real, per_window, torch.zeros_like(per_window)).sum()
    n = real.sum()
    if not metrics:
        return LossOutput(loss, n)
    sums = defaultdict(float)
    starts, ends = start.cpu(), end.cpu()
    offsets, rows = batch["offsets"].cpu(), batch["window_row"].cpu()
    labels = batch["labels"].cpu()
    for r in range(labels.shape[0]):
        if labels[r] == -100:
            continue
        at = (rows == r).nonzero().flatten()
        context = _text(batch["context_chars"][r].cpu())
        golds = [g for g in (_text(a) for a in batch["answer_chars"][r].cpu()) if g]
        pred = predict(starts[at], ends[at], offsets[at], context, n_best, max_answer, with_null, null_threshold)
        em, f1 = scores(golds, pred)
        sums["exact_match"] += em
        sums["f1"] += f1
        sums["questions"] += 1
        if with_null:
            has = bool([g for g in golds if normalize_answer(g)])
            sums["has_answer_f1"] += f1 if has else 0.0
            sums["answerable"] += has
            sums["no_answer_exact"] += em if not has else 0
            sums["unanswerable"] += not has
    dev = loss.device

    def pair(num: str, den: str):
        return (torch.tensor(sums[num], dtype=torch.float64, device=dev),
                torch.tensor(sums[den], dtype=torch.float64, device=dev))

    out = {"exact_match": pair("exact_match", "questions"), "f1": pair("f1", "questions")}
    if with_null:
        out.update(has_answer_f1=pair("has_answer_f1", "answerable"),
                   no_answer_exact=pair("no_answer_exact", "unanswerable"))
    return LossOutput(loss, n, out)


def predict(start: torch.Tensor, end: torch.Tensor, offsets: torch.Tensor, context: str, n_best: int = 20,
            max_answer: int = 30, with_null: bool = False, null_threshold: float = 0.0) -> str:
    """The answer to one question from the logits of its windows (``run_qa.py``'s
    ``postprocess_qa_predictions``).

    Args:
        start, end: ``[windows, T]`` float start and end logits (padding at a very low value).
        offsets: ``[windows, T, 2]`` int character spans of the context tokens, -1 elsewhere.
        context: the context the spans index.
        n_best: best start and end tokens per window paired into spans; spans kept before choosing.
        max_answer: longest span in tokens.
        with_null: the null answer (``""``) may be predicted, when the smallest ``[CLS]`` score over the windows
            minus the best span's score exceeds ``null_threshold``.

    Returns:
        The answer text: a span of ``context``, ``""`` (the null answer), or ``"empty"`` when no span is valid
        (``run_qa.py``'s placeholder).
    """
    null_score, spans = None, []
    for s_log, e_log, off in zip(start.tolist(), end.tolist(), offsets.tolist()):
        score = s_log[0] + e_log[0]
        if null_score is None or null_score[0] > score:
            null_score = (score, s_log[0], e_log[0])
        top_s = sorted(range(len(s_log)), key=lambda i: s_log[i], reverse=True)[:n_best]
        top_e = sorted(range(len(e_log)), key=lambda i: e_log[i], reverse=True)[:n_best]
        for i in top_s:
            for j in top_e:
                if off[i][0] < 0 or off[j][0] < 0 or j < i or j - i + 1 > max_answer:
                    continue
                spans.append((s_log[i] + e_log[j], (off[i][0], off[j][1]), s_log[i], e_log[j]))
    if with_null:
        spans.append((null_score[0], None, null_score[1], null_score[2]))
    best = sorted(spans, key=lambda x: x[0], reverse=True)[:n_best]
    texts = [("" if where is None else context[where[0]:where[1]], s, e) for _, where, s, e in best]
    if not texts or (len(texts) == 1 and texts[0][0] == ""):
        texts.insert(0, ("empty", 0.0, 0.0))
    if not with_null:
        return texts[0][0]
    text, s, e = next(t for t in texts if t[0] != "")
    return "" if null_score[0] - s - e > null_threshold else text


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """Bind the evaluation's post-processing settings (``data.n_best_size``, ``data.max_answer_length``,
    ``data.version_2_with_negative``, ``data.null_score_diff_threshold``) into ``forward``."""
    import dataclasses

    d = cfg.data
    return dataclasses.replace(recipe, forward=functools.partial(
        forward, n_best=d.n_best_size, max_answer=d.max_answer_length, with_null=d.version_2_with_negative,
        null_threshold=d.null_score_diff_threshold))


RECIPE = Recipe(name="qa", model_class=MODEL_CLASS,
                capabilities=Capabilities(eval_metrics=("exact_match", "f1", "has_answer_f1", "no_answer_exact"),
                                          reports_perplexity=False, mixes_sources=False, checks_columns=True,
                                          label_head=True, counts_rows=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, columns=columns,
                cache_key=cache_key, check_data=check_answers, check_tokenizer=check_window,
                prepare_model_config=prepare_model_config)
