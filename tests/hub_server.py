"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for the real ``huggingface_hub`` client (``HF_ENDPOINT``).

It serves repositories from a folder, ``<root>/<models|datasets>/<org>/<name>/``, each at one commit whose id is
the SHA-1 of its files' paths and bytes (so a changed file is a new commit), and answers only the routes that
``HfApi.model_info`` / ``dataset_info`` and ``snapshot_download`` call:

* ``GET /api/{models|datasets}/{org}/{name}[/revision/{rev}]``: ``{"id", "sha", "siblings", "cardData"}``;
* ``GET /api/{models|datasets}/{org}/{name}/tree/{rev}[/{path}]``: the files (``type``, ``path``, ``size``,
  ``oid``), one page;
* ``HEAD`` / ``GET /{org}/{name}/resolve/{rev}/{file}`` and ``/datasets/{org}/{name}/resolve/{rev}/{file}``:
  the bytes with ``X-Repo-Commit``, ``ETag`` (the file's SHA-256, as for LFS files) and ``Content-Length``.

A revision is ``main`` or the commit id; anything else answers 404 with ``X-Error-Code: RevisionNotFound``, an
unknown repo 404 with ``RepoNotFound``. Requests are counted per route kind (``server.hits``) so that a test can
see which files were downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def _files(repo: Path) -> list[str]:
    return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())


def commit_of(repo: Path) -> str:
    """The commit id the server gives ``repo``: SHA-1 over its files' paths and bytes."""
    h = hashlib.sha1()
    for rel in _files(repo):
        h.update(rel.encode() + b"\0" + (repo / rel).read_bytes())
    return h.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: "HubServer"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, code: str, head: bool = False) -> None:
        self._send(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code, "Content-Type":
                                                                "application/json"}, head)

    def _repo(self, kind: str, org: str, name: str, rev: str | None) -> tuple[Path | None, str | None]:
        repo = self.server.root / kind / org / name
        if not repo.is_dir():
            return None, "RepoNotFound"
        sha = commit_of(repo)
        if rev not in (None, "main", sha):
            return None, "RevisionNotFound"
        return repo, None

    def _api(self, parts: list[str]) -> None:
        kind, org, name, rest = parts[1], parts[2], parts[3], parts[4:]
        rev = rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree") else None
        repo, err = self._repo(kind, org, name, rev)
        if err:
            return self._error(err)
        sha = commit_of(repo)
        if rest[:1] == ["tree"]:
            sub = "/".join(rest[2:])
            self.server.hits["tree"] += 1
            entries = [{"type": "file", "path": rel, "size": (repo / rel).stat().st_size,
                        "oid": hashlib.sha1((repo / rel).read_bytes()).hexdigest()}
                       for rel in _files(repo) if rel.startswith(sub)]
            return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})
        self.server.hits["info"] += 1
        card = {}
        if (repo / "README.md").is_file():  # the YAML header of the card, as the Hub returns it
            text = (repo / "README.md").read_text()
            if text.startswith("---"):
                import yaml

                card = yaml.safe_load(text.split("---")[1]) or {}
        info = {"id": f"{org}/{name}", "sha": sha, "siblings": [{"rfilename": f} for f in _files(repo)],
                "cardData": card, "private": False}
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

    def _resolve(self, parts: list[str], head: bool) -> None:
        kind = "datasets" if parts[0] == "datasets" else "models"
        parts = parts[1:] if kind == "datasets" else parts
        org, name, rev, rel = parts[0], parts[1], parts[3], "/".join(parts[4:])
        repo, err = self._repo(kind, org, name, rev)
        if err:
            return self._error(err, head)
        path = repo / rel
        if not path.is_file():
            return self._error("EntryNotFound", head)
        data = path.read_bytes()
        if not head:
            self.server.hits["download"] += 1
            self.server.downloaded.append(f"{kind}/{org}/{name}/{rel}")
        self._send(200, data, {"X-Repo-Commit": commit_of(repo), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                               "Content-Type": "application/octet-stream"}, head)

    def _route(self, head: bool) -> None:
        parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
        if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            return self._api(parts)
        if "resolve" in parts:
            return self._resolve(parts, head)
        self._error("NotFound", head)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._route(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(head=True)


class HubServer(ThreadingHTTPServer):
    """The server, on a free port of 127.0.0.1; ``url`` is the value for ``HF_ENDPOINT``."""

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.hits, self.downloaded = Path(root), Counter(), []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
