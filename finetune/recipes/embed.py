"""Sentence embeddings with any ``AutoModel`` encoder (or decoder): the multiple-negatives ranking loss over pairs or
triplets, loading and writing sentence-transformers folders.

Rows are sentence-transformers' forms: ``data.anchor_column`` and ``data.positive_column`` (pairs), with
``data.negative_column`` a hard negative each (triplets), with ``data.score_column`` a similarity score in [0, 1] per
pair (STS-B's form; a pair scored below ``train.embed.relevant_score`` is no positive pair). Each side is tokenized
on its own, truncated to ``data.max_seq_len``; a row holds its sides' tokens one after the other (``side_lengths``).

Embeddings: the model's last hidden states pooled over each text's real tokens (``train.embed.pooling``: the
``1_Pooling/config.json`` of a sentence-transformers ``model.path``, ``mean`` by default; sentence-transformers'
``Pooling`` module), in float32.

Loss (``forward``): the multiple-negatives ranking loss (Henderson et al. 2017, "Efficient Natural Language Response
Suggestion for Smart Reply"; sentence-transformers' ``MultipleNegativesRankingLoss``, InfoNCE with in-batch
negatives): for each anchor, the cross-entropy of ``train.embed.scale`` x the cosine similarities to every candidate,
its own positive the target; the candidates are the positives, then the hard negatives, of the micro-batch of every
data-parallel rank (``train.embed.gather_across_ranks``: gathered with ``torch.distributed.nn.functional.all_gather``,
whose backward sums every rank's gradient of its copy into the rank that made it), or with ``train.embed.cached`` of
every micro-batch of the step on every rank (the gradient cache, :func:`before_step`). With
``train.embed.symmetric`` each positive also retrieves its anchor among the anchors, the two cross-entropies
averaged (``MultipleNegativesSymmetricRankingLoss``). ``count_targets`` counts the positive pairs, so the loss is
the mean over the global batch's anchors whatever the ranks and accumulation.

Evaluation (``eval_report``): every validation row's anchor and positive embeddings are summed into a table over
batches and ranks (each row at its index), then: retrieval of each query's positive among all rows' positives
(``eval/mrr_at_10``, ``eval/ndcg_at_10``, ``eval/accuracy_at_1``; the queries are the anchors of the positive pairs,
each with one relevant passage, as sentence-transformers' ``InformationRetrievalEvaluator`` scores them by cosine
similarity) and with ``data.score_column`` the Spearman correlation of each pair's cosine similarity with its score
(``eval/spearman``, ``EmbeddingSimilarityEvaluator``'s ``spearman_cosine``).

The export is a sentence-transformers folder (``export_files``): ``modules.json`` (Transformer, Pooling, and
Normalize with ``train.embed.normalize`` or when ``model.path`` had one), ``1_Pooling/config.json``,
``sentence_bert_config.json`` (``max_seq_length`` = ``data.max_seq_len``), so
``sentence_transformers.SentenceTransformer(path)`` loads it and embeds as the engine does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModel

from finetune.config import DataConfig, EmbedConfig, RunConfig
from finetune.data.batch import LossOutput, model_inputs, to_device
from finetune.data.dataset import file_schemas, missing_columns
from finetune.errors import ConfigError
from finetune.recipes import Capabilities, Recipe, pad_with_eos
from finetune.recipes.common.widths import by_width

MODEL_CLASS = AutoModel

POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
                "lasttoken": "pooling_mode_lasttoken"}
"""Pooling mode -> its flag in a sentence-transformers ``Pooling`` module's ``config.json``."""


# -- sentence-transformers folders -------------------------------------------------------------------------------------

def folder_pooling(folder: str | Path) -> tuple[str | None, bool]:
    """The pooling mode and whether embeddings are normalized, as a sentence-transformers folder's ``modules.json``
    says (``(None, False)`` for a plain transformers folder).

    Raises:
        ConfigError: the folder's ``Pooling`` module uses a mode this recipe does not run (``weightedmean``,
            ``mean_sqrt_len_tokens``, several at once).
    """
    folder = Path(folder)
    spec = folder / "modules.json"
    if not spec.is_file():
        return None, False
    modules = json.loads(spec.read_text())
    mode, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            cfg_file = folder / m.get("path", "") / "config.json"
            pool_cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            on = [k for k, v in pool_cfg.items() if k.startswith("pooling_mode_") and v]
            modes = [name for name, key in POOLING_KEYS.items() if key in on]
            if len(on) != 1 or len(modes) != 1:
                raise ConfigError(f"model.path: '{cfg_file}' pools with {', '.join(on) or 'no mode'}; embed runs one "
                                  f"of {', '.join(POOLING_KEYS.values())}; set train.embed.pooling to one of "
                                  f"{', '.join(POOLING_KEYS)} to choose")
            mode = modes[0]
    return mode, normalize


def resolve_pooling(cfg: RunConfig) -> tuple[str, bool]:
    """``(pooling mode, normalize)`` of the run: ``train.embed.pooling`` unless ``auto``, then the folder's, then
    ``mean``; normalized when ``train.embed.normalize`` or the folder has a ``Normalize`` module."""
    e = cfg.train.embed
    mode, normalize = folder_pooling(cfg.model.path) if Path(cfg.model.path).is_dir() else (None, False)
    return (e.pooling if e.pooling != "auto" else mode or "mean"), e.normalize or normalize


def export_files(cfg: RunConfig, out: Path) -> None:
    """Write the sentence-transformers files of an export folder ``out`` (the transformers model and tokenizer are
    there already): ``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``,
    ``config_sentence_transformers.json`` and, when normalized, ``2_Normalize/``."""
    mode, normalize = resolve_pooling(cfg)
    hidden = json.loads((out / "config.json").read_text()).get("hidden_size")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": hidden, **{key: name == mode for name, key in POOLING_KEYS.items()},
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": cfg.data.max_seq_len,
                                                               "do_lower_case": False}, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"model_type": "SentenceTransformer", "prompts": {}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}, indent=2))


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Embeddings ``[N, H]`` float32 from token states ``[N, T, H]`` and the attention mask ``[N, T]`` (right padded),
    as sentence-transformers' ``Pooling``: ``mean`` over real tokens, ``cls`` the first token, ``max`` over real
    tokens, ``lasttoken`` the last real token."""
    h = hidden.float()
    if mode == "cls":
        return h[:, 0]
    if mode == "lasttoken":
        return h[torch.arange(h.shape[0], device=h.device), mask.sum(1) - 1]
    m = mask.unsqueeze(-1).to(h.dtype)
    if mode == "max":
        return h.masked_fill(m == 0, -1e9).max(dim=1).values
    return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


# -- data --------------------------------------------------------------------------------------------------------------

def prepare_tokenizer(tokenizer):
    """The tokenizer, checked to have a pad token (a decoder's EOS is used where it has none).

    Raises:
        ConfigError: no pad and no EOS token.
    """
    return pad_with_eos(tokenizer, "embed")


def sides(data_cfg: DataConfig) -> list[str]:
    """The text columns of a row, in the order a row's sides are kept: anchor, positive, and the hard negative."""
    return [data_cfg.anchor_column, data_cfg.positive_column] + ([data_cfg.negative_column]
                                                                 if data_cfg.negative_column else [])


def columns(data_cfg: DataConfig) -> list[str]:
    """Parquet columns read: the sides, then the score column when set."""
    return sides(data_cfg) + ([data_cfg.score_column] if data_cfg.score_column else [])


def _is_text(t) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def check_pairs(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the pairs before any model is built; one line per problem, naming the file, the row and the column.

    Problems: a missing column; a side that is not text, or is null or empty (blank) in some row; a score column
    that is not numeric, or a score that is null or outside [0, 1].
    """
    d = cfg.data
    texts, wanted = sides(d), columns(d)
    for key, f, schema in file_schemas(train_files, validation_files):
        line = missing_columns(key, f, schema, wanted, "embed reads data.anchor_column, data.positive_column "
                                                       "(and data.negative_column, data.score_column when set)")
        if line:
            problems.append(line)
            continue
        table = pq.read_table(f, columns=wanted)
        for c in texts:
            if not _is_text(table.column(c).type):
                problems.append(f"{key}: '{f}' column '{c}' holds {table.column(c).type} values; embed needs text")
                continue
            empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(table.column(c))), 0), True)
            if pc.any(empty).as_py():
                row = empty.to_pylist().index(True)
                problems.append(f"{key}: '{f}' row {row} column '{c}' is empty; every side of a pair needs text "
                                f"(leave the row out)")
        if d.score_column:
            col = table.column(d.score_column)
            if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
                problems.append(f"{key}: '{f}' column '{d.score_column}' holds {col.type} values; data.score_column "
                                f"needs numbers in [0, 1]")
                continue
            values = col.to_pylist()
            bad = next((i for i, v in enumerate(values) if v is None or not 0.0 <= float(v) <= 1.0), None)
            if bad is not None:
                problems.append(f"{key}: '{f}' row {bad} column '{d.score_column}' is {values[bad]!r}; scores must "
                                f"be in [0, 1] (STS-B's 0-5 divided by 5)")


def check_settings(tokenizer, cfg: RunConfig, problems: list[str]) -> None:
    """``train.embed``'s numbers in range, and ``cached`` only with token weighting (its gradients are the global
    batch's)."""
    e = cfg.train.embed
    if not e.scale > 0:
        problems.append(f"train.embed.scale: {e.scale}; it must be above 0 (sentence-transformers' default is 20)")
    if not 0.0 <= e.relevant_score <= 1.0:
        problems.append(f"train.embed.relevant_score: {e.relevant_score}; it must be in [0, 1], as the scores")
    if e.cached and cfg.train.loss_weighting != "token":
        problems.append("train.embed.cached: the gradient cache computes the loss over the whole global batch; it "
                        "needs train.loss_weighting: token")


class Tokenize:
    """Batched map function: each row's sides tokenized on their own (truncated to ``data.max_seq_len``) ->
    ``input_ids`` (the sides' tokens one after the other), ``side_lengths`` (tokens per side) and, with
    ``data.score_column``, ``pair_score`` (float)."""

    def __init__(self, tokenizer, data_cfg: DataConfig):
        self.tokenizer, self.d = tokenizer, data_cfg
        self.reset()

    def reset(self) -> None:
        """Zero the counts (one split at a time)."""
        self.counts: Counter = Counter()

    def __call__(self, batch: dict) -> dict:
        d = self.d
        encoded = [self.tokenizer([str(t) for t in batch[c]], truncation=True, max_length=d.max_seq_len)["input_ids"]
                   for c in sides(d)]
        n = len(encoded[0])
        out = {"input_ids": [[t for side in encoded for t in side[i]] for i in range(n)],
               "side_lengths": [[len(side[i]) for side in encoded] for i in range(n)]}
        if d.score_column:
            out["pair_score"] = [float(s) for s in batch[d.score_column]]
        self.counts["rows"] += n
        self.counts["truncated"] += sum(len(side[i]) >= d.max_seq_len for side in encoded for i in range(n))
        return out

    def summary(self) -> str:
        """One line: rows and texts cut at ``data.max_seq_len``."""
        c = self.counts
        return (f"embed: {c['rows']:,} rows of {len(sides(self.d))} texts; {c['truncated']:,} texts cut at "
                f"data.max_seq_len={self.d.max_seq_len}")


def tokenize_function(tokenizer, data_cfg: DataConfig) -> Tokenize:
    """:class:`Tokenize` for ``datasets.Dataset.map(batched=True)``."""
    return Tokenize(tokenizer, data_cfg)


def make_collator(tokenizer, data_cfg: DataConfig, relevant_score: float = 0.8):
    """Collates ``B`` rows into one batch of all their texts, anchors first, then positives, then hard negatives,
    padded to the longest (``data.pad_to_multiple_of``): ``input_ids``, ``attention_mask`` int64 ``[S x B, T]``
    (``S``: 2 or 3 sides); ``text_key`` int64 ``[S x B]`` (a hash of each text's token ids: equal texts, equal keys;
    :func:`ranking_losses`); ``labels`` int64 ``[B]``: 1 for a positive pair, 0 for a pair scored below
    ``relevant_score`` (-100 marks evaluation filler rows); with scores ``pair_score`` float32 ``[B]``; in
    evaluation ``eval_row`` int64 ``[B]`` (each row's index in the validation split) and ``eval_rows`` (0-dim: the
    split's rows)."""
    pad_id = tokenizer.pad_token_id
    multiple = data_cfg.pad_to_multiple_of

    def collate(rows: list[dict]) -> dict:
        s = len(rows[0]["side_lengths"])
        texts = []
        for k in range(s):
            for row in rows:
                at = sum(row["side_lengths"][:k])
                texts.append(row["input_ids"][at:at + row["side_lengths"][k]])
        width = max(len(t) for t in texts)
        width = -(-width // multiple) * multiple if multiple else width
        ids = torch.full((len(texts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
            mask[i, :len(t)] = 1
        batch = {"input_ids": ids, "attention_mask": mask,
                 "text_key": torch.tensor([hash(tuple(t)) for t in texts], dtype=torch.long)}
        if "pair_score" in rows[0]:
            score = torch.tensor([row["pair_score"] for row in rows], dtype=torch.float32)
            batch["pair_score"] = score
            batch["labels"] = (score >= relevant_score).long()
        else:
            batch["labels"] = torch.ones(len(rows), dtype=torch.long)
        if "_row" in rows[0]:
            batch["eval_row"] = torch.tensor([row["_row"] for row in rows], dtype=torch.long)
            batch["eval_rows"] = torch.tensor(rows[0]["_rows"], dtype=torch.long)
        return batch

    collate.row_indexed = True  # evaluation rows carry "_row" and "_rows" (finetune.data.dataset.eval_loader)
    return collate


def count_targets(batch: dict) -> torch.Tensor:
    """Positive pairs of the micro-batch (anchors with a loss term); 0-dim int64."""
    return (batch["labels"] == 1).sum()


# -- loss --------------------------------------------------------------------------------------------------------------

def embed(model, batch: dict, mode: str) -> torch.Tensor:
    """Embeddings ``[S x B, H]`` float32 of the batch's texts (anchors, positives, negatives).

    Short texts beside long ones (queries and passages) run as a second forward at their own width
    (:func:`finetune.recipes.common.widths.by_width`): the same embeddings, fewer padded positions."""
    parts = [(index, pool(out.last_hidden_state, part, mode))
             for index, part, out in by_width(model, model_inputs(batch), batch["attention_mask"])]
    if len(parts) == 1:
        return parts[0][1]
    (first, a), (second, b) = parts
    return torch.cat([a, b]).index_select(0, torch.argsort(torch.cat([first, second])))


def _world(gather: bool) -> int:
    return dist.get_world_size() if gather and dist.is_available() and dist.is_initialized() else 1


def gather_with_grad(x: torch.Tensor, gather: bool) -> tuple[torch.Tensor, int]:
    """``(every data-parallel rank's x concatenated in rank order, this rank's offset in it)``; the gradient of the
    result flows back to each rank's ``x`` summed over ranks (``torch.distributed.nn.functional.all_gather``). With
    ``gather`` off or one process: ``(x, 0)``."""
    if _world(gather) == 1:
        return x, 0
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous())), dist.get_rank() * x.shape[0]


def gather_keys(keys: torch.Tensor, gather: bool) -> list[torch.Tensor]:
    """Each side's text keys over every data-parallel rank, in the order :func:`gather_with_grad` concatenates the
    embeddings: ``keys`` int64 ``[S, B]`` (this rank's, side by side) -> ``S`` tensors ``[ranks x B]``, each side's
    keys of rank 0, then rank 1, ... One all-gather without gradient; with ``gather`` off or one process, the rows
    of ``keys``."""
    if _world(gather) > 1:
        parts = [torch.empty_like(keys) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, keys.contiguous())
        keys = torch.cat(parts, dim=1)  # [S, ranks x B]
    return list(keys)


def ranking_losses(a: torch.Tensor, p: torch.Tensor, n: torch.Tensor, offset: int, scale: float,
                   keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Multiple-negatives ranking loss of each anchor ``a`` ``[B, H]``, ``[B]``: the cross-entropy of
    ``scale x cos(a_i, c)`` over the candidates ``c`` = the positives ``p`` ``[P, H]`` then the negatives ``n``
    ``[M, H]``, the target ``p[offset + i]``.

    ``keys`` (``train.embed.mask_duplicates``): ``(target keys [B], candidate keys [P + M])``, int64 text keys
    (:func:`make_collator`); a candidate other than the target whose key is the target's is left out of that
    anchor's softmax (its logit -inf): the same text is no negative of itself."""
    cands = F.normalize(torch.cat([p, n]), dim=-1)
    logits = scale * F.normalize(a, dim=-1) @ cands.T
    target = torch.arange(a.shape[0], device=a.device) + offset
    if keys is not None:
        same = keys[0][:, None] == keys[1][None, :]
        same[torch.arange(a.shape[0], device=a.device), target] = False
        logits = logits.masked_fill(same, float("-inf"))
    return F.cross_entropy(logits, target, reduction="none")


def pair_losses(emb: torch.Tensor, b: int, e: EmbedConfig, gather: bool,
                text_key: torch.Tensor | None = None) -> torch.Tensor:
    """Per-anchor loss ``[B]`` of one batch's embeddings ``[S x B, H]`` (anchors, positives, negatives), the
    candidates gathered over ranks when ``gather``; with ``text_key`` ``[S x B]`` a candidate that repeats the
    target's text is no negative (:func:`ranking_losses`)."""
    a, p, n = emb[:b], emb[b:2 * b], emb[2 * b:]
    p_all, offset = gather_with_grad(p, gather)
    n_all = gather_with_grad(n, gather)[0] if n.shape[0] else n
    forward_keys = back_keys = None
    if text_key is not None:
        every = gather_keys(text_key.view(-1, b), gather)  # anchors', positives', negatives' keys of every rank
        forward_keys = (text_key[b:2 * b], torch.cat(every[1:]))
        back_keys = (text_key[:b], every[0])
    loss = ranking_losses(a, p_all, n_all, offset, e.scale, forward_keys)
    if e.symmetric:  # each positive retrieves its anchor among every rank's anchors
        a_all = gather_with_grad(a, gather)[0]
        back = ranking_losses(p, a_all, a_all[:0], offset, e.scale, back_keys)
        loss = (loss + back) / 2
    return loss


def forward(model, batch: dict, metrics: bool = False, *, settings: EmbedConfig | None = None,
            mode: str = "mean", gather: bool = True) -> LossOutput:
    """Multiple-negatives ranking loss of one micro-batch, summed over its positive pairs' anchors.

    Args:
        model: the engine (or a transformers ``AutoModel``).
        batch: :func:`make_collator`'s keys; in training with ``train.embed.cached`` also :func:`before_step`'s
            ``embed_grad``, ``embed_loss`` and ``_rng``.
        metrics: also return ``counts``: float64 ``[rows, 2H + 2]`` (``rows``: the validation split's), at each
            real row's ``eval_row`` its anchor and positive embeddings, its score and 1 (for :func:`eval_report`);
            the table is made for every batch and summed, so it suits validation splits of thousands of rows.
        settings, mode, gather: ``train.embed``, the pooling mode, and whether to gather over ranks (bound by
            :func:`configure`).
    """
    e = settings or EmbedConfig()
    labels = batch["labels"]
    b = labels.shape[0]
    positive = labels == 1
    if "embed_grad" in batch:  # the gradient cache's second pass: the same dropout masks as the first
        batch["_rng"].restore()
        emb = embed(model, batch, mode)
        surrogate = (emb * batch["embed_grad"]).sum()
        return LossOutput(batch["embed_loss"].sum() + surrogate - surrogate.detach(), positive.sum())
    emb = embed(model, batch, mode)
    per_anchor = pair_losses(emb, b, e, gather, batch.get("text_key") if e.mask_duplicates else None)
    loss = torch.where(positive, per_anchor, torch.zeros_like(per_anchor)).sum()
    if not metrics or "eval_row" not in batch:
        return LossOutput(loss, positive.sum())
    real = labels != -100
    rows = int(batch["eval_rows"])
    h = emb.shape[1]
    table = torch.zeros((rows, 2 * h + 2), dtype=torch.float64, device=emb.device)
    score = batch.get("pair_score", torch.ones(b, device=emb.device)).double()
    values = torch.cat([emb[:b].double(), emb[b:2 * b].double(), score[:, None], torch.ones_like(score)[:, None]], 1)
    table[batch["eval_row"][real]] = values[real]
    return LossOutput(loss, positive.sum(), counts=table)


class RngState:
    """The RNG state of this process before a micro-batch's first pass (CPU, and the current CUDA device's), so that
    the second pass draws the same dropout masks (``GradCache``'s ``RandContext``). Not a tensor, so it stays on the
    host when the batch moves to the device."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        """Set this process's RNG state back to the saved one."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def before_step(engine, micro: list[dict], cfg: RunConfig, *, settings: EmbedConfig | None = None,
                mode: str = "mean", gather: bool = True) -> list[dict]:
    """The gradient cache (``train.embed.cached``; Gao et al. 2021, sentence-transformers'
    ``CachedMultipleNegativesRankingLoss``): embed every micro-batch of the step without gradients, gather the
    embeddings of every rank, compute the loss of every anchor of the global batch against every candidate of it and
    the loss's gradient with respect to each embedding, and store in each micro-batch this rank's share:
    ``embed_grad`` float32 ``[S x B, H]``, ``embed_loss`` float32 ``[B]`` (its anchors' losses, 0 for a pair that is
    not positive) and ``_rng`` (:class:`RngState`). :func:`forward` then runs each micro-batch again with its
    gradient. Without ``cached``: the batches as they are.

    Every rank computes the same global loss from the same gathered embeddings (no further collective); its
    gradient with respect to this rank's embeddings is the sum over every anchor of the global batch.
    """
    e = settings or EmbedConfig()
    if not e.cached:
        return micro
    device = engine.device
    states, parts = [], []
    with torch.no_grad():
        for batch in micro:
            states.append(RngState(device))
            parts.append(embed(engine, to_device(batch, device), mode))
    sizes = [batch["labels"].shape[0] for batch in micro]
    split = [(emb[:b], emb[b:2 * b], emb[2 * b:]) for emb, b in zip(parts, sizes)]
    a, p, n = (torch.cat([s[k] for s in split]) for k in range(3))
    labels = torch.cat([batch["labels"] for batch in micro]).to(device)
    with torch.no_grad():  # the same gather as the plain loss's, its gradient not needed here
        a_all, offset = gather_with_grad(a, gather)
        p_all = gather_with_grad(p, gather)[0]
        n_all = gather_with_grad(n, gather)[0] if n.shape[0] else n
        labels_all = gather_with_grad(labels, gather)[0]
    forward_keys = back_keys = None
    if e.mask_duplicates:  # every text's key, in the order of the gathered embeddings
        local = torch.cat([batch["text_key"].view(-1, b) for batch, b in zip(micro, sizes)], dim=1)  # [S, rows]
        every = gather_keys(local.to(device), gather)
        forward_keys = (every[1], torch.cat(every[1:]))
        back_keys = (every[0], every[0])
    leaves = [t.detach().requires_grad_(True) for t in (a_all, p_all, n_all)]
    with torch.enable_grad():
        per_anchor = ranking_losses(leaves[0], leaves[1], leaves[2], 0, e.scale, forward_keys)
        if e.symmetric:
            back = ranking_losses(leaves[1], leaves[0], leaves[0][:0], 0, e.scale, back_keys)
            per_anchor = (per_anchor + back) / 2
        per_anchor = torch.where(labels_all == 1, per_anchor, torch.zeros_like(per_anchor))
        per_anchor.sum().backward()
    rows = a.shape[0]  # every side has one text per row, so this rank's rows sit at the same offset in each
    grads = [g.grad[offset:offset + rows] if g.grad is not None else None for g in leaves]
    losses = per_anchor.detach()[offset:offset + rows]
    at = 0
    for batch, b, state in zip(micro, sizes, states):
        pieces = [grads[0][at:at + b], grads[1][at:at + b]] + ([grads[2][at:at + b]] if n.shape[0] else [])
        batch["embed_grad"] = torch.cat(pieces).float().cpu()
        batch["embed_loss"] = losses[at:at + b].float().cpu()
        batch["_rng"] = state
        at += b
    return micro


# -- evaluation --------------------------------------------------------------------------------------------------------

def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation of two float vectors (ties get their average rank, as ``scipy.stats.spearmanr``)."""
    def ranks(v: torch.Tensor) -> torch.Tensor:
        _, inverse, counts = torch.unique(v, return_inverse=True, return_counts=True)
        before = torch.cumsum(counts, 0) - counts  # values below each distinct value
        return (before + (counts + 1) / 2.0).double()[inverse]

    rx, ry = ranks(x.double()), ranks(y.double())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum()) / den if den > 0 else float("nan")


TIE = 1e-5
"""Cosine similarities this close count as equal in retrieval: the same text in two batches of different padding
width embeds a float32 rounding apart, and must not rank above (or below) the relevant passage by chance."""


def retrieval(queries: torch.Tensor, corpus: torch.Tensor, relevant: torch.Tensor, k: int = 10) -> dict[str, float]:
    """MRR@k, NDCG@k and accuracy@1 of queries ``[Q, H]`` each with one relevant passage (``relevant`` ``[Q]``: its
    index into ``corpus`` ``[C, H]``), passages ranked by cosine similarity; a passage within :data:`TIE` of the
    relevant one's similarity (the same text again) does not rank above it."""
    sim = F.normalize(queries.double(), dim=-1) @ F.normalize(corpus.double(), dim=-1).T
    own = sim[torch.arange(len(relevant)), relevant]
    rank = 1.0 + (sim > own[:, None] + TIE).sum(1).double()
    hit = rank <= k
    return {f"mrr_at_{k}": float(torch.where(hit, 1.0 / rank, 0.0).mean()),
            f"ndcg_at_{k}": float(torch.where(hit, 1.0 / torch.log2(rank + 1), 0.0).mean()),
            "accuracy_at_1": float((rank == 1).double().mean())}


def eval_report(counts: torch.Tensor, model_config, *, scored: bool = False,
                relevant_score: float = 0.8) -> tuple[dict[str, float], dict]:
    """Retrieval (``mrr_at_10``, ``ndcg_at_10``, ``accuracy_at_1``) and, with scores, ``spearman`` from the
    validation rows' embeddings (:func:`forward`'s ``counts``, summed over batches and ranks)."""
    present = counts[:, -1] > 0
    table = counts[present]
    h = (table.shape[1] - 2) // 2
    anchors, positives, score = table[:, :h], table[:, h:2 * h], table[:, 2 * h]
    queries = (score >= relevant_score - 1e-9) if scored else torch.ones_like(score, dtype=torch.bool)
    out = {}
    if bool(queries.any()):
        out = retrieval(anchors[queries], positives, torch.nonzero(queries).flatten())
    if scored and len(score) > 1:
        out["spearman"] = spearman(F.cosine_similarity(anchors, positives, dim=-1), score)
    return out, {}


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """Bind ``train.embed``, the resolved pooling mode, the relevance threshold and ``data.score_column`` into the
    hooks that read them.

    Raises:
        ConfigError: ``model.path`` is a sentence-transformers folder whose pooling this recipe does not run.
    """
    e = cfg.train.embed
    mode = resolve_pooling(cfg)[0]
    bound = dict(settings=e, mode=mode, gather=e.gather_across_ranks)
    return dataclasses.replace(
        recipe, forward=functools.partial(forward, **bound), before_step=functools.partial(before_step, **bound),
        make_collator=functools.partial(make_collator, relevant_score=e.relevant_score),
        eval_report=functools.partial(eval_report, scored=bool(cfg.data.score_column),
                                      relevant_score=e.relevant_score))


RECIPE = Recipe(name="embed", model_class=MODEL_CLASS,
                capabilities=Capabilities(eval_metrics=("mrr_at_10", "ndcg_at_10", "accuracy_at_1", "spearman"),
                                          sequence_names=("anchor", "positive", "negative"),
                                          reports_perplexity=False, mixes_sources=False, checks_columns=True,
                                          counts_rows=True, sequences_per_row=2, one_target_per_row=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, configure=configure, columns=columns,
                check_data=check_pairs, check_tokenizer=check_settings,
                eval_report=eval_report, export_files=export_files)
