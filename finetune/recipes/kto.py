"""KTO: preference training of any ``AutoModelForCausalLM`` on unpaired rows, each a completion marked desirable or
undesirable (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eqs. 7-8; TRL's
``KTOTrainer``).

Data, in TRL's unpaired form: ``data.prompt_column`` (default ``prompt``), ``data.completion_column`` (default
``completion``) and ``data.label_column`` (default ``label``: bool, or ints 0/1; true = desirable). Prompt and
completion are text, or (conversational) a list of ``{role, content}`` messages and a list of assistant messages,
encoded as ``dpo`` encodes a prompt and a response (:meth:`finetune.recipes.common.pairs.PairExamples.encode`:
the prompt's tokens are no targets; the completion ends with EOS).

The loss of a row (``train.kto``; ``r = log pi(y|x) - log pi_ref(y|x)``, the completion's log-ratio summed over
its tokens; ``sigma`` the logistic function)::

    desirable:    desirable_weight   * (1 - sigma(beta * (r - z)))
    undesirable:  undesirable_weight * (1 - sigma(beta * (z - r)))

``z`` is the reference point, an estimate of ``KL(pi || pi_ref)``: the mean over the rows of the **global batch**
(every micro-batch of the optimizer step on every rank) of ``log pi(y'|x) - log pi_ref(y'|x)`` for a mismatched
pair ``(x, y')``, clamped at 0 and detached (no gradient flows through it, as in the paper and TRL). The mismatched
pair of a row is its prompt with the completion of the row before it (TRL's rotation ``(x_1, y_n), (x_2, y_1),
...``), fixed at tokenization: within each tokenization batch of rows (:data:`finetune.data.tokenization.MAP_BATCH`,
the row order of the files), the first row takes the last row's completion. So a row's KL pair does not depend on
the shuffling, the ranks or the micro-batch split, and a micro batch of one row is fine.

Where this differs from TRL 1.16: TRL builds the mismatched pairs per ``per_device_train_batch_size`` rows of the
dataset in order (and needs sequential sampling and a device batch of at least 2) and estimates ``z`` per
micro-batch, averaged over the processes; here ``z`` is computed once per optimizer step over its whole global
batch (:func:`before_step`: a no-grad forward of the KL sequences of the step's micro-batches, one all-reduce), so the
step's loss and gradient are those of one device on the whole global batch, whatever the ranks and accumulation
(the loop's invariant, :mod:`finetune.training.trainer`). In evaluation (no step) ``z`` is estimated per evaluation
micro-batch, over its rows.

A collated micro-batch of ``B`` rows is ``[2B, seq]``: the ``B`` completions (prompt + completion), then the ``B`` KL
sequences (prompt + mismatched completion), so that the reference pass of ``dpo`` serves both unchanged
(:func:`finetune.recipes.common.reference.attach_reference`: ``reference_logps`` ``[ref of the completion, ref of
the KL pair]`` per row, computed once before training with the initial weights and cached; with LoRA the initial adapters are
zero, so this is the base model). The loss's forward runs the completions only; the KL sequences run under no grad
in :func:`before_step`.

Row weighting: ``count_targets`` counts rows with a completion target (``dpo``'s) and ``forward`` sums the rows'
weighted losses, so the step's loss is the mean over the global batch's rows of the weighted losses (TRL's
``losses.nanmean()`` of the weighted losses). Metrics, TRL's names: ``rewards/chosen`` and ``rewards/rejected``
(``beta * r`` of desirable and of undesirable rows), ``logps/chosen``, ``logps/rejected``, ``kl`` (``z``).
Dropout is off, LoRA's included (``dpo``'s ``prepare_model_config`` and ``Capabilities.disables_dropout``).
"""

from __future__ import annotations

import dataclasses
import functools

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from finetune.config import DataConfig, KtoConfig, RunConfig
from finetune.data.batch import LossOutput, to_device
from finetune.data.dataset import TrainData, missing_columns, string_type
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common import pairs, reference
from finetune.recipes.common.chat import TemplateCheck, count_summary, message_problem, template_text, \
    tokenizer_template_problem

MODEL_CLASS = pairs.MODEL_CLASS
KL_COLUMN = "kto_kl"
"""Batch key set by :func:`before_step`: ``z``, the global batch's KL estimate (0-dim float32)."""


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns the tokenize function reads: prompt, completion, label."""
    return [pairs.prompt_column(data_cfg), data_cfg.completion_column, data_cfg.label_column]


def cache_key(data_cfg: DataConfig) -> dict:
    """``dpo``'s settings (truncation, chat template) and how the KL pairs are built."""
    return {**pairs.cache_key(data_cfg), "kl_pairs": "previous row of the tokenization batch"}


prepare_tokenizer = pairs.prepare_tokenizer
prepare_model_config = pairs.prepare_model_config


def generation_pairs(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """``train.eval_generate``'s prompts and references: the desirable rows' prompts and completions (as ``dpo``'s
    chosen responses)."""
    as_pairs = [{pairs.prompt_column(data_cfg): r.get(pairs.prompt_column(data_cfg)),
                 data_cfg.chosen_column: r.get(data_cfg.completion_column)}
                for r in rows if r.get(data_cfg.label_column) in (True, 1)]
    return pairs.generation_pairs(tokenizer, as_pairs, data_cfg)


class UnpairedExamples(pairs.PairExamples):
    """Batched map function: rows -> tokenized rows with their KL pair; counts what it drops.

    Output columns: ``input_ids``, ``attention_mask``, ``labels`` (prompt + completion, labels -100 on the prompt),
    ``kl_input_ids``, ``kl_labels`` (the prompt + the previous kept row's completion of the same batch, cut to
    ``data.max_seq_len``) and ``label`` (1 desirable, 0 undesirable). Rows with a null prompt, label or completion,
    an empty completion, a conversational completion without an assistant turn, or no completion token within
    ``data.max_seq_len`` (``drop``: longer than it) are dropped and counted.

    Raises:
        ConfigError: a conversational row is malformed (checked before training by :func:`check_rows`).
    """

    def __call__(self, batch: dict) -> dict:
        d, c = self.d, self.counts
        kept = []
        for prompt, completion, label in zip(batch[pairs.prompt_column(d)], batch[d.completion_column],
                                             batch[d.label_column]):
            c["rows"] += 1
            if prompt is None or label is None or not completion or (isinstance(completion, str)
                                                                     and not completion.strip()):
                c["empty"] += 1
                continue
            encoded = self.encode(prompt, completion)
            if encoded is None:
                c["no_answer"] += 1
                continue
            fitted = self._fit(*encoded)
            if isinstance(fitted, str):
                c[fitted] += 1
                continue
            if len(encoded[0]) > d.max_seq_len:
                c["truncated"] += 1
            kept.append((prompt, completion, fitted, int(bool(label))))
        out: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "labels", "kl_input_ids",
                                                "kl_labels", "label")}
        for j, (prompt, _, (ids, labels), label) in enumerate(kept):
            other_prompt, other_completion = kept[j - 1][0], kept[j - 1][1]  # j = 0: the batch's last row
            kl_ids, kl_labels = self.encode(prompt, other_completion)
            if other_prompt == prompt:
                c["kl_same_prompt"] += 1
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
            out["kl_input_ids"].append(kl_ids[: d.max_seq_len])
            out["kl_labels"].append(kl_labels[: d.max_seq_len])
            out["label"].append(label)
            c["examples"] += 1
            c["desirable"] += label
            c["tokens"] += len(ids)
        return out

    def summary(self) -> str:
        """One line: rows read, rows kept (desirable / undesirable), what was dropped or truncated and why, and the
        KL pairs whose prompt is the row's own (a tokenization batch of one row, or neighbouring rows of one prompt:
        shuffle the file)."""
        c = self.counts
        text = count_summary("kto", c, "examples", [("empty", "with a null prompt or label or a null or empty "
                                                              "completion"),
                                                     ("no_answer", "with a completion without an assistant turn")],
                             self.d.max_seq_len, "completion")
        if c["examples"]:
            text += (f"; {c['desirable']:,} desirable, {c['examples'] - c['desirable']:,} undesirable; "
                     f"{c['tokens'] / c['examples']:.1f} tokens per sequence")
        if c["kl_same_prompt"]:
            text += (f"; {c['kl_same_prompt']:,} KL pairs with the row's own prompt (not mismatched: neighbouring "
                     f"rows of one prompt; shuffle the rows)")
        return text


def tokenize_function(tokenizer, data_cfg: DataConfig) -> UnpairedExamples:
    """The batched map function (:class:`UnpairedExamples`)."""
    return UnpairedExamples(tokenizer, data_cfg)


class KtoCollator(pairs.PairCollator):
    """Rows -> one ``[2B, longest]`` batch (``dpo``'s :class:`~finetune.recipes.common.pairs.PairCollator`): the ``B``
    completions, then the ``B`` KL sequences; ``desirable`` ``[B]`` bool (the rows' ``label``) and, when the rows have it,
    ``reference_logps`` ``[2B]`` float32."""

    def __call__(self, rows: list[dict]) -> dict:
        batch = super().__call__([{**r, "rejected_input_ids": r["kl_input_ids"], "rejected_labels": r["kl_labels"]}
                                  for r in rows])
        batch["desirable"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
        return batch


def make_collator(tokenizer, data_cfg: DataConfig) -> KtoCollator:
    """:class:`KtoCollator` with the tokenizer's pad token."""
    return KtoCollator(tokenizer.pad_token_id, data_cfg.pad_to_multiple_of)


count_targets = pairs.count_targets
"""Rows with a completion target (the first half of the ``[2B, seq]`` batch; eval filler rows have none)."""


def valid_rows(batch: dict) -> torch.Tensor:
    """``[B]`` bool: the row's completion has a target (eval filler rows have none)."""
    b = batch["labels"].shape[0] // 2
    return (batch["labels"][:b, 1:] != -100).any(dim=1)


def _half(batch: dict, second: bool) -> dict:
    """The completions (``second`` False) or the KL sequences of a collated batch: ``input_ids``,
    ``attention_mask``, ``labels`` ``[B, seq]``."""
    b = batch["input_ids"].shape[0] // 2
    part = slice(b, None) if second else slice(None, b)
    return {k: batch[k][part] for k in ("input_ids", "attention_mask", "labels")}


def _reference(batch: dict, second: bool) -> torch.Tensor:
    """``[B]`` reference log-probabilities of the completions or of the KL sequences.

    Raises:
        ValueError: the batch has no ``reference_logps`` (the reference pass, :func:`before_training`, did not run).
    """
    ref = batch.get(pairs.REFERENCE_COLUMN)
    if ref is None:
        raise ValueError("kto: the batch has no reference_logps; run the reference pass (before_training) first")
    b = ref.shape[0] // 2
    return ref[b:] if second else ref[:b]


@torch.no_grad()
def kl_sums(model, batch: dict) -> torch.Tensor:
    """``[2]`` float64: the sum over the batch's rows with a completion target of ``log pi(y'|x) - log pi_ref(y'|x)``
    (their KL pairs, no gradient), and their number."""
    logps, _ = pairs.sequence_logps(model, _half(batch, second=True))
    valid = valid_rows(batch)
    ratio = (logps - _reference(batch, second=True).to(logps.dtype)).double()
    return torch.stack([(ratio * valid).sum(), valid.sum().double()])


def kl_estimate(sums: torch.Tensor) -> torch.Tensor:
    """``z`` from :func:`kl_sums`'s ``[2]`` (summed over batches and ranks): their mean, clamped at 0; 0-dim
    float32."""
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()


def before_step(engine, micro: list[dict], cfg: RunConfig) -> list[dict]:
    """The KL estimate ``z`` of the step's global batch, stored in each micro-batch (``kto_kl``): the KL sequences
    of this rank's micro-batches run with no gradient (eval mode: dropout is off anyway), their log-ratio sums and
    counts all-reduced over the ranks (one all-reduce; every rank runs the same number of forwards, as ZeRO-3
    needs)."""
    engine.eval()
    sums = torch.stack([kl_sums(engine, to_device(b, engine.device)) for b in micro]).sum(0)
    engine.train()
    z = kl_estimate(dist_utils.all_reduce_sum(sums)).cpu()
    return [{**b, KL_COLUMN: z} for b in micro]


def row_losses(logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, z: torch.Tensor,
               s: KtoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's per-row loss (Ethayarajh et al. 2024, eq. 8 with TRL's weights; the module docstring's formulas).

    Args:
        logps: ``[B]`` float32 policy log-probabilities of the completions (summed over their tokens).
        ref: ``[B]`` float32 reference log-probabilities.
        desirable: ``[B]`` bool.
        z: 0-dim float32, the KL estimate (>= 0; no gradient flows through it).
        s: ``train.kto``.

    Returns:
        ``(losses, rewards)``, each ``[B]`` float32: the weighted losses and ``beta * (logps - ref)`` (detached).
    """
    ratio = logps - ref
    z = z.detach().to(logps.dtype)
    good = s.desirable_weight * (1 - torch.sigmoid(s.beta * (ratio - z)))
    bad = s.undesirable_weight * (1 - torch.sigmoid(s.beta * (z - ratio)))
    return torch.where(desirable, good, bad), s.beta * ratio.detach()


def forward(model, batch: dict, metrics: bool = False, settings: KtoConfig | None = None) -> LossOutput:
    """The KTO loss of one micro-batch, summed over its rows (``count_targets``).

    ``z`` is the batch's ``kto_kl`` (the step's global estimate, :func:`before_step`); without it (evaluation) it is
    estimated from this batch's own KL pairs. Metrics (every call; sums over the valid rows of each kind):
    ``rewards/chosen``, ``rewards/rejected``, ``logps/chosen``, ``logps/rejected``, ``kl``.

    Args:
        model: the engine (or a causal LM).
        batch: :class:`KtoCollator`'s batch on the model's device, with ``reference_logps``.
        metrics: accepted for the contract (the metrics are always returned).
        settings: ``train.kto`` (bound by ``configure``; the defaults when None).

    Returns:
        :class:`~finetune.data.batch.LossOutput`: ``loss_sum`` 0-dim float32 over rows, ``targets`` the row count.

    Raises:
        ValueError: the batch has no ``reference_logps``.
    """
    s = settings or KtoConfig()
    z = batch.get(KL_COLUMN)
    if z is None:
        z = kl_estimate(kl_sums(model, batch))
    router: dict = {}  # a mixture of experts: its load-balancing loss term and router statistics
    logps, _ = pairs.sequence_logps(model, _half(batch, second=False), router)
    ref = _reference(batch, second=False).to(logps.dtype)
    desirable = batch["desirable"].bool()
    losses, rewards = row_losses(logps, ref, desirable, z.to(logps.device), s)
    valid = valid_rows(batch).to(losses.dtype)
    good, bad = valid * desirable, valid * ~desirable
    lp = logps.detach()
    n = valid.sum()
    sums = {"rewards/chosen": ((rewards * good).sum(), good.sum()), "rewards/rejected": ((rewards * bad).sum(), bad.sum()),
            "logps/chosen": ((lp * good).sum(), good.sum()), "logps/rejected": ((lp * bad).sum(), bad.sum()),
            "kl": (z.to(lp.device, lp.dtype) * n, n)}
    return LossOutput((losses * valid).sum(), count_targets(batch), metrics={**sums, **router.get("metrics", {})},
                      aux_loss=router.get("aux_loss"))


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """The recipe with ``train.kto`` bound into ``forward``."""
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=cfg.train.kto))


def before_training(engine, data: TrainData, cfg: RunConfig) -> TrainData:
    """The reference log-probabilities of every row's completion and KL pair as the ``reference_logps`` column of both
    splits, computed once with the initial weights and cached
    (:func:`~finetune.recipes.common.reference.attach_reference`, as ``dpo``'s).
    Must run before a checkpoint is restored."""
    if cfg.model.lora is not None:
        logger.info("kto: reference = the base model (LoRA adapters off), computed once before training")
    return reference.attach_reference(engine, data, cfg, "kto", "rows")


def _text_or_messages(typ) -> bool:
    return string_type(typ) or str(typ).startswith(("list", "large_list"))


def check_rows(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the kto settings and data before any model is built; append one line per problem.

    Problems: ``train.kto`` values out of range; a file without a needed column; a prompt or completion column that
    is neither text nor a list of messages; a label column that is neither bool nor integer, or an integer label
    other than 0 and 1 (the first such row and their number); a null prompt or label, a null or empty completion (the
    first such row of each file and column, and their number); a conversational row whose prompt is not a list of
    ``{role, content}`` messages or whose completion has no assistant turn; a conversational file with no chat
    template, or a row on which the template raises; a split of fewer than 2 rows (its one row's KL pair would be
    its own completion).
    """
    s, d = cfg.train.kto, cfg.data
    for key in ("beta", "desirable_weight", "undesirable_weight"):
        if getattr(s, key) <= 0:
            problems.append(f"train.kto.{key}: {getattr(s, key)} must be > 0")
    p_col, c_col, l_col = columns(d)
    conversational = False
    templates = TemplateCheck(cfg, prepare_tokenizer)
    for key, files in (("data.train_files", train_files), ("data.validation_files", validation_files)):
        rows, readable = 0, True
        for f in files:
            try:
                schema = pq.ParquetFile(f).schema_arrow
            except Exception:  # noqa: BLE001  (reported by check_parquet_files)
                readable = False
                continue
            reads = ("kto reads data.prompt_column (default 'prompt'), data.completion_column (default "
                     "'completion') and data.label_column (default 'label')")
            problem = missing_columns(key, f, schema, columns(d), reads)
            if problem:
                problems.append(problem)
                continue
            bad = [c for c in (p_col, c_col) if not _text_or_messages(schema.field(c).type)]
            if bad:
                problems.append(f"{key}: '{f}' column '{bad[0]}' has type {schema.field(bad[0]).type}, neither "
                                f"text nor a list of {{role, content}} messages")
                readable = False
                continue
            label_type = schema.field(l_col).type
            if not (pa.types.is_boolean(label_type) or pa.types.is_integer(label_type)):
                problems.append(f"{key}: '{f}' column '{l_col}' has type {label_type}; kto reads bool labels "
                                f"(true: desirable, false: undesirable) or integers 0/1; convert the column")
                readable = False
                continue
            table = pq.read_table(f, columns=columns(d))
            rows += table.num_rows
            prompts, completions = table.column(p_col).to_pylist(), table.column(c_col).to_pylist()
            labels = table.column(l_col).to_pylist()
            for col, values, empty in (
                    (p_col, prompts, lambda v: v is None),
                    (c_col, completions, lambda v: v is None or not v or (isinstance(v, str) and not v.strip())),
                    (l_col, labels, lambda v: v is None)):
                found = [i for i, v in enumerate(values) if empty(v)]
                if found:
                    what = "null or empty" if col == c_col else "null"
                    problems.append(f"{key}: '{f}' row {found[0]} of column '{col}' is {what} ({len(found):,} such "
                                    f"rows); fix or remove them")
            outside = [i for i, v in enumerate(labels) if v is not None and v not in (0, 1)]
            if outside:
                problems.append(f"{key}: '{f}' row {outside[0]} of column '{l_col}' is {labels[outside[0]]}, not "
                                f"true/false (1/0) ({len(outside):,} such rows); kto labels a completion desirable "
                                f"(true, 1) or undesirable (false, 0)")
            file_start = len(problems)
            for i, (prompt, completion) in enumerate(zip(prompts, completions)):
                if isinstance(prompt, str) or prompt is None or completion is None:
                    continue
                conversational = True
                messages = pairs.as_messages(completion)
                problem, col = message_problem(prompt), p_col
                if problem is None and messages is not None:
                    problem, col = message_problem(messages), c_col
                    if problem is None and not any(m["role"] == "assistant" for m in messages):
                        problem = "a completion without an assistant turn"
                if problem:
                    problems.append(f"{key}: '{f}' row {i} of column '{col}' is {problem}; a conversational row is "
                                    f"a list of {{role, content}} messages (prompt) and assistant messages "
                                    f"(completion)")
                    break
            if len(problems) == file_start and any(isinstance(p, list) for p in prompts):
                templates.check(key, f, columns(d), ((i, c_col, list(p) + pairs.as_messages(completions[i]))
                                                     for i, p in enumerate(prompts) if isinstance(p, list)
                                                     and completions[i]), problems)
        if files and readable and rows < 2:
            problems.append(f"{key}: {', '.join(repr(f) for f in files)} hold(s) {rows} row(s); kto pairs each row's "
                            f"prompt with another row's completion for its KL estimate and needs at least 2 rows")
    if conversational and not template_text(d):
        tokenizer_template_problem(cfg, problems)


RECIPE = Recipe(name="kto", model_class=MODEL_CLASS,
                capabilities=Capabilities(generates_text=True, reports_perplexity=False, sequences_per_row=2,
                                          disables_dropout=True,
                                          sequence_names=("completion", "KL"),
                                          eval_metrics=("rewards/chosen", "rewards/rejected", "logps/chosen",
                                                        "logps/rejected", "kl"),
                                          checks_columns=True, counts_rows=True, evaluates_exports=False),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, before_training=before_training,
                before_step=before_step, columns=columns, cache_key=cache_key, check_data=check_rows,
                prepare_model_config=prepare_model_config, generation_pairs=generation_pairs)
