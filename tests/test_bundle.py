"""``finetune bundle`` and ``finetune verify``: local sources, a Hub stand-in speaking the Hub's protocol to the real
``huggingface_hub`` and ``datasets`` clients (tests/hub_server.py), re-runs, corruption, and (extended) wheels
installed into a fresh venv with ``--no-index`` that train from the bundle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import check_here
from hub_server import HubServer, commit_of

from finetune.commands.bundle import main as bundle_main
from finetune.commands.doctor import main as doctor_main
from finetune.commands.verify import main as verify_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "models" / "tiny-gpt2"


@pytest.fixture
def offline_env(monkeypatch):
    """``finetune verify`` sets the HF offline variables; monkeypatch restores them after the test."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


def _sources(tmp: Path) -> dict[str, Path]:
    """A model folder with a pickle and a Python file beside its safetensors, and data in four forms."""
    import datasets

    model = tmp / "src" / "tiny-gpt2"
    shutil.copytree(TINY, model)
    (model / "pytorch_model.bin").write_bytes(b"pickled")
    (model / "modeling_evil.py").write_text("import os\n")
    (model / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    disk = tmp / "src" / "saved"
    datasets.Dataset.from_dict({"text": ["a b", "c d", "e"], "label": ["x", "y", "x"]}).save_to_disk(str(disk))
    jsonl = tmp / "src" / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(5)))
    csv = tmp / "src" / "table.csv"
    csv.write_text("text,label\nhello,1\nworld,0\n")
    return {"model": model, "parquet": ROOT / "data" / "sst2", "disk": disk, "jsonl": jsonl, "csv": csv}


def test_bundle_local_sources_rerun_corruption(tmp_path, capsys, offline_env, monkeypatch):
    src = _sources(tmp_path)
    out = tmp_path / "bundle"
    argv = [str(out), "--model", str(src["model"]), "--dataset", str(src["parquet"]), "--dataset", str(src["disk"]),
            "--dataset", str(src["jsonl"]), "--dataset", str(src["csv"]), "--max-shard-size", "64KB"]
    assert bundle_main(argv) == 0
    m = json.loads((out / "MANIFEST.json").read_text())
    # every file hashed; no pickle, no Python file from the model folder
    for rel, entry in m["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == entry["sha256"], rel
    assert "models/tiny-gpt2/model.safetensors" in m["files"]
    assert not list((out / "models").rglob("*.bin")) and not list((out / "models").rglob("*.py"))
    by_name = {s["name"]: s for s in m["sources"]}
    assert by_name["tiny-gpt2"]["license"] == "mit" and by_name["tiny-gpt2"]["origin"] == "local"
    sst2 = by_name["sst2"]["splits"]
    assert sst2["train"]["rows"] == 4000 and sst2["validation"]["rows"] == 872
    assert sst2["train"]["columns"] == pq.read_schema(ROOT / "data/sst2/train.parquet").names
    assert len(sst2["train"]["files"]) > 1  # 64 KB shards of ~600 KB of Arrow data
    rows = sum(pq.read_metadata(out / f).num_rows for f in sst2["train"]["files"])
    texts = [t for f in sst2["train"]["files"] for t in pq.read_table(out / f)["text"].to_pylist()]
    assert rows == 4000 and texts == pq.read_table(ROOT / "data/sst2/train.parquet")["text"].to_pylist()
    assert by_name["saved"]["splits"]["train"]["rows"] == 3
    assert by_name["pairs"]["splits"]["train"]["columns"] == ["prompt", "response"]
    assert by_name["table"]["splits"]["train"]["rows"] == 2
    cfg = (out / "run_config.yaml").read_text()
    assert "recipe: seq_cls" in cfg and "data/sst2/train-*.parquet" in cfg and "models/tiny-gpt2" in cfg

    assert verify_main([str(out)]) == 0
    assert "bundle ok: " in capsys.readouterr().out

    # the starting config passes the launch's own checks from the bundle folder (in this process)
    monkeypatch.chdir(out)
    code, printed = check_here(["--config", "run_config.yaml", "train.max_steps=2"], capsys)
    assert code == 0, printed[-2000:]

    # doctor on the bundle's config: offline settings fine, and the verify command for the bundle
    assert doctor_main(["run_config.yaml"]) == 0
    rows = [line.split(None, 2) for line in capsys.readouterr().out.splitlines() if line.startswith("offline")]
    assert rows == [["offline", "ok", "HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1"],
                    ["offline", "ok", f"from the bundle {out}: check it with  finetune verify {out}"]]
    monkeypatch.chdir(ROOT)

    # a re-run rewrites nothing that is unchanged and lists the same files
    mtimes = {rel: (out / rel).stat().st_mtime_ns for rel in m["files"]}
    assert bundle_main(argv) == 0
    m2 = json.loads((out / "MANIFEST.json").read_text())
    assert m2["files"] == m["files"]
    assert {rel: (out / rel).stat().st_mtime_ns for rel in m["files"]} == mtimes

    # corruption: each problem named, exit 1
    weights = out / "models/tiny-gpt2/model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    weights.write_bytes(bytes(blob))
    (out / "data/sst2/validation-00000.parquet").unlink()
    (out / "data/stray.txt").write_text("?")
    capsys.readouterr()
    assert verify_main([str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert sorted(err[:3]) == ["corrupt: models/tiny-gpt2/model.safetensors: SHA-256 differs from the manifest "
                       "(a changed or damaged file)",
                               "extra: data/stray.txt is not in MANIFEST.json",
                               "missing: data/sst2/validation-00000.parquet (listed in MANIFEST.json, "
                               f"{m['files']['data/sst2/validation-00000.parquet']['size']} bytes)"]
    assert err[3:] == ["finetune verify: 3 problem(s) in " + str(out)]

    # a run that fails half way leaves no manifest: verify calls the folder unfinished
    bad = tmp_path / "src" / "notes.txt"
    bad.write_text("x")
    assert bundle_main([str(out), "--dataset", str(bad)]) == 2
    assert "unknown file type '.txt'" in capsys.readouterr().err
    assert not (out / "MANIFEST.json").exists()
    assert verify_main([str(out)]) == 1
    assert "no MANIFEST.json: an unfinished bundle" in capsys.readouterr().err


def test_bundle_refuses_what_it_should(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("my notes")
    assert bundle_main([str(mine), "--dataset", str(ROOT / "data/sst2")]) == 2
    assert "not a finetune bundle and not empty" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.md"]

    pickled = tmp_path / "old-model"
    pickled.mkdir()
    shutil.copy(TINY / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"pickled")
    assert bundle_main([str(tmp_path / "b"), "--model", str(pickled)]) == 2
    assert "only pickled weights (pytorch_model.bin)" in capsys.readouterr().err
    assert bundle_main([str(tmp_path / "b"), "--model", str(pickled), "--allow-pickle"]) == 0
    assert (tmp_path / "b/models/old-model/pytorch_model.bin").is_file()


def _hub_repos(root: Path) -> None:
    model = root / "models/acme/tiny-gpt2"
    shutil.copytree(TINY, model)
    (model / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    (model / "modeling_x.py").write_text("x = 1\n")
    (model / "pytorch_model.bin").write_bytes(b"pickled")
    data = root / "datasets/acme/mini"
    (data / "data").mkdir(parents=True)
    shutil.copy(ROOT / "data/sst2/train.parquet", data / "data/train.parquet")
    shutil.copy(ROOT / "data/sst2/validation.parquet", data / "data/validation.parquet")
    shutil.copy(ROOT / "data/gsm8k/test.parquet", data / "data/math.parquet")
    (data / "README.md").write_text(
        "---\nlicense: cc-by-4.0\nconfigs:\n- config_name: sentiment\n  default: true\n  data_files:\n"
        "  - split: train\n    path: data/train.parquet\n  - split: validation\n    path: data/validation.parquet\n"
        "- config_name: math\n  data_files:\n  - split: test\n    path: data/math.parquet\n---\n# mini\n")


def test_bundle_from_hub_stand_in(tmp_path):
    _hub_repos(tmp_path / "hub")
    out = tmp_path / "bundle"
    model_sha = commit_of(tmp_path / "hub/models/acme/tiny-gpt2")
    with HubServer(tmp_path / "hub") as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT),
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.pop(var, None)

        def bundle(*args):
            return subprocess.run([sys.executable, "-m", "finetune", "bundle", str(out), *args], env=env,
                                  capture_output=True, text=True, timeout=300)

        done = bundle("--model", f"acme/tiny-gpt2@{model_sha}", "--dataset", "acme/mini", "--dataset",
                      "acme/mini:math")
        assert done.returncode == 0, done.stderr[-3000:]
        first = sorted(hub.downloaded)
        assert "models/acme/tiny-gpt2/model.safetensors" in first
        assert not [f for f in first if f.endswith((".bin", ".py"))]  # never fetched
        m = json.loads((out / "MANIFEST.json").read_text())
        by_name = {s["name"]: s for s in m["sources"]}
        assert by_name["tiny-gpt2"]["resolved_revision"] == model_sha and by_name["tiny-gpt2"]["license"] == "mit"
        assert by_name["mini"]["resolved_revision"] == commit_of(tmp_path / "hub/datasets/acme/mini")
        assert by_name["mini"]["license"] == "cc-by-4.0" and by_name["mini"]["origin"] == "hub"
        assert set(by_name["mini"]["splits"]) == {"train", "validation"}
        assert by_name["mini-math"]["splits"]["test"]["rows"] == 200
        assert by_name["mini-math"]["splits"]["test"]["columns"] == ["question", "answer"]
        assert not list((out / "models").rglob("*.bin")) and not list((out / "models").rglob("*.py"))

        hub.downloaded.clear()
        again = bundle("--model", "acme/tiny-gpt2@main", "--dataset", "acme/mini")
        assert again.returncode == 0, again.stderr[-3000:]
        assert hub.downloaded == []  # everything already there: nothing fetched again
        assert json.loads((out / "MANIFEST.json").read_text())["files"] == m["files"]

        missing = bundle("--model", "acme/tiny-gpt2@v9")
        assert missing.returncode == 2
        assert missing.stderr.strip().splitlines()[-1].startswith(
            "finetune: error: --model acme/tiny-gpt2@v9: no such revision on the Hub")
        assert not (out / "MANIFEST.json").exists()  # the failed run took it away ...
        assert bundle("--dataset", "acme/mini").returncode == 0  # ... a complete one puts it back
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home")}
    verify = subprocess.run([sys.executable, "-m", "finetune", "verify", str(out)], env=offline,
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stderr[-2000:]
    assert "1 model(s) and 2 dataset(s) load offline" in verify.stdout


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
def test_wheels_install_offline_and_train(tmp_path):
    """bundle --wheels, then a fresh venv installs finetune from the bundle alone (no index, no pip config),
    verifies the bundle and trains 2 steps on 2 CPU ranks from run_config.yaml's paths."""
    from conftest import cpu_env, free_port

    out = tmp_path / "bundle"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    made = subprocess.run([sys.executable, "-m", "finetune", "bundle", str(out), "--wheels", "--model", str(TINY),
                           "--dataset", str(ROOT / "data/wikitext2/validation.parquet")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert made.returncode == 0, made.stderr[-3000:]
    wheels = sorted(p.name for p in (out / "wheels").glob("*.whl"))
    assert any(w.startswith("finetune-") for w in wheels) and any(w.startswith("deepspeed-") for w in wheels)
    assert any(w.startswith("torch-") for w in wheels)
    assert json.loads((out / "MANIFEST.json").read_text())["install"] == \
        "pip install --no-index --find-links wheels finetune"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    clean["PIP_CONFIG_FILE"] = os.devnull  # no index, no find-links, no constraints from this machine's config
    install = subprocess.run([str(venv / "bin/pip"), "install", "--no-index", "--find-links", "wheels", "finetune"],
                             cwd=out, env=clean, capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    run_env = {**cpu_env(), **{k: v for k, v in clean.items() if k != "PIP_CONFIG_FILE"}}
    # TORCH_EXTENSIONS_DIR: DeepSpeed's CPU ops built for this venv's torch go to a folder of their own; in the shared
    # ~/.cache/torch_extensions they would replace the suite venv's build, which every later launch then rebuilds
    run_env.update({"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                    "FINETUNE_CACHE": str(tmp_path / "cache"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_ext")})
    run_env.pop("PYTHONPATH", None)
    where = subprocess.run([str(venv / "bin/python"), "-c", "import finetune, torch; print(finetune.__file__)"],
                           cwd=out, env=run_env, capture_output=True, text=True, timeout=300)
    assert where.stdout.startswith(str(venv)), where  # the wheel's finetune, not this checkout
    verify = subprocess.run([str(venv / "bin/finetune"), "verify", "."], cwd=out, env=run_env, capture_output=True,
                            text=True, timeout=600)
    assert verify.returncode == 0 and verify.stdout.startswith("bundle ok: "), verify.stderr[-2000:]

    port = free_port()
    try:
        train = subprocess.run([str(venv / "bin/deepspeed"), "--num_gpus", "2", "--master_port", str(port),
                                "--module", "finetune", "train", "--config", "run_config.yaml", "train.max_steps=2",
                                "train.micro_batch_size=2", "data.max_seq_len=64", "train.eval_max_batches=2",
                                "output_dir=runs/wheels"], cwd=out, env=run_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=900)
    finally:
        # this launch's buffer only: one of a launch beside it (pytest-xdist) may not be mapped by its ranks yet
        for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            f.unlink(missing_ok=True)
    assert train.returncode == 0, train.stdout[-5000:]
    assert (out / "runs/wheels/checkpoints/step2/COMPLETE").is_file()
    assert (out / "runs/wheels/export/model.safetensors").is_file()
    again = subprocess.run([str(venv / "bin/finetune"), "verify", "."], cwd=out, env=run_env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]  # runs/ is not part of the bundle
