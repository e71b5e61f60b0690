"""Issue 51 item 5: ``finetune bundle`` takes what a local model needs and nothing through a link out of its folder,
``finetune verify`` reads nothing it has not hashed. Real symbolic links (and a named pipe) in ``tmp_path``, a 1 KiB
safetensors model, in this process: a second or two each."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from finetune.commands.bundle import main as bundle_main
from finetune.commands.verify import main as verify_main

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "models" / "tiny-gpt2"


@pytest.fixture(autouse=True)
def offline_env(monkeypatch):
    """``finetune verify`` sets the HF offline variables; monkeypatch restores them after each test."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


def _model(folder: Path) -> Path:
    """A GPT-2 model folder: config.json, a 1 KiB model.safetensors and the tiny GPT-2 tokenizer files."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
                                                    "vocab_size": 50257, "n_positions": 16}))
    save_file({"wte": torch.zeros(16, 8), "wpe": torch.ones(16, 8)}, str(folder / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def _files(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in (out / "models").rglob("*") if p.is_file())


def _outside(tmp_path: Path) -> Path:
    """A stand-in for /etc: a folder outside the model with files that must never travel."""
    etc = tmp_path / "host" / "etc"
    etc.mkdir(parents=True)
    (etc / "shadow").write_text("root:$6$secret:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    return etc


def test_bundle_takes_what_the_model_needs_and_no_link_out(tmp_path, capsys):
    model = _model(tmp_path / "src" / "tiny")
    etc = _outside(tmp_path)
    (model / "etc_link").symlink_to(etc, target_is_directory=True)  # the etc_link -> /etc
    (model / "host_shadow").symlink_to(etc / "shadow")
    out = tmp_path / "b"
    assert bundle_main([str(out), "--model", str(model)]) == 0
    for f in out.rglob("*"):
        assert not f.is_symlink() and "shadow" not in f.name and b"$6$secret" not in (f.read_bytes() if f.is_file()
                                                                                       else b""), f
    assert _files(out) == [f"models/tiny/{n}" for n in (
        "config.json", "merges.txt", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.json")]
    assert (f"model tiny: left out 2 entries of {model}: etc_link/ (a link to {etc}; not a model folder), host_shadow "
            f"(a link to {etc / 'shadow'}; not a model file)") in capsys.readouterr().err

    # only the model's files: other folders, a pipe behind a JSON name (never opened: a read would block) are left
    # out; a link inside the folder and a file a shard index names are taken
    (model / "notes").mkdir()
    (model / "notes" / "todo.txt").write_text("my notes")
    os.mkfifo(model / "pipe.json")
    (model / "chat").mkdir()
    (model / "chat" / "template.jinja").write_text("{{ messages }}")
    (model / "chat_template.jinja").symlink_to("chat/template.jinja")
    (model / "part-extra").write_bytes((model / "model.safetensors").read_bytes())
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"wte": "model.safetensors", "wpe": "part-extra"}}))
    assert bundle_main([str(out), "--model", str(model)]) == 0
    err = capsys.readouterr().err
    assert _files(out) == [f"models/tiny/{n}" for n in (
        "chat_template.jinja", "config.json", "merges.txt", "model.safetensors", "model.safetensors.index.json",
        "part-extra", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json")]
    assert not (out / "models/tiny/chat_template.jinja").is_symlink()
    assert (out / "models/tiny/chat_template.jinja").read_text() == "{{ messages }}"
    assert (f"model tiny: left out 5 entries of {model}: chat/ (not a model folder), etc_link/ (a link to {etc}; not "
            f"a model folder), host_shadow (a link to {etc / 'shadow'}; not a model file), notes/ (not a model "
            "folder), pipe.json (not a regular file)") in err
    assert verify_main([str(out)]) == 0

    # a file the model needs, linked out of the folder: refused in one line, nothing copied, no manifest
    shared = tmp_path / "shared" / "vocab.json"
    shared.parent.mkdir()
    shutil.move(model / "vocab.json", shared)
    (model / "vocab.json").symlink_to(shared)
    fresh = tmp_path / "b2"
    assert bundle_main([str(fresh), "--model", str(model)]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert lines == [f"finetune: error: model tiny: link vocab.json -> {shared} leaves the model folder {model}; a "
                     "bundle takes nothing from outside the folder it is given: copy the file into the folder (or "
                     "remove the link), or pass --follow-links to copy what such links point to"]
    assert not (fresh / "models").exists() and not (fresh / "MANIFEST.json").exists()

    # --follow-links: copied by content, and said so; the stand-in for /etc still stays out (not a model file)
    assert bundle_main([str(fresh), "--model", str(model), "--follow-links"]) == 0
    err = capsys.readouterr().err
    assert (f"model tiny: link vocab.json -> {shared}: outside the model folder, followed (--follow-links): copied "
            "by content") in err
    assert (fresh / "models/tiny/vocab.json").read_bytes() == shared.read_bytes()
    assert not list(fresh.rglob("*shadow*"))

    # a Hugging Face cache snapshot: its files link to ../../blobs/<hash>, outside the snapshot folder but inside its
    # repo's cache: taken without --follow-links, in one line
    repo = tmp_path / "hub" / "models--acme--tiny"
    source = _model(tmp_path / "plain")
    snapshot = repo / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    cached = tmp_path / "b3"
    assert bundle_main([str(cached), "--model", str(snapshot)]) == 0
    assert "model tiny: 7 files are links into the Hugging Face cache's blobs: copied by content" in \
        capsys.readouterr().err
    assert [p.split("/")[-1] for p in _files(cached)] == sorted(f.name for f in source.iterdir())
    assert json.loads((cached / "MANIFEST.json").read_text())["sources"][0]["resolved_revision"] == "ab" * 20


def test_bundle_rerun_removes_what_an_earlier_bundle_took(tmp_path, capsys):
    """A bundle made before the fix holds ``etc_link/shadow``: the re-run removes it (named) and verify passes."""
    model = _model(tmp_path / "src" / "tiny")
    out = tmp_path / "b"
    assert bundle_main([str(out), "--model", str(model)]) == 0
    old = out / "models/tiny/etc_link/shadow"
    old.parent.mkdir()
    old.write_text("root:$6$secret")
    capsys.readouterr()
    assert bundle_main([str(out), "--model", str(model)]) == 0
    assert "model tiny: removed 1 file(s) of an earlier bundle run that are no longer taken: etc_link/shadow" in \
        capsys.readouterr().err
    assert not old.exists() and "models/tiny/etc_link/shadow" not in json.loads((out / "MANIFEST.json").read_text())[
        "files"]


def _bundle(tmp_path: Path) -> Path:
    out = tmp_path / "b"
    assert bundle_main([str(out), "--model", str(_model(tmp_path / "src" / "tiny")), "--dataset",
                        str(ROOT / "data/sst2")]) == 0
    return out


def _edit(out: Path, edit) -> None:
    m = json.loads((out / "MANIFEST.json").read_text())
    edit(m)
    (out / "MANIFEST.json").write_text(json.dumps(m))


def _verify(out: Path, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = verify_main([str(out)])
    return code, [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def test_verify_reads_no_source_outside_what_it_hashed(tmp_path, capsys):
    out = _bundle(tmp_path)
    elsewhere = _model(tmp_path / "elsewhere" / "tiny")  # loads fine: only the hash could tell it is not the bundle's
    fix = "(a damaged or edited MANIFEST.json: copy it again from where the bundle was made)"

    # a source under runs/ (never hashed) that links elsewhere
    (out / "runs").mkdir()
    (out / "runs" / "tiny").symlink_to(elsewhere, target_is_directory=True)
    _edit(out, lambda m: m["sources"][0].update(path="runs/tiny"))
    code, err = _verify(out, capsys)
    assert code == 1 and err[0] == (
        "source model tiny: its path runs/tiny is where the manifest hashes nothing (.finetune-bundle, MANIFEST.json, "
        f"run_config.yaml, runs, .cache/huggingface): its files would be read unchecked; sources live under models/ or "
        f"data/ {fix}"), err

    # under a .cache/huggingface folder of the model (never hashed either)
    cache = out / "models/tiny/.cache/huggingface"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text((elsewhere / "config.json").read_text())
    _edit(out, lambda m: m["sources"][0].update(path="models/tiny/.cache/huggingface"))
    code, err = _verify(out, capsys)
    assert code == 1 and err[0].startswith("source model tiny: its path models/tiny/.cache/huggingface is where the "
                                           "manifest hashes nothing"), err

    # a source folder that is not there: no model is said to load
    _edit(out, lambda m: m["sources"][0].update(path="models/gone"))
    code, err = _verify(out, capsys)
    assert code == 1 and err[0] == "source model tiny: its folder models/gone is not in the bundle", err
    _edit(out, lambda m: m["sources"][0].update(path="models/tiny"))
    assert _verify(out, capsys)[0] == 0

    # a dataset split file that the manifest does not hash: a link under runs/ to a parquet file elsewhere
    (out / "runs" / "train.parquet").symlink_to(ROOT / "data/sst2/train.parquet")

    def point_train_outside(m):
        sst2 = next(s for s in m["sources"] if s["name"] == "sst2")
        sst2["splits"]["train"]["files"] = ["runs/train.parquet"]
    _edit(out, point_train_outside)
    code, err = _verify(out, capsys)
    assert code == 1 and err[0] == ("source dataset sst2: split 'train' reads runs/train.parquet, which is not in "
                                    f"MANIFEST.json (not hashed) {fix}"), err
