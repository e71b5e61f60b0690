"""A weighted mixture of datasets (``data.sources``): each source's settings, and each epoch's rows.

Sampling rule (per-epoch proportional sampling, without replacement within a pass over a source):

* An epoch has ``N = n_1 + ... + n_S`` rows, the tokenized training rows of all sources together (rows after
  tokenization: packed blocks for packed ``gpt_clm``/``sft``, examples otherwise), so a mixture of equal weights
  proportional to the sizes is one plain epoch over every row.
* Source ``s`` gets ``k_s`` of them, ``N x w_s / sum(w)`` rounded by the largest-remainder method (the ``k_s`` add
  up to ``N``).
* Its ``k_s`` rows are whole passes over it, each in a fresh random order, then the first rows of one more: a
  source with ``k_s < n_s`` gives a random subset (another one each epoch), a source with ``k_s > n_s`` is
  repeated (upsampled) with every row used once per pass before any row is used again.
* The epoch's order is then the ``N`` chosen rows shuffled (or length-grouped) by the training sampler with
  ``(train.seed, epoch)``, as for a single dataset.

Every draw comes from NumPy generators seeded with ``(train.seed, epoch, source index)``, so an epoch's rows depend
only on the seed, the epoch, the sources' sizes and the weights: not on the world size, the micro batch or the
accumulation, and a resume mid-epoch continues the same order (the sampler skips the rows already trained on).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass

import numpy as np

from finetune.config import DataConfig
from finetune.errors import ConfigError

COLUMN_KEYS = ("text_column", "text_pair_column", "label_column", "prompt_column", "response_column",
               "messages_column", "chosen_column", "rejected_column", "chat_template", "format")
"""The ``data`` keys a source may set for itself (its columns); the others are the run's."""

SOURCE_KEYS = ("name", "train_files", "validation_files", "validation_fraction", "weight", "max_train_rows",
               *COLUMN_KEYS)
"""Every key of a ``data.sources`` entry."""


@dataclass
class Source:
    """One source of a mixture: its name, weight, the ``data`` section it is read with (its files and columns) and
    its position in ``data.sources``."""

    name: str
    weight: float
    data: DataConfig
    index: int = 0

    @property
    def where(self) -> str:
        """How problems name the source: ``data.sources[i] (name)``."""
        return f"data.sources[{self.index}] ({self.name})"


def sources_of(data_cfg: DataConfig, problems: list[str] | None = None) -> list[Source]:
    """The sources of ``data.sources``, each with the ``data`` section it is read with (the run's, its own keys
    replacing the run's); empty when ``data.sources`` is empty (one dataset: ``data.train_files``). With
    ``problems`` given, problems are appended to it and the sources without problems returned, instead of raising.

    Raises:
        ConfigError: one line per problem, naming the source: not a mapping, an unknown key (with a suggestion), no
            or a repeated ``name``, no ``train_files``, a weight that is not a positive number, ``data.train_files``
            or ``data.validation_files`` set besides ``data.sources``.
    """
    found: list[str] = []
    out: list[Source] = []
    seen: list = []
    if data_cfg.sources and (data_cfg.train_files or data_cfg.validation_files):
        found.append("data.sources: set the files in each source, not in data.train_files/data.validation_files")
    for i, entry in enumerate(data_cfg.sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            found.append(f"{where}: expected a mapping with name, train_files and weight, got {entry!r}")
            continue
        before = len(found)
        name = entry.get("name")
        seen_before = list(seen)
        seen.append(name)
        where = f"data.sources[{i}] ({name})" if name else where
        for key in entry:
            if key not in SOURCE_KEYS:
                close = difflib.get_close_matches(str(key), SOURCE_KEYS, n=1, cutoff=0.5)
                hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(SOURCE_KEYS)}"
                found.append(f"{where}: unknown key '{key}' ({hint})")
        if not isinstance(name, str) or not name.strip() or "/" in name:
            found.append(f"{where}: needs a 'name' (text without '/', used in the metrics' names)")
        elif name in seen_before:
            found.append(f"{where}: the name '{name}' is used by another source; give each source its own")
        files = entry.get("train_files")
        files = [files] if isinstance(files, str) else files
        if not files or not isinstance(files, list):
            found.append(f"{where}: needs 'train_files' (parquet files or globs)")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
            found.append(f"{where}: weight must be a positive number, got {weight!r}")
        if len(found) > before:
            continue
        own = {k: v for k, v in entry.items() if k in SOURCE_KEYS and k not in ("name", "weight")}
        if isinstance(own.get("validation_files"), str):
            own["validation_files"] = [own["validation_files"]]
        own["train_files"] = files or []
        out.append(Source(str(name), float(weight), dataclasses.replace(data_cfg, sources=[], **own), i))
    if problems is not None:
        problems += found
    elif found:
        raise ConfigError(found)
    return out


_OWN_KEY = re.compile(r"\bdata\.(?=(?:%s)\b)" % "|".join(SOURCE_KEYS))


def in_source(source: Source, problem: str) -> str:
    """``problem`` (a line about the run's ``data`` keys) as a line about ``source``: prefixed with
    :attr:`Source.where`, and ``data.<key>`` of the keys a source sets itself written as the source's ``<key>``."""
    return f"{source.where}: {_OWN_KEY.sub('', problem)}"


def epoch_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Rows each source gives to one epoch of ``sum(sizes)`` rows: proportional to ``weights``, rounded by the
    largest-remainder method (ties to the first source), adding up to ``sum(sizes)``."""
    total = sum(sizes)
    exact = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


class Mixture:
    """The rows of each epoch of a mixture, as indices into the sources' training rows concatenated in order.

    Args:
        names: source names.
        sizes: training rows of each source (after tokenization).
        weights: the sources' weights (> 0).
        seed: ``train.seed``.
    """

    def __init__(self, names: list[str], sizes: list[int], weights: list[float], seed: int):
        self.names, self.sizes, self.weights, self.seed = list(names), list(sizes), list(weights), seed
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.counts = epoch_counts(sizes, weights)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """The ``len(self)`` rows of ``epoch`` (int64 indices into the concatenated sources), source by source
        (the sampler shuffles them)."""
        parts = []
        for s, (n, k) in enumerate(zip(self.sizes, self.counts)):
            rng = np.random.default_rng([self.seed, epoch, s])
            passes = [rng.permutation(n) for _ in range(-(-k // n))] if n else []
            parts.append(self.offsets[s] + np.concatenate(passes)[:k] if k else np.zeros(0, np.int64))
        return np.concatenate(parts).astype(np.int64)

    def source_of(self, rows: np.ndarray) -> np.ndarray:
        """The source index of each row index (int array)."""
        return np.searchsorted(self.offsets, rows, side="right") - 1

    def shares(self, rows: np.ndarray, lengths: np.ndarray) -> str:
        """One line: each source's share of ``rows`` (rows of an epoch) and of their tokens (``lengths``: tokens per
        row of the concatenated sources), and how many passes over the source that is."""
        src = self.source_of(rows)
        tokens = lengths[rows]
        parts = []
        for s, name in enumerate(self.names):
            mine = src == s
            parts.append(f"{name} {mine.mean():.1%} of rows, {tokens[mine].sum() / max(tokens.sum(), 1):.1%} of "
                         f"tokens ({int(mine.sum()):,} rows = {mine.sum() / max(self.sizes[s], 1):.2f} passes, weight "
                         f"{self.weights[s]:g})")
        return "; ".join(parts)
