"""``finetune bundle``, ``verify`` and ``doctor`` on hostile or damaged input: code in a bundle, MANIFEST.json entries
of the wrong shape or outside the bundle, symbolic links, truncated safetensors, output folders that cannot be
written, ``--model ..``. All in-process on tiny real files (a 1 KiB safetensors model), each well under a second
or two."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from finetune.commands.bundle import main as bundle_main
from finetune.commands.doctor import main as doctor_main
from finetune.commands.verify import main as verify_main
from finetune.airgap.manifest import file_entries, weights_problems

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ROOT / "tests" / "configs" / "tiny_gpt.yaml"


@pytest.fixture(autouse=True)
def offline_env(monkeypatch):
    """``finetune verify`` sets the HF offline variables; monkeypatch restores them after each test."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


def _model(parent: Path, name: str = "tiny", rows: int = 64) -> Path:
    """A model folder: a GPT-2 config.json and a ``rows`` x 4 fp32 model.safetensors (no tokenizer)."""
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
                                                    "vocab_size": 16, "n_positions": 16}))
    save_file({"wte": torch.zeros(rows, 4), "wpe": torch.ones(4, 4)}, str(folder / "model.safetensors"))
    return folder


def _bundle(tmp_path: Path, model: Path | None = None, *extra: str) -> Path:
    out = tmp_path / "b"
    assert bundle_main([str(out), "--model", str(model or _model(tmp_path / "src")), *extra]) == 0
    return out


def _edit_manifest(out: Path, edit) -> None:
    m = json.loads((out / "MANIFEST.json").read_text())
    edit(m)
    (out / "MANIFEST.json").write_text(json.dumps(m))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# item 9: verify never runs a bundle's code and stops at file problems

def test_verify_never_imports_bundle_code(tmp_path, capsys):
    model = _model(tmp_path / "src")
    marker = tmp_path / "code-ran"
    (model / "configuration_marker.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\nclass MarkerConfig(PretrainedConfig):\n"
        "    model_type = 'marker'\n")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "marker",
                                                   "auto_map": {"AutoConfig": "configuration_marker.MarkerConfig"}}))
    out = _bundle(tmp_path, model, "--trust-remote-code")
    assert (out / "models/tiny/configuration_marker.py").is_file()
    assert json.loads((out / "MANIFEST.json").read_text())["sources"][0]["trust_remote_code"] is True
    capsys.readouterr()
    assert verify_main([str(out)]) == 0, capsys.readouterr().err
    assert not marker.exists()  # the manifest's trust_remote_code is not a licence to run the bundle's code


def test_verify_stops_at_file_problems(tmp_path, capsys):
    out = _bundle(tmp_path)
    (out / "models/tiny/config.json").write_text("{not json")
    capsys.readouterr()
    assert verify_main([str(out)]) == 1
    err = _errors(capsys)
    assert len(err) == 2 and err[0].startswith("corrupt: models/tiny/config.json is 9 bytes"), err
    assert err[1] == f"finetune verify: 1 problem(s) in {out}"  # nothing loaded after a file problem


def test_verify_reads_config_as_json(tmp_path, capsys):
    model = _model(tmp_path / "src")
    (model / "config.json").write_text("[1, 2]")
    out = _bundle(tmp_path, model)
    capsys.readouterr()
    assert verify_main([str(out)]) == 1
    assert _errors(capsys)[0] == "model tiny: config.json is not a JSON object (a Hugging Face config is one)"


# item 10: paths and links confined to the bundle; the manifest's own SHA-256 printed on both sides

def test_manifest_paths_outside_the_bundle_refused(tmp_path, capsys):
    out = _bundle(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    entry = {"size": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    for rel in ("../secret.txt", str(secret), "models/../../secret.txt"):
        _edit_manifest(out, lambda m: m["files"].update({rel: entry}))
        capsys.readouterr()
        assert verify_main([str(out)]) == 2, rel
        err = _errors(capsys)
        assert len(err) == 1 and err[0].startswith(f"finetune: error: {out / 'MANIFEST.json'}: files entry "
                                                   f"'{rel}': not a path inside the bundle"), err
        _edit_manifest(out, lambda m: m["files"].pop(rel))
    _edit_manifest(out, lambda m: m["sources"][0].update(path="../src/tiny"))
    assert verify_main([str(out)]) == 2
    assert "sources[0] (model tiny): path '../src/tiny' is not a path inside the bundle" in capsys.readouterr().err


def test_links_inside_the_bundle_reported(tmp_path, capsys):
    out = _bundle(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("hidden")
    (out / "models/tiny/more").symlink_to(elsewhere, target_is_directory=True)  # its files: never hashed before
    capsys.readouterr()
    assert verify_main([str(out)]) == 1
    err = _errors(capsys)
    assert err[0] == (f"link: models/tiny/more is a symbolic link (to {elsewhere}): a bundle holds real files only; "
                      "copy what it points to (cp -rL, rsync -L)"), err
    (out / "models/tiny/more").unlink()

    weights = out / "models/tiny/model.safetensors"
    copy = tmp_path / "copy.safetensors"
    shutil.copy(weights, copy)
    weights.unlink()
    weights.symlink_to(copy)  # same bytes, but outside the bundle
    assert verify_main([str(out)]) == 1
    assert _errors(capsys)[0].startswith("link: models/tiny/model.safetensors is a symbolic link (to ")


def test_manifest_sha256_printed_by_bundle_and_verify(tmp_path, capsys):
    out = _bundle(tmp_path)
    digest = hashlib.sha256((out / "MANIFEST.json").read_bytes()).hexdigest()
    assert f"MANIFEST.json SHA-256 {digest}" in capsys.readouterr().err
    assert verify_main([str(out)]) == 0
    assert f"MANIFEST.json SHA-256 {digest}" in capsys.readouterr().out


# item 21: safetensors headers and shard indexes checked by bundle, verify and doctor (one function)

def test_weights_problems_reads_headers(tmp_path):
    model = _model(tmp_path)
    assert weights_problems(model) == []
    assert weights_problems(ROOT / "data/models/tiny-gpt2") == []
    size = (model / "model.safetensors").stat().st_size
    _truncate(model / "model.safetensors", size - 10)
    assert weights_problems(model) == [f"model.safetensors: truncated: {size - 10:,} bytes, its header says "
                                       f"{size:,} (copy it again)"]
    _truncate(model / "model.safetensors", 5)
    assert weights_problems(model) == ["model.safetensors: 5 bytes: too short for a safetensors header "
                                       "(an empty or truncated file)"]
    (model / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    assert weights_problems(model) == ["model.safetensors: header length 1,000,000 bytes, but only 2 bytes "
                                       "follow (truncated, or not a safetensors file)"]
    (model / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"[1] ")
    assert weights_problems(model) == ["model.safetensors: the header is not a JSON object (not a safetensors "
                                       "file)"]


def test_bundle_and_verify_refuse_truncated_weights(tmp_path, capsys):
    model = _model(tmp_path / "src")
    good = (model / "model.safetensors").read_bytes()
    _truncate(model / "model.safetensors", len(good) - 100)
    assert bundle_main([str(tmp_path / "b"), "--model", str(model)]) == 2
    err = _errors(capsys)
    assert err[-1] == (f"finetune: error: --model {model}: model.safetensors: truncated: {len(good) - 100:,} bytes, "
                       f"its header says {len(good):,} (copy it again)"), err
    assert not (tmp_path / "b/MANIFEST.json").exists()

    (model / "model.safetensors").write_bytes(good)
    out = _bundle(tmp_path, model)
    _truncate(out / "models/tiny/model.safetensors", len(good) - 100)
    _edit_manifest(out, lambda m: m.update(files=file_entries(out)))  # a manifest that agrees with the damage
    capsys.readouterr()
    assert verify_main([str(out)]) == 1
    assert _errors(capsys)[0].startswith("model tiny: model.safetensors: truncated: ")


def test_shard_index_names_missing_shard(tmp_path, capsys):
    model = _model(tmp_path / "src")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "wte": "model-00001-of-00002.safetensors", "wpe": "model-00002-of-00002.safetensors"}}))
    assert bundle_main([str(tmp_path / "b"), "--model", str(model)]) == 2
    assert _errors(capsys)[-1] == (f"finetune: error: --model {model}: model.safetensors.index.json: shard "
                                   "'model-00002-of-00002.safetensors' (tensor 'wpe') does not exist")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "wte": "model-00001-of-00002.safetensors", "lm_head": "model-00001-of-00002.safetensors"}}))
    assert weights_problems(model) == ["model.safetensors.index.json: tensor 'lm_head' is not in shard "
                                       "'model-00001-of-00002.safetensors'"]
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte": "../x.safetensors"}}))
    assert weights_problems(model) == ["model.safetensors.index.json: shard '../x.safetensors' (tensor 'wte') is not "
                                       "a file name in the model folder"]


def test_doctor_blocks_truncated_weights(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "data/models/tiny-gpt2", model)
    size = (model / "model.safetensors").stat().st_size
    _truncate(model / "model.safetensors", size // 2)
    code = doctor_main([str(TINY_GPT), f"model.path={model}", f"output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 2, out
    fails = [line.split(None, 2)[2] for line in out.splitlines() if "  FAIL  " in line]
    assert f"model.path '{model}': model.safetensors: truncated: {size // 2:,} bytes, its header says {size:,} " \
           "(copy it again)" in fails, out


# item 22: one line, exit 2, for manifests of the wrong shape and output folders that cannot be written

@pytest.mark.parametrize("edit, entry", [
    (lambda m: m["files"].update({"models/tiny/config.json": 5}), "files entry 'models/tiny/config.json'"),
    (lambda m: m["files"].update({"models/tiny/config.json": {"size": "9"}}), "files entry 'models/tiny/config.json'"),
    (lambda m: m["sources"][0].pop("path"), "sources[0] (model tiny)"),
    (lambda m: m.update(sources=[7]), "sources[0]"),
    (lambda m: m["sources"].append({"kind": "dataset", "name": "d", "path": "data/d", "splits": {"train": 3}}),
     "sources[1] (dataset d)"),
], ids=["file-entry-int", "file-size-str", "source-without-path", "source-int", "split-int"])
def test_manifest_of_the_wrong_shape_is_one_line(tmp_path, capsys, edit, entry):
    out = _bundle(tmp_path)
    _edit_manifest(out, edit)
    capsys.readouterr()
    assert verify_main([str(out)]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"finetune: error: {out / 'MANIFEST.json'}: {entry}"), err


def test_bundle_into_a_file_or_unwritable_folder(tmp_path, capsys):
    model = _model(tmp_path / "src")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, why in ((a_file, "is a file, not a folder"), (a_file / "b", "is a file, not a folder"),
                     (Path("/proc/finetune-bundle-test"), "cannot be written")):
        assert bundle_main([str(out), "--model", str(model)]) == 2, out
        err = _errors(capsys)
        assert len(err) == 1 and err[0].startswith("finetune: error: ") and why in err[0], err

    with tempfile.TemporaryDirectory() as parent:
        Path(parent).chmod(0o755)  # reachable by the unprivileged user below
        locked = Path(parent) / "locked"
        locked.mkdir(mode=0o555)
        as_root = os.geteuid() == 0
        try:
            if as_root:  # root writes anywhere: drop to nobody for this call (the real uid stays root)
                os.setegid(65534)
                os.seteuid(65534)
            code = bundle_main([str(locked / "b"), "--model", str(model)])
        finally:
            if as_root:
                os.seteuid(0)
                os.setegid(0)
    assert code == 2
    err = _errors(capsys)
    assert len(err) == 1 and f"{locked / 'b'}: cannot be written" in err[0], err


def test_bundle_past_a_file_size_limit_is_one_line(tmp_path, capsys):
    model = _model(tmp_path / "src", rows=4096)  # a 64 KiB weights file, past the 32 KiB limit below
    out = tmp_path / "b"
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit fails with EFBIG
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, old_limit[1]))
        code = bundle_main([str(out), "--model", str(model)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert code == 2
    err = _errors(capsys)
    assert err[-1].startswith(f"finetune: error: {out / 'models/tiny/model.safetensors'}: could not be written "
                              "(File too large)"), err
    assert not (out / "MANIFEST.json").exists() and not list(out.rglob("*.partial"))
    assert verify_main([str(out)]) == 1  # an unfinished bundle, not a complete-looking one


# item 23: local models named by their real folder; what is left out said (issue 51 item 5: only what the model
# needs is taken, never through a link out of the folder: tests/test_airgap_links.py)

def test_bundle_model_dotdot_and_links(tmp_path, capsys, monkeypatch):
    model = _model(tmp_path / "src")
    (model / "work").mkdir()
    shards = tmp_path / "shared-shards"
    shards.mkdir()
    (shards / "extra.json").write_text("{}")
    (model / "shards").symlink_to(shards, target_is_directory=True)
    outside = tmp_path / "outside-notes.txt"
    outside.write_text("notes")
    (model / "notes.txt").symlink_to(outside)
    (model / "loop").symlink_to(model, target_is_directory=True)
    (model / "gone.txt").symlink_to(tmp_path / "nothing")
    out = tmp_path / "b"
    monkeypatch.chdir(model / "work")
    assert bundle_main([str(out), "--model", ".."]) == 0
    err = capsys.readouterr().err
    assert sorted(p.relative_to(out).as_posix() for p in (out / "models").rglob("*") if p.is_file()) == [
        "models/tiny/config.json", "models/tiny/model.safetensors"]
    assert not (out / "config.json").exists()
    cfg = (out / "run_config.yaml").read_text()
    assert "path: models/tiny\n" in cfg and "output_root: runs/tiny\n" in cfg
    assert (f"model tiny: left out 5 entries of {model.resolve()}: gone.txt (a link to {tmp_path / 'nothing'}; not a "
            f"model file), loop/ (a link to {model.resolve()}; not a model folder), notes.txt (a link to "
            f"{outside.resolve()}; not a model file), shards/ (a link to {shards.resolve()}; not a model folder), "
            "work/ (not a model folder)") in err


# item 19: doctor --nodes must be positive, like --world-size

@pytest.mark.parametrize("nodes", ["0", "-3"])
def test_doctor_refuses_nodes_below_one(capsys, nodes):
    assert doctor_main([str(TINY_GPT), "--nodes", nodes]) == 2
    err = _errors(capsys)
    assert err == [f"finetune: error: --nodes: must be >= 1 (the nodes of the planned launch), got {nodes}"]
