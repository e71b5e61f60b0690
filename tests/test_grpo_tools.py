"""Multi-turn ``grpo`` with tools: the model's own tokens trained exactly, the tools' never.

Parity (tests/grpo_tool_forced.py: scripted turns that call the shipped calculator, teacher-forced, the tool
results rendered by the template): one launch's loss and gradient norm per step equal a one-process PyTorch
reference that builds every rollout the textbook way (prompt, turns, results), runs each sequence alone and
unpadded, and masks the results' tokens out of the ``dapo`` token mean; the same reference with the results'
tokens left in differs. ZeRO-3 with every parameter partitioned (``stage3_param_persistence_threshold: 0``),
2 ranks x accumulation 2: rollouts whose numbers of turns differ between ranks never hang a collective.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import CONFIGS, REPO, launch, ok, read_metrics, scratch_model
from finetune.config import load_run_config

CONFIG = CONFIGS / "tiny_grpo.yaml"
TEMPLATE = REPO / "data/chat_templates/chatml_tools.jinja"


def _prompts(path) -> str:
    """The first 16 GSM8K questions as one-message conversations (tools need a chat template)."""
    t = pq.read_table(REPO / "data/gsm8k/train.parquet").slice(0, 16)
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a}
            for q, a in zip(t.column("question").to_pylist(), t.column("answer").to_pylist())]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _overrides(tmp_path) -> list[str]:
    data = _prompts(tmp_path / "prompts.parquet")
    return [f"data.train_files=[{data}]", f"data.validation_files=[{data}]", "data.prompt_column=prompt",
            f"data.chat_template={TEMPLATE}", "data.max_seq_len=384", f"data.cache_dir={tmp_path / 'cache'}",
            f"train.grpo.tools=[{REPO}/data/tools/calculator.py:calculate]", "train.grpo.max_tool_calling_iterations=2",
            "train.grpo.max_completion_length=96", "train.grpo.rewards=[tests/grpo_rewards.py:has_digit]",
            "train.grpo.reward_weights=[]", "train.grpo.length_cache=0", "train.max_steps=2"]


def tool_reference(cfg, world: int, steps: int, masked: bool = True) -> dict:
    """One process, the textbook way: the toolkit's global batches (same sampler and collator per simulated rank),
    each prompt's rollouts built by :func:`grpo_tool_forced.reference_trajectory` (turns, then the calculator's
    results rendered by the template), each sequence run alone and unpadded, ``has_digit`` of its text, group
    advantages from ``torch.std``, TRL's per-token loss summed over the model's tokens (``masked``; else over
    every completion token) and divided by their number in the whole global batch (``dapo``); the same init,
    AdamW, schedule and clipping."""
    from conftest import reference_optimizer, simulated_ranks
    from grpo_rewards import has_digit
    from grpo_tool_forced import reference_trajectory

    torch.set_num_threads(1)
    t, g = cfg.train, cfg.train.grpo
    tok, _, _, samplers, loaders = simulated_ranks(cfg, world, configured=True)
    template = TEMPLATE.read_text()
    model = scratch_model(cfg).train()
    step = reference_optimizer(model, t, steps)
    its = []
    for smp, dl in zip(samplers, loaders):
        smp.set_epoch(0)
        its.append(iter(dl))
    out = {"losses": [], "grad_norms": [], "tool_tokens": 0, "calls": 0}
    for _ in range(steps):
        seqs = []
        for b in [next(it) for it in its for _ in range(t.gradient_accumulation_steps)]:
            for ids, mask in zip(b["input_ids"], b["attention_mask"]):
                prompt = ids[mask.bool()].tolist()
                group = [reference_trajectory(prompt, k, g.num_generations, tok, g.max_completion_length, template)
                         for k in range(g.num_generations)]
                texts = [tok.decode(c[:-1] if c[-1] == tok.eos_token_id else c, skip_special_tokens=True)
                         for c, _ in group]
                r = torch.tensor([v or 0.0 for v in has_digit(None, texts)])
                adv = (r - r.mean()) / (r.std() + 1e-4)
                seqs += [(prompt, c, m if masked else [1] * len(c), a) for (c, m), a in zip(group, adv.tolist())]
                out["tool_tokens"] += sum(len(m) - sum(m) for _, m in group)
                out["calls"] += sum(tok.decode(c).count("<tool_call>") for c, _ in group)
        total = sum(sum(m) for _, _, m, _ in seqs)
        loss = torch.zeros(())
        for prompt, c, m, a in seqs:
            x = torch.tensor([prompt + c])
            logits = model(input_ids=x).logits[0, len(prompt) - 1:-1].float() / g.temperature
            logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            ratio = torch.exp(logps - logps.detach())
            per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - g.epsilon, 1 + g.epsilon) * a)
            kept = (per_token * torch.tensor(m, dtype=torch.float32)).sum()
            # dapo: the global batch's token mean; grpo: each completion's token mean, averaged over completions
            loss = loss + (kept / total if g.loss_type == "dapo" else kept / sum(m) / len(seqs))
        loss.backward()
        out["grad_norms"].append(step())
        out["losses"].append(loss.item())
    return out


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
@pytest.mark.parametrize(("stage", "loss_type"), [(3, "dapo"), (0, "grpo")])
def test_tool_turns_equal_the_textbook_and_the_tools_tokens_are_never_trained(tmp_path, stage, loss_type):
    from test_dpo import grad_norms, max_rel

    overrides = [*_overrides(tmp_path), f"train.grpo.loss_type={loss_type}"]
    run = tmp_path / "run"
    ok(launch(CONFIG, [f"output_dir={run}", *overrides, f"ds.zero_optimization.stage={stage}"],
              script="tests/grpo_tool_forced.py"))
    rows = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    losses, norms = [rows[1]["train/loss"], rows[2]["train/loss"]], grad_norms(run)
    cfg = load_run_config(CONFIG, overrides)
    ref = tool_reference(cfg, world=2, steps=2)
    assert ref["calls"] > 8 and ref["tool_tokens"] > 100, ref  # the scripted turns call the calculator often
    if loss_type == "grpo":  # a completion's advantage is one per token: its token mean is -A, and sum(A) = 0
        assert max(abs(x) for x in losses + ref["losses"]) <= 1e-6, (losses, ref["losses"])
    else:
        assert max_rel(losses, ref["losses"]) <= 1e-5, (losses, ref["losses"])
    assert max_rel(norms, ref["grad_norms"]) <= 1e-4, (norms, ref["grad_norms"])
    unmasked = tool_reference(cfg, world=2, steps=1, masked=False)  # the results' tokens trained too: another step
    assert max_rel(norms[:1] if loss_type == "grpo" else losses[:1],
                   unmasked["grad_norms"] if loss_type == "grpo" else unmasked["losses"]) > 1e-2, unmasked
    assert all(0 < rows[s]["train/tools/call_frequency"] for s in (1, 2))
    assert all(rows[s]["train/tools/failure_frequency"] == 0 for s in (1, 2))  # every call computed
    assert all(1 <= rows[s]["train/tools/turns_mean"] <= 3 for s in (1, 2))
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    called = [r for r in logged if any(t["role"] == "tool" for t in r["turns"])]
    assert called, logged  # the transcript: the call, the calculator's result, the next turn
    first = called[0]["turns"]
    assert first[0]["role"] == "assistant" and first[0]["tool_calls"][0]["name"] == "calculate"
    a, b = (int(x) for x in first[0]["tool_calls"][0]["arguments"]["expression"].split(" + "))
    assert first[1] == {"role": "tool", "name": "calculate", "content": str(a + b)}
    _recorded_tokens_are_the_textbook_rollouts(run, cfg, logged)


def _recorded_tokens_are_the_textbook_rollouts(run, cfg, logged: list[dict]) -> None:
    """Each logged rollout's ``completion_ids`` and ``trained`` mask (``completions.jsonl``) are the textbook
    rollout's ids and model mask (rank 0's first prompt, rollouts 0-3 of each step); ``finetune inspect
    --completions`` prints them with the model's tokens in ``[[...]]`` and the calculator's results outside."""
    from finetune.commands import inspect
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe
    from grpo_tool_forced import reference_trajectory

    recipe = get_recipe("grpo").configure(get_recipe("grpo"), cfg)
    tok = load_tokenizer(cfg, recipe)
    encode, g = recipe.tokenize_function(tok, cfg.data).encode, cfg.train.grpo
    for k, row in enumerate(logged):
        ids, model = reference_trajectory(encode(row["prompt"]), k % g.num_generations, g.num_generations, tok,
                                          g.max_completion_length, TEMPLATE.read_text())
        assert (row["completion_ids"], row["trained"]) == (ids, model), k
    assert any(0 in row["trained"] for row in logged)  # some rollout holds a tool result, not trained
    with capture() as out:
        assert inspect.main(["--completions", str(run), "--step", "1", "--color", "never"]) == 0
    text = out.getvalue()
    assert "step 1 (logged steps: 1, 2), rollouts 0-3 of 4 logged" in text, text
    called = next(i for i, row in enumerate(logged[:4]) if 0 in row["trained"])
    shown = text.split("--- step 1 rollout ")[called + 1]
    result = [t for t in logged[called]["turns"] if t["role"] == "tool"][0]["content"]
    assert f"{sum(logged[called]['trained'])} trained (the model's)" in shown, shown
    assert "[[<tool_call>" in shown, shown
    start = shown.index("<tool_response>")
    response = shown[start:shown.index("</tool_response>", start)]
    assert result in response and "[[" not in response and "]]" not in response, shown  # the result: not trained


def capture():
    """stdout into a StringIO (``with capture() as out``)."""
    import contextlib
    import io

    return contextlib.redirect_stdout(io.StringIO())


def test_check_refuses_bad_tools_and_environments_in_one_line_each(tmp_path, capsys):
    """``--check``, before any model: a tool file that does not import, a function without type hints, a template
    that renders no tools, a backend and a ZeRO-3 mode the loop cannot run, an environment without reset, text
    prompts: one line each, exit 2."""
    from conftest import check_files

    prompts = tmp_path / "prompts.parquet"
    _prompts(prompts)
    tools = tmp_path / "tools.py"
    tools.write_text("def untyped(x):\n    '''No hint.\n\n    Args:\n        x: x.\n    '''\n\n\nclass Env:\n    pass\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module\n")
    base = ["data.prompt_column=prompt", f"data.chat_template={TEMPLATE}", "data.max_seq_len=384",
            "train.grpo.rewards=[tests/grpo_rewards.py:has_digit]", "train.grpo.reward_weights=[]"]
    assert check_files(CONFIG, tmp_path, [prompts], [*base, f"train.grpo.tools=[{broken}:f,{tools}:untyped]",
                                                     "train.grpo.generation_backend=hybrid_engine",
                                                     "train.grpo.gather_for_generation=false",
                                                     "train.grpo.max_tool_calling_iterations=0"]) == 2
    err = capsys.readouterr().err
    for line in (f"train.grpo.tools: importing '{broken}' failed: ModuleNotFoundError: No module named 'not_a_module'",
                 "train.grpo.generation_backend: hybrid_engine runs single-turn rollouts only",
                 "train.grpo.gather_for_generation: false makes every rank generate in lockstep",
                 "train.grpo.max_tool_calling_iterations: 0 must be >= 1"):
        assert line in err, (line, err)
    assert check_files(CONFIG, tmp_path, [prompts], [*base, f"train.grpo.tools=[{tools}:untyped]"]) == 2
    assert "tools.py:untyped' cannot be offered as a tool: Argument x is missing a type hint" in capsys.readouterr().err
    plain = [o.replace(str(TEMPLATE), str(REPO / "data/chat_templates/chatml.jinja")) for o in base]
    assert check_files(CONFIG, tmp_path, [prompts], [*plain, f"train.grpo.tools=[{REPO}/data/tools/calculator.py:calculate]"]) == 2
    assert "data.chat_template: the chat template does not render the tools' schemas (no 'calculate'" in \
        capsys.readouterr().err
    assert check_files(CONFIG, tmp_path, [prompts], [*base, f"train.grpo.environment={tools}:Env"]) == 2
    assert "train.grpo.environment: Env has no reset(**row) method" in capsys.readouterr().err
    env = f"train.grpo.environment={REPO}/data/environments/guess_number.py:GuessNumber"
    assert check_files(CONFIG, tmp_path, [prompts], [*base, env]) == 0, capsys.readouterr().err  # the example passes


def test_a_tool_named_like_an_environment_method_is_refused(tmp_path, capsys):
    """Issue 68 item 13: a tool named like a method of the environment (both offered as tools) is refused by
    ``--check`` in one line (was: two schemas named ``guess``, the environment's run, the count doubled)."""
    from conftest import check_files

    prompts = tmp_path / "prompts.parquet"
    _prompts(prompts)
    tools = tmp_path / "tools.py"
    tools.write_text("def guess(number: int) -> str:\n    '''Guess.\n\n    Args:\n        number: n.\n    '''\n"
                     "    return str(number)\n")
    assert check_files(CONFIG, tmp_path, [prompts], [
        "data.prompt_column=prompt", f"data.chat_template={TEMPLATE}", "data.max_seq_len=384",
        "train.grpo.rewards=[tests/grpo_rewards.py:has_digit]", "train.grpo.reward_weights=[]",
        f"train.grpo.tools=[{tools}:guess]",
        f"train.grpo.environment={REPO}/data/environments/guess_number.py:GuessNumber"]) == 2
    err = capsys.readouterr().err
    assert (f"train.grpo.environment: GuessNumber.guess has the name of the tool {tools}:guess (train.grpo.tools); "
            f"rename one") in err, err


def test_inspect_completions_marks_the_recorded_mask_and_refuses_what_it_cannot_show(tmp_path, capsys):
    """``finetune inspect --completions``, in process: a run folder's recorded rollout (``completion_ids``,
    ``trained``) decoded with the run's tokenizer, the runs of trained tokens in ``[[...]]``, the others bare; one
    line and exit 2 for a missing file, a line that is not JSON, rows without the token record, a step not logged,
    and a run config given beside ``--completions``."""
    from finetune.commands import inspect
    from finetune.config import config_to_dict, dump_yaml
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    cfg = load_run_config(CONFIG, _overrides(tmp_path))
    tok = load_tokenizer(cfg, get_recipe("grpo").configure(get_recipe("grpo"), cfg))
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.yaml").write_text(dump_yaml(config_to_dict(cfg)))
    call = tok(" call it", add_special_tokens=False)["input_ids"]
    result = tok(" RESULT 42", add_special_tokens=False)["input_ids"]
    answer = tok(" the answer", add_special_tokens=False)["input_ids"]
    row = {"step": 2, "prompt": [{"role": "user", "content": "What is 6 x 7?"}], "completion": "", "reward": 1.0,
           "advantage": 0.5, "completion_ids": call + result + answer,
           "trained": [1] * len(call) + [0] * len(result) + [1] * len(answer)}
    (run / "completions.jsonl").write_text(json.dumps(row) + "\n")
    assert inspect.main(["--completions", str(run), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "step 2 (logged steps: 2), rollouts 0-0 of 1 logged" in out, out
    assert f"{len(row['trained'])} completion tokens, {len(call) + len(answer)} trained (the model's)" in out, out
    assert "prompt: What is 6 x 7?\n [[call it]] RESULT 42 [[the answer]]\n" in out, out

    def refused(argv: list[str], words: str) -> None:
        assert inspect.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err

    refused(["--completions", str(run), "--step", "5"], "has no rows of step 5; logged steps: 2")
    refused(["--completions", str(tmp_path / "nowhere")], "nowhere does not exist (a grpo run folder writes completions.jsonl")
    refused(["--completions", str(run), str(CONFIG)], "give a run folder or a run config, not both")
    (run / "completions.jsonl").write_text(json.dumps({k: v for k, v in row.items() if k != "trained"}) + "\n")
    refused(["--completions", str(run)], "hold no token record (completion_ids, trained)")
    (run / "completions.jsonl").write_text(json.dumps(row) + "\n{not json\n")
    refused(["--completions", str(run / "completions.jsonl")], "completions.jsonl line 2 is not JSON")


def test_the_shipped_calculator_data_is_the_scripts_and_every_demonstrated_call_returns_the_answer(tmp_path):
    """``data/calculator`` (the SmolLM2 tool chain's data) is what ``scripts/make_arithmetic_data.py --task mul
    --demos 256`` writes; half of its demonstrations call the shipped calculator with the question's expression,
    whose result is the product, and every demonstration ends with the product; the calculator's schema is the one
    ``train.grpo.tools`` offers (transformers' ``get_json_schema``)."""
    import importlib.util

    from finetune.recipes.grpo.tools import load_tools

    spec = importlib.util.spec_from_file_location("make_arithmetic_data", REPO / "scripts/make_arithmetic_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    train, test = script.make("mul", 2000, 200)
    shipped = REPO / "data/calculator"
    for name, rows in (("train", train), ("test", test)):
        script.write(rows, tmp_path / f"{name}.parquet")
        assert pq.read_table(tmp_path / f"{name}.parquet").equals(pq.read_table(shipped / f"{name}.parquet")), name
    script.write_demos(script.demos(train, 256, 0.5), tmp_path / "train_chat.parquet")
    demos = pq.read_table(shipped / "train_chat.parquet")
    assert pq.read_table(tmp_path / "train_chat.parquet").equals(demos)
    calls = 0
    for row, question in zip(demos.to_pylist(), train):
        a, b = (int(x) for x in question["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" * "))
        turns = row["messages"]
        assert turns[-1] == {"role": "assistant", "content": f"The answer is {a * b}.", "tool_calls": None,
                             "name": None}
        if len(turns) == 4:
            calls += 1
            assert json.loads(turns[1]["tool_calls"][0]["function"]["arguments"]) == {"expression": f"{a} * {b}"}
            assert turns[2] == {"role": "tool", "content": str(a * b), "tool_calls": None, "name": "calculate"}
    assert calls == 128
    offered = load_tools([f"{REPO}/data/tools/calculator.py:calculate"])
    assert json.loads(demos.column("tools")[0].as_py()) == [t.schema for t in offered]
