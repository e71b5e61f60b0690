"""Tools for multi-turn ``grpo`` (:mod:`finetune.recipes.tools`): loading and their refusals, the template check,
parsing tool calls, running them (failures are the model's to read, never a crash), and the tokens of a result."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.errors import ConfigError
from finetune.recipes import tools as T

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
    from finetune.recipes.rewards import import_function

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
