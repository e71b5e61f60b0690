"""The frozen reference pass of the preference recipes (``dpo``, ``kto``) and the content digests other caches key
on (``distill``'s teacher): the reference log-probabilities of every row computed once with the initial weights, in
lockstep on every rank (:func:`reference_logps`), cached by the tokenized split, the model's files and their content
(:func:`content_digest`), precision and library versions (:func:`reference_key`), and attached as a column
(:func:`attach_reference`); with LoRA the reference is the base model with the adapters off (:func:`adapters_off`),
as TRL's ``precompute_ref_log_probs`` with a peft model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
import time
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

from finetune.parallel import distributed as dist_utils
from finetune.parallel.layout import layout
from finetune.data.batch import to_device
from finetune.engine.ds_config import engine_precision
from finetune.config import RunConfig
from finetune.data.dataset import (
    TrainData,
    default_cache_dir,
    eval_loader,
    file_id,
    fingerprint,
    with_splits,
)
from finetune.logs import logger
from finetune.recipes.common.pairs import REFERENCE_COLUMN, sequence_logps


def peft_model_of(model):
    """The ``peft.PeftModel`` in ``model`` (a DeepSpeed engine's ``module``), or None."""
    while model is not None and not isinstance(model, peft.PeftModel):
        model = getattr(model, "module", None)
    return model


@contextlib.contextmanager
def adapters_off(model):
    """While active, the LoRA adapters of ``model`` are bypassed: its forward is the frozen base model's.

    Raises:
        ValueError: ``model`` has no peft adapters.
    """
    wrapped = peft_model_of(model)
    if wrapped is None:
        raise ValueError("adapters_off needs a model with LoRA adapters (peft)")
    with wrapped.disable_adapter():
        yield


FULL_HASH_BYTES = 1 << 30
"""Model files up to this size (1 GiB) are hashed whole by :func:`content_digest`; larger ones are sampled."""
_SAMPLES, _SAMPLE_BYTES, _END_BYTES = 256, 1 << 16, 1 << 20


def content_digest(path: str | Path) -> str:
    """SHA-256 (hex) of a file's content, so that a file replaced by another of the same size and mtime (``rsync -a``
    of a re-export, ``cp -p``) gets another digest.

    Files up to :data:`FULL_HASH_BYTES` are hashed whole (about 1 s per GiB). Larger ones (the shards of a
    multi-GB model, read by every rank at each launch) are hashed from their size, their header (a
    ``.safetensors`` file's whole JSON header: every tensor's name, dtype, shape and offsets; else the first MiB),
    256 blocks of 64 KiB at evenly spaced offsets and the last MiB: a re-trained model changes nearly every
    block, so any sample sees it.

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
            return h.hexdigest()
        head = _END_BYTES
        if path.suffix == ".safetensors":
            first = f.read(8)
            head = 8 + min(int.from_bytes(first, "little"), size - 8) if len(first) == 8 else _END_BYTES
            f.seek(0)
        h.update(f.read(head))
        for k in range(_SAMPLES):
            f.seek(head + max(0, size - head - _SAMPLE_BYTES) * k // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - _END_BYTES))
        h.update(f.read(_END_BYTES))
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions of the packages that compute the reference log-probabilities (torch, transformers, deepspeed,
    finetune): a new kernel or model implementation may change them in the last digits."""
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("deepspeed", "finetune"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "?"
    return versions


def reference_key(cfg: RunConfig, split, precision: str) -> str:
    """Cache key of a split's reference log-probabilities (20 hex digits): the tokenized split's file(s) and rows,
    the initial model (each file of its folder: path, size, mtime and :func:`content_digest`; ``init``, the seed of a
    scratch model, ``config_overrides``, attention, fused kernels, a QLoRA base's quantization), ``precision``
    (``fp32``, ``bf16``, ``fp16``) and :func:`library_versions`; a change of any gives a new key. LoRA's rank and
    targets are not in it: the reference is the base model, adapters off, which a full fine-tune's initial weights
    equal.

    Raises:
        OSError: a model file cannot be read.
    """
    model_dir = Path(cfg.model.path)
    files = sorted(str(p) for p in model_dir.glob("*") if p.is_file()) if model_dir.is_dir() else []
    return fingerprint({"tokenized": [file_id(f["filename"]) for f in split.cache_files], "rows": len(split),
                        "model": [[*file_id(f), content_digest(f)] for f in files], "init": cfg.model.init,
                        "seed": cfg.train.seed if cfg.model.init == "scratch" else None,
                        "overrides": cfg.model.config_overrides, "attention": cfg.model.attn_implementation,
                        "fused_kernels": cfg.model.fused_kernels, "precision": precision,
                        "quantization": (dataclasses.asdict(cfg.model.quantization)
                                         if cfg.model.quantization is not None else None),
                        "libraries": library_versions(), "version": 3})


@torch.no_grad()
def reference_logps(engine, split, collator, cfg: RunConfig) -> np.ndarray:
    """``(ref_c, ref_r)`` of every pair of ``split`` with the engine's current weights (with LoRA, the base model's:
    the adapters off); all ranks call it.

    Every data-parallel rank runs its shard of the rows (``dp_rank::dp``, topped up with filler rows so that all
    ranks run the same number of forwards, as ZeRO-3 needs) in eval mode, the ranks of an SP group a slice of each
    sequence; the values are summed over ranks (each row is filled by one rank: the first of its SP group).

    Returns:
        ``[rows, 2]`` float64 array (float32 sums).
    """
    lay = layout(cfg)
    loader = eval_loader(split, collator, cfg.data, cfg.train.micro_batch_size, lay=lay)
    mine = list(range(lay.dp_rank, len(split), lay.dp)) if lay.sp_rank == 0 and lay.tp_rank == 0 else []
    values = torch.zeros((len(split), 2), dtype=torch.float64, device=engine.device)
    engine.eval()
    done = 0
    with adapters_off(engine) if peft_model_of(engine) is not None else contextlib.nullcontext():
        for batch in loader:
            logps, _ = sequence_logps(engine, to_device(batch, engine.device))
            b = logps.shape[0] // 2
            for j in range(max(0, min(b, len(mine) - done))):
                values[mine[done + j]] = torch.stack([logps[j], logps[b + j]]).double()
            done += b
    engine.train()
    return dist_utils.all_reduce_sum(values).cpu().numpy()


def attach_reference(engine, data: TrainData, cfg: RunConfig, name: str, what: str) -> TrainData:
    """Both splits with the ``reference_logps`` column: :func:`reference_logps` of every row (its two sequences: the
    collator's first and second half), computed once per tokenized split and initial model and cached in
    ``<cache>/reference/<name>-<split>-<key>.npy`` (:func:`reference_key`), else read from there. All ranks call it,
    before a checkpoint is restored. ``name`` is the recipe (the cache file's prefix and the log's), ``what`` the
    rows' name in the log (``pairs``, ``rows``)."""
    precision = engine_precision(engine)
    folder = default_cache_dir(cfg.data) / "reference"
    splits = {}
    for split_name in ("train", "validation"):
        split = getattr(data.splits, split_name)
        path = folder / f"{name}-{split_name}-{reference_key(cfg, split, precision)}.npy"
        if not dist_utils.any_rank(not path.is_file(), engine.device):
            values = np.load(path)
            logger.info(f"{name}: reference log-probabilities of {len(split):,} {split_name} {what} reused ({path})")
        else:
            start = time.monotonic()
            values = reference_logps(engine, split, data.collator, cfg)
            if dist_utils.local_rank() == 0:  # every node's cache (a shared one is written atomically twice)
                folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, values)
                os.replace(tmp, path)
            dist_utils.barrier()
            logger.info(f"{name}: reference log-probabilities of {len(split):,} {split_name} {what} computed in "
                        f"{time.monotonic() - start:.1f} s (saved to {path})")
        splits[split_name] = split.add_column(REFERENCE_COLUMN, values.tolist())
    return with_splits(dataclasses.replace(data.splits, **splits), data.collator, cfg)


