"""A bundle's manifest: every file's size and SHA-256, written last, checked offline.

A bundle (``finetune bundle``, :mod:`finetune.bundle`) is a folder that crosses the air gap::

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
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

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


def bundle_files(root: Path) -> list[str]:
    """The bundle's files the manifest covers, as sorted POSIX paths relative to ``root``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root)
            if _counted(rel):
                found.append(rel.as_posix())
    return sorted(found)


def file_entries(root: Path) -> dict[str, dict]:
    """``{path: {"size": bytes, "sha256": hex}}`` of every file of :func:`bundle_files` (each file read whole)."""
    return {rel: {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
            for rel in bundle_files(root)}


def write_manifest(root: Path, manifest: dict) -> Path:
    """Write ``root/MANIFEST.json`` atomically (a temporary file renamed over it); returns its path."""
    path = root / MANIFEST
    tmp = root / ".finetune-bundle" / (MANIFEST + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(root: Path) -> dict:
    """The parsed ``root/MANIFEST.json``.

    Raises:
        FileNotFoundError: no manifest (not a bundle, or an unfinished one).
        ValueError: not JSON, or not a finetune bundle manifest of a known format.
    """
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: not a finetune bundle manifest (format {FORMAT} with a 'files' table)")
    return manifest


def check_files(root: Path, manifest: dict) -> list[str]:
    """One line per file that is missing, of another size, corrupt (SHA-256 differs) or extra (not in the
    manifest), naming its path relative to ``root``; empty when every file matches."""
    problems = []
    listed = manifest["files"]
    for rel, entry in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"missing: {rel} (listed in {MANIFEST}, {entry['size']} bytes)")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"corrupt: {rel} is {path.stat().st_size} bytes, the manifest says {entry['size']}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"corrupt: {rel}: SHA-256 differs from the manifest (a changed or damaged file)")
    problems += [f"extra: {rel} is not in {MANIFEST}" for rel in bundle_files(root) if rel not in listed]
    return problems
