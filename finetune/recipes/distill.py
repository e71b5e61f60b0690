"""Knowledge distillation of any ``AutoModelForCausalLM`` (the student, ``model.path``) from a larger one with the
same vocabulary (the teacher, ``train.distill.teacher``), offline on the user's data and on-policy on the student's own
samples (docs/distillation.md).

Sources: Hinton et al. 2015 ("Distilling the Knowledge in a Neural Network": the teacher's softened distribution as
the target, forward KL); Gu et al. 2024 ("MiniLLM": reverse KL); Agarwal et al. 2024 ("On-Policy Distillation of
Language Models", GKD: the generalized Jensen-Shannon divergence with ``beta`` and the on-policy share ``lmbda``);
TRL 1.16's ``DistillationTrainer``, whose divergence, ``beta`` and ``temperature`` this follows.

Data: ``sft``'s forms and tokenization (prompt/response, conversations; packed rows whose examples never attend to
each other), so the trained tokens are exactly ``sft``'s: responses (assistant turns) and their end tokens; prompts
and padding never train.

Loss per trained token ``t`` (fp32; ``p_s``, ``p_t`` the student's and the teacher's next-token distributions at
``temperature`` ``T``, ``y`` the row's own next token)::

    l_t = alpha * D(p_t, p_s) + (1 - alpha) * CE(student logits at temperature 1, y)

``D``: ``forward_kl`` ``sum p_t (log p_t - log p_s)``; ``reverse_kl`` ``sum p_s (log p_s - log p_t)``; ``jsd``
``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = (1 - beta) p_s + beta p_t`` (TRL's). The recipe's
:func:`forward` returns the sum of ``l_t`` over a micro-batch's trained tokens and :func:`count_targets` counts them,
so the loop's loss is the exact mean over the global batch's trained tokens at every ZeRO stage, layout and
accumulation. Where the two models' output heads differ in size (Qwen2.5's 0.5B and 7B models pad their
vocabularies to different multiples), ``D`` compares the first ``min(V_student, V_teacher)`` logits, renormalised:
the ids past that are padding no tokenizer produces.

The teacher (:func:`build_teacher`, called by :func:`before_training`): built by
:func:`finetune.engine.model.build_engine` without an optimizer (no optimizer state, no fp32 master copy, no
gradients), in eval mode, in the student's precision; under ZeRO-3 partitioned as the student is (DeepSpeed's
inference-only ZeRO-3 engine, ``DeepSpeedZeRoOffload``). Per micro-batch it runs one forward without gradients
whose output head is replaced by a capture of the hidden states at the trained positions only; the student's head then
computes both models' logits chunk by chunk (:class:`DistillHead`, the teacher's head weight gathered once per
micro-batch under ZeRO-3), so no ``[tokens, vocabulary]`` tensor of either model exists whole, and the student's
gradients are computed in the same pass (as :class:`finetune.recipes.lm_loss.LinearCrossEntropy` does for the
cross-entropy). Logit soft-capping and scaling of either model (:func:`finetune.recipes.lm_loss.logits_transform`)
apply to its chunk's logits.

On-policy (``train.distill.on_policy_fraction`` > 0, GKD's ``lmbda``; :func:`before_step`): each training row is
chosen with that probability by its own seed (``finetune.data.dataset.row_seed``: the same rows on a resume, whatever
the ranks); a chosen row's prompt (its tokens before the first trained one) gets one completion sampled from the
student at ``temperature`` through the rollout engine ``grpo`` samples with
(:func:`finetune.engine.rollout.complete`: every ZeRO stage, the weights gathered once per step under ZeRO-3),
seeded by the step and the rows' seeds, so a resumed run samples the same completions; the completion, its EOS
included, is what trains.

Metrics: ``train/kd_loss`` (mean ``D``), ``train/ce_loss``, ``train/entropy`` and ``train/teacher_entropy`` (mean
per trained token, nats, at ``temperature``), ``train/on_policy_rows`` (share of rows sampled) and
``train/completions/mean_length`` (tokens per sampled completion, its EOS included); evaluation reports the
student's cross-entropy as ``eval/loss`` (and perplexity: comparable with ``sft``'s), ``eval/teacher_loss`` (the
teacher's on the same tokens), ``eval/kd_loss``, ``eval/entropy``, ``eval/teacher_entropy``. ``finetune evaluate``
of an export (no teacher) reports the student's cross-entropy alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from finetune import patches
from finetune.config import DataConfig, DistillConfig, RunConfig
from finetune.data.batch import LossOutput, model_inputs, to_device
from finetune.data.dataset import default_cache_dir, eval_loader, file_id, fingerprint, with_splits
from finetune.engine import gguf, rollout
from finetune.engine.rollout import SamplingConfig
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common import chat
from finetune.recipes.common.targets import count_targets, forward as ce_forward, next_token_targets
from finetune.recipes.lm_loss import add_head_gradients, check_head_output, chunk_tokens, find_head, head_output, \
    logits_transform, unwrap

MODEL_CLASS = AutoModelForCausalLM

EVAL_METRICS = ("kd_loss", "ce_loss", "entropy", "teacher_entropy", "teacher_loss")

_TEACHER: dict = {}
"""This process's teacher: ``engine`` (the DeepSpeed engine without optimizer), ``built`` (kept alive: its
``HfDeepSpeedConfig`` under ZeRO-3), ``path``."""

_NOT_INPUTS = ("row_seeds", "teacher_topk_ids", "teacher_topk_logps", "on_policy")
TOPK_ROW = "teacher_topk_row"
"""Column the training split gets with ``train.distill.cache_top_k``: each row's index into the cached arrays."""


# ---------------------------------------------------------------- the teacher


def teacher_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the teacher as the model: ``model.path`` = ``train.distill.teacher``, pretrained weights, no
    LoRA, freezing, quantization, gradient checkpointing, overrides or NEFTune (it only runs forwards)."""
    m = dataclasses.replace(cfg.model, path=cfg.train.distill.teacher, init="pretrained", lora=None, freeze=[],
                            quantization=None, gradient_checkpointing=False, offload_activations=False,
                            config_overrides={})
    return dataclasses.replace(cfg, model=m, train=dataclasses.replace(cfg.train, neftune_noise_alpha=0.0))


def build_teacher(engine, cfg: RunConfig):
    """Build the teacher beside the student ``engine`` (every rank): :func:`finetune.engine.model.build_engine` with
    ``optimizer=False`` on the student's DeepSpeed config (ZeRO-3 partitions it, stages 0-2 keep it whole), in eval
    mode. Returns its engine, kept in :data:`_TEACHER`."""
    from transformers import AutoConfig

    from finetune.engine.model import build_engine

    tcfg = teacher_config(cfg)
    model_config = AutoConfig.from_pretrained(tcfg.model.path, local_files_only=True)
    built = build_engine(tcfg, RECIPE, model_config, dict(engine.config), 0, optimizer=False)
    built.engine.module.eval()  # the module's mode only (no dropout); no hybrid-engine kernels
    for p in built.engine.module.parameters():
        p.requires_grad_(False)
    _TEACHER.clear()
    _TEACHER.update(engine=built.engine, built=built, path=tcfg.model.path)
    return built.engine


def teacher() -> object | None:
    """The teacher engine :func:`build_teacher` built in this process, or None."""
    return _TEACHER.get("engine")


def before_training(engine, data, cfg: RunConfig):
    """Build the teacher (:func:`build_teacher`); with ``cache_top_k``, the training split with its cached top-k
    (:func:`attach_top_k`), else the data as it is."""
    t = build_teacher(engine, cfg)
    n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in t.module.parameters())
    logger.info(f"distill: teacher {cfg.train.distill.teacher} ({type(t.module).__name__}, {n:,} parameters, frozen, "
                f"no optimizer state), loss {describe(cfg.train.distill)}")
    return attach_top_k(engine, t, data, cfg) if cfg.train.distill.cache_top_k else data


def top_k_key(cfg: RunConfig, split, precision: str, student_vocab: int) -> str:
    """Cache key of a split's teacher top-k (20 hex digits): the tokenized split's files and rows, the teacher
    folder's files (path, size, mtime, content digest), ``k``, ``temperature``, the student's vocabulary size (the
    compared ids), ``precision`` and the library versions."""
    from finetune.recipes.common.reference import content_digest, library_versions

    folder = Path(cfg.train.distill.teacher)
    files = sorted(str(p) for p in folder.glob("*") if p.is_file())
    d = cfg.train.distill
    return fingerprint({"tokenized": [file_id(f["filename"]) for f in split.cache_files], "rows": len(split),
                        "teacher": [[*file_id(f), content_digest(f)] for f in files], "k": d.cache_top_k,
                        "temperature": d.temperature, "student_vocab": student_vocab, "precision": precision,
                        "libraries": library_versions(), "version": 2})


def top_k(logits: torch.Tensor, k: int, temperature: float, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely ids of each row of ``logits`` (``[n, V]`` fp32, transformed) among the first ``vocab``
    at ``temperature``: ``(ids [n, k] int32, log-probabilities [n, k] float32)``, most likely first."""
    logps = torch.log_softmax(logits[:, :vocab] / temperature, dim=-1)
    values, ids = logps.topk(min(k, vocab), dim=-1)
    return ids.int(), values.float()


def _my_rows(loader, mine: range):
    """``(batch, rows)`` pairs of a rank's :func:`finetune.data.dataset.eval_loader` over its rows ``mine`` of the
    split: each batch with the split's row index of each of its rows, or None for a filler row (every rank runs the
    same number of batches)."""
    done = 0
    for batch in loader:
        size = batch["input_ids"].shape[0]
        yield batch, [mine[done + j] if done + j < len(mine) else None for j in range(size)]
        done += size


@torch.no_grad()
def teacher_top_k(t, split, collator, cfg: RunConfig, student_vocab: int, folder: Path) -> None:
    """Write the teacher's top-k of every trained position of ``split`` into ``folder`` (:data:`TOPK_ARRAYS`), all
    ranks calling it: each runs its shard of the rows (topped up with filler rows, so every rank runs the same number
    of forwards, as ZeRO-3 needs), and after each micro batch the ranks exchange that micro batch's arrays, which each
    node's first rank writes into place (memory-mapped ``.npy`` files of the known final size: no rank ever holds more
    than a micro batch of every rank's arrays). Row ``i``'s positions follow those of rows ``< i``, in the row's
    order. The folder appears whole or not at all (:func:`publish_top_k`)."""
    from finetune.parallel.layout import layout

    d, lay = cfg.train.distill, layout(cfg)
    loader = eval_loader(split, collator, cfg.data, cfg.train.micro_batch_size, lay=lay)
    mine = range(lay.dp_rank, len(split), lay.dp)
    # the trained positions per row first (collation only, no model): the files' sizes and each row's offset
    counts = np.zeros(len(split), dtype=np.int64)
    seen = [(row, n) for batch, rows in _my_rows(loader, mine)
            for row, n in zip(rows, (next_token_targets(batch) != -100).sum(1).tolist()) if row is not None]
    for part in dist_utils.all_gather_object(seen):
        for row, n in part:
            counts[row] = n
    offsets = np.concatenate([[0], np.cumsum(counts)])
    head = unwrap(t).get_output_embeddings()
    post = logits_transform(t)
    vocab = min(student_vocab, head.out_features)
    width = min(d.cache_top_k, vocab)
    writer = dist_utils.local_rank() == 0  # every node's cache (a shared one: the first rename wins)
    if writer:
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "counts.npy", counts)
        out_ids = np.lib.format.open_memmap(tmp / "ids.npy", mode="w+", dtype=np.int32,
                                            shape=(int(offsets[-1]), width))
        out_logps = np.lib.format.open_memmap(tmp / "logps.npy", mode="w+", dtype=np.float32,
                                              shape=(int(offsets[-1]), width))
    for batch, rows in _my_rows(loader, mine):
        batch = to_device(batch, t.device)
        keep = next_token_targets(batch) != -100
        inputs = {k: v for k, v in model_inputs(batch).items() if k not in _NOT_INPUTS}
        hidden = teacher_hidden(t, inputs, keep)
        ids, logps = [], []
        with _gathered([p for p in (head.weight, head.bias) if p is not None]):
            for start in range(0, hidden.shape[0], chunk_tokens(head.out_features)):
                z = F.linear(hidden[start:start + chunk_tokens(head.out_features)].to(head.weight.dtype),
                             head.weight, head.bias).float()
                i, v = top_k(post[1](z) if post is not None else z, d.cache_top_k, d.temperature, vocab)
                ids.append(i.cpu())
                logps.append(v.cpu())
        ids_b = torch.cat(ids).numpy() if ids else np.zeros((0, width), dtype=np.int32)
        logps_b = torch.cat(logps).numpy() if logps else np.zeros((0, width), dtype=np.float32)
        got, start = [], 0
        for row, n in zip(rows, keep.sum(1).tolist()):
            if row is not None:
                got.append((row, ids_b[start:start + n], logps_b[start:start + n]))
            start += n
        for part in dist_utils.all_gather_object(got):
            for row, i, v in part if writer else ():
                if len(i) != counts[row]:
                    raise RuntimeError(f"distill: row {row} has {len(i)} trained positions in the teacher's pass, "
                                       f"{counts[row]} in the count")
                out_ids[offsets[row]:offsets[row + 1]] = i
                out_logps[offsets[row]:offsets[row + 1]] = v
    if writer:
        out_ids.flush()
        out_logps.flush()
        del out_ids, out_logps
        publish_top_k(tmp, folder)


TOPK_ARRAYS = ("counts", "ids", "logps")
"""The files of a cached top-k folder, ``<name>.npy`` each: rows' trained-position counts (int64 ``[rows]``), ids
(int32 ``[positions, k]``) and log-probabilities (float32 ``[positions, k]``)."""


def top_k_saved(folder: Path) -> bool:
    """Whether ``folder`` holds a whole cached top-k (:func:`publish_top_k` renames it into place complete)."""
    return all((folder / f"{name}.npy").is_file() for name in TOPK_ARRAYS)


def publish_top_k(tmp: Path, folder: Path) -> None:
    """Rename the written folder ``tmp`` (a sibling of ``folder``) to ``folder`` at once, so a reader sees a whole
    cache or none; a ``folder`` another process completed first is kept and ``tmp`` removed."""
    try:
        os.replace(tmp, folder)
    except OSError:  # written meanwhile by another node sharing the cache
        if not top_k_saved(folder):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load_top_k(folder: Path) -> tuple[np.ndarray, ...]:
    """:data:`TOPK_ARRAYS` of ``folder``, memory-mapped read-only (the ranks of a node share the page cache; nothing
    is read before a batch needs its rows)."""
    return tuple(np.load(folder / f"{name}.npy", mmap_mode="r") for name in TOPK_ARRAYS)


def attach_top_k(engine, t, data, cfg: RunConfig):
    """The training split with :data:`TOPK_ROW` and the collator holding the teacher's top-k of its rows
    (:func:`teacher_top_k`), computed once per tokenized split, teacher and settings and cached in the folder
    ``<cache>/teacher/distill-train-<key>/`` (:func:`top_k_key`), else read from there; either
    way memory-mapped (:func:`load_top_k`). All ranks call it."""
    from finetune.engine.ds_config import engine_precision

    split = data.splits.train
    student_vocab = unwrap(engine).get_output_embeddings().out_features
    path = default_cache_dir(cfg.data) / "teacher" / \
        f"distill-train-{top_k_key(cfg, split, engine_precision(engine), student_vocab)}"
    k = cfg.train.distill.cache_top_k
    start = time.monotonic()
    if not dist_utils.any_rank(not top_k_saved(path), engine.device):
        counts, ids, logps = load_top_k(path)
        logger.info(f"distill: the teacher's top-{k} of {len(ids):,} trained tokens reused ({path})")
    else:
        teacher_top_k(t, split, data.collator, cfg, student_vocab, path)
        dist_utils.barrier()
        counts, ids, logps = load_top_k(path)
        logger.info(f"distill: the teacher's top-{k} of {len(ids):,} trained tokens computed in "
                    f"{time.monotonic() - start:.1f} s (saved to {path})")
    collator = data.collator
    collator.top_k = (np.concatenate([[0], np.cumsum(counts)]), ids, logps)
    splits = dataclasses.replace(data.splits, train=split.add_column(TOPK_ROW, list(range(len(split)))))
    return with_splits(splits, collator, cfg)


def describe(d: DistillConfig) -> str:
    """``forward_kl`` / ``jsd (beta 0.5)`` ... with temperature, alpha and the on-policy share, for the log."""
    what = f"jsd (beta {d.beta:g})" if d.loss == "jsd" else d.loss
    return (f"{what} at temperature {d.temperature:g}, alpha {d.alpha:g}, on-policy share {d.on_policy_fraction:g}")


def teacher_hidden(model, inputs: dict, keep: torch.Tensor) -> torch.Tensor:
    """The teacher's final hidden states at the positions where ``keep`` (``[batch, seq]`` bool) is true,
    ``[n, hidden]``, from one forward whose output head is replaced by the capture (it computes no logits). Call under
    ``torch.no_grad``.

    The forward makes no KV cache (``use_cache=False``, whatever the teacher's ``config.json`` says, as real
    checkpoints ship ``use_cache: true``): transformers builds the packed rows' block-diagonal mask from
    ``position_ids`` only for a forward without a cache (``masking_utils``), and Llama/Qwen-family models make one on
    every forward their config allows, so packed examples would attend to each other in the teacher.

    The teacher's logits are computed later from these rows by its head and
    :func:`~finetune.recipes.lm_loss.logits_transform`, so the forward's returned ``logits`` are checked to be the
    capture changed by that transform alone (:func:`~finetune.recipes.lm_loss.check_head_output`, the student's
    check): a teacher that changes its head's output otherwise would be silently wrong.

    Raises:
        RuntimeError: the teacher never called its head, called it more than once, or changed its output otherwise
            than :func:`~finetune.recipes.lm_loss.logits_transform` says.
    """
    head = find_head(model)
    state = SimpleNamespace(rows=None)

    def capture(hidden, *args, **kwargs):
        state.rows = hidden[keep]
        return state.rows

    with patches.applied(patches.instance_forward(head, capture, "distill: the teacher's hidden states at the "
                                                  "trained positions; its head runs in the student's loss")), \
            head_output(head) as seen:
        out = model(**inputs, use_cache=False)
    if state.rows is None:
        raise RuntimeError(f"{type(unwrap(model)).__name__} (the teacher) never called its output head "
                           f"{type(head).__name__}")
    try:  # its logits are computed from these rows by its head and logits_transform: the check the student's get
        return check_head_output(model, head, out.logits, seen, logits_transform(model))
    except RuntimeError as e:
        raise RuntimeError(f"distill: the teacher: {e}") from None


def _gathered(params: list):
    """ZeRO-3: the partitioned ``params`` gathered whole on every rank for the block (a no-op otherwise)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None,
                                             enabled=any(hasattr(p, "ds_id") for p in params))


# ---------------------------------------------------------------- the loss


def token_terms(u: torch.Tensor, zt: torch.Tensor, y: torch.Tensor, d: DistillConfig, post=None) -> dict:
    """Per-token terms of the loss for one chunk (fp32 ``[n]`` each, differentiable in ``u``).

    Args:
        u: ``[n, V_s]`` the student head's output (fp32, before the model's logit transform ``post``).
        zt: ``[n, V_t]`` the teacher's logits (fp32, transformed), or ``(ids [n, k] int64, log-probabilities [n, k],
            common vocabulary size)``: the teacher's top-k (:func:`rebuild_teacher`).
        y: ``[n]`` int64 the row's own next tokens.
        d: ``train.distill``.
        post: the student's logit transform (:func:`finetune.recipes.lm_loss.logits_transform`), or None.

    Returns:
        ``loss`` (``alpha D + (1 - alpha) CE``), ``kd`` (``D``), ``ce``, ``entropy``, ``teacher_entropy``,
        ``teacher_ce`` (NaN for a top-k teacher).
    """
    zs = post(u) if post is not None else u
    v = zt[2] if isinstance(zt, tuple) else min(zs.shape[-1], zt.shape[-1])
    whole = torch.log_softmax(zs[:, :v] / d.temperature, dim=-1)
    if d.temperature == 1 and v == zs.shape[-1]:  # the cross-entropy's log-softmax is the divergence's
        ce = -whole.gather(1, y[:, None]).squeeze(1)
    else:
        ce = F.cross_entropy(zs, y, reduction="none")
    if isinstance(zt, tuple):
        ls, lt = top_k_buckets(whole, zt[0], zt[1].float())
        teacher_ce = torch.full_like(ce, float("nan"))
    else:
        ls = whole
        lt = torch.log_softmax(zt[:, :v] / d.temperature, dim=-1)
        teacher_ce = F.cross_entropy(zt, y, reduction="none").detach()
    ps, pt = ls.exp(), lt.exp()
    kd = divergence(ls, lt, d.loss, d.beta, ps, pt)
    with torch.no_grad():
        entropy = -(ps * ls).sum(-1)
        teacher_entropy = -(pt * lt).sum(-1)
    return {"loss": d.alpha * kd + (1 - d.alpha) * ce if d.alpha < 1 else kd, "kd": kd, "ce": ce.detach(),
            "entropy": entropy, "teacher_entropy": teacher_entropy, "teacher_ce": teacher_ce}


@torch.no_grad()
def closed_form_terms(u: torch.Tensor, zt: torch.Tensor, y: torch.Tensor, d: DistillConfig,
                      grad: bool) -> tuple[dict, torch.Tensor | None]:
    """:func:`token_terms` of a student without a logit transform against the teacher's logits, with the loss's
    gradient with respect to ``u`` in closed form (no autograd graph: the chunk's forward and backward in one pass, as
    TRL's chunked-divergence kernel and Liger's fused losses do). With ``s = u / T``, ``p_s = softmax(s)``:
    ``forward_kl``: ``dD/ds = p_s - p_t``; ``reverse_kl``: ``p_s (log p_s - log p_t - D)``; ``jsd``:
    ``(1 - beta) p_s (log p_s - log m - KL(p_s || m))``; ``dD/du = dD/ds / T`` on the compared ids; the
    cross-entropy's ``softmax(u) - onehot(y)``. Returns ``(terms, [n, V_s] fp32 gradient or None)``."""
    t, beta = d.temperature, d.beta
    v = min(u.shape[-1], zt.shape[-1])
    ls = torch.log_softmax(u[:, :v] / t, dim=-1)
    lt = torch.log_softmax(zt[:, :v] / t, dim=-1)
    ps, pt = ls.exp(), lt.exp()
    if d.loss == "forward_kl":
        kd = (pt * (lt - ls)).sum(-1)
        g_s = ps - pt if grad else None
    elif d.loss == "reverse_kl":
        r = ls - lt
        kd = (ps * r).sum(-1)
        g_s = ps * (r - kd[:, None]) if grad else None
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        a = ls - lm
        kl_s = (ps * a).sum(-1)
        kd = beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * kl_s
        g_s = (1 - beta) * ps * (a - kl_s[:, None]) if grad else None
    whole = ls if t == 1 and v == u.shape[-1] else torch.log_softmax(u, dim=-1)
    ce = -whole.gather(1, y[:, None]).squeeze(1)
    teacher_ce = (-lt.gather(1, y[:, None]).squeeze(1) if t == 1 and v == zt.shape[-1]
                  else F.cross_entropy(zt, y, reduction="none"))
    terms = {"loss": d.alpha * kd + (1 - d.alpha) * ce, "kd": kd, "ce": ce, "entropy": -(ps * ls).sum(-1),
             "teacher_entropy": -(pt * lt).sum(-1), "teacher_ce": teacher_ce}
    if not grad:
        return terms, None
    g = torch.zeros_like(u)
    g[:, :v] = g_s * (d.alpha / t)
    if d.alpha < 1:
        soft = whole.exp() if whole is not ls else ps
        g[:, :soft.shape[-1]] += (1 - d.alpha) * soft
        g[torch.arange(len(y), device=y.device), y] -= 1 - d.alpha
    return terms, g


def top_k_buckets(ls: torch.Tensor, ids: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions on the teacher's top-k ids plus one bucket for every other id: ``(student, teacher)``
    log-probabilities ``[n, k + 1]`` from the student's ``ls`` (``[n, V]``, normalised over the whole vocabulary) and
    the teacher's top-k (``ids`` ``[n, k]`` int64, ``logps`` ``[n, k]`` over its whole vocabulary); each bucket holds
    the rest of its model's probability. A divergence of these is at most the whole one (merging outcomes never
    increases an f-divergence) and equal to it when ``k`` is the vocabulary size (then there is no bucket); its
    gradient moves the student's mass outside the teacher's top-k as a whole towards the teacher's, shared in the
    student's own proportions."""
    mine = ls.gather(1, ids)
    if ids.shape[1] >= ls.shape[1]:  # the whole vocabulary: no bucket (its mass is rounding)
        return mine, logps

    def rest(lp: torch.Tensor) -> torch.Tensor:
        return torch.log((1 - lp.exp().sum(-1, keepdim=True)).clamp_min(1e-30))

    return torch.cat([mine, rest(mine)], dim=-1), torch.cat([logps, rest(logps)], dim=-1)


def divergence(ls: torch.Tensor, lt: torch.Tensor, loss: str, beta: float, ps: torch.Tensor | None = None,
               pt: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]`` divergence per row between the student's and the teacher's log-probabilities ``ls``, ``lt``
    (``[n, V]``, each normalised over the same support): ``forward_kl`` KL(t || s), ``reverse_kl`` KL(s || t), ``jsd``
    the generalized JSD with ``beta`` (mixture ``(1 - beta) p_s + beta p_t``; TRL's ``DistillationTrainer``)."""
    ps = ls.exp() if ps is None else ps
    pt = lt.exp() if pt is None else pt
    if loss == "forward_kl":
        return (pt * (lt - ls)).sum(-1)
    if loss == "reverse_kl":
        return (ps * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)


_STATS = ("loss", "kd", "ce", "entropy", "teacher_entropy", "teacher_ce")

CHUNK_ELEMENTS = 2**20
"""Elements of one ``[rows, vocabulary]`` fp32 tensor of :class:`DistillHead`'s chunk (4 MiB): a chunk holds about a
dozen of them at once (both models' logits and log-probabilities, probabilities, the divergence's terms and their
gradient), so the chunk is 16 times smaller than the cross-entropy's (:data:`finetune.recipes.lm_loss.
LOGITS_CHUNK_ELEMENTS`), and at least 32 rows."""


def chunk_rows(vocab: int) -> int:
    """Rows per :class:`DistillHead` chunk for a vocabulary of ``vocab``: :data:`CHUNK_ELEMENTS` / ``vocab``, at
    least 32."""
    return max(32, CHUNK_ELEMENTS // max(int(vocab), 1))


class DistillHead(torch.autograd.Function):
    """The summed loss (:func:`token_terms`) of ``hidden @ weight.T + bias`` against the teacher, chunk by chunk,
    with the student's gradients computed in the forward pass (no ``[rows, vocabulary]`` logits outlive their chunk,
    nothing is recomputed: the form of :class:`finetune.recipes.lm_loss.LinearCrossEntropy`, with autograd on each
    chunk's fp32 logits for the divergence and the logit transform). ``teacher(start, end)`` gives the chunk's teacher
    logits (or top-k pair); ``stats`` (a dict) receives the chunk sums of every term of :data:`_STATS` (0-dim,
    detached).

    ``apply(hidden [n, h], weight [V, h], bias [V] or None, targets [n] int64, teacher, d, post, chunk, stats,
    train) -> 0-dim float32``; ``train``: gradients are wanted (``torch.is_grad_enabled()`` at the call).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher, d, post, chunk, stats, train):
        need_h, need_w, need_b = (ctx.needs_input_grad[:3] if train else (False, False, False))
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        sums = {k: torch.zeros((), dtype=torch.float64, device=hidden.device) for k in _STATS}
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], targets[start:start + chunk]
            zt = teacher(start, start + len(y))
            wants = need_h or need_w or need_b
            u = F.linear(h, weight, bias).float().detach()
            if post is None and not isinstance(zt, tuple):  # the common case: gradients in closed form
                terms, g = closed_form_terms(u, zt, y, d, wants)
            else:  # a logit transform or the cached top-k: autograd on the chunk
                u.requires_grad_(wants)
                with torch.enable_grad() if wants else torch.no_grad():
                    terms = token_terms(u, zt, y, d, post)
                    if wants:
                        (g,) = torch.autograd.grad(terms["loss"].sum(), u)
            for k in _STATS:
                sums[k] += terms[k].detach().double().sum()
            if wants:
                add_head_gradients((grad_h, grad_w, grad_b), g, h, weight, start)
            del u, zt, terms
        stats.update({k: v.float() for k, v in sums.items()})
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return sums["loss"].float().clone()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
                (grad_w * grad_out).to(ctx.dtypes[0]) if grad_w is not None else None,
                (grad_b * grad_out).to(ctx.dtypes[1]) if grad_b is not None else None,
                None, None, None, None, None, None, None)


def _teacher_logits(t, rows: torch.Tensor):
    """``(start, end) -> [end - start, V_t]`` fp32 logits (transformed) of the teacher's head on ``rows[start:end]``;
    call inside :func:`_gathered` of its head's parameters."""
    head = unwrap(t).get_output_embeddings()
    post = logits_transform(t)

    def logits(start: int, end: int) -> torch.Tensor:
        with torch.no_grad():
            z = F.linear(rows[start:end].to(head.weight.dtype), head.weight, head.bias).float()
            return post[1](z) if post is not None else z

    return head, logits


def distill_loss(model, batch: dict, d: DistillConfig, t) -> tuple[torch.Tensor, dict]:
    """One micro-batch through the teacher (no gradient) and the student: the summed loss over its trained tokens
    (0-dim float32; the tensor the student's head returned, so a ZeRO-3 backward gathers the head again) and the
    sums of :data:`_STATS`.

    Raises:
        RuntimeError: the student's output head is not a plain ``torch.nn.Linear`` (LoRA on ``lm_head``), or the
            student returns its head's output changed in a way :func:`~finetune.recipes.lm_loss.logits_transform`
            does not know.
    """
    targets = next_token_targets(batch)
    keep = targets != -100
    inputs = {k: v for k, v in model_inputs(batch).items() if k not in _NOT_INPUTS}
    head = find_head(model)
    if type(head) is not torch.nn.Linear or "forward" in vars(head):
        raise RuntimeError(f"distill: the student's output head is {type(head).__module__}.{type(head).__qualname__}"
                           f", not a plain torch.nn.Linear (LoRA on lm_head?); leave lm_head out of "
                           f"model.lora.target_modules")
    if "teacher_topk_ids" in batch:  # the cached top-k: no teacher forward
        cached = (batch["teacher_topk_ids"].long(), batch["teacher_topk_logps"])
        common = min(head.out_features, unwrap(t).get_output_embeddings().out_features)
        t_params, vocab = [], head.out_features

        def t_logits(start: int, end: int):
            return cached[0][start:end], cached[1][start:end], common
    else:
        with torch.no_grad():
            rows_t = teacher_hidden(t, inputs, keep)
        t_head, t_logits = _teacher_logits(t, rows_t)
        t_params, vocab = [p for p in (t_head.weight, t_head.bias) if p is not None], max(head.out_features,
                                                                                            t_head.out_features)
    post = logits_transform(model)
    stats: dict = {}
    state = SimpleNamespace(loss=None)

    def forward(hidden, *args, **kwargs):
        with _gathered(t_params):
            state.loss = DistillHead.apply(hidden[keep], head.weight, head.bias, targets[keep], t_logits, d,
                                           post[1] if post else None, chunk_rows(vocab), stats,
                                           torch.is_grad_enabled())
        return state.loss

    with patches.applied(patches.instance_forward(head, forward, "distill: the student's and the teacher's heads "
                                                  "at the trained positions, in chunks")), head_output(head) as seen:
        out = model(**inputs)
    got = check_head_output(model, head, out.logits, seen, post)
    return got, stats


def forward(model, batch: dict, metrics: bool = False, settings: DistillConfig | None = None) -> LossOutput:
    """The loss of one micro-batch: ``sum over trained tokens of alpha D + (1 - alpha) CE`` (module docstring), with
    ``kd_loss``, ``ce_loss``, ``entropy`` and ``teacher_entropy`` as ``(sum, trained tokens)``. With ``metrics``
    (evaluation) the loss is the student's cross-entropy and ``teacher_loss`` is added; without a teacher in this
    process (``finetune evaluate`` of an export) the cross-entropy alone.

    Raises:
        RuntimeError: training without a teacher (:func:`before_training` was not called).
    """
    d = settings or DistillConfig()
    t = teacher()
    if t is None:
        if not metrics:
            raise RuntimeError("distill: no teacher in this process (before_training builds it)")
        return ce_forward(model, {k: v for k, v in batch.items() if k not in _NOT_INPUTS}, metrics=True)
    n = count_targets(batch)
    loss, s = distill_loss(model, batch, d, t)
    named = {"kd_loss": "kd", "ce_loss": "ce", "entropy": "entropy", "teacher_entropy": "teacher_entropy"}
    out = {name: (s[k], n.to(s[k].device).float()) for name, k in named.items()}
    if "on_policy" in batch:  # with on-policy rows: their share of the rows
        flags = batch["on_policy"].float()
        out["on_policy_rows"] = (flags.sum(), torch.tensor(float(len(flags)), device=flags.device))
        trained = (batch["labels"][:, 1:] != -100).sum(1).float()  # a sampled row trains its completion and EOS
        out["completions/mean_length"] = ((trained * flags).sum(), flags.sum())
    if metrics:
        out["teacher_loss"] = (s["teacher_ce"], n.to(s["teacher_ce"].device).float())
        return LossOutput(s["ce"].to(loss.device), n, out)
    return LossOutput(loss, n, out)


# ---------------------------------------------------------------- on-policy rows


def on_policy(row_seed: int, fraction: float) -> bool:
    """Whether the row of seed ``row_seed`` gets a completion sampled from the student (its own draw: the same on a
    resume and on any layout)."""
    return fraction >= 1 or (fraction > 0 and random.Random(row_seed * 2654435761 + 97).random() < fraction)


def sampling(d: DistillConfig) -> SamplingConfig:
    """The on-policy samples' settings: one completion per prompt of at most ``max_completion_length`` tokens at
    ``temperature`` (the loss's), ``top_p``, ``top_k``."""
    return SamplingConfig(max_new_tokens=d.max_completion_length, temperature=d.temperature, top_p=d.top_p,
                          top_k=d.top_k, n_samples_per_prompt=1)


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))


def _prompt(batch: dict, i: int) -> tuple[list[int], list[int], list[int]]:
    """Row ``i`` of an unpacked micro-batch as ``(prompt ids, ids, labels)`` without padding; the prompt is the row
    before its first trained token."""
    n = int(batch["attention_mask"][i].sum())
    ids, labels = batch["input_ids"][i, :n].tolist(), batch["labels"][i, :n].tolist()
    first = next((j for j, v in enumerate(labels) if v != -100), n)
    return ids[:first], ids, labels


def collate_rows(rows: list[tuple[list[int], list[int]]], pad: int, row_seeds: torch.Tensor,
                 on_policy: list[bool]) -> dict:
    """Right-padded micro-batch of ``(ids, labels)`` rows: ``input_ids``, ``attention_mask``, ``labels`` (-100 on
    padding), ``row_seeds``, ``on_policy`` (bool ``[rows]``: the row is a sampled completion)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], mask[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), 1, torch.tensor(y)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "row_seeds": row_seeds,
            "on_policy": torch.tensor(on_policy, dtype=torch.bool)}


def sample_completions(engine, micro: list[dict], cfg: RunConfig, step: int) -> list[dict]:
    """The step's micro-batches with each on-policy row's response replaced by one completion the student samples
    from its prompt (trained: every completion token up to and including its EOS), the others as they are; every
    rank calls it with the step's micro-batches (under ZeRO-3 the weights are gathered or generation runs in lockstep:
    a rank with no chosen row generates for one row it then drops)."""
    d = cfg.train.distill
    tok = _tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    chosen = [(b, i) for b, batch in enumerate(micro) for i, s in enumerate(batch["row_seeds"].tolist())
              if on_policy(s, d.on_policy_fraction)]
    if not dist_utils.any_rank(bool(chosen), engine.device):
        return [{**b, "on_policy": torch.zeros(len(b["row_seeds"]), dtype=torch.bool)} for b in micro]
    asked = chosen or [(0, 0)]  # ZeRO-3 lockstep: every rank generates
    prompts = [_prompt(micro[b], i)[0] for b, i in asked]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    seed = rollout.sampling_seed(cfg.train.seed, step, torch.cat([b["row_seeds"] for b in micro]))
    with rollout.make_rollout(engine, tok, gather=d.gather_for_generation).weights():
        c = rollout.complete(engine, ids, mask, sampling(d), tok, seed, gather=d.gather_for_generation)
    completions = {key: c["completion_ids"][j, :int(c["lengths"][j])].tolist() for j, key in enumerate(chosen)}
    out = []
    for b, batch_b in enumerate(micro):
        rows, sampled = [], []
        for i in range(batch_b["input_ids"].shape[0]):
            prompt, ids, labels = _prompt(batch_b, i)
            done = completions.get((b, i))
            rows.append((ids, labels) if done is None else (prompt + done, [-100] * len(prompt) + done))
            sampled.append(done is not None)
        out.append(collate_rows(rows, tok.pad_token_id, batch_b["row_seeds"], sampled))
    return out


def before_step(engine, micro: list[dict], cfg: RunConfig) -> list[dict]:
    """With ``on_policy_fraction`` > 0: :func:`sample_completions`; the batches as they are otherwise."""
    if cfg.train.distill.on_policy_fraction <= 0:
        return micro
    return sample_completions(engine, micro, cfg, int(engine.global_steps))


# ---------------------------------------------------------------- data, checks and the recipe


class SeededCollator:
    """``sft``'s collator with each row's seed (``row_seeds``, int64 ``[micro_batch]``, when the rows have seeds):
    on-policy rows are chosen by it."""

    row_seeded = True

    def __init__(self, inner):
        self.inner = inner
        self.top_k = None  # (offsets [rows + 1], ids [positions, k], log-probabilities; memory-mapped): attach_top_k

    def __call__(self, rows: list[dict]) -> dict:
        seeds = [r.get("_seed") for r in rows]
        cached = [r.get(TOPK_ROW) for r in rows]
        batch = self.inner([{k: v for k, v in r.items() if k not in ("_seed", TOPK_ROW)} for r in rows])
        if None not in seeds:  # rows without seeds (the export check's own batches): none
            batch["row_seeds"] = torch.tensor(seeds, dtype=torch.long)
        if self.top_k is not None and None not in cached:  # the training split's rows, in the batch's order
            offsets, ids, logps = self.top_k
            parts = [slice(int(offsets[i]), int(offsets[i + 1])) for i in cached]
            batch["teacher_topk_ids"] = torch.from_numpy(np.concatenate([ids[p] for p in parts]))
            batch["teacher_topk_logps"] = torch.from_numpy(np.concatenate([logps[p] for p in parts]))
        return batch


def make_collator(tokenizer, data_cfg: DataConfig) -> SeededCollator:
    """:class:`SeededCollator` around ``sft``'s collator."""
    return SeededCollator(chat.make_collator(tokenizer, data_cfg))


def prepare_tokenizer(tokenizer):
    """``sft``'s (a pad token)."""
    return chat.prepare_tokenizer(tokenizer)


def _vocab(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def check_teacher(cfg: RunConfig, problems: list[str]) -> None:
    """``train.distill``'s numbers and the teacher folder, before any model is built: one line each for a missing
    teacher, a folder without ``config.json`` or weights, a teacher whose tokenizer has another vocabulary than the
    student's (both named), a teacher whose ``vocab_size`` is smaller than the student's tokenizer (with or without
    its own tokenizer files: it reads the student's token ids, and an id past its embedding fails its first forward
    with ``IndexError``), numbers out of range, and on-policy rows with packed data."""
    d = cfg.train.distill
    if not 0 <= d.alpha <= 1:
        problems.append(f"train.distill.alpha: must be in [0, 1] (the divergence's weight; 1 - alpha weights the "
                        f"cross-entropy), got {d.alpha}")
    if not 0 < d.beta < 1:
        problems.append(f"train.distill.beta: must be in (0, 1) (the jsd mixture; use loss=forward_kl or "
                        f"loss=reverse_kl for the ends), got {d.beta}")
    if not 0 < d.temperature < float("inf"):
        problems.append(f"train.distill.temperature: must be a finite number > 0, got {d.temperature}")
    if not 0 <= d.on_policy_fraction <= 1:
        problems.append(f"train.distill.on_policy_fraction: must be in [0, 1], got {d.on_policy_fraction}")
    elif d.on_policy_fraction > 0 and cfg.data.packing:
        problems.append("train.distill.on_policy_fraction: on-policy rows need one example per row; set "
                        "data.packing=false")
    if d.cache_top_k < 0:
        problems.append(f"train.distill.cache_top_k: must be >= 0 (0: off), got {d.cache_top_k}")
    elif d.cache_top_k and d.on_policy_fraction > 0:
        problems.append("train.distill.cache_top_k: the cache holds the teacher on the data's own responses; "
                        "on-policy rows are new every step: set train.distill.cache_top_k=0 or on_policy_fraction=0")
    if d.max_completion_length < 1 or d.top_k < 0 or not 0 < d.top_p <= 1:
        problems.append(f"train.distill: max_completion_length must be >= 1, top_k >= 0 and top_p in (0, 1], got "
                        f"{d.max_completion_length}, {d.top_k}, {d.top_p}")
    if not d.teacher:
        problems.append("train.distill.teacher: not set; give the teacher's local model folder (config.json, "
                        "weights and tokenizer)")
        return
    folder = Path(d.teacher)
    if not (folder / "config.json").is_file():
        problems.append(f"train.distill.teacher: '{folder}' is not a model folder (no config.json); give the "
                        f"teacher's local model folder")
        return
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")) and not gguf.weights_deferred(folder):
        problems.append(f"train.distill.teacher: '{folder}' has no weights (*.safetensors, *.bin); the teacher "
                        f"must be trained (e.g. an sft export)")
    student_path = cfg.model.tokenizer_path or cfg.model.path
    if not student_path:
        return
    try:
        mine = _vocab(student_path)
    except Exception:  # noqa: BLE001  (the student's tokenizer problem is reported by the compatibility checks)
        return
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            theirs = _vocab(str(folder))
        except Exception:  # noqa: BLE001  (never loaded by a run: the teacher reads the student's token ids)
            theirs = mine
        if mine.get_vocab() != theirs.get_vocab():
            problems.append(f"train.distill.teacher: the teacher's tokenizer '{folder}' ({len(theirs):,} tokens) has "
                            f"another vocabulary than the student's '{student_path}' ({len(mine):,} tokens); "
                            f"distillation compares the two distributions token by token: use a teacher of the same "
                            f"tokenizer")
            return
    # with or without its own tokenizer files, the teacher reads the student's token ids: every id must have a row
    # of its embedding (a smaller one fails in the teacher's first forward, IndexError on every rank)
    try:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(str(folder), local_files_only=True).get_text_config().vocab_size
    except Exception as e:  # noqa: BLE001
        problems.append(f"train.distill.teacher: '{folder}/config.json' cannot be read by transformers: "
                        f"{' '.join(str(e).split())[:200]}")
        return
    if isinstance(vocab, int) and len(mine) > vocab:
        problems.append(f"train.distill.teacher: '{folder}' has vocab_size {vocab:,} (config.json) but the student's "
                        f"tokenizer '{student_path}' has {len(mine):,} tokens, whose ids past {vocab - 1:,} would "
                        f"index past the teacher's embedding; use a teacher of the student's tokenizer (vocab_size "
                        f">= {len(mine):,})")


def check_data(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """``sft``'s checks of the data and the teacher's (:func:`check_teacher`)."""
    chat.check_labels(cfg, train_files, validation_files, problems)
    check_teacher(cfg, problems)


def configure(recipe: Recipe, cfg: RunConfig) -> Recipe:
    """``train.distill`` bound into :func:`forward`."""
    return dataclasses.replace(recipe, forward=functools.partial(forward, settings=cfg.train.distill))


def rollout_shape(cfg: RunConfig) -> tuple[int, int] | None:
    """On-policy rows: one sequence of up to ``data.max_seq_len + max_completion_length`` tokens (the planner's)."""
    d = cfg.train.distill
    return (1, cfg.data.max_seq_len + d.max_completion_length) if d.on_policy_fraction > 0 else None


def frozen_models(cfg: RunConfig) -> list[str]:
    """The teacher's folder (for ``finetune plan``)."""
    return [cfg.train.distill.teacher] if cfg.train.distill.teacher else []


RECIPE = Recipe(name="distill", model_class=MODEL_CLASS,
                capabilities=Capabilities(packs_rows=True, generates_text=True, checks_columns=True, counts_rows=True,
                                          eval_metrics=EVAL_METRICS),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=chat.tokenize_function,
                make_collator=make_collator, forward=forward, count_targets=count_targets, columns=chat.columns,
                cache_key=chat.cache_key, check_data=check_data, prepare_model_config=chat.prepare_model_config,
                generation_pairs=chat.generation_pairs, configure=configure, before_training=before_training,
                before_step=before_step, rollout=rollout_shape, frozen_models=frozen_models)
