"""Making a bundle for a cluster without internet: models, datasets and wheels, with a manifest.

``finetune bundle OUT --model ID_OR_PATH[@REV] --dataset ID_OR_PATH[@REV][:CONFIG] [--wheels]`` runs on a machine
that reaches the Hugging Face Hub (or only local files) and writes the folder described in
:mod:`finetune.airgap.manifest`; ``finetune verify OUT`` checks it offline on the cluster.

* **Models** from the Hub: the revision (branch, tag or commit) is resolved to its commit once
  (``HfApi.model_info``) and every file is fetched at that commit with ``huggingface_hub.snapshot_download``
  into ``OUT/models/<name>/``. From a local folder, named after its real folder (``--model ..`` too), only what the
  model needs is copied (:data:`MODEL_FILES`: configs, safetensors weights, tokenizer files, card and licence, the
  files a shard index names, the :data:`MODEL_FOLDERS`); what is left out is named in a warning. A link is resolved:
  inside the folder (or a cache snapshot's blob) it is copied by content; a link that leaves the folder is refused
  in one line unless ``follow_links`` (``--follow-links``), which copies what it points to, saying so. Every
  safetensors header and shard index is read (:func:`finetune.airgap.manifest.weights_problems`): a truncated or damaged
  weights file is refused. A named ``.gguf`` file (``--model x.gguf``) is carried alone into ``OUT/models/<stem>/``,
  after the checks a launch runs on it (:func:`finetune.engine.gguf.problems`: a GGUF, whole, of an architecture
  transformers reads); the run on the cluster converts it (``model.path`` names the file). Never taken unless asked: pickled weights
  (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``: unpickling runs code; ``allow_pickle``) and Python files
  (remote code; ``trust_remote_code``, recorded in the manifest); never taken from a folder: TensorFlow, Flax, ONNX,
  GGUF weights (PyTorch training reads none of them; a GGUF is taken when named itself, above).
* **Datasets**: ``datasets.load_dataset`` on a local parquet/jsonl/json/csv file, a folder of them (splits from
  the file names), a ``save_to_disk`` folder (``load_from_disk``), or a Hub dataset repo fetched at a resolved
  commit with ``snapshot_download`` into the Hugging Face cache and loaded from there (its README's
  ``configs`` select ``:CONFIG``; loading scripts are not run). Each split is written as parquet shards of at
  most ``max_shard_bytes`` of Arrow data, ``OUT/data/<name>/<split>-NNNNN.parquet``, the form the datasets
  maintainers recommend for moving data (``to_parquet``); rows and columns go into the manifest.
* **Wheels** (``wheels=True``): finetune and every dependency as wheels in ``OUT/wheels`` (``pip wheel``:
  what only exists as a source archive, DeepSpeed among them, is built into a wheel here), so that the
  cluster installs with ``pip install --no-index --find-links OUT/wheels finetune`` and needs no compiler.
  For another Python or platform (``for_python``, ``for_platform``), the pure-Python wheels built here are kept
  and the binary ones are fetched for the target with ``pip download --only-binary=:all:``.
* ``OUT/run_config.yaml``: a starting run config (recipe guessed from the first model and dataset) whose paths
  are relative to the bundle folder; ``OUT/ds_configs/``: the DeepSpeed JSON files it names.

Re-running into the same folder is safe and cheap: the manifest is removed first and rewritten last (a partial
bundle never looks complete: a failed write, e.g. a full disk, ends in one line naming the file and no manifest),
Hub files already fetched are skipped by ``huggingface_hub`` (its metadata in ``.cache/huggingface/``), and
copies, shards and wheels whose SHA-256 already matches are left untouched.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml
from loguru import logger

from finetune import __version__
from finetune.engine import gguf
from finetune.errors import ConfigError
from finetune.airgap.manifest import FORMAT, MANIFEST, check_files, file_entries, read_manifest, sha256_file, \
    source_problems, weights_problems, write_manifest

PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle"]
CODE_PATTERNS = ["*.py"]
NEVER_PATTERNS = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.tflite", "*.gguf", "onnx/*", ".git*"]
DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
SPLIT_NAMES = ("train", "validation", "valid", "dev", "test")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_WORK = ".finetune-bundle"


@dataclass
class Source:
    """One model or dataset of a bundle, as recorded in ``MANIFEST.json``'s ``sources``.

    Attributes:
        kind: ``"model"`` or ``"dataset"``.
        name: folder name under ``models/`` or ``data/``.
        spec: what the user asked for (``ID_OR_PATH[@REV][:CONFIG]``).
        origin: ``"hub"`` or ``"local"``.
        revision: the revision asked for (``None``: the default branch).
        resolved_revision: the commit fetched (Hub), or read from a Hugging Face cache path
            (``.../snapshots/<commit>``); ``None`` for other local sources.
        license: the ``license`` of the card's YAML header (README.md), ``None`` when not stated.
        config: the dataset configuration (``:CONFIG``).
        trust_remote_code: Python files from the source are in the bundle.
        splits: datasets only: ``{split: {"rows": int, "columns": [names], "types": {name: feature type},
            "files": [paths]}}``.
    """

    kind: str
    name: str
    spec: str
    origin: str = "local"
    revision: str | None = None
    resolved_revision: str | None = None
    license: str | None = None
    config: str | None = None
    trust_remote_code: bool = False
    splits: dict = field(default_factory=dict)
    gguf: str | None = None
    """Models from a ``.gguf`` file: its name in the model's folder (the run's ``model.path`` is that file)."""

    @property
    def path(self) -> str:
        """The source's folder inside the bundle (``models/<name>`` or ``data/<name>``)."""
        return f"{'models' if self.kind == 'model' else 'data'}/{self.name}"


def _split_spec(spec: str, with_config: bool) -> tuple[str, str | None, str | None]:
    """``ID_OR_PATH[@REV][:CONFIG]`` -> (id or path, revision, config); an existing local path is taken whole."""
    if Path(spec).expanduser().exists():
        return spec, None, None
    config = None
    if with_config and ":" in spec:
        spec, config = spec.rsplit(":", 1)
        if Path(spec).expanduser().exists():
            return spec, None, config or None
    rev = None
    if "@" in spec:
        spec, rev = spec.rsplit("@", 1)
    return spec, rev or None, config or None


def _local(ident: str) -> Path:
    """A local source as a real path: a folder resolved (``..``, links: named after the real folder), a file made
    absolute without following its link (a Hugging Face cache file links to a blob named by its hash)."""
    p = Path(ident).expanduser()
    return p.resolve() if p.is_dir() else Path(os.path.abspath(p))


def _name(ident: str, config: str | None = None) -> str:
    """The folder name of a source in the bundle: a local path's real name (a cache snapshot: its repo's name), a
    Hub id's last part, ``-CONFIG`` appended.

    Raises:
        ConfigError: no usable name (``--model /``).
    """
    p = _local(ident) if Path(ident).expanduser().exists() else Path(ident.rstrip("/"))
    base = p.stem if p.suffix in DATA_SUFFIXES or gguf.is_gguf(p) else p.name
    if re.fullmatch(r"[0-9a-f]{40}", base) and p.parent.name == "snapshots":  # a Hugging Face cache snapshot
        base = p.parent.parent.name.split("--")[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", base + (f"-{config}" if config else ""))
    if name.strip(".-") == "":
        raise ConfigError(f"{ident}: no folder name to give it in the bundle; name a model or dataset folder")
    return name


def _card_license(folder: Path) -> str | None:
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub import RepoCard

    try:
        lic = RepoCard.load(readme).data.to_dict().get("license")
    except Exception:  # a README without a (valid) YAML header states no licence
        return None
    return ", ".join(lic) if isinstance(lic, list) else lic


def _cache_commit(path: Path) -> str | None:
    """The commit of a Hugging Face cache snapshot folder (``.../snapshots/<commit>``), else ``None``."""
    p = path.resolve()
    return p.name if p.parent.name == "snapshots" and _COMMIT.fullmatch(p.name) else None


def _ignore(allow_pickle: bool, trust_remote_code: bool) -> list[str]:
    return NEVER_PATTERNS + ([] if allow_pickle else PICKLE_PATTERNS) + ([] if trust_remote_code else CODE_PATTERNS)


_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _write_failed(path: Path | str, e: OSError) -> ConfigError:
    """One line for a write into the bundle that failed (disk full, file-size limit, read-only, ...)."""
    hint = "free space (or raise the file-size limit: ulimit -f)" if e.errno in _FULL else \
        "give a folder you can write to"
    return ConfigError(f"{path}: could not be written ({e.strerror or e}): {hint}, then run finetune bundle again "
                       f"(until then the bundle has no {MANIFEST}: unfinished)")


def _copy_if_changed(src: Path, dst: Path) -> bool:
    """Copy ``src`` (a link: what it points to) to ``dst`` unless ``dst`` already has the same bytes (size and
    SHA-256); True if copied. The copy goes to ``dst.partial`` first, renamed when whole.

    Raises:
        ConfigError: the copy failed (one line naming ``dst``; the partial file is removed).
    """
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha256_file(src):
        return False
    tmp = dst.with_name(dst.name + ".partial")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not os.access(src, os.R_OK):
            raise ConfigError(f"{src}: cannot be read ({e.strerror or e}); make it readable") from None
        raise _write_failed(dst, e) from None
    return True


MODEL_FILES = ("*.json", "*.safetensors", "merges.txt", "vocab.txt", "*.model", "*.tiktoken", "*.jinja", "README.md",
               "LICENSE*", "LICENCE*", "NOTICE*", "USE_POLICY*")
"""What ``finetune bundle`` takes from the top level of a local model folder: its configs and other JSON files
(``config.json``, ``generation_config.json``, the tokenizer's, shard indexes, a finetune export's provenance), the
safetensors weights, the tokenizer's vocabularies (BPE ``merges.txt``, WordPiece ``vocab.txt``, SentencePiece
``*.model``, tiktoken), chat templates, the card and the licence; with ``allow_pickle`` also the pickled weights, with
``trust_remote_code`` the Python files, and every file a shard index names (``weight_map``). What ``from_pretrained``
and ``AutoTokenizer`` read; anything else is left out and named in a warning."""

MODEL_FOLDERS = {"adapter": ("*.json", "*.safetensors", "README.md"), "additional_chat_templates": ("*.jinja",)}
"""Subfolders of a local model folder taken too, with the files taken from each: a finetune export's LoRA adapter
(``adapter/``) and the named chat templates transformers reads besides ``chat_template.jinja``."""


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _target(link: Path) -> Path:
    """Where ``link`` leads, every link on the way resolved (``os.path.realpath``: a loop gives a path, no error)."""
    return Path(os.path.realpath(link))


def _listed(src: Path) -> set[str]:
    """The file names the shard indexes of ``src`` name (``*.index.json`` ``weight_map`` values)."""
    names: set[str] = set()
    for index in src.glob("*.index.json"):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue  # a damaged index is reported by weights_problems once copied
        if isinstance(weight_map, dict):
            names.update(v for v in weight_map.values() if isinstance(v, str) and v and "/" not in v)
    return names


def _model_plan(src: Path, ignore: list[str], follow_links: bool, what: str) -> tuple[list[tuple[Path, str]], list[str]]:
    """What to copy from the local model folder ``src``: ``([(file, path relative to src)], [left out])``.

    Only :data:`MODEL_FILES` of the top level, every file a shard index names and the :data:`MODEL_FOLDERS`, minus
    the ``ignore`` patterns; nothing else is read (a folder's other subfolders are never entered). A symbolic link
    is resolved: one whose target stays inside ``src`` (or, for a Hugging Face cache snapshot, inside its repo's
    ``blobs/``) is taken by content; one that leaves it is refused unless ``follow_links``, and then taken by content
    with a log line. A link that points to nothing is skipped with a warning.

    Raises:
        ConfigError: a file or folder to take is a link out of ``src`` and ``follow_links`` is off (one line naming
            the first such link, the number of others, and the two fixes).
    """
    real = src.resolve()
    blobs = real.parent.parent / "blobs" if _cache_commit(src) is not None else None
    listed = _listed(src)
    take: list[tuple[Path, str]] = []
    left, outside, cached = [], [], 0

    def wanted(rel: str, patterns) -> str | None:
        """Why ``rel`` is left out (None: taken)."""
        name = rel.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(name, pat) for pat in ignore):
            return ("pickled weights: --allow-pickle" if any(fnmatch.fnmatch(name, p) for p in PICKLE_PATTERNS)
                    else "code: --trust-remote-code" if any(fnmatch.fnmatch(name, p) for p in CODE_PATTERNS)
                    else "never bundled")
        if any(fnmatch.fnmatch(name, pat) for pat in patterns) or ("/" not in rel and name in listed):
            return None
        if "/" not in rel and (any(fnmatch.fnmatch(name, p) for p in PICKLE_PATTERNS)
                               or any(fnmatch.fnmatch(name, p) for p in CODE_PATTERNS)):
            return None  # asked for (--allow-pickle, --trust-remote-code): not in ignore
        return "not a model file"

    def link_ok(p: Path, rel: str) -> bool:
        """A link: taken (inside, a cache blob, or followed) or not (it points to nothing)."""
        nonlocal cached
        target = _target(p)
        if not p.exists():
            logger.warning(f"{what}: link {rel} -> {os.readlink(p)}: points to nothing, skipped")
            return False
        if blobs is not None and _inside(target, blobs):
            cached += 1
        elif _inside(target, real):
            logger.info(f"{what}: link {rel} -> {target}: inside the model folder, copied by content")
        elif follow_links:
            logger.warning(f"{what}: link {rel} -> {target}: outside the model folder, followed (--follow-links): "
                           "copied by content")
        else:
            outside.append(f"{rel} -> {target}")
            return False
        return True

    def scan(folder: Path, prefix: str, patterns) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            rel = prefix + entry.name
            link = f"a link to {_target(entry)}; " if entry.is_symlink() else ""
            if entry.is_dir():  # a folder, or a link to one
                sub = MODEL_FOLDERS.get(rel)
                if rel == ".cache":  # huggingface_hub's download metadata
                    continue
                if sub is None:
                    left.append(f"{rel}/ ({link}not a model folder)")
                    continue
                if entry.is_symlink() and not link_ok(entry, rel):
                    continue
                scan(entry, rel + "/", sub)
                continue
            why = wanted(rel, patterns)
            if why is None and entry.exists() and not entry.is_file():
                why = "not a regular file"  # a pipe or device (behind a name such as x.json): never read
            if why is not None:
                left.append(f"{rel} ({link}{why})")
            elif not entry.is_symlink() or link_ok(entry, rel):
                take.append((entry, rel))

    scan(src, "", MODEL_FILES)
    if outside:
        more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
        raise ConfigError(f"{what}: link {outside[0]} leaves the model folder {real}{more}; a bundle takes nothing "
                          "from outside the folder it is given: copy the file into the folder (or remove the link), "
                          "or pass --follow-links to copy what such links point to")
    if cached:
        logger.info(f"{what}: {cached} files are links into the Hugging Face cache's blobs: copied by content")
    return take, left


def _copy_model(src: Path, dst: Path, ignore: list[str], follow_links: bool, what: str) -> tuple[int, int]:
    """Copy what the model needs from the local folder ``src`` into ``dst`` (:func:`_model_plan`; nothing is copied
    when it refuses); what is left out is named in one warning; a file of an earlier bundle run that is no longer
    taken is removed from ``dst``. Returns (copied, already there).

    Raises:
        ConfigError: see :func:`_model_plan`; a copy failed (:func:`_copy_if_changed`).
    """
    take, left = _model_plan(src, ignore, follow_links, what)
    if left:
        shown = ", ".join(left[:6]) + (f", and {len(left) - 6} more" if len(left) > 6 else "")
        logger.warning(f"{what}: left out {len(left)} entr{'y' if len(left) == 1 else 'ies'} of {src}: {shown}")
    copied = kept = 0
    for f, rel in take:
        if _copy_if_changed(f, dst / rel):
            copied += 1
        else:
            kept += 1
    wanted = {rel for _, rel in take}
    stale = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if (p.is_file() or p.is_symlink())
                   and ".cache" not in p.relative_to(dst).parts) if dst.is_dir() else []
    stale = [rel for rel in stale if rel not in wanted]
    for rel in stale:
        (dst / rel).unlink()
    if stale:
        logger.info(f"{what}: removed {len(stale)} file(s) of an earlier bundle run that are no longer taken: "
                    f"{', '.join(stale[:6])}")
    return copied, kept


@contextmanager
def _hub_errors(what: str):
    """Turn the Hub client's errors (unknown repo or revision, no connection, HTTP errors) into one line."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError
    from httpx2 import HTTPError  # the client huggingface_hub uses

    try:
        yield
    except RevisionNotFoundError as e:
        raise ConfigError(f"{what}: no such revision on the Hub ({_first_line(e)})") from None
    except RepositoryNotFoundError as e:
        raise ConfigError(f"{what}: not a local path, and no such repo on the Hub (or it is private/gated: "
                          f"run `hf auth login`) ({_first_line(e)})") from None
    except OSError as e:
        if e.errno in _FULL:  # writing what was fetched failed, not the Hub
            raise _write_failed(e.filename or what, e) from None
        raise ConfigError(f"{what}: the Hub could not be reached or refused ({_first_line(e)}); bundle runs on "
                          "a machine with internet (HF_ENDPOINT for a mirror)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, HTTPError) as e:
        raise ConfigError(f"{what}: the Hub could not be reached or refused ({_first_line(e)}); bundle runs on "
                          "a machine with internet (HF_ENDPOINT for a mirror)") from None


def fetch_model(spec: str, out: Path, allow_pickle: bool = False, trust_remote_code: bool = False,
                follow_links: bool = False) -> Source:
    """Put the model (or tokenizer) ``spec`` (``ID_OR_PATH[@REV]``) into ``out/models/<name>/``: from the Hub, every
    file of the repo at the resolved commit but the ignored ones; from a local folder, what the model needs
    (:func:`_model_plan`: configs, weights, tokenizer, card, the files its shard indexes name), never anything
    through a link out of the folder unless ``follow_links``.

    Returns:
        Its :class:`Source`.

    Raises:
        ConfigError: a file to take is a link out of the local folder (without ``follow_links``), the folder ends
            without a ``config.json`` or tokenizer, with pickled weights only (``--allow-pickle`` takes them), or with
            a damaged safetensors file or shard index (truncated, a shard missing:
            :func:`finetune.airgap.manifest.weights_problems`), or a copy failed (disk full).
    """
    ident, rev, _ = _split_spec(spec, with_config=False)
    src = Source("model", _name(ident), spec, revision=rev, trust_remote_code=trust_remote_code)
    dest = out / src.path
    ignore = _ignore(allow_pickle, trust_remote_code)
    local = _local(ident)
    if local.is_file() and gguf.is_gguf(local):  # a GGUF named itself: the file alone, checked as a launch does
        bad = gguf.problems(str(local), f"--model {spec}", needs_tokenizer=False)
        if bad:
            raise ConfigError(bad)
        src.gguf = local.name
        copied = _copy_if_changed(local, dest / local.name)
        logger.info(f"model {src.name}: GGUF {local} {'copied' if copied else 'already there'}")
        return src
    if local.is_dir():
        copied, kept = _copy_model(local, dest, ignore, follow_links, f"model {src.name}")
        src.resolved_revision = _cache_commit(local)
        logger.info(f"model {src.name}: {copied} files copied from {local}, {kept} already there")
    else:
        from huggingface_hub import HfApi, snapshot_download

        src.origin = "hub"
        with _hub_errors(f"--model {spec}"):
            src.resolved_revision = HfApi().model_info(ident, revision=rev).sha
            snapshot_download(ident, revision=src.resolved_revision, local_dir=dest, ignore_patterns=ignore)
        logger.info(f"model {src.name}: {ident} at {src.resolved_revision} in {dest}")
    files = {p.name for p in dest.rglob("*") if p.is_file()} if dest.is_dir() else set()
    if not files & {"config.json", "tokenizer_config.json", "tokenizer.json"}:
        raise ConfigError(f"--model {spec}: no config.json or tokenizer files in it: is it a Hugging Face model "
                          "folder or repo?")
    if not any(n.endswith(".safetensors") for n in files) and not (allow_pickle and any(
            fnmatch.fnmatch(n, p) for n in files for p in PICKLE_PATTERNS)):
        pickled = sorted(n for n in (local.iterdir() if local.is_dir() else [])
                         if any(fnmatch.fnmatch(n.name, p) for p in PICKLE_PATTERNS))
        if pickled:
            raise ConfigError(f"--model {spec}: only pickled weights ({pickled[0].name}); pickles run code when "
                              "loaded: convert them to safetensors, or pass --allow-pickle to bundle them")
        logger.warning(f"model {src.name}: no weights (config/tokenizer only): usable with model.init: scratch "
                       "or as model.tokenizer_path")
    damaged = weights_problems(dest)
    if damaged:
        raise ConfigError([f"--model {spec}: {p}" for p in damaged])
    src.license = _card_license(dest)
    return src


def _load_local(path: Path, config: str | None):
    """A ``DatasetDict`` from a local file, folder of data files or ``save_to_disk`` folder."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    if path.is_file():
        builder = DATA_SUFFIXES.get(path.suffix)
        if builder is None:
            raise ConfigError(f"--dataset {path}: unknown file type '{path.suffix}' (parquet, jsonl, json, csv)")
        split = next((s for s in SPLIT_NAMES if path.stem.lower().startswith(s)), "train")
        return load_dataset(builder, data_files={split: str(path)})
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = load_from_disk(str(path))
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
    return load_dataset(str(path), name=config)


def _write_split(ds, folder: Path, split: str, max_shard_bytes: int, tmpdir: Path) -> tuple[list[str], int]:
    """Write ``ds`` as ``<split>-NNNNN.parquet`` shards; returns (file names, shards rewritten)."""
    n = max(1, math.ceil(ds.data.nbytes / max_shard_bytes))
    names, written = [], 0
    for i in range(n):
        name = f"{split}-{i:05d}.parquet"
        tmp = tmpdir / name
        ds.shard(n, i, contiguous=True).to_parquet(str(tmp))
        dst = folder / name
        if dst.is_file() and sha256_file(dst) == sha256_file(tmp):
            tmp.unlink()
        else:
            os.replace(tmp, dst)
            written += 1
        names.append(name)
    return names, written


def fetch_dataset(spec: str, out: Path, max_shard_bytes: int = 500 * 2**20) -> Source:
    """Put the dataset ``spec`` (``ID_OR_PATH[@REV][:CONFIG]``) into ``out/data/<name>/`` as parquet shards.

    Returns:
        Its :class:`Source`, with ``splits`` (rows, columns, files).

    Raises:
        ConfigError: an unknown file type, or a dataset without rows.
    """
    import datasets

    datasets.disable_progress_bars()
    ident, rev, config = _split_spec(spec, with_config=True)
    src = Source("dataset", _name(ident, config), spec, revision=rev, config=config)
    local = Path(ident).expanduser()
    if local.exists():
        try:
            dd = _load_local(local, config)
        except ConfigError:
            raise
        except Exception as e:  # datasets' own errors (mixed schemas, bad rows): the cause in one line
            while e.__cause__ is not None:
                e = e.__cause__
            raise ConfigError(f"--dataset {spec}: datasets cannot load it: {_first_line(e)} (files of one "
                              "split must share their columns; give files one by one)") from None
        src.resolved_revision = _cache_commit(local) if local.is_dir() else None
        card_dir = local if local.is_dir() else None
    else:
        from datasets import load_dataset
        from huggingface_hub import HfApi, snapshot_download

        src.origin = "hub"
        with _hub_errors(f"--dataset {spec}"):
            src.resolved_revision = HfApi().dataset_info(ident, revision=rev).sha
            snap = Path(snapshot_download(ident, repo_type="dataset", revision=src.resolved_revision,
                                          ignore_patterns=CODE_PATTERNS))
        dd = load_dataset(str(snap), name=config)
        card_dir = snap
    folder = out / src.path
    folder.mkdir(parents=True, exist_ok=True)
    if card_dir is not None and (card_dir / "README.md").is_file():
        _copy_if_changed(card_dir / "README.md", folder / "README.md")
        src.license = _card_license(card_dir)
    keep = {"README.md"}
    with tempfile.TemporaryDirectory(dir=out / _WORK) as tmp:
        for split, ds in dd.items():
            if len(ds) == 0:
                raise ConfigError(f"--dataset {spec}: split '{split}' has no rows")
            names, written = _write_split(ds, folder, split, max_shard_bytes, Path(tmp))
            keep.update(names)
            src.splits[split] = {"rows": len(ds), "columns": list(ds.column_names),
                                 "types": {k: str(v) for k, v in ds.features.items()},
                                 "files": [f"{src.path}/{n}" for n in names]}
            logger.info(f"dataset {src.name}: split {split}: {len(ds):,} rows in {len(names)} shard(s), "
                        f"{written} rewritten")
    for stale in folder.glob("*-[0-9][0-9][0-9][0-9][0-9].parquet"):  # shards of an earlier, other split layout
        if stale.name not in keep:
            stale.unlink()
    return src


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    logger.info("$ " + " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"pip {args[0]} failed (exit {done.returncode}): {' | '.join(tail)}")


def _this_platform() -> tuple[str, str]:
    return f"{sys.version_info.major}.{sys.version_info.minor}", sysconfig.get_platform().replace("-", "_")


def fetch_wheels(out: Path, for_python: str | None = None, for_platform: str | None = None,
                 torch_version: str | None = None, torch_index: str | None = None) -> str:
    """Wheels of finetune and all its dependencies in ``out/wheels``; returns the cluster's install command.

    finetune's own wheel is built from its source folder (the one this module is imported from). torch is pinned
    to ``torch_version`` (default: the installed one, without its local ``+cpu``/``+cuXXX`` tag), taken from
    ``torch_index`` when given (e.g. ``https://download.pytorch.org/whl/cu128``).

    Raises:
        ConfigError: pip failed (its last lines are in the message), or finetune is not installed from a
            source folder.
    """
    import torch

    root = Path(__file__).resolve().parents[2]  # finetune/airgap/bundle.py -> the source folder
    if not (root / "pyproject.toml").is_file():
        raise ConfigError("--wheels: finetune's source folder (pyproject.toml) is not beside the installed package; "
                          "run bundle from a source checkout (pip install -e .)")
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    work = out / _WORK / "wheels"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    pin = work / "constraints.txt"
    pin.write_text(f"torch=={torch_version or torch.__version__.split('+')[0]}\n")
    index = ["--extra-index-url", torch_index] if torch_index else []
    _pip(["wheel", "--no-deps", "--wheel-dir", str(work / "own"), str(root)])
    own = next((work / "own").glob("finetune-*.whl"))
    _pip(["wheel", "--wheel-dir", str(work / "built"), "--find-links", str(work / "own"), "-c", str(pin), *index,
          str(own)])
    here = _this_platform()
    target = (for_python or here[0], for_platform or here[1])
    if target == here:
        found = list((work / "built").glob("*.whl"))
    else:
        found = [w for w in (work / "built").glob("*.whl") if w.name.endswith("-none-any.whl")]
        pure = work / "pure"
        pure.mkdir()
        for w in found:
            shutil.copy2(w, pure / w.name)
        _pip(["download", "--dest", str(work / "target"), "--only-binary=:all:", "--python-version", target[0],
              "--platform", target[1], "--find-links", str(pure), "-c", str(pin), *index, str(own)])
        found = sorted({w.name: w for w in [*found, *(work / "target").glob("*.whl")]}.values())
    names = {w.name for w in found}
    for w in found:
        _copy_if_changed(w, wheels / w.name)
    for old in wheels.glob("*.whl"):
        if old.name not in names:
            old.unlink()
    shutil.rmtree(work, ignore_errors=True)
    logger.info(f"wheels: {len(names)} for Python {target[0]} on {target[1]} in {wheels}")
    return "pip install --no-index --find-links wheels finetune"


def _recipe_guess(models: list[Source], datasets: list[Source], out: Path) -> tuple[str, dict]:
    """(recipe, data keys) for the starting run config, from the dataset's columns and the model's class."""
    cols = set(next(iter(datasets[0].splits.values()))["columns"]) if datasets else set()
    masked = False
    if models and (out / models[0].path / "config.json").is_file():
        masked = "MaskedLM" in (out / models[0].path / "config.json").read_text()
    if {"prompt", "chosen", "rejected"} <= cols:
        return "dpo", {"prompt_column": "prompt", "chosen_column": "chosen", "rejected_column": "rejected"}
    if "messages" in cols:
        return "sft", {"messages_column": "messages"}
    # the peers' forms sft recognises (finetune.data.formats): named, so the tokens are those of their messages
    for form, needs in (("sharegpt", {"conversations"}), ("alpaca", {"instruction", "output"}),
                        ("prompt_completion", {"prompt", "completion"})):
        if needs <= cols:
            return "sft", {"format": form}
    if {"question", "context", "answers"} <= cols:  # SQuAD's form (squad, squad_v2 and the sets shaped like them)
        return "qa", {"question_column": "question", "context_column": "context", "answers_column": "answers"}
    for p, r in (("prompt", "response"), ("question", "answer")):
        if {p, r} <= cols:
            return "sft", {"prompt_column": p, "response_column": r}
    if {"text", "label"} <= cols:
        return "seq_cls", {"text_column": "text", "label_column": "label"}
    if {"tokens", "ner_tags"} <= cols:  # Hugging Face's token-classification sets (conll2003, wnut_17, wikiann)
        return "token_cls", {"tokens_column": "tokens", "tags_column": "ner_tags"}
    if {"anchor", "positive"} <= cols:  # sentence-transformers' pair and triplet sets (all-nli, msmarco, ...)
        keys = {"anchor_column": "anchor", "positive_column": "positive"}
        return "embed", {**keys, **({"negative_column": "negative"} if "negative" in cols else {}),
                         **({"score_column": "score"} if "score" in cols else {})}
    return ("bert_mlm" if masked else "gpt_clm"), {"text_column": "text"}


def starting_config(out: Path, models: list[Source], datasets: list[Source]) -> str:
    """Text of ``run_config.yaml``: the first model and dataset, paths relative to the bundle folder."""
    recipe, keys = _recipe_guess(models, datasets, out)
    model = {"path": models[0].path} if models else {"path": "models/<name>"}
    if models and models[0].gguf:
        model["path"] = f"{models[0].path}/{models[0].gguf}"
    elif models and not any((out / models[0].path).glob("*.safetensors")) and not any(
            (out / models[0].path).glob("*.bin")):
        model["init"] = "scratch"
    data: dict = {}
    if datasets:
        splits = datasets[0].splits
        val = next((s for s in ("validation", "valid", "dev", "test") if s in splits), None)
        train = "train" if "train" in splits else next(iter(splits))
        data["train_files"] = [f"{datasets[0].path}/{train}-*.parquet"]
        if val:
            data["validation_files"] = [f"{datasets[0].path}/{val}-*.parquet"]
    cfg = {"recipe": recipe, "output_root": f"runs/{models[0].name if models else 'run'}",
           "deepspeed": "ds_configs/zero2.json", "model": model, "data": {**data, **keys},
           "train": {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "epochs": 1, "lr": 2.0e-5,
                     "eval_every": 200, "save_every": 500, "keep_last_checkpoints": 2}}
    others = [s.path for s in [*models[1:], *datasets[1:]]]
    head = ("# Written by finetune bundle: a starting point to edit (not in MANIFEST.json). Paths are relative to\n"
            "# the bundle folder: run from it, e.g.  deepspeed --module finetune train --config run_config.yaml\n"
            + (f"# Also in the bundle: {', '.join(others)}\n" if others else ""))
    return head + yaml.safe_dump(cfg, sort_keys=False)


def _recorded(out: Path) -> dict:
    """What earlier and this run finished: ``{"sources": {"<kind>/<name>": source dict}, "install": str}``, kept in
    ``.finetune-bundle/sources.json`` so that a re-run adds to the bundle; sources whose folder is gone drop out."""
    path = out / _WORK / "sources.json"
    rec = json.loads(path.read_text()) if path.is_file() else {"sources": {}}
    rec["sources"] = {k: v for k, v in rec["sources"].items() if (out / v["path"]).is_dir()}
    if rec.get("install") and not (out / "wheels").is_dir():
        rec["install"] = None
    return rec


def _save_recorded(out: Path, rec: dict) -> None:
    tmp = out / _WORK / "sources.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, out / _WORK / "sources.json")


def _record(out: Path, src: Source) -> Source:
    rec = _recorded(out)
    rec["sources"][f"{src.kind}/{src.name}"] = vars(src) | {"path": src.path}
    _save_recorded(out, rec)
    return src


def make_bundle(out: Path, models: list[str], datasets: list[str], wheels: bool = False,
                allow_pickle: bool = False, trust_remote_code: bool = False, max_shard_bytes: int = 500 * 2**20,
                for_python: str | None = None, for_platform: str | None = None, torch_version: str | None = None,
                torch_index: str | None = None, follow_links: bool = False) -> dict:
    """Fetch every source into ``out`` and write ``MANIFEST.json`` last; returns the manifest.

    A re-run into the same folder adds its sources to those of earlier runs (a source of the same kind and name
    is fetched again: unchanged files are kept); the manifest lists them all. ``follow_links``: links out of a local
    model folder are followed (:func:`fetch_model`).

    Raises:
        ConfigError: ``out`` is a file, cannot be written, or is a non-empty folder that is not a bundle (nothing
            of the user's is touched), two sources share a name, a source fails (see :func:`fetch_model`,
            :func:`fetch_dataset`, :func:`fetch_wheels`), or a write fails (disk full, file-size limit: one line
            naming the file; the folder is then an unfinished bundle, without ``MANIFEST.json``).
    """
    out = Path(out)
    _check_out(out)
    names = [_name(*_split_spec(s, False)[:1]) for s in models] + \
        [_name(i, c) for i, _, c in (_split_spec(s, True) for s in datasets)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"two sources would share the folder name '{dup[0]}': bundle them into separate folders")
    try:
        if (out / MANIFEST).is_file():
            (out / MANIFEST).unlink()  # from here until the end, the folder is an unfinished bundle
        model_src = [_record(out, fetch_model(s, out, allow_pickle, trust_remote_code, follow_links)) for s in models]
        data_src = [_record(out, fetch_dataset(s, out, max_shard_bytes)) for s in datasets]
        install = fetch_wheels(out, for_python, for_platform, torch_version, torch_index) if wheels else None
        if install:
            _save_recorded(out, _recorded(out) | {"install": install})
        ds_dir = Path(__file__).resolve().parents[2] / "ds_configs"
        for f in sorted(ds_dir.glob("*.json")) if ds_dir.is_dir() else []:
            _copy_if_changed(f, out / "ds_configs" / f.name)
        if not (out / "run_config.yaml").exists():  # once written, it is the user's to edit
            tmp = out / _WORK / "run_config.yaml.tmp"
            tmp.write_text(starting_config(out, model_src, data_src))
            os.replace(tmp, out / "run_config.yaml")
        manifest = {"format": FORMAT, "finetune_version": __version__,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "made_on": {"python": platform.python_version(), "platform": sysconfig.get_platform()},
                    "install": install or _recorded(out).get("install"),
                    "sources": list(_recorded(out)["sources"].values()), "files": file_entries(out)}
        write_manifest(out, manifest)
    except OSError as e:  # a write into the bundle that failed (shards, records, the manifest)
        if e.errno not in _FULL | {errno.EROFS}:
            raise
        raise _write_failed(e.filename or out, e) from None
    return manifest


def _check_out(out: Path) -> None:
    """Refuse an output ``out`` that is (or lies under) a file, cannot be written, or is a non-empty folder that is
    not a bundle; leaves ``out/.finetune-bundle/`` in place (the mark of a bundle folder).

    Raises:
        ConfigError: one line naming ``out`` and what is wrong.
    """
    try:
        above = out.absolute()
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise ConfigError(f"{out}: {'it' if above == out.absolute() else above} is a file, not a folder; give a "
                              "new or empty folder")
        if above == out.absolute() and any(out.iterdir()) and not (out / _WORK).is_dir():
            raise ConfigError(f"{out}: a folder that is not a finetune bundle and not empty; give a new or empty "
                              "folder")
        (out / _WORK).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out / _WORK, prefix="probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{out}: cannot be written ({e.strerror or e}); give a folder you can write to") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _check_model(root: Path, src: dict) -> list[str]:
    """Problems of a bundled model, found without running any of its code, whatever the manifest's
    ``trust_remote_code`` says: ``config.json`` and ``tokenizer_config.json`` parsed as JSON objects (never
    ``AutoConfig``), the safetensors headers and shard indexes (:func:`finetune.airgap.manifest.weights_problems`), and
    the tokenizer loaded offline with ``trust_remote_code=False``; a model whose configs name custom code
    (``auto_map``) has its ``tokenizer.json`` parsed instead."""
    from transformers import AutoTokenizer

    folder, problems, custom = root / src["path"], [], False
    if src.get("gguf"):  # a GGUF file: its metadata as a launch checks it (no weights read, no code run)
        return gguf.problems(str(folder / src["gguf"]), f"model {src['name']}", needs_tokenizer=False)
    for name in ("config.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            continue
        try:
            data = json.loads((folder / name).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"model {src['name']}: {name} is not valid JSON ({e})")
            continue
        if not isinstance(data, dict):
            problems.append(f"model {src['name']}: {name} is not a JSON object (a Hugging Face config is one)")
        elif name == "config.json" and not isinstance(data.get("model_type"), str):
            problems.append(f"model {src['name']}: config.json has no model_type (transformers cannot tell the "
                            "architecture)")
        else:
            custom = custom or "auto_map" in data
    problems += [f"model {src['name']}: {p}" for p in weights_problems(folder)]
    if problems or not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json",
                                                             "vocab.json", "vocab.txt")):
        return problems
    if custom:
        if (folder / "tokenizer.json").is_file():
            try:
                json.loads((folder / "tokenizer.json").read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                problems.append(f"model {src['name']}: tokenizer.json is not valid JSON ({e})")
        return problems
    try:
        AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # any failure is the finding, reported in one line
        problems.append(f"model {src['name']}: the tokenizer does not load offline: {_first_line(e)}")
    return problems


def _check_dataset(root: Path, src: dict) -> list[str]:
    """Problems reading a bundled dataset's parquet footers: columns and row counts against the manifest."""
    import pyarrow.parquet as pq

    problems = []
    for split, info in src.get("splits", {}).items():
        rows, whole = 0, all((root / rel).is_file() for rel in info["files"])
        for rel in info["files"]:
            if not (root / rel).is_file():  # reported by check_files
                continue
            try:
                meta = pq.read_metadata(root / rel)
            except Exception as e:
                problems.append(f"dataset {src['name']}: {rel}: parquet footer unreadable: {_first_line(e)}")
                continue
            rows += meta.num_rows
            names = meta.schema.to_arrow_schema().names
            if names != info["columns"]:
                problems.append(f"dataset {src['name']}: {rel}: columns {names}, the manifest says "
                                f"{info['columns']}")
        if whole and rows != info["rows"]:
            problems.append(f"dataset {src['name']}: split {split} has {rows:,} rows, the manifest says "
                            f"{info['rows']:,}")
    return problems


def verify_bundle(root: Path) -> list[str]:
    """Offline check of a bundle: one line per problem, empty when it is whole.

    Every file's size and SHA-256 against ``MANIFEST.json`` (missing, corrupt, extra, links: :func:`check_files`)
    and every source's folder and split files where the manifest hashes them (:func:`source_problems`: not under
    ``runs/`` or a cache, no link, inside the bundle); only when all is well, each model's configs, weights headers
    and tokenizer (:func:`_check_model`, no code of the bundle run) and each dataset's parquet footers (columns,
    row counts). Call with ``HF_HUB_OFFLINE=1`` set
    before transformers is imported (the command does).

    Raises:
        ConfigError: ``MANIFEST.json`` is not a manifest: not JSON, entries of the wrong shape or paths outside the
            bundle (:func:`finetune.airgap.manifest.read_manifest`).
    """
    root = Path(root)
    if not root.is_dir():
        return [f"{root}: no such folder"]
    try:
        manifest = read_manifest(root)
    except FileNotFoundError:
        unfinished = (root / _WORK).is_dir()
        return [f"{root}: no {MANIFEST}: " + ("an unfinished bundle (finetune bundle stopped before the end: "
                                              "run it again)" if unfinished else "not a finetune bundle")]
    problems = check_files(root, manifest) + source_problems(root, manifest)
    if problems:  # nothing of a bundle whose files do not match, or that would be read unhashed, is loaded
        return problems
    for src in manifest.get("sources", []):
        problems += _check_model(root, src) if src["kind"] == "model" else _check_dataset(root, src)
    return problems
