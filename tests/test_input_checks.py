"""What the files tell before a model is built, and data that a hostile user might bring.

* Empty and null text rows (1,000 in a row, as in a file sorted by length) are dropped and counted, never
  crash tokenization; a file with no text at all and a text column that is not text are refused up front.
* Model/tokenizer/data compatibility (positions, vocabulary, special tokens, override keys, column types)
  is checked from ``config.json``, the tokenizer files and the parquet schema, every problem of every kind
  in one pass, by a launch as by ``--check`` and ``--print-config``.
* Rank 0's first-time tokenization may outlast ``train.dist_timeout_minutes``; a killed tokenization leaves
  no cache entry behind, and the next run removes what the dead one left.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import BIN, REPO, check_here, cpu_env, free_port, refused_here, run_python
from launch_helpers import wait_for

WIKI = REPO / "data" / "wikitext2" / "test.parquet"


def errors_of(proc) -> list[str]:
    return error_lines(proc.stdout)


def error_lines(printed: str) -> list[str]:
    return [line[len("finetune: error: "):] for line in printed.splitlines() if line.startswith("finetune: error:")]


def wiki_texts(n: int | None = None) -> list[str]:
    texts = pq.read_table(WIKI).column("text").to_pylist()
    return texts[:n] if n else texts


@pytest.fixture
def holes(tmp_path):
    """600 WikiText rows after 1,000 empty rows in a row, plus nulls and whitespace-only rows."""
    p = tmp_path / "holes.parquet"
    rows = [""] * 1000 + [None] * 7 + [" \n "] * 3 + wiki_texts(600)
    pq.write_table(pa.table({"text": pa.array(rows, pa.string())}), p)
    return p


@pytest.mark.parametrize("config", ["tiny_gpt", "tiny_bert"])
def test_empty_and_null_rows_are_dropped_and_counted(tmp_path, holes, config):
    """Tokenization (gpt_clm packed, bert_mlm one row per text) drops the 1,010 empty/null rows and the
    WikiText blank lines, logs the count once per split, and a split of only whitespace (which footer
    statistics cannot prove empty) is a clear error, not a crash."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.data.dataset import load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.logs import logger
    from finetune.recipes import get_recipe

    cfg = load_run_config(REPO / f"tests/configs/{config}.yaml",
                          [f"data.train_files=[{holes}]", f"data.validation_files=[{holes}]", "data.max_train_rows=0",
                           f"data.cache_dir={tmp_path / 'cache'}"])
    recipe = get_recipe(cfg.recipe)
    tokenizer = load_tokenizer(cfg, recipe)
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="INFO")
    try:
        splits = load_splits(recipe, tokenizer, cfg.data, cfg.train.seed)
    finally:
        logger.remove(sink)
    texts = sum(1 for t in wiki_texts(600) if t.strip())
    dropped = [int(n.replace(",", "")) for n in re.findall(r"dropped ([\d,]+) empty or null texts", "".join(messages))]
    assert dropped == [1610 - texts, 1610 - texts], messages  # train, validation
    if cfg.recipe == "bert_mlm":
        assert len(splits.train) == len(splits.validation) == texts
    else:
        assert len(splits.train) == len(splits.validation) > 0
    spaces = tmp_path / "spaces.parquet"
    pq.write_table(pa.table({"text": ["   ", "\t", None] * 10}), spaces)
    cfg.data.train_files = [str(spaces)]
    with pytest.raises(ConfigError, match=r"data.train_files: the train split has no rows to train on: every one "
                                          r"of its 30 texts in column 'text' is empty or null"):
        load_splits(recipe, tokenizer, cfg.data, cfg.train.seed)


def test_every_problem_of_every_kind_in_one_pass(tmp_path):
    """An unknown key in the file does not hide a missing model folder and a zero micro batch, and the zero
    micro batch gets our line only (no DeepSpeed parser line about it)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"recipe: gpt_clm\noutput_dir: {tmp_path / 'run'}\nmodel: {{path: {tmp_path / 'no-model'}}}\n"
                   f"data: {{train_files: [{WIKI}]}}\ntrain: {{micro_batch_size: 0, lrr: 1}}\n")
    proc = run_python(["finetune/run.py", "--config", str(cfg)], timeout=180)
    assert proc.returncode == 2, proc.stdout[-3000:]
    errs = errors_of(proc)
    assert len(errs) == 3, proc.stdout[-3000:]
    assert errs[0] == "unknown key 'train.lrr' (did you mean 'lr'?)"
    assert errs[1].startswith(f"model.path: folder '{tmp_path / 'no-model'}' does not exist")
    assert errs[2] == "train.micro_batch_size: must be > 0, got 0"
    assert "DeepSpeed" not in proc.stdout and not (tmp_path / "run").exists()


def test_print_config_and_check_run_the_launch_validation(tmp_path, capsys, monkeypatch):
    """``--print-config`` exits 2 on what a launch refuses (it exited 0); ``--check`` passes a good config (both in
    the test's process)."""
    code, printed = refused_here(["--config", "tests/configs/tiny_gpt.yaml", "recipe=nope",
                                  f"model.path={tmp_path / 'none'}", "train.lr=-1", f"output_dir={tmp_path / 'run'}",
                                  "--print-config"], capsys)
    assert code == 2, printed[-3000:]
    errs = error_lines(printed)
    assert len(errs) == 3 and errs[0].startswith("recipe: 'nope' unknown") and "model.path" in errs[1]
    assert errs[2] == "train.lr: must be > 0, got -1.0"
    monkeypatch.chdir(REPO)
    code, good = check_here(["--config", "tests/configs/tiny_gpt.yaml", f"output_dir={tmp_path / 'r'}"], capsys)
    assert code == 0 and "tests/configs/tiny_gpt.yaml: no problems found (world size 1)" in good
    assert not (tmp_path / "r").exists()


def test_bert_model_tokenizer_data_mismatches_before_any_model(tmp_path, capsys):
    """GPT-2 tokenizer with a BERT config, too long a max_seq_len, an int text column and a typo in
    config_overrides: all reported, by a launch (in the test's process), before a model is built or a row
    tokenized."""
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3], "body": ["a", "b", "c"]}), ints)
    cache = tmp_path / "cache"
    code, printed = refused_here(["--config", "tests/configs/tiny_bert.yaml", f"output_dir={tmp_path / 'run'}",
                                  "model.tokenizer_path=data/models/tiny-gpt2", "data.max_seq_len=1024",
                                  f"data.train_files=[{ints}]",
                                  "model.config_overrides={hidden_size: 64, num_hidden_layer: 1}"], capsys,
                                 FINETUNE_CACHE=str(cache))
    assert code == 2, printed[-3000:]
    errs = error_lines(printed)
    assert len(errs) == 5, printed[-3000:]
    assert errs[0] == (f"data.train_files: '{ints}' column 'text' has type int64, not text (string); set "
                       f"data.text_column to a text column (string columns: body (string)) or convert the column "
                       f"to strings")
    assert errs[1].startswith("model.config_overrides: 'num_hidden_layer' is not a key of the model config "
                              "'data/models/bert-small/config.json' (model_type bert) "
                              "(did you mean 'num_hidden_layers'?)")
    assert errs[2].startswith("data.max_seq_len: 1024 is more tokens than the model has positions for "
                              "(max_position_embeddings=512") and errs[2].endswith("set data.max_seq_len=512 or lower")
    assert "has no mask or pad token; bert_mlm needs both" in errs[3]
    assert errs[4].startswith("model.tokenizer_path: tokenizer 'data/models/tiny-gpt2' has 50,257 token ids but the "
                              "model's vocab_size is 30,522")
    assert not (tmp_path / "run").exists() and not cache.exists()


def test_gpt_vocab_shrink_positions_column_types_and_model_class(tmp_path, monkeypatch):
    """In-process ``validate_run``: a config_overrides vocab shrink on pretrained weights, max_seq_len above
    n_positions, a binary validation column and an all-empty training file in one pass; then a recipe whose
    model class cannot build the model type."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    monkeypatch.chdir(REPO)
    binary, empty = tmp_path / "bin.parquet", tmp_path / "empty_texts.parquet"
    pq.write_table(pa.table({"text": pa.array([b"abc"], pa.binary())}), binary)
    pq.write_table(pa.table({"text": pa.array([""] * 1200 + [None] * 5, pa.string())}), empty)
    cfg = load_run_config(REPO / "tests/configs/tiny_gpt.yaml",
                          [f"output_dir={tmp_path / 'run'}", "model.config_overrides={vocab_size: 1000}",
                           "data.max_seq_len=2048", f"data.train_files=[{empty}]", f"data.validation_files=[{binary}]"])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, world_size=2, on_cpu=True)
    errs = err.value.problems
    assert len(errs) == 5, errs
    assert errs[0] == (f"data.train_files: '{empty}' has no non-empty text: every row of column 'text' is null or "
                       f"empty (1,205 rows)")
    assert errs[1].startswith(f"data.validation_files: '{binary}' column 'text' has type binary, not text (string)")
    assert errs[2].startswith("model.config_overrides: vocab_size=1000 differs from 'data/models/tiny-gpt2/config.json'"
                              " (model_type gpt2) (50257), but the pretrained weights")
    assert errs[3].startswith("data.max_seq_len: 2048 is more tokens than the model has positions for "
                              "(max_position_embeddings=1024")
    assert "has 50,257 token ids but the model's vocab_size is 1,000" in errs[4]
    cfg = load_run_config(REPO / "tests/configs/tiny_gpt.yaml", [f"output_dir={tmp_path / 'run'}", "recipe=bert_mlm"])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, None, world_size=2, on_cpu=True)
    assert "is a model type that AutoModelForMaskedLM (recipe bert_mlm) cannot build" in str(err.value)


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_slow_first_tokenization_outlasts_dist_timeout_and_a_killed_one_leaves_no_entry(tmp_path):
    """A training file rank 0 needs seconds to tokenize. A first run is SIGKILLed while tokenizing: no cache
    entry appears. The next launch (2 ranks, train.dist_timeout_minutes=0.04: 2.4 s) removes the dead run's
    partial folder and rank 1 waits out the tokenization (before, its barrier timed out after 2.4 s and the
    launcher killed rank 0 mid-tokenization); the launch then stops on purpose right after the data (a
    micro batch larger than the data), before any model: rank 0 reaches that error only when nothing timed
    out. (Rank 1 may be killed by the launcher before it logs, so its log is only checked for failures.)"""
    big = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": pa.array(wiki_texts() * 15, pa.string())}), big)
    cache = tmp_path / "cache"
    tokenized = cache / "tokenized"
    run = tmp_path / "run"
    args = ["finetune/run.py", "--config", "tests/configs/tiny_gpt.yaml", f"data.train_files=[{big}]",
            "data.validation_files=[]", "data.max_train_rows=0", "train.dist_timeout_minutes=0.04", "export=false",
            "data.num_proc=1"]
    env = cpu_env(FINETUNE_CACHE=str(cache))

    def writing():
        return tokenized.is_dir() and any(p.is_file() and p.name != "owner.json" and p.stat().st_size > 0
                                          for p in tokenized.rglob("*"))

    first = subprocess.Popen([sys.executable, *args, f"output_dir={tmp_path / 'killed'}"], cwd=REPO, env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: writing() or first.poll() is not None, 240, what="tokenization started")
        assert first.poll() is None, "the first run ended before it could be killed"
    finally:
        first.kill()
        first.wait()
    assert not list(tokenized.glob("gpt_clm-*")), "a killed tokenization left a cache entry"
    assert any(p.is_file() for p in tokenized.rglob("*")), "the test should kill the run while it writes"

    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), *args,
           f"output_dir={run}", "train.micro_batch_size=100000"]
    second = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=400)
    errs = errors_of(second)
    assert second.returncode != 0 and len(errs) == 1, second.stdout[-4000:]
    assert "training rows give no full global batch" in errs[0], second.stdout[-4000:]
    log0 = (run / "logs" / "rank0.log").read_text()
    log1 = (run / "logs" / "rank1.log").read_text()
    assert "removed the partial tokenization of a dead run" in log0
    seconds = float(re.search(r"train: [\d,]+ rows \(tokenized [\d,]+ texts in ([\d.]+) s", log0).group(1))
    assert seconds > 0.04 * 60, f"tokenization took {seconds} s: too fast to test the wait ({log0[-2000:]})"
    assert "rank 1 failed" not in log1, log1[-3000:]
    entries = sorted(p.name for p in tokenized.iterdir())
    assert len(entries) == 2 and all(e.startswith("gpt_clm-") for e in entries), entries  # train and validation
    assert all((tokenized / e / "info.json").is_file() for e in entries)


# ---------------------------------------------------------------------------------------------------------
# issue 51, item 6: --check and doctor run every check the launch runs
# ---------------------------------------------------------------------------------------------------------

PARITY = REPO / "tests" / "configs" / "parity_gpt.yaml"
PAIRS = REPO / "data" / "gsm8k_pref" / "train.parquet"


def _doctor_fails(capsys, config, overrides: list[str]) -> list[str]:
    """``finetune doctor`` in this process: asserts exit 2, returns its ``FAIL`` rows."""
    from finetune.commands import doctor

    capsys.readouterr()
    code = doctor.main([str(config), *overrides])
    out = capsys.readouterr().out
    assert code == 2, out[-3000:]
    return [line for line in out.splitlines() if "  FAIL  " in line]


def test_optimizer_settings_out_of_range_are_refused_by_check_and_doctor(tmp_path, capsys, monkeypatch):
    """NaN, negative or zero learning rates, Muon's momentum outside [0, 1), Adam betas outside [0, 1), a zero or NaN
    epsilon and a negative or NaN weight decay pass no more: one line naming the key, before any model, by
    ``--check`` (the launch's own validation) and by ``finetune doctor``. Before, ``train.muon_lr=-1`` trained to the
    end with exit 0, ``train.adam_beta1=1.5`` failed in torch's AdamW after the model was built."""
    from finetune.config import load_run_config
    from finetune.errors import ConfigError
    from finetune.preflight.validate import validate_run

    monkeypatch.chdir(REPO)
    code, out = check_here(["--config", PARITY, f"output_dir={tmp_path / 'run'}", "train.optimizer=muon",
                            "train.muon_lr=-1"], capsys)
    assert code == 2 and error_lines(out) == ["train.muon_lr: must be a finite number > 0 (the Muon matrices' peak "
                                              "learning rate; default 0.02), got -1.0"], out[-2000:]
    cases = ["train.muon_lr=nan", "train.muon_lr=0", "train.muon_momentum=1", "train.muon_momentum=-0.5",
             "train.adam_beta1=1.5", "train.adam_beta2=nan", "train.adam_eps=0", "train.weight_decay=-0.1",
             "train.lr=nan", "train.kto.beta=nan"]
    for override in cases:  # what --check runs (validate_run), without the command's start-up
        cfg = load_run_config(PARITY, [f"output_dir={tmp_path / 'run'}", "train.optimizer=muon", override])
        with pytest.raises(ConfigError) as refused:
            validate_run(cfg, None, world_size=1, on_cpu=True)
        errs = refused.value.problems
        assert len(errs) == 1 and errs[0].startswith(f"{override.split('=')[0]}: "), (override, errs)
    fails = _doctor_fails(capsys, PARITY, [f"output_dir={tmp_path / 'run'}", "train.optimizer=muon",
                                           "train.muon_lr=-1", "train.adam_beta1=1.5"])
    assert [f.split("FAIL", 1)[1].split(":")[0].strip() for f in fails] == ["train.muon_lr", "train.adam_beta1"], fails
    code, out = check_here(["--config", PARITY, f"output_dir={tmp_path / 'run'}", "train.optimizer=muon",
                            "train.adam_beta2=0", "train.muon_momentum=0", "train.weight_decay=0"], capsys)
    assert code == 0, out[-2000:]  # the ends of the ranges that are allowed


def test_a_split_left_with_no_rows_is_refused_by_check_and_doctor_in_the_launch_s_words(tmp_path, capsys,
                                                                                       monkeypatch):
    """DPO pairs whose chosen equals rejected, KTO rows all longer than data.max_seq_len with data.truncation=drop:
    the launch's tokenization leaves no row and refuses the split; ``--check`` and ``finetune doctor`` now refuse it
    too, before any model, with the launch's own line (the recipe's map function over the split's rows). Before,
    both passed and only the launch refused it."""
    from finetune.config import load_run_config
    from finetune.data.dataset import load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.errors import ConfigError
    from finetune.recipes import get_recipe

    monkeypatch.chdir(REPO)
    table = pq.read_table(PAIRS).slice(0, 40).to_pydict()
    same = tmp_path / "same.parquet"
    pq.write_table(pa.table({"prompt": table["prompt"], "chosen": table["chosen"], "rejected": table["chosen"]}), same)
    dpo_args = [f"data.train_files=[{same}]", f"data.validation_files=[{PAIRS}]", f"output_dir={tmp_path / 'dpo'}",
                f"data.cache_dir={tmp_path / 'cache'}"]
    kto_args = ["data.max_seq_len=8", "data.truncation=drop", f"output_dir={tmp_path / 'kto'}",
                "data.validation_fraction=0.1", "data.validation_files=[]", f"data.cache_dir={tmp_path / 'cache'}"]
    for config, args in ((REPO / "tests/configs/parity_dpo.yaml", dpo_args),
                         (REPO / "tests/configs/parity_kto.yaml", kto_args)):
        cfg = load_run_config(config, args)
        recipe = get_recipe(cfg.recipe)
        with pytest.raises(ConfigError) as launch_error:  # what the launch's tokenization refuses
            load_splits(recipe, load_tokenizer(cfg, recipe), cfg.data, cfg.train.seed)
        launch_line = launch_error.value.problems[0]
        assert launch_line.startswith("data.train_files: the train split has no rows to train on"), launch_line
        code, out = check_here(["--config", config, *args], capsys)
        errs = error_lines(out)
        assert code == 2 and errs[:1] == [launch_line], out[-3000:]
        if cfg.recipe == "dpo":
            assert errs[1:] == [], out[-3000:]  # the validation file keeps its pairs
        else:  # the held-out rows are as long
            assert len(errs) == 2 and errs[1].startswith("data.validation_fraction: the validation split has no rows "
                                                         "to evaluate on: 5 rows gave no example"), errs
        assert [f.split("FAIL", 1)[1].strip() for f in _doctor_fails(capsys, config, args)] == errs
