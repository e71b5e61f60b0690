"""Chosen/rejected pair rows, as ``dpo`` trains on them and ``kto``, ``reward`` and ``grpo`` read theirs: the
columns (TRL's text and conversational forms), the tokenization of each response as a prompt/response example
(:class:`PairExamples`, with the drops counted), the ``[2B, seq]`` collation of the chosen then the rejected
sequences (:class:`PairCollator`: TRL's "concatenated forward"), the pair counts, the sequence log-probabilities
from the chunked LM head (:func:`sequence_logps`), and the checks of the pairs before any model is built
(:func:`check_pairs`, :func:`doctor_rows`). The form of the data and what is dropped: :mod:`finetune.recipes.dpo`.
"""

from __future__ import annotations

from collections import Counter

import pyarrow.parquet as pq
import torch

from finetune.parallel import sequence
from finetune.data import images, mixture
from finetune.data.batch import model_inputs
from finetune.engine.auto import AutoModelForCausalOrImageTextLM
from finetune.config import DataConfig, RunConfig
from finetune.data.dataset import (
    expand_files,
    missing_columns,
    string_type,
)
from finetune.errors import ConfigError
from finetune.recipes.common.targets import shift_labels
from finetune.recipes.lm_loss import token_loss_sum
from finetune.recipes.common.chat import (
    TemplateCheck,
    chat_template,
    count_summary,
    encode_pair,
    encode_rendered,
    message_problem,
    prepare_tokenizer as sft_tokenizer,
    prompt_ids,
    prompt_length,
    template_text,
    tokenizer_template_problem,
)

MODEL_CLASS = AutoModelForCausalOrImageTextLM
"""Any ``AutoModelForCausalLM``, or an ``AutoModelForImageTextToText`` (a config with a ``vision_config``): its
pairs' prompts then hold images (``dpo``'s ``configure``)."""
REFERENCE_COLUMN = "reference_logps"
"""Column added by the reference pass (:func:`finetune.recipes.common.reference.attach_reference`): ``[ref_c,
ref_r]`` per pair (float64 values of float32 sums)."""


def prompt_column(data_cfg: DataConfig) -> str:
    """``data.prompt_column``, or ``prompt`` when it is empty (TRL's name)."""
    return data_cfg.prompt_column or "prompt"


def columns(data_cfg: DataConfig, with_images: bool = False) -> list[str]:
    """Parquet columns the tokenize function reads: prompt, chosen, rejected; ``with_images`` (an image-text model,
    :func:`configure`): then ``data.image_column``."""
    return [prompt_column(data_cfg), data_cfg.chosen_column, data_cfg.rejected_column,
            *([data_cfg.image_column] if with_images else [])]


def cache_key(data_cfg: DataConfig, with_images: bool = False) -> dict:
    """Settings besides the files, columns and tokenizer that decide the tokenized rows."""
    return {"truncation": data_cfg.truncation, "chat_template": template_text(data_cfg),
            **({"images": data_cfg.image_column, **images.pixel_key(data_cfg)} if with_images else {})}


def prepare_tokenizer(tokenizer):
    """``sft``'s: EOS as the pad token when there is none, right padding; an EOS token ends every response.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """
    return sft_tokenizer(tokenizer)


def prepare_model_config(model_config, data_cfg: DataConfig):
    """Dropout off: every float ``*dropout``/``*pdrop`` probability of the config set to 0 (TRL's
    ``disable_dropout``), so log-probabilities are deterministic (also in the export's ``config.json``); the same in
    each sub-config (an image-text model's ``text_config`` and ``vision_config``)."""
    subs = [getattr(model_config, k, None) for k in getattr(model_config, "sub_configs", {})]
    for config in [model_config, *[c for c in subs if c is not None and hasattr(c, "to_dict")]]:
        for key, value in config.to_dict().items():
            if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
                setattr(config, key, 0.0)
    return model_config


def as_messages(response) -> list[dict] | None:
    """A conversational response: a list of messages as it is, a string as one assistant message."""
    if isinstance(response, str):
        return [{"role": "assistant", "content": response}]
    return list(response) if isinstance(response, (list, tuple)) else None


def generation_pairs(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """``train.eval_generate``'s prompts and references: the prompt (text, or conversation rendered with the
    assistant's turn opened) and the chosen response's text."""
    pairs = []
    for row in rows:
        prompt, chosen = row.get(prompt_column(data_cfg)), row.get(data_cfg.chosen_column)
        if isinstance(prompt, str):
            if prompt.strip() and isinstance(chosen, str) and chosen.strip():
                pairs.append((tokenizer(prompt, add_special_tokens=True)["input_ids"], chosen))
            continue
        messages = as_messages(chosen)
        if prompt is None or message_problem(prompt) or not messages:
            continue
        answer = " ".join(m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        if answer.strip():
            pairs.append((prompt_ids(tokenizer, list(prompt), chat_template(data_cfg, tokenizer)), answer))
    return pairs


class PairExamples:
    """Batched map function: rows -> tokenized pairs; counts what it drops.

    Output columns (lists of int): ``input_ids``, ``attention_mask``, ``labels`` (the chosen sequence) and
    ``rejected_input_ids``, ``rejected_labels``. It gets every row (``Capabilities.counts_rows``) and logs :meth:`summary`.

    Raises:
        ConfigError: a conversational row is malformed (checked before training by :func:`check_pairs`).
    """

    def __init__(self, tokenizer, data_cfg: DataConfig, processor: images.ProcessorSource | None = None):
        self.tokenizer, self.d = tokenizer, data_cfg
        self.template = template_text(data_cfg) or None
        self.processor = processor(tokenizer) if processor is not None else None
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()
        self.shortest_difference = 0
        """Of the pairs dropped as identical after truncation (``identical_truncated``), the fewest tokens that
        keep the first one that differs: a ``data.max_seq_len`` at which one of them is kept (0: none dropped).
        Not part of ``counts`` (it is no sum), so not kept in the tokenization cache."""

    def _template(self) -> str:
        if self.template is None:
            self.template = chat_template(self.d, self.tokenizer)
        return self.template

    def encode(self, prompt, response) -> tuple[list[int], list[int]] | None:
        """Ids and labels of ``prompt + response`` (labels -100 outside the response); None when the
        conversational response has no assistant turn."""
        if isinstance(prompt, str):
            return encode_pair(self.tokenizer, prompt, response)
        messages = as_messages(response)
        if not messages or not any(m.get("role") == "assistant" for m in messages if isinstance(m, dict)):
            return None
        template = self._template()
        for where, turns in (("prompt", prompt), ("response", messages)):
            problem = message_problem(turns)
            if problem:
                raise ConfigError(f"data.{where}_column: a row's {where} is {problem}")
        ids, labels = encode_rendered(self.tokenizer, list(prompt) + messages, template, "prompt/response")
        start = prompt_length(self.tokenizer, list(prompt), template)
        labels[:start] = [-100] * min(start, len(labels))
        return ids, labels

    def encode_with_images(self, prompt, response, pictures: list, where: str = "") \
            -> tuple[list[int], list[int], dict] | None:
        """Ids, labels (the response's assistant tokens only, :func:`~finetune.recipes.vlm_sft` 's way: the template's
        ``{% generation %}`` marks) and the processor's output of ``prompt + response`` with the row's decoded images;
        None when the response has no assistant turn.

        Raises:
            ConfigError: the prompt or response is not a conversation, or the image parts and images differ in number.
        """
        messages = as_messages(response)
        if not messages or not any(m.get("role") == "assistant" for m in messages if isinstance(m, dict)):
            return None
        prompt = images.conversation(prompt, len(pictures))
        problem = images.pairing_problem(list(prompt) + messages, len(pictures))
        if problem:
            where = where or f"a row of '{prompt_column(self.d)}' and '{self.d.image_column}'"
            raise ConfigError(f"data: {where}: {problem}; fix or drop that row")
        kwargs = {"chat_template": self.template} if self.template else {}
        enc = self.processor.apply_chat_template(
            list(prompt) + messages, tokenize=True, return_dict=True, return_tensors="np",
            return_assistant_tokens_mask=True, processor_kwargs={"images": pictures} if pictures else {}, **kwargs)
        ids = enc["input_ids"][0].tolist()
        marks = images.assistant_mask(self.processor, list(prompt) + messages, pictures, enc, self.template,
                                      f"data: {where or 'a row'}")
        labels = [t if m else -100 for t, m in zip(ids, marks)]
        labels[0] = -100
        return ids, labels, enc

    def _fit(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]] | str:
        if len(ids) <= self.d.max_seq_len:
            return ids, labels
        if self.d.truncation == "drop" or self.processor is not None:  # images: never cut (an image stays whole)
            return "too_long"
        ids, labels = ids[: self.d.max_seq_len], labels[: self.d.max_seq_len]
        return (ids, labels) if any(v != -100 for v in labels[1:]) else "truncated_no_answer"

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        out: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "labels", "rejected_input_ids",
                                                "rejected_labels")}
        p_col = prompt_column(d)
        for i, (prompt, chosen, rejected) in enumerate(zip(batch[p_col], batch[d.chosen_column],
                                                           batch[d.rejected_column])):
            c["rows"] += 1
            if prompt is None or not chosen or not rejected:
                c["empty"] += 1
                continue
            if chosen == rejected:
                c["identical"] += 1
                continue
            encs = None
            if self.processor is not None:
                where = images.row_where(batch, i, f"'{p_col}' and '{d.image_column}'")
                pictures = [images.decode_image(v, f"data.image_column: {where}", images.folder_of(batch, i), d)
                            for v in (batch[d.image_column][i] or [])]
                pair = [self.encode_with_images(prompt, r, pictures, where) for r in (chosen, rejected)]
                encs = [p[2] if p else None for p in pair]
                pair = [p[:2] if p else None for p in pair]
            else:
                pair = [self.encode(prompt, chosen), self.encode(prompt, rejected)]
            if pair[0] is None or pair[1] is None:
                c["no_answer"] += 1
                continue
            fitted = [self._fit(*p) for p in pair]
            why = next((f for f in fitted if isinstance(f, str)), None)
            if why:
                c[why] += 1
                continue
            (ids_c, lab_c), (ids_r, lab_r) = fitted
            if ids_c == ids_r:  # nothing tells chosen from rejected: zero gradient, reward accuracy 0
                if any(len(p[0]) > d.max_seq_len for p in pair):
                    c["identical_truncated"] += 1
                    full_c, full_r = pair[0][0], pair[1][0]
                    need = next((i for i, (a, b) in enumerate(zip(full_c, full_r)) if a != b),
                                min(len(full_c), len(full_r))) + 1
                    self.shortest_difference = min(self.shortest_difference or need, need)
                else:
                    c["identical"] += 1
                continue
            if any(len(p[0]) > d.max_seq_len for p in pair):
                c["truncated"] += 1
            out["input_ids"].append(ids_c)
            out["attention_mask"].append([1] * len(ids_c))
            out["labels"].append(lab_c)
            out["rejected_input_ids"].append(ids_r)
            out["rejected_labels"].append(lab_r)
            if encs is not None:  # the prompt's images, once for the pair; each sequence's per-token inputs
                names = self.processor.model_input_names
                images.store(encs[0], out, names)
                rejected: dict[str, list] = {}
                images.store({k: v for k, v in encs[1].items() if k in images.TOKEN_KEYS}, rejected, names)
                for key, values in rejected.items():
                    out.setdefault("rejected_" + key, []).extend(values)
                c["images"] += len(batch[d.image_column][i] or [])
            c["pairs"] += 1
            c["tokens"] += len(ids_c) + len(ids_r)
        return out

    def summary(self) -> str:
        """One line: rows read, pairs kept, what was dropped or truncated and why."""
        c = self.counts
        same = (f"of {c['rows']:,} pairs whose chosen and rejected are identical after truncation to "
                f"data.max_seq_len={self.d.max_seq_len} tokens (raise data.max_seq_len to keep them)")
        text = count_summary("dpo", c, "pairs", [("identical_truncated", same),
                                                 ("identical", "with identical chosen and rejected responses"),
                                                 ("empty", "with a null prompt or a null or empty response"),
                                                 ("no_answer", "with a response without an assistant turn")],
                             self.d.max_seq_len, "response")
        if c["pairs"]:
            text += f"; {c['tokens'] / (2 * c['pairs']):.1f} tokens per sequence"
        if self.processor is not None:
            text += f"; {c['images']:,} images (pairs longer than data.max_seq_len are left out, not cut)"
        return text


def tokenize_function(tokenizer, data_cfg: DataConfig,
                      processor: images.ProcessorSource | None = None) -> PairExamples:
    """The batched map function (:class:`PairExamples`); ``processor``: an image-text model's, whose pairs hold their
    prompt's images (bound by ``dpo``'s ``configure``)."""
    return PairExamples(tokenizer, data_cfg, processor)


class PairCollator:
    """Rows of pairs -> one ``[2B, longest]`` batch: ``input_ids``, ``attention_mask``, ``labels`` (int64; the B
    chosen sequences, then the B rejected ones; right-padded with the pad token, mask 0, label -100; the length
    rounded up to ``pad_to_multiple_of``) and, when the rows have it, ``reference_logps`` ``[2B]`` float32; with images,
    each pair's prompt image tensors for its chosen and again for its rejected sequence, joined as the processor joins
    a batch of the ``2B`` rows (:func:`finetune.data.images.join`), and each sequence's per-token inputs
    (``mm_token_type_ids``, ``token_type_ids``; right-padded with 0: :func:`finetune.data.images.pad_tokens`), which
    the forward passes to the model."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 0):
        self.pad, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        seqs = [(r["input_ids"], r["labels"]) for r in rows] + [(r["rejected_input_ids"], r["rejected_labels"])
                                                                 for r in rows]
        longest = max(len(ids) for ids, _ in seqs)
        if self.multiple:
            longest = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(seqs), longest), self.pad, dtype=torch.long)
        labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, (s, lab) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            labels[i, : len(s)] = torch.tensor(lab, dtype=torch.long)
            mask[i, : len(s)] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if any(k.endswith("__shape") for k in rows[0]):
            pictures = [images.row_tensors(r) for r in rows]
            batch.update(images.join(pictures + pictures))
            batch.update(images.pad_tokens(rows + [{k: r["rejected_" + k] for k in images.TOKEN_KEYS
                                                    if "rejected_" + k in r} for r in rows], longest))
        if REFERENCE_COLUMN in rows[0]:
            ref = [r[REFERENCE_COLUMN] for r in rows]
            batch[REFERENCE_COLUMN] = torch.tensor([c for c, _ in ref] + [r for _, r in ref], dtype=torch.float32)
        return batch


def make_collator(tokenizer, data_cfg: DataConfig) -> PairCollator:
    """:class:`PairCollator` with the tokenizer's pad token."""
    return PairCollator(tokenizer.pad_token_id, data_cfg.pad_to_multiple_of)


def _row_targets(batch: dict) -> torch.Tensor:
    """Targets of each whole sequence ``[2B]`` int64: ``row_targets`` of a sequence-parallel slice, else counted
    from ``labels``."""
    if "row_targets" in batch:
        return batch["row_targets"]
    return (batch["labels"][:, 1:] != -100).sum(dim=1)


def valid_pairs(batch: dict) -> torch.Tensor:
    """``[B]`` bool: the pair's chosen sequence has a target (eval filler rows have none)."""
    rows = _row_targets(batch)
    return rows[: rows.shape[0] // 2] > 0


def count_targets(batch: dict) -> torch.Tensor:
    """Pairs with a target (the chosen half of the ``[2B, seq]`` batch; eval filler rows have none); 0-dim int64.
    Under sequence parallelism the SP group's ranks hold slices of the same pairs: the first counts them, the others
    count 0 (the sum over all ranks counts each pair once)."""
    pairs = valid_pairs(batch).sum()
    return pairs if sequence.sequence_rank() == 0 else pairs * 0


def sequence_logps(model, batch: dict, router: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of every sequence's targets and their number.

    Under sequence parallelism each rank holds a slice of every sequence (``shift_labels``, ``row_targets``,
    :mod:`finetune.parallel.sequence`): the slices' sums are added over the SP group, differentiably
    (:func:`finetune.parallel.sequence.sum_over_sequence`), so every rank gets the whole sequences' values.

    Args:
        model: engine or (peft-wrapped) causal LM.
        batch: ``input_ids``, ``attention_mask``, ``labels`` ``[rows, seq]`` int64, or a sequence-parallel slice
            (``input_ids``, ``position_ids``, ``shift_labels`` ``[rows, seq / sp]``, ``row_targets`` ``[rows]``).
        router: filled with a mixture of experts' router loss term and statistics
            (:func:`finetune.recipes.lm_loss.token_loss_sum`); None: not asked for.

    Returns:
        ``(logps, tokens)``: ``[rows]`` float32, ``sum_t log p(labels[t+1] | ...)`` over the row's targets
        (differentiable when gradients are on), and ``[rows]`` int64 target counts.
    """
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])
    nll, _ = token_loss_sum(model, model_inputs(batch), targets, per_row=True, router=router)
    return -sequence.sum_over_sequence(nll), _row_targets(batch)


def _text_or_messages(typ) -> bool:
    return string_type(typ) or str(typ).startswith(("list", "large_list"))


def check_pairs(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the dpo settings and data before any model is built; append one line per problem.

    Problems: ``train.dpo`` values out of range, a file without a needed column or with a column that is neither
    text nor a list of messages, a null or empty response or a null prompt (the first such row of each file and
    column, and their number), a conversational row whose prompt is not a list of ``{role, content}`` messages or
    whose response has no assistant turn, a conversational file with no chat template to render it, a row on which
    the chat template raises (:class:`finetune.recipes.common.chat.TemplateCheck`: prompt + chosen and prompt + rejected
    rendered once per file version), and a split none of whose pairs is left once cut to ``data.max_seq_len``
    because chosen and rejected become identical (read until the first pair that is kept).
    """
    s, d = cfg.train.dpo, cfg.data
    if s.beta <= 0:
        problems.append(f"train.dpo.beta: {s.beta} must be > 0 (TRL's default 0.1)")
    if not 0 <= s.label_smoothing < 0.5:
        problems.append(f"train.dpo.label_smoothing: {s.label_smoothing} must be in [0, 0.5)")
    elif s.label_smoothing and s.loss_type in ("ipo", "orpo"):
        paper = "Azar et al. 2023, eq. 17" if s.loss_type == "ipo" else "Hong et al. 2024, eq. 6"
        problems.append(f"train.dpo.label_smoothing: {s.label_smoothing} with loss_type {s.loss_type}, whose loss "
                        f"({paper}) has no flipped-preference term to smooth; set train.dpo.label_smoothing=0 or "
                        f"use loss_type sigmoid (cDPO)")
    if s.rpo_alpha and s.loss_type == "orpo":
        problems.append(f"train.dpo.rpo_alpha: {s.rpo_alpha} with loss_type orpo, whose loss already holds the chosen "
                        f"response's NLL; set train.dpo.rpo_alpha=0")
    if s.rpo_alpha < 0:
        problems.append(f"train.dpo.rpo_alpha: {s.rpo_alpha} must be >= 0")
    if images.in_prompts(cfg):
        _image_pair_problems(cfg, train_files, validation_files, problems)
        return
    conversational = False
    templates = TemplateCheck(cfg, prepare_tokenizer)
    for key, files in (("data.train_files", train_files), ("data.validation_files", validation_files)):
        split_start = len(problems)
        for f in files:
            try:
                schema = pq.ParquetFile(f).schema_arrow
            except Exception:  # noqa: BLE001  (reported by check_parquet_files)
                split_start = -1
                continue
            file_start = len(problems)
            reads = "dpo reads data.prompt_column (default 'prompt'), data.chosen_column and data.rejected_column"
            problem = missing_columns(key, f, schema, columns(d), reads)
            if problem:
                problems.append(problem)
                continue
            bad = [c for c in columns(d) if not _text_or_messages(schema.field(c).type)]
            if bad:
                problems.append(f"{key}: '{f}' column '{bad[0]}' has type {schema.field(bad[0]).type}, neither "
                                f"text nor a list of {{role, content}} messages")
                continue
            table = pq.read_table(f, columns=columns(d))
            prompts = table.column(prompt_column(d)).to_pylist()
            responses = {}
            for col in columns(d):
                values = prompts if col == prompt_column(d) else table.column(col).to_pylist()
                responses[col] = values
                empty = [i for i, v in enumerate(values) if v is None or (col != prompt_column(d) and not v)
                         or (isinstance(v, str) and col != prompt_column(d) and not v.strip())]
                if empty:
                    what = "null" if col == prompt_column(d) else "null or empty"
                    problems.append(f"{key}: '{f}' row {empty[0]} of column '{col}' is {what} ({len(empty):,} such "
                                    f"rows); fix or remove them")
                    continue
                if col == prompt_column(d):
                    continue
                for i, (prompt, response) in enumerate(zip(prompts, values)):
                    if isinstance(prompt, str):
                        continue
                    conversational = True
                    problem = message_problem(prompt)
                    messages = as_messages(response)
                    if problem is None and messages is not None:
                        problem = message_problem(messages)
                        if problem is None and not any(m["role"] == "assistant" for m in messages):
                            problem = "a response without an assistant turn"
                    if problem:
                        problems.append(f"{key}: '{f}' row {i} of column "
                                        f"'{col if messages is None or 'assistant' in problem else prompt_column(d)}'"
                                        f" is {problem}; a conversational row is a list of {{role, content}} "
                                        f"messages (prompt) and assistant messages (chosen, rejected)")
                        break
            if len(problems) == file_start and any(not isinstance(p, str) for p in prompts):
                templates.check(key, f, columns(d), ((i, col, list(p) + as_messages(responses[col][i]))
                                                     for i, p in enumerate(prompts) if not isinstance(p, str)
                                                     for col in (d.chosen_column, d.rejected_column)), problems)
        if files and len(problems) == split_start:
            _check_pairs_left(templates.tokenizer(), d, key, files, problems)
    if conversational and not template_text(d):
        tokenizer_template_problem(cfg, problems)


def _pair_batches(files: list[str], data_cfg: DataConfig, limit: int = 0, size: int = 256):
    """The rows of ``files`` (the first ``limit`` when > 0) as batches of :func:`columns` (dicts of lists)."""
    left = limit or None
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(columns=columns(data_cfg), batch_size=size):
            rows = batch.to_pydict()
            if left is not None:
                rows = {k: v[:left] for k, v in rows.items()}
                left -= len(rows[prompt_column(data_cfg)])
            yield rows
            if left is not None and left <= 0:
                return


def identical_after_truncation(tokenizer, data_cfg: DataConfig, files: list[str], limit: int = 0,
                               until_kept: bool = False) -> PairExamples:
    """Tokenize the pairs of ``files`` as training does (:class:`PairExamples`; the first ``limit`` rows when > 0)
    and return the map function with its counts: ``rows``, ``pairs`` (kept), ``identical_truncated`` (dropped:
    chosen and rejected identical after truncation to ``data.max_seq_len``) and the other reasons; its
    ``shortest_difference``. With ``until_kept`` it stops at the first batch (256 rows) that keeps a pair.

    Raises:
        ConfigError: a malformed conversational row (reported by :func:`check_pairs` first).
    """
    fn = PairExamples(tokenizer, data_cfg)
    for batch in _pair_batches(files, data_cfg, limit):
        fn(batch)
        if until_kept and fn.counts["pairs"]:
            break
    return fn


def _image_pair_problems(cfg: RunConfig, train_files: list[str], validation_files: list[str],
                         problems: list[str]) -> None:
    """An image-text model's pairs: no ``train.eval_generate``; the files, their image rows and the processor as
    :func:`finetune.data.images.check_prompt_files` checks them."""
    if cfg.train.eval_generate.prompts:
        problems.append(f"train.eval_generate.prompts: {cfg.train.eval_generate.prompts}; model.path "
                        f"'{cfg.model.path}' is an image-text model: not available with images yet; set it to 0")
    images.check_prompt_files(cfg, "dpo", columns(cfg.data, with_images=True),
                              "data.prompt_column (default 'prompt'), data.chosen_column, data.rejected_column and "
                              "data.image_column (default 'images')", train_files, validation_files, problems)


def _check_pairs_left(tokenizer, d: DataConfig, key: str, files: list[str], problems: list[str]) -> None:
    """Refuse a split none of whose pairs survives truncation because chosen and rejected become identical (they
    would train on nothing: loss log 2 at every step, reward accuracy 0). Reads until the first kept pair, so a
    split that has one costs one batch of rows."""
    if tokenizer is None or d.truncation != "truncate":
        return
    limit = d.max_train_rows if key == "data.train_files" else 0
    try:
        fn = identical_after_truncation(tokenizer, d, files, limit, until_kept=True)
    except Exception:  # noqa: BLE001  (malformed rows and templates are reported by check_pairs)
        return
    c = fn.counts
    if c["pairs"] or not c["identical_truncated"]:
        return
    use = "to train on" if key == "data.train_files" else "to evaluate on"
    problems.append(f"{key}: no pair of {', '.join(repr(f) for f in files)} is left {use}: the chosen and rejected "
                    f"responses of all its {c['identical_truncated']:,} pairs are identical after "
                    f"truncation to data.max_seq_len={d.max_seq_len} tokens (they differ after it); raise "
                    f"data.max_seq_len (data.max_seq_len={fn.shortest_difference} keeps at least one) or shorten "
                    f"the prompts")


def doctor_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """``finetune doctor``'s ``dpo`` rows: per split (and source), the share of pairs dropped because chosen and
    rejected are identical after truncation to ``data.max_seq_len`` (``ok`` none, ``warn`` some, ``FAIL`` all).
    Tokenizes the splits' files in this process (the validation share of a held-out split is not measured).
    Nothing when the tokenizer or the files cannot be read (other rows report that)."""
    rows: list[tuple[str, str, str]] = []
    tokenizer = TemplateCheck(cfg, prepare_tokenizer).tokenizer()
    if tokenizer is None:
        return rows
    problems: list[str] = []
    sources = mixture.sources_of(cfg.data, problems)
    for where, d in [(f"{s.where}: ", s.data) for s in sources] or [("", cfg.data)]:
        for key, patterns in (("data.train_files", d.train_files), ("data.validation_files", d.validation_files)):
            files = expand_files(patterns, key, problems)
            if not files:
                continue
            limit = d.max_train_rows if key == "data.train_files" else 0
            try:
                fn = identical_after_truncation(tokenizer, d, files, limit)
            except Exception:  # noqa: BLE001  (bad files and rows are reported by the data and config rows)
                continue
            c, name = fn.counts, (where + key.removeprefix("data.") if where else key)
            n, total = c["identical_truncated"], c["rows"]
            status = "ok" if not n else "FAIL" if not c["pairs"] else "warn"
            text = (f"{name}: {n:,} of {total:,} pairs ({100 * n / max(total, 1):.1f}%) have chosen and rejected "
                    f"identical after truncation to data.max_seq_len={d.max_seq_len} tokens")
            if n:
                text += (f" and are dropped ({c['pairs']:,} pairs left); raise data.max_seq_len "
                         f"(at {fn.shortest_difference} tokens the first of them would be kept)")
            rows.append(("dpo", status, text))
    return rows


