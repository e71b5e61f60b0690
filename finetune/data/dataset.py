"""Parquet files -> tokenized ``datasets.Dataset`` (cached) -> per-rank DataLoaders.

* Files are checked before anything heavy runs (:func:`check_parquet_files`, footers only): a glob that
  matches nothing, an unreadable or empty file, a missing text column (the error lists the columns), a
  text column that is not of a string type (its type is named), or one whose statistics show no text.
* Tokenization (:func:`load_splits`, run by :mod:`finetune.data.tokenization`) goes into a cache entry whose name
  hashes everything that decides its content (files with size and mtime, tokenizer files, recipe, lengths,
  split), so a second run with the same inputs loads it instead of tokenizing. Rows with a null, empty or
  whitespace text are dropped and counted (:class:`DropEmptyText`); a split left without rows is an error. Each
  node's local rank 0 tokenizes with ``data.num_proc`` processes (the nodes share the work when they share the
  cache folder) while the other ranks wait on their own process group whose timeout is
  ``data.tokenize_timeout_minutes``, not ``train.dist_timeout_minutes``; then every rank reads the same entry.
* Training uses :class:`ResumableDistributedSampler` (``DistributedSampler`` + skip of the batches
  already consumed when resuming mid-epoch) with ``set_epoch`` every epoch; batches are padded per
  batch by the recipe's collator, never to a global maximum. With ``data.group_by_length`` (default, for
  rows of different lengths) the epoch's order is length-grouped per GLOBAL batch (:func:`grouped_order`):
  every rank's micro-batches of one optimizer step come from one length bucket, so little is padding and
  no rank waits in the gradient all-reduce for a wider batch.
* Rank ``r`` takes rows ``r, r + W, r + 2W, ...`` of the epoch's global order (``W`` ranks), so optimizer
  step ``s`` trains on rows ``[s * G, (s + 1) * G)`` of that order (``G`` = global batch) whatever the
  world size or the micro-batch/accumulation split (the parity battery relies on it).
* Rows reach the collator with their row index (:class:`IndexedRows`, :class:`_EvalShard`), and
  :class:`RowSeededCollate` turns it into a per-row seed ``row_seed(train.seed, epoch, index)`` for
  collators that draw random numbers (MLM masks). A row is therefore masked the same way whichever
  rank, micro-batch or DataLoader worker collates it: batches do not depend on the world size, on
  ``micro_batch_size x gradient_accumulation_steps`` or on RNG state (exact resume with workers).
* Evaluation shards the validation rows across ranks without duplicates: the shorter shards are
  topped up with flagged filler rows whose labels are set to -100, so every rank runs the same number
  of forward passes (needed by ZeRO-3) and metrics count each row once.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from finetune.parallel import distributed as dist_utils
from finetune.data import mixture as mixture_lib
from finetune.data.batch import flatten, flattens
from finetune.parallel import layout, sequence
from finetune.data import tokenization
from finetune.config import DataConfig, RunConfig
from finetune.errors import ConfigError
from finetune.logs import logger


def expand_files(patterns: list, key: str, problems: list[str]) -> list[str]:
    """Expand file names and globs (sorted, deduplicated); a pattern matching nothing is a problem."""
    files: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(str(pat)), recursive=True))
        if not hits:
            problems.append(f"{key}: '{pat}' matches no file")
        files += [h for h in hits if h not in files]
    return files


def string_type(typ) -> bool:
    """True for Arrow string columns (``string``, ``large_string``, ``string_view``, dictionary of strings)."""
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return pa.types.is_string(typ) or pa.types.is_large_string(typ) or getattr(pa.types, "is_string_view",
                                                                               lambda t: False)(typ)


def _no_text_in_statistics(pf, column: str) -> bool:
    """True when the footer statistics prove that ``column`` holds no non-empty text in any row group.

    Uses only exact facts: a null count equal to the row count, or a maximum value of ``""``. A file
    without statistics (or with whitespace-only texts) passes here; tokenization drops and counts such rows.
    """
    index = pf.schema_arrow.get_field_index(column)
    leaves = [i for i in range(pf.metadata.num_columns)
              if pf.metadata.schema.column(i).path.split(".")[0] == column]
    if index < 0 or len(leaves) != 1:
        return False
    for g in range(pf.metadata.num_row_groups):
        group = pf.metadata.row_group(g)
        stats = group.column(leaves[0]).statistics
        if group.num_rows == 0:
            continue
        if stats is None:
            return False
        all_null = stats.has_null_count and stats.null_count == group.num_rows
        try:
            all_empty = stats.has_min_max and stats.max in ("", b"")
        except UnicodeDecodeError:  # a maximum that is not UTF-8: text of some kind (check_utf8 names the row)
            return False
        if not (all_null or all_empty):
            return False
    return True


@functools.lru_cache(maxsize=16)
def _read_column(path: str, column: str, mtime_ns: int):
    return pq.read_table(path, columns=[column]).column(column)


def read_column(path: str, column: str):
    """The ``column`` of parquet file ``path`` as a ``pyarrow.ChunkedArray``, read once per file version (a recipe's
    label set and its checks read the same column)."""
    return _read_column(os.path.abspath(path), column, os.stat(path).st_mtime_ns)


def sorted_values(patterns: list, key: str, column: str, flatten: bool = False) -> list:
    """The sorted distinct non-null values of ``column`` over the files ``patterns`` match (``key``: their setting);
    ``flatten``: a list column's elements (a tag per word).

    Raises:
        ConfigError: a pattern matches no file.
    """
    problems: list[str] = []
    files = expand_files(patterns, key, problems)
    if problems:
        raise ConfigError(problems)
    values: set = set()
    for f in files:
        col = read_column(f, column)
        values |= set((pc.list_flatten(col) if flatten else col).unique().to_pylist())
    values.discard(None)
    return sorted(values)


def file_schemas(train_files: list[str], validation_files: list[str]):
    """``(key, file, arrow schema)`` of every readable training and validation file (``key``: ``data.train_files``
    or ``data.validation_files``), for a recipe's checks of columns and their types; an unreadable file is left out
    (:func:`check_parquet_files` reports it)."""
    for key, files in (("data.train_files", train_files), ("data.validation_files", validation_files)):
        for f in files:
            try:
                schema = pq.ParquetFile(f).schema_arrow
            except Exception:  # noqa: BLE001  (reported by check_parquet_files)
                continue
            yield key, f, schema


def missing_columns(key: str, f: str, schema, wanted: list[str], reads: str) -> str | None:
    """The one line naming the columns of ``wanted`` that file ``f`` (``key``: its setting) lacks, with the columns it
    has and ``reads`` (what the recipe reads, e.g. "dpo reads data.prompt_column ..."); None when it has them all."""
    missing = [c for c in wanted if c not in schema.names]
    if not missing:
        return None
    return (f"{key}: '{f}' has no column {', '.join(repr(c) for c in missing)} (columns: {', '.join(schema.names)}); "
            f"{reads}")


def file_columns(train_files: list[str], validation_files: list[str]):
    """``(key, file, column names)`` of every readable training and validation file (:func:`file_schemas`)."""
    for key, f, schema in file_schemas(train_files, validation_files):
        yield key, f, schema.names


def check_parquet_files(files: list[str], key: str, text_column: str | None, problems: list[str]) -> int:
    """Open each parquet file's footer: readable, non-empty, has ``text_column`` of a string type with text.

    Reads footers only (schema, row counts, column statistics), never the data. Problems appended: an
    unreadable file, 0 rows, a missing ``text_column`` (the columns are listed), a ``text_column`` whose Arrow
    type is not a string (its type is named: ints, binary, ...), and a ``text_column`` whose statistics show
    that every row is null or empty (``text_column=None``: readability and row counts only, for recipes that
    check their own columns). Returns the total row count.
    """
    rows = 0
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError with varying messages
            problems.append(f"{key}: '{f}' is not a readable parquet file ({type(e).__name__}: {e})")
            continue
        schema = pf.schema_arrow
        names = schema.names
        if text_column is None:  # the recipe checks its own columns (sft)
            if pf.metadata.num_rows == 0:
                problems.append(f"{key}: '{f}' is empty (0 rows)")
        elif text_column not in names:
            problems.append(f"{key}: '{f}' has no column '{text_column}' (columns: {', '.join(names)}); "
                            f"set data.text_column")
        elif pf.metadata.num_rows == 0:
            problems.append(f"{key}: '{f}' is empty (0 rows)")
        elif not string_type(schema.field(text_column).type):
            typ = schema.field(text_column).type
            others = [f"{n} ({schema.field(n).type})" for n in names if string_type(schema.field(n).type)]
            hint = f"string columns: {', '.join(others)}" if others else "the file has no string column"
            problems.append(f"{key}: '{f}' column '{text_column}' has type {typ}, not text (string); "
                            f"set data.text_column to a text column ({hint}) or convert the column to strings")
        elif _no_text_in_statistics(pf, text_column):
            problems.append(f"{key}: '{f}' has no non-empty text: every row of column '{text_column}' is null or "
                            f"empty ({pf.metadata.num_rows:,} rows)")
        if text_column is not None and text_column not in names and pf.metadata.num_rows == 0:
            problems.append(f"{key}: '{f}' is empty (0 rows)")
        rows += pf.metadata.num_rows
    return rows


def _bad_utf8_row(column) -> int | None:
    """Index of the first row of an Arrow array whose strings are not valid UTF-8 (None: every row is valid)."""
    try:
        column.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    for i in range(len(column)):
        try:
            column.slice(i, 1).validate(full=True)
        except pa.ArrowInvalid:
            return i
    return None


def check_utf8(files: list[str], key: str, columns: list[str], problems: list[str], checked: Path | None = None,
               marks: list[Path] | None = None) -> None:
    """Every string in ``columns`` (nested ones too: chat messages) of each file is valid UTF-8.

    Parquet stores strings as bytes and does not check them, so a file written by another tool can hold a
    cell such as ``b"\\xff\\xfe"`` that only fails when the rows become Python strings during tokenization.
    Reads the columns (one record batch at a time) and appends one line per file with such a cell, naming the
    file, the row and the column. Unreadable files and absent columns are skipped (reported elsewhere).

    With ``checked`` (a folder, ``<cache>/checked``), a file found valid gets a mark there named by its
    :func:`file_id` and the columns, and a later check of the same file version skips it: reading every string of
    a gigabyte corpus costs seconds at every launch otherwise. The marks are appended to ``marks`` rather than
    written: the caller writes them with :func:`remember_checked` once the whole input check passed, so a
    launch refused for bad input leaves nothing behind, not even in the cache.
    """
    for f in files:
        mark = None
        if checked is not None:
            try:
                mark = checked / f"utf8-{fingerprint({'file': file_id(f), 'columns': sorted(columns)})}"
            except OSError:  # a missing file is reported elsewhere
                continue
            if mark.exists():
                continue
        found = len(problems)
        try:
            pf = pq.ParquetFile(f)
            present = [c for c in columns if c in pf.schema_arrow.names]
            if not present:
                continue
            start = 0
            for batch in pf.iter_batches(columns=present):
                bad = [(row, c) for c in present if (row := _bad_utf8_row(batch.column(c))) is not None]
                if bad:
                    row, c = min(bad)
                    problems.append(f"{key}: '{f}' row {start + row} column '{c}' is not valid UTF-8 text (bytes "
                                    f"another tool wrote as a string); fix or drop that row, e.g. decode it with "
                                    f"errors='replace' when writing the file")
                    break
                start += batch.num_rows
        except Exception:  # noqa: BLE001  (an unreadable file is reported by check_parquet_files)
            continue
        if mark is not None and marks is not None and len(problems) == found:
            marks.append(mark)


def remember_checked(marks: list[Path]) -> None:
    """Write the marks :func:`check_utf8` collected (empty files); a read-only cache is no error (the check
    simply runs again at the next launch)."""
    for mark in marks:
        with contextlib.suppress(OSError):
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()


def default_cache_dir(data_cfg: DataConfig) -> Path:
    """``data.cache_dir``, else ``$FINETUNE_CACHE``, else ``~/.cache/finetune``."""
    return Path(data_cfg.cache_dir or os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")


def fingerprint(parts: dict) -> str:
    """Cache key of ``parts`` (JSON-able settings and file ids): the first 20 hex digits of its sha256."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_id(path: str) -> list:
    """What identifies a file's version in a cache key: ``[absolute path, size in bytes, mtime in ns]``."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def linked_files(path: str, column: str) -> list[str]:
    """The files that ``column`` of the parquet file ``path`` names by path, in row order, each once: its string
    values (a file path, or a list of them) or the ``path`` fields of ``datasets.Image``'s ``{bytes, path}`` structs
    (those of rows whose bytes win included), a relative one resolved against the parquet file's folder (as
    :func:`finetune.data.images.open_image` reads it). Reads only those string leaves of the column, never the
    image bytes. Empty when ``path`` has no such column or names no file."""
    pf = pq.ParquetFile(path)
    schema = pf.schema
    leaves = [schema.column(i) for i in range(len(schema))]
    picked = [c.path for c in leaves if (c.path == column or c.path.startswith(column + "."))
              and c.physical_type == "BYTE_ARRAY" and str(c.logical_type) == "String"]
    found: dict[str, None] = {}

    def walk(value):
        if isinstance(value, str):
            found.setdefault(value, None)
        elif isinstance(value, dict):
            walk(value.get("path"))
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    for g in range(pf.num_row_groups):
        if picked:
            walk(pf.read_row_group(g, columns=picked).column(0).to_pylist())
    folder = Path(path).parent
    return [str(folder / f) if not Path(f).is_absolute() else f for f in found if f]


def source_id(path: str, linked_column: str | None = None) -> list:
    """What identifies a data file's version in a cache key: :func:`file_id`, and with ``linked_column`` (the image
    column of an image recipe) the version of every file that column names (:func:`linked_files`: ``[path, size,
    mtime]``, or ``[path, None]`` when missing), hashed, so an image file changed on disk misses the cache."""
    if not linked_column:
        return file_id(path)
    linked = []
    for f in linked_files(path, linked_column):
        try:
            linked.append(file_id(f))
        except OSError:
            linked.append([os.path.abspath(f), None])
    return [*file_id(path), fingerprint({"linked": linked})]


def linked_column(d: DataConfig, cols: list[str]) -> str | None:
    """The column whose named files are part of a split's cache key (:func:`source_id`): ``data.image_column``
    when the recipe reads it (``vlm_sft``; ``dpo`` and ``grpo`` on an image-text model), else None."""
    return d.image_column if d.image_column and d.image_column in cols else None


def _tokenizer_id(tokenizer) -> list:
    folder = Path(tokenizer.name_or_path)
    files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []
    return [file_id(str(p)) for p in files] + [tokenizer.pad_token, tokenizer.eos_token]


def tokenization_key(recipe, tokenizer, d: DataConfig) -> dict:
    """What decides a split's tokenized rows besides the rows themselves: recipe, tokenizer files, columns,
    ``data.max_seq_len``, the recipe's own settings (``cache_key``) and the ``datasets`` version; the base of the
    tokenization cache's keys (:func:`load_splits`) and of ``--check``'s marks of splits that give rows."""
    col, cols = d.text_column, recipe.columns(d)
    return {"recipe": recipe.name, "tokenizer": _tokenizer_id(tokenizer), "column": col if cols == [col] else cols,
            "max_seq_len": d.max_seq_len, "recipe_settings": recipe.cache_key(d), "datasets": datasets.__version__,
            "version": 2}


class DropEmptyText:
    """Batched map function around a recipe's ``tokenize_function``: rows whose text is null, empty or
    whitespace are dropped (with all their columns) before the recipe sees the batch, and counted.

    The recipe thus never gets an empty text, nor an empty batch (a batch of only empty rows returns empty
    columns without calling it: tokenizers fail on an empty list). Rows are dropped inside each map batch,
    so a batch holds the same texts as before (packing cuts blocks per batch of 1,000 rows).

    Attributes:
        dropped: number of rows dropped so far (int).
    """

    def __init__(self, fn, column: str):
        self.fn, self.column, self.dropped = fn, column, 0

    def __call__(self, batch: dict) -> dict:
        texts = batch[self.column]
        keep = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
        if len(keep) == len(texts):
            return self.fn(batch)
        self.dropped += len(texts) - len(keep)
        if not keep:  # the output columns, from a one-row stand-in batch (its output is thrown away)
            probe = {k: v[:1] for k, v in batch.items()}
            probe[self.column] = ["x"]
            return {k: [] for k in self.fn(probe)}
        return self.fn({k: [v[i] for i in keep] for k, v in batch.items()})


def row_mapper(recipe, fn, column: str):
    """What a split's rows are mapped with: the recipe's map function ``fn`` itself when the recipe skips and counts
    bad rows (``Capabilities.counts_rows``: sft, dpo, ...), else ``fn`` behind :class:`DropEmptyText` on ``column``.
    :func:`load_splits` and ``--check`` (:func:`finetune.preflight.validate.check_inputs`) both map with it."""
    return fn if recipe.capabilities.counts_rows else DropEmptyText(fn, column)


def no_rows_problem(where: str, key_name: str, name: str, n_in: int, dropped: int, fn, column: str,
                    counts_rows: bool) -> str:
    """The line that refuses a split whose ``n_in`` rows the map function (:func:`row_mapper`) left with no row:
    raised by :func:`load_splits`, reported by ``--check`` and ``finetune doctor`` before any model.

    Args:
        where: the source's prefix (``data.sources[i] (name): ``), or empty.
        key_name: the key that chose the split's rows (``data.train_files``, ``data.validation_files``,
            ``data.validation_fraction``).
        name: ``train`` or ``validation``.
        n_in: rows mapped.
        dropped: of them, rows :class:`DropEmptyText` dropped.
        fn: the recipe's map function (its ``summary()`` when ``counts_rows``).
        column: the text column.
        counts_rows: the recipe counts what it drops (``Capabilities.counts_rows``).
    """
    why = (f"every one of its {n_in:,} texts in column '{column}' is empty or null" if dropped == n_in
           else f"{n_in:,} rows gave no example ({fn.summary()})" if counts_rows
           else f"{n_in:,} texts in column '{column}' gave no row (empty, null, or shorter than one "
                f"data.max_seq_len block when packing)")
    use = "to evaluate on" if name == "validation" else "to train on"
    key = key_name.removeprefix("data.") if where else key_name  # a source's own key
    return f"{where}{key}: the {name} split has no rows {use}: {why}"


def holdout(n_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, validation rows), each sorted (int64 arrays), of ``n_rows`` with ``round(n_rows x fraction)``
    (at least 1) held out by a permutation seeded with ``seed`` (``data.validation_fraction``, ``train.seed``)."""
    perm = np.random.default_rng(seed).permutation(n_rows).astype(np.int64)
    n_val = max(1, int(round(n_rows * fraction)))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def validation_rows(data_cfg: DataConfig, columns: list[str], seed: int, n: int) -> list[dict]:
    """The first ``n`` raw rows (``columns`` only) of the validation split as :func:`load_splits` forms it: the
    validation files, or the held-out share of the training files (same seed, same rows)."""
    problems: list[str] = []
    val_files = expand_files(data_cfg.validation_files, "data.validation_files", problems)
    files = val_files or expand_files(data_cfg.train_files, "data.train_files", problems)
    if problems:
        raise ConfigError(problems)
    source = tokenization.ParquetRows(files, columns)
    rows = np.arange(len(source))
    if not val_files:
        if data_cfg.max_train_rows:
            rows = rows[:data_cfg.max_train_rows]
        rows = np.asarray(holdout(len(rows), data_cfg.validation_fraction, seed)[1], np.int64)
    picked = source.take(rows[:n])
    return [{c: picked[c][i] for c in columns} for i in range(len(rows[:n]))]


@dataclass
class SourceSplit:
    """One source of a mixture in :class:`Splits`: its name, weight and rows in the concatenated splits."""

    name: str
    weight: float
    train_rows: int  # its training rows (they follow the previous sources' in ``Splits.train``)
    validation_rows: int  # likewise in ``Splits.validation``


@dataclass
class Splits:
    """Tokenized train and validation datasets (rows of ``input_ids``, ``attention_mask``, ...); with ``data.sources``
    each split is the sources' rows concatenated in order, and ``sources`` says which rows are whose."""

    train: "datasets.Dataset"  # noqa: F821
    validation: "datasets.Dataset"  # noqa: F821
    sources: list[SourceSplit] = field(default_factory=list)


def load_splits(recipe, tokenizer, data_cfg: DataConfig, seed: int, num_proc: int = 0) -> Splits:
    """Read the parquet files lazily, hold out validation if needed, tokenize (cached) on every core of every node.

    Each node's local rank 0 tokenizes with ``num_proc`` (else ``data.num_proc``, else
    :func:`~finetune.data.tokenization.default_num_proc`) processes; with a cache folder shared by the nodes the shards
    are split between them, with a node-local one each node tokenizes all. The other ranks wait on a group whose
    timeout is ``data.tokenize_timeout_minutes``, then every rank memory-maps the same entry. With ``data.sources``
    each source is read, held out and tokenized with its own files, columns and ``max_train_rows``.

    Args:
        recipe: the recipe module (its ``tokenize_function``).
        tokenizer: a prepared ``PreTrainedTokenizerBase``.
        data_cfg: the ``data`` section.
        seed: seed of the held-out validation split.
        num_proc: processes per node (0: ``data.num_proc``).

    Returns:
        :class:`Splits` with only model-input columns.

    Raises:
        ConfigError: a split (of a source) has no rows left after tokenization (every text empty, ...), or the
            recipe's map function rejected a row (on any rank: every rank raises it).
    """
    sources = mixture_lib.sources_of(data_cfg)
    tokenized_dir = default_cache_dir(data_cfg) / "tokenized"
    procs = num_proc or data_cfg.num_proc or tokenization.default_num_proc()
    group = dist_utils.data_group(data_cfg.tokenize_timeout_minutes)
    leader = dist_utils.local_rank() == 0
    me = dist_utils.rank()

    def setup():
        if leader:
            tokenized_dir.mkdir(parents=True, exist_ok=True)
            tokenization.clean_dead_partials(tokenized_dir)
        return leader

    leaders = [r for r, lead in enumerate(dist_utils.checked_step(group, setup)) if lead]
    shared = len(leaders) == 1 or tokenization.shared_between_leaders(group, tokenized_dir, leaders)

    def one(d: DataConfig, label: str, where: str):
        """The (train, validation) datasets of the files and columns of ``d``; ``label`` prefixes the log lines,
        ``where`` the keys named in errors."""
        problems: list[str] = []
        train_files = expand_files(d.train_files, where + "data.train_files", problems)
        val_files = expand_files(d.validation_files, where + "data.validation_files", problems)
        if problems:
            raise ConfigError(problems)
        col = d.text_column
        cols = recipe.columns(d)
        base_key = tokenization_key(recipe, tokenizer, d)
        fn = recipe.tokenize_function(tokenizer, d)
        counts_rows = recipe.capabilities.counts_rows  # the recipe skips and counts bad rows itself (sft, dpo)
        mapper = row_mapper(recipe, fn, col)

        def tokenize(source: tokenization.ParquetRows, rows: np.ndarray, split_key: dict, name: str, key_name: str):
            key = fingerprint({**base_key, **split_key})
            entry = tokenized_dir / f"{recipe.name}-{name}-{key}"
            have = dist_utils.checked_step(group, lambda: tokenization.is_entry(entry) if leader else True)
            if all(have):
                out, info = tokenization.load_entry(entry)
                logger.info(f"{label}{name}: {len(out):,} rows (cache hit: {entry})")
            else:
                job = tokenization.ShardJob(source, rows, mapper)
                if shared and len(leaders) > 1:
                    tokenization.tokenize_across_nodes(group, job, entry, leaders, procs)
                else:
                    job.bounds = tokenization.shard_bounds(len(rows), procs)
                    dist_utils.checked_step(group, lambda: tokenization.tokenize_here(job, entry, procs)
                                            if leader and not have[me] else None)
                out, info = tokenization.load_entry(entry)
                c = info["counts"]
                dropped = f"; dropped {c['dropped']:,} empty or null texts" if c.get("dropped") else ""
                logger.info(f"{label}{name}: {len(out):,} rows (tokenized {c.get('rows_in', 0):,} texts in "
                            f"{info['seconds']:.1f} s by {info['nodes']} node(s) x {info['num_proc']} process(es)"
                            f"{dropped}: {entry})")
            counts = info["counts"]
            if counts_rows:
                fn.counts = Counter({k: v for k, v in counts.items() if k not in ("rows_in", "rows_out", "dropped")})
                logger.info(f"{label}{name}: {fn.summary()}")
            if len(out) == 0:
                raise ConfigError(no_rows_problem(where, key_name, name, counts.get("rows_in", 0),
                                                  counts.get("dropped", 0), fn, col, counts_rows))
            return out

        train_source = tokenization.ParquetRows(train_files, cols)
        n_train = min(d.max_train_rows, len(train_source)) if d.max_train_rows else len(train_source)
        linked = linked_column(d, cols)
        ids = {"train_files": [source_id(f, linked) for f in train_files], "max_rows": d.max_train_rows}
        if val_files:
            train_rows, val_source = np.arange(n_train), tokenization.ParquetRows(val_files, cols)
            val_rows, train_ids = np.arange(len(val_source)), ids
            val_ids, val_key = {"val_files": [source_id(f, linked) for f in val_files]}, "data.validation_files"
        else:
            train_idx, val_idx = holdout(n_train, d.validation_fraction, seed)
            train_rows, val_rows = np.asarray(train_idx, np.int64), np.asarray(val_idx, np.int64)
            val_source = train_source
            split = {"holdout": d.validation_fraction, "seed": seed}
            train_ids, val_ids = {**ids, **split, "part": "train"}, {**ids, **split, "part": "val"}
            val_key = "data.validation_fraction"
        return (tokenize(train_source, train_rows, train_ids, "train", "data.train_files"),
                tokenize(val_source, val_rows, val_ids, "validation", val_key))

    if not sources:
        return Splits(*one(data_cfg, "", ""))
    parts = [one(s.data, f"{s.name}/", f"{s.where}: ") for s in sources]
    return Splits(train=datasets.concatenate_datasets([t for t, _ in parts]),
                  validation=datasets.concatenate_datasets([v for _, v in parts]),
                  sources=[SourceSplit(s.name, s.weight, len(t), len(v)) for s, (t, v) in zip(sources, parts)])


def row_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of one row's random choices (MLM masks): a well-mixed hash of ``(seed, epoch, index)``.

    Args:
        seed: ``train.seed``.
        epoch: training epoch (0-based); evaluation uses 0.
        index: the row's index in its split's tokenized dataset.

    Returns:
        A non-negative int below ``2**63`` (for ``torch.Generator.manual_seed``), from NumPy's
        ``SeedSequence``, so nearby inputs give unrelated streams.
    """
    words = [int(v) & 0xFFFFFFFFFFFFFFFF for v in (seed, epoch, index)]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


class IndexedRows(Dataset):
    """``dataset`` (rows are dicts) whose rows also carry ``"_index"``: the row's index in ``dataset`` (int)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        row = dict(self.dataset[i])
        row["_index"] = int(i)
        return row

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """The rows of ``indices`` in one Arrow read (``torch.utils.data`` fetches a micro-batch through this
        when it exists; ``datasets.Dataset.__getitems__``), instead of one read per row."""
        fetch = getattr(self.dataset, "__getitems__", None)
        rows = fetch(list(indices)) if fetch is not None else [dict(self.dataset[i]) for i in indices]
        for row, i in zip(rows, indices):
            row["_index"] = int(i)
        return rows


class FlattenRows:
    """Collator wrapper: the recipe's collated micro-batch ``[B, S]`` as one row ``[1, B x S]``
    (:func:`finetune.data.batch.flatten`), so that flash attention's variable-length kernel keeps the packed
    examples apart. Keeps ``row_seeded`` and ``set_epoch`` of the wrapped collator."""

    def __init__(self, collator):
        self.collator = collator
        self.row_seeded = getattr(collator, "row_seeded", False)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped collator."""
        getattr(self.collator, "set_epoch", lambda e: None)(epoch)

    def __call__(self, rows: list[dict]) -> dict:
        return flatten(self.collator(rows))


class RowSeededCollate:
    """Collate function around a recipe's collator: each row's ``"_index"`` becomes a per-row seed.

    Rows must carry ``"_index"`` (from :class:`IndexedRows` or :class:`_EvalShard`); it is removed. When
    the collator declares ``row_seeded = True`` (the MLM one), every row gets ``"_seed"`` =
    :func:`row_seed` ``(seed, epoch, index)`` (int) for its random choices; other collators see plain rows.

    The loop calls :meth:`set_epoch` next to the sampler's ``set_epoch``, before the epoch's batch
    iterator exists, so DataLoader workers (which copy this object when the iterator starts) see it too.
    """

    def __init__(self, collator, seed: int, epoch: int = 0):
        self.collator = collator
        self.seed = seed
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Seed the rows of the coming batches with ``epoch``."""
        self.epoch = epoch

    def __call__(self, rows: list[dict]) -> dict:
        seeded = getattr(self.collator, "row_seeded", False)
        for row in rows:
            index = row.pop("_index")
            if seeded:
                row["_seed"] = row_seed(self.seed, self.epoch, index)
        return self.collator(rows)


def row_lengths(dataset) -> np.ndarray:
    """Tokens per row of a tokenized ``datasets.Dataset`` (int64 array ``[rows]``), read from the Arrow
    list offsets of ``input_ids`` (no row is decoded)."""
    column = dataset.data.column("input_ids")
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def grouped_order(lengths: np.ndarray, global_batch: int, seed: int, epoch: int) -> list[int]:
    """One epoch's global row order, grouped by length per global batch (a permutation of ``range(len(lengths))``).

    transformers' ``get_length_grouped_indices`` (the order of its ``LengthGroupedSampler``, used here as it
    is) draws a random permutation, cuts it into mega-batches of ``min(50, rows // (4 * global_batch))``
    global batches, sorts each by length (longest first) and moves the longest row to the front. The full
    global batches of that order are then shuffled as whole batches, except the one holding the longest row,
    which stays first (an out-of-memory shows at the first step of an epoch, not hours in). The
    ``rows % global_batch`` rows left over come last (the loop drops them, as it drops any incomplete
    global batch). Everything is drawn from a ``torch.Generator`` seeded with ``seed + epoch`` (as
    ``DistributedSampler``), so the order depends only on ``(seed, epoch)``, the lengths and ``global_batch``.

    Args:
        lengths: tokens per row (ints ``[rows]``, e.g. :func:`row_lengths`).
        global_batch: rows per optimizer step of all ranks (micro batch x accumulation x world size).
        seed: ``train.seed``.
        epoch: 0-based epoch.

    Returns:
        Row indices (list of int): global batch ``s`` is ``order[s * global_batch:(s + 1) * global_batch]``.
    """
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = get_length_grouped_indices(lengths.tolist(), global_batch, generator=g)
    full = len(order) // global_batch
    batches = [order[i * global_batch:(i + 1) * global_batch] for i in range(full)]
    rest = order[full * global_batch:]
    if full > 1:
        batches = batches[:1] + [batches[1 + i] for i in torch.randperm(full - 1, generator=g).tolist()]
    return [i for batch in batches for i in batch] + rest


class ResumableDistributedSampler(DistributedSampler):
    """``torch.utils.data.DistributedSampler`` that can skip the first ``skip`` samples of one epoch, and can
    group rows by length per global batch.

    The order within an epoch depends only on ``(seed, epoch)``, so skipping the samples a checkpoint
    already consumed resumes exactly at the next micro-batch without collating the skipped ones.

    Args:
        dataset: rows (only its length is used).
        num_replicas: world size.
        rank: this rank.
        seed: ``train.seed``.
        lengths: tokens per row (``[rows]``); with ``global_batch`` > 0 the epoch's order is
            :func:`grouped_order`, otherwise ``DistributedSampler``'s plain shuffle.
        global_batch: rows per optimizer step of all ranks (micro batch x accumulation x world size).
        mixture: with ``data.sources``, the :class:`~finetune.data.mixture.Mixture` that draws each epoch's rows.
        row_tokens: tokens per row (``[rows]``), for the mixture's shares of tokens.
        repeat: each optimizer step's rows come ``repeat`` times in a row (``grpo``'s ``num_iterations``: one
            generation batch trains that many optimizer steps; TRL's ``RepeatSampler``); ``num_samples`` counts the
            repeats, so an epoch is ``repeat`` times as many steps.
        step_rows: rows per rank and optimizer step (micro batch x accumulation), with ``repeat`` > 1.

    In both cases rank ``r`` takes every ``num_replicas``-th row of the global order from ``r`` on, over the
    first ``len(dataset) // num_replicas * num_replicas`` rows (``drop_last``).
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, lengths: np.ndarray | None = None,
                 global_batch: int = 0, mixture: "mixture_lib.Mixture | None" = None, row_tokens: np.ndarray | None = None,
                 repeat: int = 1, step_rows: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0
        self.lengths = lengths if global_batch > 0 else None
        self.global_batch = global_batch
        self.mixture, self.row_tokens = mixture, row_tokens
        self.repeat, self.step_rows = (repeat, step_rows) if repeat > 1 and step_rows > 0 else (1, 0)
        if self.repeat > 1:
            steps = self.num_samples // self.step_rows
            self.num_samples = steps * self.step_rows * self.repeat + self.num_samples - steps * self.step_rows

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's permutation and skip its first ``skip`` samples (on this rank)."""
        super().set_epoch(epoch)
        self.skip = skip

    def global_order(self) -> np.ndarray:
        """The epoch's order of all rows (before the split over ranks; int64 ``[rows]``, 8 bytes a row where a
        Python list takes ~36); with a mixture, of the epoch's rows drawn from the sources
        (:meth:`finetune.data.mixture.Mixture.epoch_rows`), shuffled or length-grouped likewise."""
        if self.mixture is not None:
            rows = self.mixture.epoch_rows(self.epoch)
            if self.lengths is None:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                return rows[torch.randperm(len(rows), generator=g).numpy()]
            return rows[grouped_order(self.lengths[rows], self.global_batch, self.seed, self.epoch)]
        if self.lengths is None:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).numpy()  # DistributedSampler's own shuffle
        return np.asarray(grouped_order(self.lengths, self.global_batch, self.seed, self.epoch), np.int64)

    def __iter__(self):
        mine = self.global_order()[self.rank:self.total_size:self.num_replicas]
        if self.repeat > 1:  # each step's block of rows ``repeat`` times; the tail that fills no step once
            whole = len(mine) // self.step_rows * self.step_rows
            blocks = np.repeat(np.asarray(mine[:whole]).reshape(-1, self.step_rows), self.repeat, axis=0)
            mine = np.concatenate([blocks.reshape(-1), np.asarray(mine[whole:])])
        return map(int, mine[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip

    def epoch_shares(self) -> str | None:
        """With a mixture: each source's share of rows and tokens in the current epoch (one line); else None."""
        if self.mixture is None:
            return None
        return self.mixture.shares(self.mixture.epoch_rows(self.epoch), self.row_tokens)

    def trained_shares(self, epoch: int, samples_in_epoch: int, rows_per_epoch: int) -> str | None:
        """With a mixture: each source's share of the rows and tokens trained on from the start of the run to
        ``samples_in_epoch`` rows into ``epoch`` (one line); else None.

        Args:
            epoch: the current epoch.
            samples_in_epoch: rows of its global order trained on (all ranks).
            rows_per_epoch: rows of a finished epoch trained on (whole optimizer steps; the rest is dropped).
        """
        if self.mixture is None:
            return None
        current = self.epoch
        trained = []
        for e in range(epoch + 1):
            super().set_epoch(e)
            trained.append(self.global_order()[: rows_per_epoch if e < epoch else samples_in_epoch])
        super().set_epoch(current)
        return self.mixture.shares(np.concatenate(trained).astype(np.int64), self.row_tokens)


class _EvalShard(Dataset):
    """This rank's validation rows (``rank::world``), topped up to an equal length (a multiple of ``multiple``) with
    flagged filler rows.

    Rows carry ``"_index"`` (their index in the validation dataset; 0 for fillers) and ``"_filler"`` (bool).
    """

    def __init__(self, dataset, rank: int, world: int, multiple: int = 1):
        self.dataset = dataset
        self.indices = list(range(rank, len(dataset), world))
        self.length = math.ceil(math.ceil(len(dataset) / world) / multiple) * multiple

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        real = i < len(self.indices)
        index = self.indices[i] if real else 0
        row = dict(self.dataset[index])
        row["_index"] = index
        row["_filler"] = not real
        return row


def _eval_collate(collator, seed: int, split_rows: int):
    """Collate function of validation batches: filler rows' ``labels`` set to -100; a collator that declares
    ``row_indexed = True`` (``embed``'s, which places each row's embeddings at its index) also gets ``"_row"`` (the
    row's index in the validation split) and ``"_rows"`` (``split_rows``) in every row."""
    seeded = RowSeededCollate(collator, seed, epoch=0)
    indexed = getattr(collator, "row_indexed", False)

    def collate(rows):
        filler = torch.tensor([r.pop("_filler") for r in rows])
        if indexed:
            for r in rows:
                r["_row"], r["_rows"] = r["_index"], split_rows
        batch = seeded(rows)
        per_row = batch["labels"].shape[0] // len(rows)  # sequences per row (dpo: chosen, then rejected)
        batch["labels"][filler.repeat(per_row)] = -100
        return batch

    return collate


def train_sampler(dataset, data_cfg: DataConfig, global_batch: int, world: int, rank: int,
                  seed: int, mixture: "mixture_lib.Mixture | None" = None, repeat: int = 1) -> ResumableDistributedSampler:
    """The training sampler of ``rank``: rows grouped by length per global batch when ``data.group_by_length``
    is on and the rows do not all have one length (packed CLM blocks keep the plain shuffle).

    Args:
        dataset: the tokenized training split (rows with ``input_ids``), or :class:`IndexedRows` of it.
        data_cfg: the ``data`` section.
        global_batch: micro batch x accumulation x world size (rows per optimizer step).
        world: world size.
        rank: this rank.
        seed: ``train.seed``.
        mixture: the mixture of ``data.sources`` (each epoch's rows drawn from the sources), or None.
        repeat: optimizer steps each global batch trains (:class:`ResumableDistributedSampler`'s ``repeat``).
    """
    base = dataset.dataset if isinstance(dataset, IndexedRows) else dataset
    lengths = row_lengths(base) if data_cfg.group_by_length or mixture is not None else None
    grouped = data_cfg.group_by_length and lengths is not None and len(lengths) > 0 and lengths.min() != lengths.max()
    return ResumableDistributedSampler(dataset, world, rank, seed, lengths, global_batch if grouped else 0, mixture,
                                       lengths, repeat, global_batch // max(world, 1))


def train_loader(dataset, collator, data_cfg: DataConfig, micro_batch: int, seed: int,
                 gradient_accumulation_steps: int = 1, mixture: "mixture_lib.Mixture | None" = None,
                 lay: layout.Layout | None = None, repeat: int = 1) -> DataLoader:
    """Per-rank training loader: shuffled, ``drop_last``, sampler of type :class:`ResumableDistributedSampler`
    (from :func:`train_sampler`) over the data-parallel ranks of ``lay`` (default: every rank data-parallel).

    Rows are :class:`IndexedRows` of ``dataset``; ``collate_fn`` is a :class:`RowSeededCollate` with
    ``seed`` (call its ``set_epoch`` with the sampler's), wrapped in :class:`finetune.parallel.sequence.SequenceShard`
    under sequence parallelism (the ranks of an SP group draw the same rows and keep one slice of each sequence).
    ``repeat``: optimizer steps each global batch trains (the recipe's ``batch_repeats``).
    """
    rows = IndexedRows(dataset)
    lay = lay or layout.Layout(dist_utils.world_size(), 1, dist_utils.rank())
    sampler = train_sampler(rows, data_cfg, micro_batch * gradient_accumulation_steps * lay.dp, lay.dp,
                            lay.dp_rank, seed, mixture, repeat)
    collate = RowSeededCollate(collator, seed)
    return DataLoader(rows, batch_size=micro_batch, sampler=sampler,
                      collate_fn=sequence.SequenceShard(collate, lay) if lay.sp > 1 else collate,
                      drop_last=True, num_workers=data_cfg.num_workers, pin_memory=torch.cuda.is_available())


def eval_loader(dataset, collator, data_cfg: DataConfig, micro_batch: int, seed: int = 0,
                lay: layout.Layout | None = None) -> DataLoader:
    """Per-rank validation loader; every rank yields the same number of batches; filler rows have no labels.

    Row seeds (MLM masks) are ``row_seed(seed, 0, validation row index)``: the same at every evaluation and
    for any world size or micro batch. The CLI keeps ``seed=0``, so every run scores the same masked positions.
    Rows are sharded over the data-parallel ranks of ``lay``; under sequence parallelism every batch is full
    (Ulysses reshapes by the micro batch size; filler rows top it up) and cut like the training batches.
    """
    lay = lay or layout.Layout(dist_utils.world_size(), 1, dist_utils.rank())
    shard = _EvalShard(dataset, lay.dp_rank, lay.dp, micro_batch if lay.sp > 1 else 1)
    collate = _eval_collate(collator, seed, len(dataset))
    return DataLoader(shard, batch_size=micro_batch, shuffle=False,
                      collate_fn=sequence.SequenceShard(collate, lay) if lay.sp > 1 else collate,
                      num_workers=data_cfg.num_workers, pin_memory=torch.cuda.is_available())


@dataclass
class TrainData:
    """What one training run reads, built by :func:`build_train_data` (the toolkit's loop and the bench's bare
    loop use the same)."""

    splits: Splits
    collator: object  # the recipe's collator (rows -> batch of tensors)
    train_loader: DataLoader  # :func:`train_loader`: this rank's micro-batches, sampler a ResumableDistributedSampler
    eval_loader: DataLoader | dict  # :func:`eval_loader`; with ``data.sources``: source name -> its loader
    steps_per_epoch: int  # optimizer steps per epoch (whole global batches)
    total_steps: int  # ``train.max_steps``, or ``train.epochs`` x steps_per_epoch


def build_train_data(recipe, cfg: RunConfig, tokenizer) -> TrainData:
    """Tokenized splits (:func:`load_splits`, cached), the recipe's collator and this rank's loaders.

    Packed rows of a causal-LM recipe under a flash-attention kernel go to the model as one row per micro-batch
    (:class:`FlattenRows`, :func:`finetune.data.batch.flattens`).

    Args:
        recipe: the recipe module (``tokenize_function``, ``make_collator``).
        cfg: the run config (``recipe``, ``data``, and ``train``'s micro batch, accumulation, seed, steps).
        tokenizer: the prepared tokenizer (``recipe.prepare_tokenizer`` applied).

    Raises:
        ConfigError: a split has no rows (``data.train_files``/``data.validation_*``), or the training rows do
            not fill one global batch (micro batch x accumulation x world size rows).
    """
    collator = recipe.make_collator(tokenizer, cfg.data)
    if flattens(cfg, recipe):
        collator = FlattenRows(collator)
    return with_splits(load_splits(recipe, tokenizer, cfg.data, cfg.train.seed), collator, cfg,
                       recipe.batch_repeats(cfg))


def with_splits(splits: Splits, collator, cfg: RunConfig, repeat: int = 1) -> TrainData:
    """:class:`TrainData` of tokenized ``splits``: this rank's loaders with ``collator``, the steps per epoch and of
    the run (a recipe that adds columns before training, ``dpo``'s reference log-probabilities, rebuilds it here).

    ``repeat``: optimizer steps each global batch trains (the recipe's ``batch_repeats``; the steps per epoch count
    them).

    Raises:
        ConfigError: the training rows do not fill one global batch.
    """
    mix = None
    if splits.sources:
        mix = mixture_lib.Mixture([s.name for s in splits.sources], [s.train_rows for s in splits.sources],
                                  [s.weight for s in splits.sources], cfg.train.seed)
    lay = layout.layout(cfg)
    eval_micro = cfg.train.eval_micro_batch_size or cfg.train.micro_batch_size
    train_dl = train_loader(splits.train, collator, cfg.data, cfg.train.micro_batch_size, cfg.train.seed,
                            cfg.train.gradient_accumulation_steps, mix, lay, repeat)
    if splits.sources:
        starts = np.cumsum([0] + [s.validation_rows for s in splits.sources]).tolist()
        eval_dl = {s.name: eval_loader(splits.validation.select(range(a, b)), collator, cfg.data, eval_micro, lay=lay)
                   for s, a, b in zip(splits.sources, starts, starts[1:])}
    else:
        eval_dl = eval_loader(splits.validation, collator, cfg.data, eval_micro, lay=lay)
    micro, gas = cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps
    steps_per_epoch = (train_dl.sampler.num_samples // micro) // gas
    if steps_per_epoch == 0:
        raise ConfigError(f"data.train_files: {len(splits.train)} training rows give no full global batch of "
                          f"{micro} x {gas} x {lay.dp} (data-parallel size) rows; lower train.micro_batch_size or add data")
    return TrainData(splits, collator, train_dl, eval_dl, steps_per_epoch,
                     cfg.train.max_steps or cfg.train.epochs * steps_per_epoch)
