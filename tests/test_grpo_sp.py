"""``grpo`` under sequence parallelism (DeepSpeed Ulysses): SP = 2 trains exactly as SP = 1 on long multi-turn
trajectories (issue 53 item 5).

Fixed multi-turn trajectories of about 4k tokens, teacher-forced (this module, run as a launch's entry point,
replaces the recipe's ``generate`` with scripted turns of 700-1,100 random bytes that call the shipped
calculator; the toolkit's tool loop runs the calls and renders their results, which the loss never trains:
``tool_mask`` 0), train two optimizer steps on 2 ranks forming one SP group and on 1 rank with the same global
batch (2 prompts x 2 completions per step): the same loss and gradient norm per step (rel 1e-5, fp32). ``dapo``
with ``num_iterations: 2`` (step 2 reuses step 1's rollouts: the old policy's log-probabilities, computed on the
sequence slices, make its ratios differ from 1) at ZeRO-3 with every parameter partitioned, and ``grpo`` (each
completion's own token mean) at ZeRO-2 with LoRA and ``beta`` 0.1 (the reference's log-probabilities, adapters
off, on the slices too: step 2's KL).

The LoRA run sets ``train.adam_eps`` to 1e-3. AdamW's first update is ``lr * g / (|g| + eps)``: with the default
eps (1e-8) every gradient element well above 1e-8 moves by the full ``lr`` whatever its size, so elements whose
value is rounding (they differ in the last bits between the layouts, and can change sign) become full-size,
layout-dependent updates, and step 2 is then further apart than the layouts' rounding (measured: gradient norm
4.0e-6 and KL 6.6e-5 relative). With eps 1e-3 the update is proportional to the gradient for such elements and
step 2 is as close as step 1 (measured: 2.3e-7 and 1.1e-6): the gap is the optimizer's, not the layout's.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from grpo_tool_forced import as_generated

REPO = Path(__file__).resolve().parent.parent
LENGTH = 3000
"""``train.grpo.max_completion_length`` of the launches (prompts of up to 1,024 tokens: trajectories of up to 4,024)."""


def long_turn(context: list[int], tokenizer, budget: int) -> list[int]:
    """The turn that continues ``context`` (prompt + the completion so far, real tokens), drawn from a generator
    seeded with it (the same on every rank and layout): 700-1,100 random printable bytes, then a calculator call and
    EOS (a first turn always; a turn after a tool result one time in two), else EOS (or, one time in four, nothing:
    a completion that never ends); at most ``budget`` ids."""
    gen = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(context)) % (2 ** 31))
    after_result = "<tool_response>" in tokenizer.decode(context[-40:])
    n = int(torch.randint(700, 1100, (1,), generator=gen))
    ids = torch.randint(3 + 32, 3 + 127, (n,), generator=gen).tolist()  # printable ASCII (ByT5: byte + 3)
    draw = int(torch.randint(0, 4, (1,), generator=gen))
    if not after_result or draw < 2:
        a, b = (int(x) for x in torch.randint(1, 99, (2,), generator=gen))
        call = '\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "%d + %d"}}\n</tool_call>' % (a, b)
        ids += tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    elif draw == 2:
        ids.append(tokenizer.eos_token_id)
    return ids[:budget]


def _generate(engine, batch, g, tokenizer, n, sample, seed, synced):
    """``finetune.recipes.grpo.rollout.generate`` of scripted turns (:func:`long_turn`): a prompt's ``n`` first turns
    continue the prompt and their index, so they differ."""
    rows = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        context = ids[mask.bool()].tolist()
        for k in range(n):
            rows.append(long_turn(context + ([k] if n > 1 else []), tokenizer, g.max_completion_length))
    return as_generated(rows, tokenizer)


@pytest.mark.parametrize("sp", [1, 2, 3])
def test_sequence_slices_predict_every_completion_token_once_at_its_own_position(sp):
    """:func:`~finetune.recipes.grpo.loss.sequence_slice`: prompts left-padded to different lengths, completions of
    different lengths; the slices of an SP group together predict every ``(row, column)`` of the completion grid
    exactly once, each from the hidden state of the token just before it, every real token at the position
    :func:`~finetune.recipes.grpo.before_step` gives it, the right-padded rows' real tokens first."""
    from finetune.recipes.grpo.loss import sequence_slice

    gen = torch.Generator().manual_seed(sp)
    prompts, p, c = [3, 7, 5, 1], 7, 6
    ids = torch.randint(10, 99, (4, p + c), generator=gen)
    mask = torch.zeros(4, p + c, dtype=torch.long)
    for r, n in enumerate(prompts):
        ids[r, :p - n] = 0
        mask[r, p - n:p] = 1
        mask[r, p:p + 2 + r] = 1  # the completion's real tokens (the rest: padding after its EOS)
    batch = {"input_ids": ids, "attention_mask": mask, "prompt_length": torch.tensor(p),
             "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    parts = [sequence_slice(batch, sp, k, pad_token_id=-1) for k in range(sp)]
    row = torch.cat([x["input_ids"] for x in parts], 1)  # the right-padded rows, slices joined
    pos = torch.cat([x["position_ids"] for x in parts], 1)
    size = parts[0]["input_ids"].shape[1]
    assert row.shape[1] == size * sp and row.shape[1] % sp == 0 and row.shape[1] - sp < max(prompts) + c
    assert sorted(torch.cat([x["dest"] for x in parts]).tolist()) == list(range(4 * c))  # each once
    for k, x in enumerate(parts):
        r, col = x["source"] // size, x["source"] % size + k * size  # the predicting token's row and column
        assert torch.equal(x["target"], ids[:, p:].reshape(-1)[x["dest"]])
        assert torch.equal(row[r, col + 1], x["target"])  # the next token of the right-padded row
        assert torch.equal(x["dest"] // c, r) and torch.equal(x["dest"] % c, col + 1 - torch.tensor(prompts)[r])
    for r, n in enumerate(prompts):  # real tokens first, at the positions the batch gives them
        real = mask[r].bool()
        assert torch.equal(row[r, :int(real.sum())], ids[r][real])
        assert torch.equal(pos[r, :int(real.sum())], batch["position_ids"][r][real])


def test_check_accepts_grpo_under_sequence_parallelism_and_refuses_the_hybrid_engine(tmp_path, capsys):
    """``--check`` with 2 ranks and ``parallel.sequence_parallel_size: 2``: ``grpo`` passes (it declares sequence
    parallelism); with ``generation_backend: hybrid_engine`` it is refused in one line naming the key and the fix,
    exit 2, before any model is built."""
    from conftest import CONFIGS, check_here

    ranks = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    args = ["--config", CONFIGS / "tiny_grpo.yaml", f"output_dir={tmp_path / 'r'}", f"data.cache_dir={tmp_path}",
            "parallel.sequence_parallel_size=2"]
    code, out = check_here(args, capsys, **ranks)
    assert code == 0, out
    code, out = check_here([*args, "train.grpo.generation_backend=hybrid_engine"], capsys, **ranks)
    errs = [line for line in out.splitlines() if "is not checked under sequence parallelism" in line]
    assert code == 2 and len(errs) == 1 and "use generation_backend=hf_generate" in errs[0], out
    assert not (tmp_path / "r").exists()


def _files(tmp: Path) -> list[str]:
    """A Llama config with 8,192 positions and a byte vocabulary (tiny-llama's, hidden 64, 4 heads, 2 key/value
    heads; the ByT5 tokenizer of data/models/gpt2-bytes: 259 ids, so that the output head of 4k-token sequences is
    cheap on CPUs), 8 one-message conversations with an answer, and the overrides that train on them with the
    calculator."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp / "model"
    model.mkdir(exist_ok=True)
    config = json.loads((REPO / "data/models/tiny-llama/config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192, "vocab_size": 259,
                                                   "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}))
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}? Use the calculator."}],
             "answer": str(a + b)} for a, b in zip(range(11, 19), range(40, 48))]
    pq.write_table(pa.Table.from_pylist(rows), tmp / "prompts.parquet")
    data = tmp / "prompts.parquet"
    return [f"model.path={model}", f"model.tokenizer_path={REPO}/data/models/gpt2-bytes",
            f"data.train_files=[{data}]", f"data.validation_files=[{data}]",
            "data.prompt_column=prompt", f"data.chat_template={REPO}/data/chat_templates/chatml_tools.jinja",
            "data.max_seq_len=1024", f"data.cache_dir={tmp / 'cache'}",
            f"train.grpo.tools=[{REPO}/data/tools/calculator.py:calculate]", "train.grpo.max_tool_calling_iterations=2",
            f"train.grpo.max_completion_length={LENGTH}", "train.grpo.num_generations=2", "train.grpo.rewards=[length]",
            "train.grpo.reward_weights=[]", "train.grpo.length_cache=2800", "train.micro_batch_size=1",
            "train.gradient_accumulation_steps=2", "train.max_steps=2", "train.grpo.log_completions=4"]


def _run(tmp: Path, name: str, overrides: list[str], nproc: int) -> list[dict]:
    from conftest import launch, ok, read_metrics

    run = tmp / name
    ok(launch(REPO / "tests/configs/tiny_grpo.yaml", [f"output_dir={run}", *overrides], nproc=nproc,
              script="tests/test_grpo_sp.py"))
    return sorted((r for r in read_metrics(run) if "train/loss" in r), key=lambda r: r["step"])


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
@pytest.mark.parametrize(("loss_type", "stage", "iterations", "beta"), [("dapo", 3, 2, 0.0), ("grpo", 2, 1, 0.1)])
def test_sequence_parallel_2_equals_1_on_4k_token_multi_turn_trajectories(tmp_path, loss_type, stage, iterations,
                                                                           beta):
    from test_dpo import max_rel

    overrides = [*_files(tmp_path), f"train.grpo.loss_type={loss_type}", f"ds.zero_optimization.stage={stage}",
                 f"train.grpo.num_iterations={iterations}", f"train.grpo.beta={beta}",
                 *(["model.lora.r=4", "train.adam_eps=1e-3"] if beta else [])]  # eps: the module docstring
    sp2 = _run(tmp_path, "sp2", [*overrides, "parallel.sequence_parallel_size=2"], nproc=2)
    sp1 = _run(tmp_path, "sp1", overrides, nproc=1)
    assert [r["step"] for r in sp2] == [r["step"] for r in sp1] == [1, 2]
    # the trajectories: about 4k tokens, the calculator called, its results' tokens in the sequences but not trained
    assert all(r["train/completions/mean_length"] > 1500 for r in sp1 + sp2), sp1
    assert all(r["train/tools/call_frequency"] >= 1 for r in sp1 + sp2), sp1
    for key in ("train/completions/mean_length", "train/tools/call_frequency", "train/reward", "train/tokens_seen",
                "train/padding_ratio"):  # the SP group counts its rows once
        assert [r[key] for r in sp2] == pytest.approx([r[key] for r in sp1], rel=1e-9), key
    losses = ([r["train/loss"] for r in sp2], [r["train/loss"] for r in sp1])
    norms = ([r["train/grad_norm"] for r in sp2], [r["train/grad_norm"] for r in sp1])
    assert min(norms[1]) > 1e-3, norms  # the rewards differ within groups: something is trained
    print(f"{loss_type}: losses (sp2, sp1) {losses}, grad norms {norms}")
    if loss_type == "grpo":  # ratio 1: each completion's token mean is -A (+ beta KL), and a group's advantages sum
        # to 0: the loss is a float32 difference of terms of order 1 (1e-7 apart whatever the layout), so compared
        # absolutely; with beta 0 it is that rounding alone
        assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-6, losses
        assert beta or max(abs(x) for x in losses[0] + losses[1]) <= 1e-6, losses
    else:
        assert max_rel(*losses) <= 1e-5, losses
        if iterations > 1:  # step 2 trains step 1's rollouts against their old log-probabilities: ratios differ from 1
            assert abs(losses[1][1] - losses[1][0]) > 1e-4, losses
    assert max_rel(*norms) <= 1e-5, norms
    if beta:  # the reference's log-probabilities (adapters off) on the slices: step 2's KL, after step 1 moved them
        kl = ([r["train/kl"] for r in sp2], [r["train/kl"] for r in sp1])
        print(f"kl (sp2, sp1) {kl}")
        assert kl[1][0] == pytest.approx(0.0, abs=1e-9) and kl[1][1] > 1e-7, kl
        assert max_rel(kl[0][1:], kl[1][1:]) <= 1e-5 and abs(kl[0][0]) <= 1e-9, kl


if __name__ == "__main__":  # a launch's entry point: finetune/run.py with the scripted turns
    sys.path.insert(0, str(REPO))
    from finetune.recipes.grpo import rollout

    rollout.generate = _generate
    sys.argv[0] = str(REPO / "finetune/run.py")
    runpy.run_path(str(REPO / "finetune/run.py"), run_name="__main__")
