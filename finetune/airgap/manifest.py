"""A bundle's manifest: every file's size and SHA-256, written last, checked offline.

A bundle (``finetune bundle``, :mod:`finetune.airgap.bundle`) is a folder that crosses the air gap::

    OUT/MANIFEST.json        {"format": 1, "finetune_version", "created", "sources": [...], "files": {path: {size, sha256}}}
    OUT/models/<name>/       configs, tokenizers, safetensors weights
    OUT/data/<name>/<split>-NNNNN.parquet
    OUT/wheels/              (optional) finetune and its dependencies
    OUT/ds_configs/, OUT/run_config.yaml

``MANIFEST.json`` is written only once everything is in place (atomically, by rename), and removed at the start
of a re-run: a folder without it is an unfinished bundle. Not hashed (and never called extra): the manifest
itself, ``run_config.yaml`` (a starting point to edit), ``runs/`` (training runs started from the bundle),
``.finetune-bundle/`` (the maker's own state) and the download metadata ``huggingface_hub`` keeps in
``.cache/huggingface/`` folders. The hash is SHA-256, the same as the Hub's LFS object ids.

A bundle holds real files only: every path of the manifest is relative to the bundle folder and stays inside it
(no absolute path, no ``..``), and a symbolic link inside the bundle is a problem, never followed (its target
could be anything on the cluster). A source's folder must lie where the manifest hashes (not under ``runs/`` or a
cache, not through a link) and a dataset's split files must be listed (:func:`source_problems`): ``verify`` reads
nothing it has not hashed. Weights are checked beyond their hash: :func:`weights_problems` reads every
safetensors header and shard index of a model folder (bundle, verify and doctor share it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from finetune.errors import ConfigError

MANIFEST = "MANIFEST.json"
FORMAT = 1
UNHASHED_TOP = {MANIFEST, "run_config.yaml", "runs", ".finetune-bundle"}
"""Top-level names of a bundle outside the manifest (see the module docstring)."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB chunks (memory does not grow with the file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _counted(rel: Path) -> bool:
    if rel.parts[0] in UNHASHED_TOP:
        return False
    return not any(a == ".cache" and b == "huggingface" for a, b in zip(rel.parts, rel.parts[1:]))


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """(files, symbolic links) of the bundle the manifest covers, sorted POSIX paths relative to ``root``; a link to
    a folder is listed and not entered, the folders outside the manifest are not entered at all."""
    files, links = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        entered = []
        for name in sorted(dirnames):
            rel = (here / name).relative_to(root)
            if not _counted(rel):
                continue
            if (here / name).is_symlink():
                links.append(rel.as_posix())
            else:
                entered.append(name)
        dirnames[:] = entered
        for name in filenames:
            rel = (here / name).relative_to(root)
            if _counted(rel):
                (links if (here / name).is_symlink() else files).append(rel.as_posix())
    return sorted(files), sorted(links)


def bundle_files(root: Path) -> list[str]:
    """The bundle's files the manifest covers, as sorted POSIX paths relative to ``root`` (symbolic links left out:
    see :func:`bundle_links`)."""
    return _walk(root)[0]


def bundle_links(root: Path) -> list[str]:
    """The symbolic links (to files or folders) where the manifest's files live, as sorted POSIX paths relative to
    ``root``; a bundle should have none."""
    return _walk(root)[1]


def file_entries(root: Path) -> dict[str, dict]:
    """``{path: {"size": bytes, "sha256": hex}}`` of every file of :func:`bundle_files` (each file read whole).

    Raises:
        ConfigError: a symbolic link in the bundle (a bundle holds real files only).
    """
    files, links = _walk(root)
    if links:
        raise ConfigError(f"{root / links[0]}: a symbolic link inside the bundle; a bundle holds real files only: "
                          "remove it (finetune bundle copies what links point to)")
    return {rel: {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)} for rel in files}


def manifest_sha256(root: Path) -> str:
    """Hex SHA-256 of ``root/MANIFEST.json`` itself: bundle and verify print it, so that the manifest checked on the
    cluster can be compared with the one written on the connected machine."""
    return sha256_file(root / MANIFEST)


def write_manifest(root: Path, manifest: dict) -> Path:
    """Write ``root/MANIFEST.json`` atomically (a temporary file renamed over it); returns its path."""
    path = root / MANIFEST
    tmp = root / ".finetune-bundle" / (MANIFEST + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def inside(rel: object) -> bool:
    """True when ``rel`` is a POSIX path relative to a bundle that stays inside it: a non-empty string, not
    absolute, without ``.``, ``..`` or empty parts."""
    return isinstance(rel, str) and bool(rel) and "\0" not in rel and not rel.startswith("/") and \
        all(part not in ("", ".", "..") for part in rel.split("/"))


_HEX = set("0123456789abcdef")


def _shape_problems(manifest: dict) -> list[str]:
    """What is wrong with the entries of a parsed manifest, one line per entry (empty when all are well-formed)."""
    problems = []
    for rel, entry in manifest["files"].items():
        if not inside(rel):
            problems.append(f"files entry '{rel}': not a path inside the bundle (absolute paths and '..' are "
                            "refused: the manifest names files relative to its folder)")
        elif not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                  and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
                  and set(entry["sha256"]) <= _HEX):
            problems.append(f"files entry '{rel}': {json.dumps(entry)[:80]} is not "
                            '{"size": bytes, "sha256": 64 hex digits}')
    sources = manifest.get("sources", [])
    if not isinstance(sources, list):
        return problems + [f"sources: {json.dumps(sources)[:80]} is not a list of sources"]
    for i, src in enumerate(sources):
        if not isinstance(src, dict):
            problems.append(f"sources[{i}]: {json.dumps(src)[:80]} is not an object with kind, name and path")
            continue
        label = f"sources[{i}]" + (f" ({src['kind']} {src['name']})" if isinstance(src.get("kind"), str)
                                   and isinstance(src.get("name"), str) else "")
        if src.get("kind") not in ("model", "dataset"):
            problems.append(f"{label}: kind {json.dumps(src.get('kind'))} is not 'model' or 'dataset'")
        elif not isinstance(src.get("name"), str) or not src["name"]:
            problems.append(f"{label}: no 'name'")
        elif "path" not in src:
            problems.append(f"{label}: no 'path' (the source's folder in the bundle, e.g. models/<name>)")
        elif not inside(src["path"]):
            problems.append(f"{label}: path {src['path']!r} is not a path inside the bundle")
        elif src["kind"] == "dataset":
            splits = src.get("splits", {})
            if not isinstance(splits, dict):
                problems.append(f"{label}: splits {json.dumps(splits)[:80]} is not {{split: {{rows, columns, "
                                "files}}}")
                continue
            for split, info in splits.items():
                if not (isinstance(info, dict) and type(info.get("rows")) is int
                        and isinstance(info.get("columns"), list) and isinstance(info.get("files"), list)):
                    problems.append(f"{label}: split '{split}': {json.dumps(info)[:80]} is not "
                                    "{rows, columns, files}")
                elif not all(inside(f) for f in info["files"]):
                    bad = next(f for f in info["files"] if not inside(f))
                    problems.append(f"{label}: split '{split}': file {json.dumps(bad)} is not a path inside the "
                                    "bundle")
    if not isinstance(manifest.get("install"), (str, type(None))):
        problems.append(f"install: {json.dumps(manifest['install'])[:80]} is not a command or null")
    return problems


def read_manifest(root: Path) -> dict:
    """The parsed ``root/MANIFEST.json``, every entry of the expected shape and every path inside ``root``.

    Raises:
        FileNotFoundError: no manifest (not a bundle, or an unfinished one).
        ConfigError: not JSON, not a finetune bundle manifest of a known format, or entries of the wrong shape or
            outside the bundle (one line per entry, naming it).
    """
    path = root / MANIFEST
    fix = f"(a damaged or edited {MANIFEST}: copy it again from where the bundle was made)"
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}) {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ConfigError(f"{path}: not a finetune bundle manifest (format {FORMAT} with a 'files' table) {fix}")
    problems = _shape_problems(manifest)
    if problems:
        raise ConfigError([f"{path}: {p} {fix}" for p in problems])
    return manifest


def _link_on_the_way(root: Path, rel: str) -> str | None:
    """The first symbolic link among ``rel``'s path components below ``root`` (as a path relative to it), else
    ``None``."""
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        if (root.joinpath(*parts[:i])).is_symlink():
            return "/".join(parts[:i])
    return None


def check_files(root: Path, manifest: dict) -> list[str]:
    """One line per file that is missing, of another size, corrupt (SHA-256 differs) or extra (not in the
    manifest), and per symbolic link (to a file or a folder, listed or not: a bundle holds real files only, and
    the files under a link are not checked), naming its path relative to ``root``; empty when every file matches.

    ``manifest`` comes from :func:`read_manifest` (its paths are inside ``root``).
    """
    problems = []
    listed = manifest["files"]
    files, links = _walk(root)
    links = set(links)
    for rel, entry in sorted(listed.items()):
        path = root / rel
        link = _link_on_the_way(root, rel)
        if link is not None:
            links.add(link)
        elif not path.is_file():
            problems.append(f"missing: {rel} (listed in {MANIFEST}, {entry['size']} bytes)")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"corrupt: {rel} is {path.stat().st_size} bytes, the manifest says {entry['size']}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"corrupt: {rel}: SHA-256 differs from the manifest (a changed or damaged file)")
    problems += [f"link: {rel} is a symbolic link (to {os.readlink(root / rel)}): a bundle holds real files only; "
                 "copy what it points to (cp -rL, rsync -L)" for rel in sorted(links)]
    problems += [f"extra: {rel} is not in {MANIFEST}" for rel in files if rel not in listed]
    return problems


def source_problems(root: Path, manifest: dict) -> list[str]:
    """One line per source of the manifest whose files ``verify`` would read without a hash check, naming it; empty
    when each source's folder is a real folder (no symbolic link on the way, resolved inside ``root``) under the part
    of the bundle the manifest hashes (not ``runs/``, ``.finetune-bundle/``, a ``.cache/huggingface/`` folder: see
    the module docstring), holds files the manifest lists, and every file of a dataset's splits is listed.

    ``manifest`` comes from :func:`read_manifest` (every path is relative and without ``..``); the files themselves
    are checked by :func:`check_files`.
    """
    problems, real_root = [], root.resolve()
    listed = manifest["files"]
    for src in manifest.get("sources", []):
        label, rel = f"source {src['kind']} {src['name']}", src["path"]
        fix = f"(a damaged or edited {MANIFEST}: copy it again from where the bundle was made)"
        if not _counted(Path(rel)):
            problems.append(f"{label}: its path {rel} is where the manifest hashes nothing ({', '.join(sorted(UNHASHED_TOP))}"
                            f", .cache/huggingface): its files would be read unchecked; sources live under models/ "
                            f"or data/ {fix}")
            continue
        link = _link_on_the_way(root, rel)
        if link is not None:
            problems.append(f"{label}: {link} is a symbolic link (to {os.readlink(root / link)}): its files would be "
                            "read from outside the bundle; copy what it points to (cp -rL, rsync -L)")
            continue
        folder = root / rel
        if not _inside_real((folder).resolve(), real_root):
            problems.append(f"{label}: {rel} resolves to {folder.resolve()}, outside the bundle")
            continue
        if not folder.is_dir():
            problems.append(f"{label}: its folder {rel} is not in the bundle{' (a file)' if folder.exists() else ''}")
            continue
        if not any(f.startswith(rel + "/") for f in listed):
            problems.append(f"{label}: no file under {rel} is in {MANIFEST}: nothing of it is hashed {fix}")
            continue
        for split, info in src.get("splits", {}).items() if src["kind"] == "dataset" else ():
            unlisted = [f for f in info["files"] if f not in listed]
            if unlisted:
                problems.append(f"{label}: split '{split}' reads {unlisted[0]}, which is not in {MANIFEST} (not "
                                f"hashed){f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''} {fix}")
    return problems


def _inside_real(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


SAFETENSORS_MAX_HEADER = 100_000_000
"""The largest header safetensors itself reads (bytes)."""

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
                "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def safetensors_header(path: Path) -> dict:
    """The tensors of a safetensors file, ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, read from
    its header only (8-byte little-endian header length, then that many bytes of JSON), after the checks the
    safetensors loader makes: the header fits in the file, every tensor's byte range is ``dtype size x shape``,
    the ranges follow each other from byte 0 and end exactly at the end of the file.

    Raises:
        ValueError: what is wrong, in one phrase without the path (a truncated file: its size and the size its
            header describes).
        OSError: the file cannot be read.
    """
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{size} bytes: too short for a safetensors header (an empty or truncated file)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > SAFETENSORS_MAX_HEADER:
            raise ValueError(f"header length {n:,} bytes, more than safetensors reads (not a safetensors file)")
        if n > size - 8:
            raise ValueError(f"header length {n:,} bytes, but only {size - 8:,} bytes follow (truncated, or not a "
                             "safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("the header is not JSON (not a safetensors file)") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object (not a safetensors file)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for name, t in tensors.items():
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        shape = t.get("shape") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1] and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape) and isinstance(t.get("dtype"), str)):
            raise ValueError(f"tensor '{name}': {json.dumps(t)[:80]} is not {{dtype, shape, data_offsets}} (a "
                             "damaged header)")
        spans.append((offsets[0], offsets[1], name, t["dtype"], shape))
    end = 8 + n + max((e for _, e, *_ in spans), default=0)
    if end > size:
        raise ValueError(f"truncated: {size:,} bytes, its header says {end:,} (copy it again)")
    at = 0
    for begin, stop, name, dtype, shape in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor '{name}' starts at data byte {begin:,}, expected {at:,} (overlapping or "
                             "gapped tensors: a damaged header)")
        if dtype in _DTYPE_BYTES and stop - begin != _DTYPE_BYTES[dtype] * math.prod(shape):
            raise ValueError(f"tensor '{name}': {stop - begin:,} bytes for {dtype} {shape} (a damaged header)")
        at = stop
    if end < size:
        raise ValueError(f"{size - end:,} bytes past the last tensor its header describes (a damaged file)")
    return tensors


def weights_problems(folder: Path) -> list[str]:
    """What is wrong with the safetensors weights of a model folder, one line per problem naming the file (empty
    when every file is whole): each ``*.safetensors`` file's header (:func:`safetensors_header`), and each
    ``*.safetensors.index.json`` shard index: JSON with a ``weight_map`` of tensor -> shard file, every shard a file
    of the folder that holds the tensors it is named for. Reads headers only, never the tensors.
    """
    problems, headers = [], {}
    for f in sorted(folder.glob("*.safetensors")):
        if not f.is_file():
            continue
        try:
            headers[f.name] = safetensors_header(f)
        except (ValueError, OSError) as e:
            problems.append(f"{f.name}: {e}")
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            problems.append(f"{index.name}: not a JSON object ({e}): a damaged shard index")
            continue
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            problems.append(f"{index.name}: no 'weight_map' of tensor name -> shard file: a damaged shard index")
            continue
        reported = set()
        for tensor, shard in weight_map.items():
            if shard in reported:
                continue
            if not shard or "/" in shard or shard in (".", ".."):
                problems.append(f"{index.name}: shard '{shard}' (tensor '{tensor}') is not a file name in the model "
                                "folder")
            elif not (folder / shard).is_file():
                problems.append(f"{index.name}: shard '{shard}' (tensor '{tensor}') does not exist")
            elif shard in headers and tensor not in headers[shard]:
                problems.append(f"{index.name}: tensor '{tensor}' is not in shard '{shard}'")
            else:
                continue
            reported.add(shard)
    return problems
