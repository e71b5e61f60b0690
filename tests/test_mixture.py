"""Weighted mixtures of datasets (``data.sources``, finetune/data/mixture.py).

* The sampling rule: rows per source in proportion to the weights (largest remainder), whole passes without
  replacement, another subset each epoch; deterministic per seed.
* The training order does not depend on the world size or the micro-batch/accumulation split: the ranks' rows of
  each optimizer step, put together, are the same global batch at 1, 2 and 4 ranks.
* A real 2-rank run of ``gpt_clm`` on two sources with other columns (WikiText-2's ``text``, GSM8K's ``question``,
  held out per source): the realised shares in the log match the weights, ``eval/<source>/loss`` for each source and
  the overall ``eval/loss`` is their token-weighted mean; a resume mid-epoch repeats the uninterrupted losses.
* Checks before any model, one line each naming the source.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import CONFIGS, check_here, launch, ok, read_metrics, train_losses

from finetune.config import DataConfig
from finetune.data.dataset import ResumableDistributedSampler
from finetune.errors import ConfigError
from finetune.data.mixture import Mixture, epoch_counts, sources_of


def test_sampling_rule():
    assert epoch_counts([100, 300], [1, 1]) == [200, 200]
    assert epoch_counts([10, 10, 10], [1, 1, 1]) == [10, 10, 10]
    assert sum(epoch_counts([7, 13, 5], [0.3, 0.3, 0.4])) == 25 and epoch_counts([7, 13, 5], [0.3, 0.3, 0.4]) == [8, 7, 10]
    mix = Mixture(["a", "b"], [100, 300], [3, 1], seed=5)  # a: 300 rows = 3 passes, b: 100 of its 300
    rows = mix.epoch_rows(0)
    assert len(rows) == 400 and np.array_equal(rows, mix.epoch_rows(0))  # deterministic
    a, b = rows[rows < 100], rows[rows >= 100]
    assert len(a) == 300 and len(b) == 100
    for k in range(3):  # every pass over a is a permutation: no row repeats before all were used
        assert sorted(a[k * 100:(k + 1) * 100].tolist()) == list(range(100))
    assert len(set(b.tolist())) == 100  # without replacement
    other = mix.epoch_rows(1)
    assert set(other[other >= 100].tolist()) != set(b.tolist())  # another subset each epoch
    assert not np.array_equal(Mixture(["a", "b"], [100, 300], [3, 1], seed=6).epoch_rows(0), rows)
    # realised proportions over an epoch: exactly the weights' (rounding aside)
    big = Mixture(["a", "b", "c"], [1000, 5000, 200], [0.5, 0.3, 0.2], seed=0)
    share = np.bincount(big.source_of(big.epoch_rows(0)), minlength=3) / len(big)
    assert share == pytest.approx([0.5, 0.3, 0.2], abs=1e-3)


def _global_batches(world: int, micro: int, accumulation: int, mix: Mixture, epoch: int, skip: int = 0) -> list:
    """Rows of each optimizer step, all ranks together, as the loop draws them."""
    lengths = np.arange(len(mix)) % 17 + 1
    global_batch = micro * accumulation * world
    samplers = []
    for rank in range(world):
        s = ResumableDistributedSampler(range(len(mix)), world, rank, seed=3, lengths=lengths, global_batch=global_batch,
                                        mixture=mix, row_tokens=lengths)
        s.set_epoch(epoch, skip=skip // world)
        samplers.append(list(s))
    steps = len(samplers[0]) // (micro * accumulation)
    per_rank = micro * accumulation
    return [sorted(r for s in samplers for r in s[i * per_rank:(i + 1) * per_rank]) for i in range(steps)]


def test_order_does_not_depend_on_world_size_or_split_and_resumes():
    mix = Mixture(["a", "b"], [120, 200], [2, 1], seed=3)
    one = _global_batches(1, 8, 1, mix, epoch=1)
    assert one == _global_batches(2, 4, 1, mix, epoch=1) == _global_batches(2, 2, 2, mix, epoch=1) \
        == _global_batches(4, 1, 2, mix, epoch=1)
    assert _global_batches(2, 2, 2, mix, epoch=1, skip=5 * 8) == one[5:]  # mid-epoch resume: the same next rows


def test_sources_are_checked_one_line_each():
    with pytest.raises(ConfigError) as e:
        sources_of(DataConfig(sources=[{"name": "a", "train_files": ["x.parquet"], "wieght": 2},
                                       {"name": "a", "train_files": ["y.parquet"], "weight": 0},
                                       {"train_files": []}, "z"]))
    text = "\n".join(e.value.problems)
    assert "data.sources[0] (a): unknown key 'wieght' (did you mean 'weight'?)" in text
    assert "data.sources[1] (a): the name 'a' is used by another source" in text
    assert "data.sources[1] (a): weight must be a positive number, got 0" in text
    assert "data.sources[2]: needs a 'name'" in text and "data.sources[2]: needs 'train_files'" in text
    assert "data.sources[3]: expected a mapping" in text


SOURCES = ("data.sources=[{name: wiki, train_files: [data/wikitext2/test.parquet], weight: 3, max_train_rows: 600, "
           "validation_fraction: 0.1}, {name: math, train_files: [data/gsm8k/train.parquet], text_column: question, "
           "weight: 1, max_train_rows: 600, validation_fraction: 0.1}]")
MIX = [SOURCES, "data.train_files=[]", "data.validation_files=[]", "data.max_train_rows=0", "train.max_steps=8",
       "train.eval_every=4", "train.save_every=4", "train.eval_max_batches=2", "export=false"]


def test_check_names_the_source(tmp_path, capsys):
    bad = SOURCES.replace("text_column: question", "text_column: questoin").replace("weight: 3", "weight: -1")
    code, out = check_here(["--config", CONFIGS / "tiny_gpt.yaml", *MIX, bad, f"output_dir={tmp_path / 'r'}"], capsys)
    errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
    assert code == 2 and len(errors) == 2, out[-3000:]
    assert "data.sources[0] (wiki): weight must be a positive number, got -1" in errors[0]
    assert errors[1].startswith("finetune: error: data.sources[1] (math): train_files: 'data/gsm8k/train.parquet' has "
                                "no column 'questoin' (columns: question, answer); set text_column"), errors[1]


def test_mixture_trains_logs_shares_evaluates_per_source_and_resumes(tmp_path):
    full = tmp_path / "full"
    proc = ok(launch(CONFIGS / "tiny_gpt.yaml", [*MIX, f"output_dir={full}"]))
    log = (full / "logs" / "rank0.log").read_text()
    assert "wiki/train: " in log and "math/validation: " in log, proc.stdout[-3000:]
    shares = re.search(r"mixture, epoch 0: wiki ([\d.]+)% of rows, ([\d.]+)% of tokens .*; math ([\d.]+)% of rows", log)
    assert shares, log[-3000:]
    assert float(shares.group(1)) == pytest.approx(75.0, abs=0.1) and float(shares.group(3)) == pytest.approx(25.0, abs=0.1)
    trained = re.search(r"mixture, rows trained on since the run began: wiki [\d.]+% of rows, [\d.]+% of tokens "
                        r"\(([\d,]+) rows = .*; math [\d.]+% of rows, [\d.]+% of tokens \(([\d,]+) rows", log)
    assert trained, log[-3000:]
    assert int(trained.group(1).replace(",", "")) + int(trained.group(2).replace(",", "")) == 8 * 2 * 4  # steps x ranks x micro batch
    evals = [r for r in read_metrics(full) if "eval/loss" in r]
    assert evals and all({"eval/wiki/loss", "eval/math/loss", "eval/wiki/perplexity"} <= set(r) for r in evals)
    for r in evals:  # the overall loss lies between the sources' (their token-weighted mean)
        low, high = sorted([r["eval/wiki/loss"], r["eval/math/loss"]])
        assert low <= r["eval/loss"] <= high

    resumed = tmp_path / "resumed"
    proc = ok(launch(CONFIGS / "tiny_gpt.yaml", [*MIX, f"output_dir={resumed}"],
                     resume=str(full / "checkpoints" / "step4")))
    assert "resumed from" in proc.stdout
    assert trained.group(0) in (resumed / "logs" / "rank0.log").read_text()  # the same rows, counted from the start
    reference, again = train_losses(full), train_losses(resumed)
    assert sorted(again) == [5, 6, 7, 8]
    for step, loss in again.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), step
