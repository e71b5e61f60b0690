"""Tokenization on several processes and nodes (finetune/data/tokenization.py) and ``finetune prepare``.

* ``data.num_proc=2`` writes the rows of ``data.num_proc=1`` (packed gpt_clm, packed sft with its counts, and the
  number of shards of several nodes), read lazily from a file of several row groups.
* Two "nodes" of one rank each (``LOCAL_RANK=0`` on both, ``NODE_RANK`` 0 and 1, as a launcher sets them on two
  hosts) sharing one cache folder tokenize one entry together (2 nodes in its ``info.json``); with a cache folder
  each, each node tokenizes all. Both entries hold the rows of a one-process ``finetune prepare``.
* ``finetune prepare`` then a launch: the launch logs the cache hit; a killed ``prepare`` leaves no entry, its
  forked processes die with it, and the next ``prepare`` removes its partial folder.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import BIN, REPO, cpu_env, free_port, ok, run_python
from launch_helpers import wait_for

from finetune.data import tokenization
from finetune.config import load_run_config
from finetune.data.dataset import load_splits
from finetune.engine.model import load_tokenizer
from finetune.recipes import recipe_for


def _texts() -> list:
    return pq.read_table(REPO / "data" / "wikitext2" / "test.parquet").column("text").to_pylist()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """4,000 WikiText-2 lines (every 7th made empty) in a parquet file of row groups of 700 rows (not a multiple of
    the 1,000-row map batch)."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.parquet"
    texts = [t if i % 7 else "" for i, t in enumerate((_texts() * 2)[:4000])]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=700)
    return path


def _splits(config: str, tmp: Path, num_proc: int, overrides: list[str] = ()):
    cfg = load_run_config(REPO / config, [f"data.cache_dir={tmp}", *overrides])
    recipe = recipe_for(cfg)
    return load_splits(recipe, load_tokenizer(cfg, recipe), cfg.data, cfg.train.seed, num_proc)


def test_rows_do_not_depend_on_processes_or_shards(tmp_path, corpus):
    """Same rows (and dtypes) for 1 and 2 processes; shards cut at multiples of the map batch; lazy reads by row
    group give the rows of the file; an sft entry's counts add up over its shards."""
    assert tokenization.shard_bounds(4000, 3) == [(0, 1000), (1000, 3000), (3000, 4000)]
    assert tokenization.shard_bounds(2500, 8) == [(0, 1000), (1000, 2000), (2000, 2500)]
    rows = tokenization.ParquetRows([str(corpus), str(corpus)], ["text"])
    texts = [t if i % 7 else "" for i, t in enumerate((_texts() * 2)[:4000])]
    assert len(rows) == 8000 and rows.take([0, 699, 700, 4001, 7999])["text"] == [texts[i] for i in (0, 699, 700, 1,
                                                                                                      3999)]

    gpt = ["data.validation_files=[]", f"data.train_files=[{corpus}]", "data.max_train_rows=0"]
    one = _splits("tests/configs/tiny_gpt.yaml", tmp_path / "one", 1, gpt)
    two = _splits("tests/configs/tiny_gpt.yaml", tmp_path / "two", 2, gpt)
    for a, b in ((one.train, two.train), (one.validation, two.validation)):
        assert a.features == b.features and a.data.table.equals(b.data.table)
    entry = next((tmp_path / "two" / "tokenized").glob("gpt_clm-train-*"))
    info = json.loads((entry / "info.json").read_text())
    assert info["num_proc"] == 2 and info["shards"] == 2 and len(list(entry.glob("shard-*.arrow"))) == 2
    assert info["counts"]["rows_in"] == 3800 and info["counts"]["dropped"] > 500  # the empty lines

    sft_one = _splits("finetune/recipes/configs/sft_gsm8k_chat.yaml", tmp_path / "s1", 1)
    sft_two = _splits("finetune/recipes/configs/sft_gsm8k_chat.yaml", tmp_path / "s2", 2)
    assert sft_one.train.data.table.equals(sft_two.train.data.table)
    counts = [json.loads((e / "info.json").read_text())["counts"]
              for e in (tmp_path / "s1" / "tokenized", tmp_path / "s2" / "tokenized") for e in e.glob("sft-train-*")]
    assert counts[0] == counts[1] and counts[0]["rows"] == 2000 and counts[0]["packed_rows"] == len(sft_one.train)


def _node(rank: int, port: int, cache: Path, run: Path, corpus: Path) -> subprocess.Popen:
    """One "node" of a 2-node run: one rank with the environment a launcher sets on its own host."""
    env = cpu_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank),
                  GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FINETUNE_CACHE=str(cache))
    args = ["finetune/run.py", "--config", "tests/configs/tiny_gpt.yaml", f"output_dir={run}", "train.max_steps=1",
            "train.eval_every=0", "train.save_every=0", "export=false", "data.validation_files=[]",
            f"data.train_files=[{corpus}]", "data.max_train_rows=0", "data.num_proc=1"]
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _two_nodes(tmp_path: Path, corpus: Path, caches: tuple[Path, Path]) -> Path:
    port, run = free_port(), tmp_path / f"run-{caches[0].name}-{caches[1].name}"
    procs = [_node(r, port, caches[r], run, corpus) for r in (0, 1)]
    for p in procs:
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out[-4000:]
    return run


def test_two_nodes_split_a_shared_cache_and_fill_their_own(tmp_path, corpus):
    shared = tmp_path / "shared"
    run = _two_nodes(tmp_path, corpus, (shared, shared))
    log0 = (run / "logs" / "rank0.log").read_text()
    assert "train: " in log0 and "by 2 node(s) x 1 process(es)" in log0, log0[-3000:]
    entry = next((shared / "tokenized").glob("gpt_clm-train-*"))
    assert json.loads((entry / "info.json").read_text())["nodes"] == 2
    assert len(list(entry.glob("shard-*.arrow"))) == 2  # one per node
    assert not list((shared / "tokenized").glob(".*")), "a partial folder or probe file was left"

    own = _two_nodes(tmp_path, corpus, (tmp_path / "node0", tmp_path / "node1"))
    for r in (0, 1):
        log = (own / "logs" / f"rank{r}.log").read_text()
        assert "by 1 node(s) x 1 process(es)" in log, log[-3000:]  # each node tokenized everything itself
    prepared = tmp_path / "prepared"
    ok(run_python(["-m", "finetune", "prepare", "--config", "tests/configs/tiny_gpt.yaml", "data.validation_files=[]",
                   f"data.train_files=[{corpus}]", "data.max_train_rows=0", "--num-proc", "1"],
                  env=cpu_env(FINETUNE_CACHE=str(prepared))))
    tables = {}
    for cache in (shared, tmp_path / "node0", tmp_path / "node1", prepared):
        entries = sorted((cache / "tokenized").glob("gpt_clm-*"))
        assert [e.name for e in entries] == sorted(e.name for e in (shared / "tokenized").glob("gpt_clm-*"))
        tables[cache.name] = [tokenization.load_entry(e)[0].data.table for e in entries]
    for name, t in tables.items():
        assert all(a.equals(b) for a, b in zip(t, tables["prepared"])), name


def test_prepare_then_launch_hits_and_a_killed_prepare_leaves_nothing(tmp_path):
    big = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": pa.array(_texts() * 8, pa.string())}), big, row_group_size=2000)
    cache = tmp_path / "cache"
    tokenized = cache / "tokenized"
    args = [sys.executable, "-m", "finetune", "prepare", "--config", "tests/configs/tiny_gpt.yaml",
            f"data.train_files=[{big}]", "data.validation_files=[]", "data.max_train_rows=0", "--num-proc", "2"]
    env = cpu_env(FINETUNE_CACHE=str(cache))
    killed = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(p.stat().st_size > 0 for p in tokenized.glob(".partial-*/.shard-*")) or
                 killed.poll() is not None, 240, what="tokenization started")
        assert killed.poll() is None, "prepare ended before it could be killed"
        workers = psutil.Process(killed.pid).children()
        assert len(workers) == 2
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 10,
             what="the forked tokenizers died with prepare")
    assert not [p for p in tokenized.iterdir() if not p.name.startswith(".partial-")], "a killed prepare left an entry"

    prepare = subprocess.run(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=300)
    assert prepare.returncode == 0, prepare.stdout[-3000:]
    assert "removed the partial tokenization of a dead run" in prepare.stdout
    assert "by 1 node(s) x 2 process(es)" in prepare.stdout and "prepared: " in prepare.stdout
    assert sorted(p.name.split("-")[1] for p in tokenized.iterdir()) == ["train", "validation"]
    assert len(list((cache / "checked").glob("utf8-*"))) == 1, "the UTF-8 check passed but left no mark"

    run = tmp_path / "run"
    launch = subprocess.run([str(BIN / "python"), "finetune/run.py", "--config", "tests/configs/tiny_gpt.yaml",
                             f"data.train_files=[{big}]", "data.validation_files=[]", "data.max_train_rows=0",
                             f"output_dir={run}", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
                             "export=false"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    assert launch.returncode == 0, launch.stdout[-3000:]
    log = (run / "logs" / "rank0.log").read_text()
    assert log.count("rows (cache hit: ") == 2, log[-3000:]
