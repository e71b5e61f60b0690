"""``finetune inspect``: the label-mask inspector, in-process, on the small test configs of every recipe.

The counts it prints are compared with the labels of the same rows collated here by the recipe's collator
(``RowSeededCollate``, epoch 0, as the inspector and the first epoch of training collate them); the marked text with
the raw rows; and two chat templates that the input checks let through show the warnings: one that renders no
assistant turn (nothing is trained) and one whose ``{% generation %}`` block encloses the whole conversation (the
prompt is trained).
"""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from conftest import CONFIGS, REPO, cpu_env

from finetune.commands import inspect
from finetune.config import load_run_config
from finetune.data.dataset import RowSeededCollate, load_splits
from finetune.engine.model import load_tokenizer
from finetune.recipes import recipe_for

HEADER = re.compile(r"^--- row (\d+)(?: (chosen|rejected|completion|KL))?: (\d+) tokens, (?:(\d+) trained(?:, (\d+) examples?)?"
                    r"(?: \((\d+) changed in the input[^)]*\))?|label (.+))$")
MARKED = re.compile(r"\[\[(.*?)\]\]", re.S)

NOTHING = """{%- for message in messages -%}
{%- if message['role'] != 'assistant' -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' -}}
{%- endif -%}
{%- endfor -%}
"""
"""A chat template without generation markers that leaves the assistant's turns out: nothing is trained."""

EVERYTHING = """{%- generation -%}
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' -}}
{%- endfor -%}
{%- endgeneration -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
"""A chat template whose ``{% generation %}`` block encloses every turn: the prompt is trained."""


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.chdir(REPO)  # run configs name repo-relative paths
    for key in ("FINETUNE_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(key, cpu_env()[key])  # the suite's shared tokenization cache


def _inspect(capsys, argv):
    code = inspect.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _shown(out: str) -> list[dict]:
    """The sequences printed: header fields and the text below the header."""
    shown, lines = [], out.splitlines()
    for i, line in enumerate(lines):
        m = HEADER.match(line)
        if m:
            shown.append({"row": int(m[1]), "which": m[2] or "", "tokens": int(m[3]),
                          "trained": None if m[4] is None else int(m[4]), "examples": int(m[5] or 1),
                          "changed": int(m[6] or 0), "label": m[7], "start": i + 1})
    ends = [s["start"] - 1 for s in shown[1:]] + [next((i for i, line in enumerate(lines)
                                                       if line.startswith("summary: ")), len(lines))]
    for s, end in zip(shown, ends):
        s["text"] = "\n".join(lines[s["start"]:end])
    return shown


def _body(out: str) -> str:
    """``out`` without its first line (which names the marks)."""
    return out.split("\n", 1)[1]


def _collated(config, overrides=(), split="train", n=4):
    """The first ``n`` rows of the split collated as the training's first epoch collates them: (batch, rows, cfg)."""
    cfg = load_run_config(config, list(overrides))
    recipe = recipe_for(cfg)
    tokenizer = load_tokenizer(cfg, recipe)
    splits = load_splits(recipe, tokenizer, cfg.data, cfg.train.seed)
    data = splits.train if split == "train" else splits.validation
    rows = [dict(data[i], _index=i) for i in range(n)]
    batch = RowSeededCollate(recipe.make_collator(tokenizer, cfg.data), cfg.train.seed)([dict(r) for r in rows])
    return batch, rows, cfg, tokenizer


def test_sft_prompt_response_packed(capsys):
    """Packed prompt/response rows: trained counts = labels != -100 of the collated rows, boundaries where the
    position_ids restart, every shown answer marked and no prompt marked."""
    overrides = ["data.max_seq_len=512"]  # several examples per packed row
    code, out, err = _inspect(capsys, [CONFIGS / "parity_sft.yaml", *overrides, "--rows", 3, "--color", "never"])
    assert code == 0, err
    shown = _shown(out)
    batch, rows, _, _ = _collated(CONFIGS / "parity_sft.yaml", overrides, n=3)
    assert [s["row"] for s in shown] == [0, 1, 2]
    for s in shown:
        k = s["row"]
        real = len(rows[k]["input_ids"])
        assert s["tokens"] == real
        assert s["trained"] == int((batch["labels"][k] != -100).sum())
        assert s["examples"] == int((batch["position_ids"][k][:real] == 0).sum()) > 1
        assert s["text"].count(inspect.BOUNDARY) == s["examples"] - 1
    raw = pq.read_table(REPO / "data/gsm8k/train.parquet").slice(0, 40).to_pylist()
    text = "\n".join(s["text"] for s in shown)
    marked = "\n".join(MARKED.findall(text))
    found = [r for r in raw if r["question"] in text]
    assert len(found) == sum(s["examples"] for s in shown)  # every example's prompt is shown whole ...
    for r in found:
        assert r["question"] not in marked  # ... and not trained
        assert r["answer"].splitlines()[0] in marked  # the answer's first line is
    assert "0 (0%) with no trained token" in out and "warning" not in err


def test_sft_chat_marks_assistant_turns(capsys):
    """ChatML rows (the shipped template with {% generation %}): the assistant's answer is trained, the user's turn
    and the assistant header are not."""
    code, out, err = _inspect(capsys, [CONFIGS / "tiny_sft.yaml", "--rows", 2, "--split", "validation"])
    assert code == 0, err
    batch, rows, _, _ = _collated(CONFIGS / "tiny_sft.yaml", split="validation", n=2)
    shown = _shown(out)
    assert [s["trained"] for s in shown] == [int((batch["labels"][k] != -100).sum()) for k in range(2)]
    for s in shown:
        marked = MARKED.findall(s["text"])
        assert len(marked) == 1 and "<|im_start|>" not in marked[0]
        assert s["text"].startswith("<|im_start|>user\n") and "<|im_start|>assistant\n[[" in s["text"]
    assert "prompts located in 2 of 2 examples" in out and "warning" not in err


def test_dpo_shows_chosen_and_rejected(capsys):
    """Each pair as its chosen, then its rejected sequence, labels on the responses only."""
    code, out, err = _inspect(capsys, [CONFIGS / "parity_dpo.yaml", "--rows", 2, "--color", "never"])
    assert code == 0, err
    batch, rows, cfg, _ = _collated(CONFIGS / "parity_dpo.yaml", n=2)
    shown = _shown(out)
    assert [(s["row"], s["which"]) for s in shown] == [(0, "chosen"), (0, "rejected"), (1, "chosen"), (1, "rejected")]
    for s in shown:
        k = s["row"] + (2 if s["which"] == "rejected" else 0)  # [2B, seq]: chosen rows, then rejected rows
        assert s["tokens"] == int(batch["attention_mask"][k].sum())
        assert s["trained"] == int((batch["labels"][k] != -100).sum()) > 0
        assert s["text"].count("[[") == 1 and s["text"].rstrip().endswith("<|endoftext|>]]")
    for chosen, rejected in (shown[0:2], shown[2:4]):
        assert chosen["text"] != rejected["text"]
        prompt = chosen["text"].split("[[")[0]
        assert prompt and rejected["text"].startswith(prompt)  # the shared prompt, untrained in both
    assert "warning" not in err


def test_kto_shows_the_completion_and_its_kl_pair(capsys):
    """Each row as its completion, then its KL pair: the same prompt (untrained) with the previous row's completion
    (trained, as the collator labels it)."""
    code, out, err = _inspect(capsys, [CONFIGS / "parity_kto.yaml", "--rows", 2, "--color", "never"])
    assert code == 0, err
    batch, rows, cfg, _ = _collated(CONFIGS / "parity_kto.yaml", n=2)
    shown = _shown(out)
    assert [(s["row"], s["which"]) for s in shown] == [(0, "completion"), (0, "KL"), (1, "completion"), (1, "KL")]
    for s in shown:
        k = s["row"] + (2 if s["which"] == "KL" else 0)  # [2B, seq]: completions, then KL pairs
        assert s["tokens"] == int(batch["attention_mask"][k].sum())
        assert s["trained"] == int((batch["labels"][k] != -100).sum()) > 0
        assert s["text"].count("[[") == 1
    for completion, kl in (shown[0:2], shown[2:4]):
        prompt = completion["text"].split("[[")[0]
        assert prompt and kl["text"].startswith(prompt + "[[") and kl["text"] != completion["text"]
    previous = MARKED.findall(shown[0]["text"])[0]  # row 1's KL pair holds row 0's completion (both cut at 128)
    kl_of_next = MARKED.findall(shown[3]["text"])[0]
    assert previous.startswith(kl_of_next[:20]) and "warning" not in err


def test_bert_mlm_marks_the_masked_positions(capsys):
    """The trained positions are the collator's masked ones (row-seeded, epoch 0), shown with their targets."""
    code, out, err = _inspect(capsys, [CONFIGS / "tiny_bert.yaml", "--rows", 4])
    assert code == 0, err
    batch, rows, _, tokenizer = _collated(CONFIGS / "tiny_bert.yaml", n=4)
    shown = _shown(out)
    assert len(shown) == 4
    for s in shown:
        k = s["row"]
        labels, ids = batch["labels"][k], batch["input_ids"][k]
        masked = labels != -100
        assert s["tokens"] == len(rows[k]["input_ids"])
        assert s["trained"] == int(masked.sum())
        assert s["changed"] == int((ids[masked] != labels[masked]).sum())
        assert len(MARKED.findall(s["text"])) <= s["trained"]
    assert sum(s["trained"] for s in shown) > 0 and sum(s["changed"] for s in shown) > 0
    assert "[MASK]" not in out  # trained positions show their target, not what the model sees there


def test_seq_cls_shows_the_label(capsys):
    code, out, err = _inspect(capsys, [CONFIGS / "parity_cls.yaml", "--rows", 3])
    assert code == 0, err
    batch, _, _, _ = _collated(CONFIGS / "parity_cls.yaml", n=3)
    names = {0: "'negative'", 1: "'positive'"}
    assert [s["label"] for s in _shown(out)] == [f"{int(v)} ({names[int(v)]})" for v in batch["labels"]]
    assert "[[" not in out and "summary" not in out and "one label per row" in out


@pytest.mark.parametrize("config", ["tiny_gpt", "parity_gpt"])
def test_gpt_clm_trains_every_token(capsys, config):
    """Packed blocks (tiny_gpt: examples end with EOS, a boundary after each) and padded rows (parity_gpt)."""
    code, out, err = _inspect(capsys, [CONFIGS / f"{config}.yaml", "--rows", 3])
    assert code == 0, err
    batch, rows, cfg, tokenizer = _collated(CONFIGS / f"{config}.yaml", n=3)
    for s in _shown(out):
        ids = rows[s["row"]]["input_ids"]
        assert s["tokens"] == len(ids) and s["trained"] == int((batch["labels"][s["row"]] != -100).sum()) == len(ids)
        if cfg.data.packing:
            assert s["examples"] == 1 + sum(t == tokenizer.eos_token_id for t in ids[:-1])
            assert s["text"].count(inspect.BOUNDARY) == s["examples"] - 1
        else:
            assert inspect.BOUNDARY not in s["text"]


def test_chat_template_that_trains_nothing_warns(capsys, tmp_path):
    """A template without generation markers that renders no assistant turn passes the input checks (it renders
    every row) but leaves every label at -100: the inspector shows the rows and warns (exit 0)."""
    template = tmp_path / "no_assistant.jinja"
    template.write_text(NOTHING)
    code, out, err = _inspect(capsys, [CONFIGS / "tiny_sft.yaml", f"data.chat_template={template}",
                                       "data.max_seq_len=128", "--rows", 2])
    assert code == 0, err
    shown = _shown(out)
    assert [s["trained"] for s in shown] == [0, 0] and "[[" not in _body(out)
    assert "<|im_start|>user" in shown[0]["text"] and "<|im_start|>assistant" not in out
    assert err.count("finetune: warning: row ") == 2 and "no trained token (its labels are all -100)" in err
    assert "finetune: warning: 2 of 2 rows shown (100%) have no trained token" in err
    assert re.search(r"finetune: warning: (\d+) of \1 rows of the train split \(100\.0%\) have no trained token", err)


def test_chat_template_that_trains_the_prompt_warns(capsys, tmp_path):
    template = tmp_path / "everything.jinja"
    template.write_text(EVERYTHING)
    code, out, err = _inspect(capsys, [CONFIGS / "tiny_sft.yaml", f"data.chat_template={template}",
                                       "data.max_seq_len=128", "--rows", 1])
    assert code == 0, err
    assert re.search(r"finetune: warning: row 0: \d+ of its \d+ prompt tokens are trained \(the loss is taken on "
                     r"the prompt\)", err), err
    marked = MARKED.findall(_body(out))
    assert len(marked) == 1 and marked[0].startswith("|im_start|>user\n")  # all but the first token (no target)


def test_color_and_bad_input(capsys):
    code, out, err = _inspect(capsys, [CONFIGS / "parity_sft.yaml", "--rows", 1, "--color", "always"])
    assert code == 0 and "\x1b[1;32m" in out and "[[" not in _body(out)
    for argv, line in ((["--rows", 0], "--rows: must be >= 1, got 0"),
                       (["--split", "test"], "--split: 'test' unknown (choose one of: train, validation)"),
                       (["--color", "blue"], "--color: 'blue' unknown"),
                       (["data.no_such_key=1"], "unknown key 'data.no_such_key'")):
        code, out, err = _inspect(capsys, [CONFIGS / "parity_sft.yaml", *argv])
        assert code == 2 and out == "", err
        assert len(err.strip().splitlines()) == 1 and err.startswith("finetune: error: ") and line in err, err
