"""Multi-turn ``grpo`` with an environment, in one process (:mod:`finetune.recipes.grpo.agent`): the first
observation ``reset(**row)`` returns (TRL 1.16's ``environment_factory`` contract) becomes part of the rollout's
prompt, rendered by the chat template, never trained; rollouts of one group may then start from different prompts,
and the training pass runs each with its own (no prompt sharing), with the same log-probabilities as each sequence
run alone."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import CONFIGS, REPO, scratch_model
from finetune.config import load_run_config
from finetune.errors import RunFailure
from finetune.recipes import get_recipe, grpo
from finetune.recipes.grpo import agent as agent_mod

CONFIG = CONFIGS / "tiny_grpo.yaml"
TEMPLATE = REPO / "data/chat_templates/chatml_tools.jinja"
ENVIRONMENTS = '''
class Lamp:
    """A lamp to switch on; reset says which room it is in, and, with ``numbered``, which rollout this is."""

    made = 0

    def __init__(self):
        Lamp.made += 1
        self._number, self._on = Lamp.made, False

    def reset(self, answer, room, **row):
        """The first observation: the room (the row's) and, in odd rooms, the instance's number (so the rollouts of
        one prompt start from different prompts)."""
        self._room = room
        return f" (You are in the {room}." + (f" Lamp {self._number}.)" if len(room) % 2 else ")")

    def switch(self, on: bool) -> str:
        """Switch the lamp.

        Args:
            on: On or off.
        """
        self._on = bool(on)
        return "on" if self._on else "off"

    def get_reward(self) -> float:
        """1 when the lamp is on."""
        return float(self._on)


class Silent(Lamp):
    def reset(self, answer, room, **row):
        """No observation: the prompt states the task."""
        return None


class Loud(Lamp):
    def reset(self, answer, room, **row):
        """An observation that is not text."""
        return {"room": room}
'''


def _setup(tmp_path, factory: str, rooms=("hall", "kitchen")):
    env = tmp_path / "lamps.py"
    env.write_text(ENVIRONMENTS)
    data = tmp_path / "prompts.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"Switch the lamp on, please ({i})."}], "answer": "on",
             "room": room} for i, room in enumerate(rooms)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    overrides = [f"data.train_files=[{data}]", f"data.validation_files=[{data}]", "data.prompt_column=prompt",
                 "data.reward_columns=[answer,room]", f"data.chat_template={TEMPLATE}", "data.max_seq_len=384",
                 f"train.grpo.environment={env}:{factory}", "train.grpo.rewards=[]", "train.grpo.reward_weights=[]",
                 "train.grpo.num_generations=3", "train.grpo.max_completion_length=6", "train.grpo.log_completions=8",
                 f"output_dir={tmp_path / 'run'}"]
    cfg = load_run_config(CONFIG, overrides)
    (tmp_path / "run").mkdir()
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    recipe = get_recipe("grpo").configure(get_recipe("grpo"), cfg)
    tok = load_tokenizer(cfg, recipe)
    fn = recipe.tokenize_function(tok, cfg.data)
    table = pq.read_table(data).to_pydict()
    tokenized = fn({k: table[k] for k in ("prompt", "answer", "room")})
    prompt_rows = [{k: tokenized[k][i] for k in tokenized} | {"_seed": i} for i in range(len(rows))]
    batch = recipe.make_collator(tok, cfg.data)(prompt_rows)
    return cfg, tok, fn, batch


def test_the_reset_observation_is_the_rollouts_prompt_and_never_trained(tmp_path):
    """``reset`` returns text: each rollout's prompt is the row's with the observation appended to its last message
    (TRL's ``content + observation``), rendered with the tools offered; its tokens are prompt (labels -100, outside
    ``completion_mask``); completions.jsonl shows it. The kitchen's observations number the instances, so its group's
    prompts differ: prompt sharing is off for that micro-batch, and the loss's log-probabilities equal each sequence
    run alone."""
    cfg, tok, fn, batch = _setup(tmp_path, "Lamp")
    model = scratch_model(cfg).eval()
    out = grpo._generate_and_score(model, [batch], cfg, 0)
    assert len(out) == 1
    b, g = out[0], cfg.train.grpo.num_generations
    p = int(b["prompt_length"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 2 * g
    prompts = [r["prompt"] for r in logged]
    for k in range(g):  # the hall's: one observation for all; the kitchen's: one per instance
        assert prompts[k][-1]["content"] == "Switch the lamp on, please (0). (You are in the hall.)"
        assert prompts[g + k][-1]["content"].startswith("Switch the lamp on, please (1). (You are in the kitchen. Lamp ")
    assert len({json.dumps(x) for x in prompts[g:]}) == g  # the kitchen's rollouts start from different prompts
    for i, messages in enumerate(prompts):  # the sequence's prompt: the observed messages as the template renders them
        expected = fn.encode(messages)
        real = b["input_ids"][i, :p][b["attention_mask"][i, :p].bool()].tolist()
        assert real == expected, i
        assert "<tools>" in tok.decode(real) and "switch" in tok.decode(real)  # the tools' schemas offered
        assert (b["labels"][i, :p] == -100).all()  # never trained
    assert "You are in the hall" not in tok.decode(batch["input_ids"][0])  # the data's own prompt has none
    assert bool(b["prompts_differ"]) and not grpo.shares_prompts(model, b, True)
    # per-tool calls: one column per offered tool (the environment's switch), then calls naming none
    assert b["tool_calls_by_name"].shape == (2 * g, 2)
    assert torch.equal(b["tool_calls_by_name"].sum(1), b["tool_calls"])
    recipe = get_recipe("grpo").configure(get_recipe("grpo"), cfg)
    m = recipe.forward(model, b, metrics=True).metrics
    assert {"tools/switch/call_frequency", "tools/(unknown)/call_frequency"} <= set(m)
    logps, _ = grpo.completion_logps(model, b, cfg.train.grpo.temperature, share=True)
    for i in range(len(b["input_ids"])):  # each sequence alone, unpadded: the same log-probabilities
        ids = b["input_ids"][i][b["attention_mask"][i].bool()]
        n_prompt = int(b["attention_mask"][i, :p].sum())
        n = int(b["lengths"][i])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, n_prompt - 1:n_prompt + n - 1].float()
        alone = torch.log_softmax(logits / cfg.train.grpo.temperature, -1).gather(-1, ids[n_prompt:, None]).squeeze(-1)
        assert torch.allclose(logps[i, :n], alone, atol=1e-5), i


def test_equal_observations_keep_prompt_sharing_and_no_observation_keeps_the_datas_prompts(tmp_path):
    """Observations that depend on the row only (even rooms): a group's prompts are equal, prompt sharing stays on
    and gives the unshared log-probabilities. ``reset`` returning None: the rollouts start from the data's prompts
    (the path without observations, unchanged)."""
    cfg, tok, _, batch = _setup(tmp_path, "Lamp", rooms=("hall", "cellar"))
    model = scratch_model(cfg).eval()
    b = grpo._generate_and_score(model, [batch], cfg, 0)[0]
    assert not bool(b["prompts_differ"]) and grpo.shares_prompts(model, b, True)
    shared, _ = grpo.completion_logps(model, b, cfg.train.grpo.temperature, share=True)
    plain, _ = grpo.completion_logps(model, b, cfg.train.grpo.temperature, share=False)
    assert torch.allclose(shared * b["completion_mask"], plain * b["completion_mask"], atol=1e-5)
    assert "(You are in the cellar.)<|endoftext|>" in tok.decode(b["input_ids"][-1])

    silent = tmp_path / "silent"
    silent.mkdir()
    cfg, tok, _, batch = _setup(silent, "Silent")
    b = grpo._generate_and_score(model, [batch], cfg, 0)[0]
    p, g = int(b["prompt_length"]), cfg.train.grpo.num_generations
    assert torch.equal(b["input_ids"][:, :p], batch["input_ids"].repeat_interleave(g, 0))
    assert not bool(b["prompts_differ"])


def test_a_reset_that_returns_other_than_text_stops_in_one_line(tmp_path):
    cfg, tok, _, batch = _setup(tmp_path, "Loud")
    agent = agent_mod.agent_of(cfg)
    with pytest.raises(RunFailure, match=r"^grpo: train.grpo.environment: Loud.reset returned a dict; return None "
                                         r"or the first observation as text"):
        agent_mod.start_environments(agent, {"answer": ["on"], "room": ["hall"]}, 1)


def test_observe_appends_to_the_last_message_as_trl_does():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]
    assert agent_mod.observe(messages, " Door open.") == [messages[0], {"role": "user", "content": "Go. Door open."}]
    assert messages[1]["content"] == "Go." and agent_mod.observe(messages, None) is messages


def test_inspect_shows_a_multi_turn_rollout_with_the_models_tokens_marked(tmp_path, capsys):
    """``finetune inspect`` on a grpo config with the shipped guessing game: the rows' prompts, then a sample
    multi-turn rollout of row 0 built by the training loop's own code: the prompt offering ``guess``, the model's
    tool call (trained, marked), the environment's real answer rendered by the template (not trained), the model's
    next turn (trained, marked)."""
    from finetune.commands import inspect as inspect_cmd

    overrides = ["data.train_files=[data/guess_number/train.parquet]", "data.validation_files=[data/guess_number/test.parquet]",
                 "data.prompt_column=prompt", "data.reward_columns=[low,high,secret]", f"data.chat_template={TEMPLATE}",
                 "data.max_seq_len=384", "train.grpo.environment=data/environments/guess_number.py:GuessNumber",
                 "train.grpo.rewards=[]", "train.grpo.reward_weights=[]", f"data.cache_dir={tmp_path / 'cache'}"]
    assert inspect_cmd.main([str(CONFIG), *overrides, "--rows", "1", "--color", "never"]) == 0
    out = capsys.readouterr().out
    head, sample = out.split("--- row 0 a sample multi-turn rollout (the model's turns are scripted here; training "
                             "samples them): ")
    assert "--- row 0: 277 prompt tokens\n" in head and "[[" not in head  # the prompts: nothing trained
    counts, text = sample.split("\n", 1)
    assert counts.startswith("277 prompt tokens, then ") and "; train.grpo.max_completion_length=12 would end" in counts
    model, tools = (int(x) for x in re.search(r"tokens: (\d+) the model's .*\), (\d+) the tools'", counts).groups())
    assert model > 10 and tools > 10
    assert '"name": "guess"' in text.split("<|im_start|>assistant\n[[")[0]  # the prompt offers the tool
    assert text.endswith('<|im_start|>assistant\n[[<tool_call>\n{"name": "guess", "arguments": {"number": 1}}\n'
                         '</tool_call><|endoftext|>]]\n<|im_start|>user\n<tool_response>\n1 is too low: the secret is '
                         "higher.\n</tool_response><|endoftext|>\n<|im_start|>assistant\n[[(the model's next turn)"
                         "<|endoftext|>]]\n"), text[-400:]
    # the marks are the training masks: tool_turns' own (1 on the model's tokens, 0 on the result's)
    ids, trained = agent_mod.inspect_sample(load_run_config(CONFIG, overrides), _tokenizer(overrides),
                                            _first_row(overrides))
    assert sum(trained) == model and len(ids) - 277 - model == tools and not any(trained[:277])


def _tokenizer(overrides):
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    return load_tokenizer(load_run_config(CONFIG, overrides), get_recipe("grpo"))


def _first_row(overrides):
    cfg = load_run_config(CONFIG, overrides)
    first = pq.read_table(REPO / "data/guess_number/train.parquet").slice(0, 1).to_pylist()[0]
    return {grpo.PROMPT_COLUMN: first["prompt"], **{grpo.COLUMN_PREFIX + n: first[n] for n in cfg.data.reward_columns}}


# Issue 68 item 12: an environment's calls run in the rank's environment process, where a timeout can stop them.

COUNTERS = '''
class Counter:
    """A counter per rollout; ``spin`` computes a power in C code that holds the GIL and would not end."""

    def reset(self, start, **row):
        self.count, self.blob = int(start), object()

    def add(self, k: int) -> str:
        """Add to the count.

        Args:
            k: How much.
        """
        self.count += k
        return f"count {self.count}"

    def spin(self) -> str:
        """Compute a power with 64**64 bits of exponent (C code holding the GIL, for ever)."""
        return str((9 ** 64) ** 64 ** 64)

    def get_reward(self) -> float:
        """A tenth of the count."""
        return self.count / 10
'''


def _counters(tmp_path):
    path = tmp_path / "counters.py"
    path.write_text(COUNTERS)
    agent = agent_mod._load((), f"{path}:Counter")
    return agent, lambda env: {m: getattr(env, m) for m in agent.methods}


def _call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments, "error": None}


def test_an_environment_call_stuck_in_c_code_is_stopped_and_its_process_lost(tmp_path):
    """A method spinning in C code that holds the GIL is stopped at ``tool_timeout_s`` (the rank's threads run on
    meanwhile); the instances of that process are lost: their tool calls return an error the model reads, their
    ``get_reward`` None; a fresh instance then works, and reward functions read the instances' attributes and
    rewards through their handles; a value that is not JSON is a one-line TypeError."""
    import threading
    import time

    from finetune.recipes.common import rewards
    from finetune.recipes.grpo import tools as T

    agent, tools_of = _counters(tmp_path)
    assert agent.methods == ("add", "spin")
    envs, observations = agent_mod.start_environments(agent, {"start": [1, 2]}, 2, timeout_s=0.5)
    assert observations == [None, None]
    stats = T.ToolStats()
    assert T.call_tool(tools_of(envs[0]), _call("add", k=2), 0.5, stats) == "count 3"
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    stuck = T.call_tool(tools_of(envs[1]), _call("spin"), 0.5, stats)
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    assert json.loads(stuck) == {"error": "the tool 'spin' did not return within 0.5 s"} and took < 1.5, took
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.25  # the rank's threads were never blocked
    for env in envs:  # both lost with the process: the other rollout's and the spinning one's
        lost = json.loads(T.call_tool(tools_of(env), _call("add", k=1), 0.5, stats))["error"]
        assert lost == ("the environment was lost: a call of another rollout, or of this one, ran past 0.5 s "
                        "(train.grpo.tool_timeout_s), so the process holding the rank's environments was stopped")
        assert env.get_reward() is None and env.count is None
    assert agent_mod.environment_reward([], [], environments=envs) == [None, None]
    assert (stats.calls, stats.failures) == (4, 3)

    fresh, _ = agent_mod.start_environments(agent, {"start": [5]}, 1, timeout_s=0.5)
    assert T.call_tool(tools_of(fresh[0]), _call("add", k=2), 0.5, stats) == "count 7"

    def counted(prompts, completions, environments, **columns):
        return [env.count / 7 for env in environments]

    table = rewards.score([rewards.RewardFunction("counted", "counted", counted, 1.0),
                           rewards.RewardFunction("Counter", "Counter", agent_mod.environment_reward, 1.0)],
                          ["p"], ["c"], [[1]], {"environments": fresh})
    assert table == [[1.0, 0.7]]
    with pytest.raises(TypeError) as e:
        fresh[0].blob
    assert str(e.value) == ("Counter.blob holds a value of type 'object', which cannot be read from the rank: "
                            "environments run in the environment process, and only JSON values (numbers, text, "
                            "lists, dicts, None) cross")
    assert not hasattr(fresh[0], "missing")


def test_an_environment_call_holding_the_gil_returns_within_its_timeout(tmp_path):
    """The rank's own path (``start_environments``, the rollout's tools bound by name, ``call_tool``) run in a forked
    child so that this test cannot hang: the spinning call returns its timeout error within ``tool_timeout_s`` + 1 s.
    Before, the method ran in a thread of the rank, which C code holding the GIL blocked for ever (with the rank's
    timeout and signal handlers): the child never answered."""
    import os
    import select
    import signal
    import time

    from finetune.recipes.grpo import tools as T

    agent, tools_of = _counters(tmp_path)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the rank
        try:
            os.close(read)
            envs, _ = agent_mod.start_environments(agent, {"start": [1]}, 1)
            start = time.perf_counter()
            said = T.call_tool(tools_of(envs[0]), _call("spin"), 0.5, T.ToolStats())
            os.write(write, json.dumps({"said": said, "took": time.perf_counter() - start}).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        answered = select.select([read], [], [], 0.5 + 2.5)[0]
        if not answered:
            os.kill(child, signal.SIGKILL)
        got = json.loads(os.read(read, 1 << 16) or "null") if answered else None
    finally:
        os.close(read)
        os.waitpid(child, 0)
    assert got is not None, "the environment's call did not return within 3 s: the rank was blocked"
    assert json.loads(got["said"]) == {"error": "the tool 'spin' did not return within 0.5 s"}
    assert got["took"] < 1.5, got
