"""A ``.gguf`` file as ``model.path``: transformers' GGUF loader converts it once into a cached Hugging Face folder.

llama.cpp's GGUF files hold the weights (often quantized: Q4_1, Q8_0, ...), the config and the tokenizer (vocabulary,
merges, special tokens, chat template) in one file. Training needs full-precision weights, so a GGUF is dequantized
once, on one process, by transformers' own loader (``from_pretrained(folder, gguf_file=name)`` with
``GgufConfig(dequantize=True)``, which reads the file through the ``gguf`` package) and saved with
``save_pretrained`` as an ordinary folder: ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer files with the file's chat template. Every rank, and every later verb (``plan``, ``doctor``, ``inspect``,
``evaluate``, ``export``), then reads that folder as it would any model folder: :func:`resolve` replaces
``model.path`` (and a ``.gguf`` ``model.tokenizer_path``) by it before any other check.

* **Where**: ``<data.cache_dir or $FINETUNE_CACHE or ~/.cache/finetune>/gguf/<sha256 of the file>/`` (:func:`folder_for`),
  with ``gguf.json`` naming the source file, its SHA-256, its architecture and what converted it. The SHA-256 of a file
  is remembered per (path, size, mtime) under ``gguf/hashes/``, so a launch does not read a large file again.
* **Once**: a process takes an exclusive ``flock`` on ``gguf/<sha256>.lock`` (released by the kernel if the process
  dies), converts into a private ``.partial-*`` folder and renames it into place whole; the other ranks of a launch
  block on the lock and find the folder there. The same rule as the tokenization cache
  (:mod:`finetune.data.tokenization`): a killed conversion never leaves a folder a later run would take.
* **Config only** (``weights=False``: ``--check``, ``--print-config``, ``plan``, ``doctor``): what a check reads, the
  config, generation config and tokenizer, without the weights, into ``gguf/<sha256>-config/`` (a few seconds instead
  of a dequantization); a full conversion, when one exists, serves as well. Its ``gguf.json`` says ``"weights":
  false`` (:func:`weights_deferred`), so that the checks do not ask it for weight files.
* **Checks** (:func:`problems`), before any process group or model, one line each: the file is missing, not a GGUF or
  truncated (its tensor table points past its end); its architecture is one transformers' GGUF loader cannot read
  (the line names it and the ones it can); it has no tokenizer in its metadata and no ``model.tokenizer_path`` is set.

No GGUF reader of finetune's own: the metadata comes from transformers' reader (``read_gguf_metadata``,
``GgufHeader``), the weights from its loader.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

SUFFIX = ".gguf"
INFO_FILE = "gguf.json"
"""The record of a converted folder: ``source``, ``sha256``, ``architecture``, ``transformers`` version, ``dtype``."""


def is_gguf(path: str | os.PathLike | None) -> bool:
    """True when ``path`` names a GGUF file (by its ``.gguf`` suffix, any case)."""
    return bool(path) and str(path).lower().endswith(SUFFIX)


def _metadata(path: Path) -> tuple[dict, object]:
    """transformers' reading of the file's metadata and tensor table (no tensor data): ``(metadata, GgufHeader)``."""
    from transformers.integrations.gguf import GgufHeader, read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens",))
    return metadata, GgufHeader.from_file(str(path))


@functools.lru_cache(maxsize=4)
def _config_of(path: str, size: int, mtime_ns: int):
    """transformers' ``AutoConfig`` of the GGUF file ``path`` (its legacy reader parses the whole metadata, seconds for
    a real vocabulary), read once per process and file version: the checks and the conversion share it."""
    from transformers import AutoConfig

    p = Path(path)
    return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


def _auto_config(path: Path):
    """:func:`_config_of` for the file ``path`` as it is now (a copy: the caller may change it)."""
    st = path.stat()
    return copy.deepcopy(_config_of(str(path.resolve()), st.st_size, st.st_mtime_ns))


def supported_architectures() -> list[str]:
    """The GGUF architectures (``general.architecture``) transformers' loader reads: its fast path's and its legacy
    reader's (whose table also holds the ``general`` and ``tokenizer`` key groups, which are no architectures)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted((set(GGUF_CONFIG_ARCHS) | set(GGUF_SUPPORTED_ARCHITECTURES)) - {"general", "tokenizer"})


def problems(path: str, key: str, needs_tokenizer: bool) -> list[str]:
    """What is wrong with the GGUF file ``path`` given as ``key`` (``model.path``, ``model.tokenizer_path``), from its
    metadata alone (no weights read): one line each, [] when transformers can convert it.

    Args:
        path: the ``.gguf`` file.
        key: the run-config key that named it (the lines start with it).
        needs_tokenizer: the tokenizer comes from this file (no other ``model.tokenizer_path``).
    """
    p = Path(path)
    if not p.is_file():
        return [f"{key}: GGUF file '{p}' does not exist (models load from local files only; fix the path)"]
    try:
        metadata, header = _metadata(p)
    except Exception as e:  # noqa: BLE001  (struct.error on a cut header, ValueError on a wrong magic, ...)
        return [f"{key}: '{p}' cannot be read as a GGUF file ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                f"give a complete .gguf file (llama.cpp's format) or a Hugging Face model folder"]
    end = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=header.data_start)
    size = p.stat().st_size
    if end > size:
        return [f"{key}: GGUF file '{p}' is truncated: its tensors end at byte {end:,} but the file has {size:,} "
                f"bytes; copy the whole file again"]
    arch = metadata.get("general.architecture")
    found = []
    try:
        _auto_config(p)
    except Exception as e:  # noqa: BLE001  (ValueError: architecture not supported; KeyError: a key it needs)
        if "not supported" in str(e) or arch not in supported_architectures():
            found.append(f"{key}: GGUF file '{p}' is a '{arch}' model, an architecture transformers' GGUF loader "
                         f"cannot read (it reads: {', '.join(supported_architectures())}); convert the original "
                         f"Hugging Face model folder instead")
        else:
            found.append(f"{key}: transformers cannot read the config of GGUF file '{p}' ({arch}): {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}")
    if needs_tokenizer and not metadata.get("tokenizer.ggml.tokens"):
        found.append(f"{key}: GGUF file '{p}' holds no tokenizer (no tokenizer.ggml.tokens in its metadata); set "
                     f"model.tokenizer_path to the model's tokenizer folder")
    return found


def sha256_of(path: Path, cache_root: Path) -> str:
    """The SHA-256 of the file at ``path`` (hex), remembered under ``cache_root/gguf/hashes/`` by the file's absolute
    path, size and mtime, so that every rank and every later launch does not read it again."""
    st = path.stat()
    ident = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns])
    memo = cache_root / "gguf" / "hashes" / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"
    try:
        return json.loads(memo.read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"file": ident, "sha256": digest}))
        os.replace(tmp, memo)
    except OSError:  # a read-only cache still converts; it only hashes again next time
        pass
    return digest


def folder_for(sha256: str, cache_root: Path) -> Path:
    """The converted folder of the GGUF file whose SHA-256 is ``sha256``."""
    return cache_root / "gguf" / sha256


def config_folder_for(sha256: str, cache_root: Path) -> Path:
    """The config-only folder (no weights) of the GGUF file whose SHA-256 is ``sha256``: what the checks read."""
    return cache_root / "gguf" / f"{sha256}-config"


def is_converted(folder: Path) -> bool:
    """True when ``folder`` is a complete conversion (renamed into place with its ``gguf.json``)."""
    return (folder / INFO_FILE).is_file()


def weights_deferred(folder: str | os.PathLike) -> bool:
    """True when ``folder`` is a GGUF's config-only folder: its weights stay in the GGUF until a launch converts it."""
    return (source_of(folder) or {}).get("weights") is False


def _ready(digest: str, cache_root: Path, weights: bool) -> Path | None:
    """A complete folder of the GGUF file whose SHA-256 is ``digest`` that serves (the full conversion; for
    ``weights=False`` also the config-only one), or None. Its file was checked (:func:`problems`) when it was made."""
    for folder in (folder_for(digest, cache_root), *(() if weights else (config_folder_for(digest, cache_root),))):
        if is_converted(folder):
            return folder
    return None


@contextmanager
def _locked(lock: Path):
    """An exclusive ``flock`` on ``lock`` (created), held for the block; a process killed while it holds it releases
    it with its file descriptors."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _model_class(config):
    """The transformers auto class that builds ``config`` with its head: causal LM, else seq2seq LM, else the bare
    model."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING)

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    if type(config) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        return AutoModelForSeq2SeqLM
    return AutoModel


def convert(path: Path, out: Path) -> dict:
    """Dequantize the GGUF file ``path`` with transformers' loader and save it as a Hugging Face folder ``out``
    (safetensors, config, generation config, and when the file holds one the tokenizer with its chat template).

    The weights are saved in the file's own float type when it holds plain floats (F32, F16, BF16: exact), in fp32
    when it holds quantized blocks (a dequantized block is exact in fp32, not in a half type). transformers keeps its
    GGUF quantizer and ``quantization_config`` on the loaded model; both are dropped before ``save_pretrained``, since
    the saved weights are plain tensors.

    Returns:
        The folder's ``gguf.json`` record (without ``source``/``sha256``, which the caller adds).
    """
    import torch
    import transformers
    from transformers import AutoTokenizer, GgufConfig

    parent, name = str(path.parent), path.name
    config = _auto_config(path)
    metadata, header = _metadata(path)
    with_tokenizer = bool(metadata.get("tokenizer.ggml.tokens"))
    dtype = header.dtype or torch.float32
    model = _model_class(config).from_pretrained(parent, gguf_file=name, local_files_only=True, dtype=dtype,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    if with_tokenizer:
        AutoTokenizer.from_pretrained(parent, gguf_file=name, local_files_only=True).save_pretrained(out)
    return {"architecture": header.architecture, "tokenizer": with_tokenizer, "model_class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype).removeprefix("torch."),
            "transformers": transformers.__version__}


def convert_config(path: Path, out: Path) -> dict:
    """The config, generation config and (when the file holds one) tokenizer of the GGUF file ``path``, read by
    transformers' GGUF loader and saved into ``out`` without the weights: what ``--check``, ``plan`` and ``doctor``
    read. The generation config is the one ``from_pretrained`` gives the full conversion (``from_model_config``).

    Returns:
        The folder's ``gguf.json`` record (``"weights": false``; without ``source``/``sha256``).
    """
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    parent, name = str(path.parent), path.name
    config = _auto_config(path)
    metadata, header = _metadata(path)
    with_tokenizer = bool(metadata.get("tokenizer.ggml.tokens"))
    model_class = _model_class(config)._model_mapping[type(config)]  # what the full conversion builds
    config.architectures = [model_class.__name__]  # as save_pretrained of that model writes it
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    if with_tokenizer:
        AutoTokenizer.from_pretrained(parent, gguf_file=name, local_files_only=True).save_pretrained(out)
    return {"architecture": header.architecture, "tokenizer": with_tokenizer, "weights": False,
            "model_class": model_class.__name__, "transformers": transformers.__version__}


def ensure_converted(path: str, cache_root: Path, weights: bool = True) -> tuple[Path, str | None]:
    """The converted folder of the GGUF file ``path`` under ``cache_root``, converting it first when no process has
    (under the file's lock: of the ranks that start together one converts, the others wait and reuse it).

    Args:
        weights: False for a check that reads no weights: the full conversion when it exists, else the config-only
            folder (:func:`convert_config`), made when missing.

    Returns:
        ``(folder, note)``: ``note`` is the line that says what was converted and where, or None when the folder was
        already there.
    """
    p = Path(path)
    digest = sha256_of(p, cache_root)
    if ready := _ready(digest, cache_root, weights):
        return ready, None
    folder = folder_for(digest, cache_root) if weights else config_folder_for(digest, cache_root)
    with _locked(folder.parent / f"{digest}.lock"):
        if ready := _ready(digest, cache_root, weights):  # another rank converted it while this one waited
            return ready, None
        start = time.monotonic()
        partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
        try:
            info = {"source": str(p.resolve()), "sha256": digest, **(convert if weights else convert_config)(p, partial)}
            (partial / INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))
            if folder.exists():  # an incomplete folder of an older layout: never taken, replaced whole
                shutil.rmtree(folder)
            os.replace(partial, folder)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    took = f"{time.monotonic() - start:.0f} s"
    if not weights:
        return folder, (f"GGUF '{p}' ({info['architecture']}, sha256 {digest[:12]}): config and tokenizer read by "
                        f"transformers into '{folder}' in {took} (the weights are converted at launch)")
    return folder, (f"GGUF '{p}' ({info['architecture']}, sha256 {digest[:12]}) converted by transformers into "
                    f"'{folder}' ({info['model_class']}, {info['parameters']:,} parameters, {info['dtype']}) in {took}")


def source_of(folder: str | os.PathLike) -> dict | None:
    """``gguf.json`` of a converted folder (the GGUF it came from), or None for any other folder."""
    try:
        return json.loads((Path(folder) / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None


def resolve(cfg, cache_root: Path, found: list[str], announce: bool = True, weights: bool = True) -> list[str]:
    """Replace a ``.gguf`` ``model.path`` / ``model.tokenizer_path`` (and a ``distill`` run's
    ``train.distill.teacher``) of the run config ``cfg`` (in place) by its converted folder under ``cache_root``,
    converting it once (:func:`ensure_converted`).

    Checks first (:func:`problems`), unless a folder made from the same file (by SHA-256) is already there; a key with
    a problem is left as it is and its lines appended to ``found``, so that nothing is converted for a run that is
    refused.

    Args:
        announce: print each conversion's line to stderr (the converting process; a launch's log has it too, from
            :func:`describe` when the model is built).
        weights: False for the verbs that read no weights (``--check``, ``plan``, ``doctor``): the config-only folder
            serves (:func:`convert_config`).

    Returns:
        The lines that say what was converted and where (empty when every folder was already there).
    """
    m = cfg.model
    separate_tokenizer = bool(m.tokenizer_path) and not is_gguf(m.tokenizer_path)
    # (owner, attribute, key as the user writes it, its weights are read, the file must carry a tokenizer)
    slots = [(m, "path", "model.path", True, not separate_tokenizer),
             (m, "tokenizer_path", "model.tokenizer_path", False, True)]
    if getattr(cfg, "recipe", "") == "distill":  # the teacher reads the student's token ids: no tokenizer needed
        slots.append((cfg.train.distill, "teacher", "train.distill.teacher", True, False))
    slots = [s for s in slots if is_gguf(getattr(s[0], s[1]))]
    if not slots:
        return []
    own = []
    for owner, attr, key, reads_weights, needs_tokenizer in slots:
        p = Path(getattr(owner, attr))
        if p.is_file() and _ready(sha256_of(p, cache_root), cache_root, weights and reads_weights):
            continue
        own += problems(getattr(owner, attr), key, needs_tokenizer=needs_tokenizer)
    if own:
        found += own
        return []
    notes = []
    for owner, attr, key, reads_weights, _ in slots:
        try:
            folder, note = ensure_converted(getattr(owner, attr), cache_root, weights=weights and reads_weights)
        except OSError as e:
            found.append(f"{key}: cannot write the conversion of '{getattr(owner, attr)}' under '{cache_root}/gguf' "
                         f"({e.strerror or e}); set data.cache_dir (or $FINETUNE_CACHE) to a writable folder")
            return notes
        except Exception as e:  # noqa: BLE001  (transformers' loader: an unsupported tensor type, a shape it rejects)
            found.append(f"{key}: transformers could not convert GGUF file '{getattr(owner, attr)}': "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            return notes
        if note:
            notes.append(note)
            if announce:
                print(f"finetune: {note}", file=sys.stderr, flush=True)
        setattr(owner, attr, str(folder))
    return notes


def describe(folder: str | os.PathLike) -> str | None:
    """The log line of a model loaded from a GGUF's converted folder (what it came from, where it is), or None."""
    info = source_of(folder)
    if info is None:
        return None
    return (f"model from GGUF '{info['source']}' (sha256 {info['sha256'][:12]}, {info['architecture']}), converted "
            f"by transformers {info['transformers']} into '{folder}'")
