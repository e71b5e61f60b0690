"""``finetune inspect <run config> [key=value ...] [--rows N] [--split train|validation] [--color auto|always|never]``
(or ``finetune inspect --completions <run folder>``, below):
print the first tokenized rows of a run as the model gets them, with the trained tokens marked (a label-mask
inspector, as axolotl's ``preprocess --debug``).

What is shown is what training builds, through the same code: the run's input checks
(:func:`finetune.preflight.validate.check_inputs`, exit 2 with one line per problem), the tokenizer as a launch loads
it (:func:`finetune.engine.model.load_tokenizer`, the recipe's ``prepare_tokenizer``), the tokenized split of
:func:`finetune.data.dataset.load_splits` (the cache ``finetune prepare`` and the launches read and write), and its
first ``N`` rows collated as one micro-batch by the recipe's own ``make_collator``, each row seeded as training seeds
it in the first epoch (:class:`finetune.data.dataset.RowSeededCollate`: the MLM masks are those of epoch 0). A
position whose label is not -100 is trained.

Per sequence: a header line ``--- row R[ chosen|rejected]: T tokens, K trained[, E examples][, label L]``, then the
decoded text (runs of tokens decoded together, so byte-level BPE characters stay whole) with the runs of trained
tokens in ``[[...]]`` (``--color never``, or ``auto`` when stdout is not a terminal) or in green (``always``, or
``auto`` on a terminal), and `` ‖ `` where a packed row's next example starts (``position_ids`` restart, or after
each EOS of a packed block without them). Trained positions show their target: for a masked LM the original token,
whatever the input holds there (``[MASK]``, a random token or the token itself; the header counts the changed ones).
A recipe with one target per row (``Capabilities.one_target_per_row``) shows the row's label and its name. A recipe
with several sequences per row (``Capabilities.sequences_per_row``: ``dpo``, ``kto``) shows each under its name
(``Capabilities.sequence_names``): chosen, then rejected; kto's completion, then its KL pair.

A ``grpo`` run shows its rows' prompts (training generates their completions); with tools or an environment
(``train.grpo.tools``, ``environment``) it then shows a sample multi-turn rollout of row 0 as training builds it
(the recipe's ``sample_rollout`` hook, :func:`rollout_sample`): the prompt with the tools' schemas (and the
environment's first observation), an assistant turn calling the first tool, the tool's real result as the template
renders it, and the next assistant turn (the two assistant turns scripted, since no model has generated yet), the
model's tokens marked as trained and the tool's and template's tokens between them not (their mask 0 in
training).

``finetune inspect --completions <run folder> [--step S] [--rows N]`` shows what a ``grpo`` run really trained on:
the rollouts it logged at step ``S`` (default: the last logged step) in ``completions.jsonl``, each rollout's
completion tokens as the loss saw them (the token ids and the mask recorded at that step, decoded with the run's
own tokenizer from its ``run_config.yaml``): the model's tokens marked as trained, the tools' results and the
template's tokens between the turns not, and a truncated completion wholly unmarked under
``mask_truncated_completions`` (:func:`show_recorded`).

Warnings (``finetune: warning: ...`` on stderr; the exit status stays 0), for recipes that train on answers to
prompts (those that generate text and take their rows apart themselves: ``Capabilities.generates_text`` and
``counts_rows``, i.e. ``sft``, ``dpo`` and ``kto``):

* an example with no trained token (its labels are all -100): a chat template that renders no assistant turn, or one
  whose ``{% generation %}`` markers enclose nothing;
* an example whose prompt is trained: its prompt is located by matching the prompts that the recipe's
  ``generation_pairs`` hook builds from the split's first raw rows (what ``train.eval_generate`` prompts with); a
  trained token at the prompt's second or last position (the first never has a target) warns, with the count of
  trained prompt tokens. Earlier assistant turns of a multi-turn conversation belong to that prompt and are
  rightly trained; they do not warn.

At most :data:`WARN_EACH` lines of each kind; the rest are counted in one more line.

For every recipe with token labels, the last line is a summary: rows shown and those with no trained token, and,
when the tokenized split holds its labels, the rows of the whole split that train nothing (a warning when any).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from finetune.config import DataConfig, RunConfig, load_run_config
from finetune.data import mixture, tokenization
from finetune.data.dataset import (
    RowSeededCollate,
    expand_files,
    holdout,
    load_splits,
    validation_rows,
)
from finetune.engine.model import load_model_config, load_tokenizer
from finetune.errors import ConfigError
from finetune.errors import report as report_error
from finetune.preflight.validate import checked_inputs_config
from finetune.recipes import Recipe, recipe_for

SPLITS = ("train", "validation")
COLORS = ("auto", "always", "never")
BOUNDARY = " \u2016 "
"""Printed where a packed row's next example starts."""
PROMPT_ROWS = 1000
"""Raw rows read at most to locate the prompts of the shown examples (a packed row draws its examples from the first
map batch of 1,000 rows)."""
WARN_EACH = 3
"""Warnings printed per kind (no trained token, trained prompt); the rest are counted in one line."""
NOTHING, PROMPT = "no trained token", "trained prompt tokens"
"""Kinds of :func:`example_problems`."""
_GREEN, _YELLOW, _RESET = "\x1b[1;32m", "\x1b[33m", "\x1b[0m"


@dataclass
class Shown:
    """One collated sequence as shown: ``ids`` (the target at trained positions, the input elsewhere), ``trained``
    (bool per token), ``starts`` (positions where an example starts, 0 first), ``changed`` (trained positions whose
    input differs from the target), ``label`` (one-target recipes: ``"3 ('positive')"``), ``row`` and ``which``
    (``"chosen"``, ``"rejected"``, or ``""`` for one sequence per row)."""

    row: int
    which: str
    ids: list[int]
    trained: list[bool]
    starts: list[int] = field(default_factory=lambda: [0])
    changed: int = 0
    label: str | None = None
    tags: list[str | None] | None = None
    """Per-token class recipes (``Capabilities.label_head``: ``token_cls``): each token's tag name (None where it
    is not trained); ``ids`` are then the inputs."""

    def examples(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each example."""
        return list(zip(self.starts, self.starts[1:] + [len(self.ids)]))

    def name(self) -> str:
        """``row R`` or ``row R chosen``."""
        return f"row {self.row}" + (f" {self.which}" if self.which else "")


def prompted(recipe: Recipe) -> bool:
    """True for recipes that train on answers to prompts: they generate text and take their rows apart themselves
    (``Capabilities.generates_text`` and ``counts_rows``: ``sft``, ``dpo``); the prompt checks apply to them."""
    return recipe.capabilities.generates_text and recipe.capabilities.counts_rows


def collated_sequences(recipe: Recipe, tokenizer, cfg: RunConfig, rows: list[dict]) -> tuple[dict, list[Shown]]:
    """The first rows of a tokenized split collated as one micro-batch, and its sequences as shown.

    Args:
        recipe: the configured recipe (:func:`finetune.recipes.recipe_for`).
        tokenizer: the prepared tokenizer.
        cfg: the run config (``data``, ``train.seed``).
        rows: the split's rows ``0..len(rows)-1`` (dicts of the tokenized columns).

    Returns:
        ``(batch, sequences)``: the recipe collator's batch (``RowSeededCollate`` with ``train.seed``, epoch 0, the
        rows' indices in the split) and one :class:`Shown` per collated sequence, row by row (with several
        sequences per row: each row's chosen, then its rejected).
    """
    collate = RowSeededCollate(recipe.make_collator(tokenizer, cfg.data), cfg.train.seed, epoch=0)
    batch = collate([{**r, "_index": i} for i, r in enumerate(rows)])
    n = len(rows)
    per_row = recipe.capabilities.sequences_per_row
    names = recipe.capabilities.sequence_names or (("chosen", "rejected") if per_row == 2
                                                   else tuple(f"sequence {j}" for j in range(per_row)))
    id2label = {}
    if batch["labels"].dim() == 1:
        try:
            id2label = getattr(load_model_config(cfg, recipe), "id2label", None) or {}
        except Exception:  # noqa: BLE001  (no config.json: the label ids alone)
            id2label = {}
    eos = tokenizer.eos_token_id
    out = []
    if "window_row" in batch:  # rows of several windows (qa): each window, its answer span as the trained tokens
        seen: dict[int, int] = {}
        for k, r in enumerate(batch["window_row"].tolist()):
            seen[r] = seen.get(r, -1) + 1
            pos = batch["attention_mask"][k].nonzero().flatten()
            inputs = batch["input_ids"][k][pos].tolist()
            s, e = int(batch["start_positions"][k]), int(batch["end_positions"][k])
            trained = [0 < s <= t <= e for t in range(len(inputs))]
            out.append(Shown(r, f"window {seen[r]}", inputs, trained,
                             label=None if any(trained) else "no answer in this window ([CLS])"))
        return batch, out
    for r, j in ((r, j) for r in range(n) for j in range(per_row)):
        k, which = j * n + r, (names[j] if per_row > 1 else "")
        if "attention_mask" in batch:
            pos = batch["attention_mask"][k].nonzero().flatten()
        else:  # packed rows: the row's own tokens, then padding
            pos = np.arange(len(rows[r]["input_ids"]))
        inputs = batch["input_ids"][k][pos].tolist()
        labels = batch["labels"]
        if labels.dim() == 1 and recipe.rollout(cfg) is not None:  # a prompt; training generates its completions
            out.append(Shown(r, which, inputs, [False] * len(inputs), label=PROMPT_ONLY))
            continue
        if labels.dim() == 1 and labels.shape[0] == n < batch["input_ids"].shape[0]:  # a label per row (embed's
            # 1: a positive pair, 0: scored below train.embed.relevant_score), shown with the row's first text
            out.append(Shown(r, which, inputs, [False] * len(inputs),
                             label=str(int(labels[r])) if j == 0 else None))
            continue
        if labels.dim() == 1:
            value = int(labels[k])
            name = id2label.get(value, id2label.get(str(value)))
            out.append(Shown(r, which, inputs, [False] * len(inputs),
                                label=f"{value}" + (f" ({name!r})" if name is not None else "")))
            continue
        lab = labels[k][pos].tolist()
        trained = [v != -100 for v in lab]
        if recipe.capabilities.label_head:  # a class per token: the input tokens with their tags
            if not id2label:
                try:
                    id2label = getattr(load_model_config(cfg, recipe), "id2label", None) or {}
                except Exception:  # noqa: BLE001  (no config.json: the label ids alone)
                    id2label = {}
            tags = [str(id2label.get(v, id2label.get(str(v), v))) if t else None for v, t in zip(lab, trained)]
            out.append(Shown(r, which, inputs, trained, tags=tags))
            continue
        ids = [v if t else i for i, v, t in zip(inputs, lab, trained)]
        if "position_ids" in batch:
            position = batch["position_ids"][k][pos].tolist()
            starts = [0] + [t for t in range(1, len(position)) if position[t] == 0]
        elif recipe.capabilities.packs_rows and cfg.data.packing and eos is not None:
            starts = [0] + [t for t in range(1, len(inputs)) if inputs[t - 1] == eos]
        else:
            starts = [0]
        out.append(Shown(r, which, ids, trained, starts,
                            changed=sum(1 for i, v, t in zip(inputs, lab, trained) if t and i != v)))
    return batch, out


def decoded_runs(tokenizer, ids: list[int], marks: list[bool]) -> list[tuple[str, bool]]:
    """``ids`` (one example) decoded as runs of equal ``marks``: ``[(text, mark)]``.

    Each run's text is the difference between the decoded prefixes that end after and before it (special tokens
    kept, no clean-up), so tokenizers that put spaces between tokens (WordPiece) and byte-level BPE (a character
    split over tokens) decode as the whole sequence does; where a prefix does not extend the previous one, the run
    is decoded alone.
    """
    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    runs, before, start = [], "", 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and marks[end] == marks[start]:
            continue
        upto = decode(ids[:end])
        runs.append((upto[len(before):] if upto.startswith(before) else decode(ids[start:end]), marks[start]))
        before, start = upto, end
    return runs


def render(tokenizer, seq: Shown, color: bool) -> str:
    """The text of ``seq``: trained runs in ``[[...]]`` (or green with ``color``), `` ‖ `` between examples; with
    per-token tags, the word pieces separated by spaces, each trained one as ``[[piece/TAG]]``."""
    if seq.tags is not None:
        pieces = tokenizer.convert_ids_to_tokens(seq.ids)
        return " ".join(piece if tag is None else (f"{_GREEN}{piece}/{tag}{_RESET}" if color else f"[[{piece}/{tag}]]")
                        for piece, tag in zip(pieces, seq.tags))
    parts = []
    for j, (a, b) in enumerate(seq.examples()):
        if j:
            parts.append(f"{_YELLOW}{BOUNDARY}{_RESET}" if color else BOUNDARY)
        for text, trained in decoded_runs(tokenizer, seq.ids[a:b], seq.trained[a:b]):
            if not trained:
                parts.append(text)
            elif color:
                parts.append(f"{_GREEN}{text}{_RESET}")
            else:
                core = text.strip()
                if not core:
                    parts.append(f"[[{text}]]")
                    continue
                lead = text[: len(text) - len(text.lstrip())]
                parts.append(f"{lead}[[{core}]]{text[len(text.rstrip()):]}")
    return "".join(parts)


PROMPT_ONLY = "prompt only"
"""The label of a row whose completions training generates (a recipe with a ``rollout``: ``grpo``)."""


def header(seq: Shown, packed: bool) -> str:
    """``--- row R[ which]: T tokens, K trained[, E examples][, C changed in the input]`` or ``..., label L``."""
    text = f"--- {seq.name()}: {len(seq.ids)} tokens"
    if seq.label == PROMPT_ONLY:
        return f"--- {seq.name()}: {len(seq.ids)} prompt tokens"
    if seq.label is not None:
        return f"{text}, label {seq.label}"
    text += f", {sum(seq.trained)} trained"
    if packed:
        text += f", {len(seq.starts)} example" + ("s" if len(seq.starts) > 1 else "")
    if seq.changed:
        text += f" ({seq.changed} changed in the input: the model sees another token there)"
    return text


def rollout_sample(recipe: Recipe, cfg: RunConfig, tokenizer, row: dict) -> Shown | None:
    """The recipe's sample of what it generates and trains on from ``row`` (its ``sample_rollout`` hook: ``grpo``
    with tools or an environment shows a multi-turn rollout as training builds it, before any model has generated,
    :func:`finetune.recipes.grpo.agent.inspect_sample`), or None.

    Raises:
        ConfigError: bad input (one line).
    """
    sample = recipe.sample_rollout(cfg, tokenizer, row)
    if sample is None:
        return None
    ids, trained = sample
    return Shown(0, "a sample multi-turn rollout", list(ids), list(trained), label=SAMPLE)


SAMPLE = "sample"
"""The label of :func:`rollout_sample`'s sequence."""


def sample_header(seq: Shown, color: bool, max_completion_length: int) -> str:
    """``--- row 0 a sample multi-turn rollout (...): P prompt tokens, then C completion tokens: K the model's
    (trained, ...), T the tools' and the template's (not trained)``, and a note when ``C`` is more than
    ``max_completion_length`` (the recipe's ``rollout`` tokens per sequence less ``data.max_seq_len``; ``grpo``:
    ``train.grpo.max_completion_length``): training would end the rollout sooner."""
    prompt = next((i for i, t in enumerate(seq.trained) if t), len(seq.ids))
    trained, n = sum(seq.trained), len(seq.ids) - prompt
    return (f"--- {seq.name()} (the model's turns are scripted here; training samples them): {prompt} prompt tokens, "
            f"then {n} completion tokens: {trained} the model's (trained, {'green' if color else '[[...]]'}), "
            f"{n - trained} the tools' and the template's (not trained)" +
            (f"; train.grpo.max_completion_length={max_completion_length} would end this rollout sooner"
             if n > max_completion_length else ""))


def split_rows(data_cfg: DataConfig, columns: list[str], seed: int, split: str, n: int) -> list[dict]:
    """The first ``n`` raw rows (``columns`` only) of ``split`` as :func:`finetune.data.dataset.load_splits` forms it
    (``max_train_rows``, the held-out share of the training files when there are no validation files); with
    ``data.sources``, those of the first source (whose rows come first in the split).

    Raises:
        ConfigError: a file pattern matches nothing.
    """
    sources = mixture.sources_of(data_cfg)
    d = sources[0].data if sources else data_cfg
    if split == "validation":
        return validation_rows(d, columns, seed, n)
    problems: list[str] = []
    train_files = expand_files(d.train_files, "data.train_files", problems)
    val_files = expand_files(d.validation_files, "data.validation_files", problems)
    if problems:
        raise ConfigError(problems)
    source = tokenization.ParquetRows(train_files, columns)
    n_train = min(d.max_train_rows, len(source)) if d.max_train_rows else len(source)
    rows = np.arange(n_train) if val_files else np.asarray(holdout(n_train, d.validation_fraction, seed)[0])
    picked = source.take(rows[:n])
    return [{c: picked[c][i] for c in columns} for i in range(len(rows[:n]))]


class Prompts:
    """The prompts (token ids) of a split's first raw rows, from the recipe's ``generation_pairs`` hook, built
    lazily in chunks until an example's prompt is found."""

    def __init__(self, recipe: Recipe, tokenizer, cfg: RunConfig, split: str):
        self.recipe, self.tokenizer, self.cfg = recipe, tokenizer, cfg
        self.raw = split_rows(cfg.data, recipe.columns(cfg.data), cfg.train.seed, split, PROMPT_ROWS)
        self.done = 0
        self.by_first: dict[int, set[tuple[int, ...]]] = {}

    def _more(self) -> bool:
        if self.done >= len(self.raw):
            return False
        chunk = self.raw[self.done:self.done + 100]
        self.done += len(chunk)
        for prompt, _ in self.recipe.generation_pairs(self.tokenizer, chunk, self.cfg.data):
            if prompt:
                self.by_first.setdefault(prompt[0], set()).add(tuple(prompt))
        return True

    def length(self, ids: list[int]) -> int:
        """Tokens of the longest known prompt that ``ids`` starts with; 0 when none is found in the rows read."""
        while True:
            found = [len(p) for p in self.by_first.get(ids[0], ()) if tuple(ids[:len(p)]) == p] if ids else []
            if found:
                return max(found)
            if not self._more():
                return 0


def example_problems(seq: Shown, prompts: Prompts) -> list[tuple[str, str]]:
    """The label-mask problems of the examples of ``seq`` (a recipe that trains on answers to prompts):
    ``[(kind, line)]``, kind :data:`NOTHING` (no trained token) or :data:`PROMPT` (a trained token at the second or
    the last position of the example's prompt, located by :meth:`Prompts.length`; the first position never has a
    target, and earlier assistant turns of a multi-turn prompt are rightly trained)."""
    problems = []
    for j, (a, b) in enumerate(seq.examples()):
        where = seq.name() + (f" example {j}" if len(seq.starts) > 1 else "")
        trained = seq.trained[a:b]
        if not any(trained):
            problems.append((NOTHING, f"{where}: no trained token (its labels are all -100), so it teaches nothing; "
                                      f"with a chat template, check that it renders the assistant's turns and that "
                                      f"its {{% generation %}} markers, if any, enclose them"))
        plen = min(prompts.length(seq.ids[a:b]), b - a)
        if plen > 1 and (trained[1] or trained[plen - 1]):
            problems.append((PROMPT, f"{where}: {sum(trained[:plen])} of its {plen} prompt tokens are trained (the "
                                     f"loss is taken on the prompt); check data.chat_template's {{% generation %}} "
                                     f"markers and the prompt/answer columns"))
    return problems


def untrained_rows(split, column: str) -> np.ndarray | None:
    """Bool per row of a tokenized split: its list column ``column`` (labels) is all -100; None when the split has
    no such list column."""
    if column not in split.column_names:
        return None
    arr = split.with_format("arrow")[column]
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not pa.types.is_list(arr.type) and not pa.types.is_large_list(arr.type):
        return None
    flat = np.asarray(pc.list_flatten(arr))
    parents = np.asarray(pc.list_parent_indices(arr))
    counts = np.bincount(parents[flat != -100], minlength=len(arr))
    return counts == 0


def _warn(text: str) -> None:
    print(f"finetune: warning: {text}", file=sys.stderr, flush=True)


def _use_color(choice: str) -> bool:
    if choice == "always":
        return True
    if choice == "never":
        return False
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _recorded_rows(run: str, step: int | None) -> tuple[Path, list[dict], list[int], int]:
    """The rows of a ``grpo`` run's ``completions.jsonl`` logged at ``step`` (None: the last logged step).

    Args:
        run: the run folder, or its ``completions.jsonl``.
        step: an optimizer step the run logged, or None.

    Returns:
        ``(path, rows, steps, step)``: the file, its rows of that step, every logged step, the step shown.

    Raises:
        ConfigError: no such file, a line that is not JSON, a file with no rows, rows without the token record
            (``completion_ids``, ``trained``), or a step that was not logged.
    """
    path = Path(run)
    path = path / "completions.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--completions: {path} does not exist (a grpo run folder writes completions.jsonl at its "
                          f"logged steps unless train.grpo.log_completions is 0)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"--completions: {path} line {n} is not JSON ({e.msg})") from None
    if not rows:
        raise ConfigError(f"--completions: {path} holds no completion (no step logged yet)")
    steps = sorted({r.get("step") for r in rows if isinstance(r.get("step"), int)})
    step = steps[-1] if step is None and steps else step
    if step not in steps:
        raise ConfigError(f"--completions: {path} has no rows of step {step}; logged steps: "
                          f"{', '.join(map(str, steps)) or 'none'}")
    rows = [r for r in rows if r.get("step") == step]
    if not all(isinstance(r.get("completion_ids"), list) and isinstance(r.get("trained"), list) for r in rows):
        raise ConfigError(f"--completions: the rows of step {step} in {path} hold no token record (completion_ids, "
                          f"trained): a finetune without it wrote them; rerun to record them")
    return path, rows, steps, step


def _prompt_line(prompt) -> str:
    """A recorded prompt on one line: its text, or its last message's content, cut to 160 characters."""
    text = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) \
        else str(prompt)
    text = " ".join(str(text).split())
    return text if len(text) <= 160 else text[:157] + "..."


def show_recorded(run: str, rows: int, step: int | None, color: bool) -> int:
    """``finetune inspect --completions <run>``: the rollouts a ``grpo`` run logged (``completions.jsonl``,
    :data:`finetune.config.GrpoConfig.log_completions` per logged step) as its loss saw them: each completion's
    tokens with the trained ones marked and the tools' and the template's (mask 0) not, decoded with the run's own
    tokenizer (``run_config.yaml`` of the run folder). Returns 0.

    Raises:
        ConfigError: :func:`_recorded_rows`'s, a run folder without ``run_config.yaml``, or a tokenizer that does
            not load.
    """
    path, records, steps, step = _recorded_rows(run, step)
    config = path.parent / "run_config.yaml"
    if not config.is_file():
        raise ConfigError(f"--completions: {config} does not exist: the run folder's run_config.yaml names the "
                          f"tokenizer to decode with")
    cfg = load_run_config(config, [])
    try:
        tokenizer = load_tokenizer(cfg, recipe_for(cfg))
    except OSError as e:
        raise ConfigError(f"--completions: the run's tokenizer ({cfg.model.tokenizer_path or cfg.model.path}, from "
                          f"{config}; relative paths are read from where the run was launched) does not load: "
                          f"{str(e).splitlines()[0]}") from None
    shown = records[:rows]
    print(f"finetune inspect: {path}, step {step} (logged steps: {', '.join(map(str, steps))}), rollouts "
          f"0-{len(shown) - 1} of {len(records)} logged as the loss saw them; trained tokens in "
          f"{'green' if color else '[[...]]'}, the tools' and the template's not")
    for i, r in enumerate(shown):
        ids, trained = r["completion_ids"], [bool(t) for t in r["trained"]]
        reward = "none" if r.get("reward") is None else f"{r['reward']:.4g}"
        turns = sum(1 for t in r.get("turns") or [] if isinstance(t, dict) and t.get("role") == "assistant")
        print(f"--- step {step} rollout {i}: reward {reward}, advantage {r.get('advantage', float('nan')):.4g}"
              + (f", {turns} model turns" if turns else "") + f": {len(ids)} completion tokens, {sum(trained)} "
              f"trained (the model's), {len(ids) - sum(trained)} not (the tools' and the template's, or a masked "
              f"truncated completion's)")
        print(f"prompt: {_prompt_line(r.get('prompt'))}")
        print(render(tokenizer, Shown(i, "", ids, trained), color))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``finetune inspect <run config> [key=value ...] [--rows N] [--split train|validation]
    [--color auto|always|never]``: print the first ``N`` tokenized rows of the split with their trained tokens
    marked; returns 0 (also when it warns), or 2 with one ``finetune: error:`` line per problem (a bad config key or
    input, an unknown split or colour choice, ``--rows`` below 1)."""
    p = argparse.ArgumentParser(prog="finetune inspect", description="Print tokenized training rows as the model "
                                "gets them, with the trained tokens (labels != -100) marked.")
    p.add_argument("config", nargs="?", help="run config (YAML or JSON), as for finetune train")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for finetune train")
    p.add_argument("--rows", type=int, default=4, help="rows to show, collated as one micro-batch (default 4)")
    p.add_argument("--split", default="train", help="train (default) or validation")
    p.add_argument("--color", default="auto", help="auto (default: on a terminal), always or never")
    p.add_argument("--completions", default="", metavar="RUN", help="instead of a config: a grpo run folder (or its "
                   "completions.jsonl); show its logged rollouts as the loss saw them, the trained tokens marked")
    p.add_argument("--step", type=int, default=None, help="with --completions: the logged step (default: the last)")
    args = p.parse_intermixed_args(argv)
    try:
        problems = []
        if args.completions and (args.config or args.overrides):
            problems.append("--completions: give a run folder or a run config, not both")
        if not args.completions and not args.config:
            problems.append("a run config (or --completions <run folder>) is required")
        if args.rows < 1:
            problems.append(f"--rows: must be >= 1, got {args.rows}")
        if args.split not in SPLITS:
            problems.append(f"--split: '{args.split}' unknown (choose one of: {', '.join(SPLITS)})")
        if args.color not in COLORS:
            problems.append(f"--color: '{args.color}' unknown (choose one of: {', '.join(COLORS)})")
        if problems:
            raise ConfigError(problems)
        if args.completions:
            return show_recorded(args.completions, args.rows, args.step, _use_color(args.color))
        cfg = checked_inputs_config(args.config, args.overrides)
        recipe = recipe_for(cfg)
        tokenizer = load_tokenizer(cfg, recipe)
        splits = load_splits(recipe, tokenizer, cfg.data, cfg.train.seed)
        split = splits.train if args.split == "train" else splits.validation
        n = min(args.rows, len(split))
        rows = [split[i] for i in range(n)]
        _, sequences = collated_sequences(recipe, tokenizer, cfg, rows)
        prompts = Prompts(recipe, tokenizer, cfg, args.split) if prompted(recipe) else None
    except ConfigError as e:
        return report_error(e)
    color = _use_color(args.color)
    packed = bool(recipe.capabilities.packs_rows and cfg.data.packing)
    one_label = bool(sequences) and sequences[0].label is not None
    marked = ("prompts only: every training step generates their completions" if recipe.rollout(cfg) is not None
              else "one label per row" if one_label else
              f"trained tokens (labels != -100) in {'green' if color else '[[...]]'}")
    print(f"finetune inspect: recipe {cfg.recipe}, {args.split} split, rows 0-{n - 1} of {len(split):,} collated as "
          f"one micro-batch; {marked}" + (f", examples separated by '{BOUNDARY.strip()}'" if packed else ""))
    warnings: dict[str, list[str]] = {NOTHING: [], PROMPT: []}
    zero_rows: set[int] = set()
    located = examples = 0
    for seq in sequences:
        print(header(seq, packed))
        print(render(tokenizer, seq, color))
        if seq.label is not None:
            continue
        if not any(seq.trained):
            zero_rows.add(seq.row)
        if prompts is not None:
            for kind, text in example_problems(seq, prompts):
                warnings[kind].append(text)
            examples += len(seq.starts)
            located += sum(1 for a, b in seq.examples() if prompts.length(seq.ids[a:b]))
    for kind, texts in warnings.items():
        for text in texts[:WARN_EACH]:
            _warn(text)
        if len(texts) > WARN_EACH:
            _warn(f"{len(texts) - WARN_EACH} more examples shown with {kind}")
    if one_label:
        try:
            sample = rollout_sample(recipe, cfg, tokenizer, rows[0]) if rows else None
        except ConfigError as e:
            return report_error(e)
        if sample is not None:
            shape = recipe.rollout(cfg)
            print(sample_header(sample, color, shape[1] - cfg.data.max_seq_len if shape else len(sample.ids)))
            print(render(tokenizer, sample, color))
        return 0
    shown = len({s.row for s in sequences})
    share = f"{100 * len(zero_rows) / shown:.0f}%"
    summary = f"summary: {shown} row{'s' if shown != 1 else ''} shown, {len(zero_rows)} ({share}) with no trained token"
    if prompts is not None:
        summary += f"; prompts located in {located} of {examples} examples (the first {prompts.done:,} raw rows read)"
    whole = [m for m in (untrained_rows(split, c) for c in ("labels", "rejected_labels")) if m is not None]
    zero = total = 0
    if whole:
        zero, total = int(np.logical_or.reduce(whole).sum()), len(whole[0])
        summary += f"; in the whole {args.split} split {zero:,} of {total:,} rows train nothing"
    print(summary)
    if zero_rows and prompts is not None:
        _warn(f"{len(zero_rows)} of {shown} rows shown ({share}) have no trained token")
    if zero:
        _warn(f"{zero:,} of {total:,} rows of the {args.split} split ({100 * zero / total:.1f}%) have no trained "
              f"token (labels all -100)")
    return 0
