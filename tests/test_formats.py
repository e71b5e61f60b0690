"""The instruction-data forms sft recognises (:mod:`finetune.data.formats`): Alpaca, ShareGPT and TRL's
prompt-completion files train exactly the tokens of the equivalent messages file (the pipeline's own tokenized
rows, byte for byte); what was recognised is one log line; a file in no form, files of different forms and a row
that does not fit its form are one line each before any model. In one process, no launch."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import CONFIGS, REPO, check_here

SFT = CONFIGS / "tiny_sft.yaml"
SYSTEM = "You solve grade-school math problems."


def _conversations() -> list[dict]:
    """Real GSM8K rows (the shipped chat slice) as Alpaca fields: ``instruction`` (the question), ``output`` (the
    solution), every third with a system prompt, every fourth with its question's first sentence as the ``input``,
    and the fifth row with one earlier turn of ``history``."""
    rows = pq.read_table(REPO / "data/gsm8k/train_chat.parquet").slice(0, 24).column("messages").to_pylist()
    out = []
    for i, (user, assistant) in enumerate(rows):
        question = user["content"]
        row = {"instruction": question, "input": "", "output": assistant["content"], "system": "", "history": []}
        if i % 4 == 1 and ". " in question:
            row["instruction"], row["input"] = question.split(". ", 1)
        if i % 3 == 2:
            row["system"] = SYSTEM
        if i == 4:
            row["history"] = [["What is 2 + 3?", "2 + 3 = 5\n#### 5"]]
        out.append(row)
    return out


def _messages(row: dict) -> list[dict]:
    """The conversation an Alpaca row means (LLaMA-Factory's: instruction and input joined by a newline)."""
    system = [{"role": "system", "content": row["system"]}] if row["system"] else []
    history = [m for q, a in row["history"] for m in ({"role": "user", "content": q},
                                                      {"role": "assistant", "content": a})]
    prompt = "\n".join(p for p in (row["instruction"], row["input"]) if p)
    return system + history + [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


_TAGS = {"system": "system", "user": "human", "assistant": "gpt"}


def _write_forms(tmp_path) -> dict:
    """The same conversations in every form, one file each."""
    rows = _conversations()
    forms = {
        "messages": {"messages": [_messages(r) for r in rows]},
        "alpaca": {k: [r[k] for r in rows] for k in ("instruction", "input", "output", "system", "history")},
        # ShareGPT with its system prompt in a column of its own (LLaMA-Factory's) on the rows that have one
        "sharegpt": {"conversations": [[{"from": _TAGS[m["role"]], "value": m["content"]} for m in _messages(r)
                                        if m["role"] != "system"] for r in rows],
                     "system": [r["system"] for r in rows]},
        # TRL's conversational prompt-completion: the last assistant turn is the completion
        "prompt_completion": {"prompt": [_messages(r)[:-1] for r in rows],
                              "completion": [_messages(r)[-1:] for r in rows]},
    }
    paths = {}
    for name, columns in forms.items():
        paths[name] = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table(columns), paths[name])
    return paths


def _tokenized(tmp_path, path, extra=()):
    from finetune.config import load_run_config
    from finetune.data.dataset import load_splits
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    cfg = load_run_config(SFT, [f"data.train_files=[{path}]", f"data.validation_files=[{path}]",
                                "data.messages_column=", "data.max_train_rows=0", f"data.cache_dir={tmp_path / 'c'}",
                                f"output_dir={tmp_path / 'run'}", *extra])
    recipe = get_recipe("sft")
    splits = load_splits(recipe, load_tokenizer(cfg, recipe), cfg.data, cfg.train.seed, num_proc=1)
    return [splits.train[i] for i in range(len(splits.train))]


def test_alpaca_sharegpt_and_prompt_completion_train_the_tokens_of_the_messages_file(tmp_path):
    """Issue 54's target: the pipeline's tokenized (packed) rows of the Alpaca and ShareGPT files equal the messages
    file's, ids, labels and positions, each form recognised from its columns with one log line; the conversational
    prompt-completion file's have the same ids and positions, its prompt's assistant turn (a history) untrained."""
    from loguru import logger

    paths = _write_forms(tmp_path)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        want = _tokenized(tmp_path, paths["messages"])
        got = {name: _tokenized(tmp_path, paths[name]) for name in ("alpaca", "sharegpt", "prompt_completion")}
    finally:
        logger.remove(sink)
    assert want and sum(sum(1 for t in r["labels"] if t != -100) for r in want) > 1000
    for name in ("alpaca", "sharegpt"):
        assert got[name] == want, name
    # prompt-completion: the same tokens; the history turn of row 4 is in the prompt, so not trained (TRL's way)
    pc = got["prompt_completion"]
    assert [(r["input_ids"], r["position_ids"]) for r in pc] == [(r["input_ids"], r["position_ids"]) for r in want]
    differ = [i for i, (a, b) in enumerate(zip(pc, want)) if a["labels"] != b["labels"]]
    assert len(differ) == 1, differ
    a, b = pc[differ[0]]["labels"], want[differ[0]]["labels"]
    assert all(x == y or x == -100 for x, y in zip(a, b)) and sum(x != y for x, y in zip(a, b)) > 5
    said = [line for line in lines if "form (recognised" in line]
    assert any("sft: Alpaca form (recognised; columns instruction, output, input, system, history) in 1 file(s), "
               "24 rows: read as conversations" in line for line in said), said
    assert any("ShareGPT form (recognised; columns conversations, system)" in line for line in said), said
    assert any("prompt-completion form (recognised" in line for line in said), said


def test_text_prompt_completion_is_a_prompt_response_pair(tmp_path):
    """TRL's prompt-completion as text: the pair form of data.prompt_column / data.response_column."""
    rows = _conversations()[:8]
    path = tmp_path / "pc.parquet"
    pq.write_table(pa.table({"prompt": [r["instruction"] for r in rows], "completion": [r["output"] for r in rows]}),
                   path)
    explicit = _tokenized(tmp_path, path, ["data.prompt_column=prompt", "data.response_column=completion",
                                           "data.chat_template="])
    assert _tokenized(tmp_path, path, ["data.chat_template="]) == explicit and explicit


def test_conversational_prompt_completion_trains_the_completion_only(tmp_path):
    """An assistant turn in the prompt of a conversational prompt-completion row is context, not trained (TRL
    trains the completion); the messages file of the same turns trains both."""
    from finetune.config import DataConfig
    from finetune.data import formats
    from finetune.recipes import sft
    from finetune.recipes.common import chat as sft_data
    from transformers import AutoTokenizer

    tok = sft.prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2", local_files_only=True))
    template = (REPO / "data/chat_templates/chatml.jinja").read_text()
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    read = formats.Form("prompt_completion", ("prompt", "completion"))
    messages, first = sft_data.conversation(read, {"prompt": turns[:3], "completion": turns[3:]})
    assert (messages, first) == (turns, 3)
    _, labels = sft_data.encode_messages(tok, messages, template, first=first)
    _, both = sft_data.encode_messages(tok, turns, template)
    assert tok.decode([t for t in labels if t != -100]) == "4<|endoftext|>"
    assert tok.decode([t for t in both if t != -100]) == "Hello!<|endoftext|>4<|endoftext|>"
    assert DataConfig().format == "auto"


def test_sharegpt_tool_turns_become_tool_calls_and_tool_messages():
    """ShareGPT's function_call value (JSON) is an assistant turn with that tool call, observation a tool turn."""
    from finetune.data import formats

    read = formats.Form("sharegpt", ("conversations",))
    turns = [{"from": "human", "value": "3 * 7?"},
             {"from": "function_call", "value": json.dumps({"name": "calculate", "arguments": {"expression": "3*7"}})},
             {"from": "observation", "value": "21"}, {"from": "gpt", "value": "21"}]
    assert formats.to_messages(read, {"conversations": turns}) == [
        {"role": "user", "content": "3 * 7?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "3*7"}}}]},
        {"role": "tool", "content": "21"}, {"role": "assistant", "content": "21"}]


def test_no_form_mixed_forms_and_a_row_off_its_form_are_one_line_each(tmp_path, capsys):
    """Before any model: a file whose columns fit no form (the columns found and the forms accepted), an Alpaca
    training file with a ShareGPT validation file, a ShareGPT row with an unknown tag (file and row)."""
    paths = _write_forms(tmp_path)
    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"question": ["q"], "reply": ["a"]}), odd)
    bad = tmp_path / "bad_sharegpt.parquet"
    pq.write_table(pa.table({"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
                                               [{"from": "narrator", "value": "once"}]]}), bad)
    bare = tmp_path / "alpaca_bare.parquet"  # Alpaca without the optional columns
    pq.write_table(pa.table({"instruction": ["2+2?"], "output": ["4"]}), bare)
    cases = {
        (paths["alpaca"], bare): f"'{bare}' has the Alpaca columns instruction, output but '{paths['alpaca']}' has "
                                 f"instruction, output, input, system, history; give every file the same columns",
        (odd, odd): f"data.train_files: '{odd}' has the columns question, reply: no form sft reads; it reads messages",
        (paths["alpaca"], paths["sharegpt"]): f"data.train_files: '{paths['sharegpt']}' is ShareGPT (columns: "
                                              f"conversations, system) but '{paths['alpaca']}' is Alpaca: one form "
                                              f"per run",
        (bad, bad): f"'{bad}' row 1 of the ShareGPT form has a turn with 'from' 'narrator' (known: human,",
    }
    for (train, validation), want in cases.items():
        code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 'run'}", f"data.train_files=[{train}]",
                                f"data.validation_files=[{validation}]", "data.messages_column=",
                                f"data.cache_dir={tmp_path / 'c'}"], capsys)
        errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
        assert code == 2 and len(errors) == (2 if train == bad else 1), out[-2000:]
        assert want in errors[0], errors


def test_a_mixture_reads_each_source_in_its_own_form(tmp_path, capsys):
    """data.sources: an Alpaca source beside a ShareGPT one passes the checks (each source's form is its own)."""
    paths = _write_forms(tmp_path)
    sources = (f"data.sources=[{{name: a, train_files: [{paths['alpaca']}], validation_fraction: 0.25, weight: 1}}, "
               f"{{name: s, train_files: [{paths['sharegpt']}], validation_fraction: 0.25, weight: 1}}]")
    code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 'run'}", "data.train_files=[]",
                            "data.validation_files=[]", sources, "data.messages_column=",
                            f"data.cache_dir={tmp_path / 'c'}"], capsys)
    assert code == 0, out[-2000:]


def test_bundle_starting_config_names_the_recognised_form(tmp_path):
    """``finetune bundle``'s starting run config names the form ``sft`` recognises from the dataset's columns."""
    from types import SimpleNamespace

    from finetune.airgap.bundle import _recipe_guess

    def guess(*columns):
        return _recipe_guess([], [SimpleNamespace(splits={"train": {"columns": list(columns)}})], tmp_path)

    assert guess("instruction", "input", "output") == ("sft", {"format": "alpaca"})
    assert guess("conversations") == ("sft", {"format": "sharegpt"})
    assert guess("prompt", "completion") == ("sft", {"format": "prompt_completion"})
    assert guess("question", "answer") == ("sft", {"prompt_column": "question", "response_column": "answer"})


def test_a_recognised_form_under_explicit_columns_says_how_to_read_it(tmp_path, capsys):
    """Issue 68, item 9: an Alpaca or ShareGPT file given to a config naming data.prompt_column/response_column
    failed with "has no column 'question'" alone; the line now says which form the file is (recognised from its
    columns) and the two ways to read it (data.format, or clearing the column keys). A file in no form stays as
    it was."""
    paths = _write_forms(tmp_path)
    for name, form in (("alpaca", "Alpaca"), ("sharegpt", "ShareGPT")):
        code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 'run'}", f"data.train_files=[{paths[name]}]",
                                f"data.validation_files=[{paths[name]}]", "data.messages_column=",
                                "data.prompt_column=question", "data.response_column=answer",
                                f"data.cache_dir={tmp_path / 'c'}"], capsys)
        errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
        assert code == 2 and errors, out[-2000:]
        assert "has no column 'question'" in errors[0] and f"the file is in the {form} form (recognised from its columns): " \
            f"set data.format: {name}, or clear data.prompt_column and data.response_column" in errors[0], errors
        assert len([e for e in errors if paths[name].name in e]) == 2, errors  # one line per file, not per column


def test_the_form_reads_the_column_of_its_shape(tmp_path, capsys):
    """Issue 68, item 15: a ``conversations`` column of text beside a valid ``messages`` column is the messages
    form, read from ``messages`` (it read ``conversations`` and failed every row)."""
    from finetune.config import DataConfig
    from finetune.data import formats

    rows = _conversations()[:6]
    path = tmp_path / "both.parquet"
    pq.write_table(pa.table({"conversations": [r["instruction"] for r in rows],
                             "messages": [_messages(r) for r in rows]}), path)
    for fmt in ("auto", "messages"):
        assert formats.resolve(DataConfig(train_files=[str(path)], format=fmt)).columns == ("messages",), fmt
    code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 'run'}", f"data.train_files=[{path}]",
                            f"data.validation_files=[{path}]", "data.messages_column=",
                            f"data.cache_dir={tmp_path / 'c'}"], capsys)
    assert code == 0, out[-2000:]


def test_no_chat_template_names_the_form_not_an_empty_column(tmp_path, capsys):
    """Issue 68, item 9: without a chat template, an Alpaca file's line named ``data.messages_column ''``; it names
    the form the rows were recognised in."""
    paths = _write_forms(tmp_path)
    code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 'run'}", f"data.train_files=[{paths['alpaca']}]",
                            f"data.validation_files=[{paths['alpaca']}]", "data.messages_column=",
                            "data.chat_template=", f"data.cache_dir={tmp_path / 'c'}"], capsys)
    errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
    assert code == 2 and len(errors) == 1, out[-2000:]
    assert "has no chat template to render the conversations of the Alpaca file(s)" in errors[0], errors
    assert "messages_column ''" not in errors[0], errors
