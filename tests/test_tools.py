"""Tools for multi-turn ``grpo`` (:mod:`finetune.recipes.grpo.tools`): loading and their refusals, the template check,
parsing tool calls, running them (failures are the model's to read, never a crash), and the tokens of a result."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.errors import ConfigError
from finetune.recipes.grpo import tools as T

REPO = Path(__file__).resolve().parent.parent
CALCULATOR = f"{REPO}/data/tools/calculator.py:calculate"
TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ZeroDivisionError("the tool divided by zero")


def no_hint(x):
    """No type hint.

    Args:
        x: Anything.
    """
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2")
    tok.chat_template = (REPO / "data/chat_templates/chatml_tools.jinja").open().read()
    return tok


def test_loading_and_its_refusals(tool_file, tmp_path):
    tools = T.load_tools([f"{tool_file}:add", f"{tool_file}:sleepy", CALCULATOR])
    assert [t.name for t in tools] == ["add", "sleepy", "calculate"]
    assert tools[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    for spec, needle in ((f"{tool_file}:no_hint", "Argument x is missing a type hint"),
                         (f"{tmp_path}/nowhere.py:f", "is no file"), (f"{tool_file}:missing", "has no function 'missing'"),
                         ("add", "is not path/to/file.py:function (a tool)"),
                         (f"{tool_file}:add,{tool_file}:add", "two tools are named 'add'")):
        with pytest.raises(ConfigError, match="train.grpo.tools: ") as e:
            T.load_tools(spec.split(","))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_template_must_render_tools(tool_file, tokenizer):
    tools = [t.schema for t in T.load_tools([f"{tool_file}:add"])]
    assert T.template_problem(tokenizer, tools) is None
    plain = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2")
    assert "has no chat template" in T.template_problem(plain, tools)
    plain.chat_template = (REPO / "data/chat_templates/chatml.jinja").open().read()  # renders no tools
    assert "does not render the tools' schemas (no 'add'" in T.template_problem(plain, tools)


def test_calls_are_parsed_and_every_failure_is_a_message(tool_file, tokenizer):
    text = ('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "sleepy", "arguments": {"seconds": 5}}</tool_call><tool_call>{oops}</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {"x": "y"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    calls = T.parse_tool_calls(text, tokenizer)
    assert [c["name"] for c in calls] == ["add", "sleepy", None, "add", "broken", "search"]
    assert calls[3]["arguments"] == {"a": 1}  # arguments written as a JSON string are read
    assert T.parse_tool_calls("no call here", tokenizer) == []
    fns = {t.name: t.function for t in T.load_tools([f"{tool_file}:add", f"{tool_file}:sleepy", f"{tool_file}:broken"])}
    stats = T.ToolStats()
    start = time.perf_counter()
    results = [T.call_tool(fns, c, 0.3, stats) for c in calls]
    assert time.perf_counter() - start < 2  # the hanging tool is left behind after its timeout
    assert results[0] == "5"
    errors = [json.loads(r)["error"] for r in results[1:]]
    assert errors[0] == "the tool 'sleepy' did not return within 0.3 s"
    assert errors[1].startswith("the tool call is not JSON")
    assert errors[2] == "TypeError: add() missing 1 required positional argument: 'b'"
    assert errors[3] == "ZeroDivisionError: the tool divided by zero"
    assert errors[4] == "unknown tool 'search'; the tools are: add, broken, sleepy"
    assert (stats.calls, stats.failures, stats.non_text) == (6, 5, 1)  # add's int result went as str(5)
    assert stats.per_tool == {"add": 2, "sleepy": 1, "<unparsed>": 1, "broken": 1, "search": 1}


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize(("value", "text"), [(None, "None"), ({"a": 1, "b": [2]}, "{'a': 1, 'b': [2]}"), (2.5, "2.5"),
                                             ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "ab"),
                                             ([1, 2], "[1, 2]"), (_Unprintable(), "<_Unprintable>")])
def test_a_result_that_is_not_text_is_sent_as_trl_sends_it_and_counted(value, text):
    """TRL 1.16's ``str(result)`` (text content blocks: their texts); counted as ``non_text``, not a failure."""
    stats = T.ToolStats()
    assert T.call_tool({"f": lambda: value}, {"name": "f", "arguments": {}, "error": None}, 1.0, stats) == text
    assert (stats.calls, stats.failures, stats.non_text) == (1, 0, 1)


def test_a_tool_without_a_docstring_is_refused_in_one_line(tmp_path):
    """Issue 53's "a bad tool file: one line": type hints but no docstring, or an argument the docstring does not
    describe."""
    path = tmp_path / "bare.py"
    path.write_text("def bare(x: int) -> int:\n    return x\n\n\ndef partial(x: int, y: int) -> int:\n"
                    "    \"\"\"Half documented.\n\n    Args:\n        x: The first.\n    \"\"\"\n    return x\n")
    for name, needle in (("bare", "Cannot generate JSON schema for bare because it has no docstring"),
                         ("partial", "Cannot generate JSON schema for partial because the docstring has no "
                                     "description for the argument 'y'")):
        with pytest.raises(ConfigError, match=f"^train.grpo.tools: '{path}:{name}' cannot be offered as a tool: ") as e:
            T.load_tools([f"{path}:{name}"])
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_result_is_appended_as_the_template_renders_it(tokenizer):
    conversation = [{"role": "user", "content": "What is 2 + 3?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    turn = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    turn = turn[:max(i for i, t in enumerate(turn) if t == tokenizer.eos_token_id) + 1]  # sampling stops at EOS
    suffix = T.tool_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": "5"}])
    whole = tokenizer.apply_chat_template(conversation + [{"role": "tool", "name": "add", "content": "5"}],
                                          tokenize=True, add_generation_prompt=True, return_dict=False)
    assert turn + suffix == whole  # token in, token out: the sampled tokens are kept and the result follows
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|endoftext|>\n<|im_start|>assistant\n"


def test_the_calculator_computes_and_runs_nothing_else():
    from finetune.recipes.common.rewards import import_function

    calculate = import_function(CALCULATOR, "train.grpo.tools", "")
    assert [calculate(e) for e in ("(48 / 2) + 48", "2 ** 10", "7 / 2", "1,000 * 3")] == ["72", "1024", "3.5", "3000"]
    for bad in ('__import__("os").system("true")', "2 ** 1000", "x + 1"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_an_environment_offers_its_public_methods_and_scores_the_game(tmp_path):
    factory = T.load_environment(f"{REPO}/data/environments/guess_number.py:GuessNumber")
    env = factory()
    tools = T.environment_tools(env)
    assert [t.name for t in tools] == ["guess"] and tools[0].schema["function"]["parameters"]["required"] == ["number"]
    env.reset(low=1, high=16, secret=11, prompt="ignored")
    play = [env.guess(n) for n in (8, 12, 10, 11)]
    assert play == ["8 is too low: the secret is higher.", "12 is too high: the secret is lower.",
                    "10 is too low: the secret is higher.", "11 is correct."]
    assert env.get_reward() == 1.0  # 4 guesses: what bisection may need for 16 numbers
    env.reset(low=1, high=16, secret=11)
    assert env.get_reward() == 0.0
    bad = tmp_path / "envs.py"
    bad.write_text("class NoReset:\n    pass\n\n\nclass Untyped:\n    def reset(self, **row):\n        pass\n\n"
                   "    def act(self, x):\n        return x\n\n\ndef raises():\n    raise OSError('no display')\n")
    for name, needle in (("NoReset", "NoReset has no reset(**row) method"),
                         ("Untyped", "Untyped.act cannot be offered as a tool: Cannot generate JSON schema for act because it has no docstring"),
                         ("raises", "raises() failed: OSError: no display")):
        with pytest.raises(ConfigError, match="train.grpo.environment: ") as e:
            T.load_environment(f"{bad}:{name}")
        assert needle in str(e.value), str(e.value)


def test_tool_turns_append_results_unmasked_never_and_continue_together(tool_file, tokenizer):
    """A scripted model: rollout 0 calls add then answers; 1 answers at once; 2 calls add at every turn (stopped by
    max_iterations); 3 would overflow max_completion_length with its result. The model's tokens are kept as
    sampled, the results' tokens are the template's and masked, and every continuation runs in one batch per turn."""
    eos = tokenizer.eos_token_id
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = enc('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>') + [eos]
    prompts = [enc("<|im_start|>user\nq<|endoftext|>\n<|im_start|>assistant\n")] * 4
    first = [call, enc("It is 5.") + [eos], call, call]
    batches = []

    def generate_fn(inputs, max_new_tokens):
        batches.append(len(inputs))
        return [enc("It is 5.") + [eos] if len(batches) == 1 and k == 0 else call for k in range(len(inputs))]

    fns = {t.name: t.function for t in T.load_tools([f"{tool_file}:add"])}
    stats = [T.ToolStats() for _ in range(4)]
    limit = len(call) + 40  # room for one result (27 tokens) and a short reply
    out = T.tool_turns(prompts, first, generate_fn, tokenizer, [fns] * 4, 200, 2, 1.0, stats)
    suffix = T.tool_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": "5"}])
    assert out[0].ids == call + suffix + enc("It is 5.") + [eos]
    assert out[0].mask == [1] * len(call) + [0] * len(suffix) + [1] * (len(enc("It is 5.")) + 1)
    assert [m["role"] for m in out[0].turns] == ["assistant", "tool", "assistant"] and out[0].turns[1]["content"] == "5"
    assert out[1].ids == first[1] and out[1].mask == [1] * len(first[1]) and len(out[1].turns) == 1
    assert out[2].ids == (call + suffix) * 2 + call  # two tool turns, then the third call is left unanswered
    assert batches == [3, 2]  # rollouts 0, 2, 3 continue together, then 2 and 3
    assert [s.calls for s in stats] == [1, 0, 2, 2] and T.ToolStats.total(stats).per_tool == {"add": 5}
    short = T.tool_turns(prompts[:1], [call], generate_fn, tokenizer, [fns], limit - 15, 2, 1.0, [T.ToolStats()])
    assert short[0].ids == call and short[0].mask == [1] * len(call)  # no room for the result: it ends there


def test_a_template_that_fails_on_tool_messages_is_refused_in_one_line(tool_file, tokenizer):
    """A template that renders the schemas but raises on a ``tool`` message (a Jinja error of the user's template):
    one line naming the error, before any model."""
    tools = [t.schema for t in T.load_tools([f"{tool_file}:add"])]
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
                "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    problem = T.template_problem(tokenizer, tools, template)
    assert problem.startswith("the chat template cannot render tools, tool calls or tool results (") and \
        "no tool role" in problem and "\n" not in problem, problem


# Issue 68, items 2, 12, 13 and 15 (the tool parts).

MULTIPLY = '''
import sys
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def crunch(n: int) -> str:
    """Sum 0..n-1 in C code that holds the GIL (a thread cannot stop it).

    Args:
        n: How many.
    """
    return str(sum(range(n)))


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def chatty(n: int) -> str:
    """Print to stdout, then return n words.

    Args:
        n: How many words.
    """
    print("this line must not reach the caller")
    return "word " * n
'''

SMOLLM2_LIST = ('<tool_call>[{"name": "multiply", "arguments": {"a": 2, "b": 3}}, '
                '{"name": "multiply", "arguments": {"a": 4, "b": 5}}]</tool_call>')
"""SmolLM2-1.7B-Instruct's tool calls: a JSON list of calls in one ``<tool_call>`` block (its model card's function
calling system prompt, HuggingFaceTB/SmolLM2-1.7B-Instruct; the 135M model's GGUF template renders no tools)."""

HERMES_PARAMETERS = '<tool_call>\n{"name": "multiply", "parameters": {"a": 2, "b": 3}}\n</tool_call>'
"""A Hermes block with Llama-3.x's key for the arguments (``"parameters"``)."""


@pytest.fixture
def multiply_file(tmp_path):
    path = tmp_path / "calc_tools.py"
    path.write_text(MULTIPLY)
    return path


def _stock(name: str):
    """tiny-gpt2's tokenizer with a stock chat template and its turn tokens as special tokens, and the end token a
    turn stops at. The templates are the stock ones TRL 1.16 ships (``trl/chat_templates/llama3_1.jinja``:
    meta-llama/Llama-3.1-8B-Instruct's; ``qwen2_5.jinja``: Qwen/Qwen2.5-7B-Instruct's)."""
    import trl.chat_template_utils as stock

    tok = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2")
    if name == "llama3.1":
        tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                              "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                                              "<|python_tag|>"]})
        tok.chat_template, end = stock.llama3_1_chat_template, "<|eot_id|>"
    elif name == "qwen2.5":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template, end = stock.qwen2_5_chat_template, "<|im_end|>"
    else:
        tok.chat_template, end = (REPO / "data/chat_templates/chatml_tools.jinja").read_text(), tok.eos_token
    return tok, [tok.convert_tokens_to_ids(end)]


@pytest.mark.parametrize("form", ["llama3.1", "qwen2.5", "smollm2-list", "hermes-parameters"])
def test_stock_tool_call_forms_are_parsed_and_run_end_to_end(form, multiply_file):
    """Item 2: the call each stock template renders (Llama-3.1's bare ``{"name", "parameters"}`` JSON, Qwen2.5's
    ``<tool_call>``), SmolLM2's list of calls and a ``"parameters"`` key inside ``<tool_call>`` are run: the template
    check passes, the tool runs (in its worker process) and its result follows the call as the template renders it,
    then the model's next turn."""
    tok, stops = _stock(form if form in ("llama3.1", "qwen2.5") else "chatml")
    tools = T.load_tools([f"{multiply_file}:multiply"])
    schemas = [t.schema for t in tools]
    assert T.template_problem(tok, schemas, stops=stops) is None
    messages = [{"role": "user", "content": "What is 2 times 3?"}]
    prompt = tok.apply_chat_template(messages, tools=schemas, tokenize=True, add_generation_prompt=True,
                                     return_dict=False)
    if form in ("llama3.1", "qwen2.5"):
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}]}
        whole = tok.apply_chat_template(messages + [call], tools=schemas, tokenize=True, return_dict=False)
        turn = whole[len(prompt):]
        turn = turn[:max(i for i, t in enumerate(turn) if t in stops) + 1]  # sampling stops at the end token
    else:
        turn = tok(SMOLLM2_LIST if form == "smollm2-list" else HERMES_PARAMETERS,
                   add_special_tokens=False)["input_ids"] + stops
    reply = tok("It is 6.", add_special_tokens=False)["input_ids"] + stops
    stats = [T.ToolStats()]
    out = T.tool_turns([prompt], [turn], lambda inputs, budget: [reply for _ in inputs], tok,
                       [{t.name: t.function for t in tools}], 400, 2, 30.0, stats, None, stops)[0]
    results = ["6", "20"] if form == "smollm2-list" else ["6"]
    assert [m["content"] for m in out.turns if m["role"] == "tool"] == results, out.turns
    assert (stats[0].calls, stats[0].failures, stats[0].per_tool) == (len(results), 0, {"multiply": len(results)})
    suffix = T.tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": r} for r in results], None,
                               stops)
    assert out.ids == turn + suffix + reply and out.mask == [1] * len(turn) + [0] * len(suffix) + [1] * len(reply)
    assert not out.cut


def test_a_template_whose_tool_calls_cannot_be_read_is_refused(tool_file, tokenizer):
    """Item 2: a template that writes tool calls in a form neither the tokenizer's response template, TRL's for a
    stock template nor the Hermes ``<tool_call>`` parser reads is refused before any model (was: the calls parsed
    to nothing, silently)."""
    tools = [t.schema for t in T.load_tools([f"{tool_file}:add"])]
    template = ("{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
                "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}{% endfor %}"
                "{% else %}{{ m.content }}{% endif %}<|endoftext|>\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    problem = T.template_problem(tokenizer, tools, template)
    assert problem is not None and problem.startswith("the chat template writes a tool call as 'CALL add") and \
        "\n" not in problem, problem


def test_deep_or_broken_calls_are_errors_for_the_model_never_a_crash(tokenizer):
    """Item 12: 1,000 nested brackets inside ``<tool_call>`` (or as string arguments) are an error the model
    reads, never a ``RecursionError`` that ends the rank."""
    for text in ("<tool_call>" + "[" * 1000 + "</tool_call>",
                 '<tool_call>{"name": "add", "arguments": "' + "[" * 1000 + '"}</tool_call>'):
        calls = T.parse_tool_calls(text, tokenizer)
        assert len(calls) == 1 and calls[0]["error"] and "nest" in calls[0]["error"], calls


def test_a_tool_stuck_in_c_code_is_stopped_by_its_timeout_and_replaced(multiply_file):
    """Item 12 and item 15: a tool call runs in the rank's worker process, so a call stuck in C code that holds
    the GIL is killed at ``tool_timeout_s`` (a thread could not be stopped) and the next call gets a fresh worker;
    slow calls leave no thread behind; what a tool prints never mixes with its result."""
    import threading

    fns = {t.name: t.function for t in T.load_tools([f"{multiply_file}:{n}" for n in ("crunch", "nap", "multiply",
                                                                                      "chatty")])}
    stats = T.ToolStats()
    assert T.call_tool(fns, {"name": "multiply", "arguments": {"a": 6, "b": 7}, "error": None}, 30.0, stats) == "42"
    threads = threading.active_count()
    start = time.perf_counter()
    stuck = T.call_tool(fns, {"name": "crunch", "arguments": {"n": 4 * 10 ** 8}, "error": None}, 0.5, stats)
    assert time.perf_counter() - start < 4 and json.loads(stuck) == {
        "error": "the tool 'crunch' did not return within 0.5 s"}
    for _ in range(4):
        T.call_tool(fns, {"name": "nap", "arguments": {"seconds": 5}, "error": None}, 0.2, stats)
    assert threading.active_count() == threads  # no thread left running a slow call
    assert T.call_tool(fns, {"name": "multiply", "arguments": {"a": 2, "b": 3}, "error": None}, 30.0, stats) == "6"
    assert T.call_tool(fns, {"name": "chatty", "arguments": {"n": 2}, "error": None}, 30.0, stats) == "word word "
    assert (stats.calls, stats.failures, stats.non_text) == (8, 5, 2)


def test_the_calculator_is_safe_by_construction():
    """Item 12: results too large to compute quickly are refused before they are computed (the exponent check
    alone let ``((((9**64)**64)**64)**64)`` run for 31 s)."""
    from finetune.recipes.common.rewards import import_function

    calculate = import_function(CALCULATOR, "train.grpo.tools", "")
    for bad in ("(9**64)**64", "((((9**64)**64)**64)**64)", "2**64**64", "(10**300)*(10**300)", "(-8) ** 0.5"):
        start = time.perf_counter()
        with pytest.raises(ValueError):
            calculate(bad)
        assert time.perf_counter() - start < 0.1, bad
    assert calculate("2 ** 64") == "18446744073709551616" and calculate("1.5 ** 2") == "2.25"


def test_a_huge_result_is_not_tokenized_and_a_cut_rollout_is_truncated(multiply_file, tokenizer):
    """Item 15: a 4 MB result is known not to fit from its length (the tokenizer's longest token bounds its
    characters per token) without tokenizing it; the rollout cut there is truncated (not terminated), so
    ``mask_truncated_completions`` applies to it."""
    fns = {t.name: t.function for t in T.load_tools([f"{multiply_file}:chatty"])}
    eos = tokenizer.eos_token_id
    call = tokenizer('<tool_call>{"name": "chatty", "arguments": {"n": 800000}}</tool_call>',
                     add_special_tokens=False)["input_ids"] + [eos]
    start = time.perf_counter()
    out = T.tool_turns([[1, 2]], [call], lambda inputs, budget: [[eos] for _ in inputs], tokenizer, [fns], 200, 2,
                       30.0, [T.ToolStats()])[0]
    assert time.perf_counter() - start < 2
    assert out.ids == call and out.cut  # no room for the result: cut, and marked so


def test_a_property_of_an_environment_is_not_a_tool_and_a_text_reward_is_refused(tmp_path):
    """Item 15: an environment's ``@property`` is not read to list its tools (one that needs ``reset()`` crashed
    ``--check``); ``get_reward`` returning the text ``"0.5"`` is refused as every reward function's text is."""
    from finetune.recipes.common import rewards
    from finetune.recipes.grpo.agent import environment_reward

    path = tmp_path / "env.py"
    path.write_text("class Env:\n    def reset(self, **row):\n        self._state = 1\n\n    @property\n"
                    "    def state(self) -> int:\n        return self._state\n\n    def get_reward(self):\n"
                    "        return '0.5'\n")
    factory = T.load_environment(f"{path}:Env")
    assert T.environment_tools(factory()) == []
    env = factory()
    env.reset()
    table = [rewards.RewardFunction(f"{path}:Env", "Env", environment_reward, 1.0)]
    with pytest.raises(rewards.RewardError, match="returned '0.5' \\(a str\\)"):
        rewards.score(table, ["p"], ["c"], [[1]], {"environments": [env]})


@pytest.mark.parametrize(("body", "what"), [("import sys\nsys.exit(3)\n", "SystemExit: 3"),
                                             ("raise KeyboardInterrupt('stop')\n", "KeyboardInterrupt: stop")])
def test_a_tool_file_that_exits_at_import_is_refused_in_one_line(tmp_path, body, what):
    """Item 15: ``sys.exit`` or ``KeyboardInterrupt`` at import is a ConfigError (was: ``--check`` passed silently,
    or a traceback)."""
    path = tmp_path / f"exits_{abs(hash(body))}.py"
    path.write_text(body + "\n\ndef f(x: int) -> int:\n    '''F.\n\n    Args:\n        x: x.\n    '''\n    return x\n")
    with pytest.raises(ConfigError, match=f"train.grpo.tools: importing '{path}' failed: {what}"):
        T.load_tools([f"{path}:f"])


def test_a_rollout_cut_for_its_results_is_truncated_in_the_step(multiply_file):
    """Item 15, settled: a rollout whose tool results did not fit ended with its call's end token and counted as
    terminated, so ``mask_truncated_completions`` left it in; the step's ``terminated`` is now False for it (a
    rollout that answered is still terminated)."""
    import torch

    from finetune.config import GrpoConfig
    from finetune.recipes.grpo.agent import Agent, multi_turn

    tok = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2")
    tok.chat_template, tok.pad_token = (REPO / "data/chat_templates/chatml_tools.jinja").read_text(), tok.eos_token
    eos = tok.eos_token_id
    tools = T.load_tools([f"{multiply_file}:chatty"])
    call = tok('<tool_call>{"name": "chatty", "arguments": {"n": 60}}</tool_call>', add_special_tokens=False)[
        "input_ids"] + [eos]
    answer = tok("It is 6.", add_special_tokens=False)["input_ids"] + [eos]
    ids = torch.full((2, len(call)), eos)
    ids[0], ids[1, :len(answer)] = torch.tensor(call), torch.tensor(answer)
    g = GrpoConfig(max_completion_length=len(call) + 30, max_tool_calling_iterations=2, tool_timeout_s=30.0)
    out, turns, stats = multi_turn({"completion_ids": ids, "lengths": torch.tensor([len(call), len(answer)])},
                                   {"input_ids": torch.ones(2, 2, dtype=torch.long),
                                    "attention_mask": torch.ones(2, 2, dtype=torch.long)},
                                   None, tok, g, Agent(tools, None, [t.schema for t in tools]), [None, None], None)
    assert out["terminated"].tolist() == [False, True] and stats.calls == 1 and len(turns[0]) == 1
