"""Mixture-of-experts models at ZeRO 3 compute what one device computes, router loss and statistics included.

The tiny Qwen3-MoE of ``tests/configs/moe_qwen3.yaml`` (4 experts, top-2, ``router_aux_loss_coef`` 0.01) trains 4
steps on 8 WikiText-2 rows written by the test, one row per micro-batch: 2 ranks (ZeRO-3 with every parameter
partitioned) against one device with 2 accumulation steps, which runs exactly the ranks' micro-batches
(the aux loss is a mean per micro-batch, so the split into micro-batches is part of what a step optimizes). Per step
``train/loss`` (the token part), ``train/aux_loss`` and the router statistics agree at the parity battery's
tolerances (``tests/test_parity.py``: losses 1e-5 relative, grad norms 1e-4), and so do the grad norms, which
carry the aux loss's gradient. The step-1 grad norm is also checked against the definition computed in this process
(the gradient of the LM token mean + ``coef x`` the mean of the two micro-batches' aux losses).

The batch in which one rank routes no token to some expert is made from the data: the row rank 1 trains on at step
1 is one byte repeated (``"a" * 40``). With causal attention over identical values every position of such a row has
the same hidden states in every layer, so all its tokens go to the same 2 of the 4 experts in each layer and the
other 2 get nothing on that rank; rank 0's WikiText row reaches every expert. The test checks both on the initial
model in this process (the batches of each simulated rank, :func:`conftest.simulated_ranks`) and in the run's
logged statistics (``train/router/idle_experts`` at step 1: the mean over the step's two micro-batches of the
(layer, expert) pairs that got no token). The ZeRO-3 run finishes within the launch's timeout (no hang), its sparse
blocks gathered whole (ZeRO-3 leaf modules, logged).

Extended: the tiny Mixtral trained by the ``dpo`` recipe at
ZeRO-3 on 2 ranks (loads, trains 2 steps with its aux loss and router statistics logged).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import CONFIGS, check_here, launch, ok, read_metrics, scratch_model, simulated_ranks, write_parquet

pytestmark = pytest.mark.slow

MOE = CONFIGS / "moe_qwen3.yaml"
ROWS = 8
IDLE_ROW = "a" * 40
"""The text of rank 1's first row: one byte repeated, routed to 2 of the 4 experts only in every layer."""


def _rank_rows(world: int, rank: int, seed: int) -> list[int]:
    """Dataset rows ``rank`` trains on, in order (one per step: micro batch 1), from the toolkit's sampler."""
    from finetune.config import DataConfig
    from finetune.data.dataset import train_sampler

    return list(train_sampler(list(range(ROWS)), DataConfig(group_by_length=False), world, world, rank, seed))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, list[str]]:
    """8 WikiText-2 rows of 60+ characters; the row rank 1 of 2 trains on at step 1 is :data:`IDLE_ROW`."""
    import pyarrow.parquet as pq

    from finetune.config import load_run_config

    seed = load_run_config(MOE, []).train.seed
    texts = [t.strip() for t in pq.read_table("data/wikitext2/test.parquet").column("text").to_pylist()
             if len(t.strip()) > 60][:ROWS]
    texts[_rank_rows(2, 1, seed)[0]] = IDLE_ROW
    path = write_parquet(tmp_path_factory.mktemp("moe_data") / "train.parquet", {"text": texts})
    return path, texts


def _overrides(data, run: Path, *extra: str) -> list[str]:
    path, _ = data
    return [f"output_dir={run}", f"data.train_files=[{path}]", f"data.validation_files=[{path}]",
            f"data.cache_dir={run.parent / 'cache'}", *extra]


@pytest.fixture(scope="module")
def one_device(data, tmp_path_factory) -> Path:
    """One rank, ZeRO-0, 2 accumulation steps of one row: the two ranks' micro-batches, in one process."""
    run = tmp_path_factory.mktemp("moe_one") / "run"
    ok(launch(MOE, _overrides(data, run, "deepspeed=ds_configs/zero0.json", "train.gradient_accumulation_steps=2"),
              nproc=1, timeout=300))
    return run


def _steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if "train/loss" in r}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_run(got: Path, want: Path) -> None:
    """Every step's token loss, aux loss and router statistics at 1e-5 relative, grad norm at 1e-4."""
    g, w = _steps(got), _steps(want)
    assert sorted(g) == sorted(w) == [1, 2, 3, 4], (sorted(g), sorted(w))
    for step in w:
        for key in ("train/loss", "train/aux_loss"):
            assert _rel(g[step][key], w[step][key]) <= 1e-5, (step, key, g[step][key], w[step][key])
        assert _rel(g[step]["train/grad_norm"], w[step]["train/grad_norm"]) <= 1e-4, (step, g[step], w[step])
        for key in [k for k in w[step] if k.startswith("train/router/")]:
            assert g[step][key] == pytest.approx(w[step][key], abs=1e-9), (step, key)


def test_zero3_two_ranks_equal_one_device_with_an_idle_expert(data, one_device, tmp_path):
    """ZeRO-3 on 2 ranks = one device, while rank 1 routes no token to half the experts at step 1."""
    import torch

    from finetune.config import load_run_config
    from finetune.recipes import gpt_clm

    run = tmp_path / "z3"
    proc = ok(launch(MOE, _overrides(data, run), timeout=300))
    assert "ZeRO-3 gathers each Qwen3MoeSparseMoeBlock whole" in proc.stdout
    _assert_same_run(run, one_device)

    # the first step's micro-batches, on the initial model in this process: rank 1 leaves experts idle, rank 0 none
    cfg = load_run_config(MOE, _overrides(data, tmp_path / "sim"))
    *_, loaders = simulated_ranks(cfg, 2)
    model = scratch_model(cfg)
    first = [next(iter(loader)) for loader in loaders]
    assert first[1]["input_ids"].unique().numel() <= 2  # the repeated byte (and the EOS the tokenizer appends)
    outs = [gpt_clm.forward(model, batch) for batch in first]
    idle = [float(o.metrics["router/idle_experts"][0]) for o in outs]
    assert idle[0] == 0 and idle[1] >= 2, idle  # 2 layers x 4 experts: at least one layer leaves 2 idle on rank 1
    step1 = _steps(run)[1]
    assert step1["train/router/idle_experts"] == pytest.approx(sum(idle) / 2)  # logged: the mean of the two ranks
    aux = [float(o.metrics["aux_loss"][0]) for o in outs]
    assert step1["train/aux_loss"] == pytest.approx(sum(aux) / 2, rel=1e-5)
    # the aux term is part of the optimized loss: its coefficient times the model's own aux loss, per micro-batch; the
    # logged step-1 gradient norm (before clipping) is that of "LM token mean + coef x mean of the micro-batch aux
    # losses" (measured 2.5e-9 relative), and without the aux term it would differ (by 1.9e-4)
    assert float(outs[0].aux_loss) == pytest.approx(0.01 * aux[0], rel=1e-6)
    lm = sum(o.loss_sum for o in outs) / sum(o.targets for o in outs)

    def grad_norm(loss) -> float:
        model.zero_grad()
        loss.backward(retain_graph=True)
        return float(torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in model.parameters()
                                  if p.grad is not None]).norm())

    assert step1["train/grad_norm"] == pytest.approx(grad_norm(lm + sum(o.aux_loss for o in outs) / 2), rel=1e-5)
    assert step1["train/grad_norm"] != pytest.approx(grad_norm(lm), rel=1e-5)
    shares = [step1[f"train/router/expert{e}_share"] for e in range(4)]
    assert math.isclose(sum(shares), 1.0, rel_tol=1e-9) and 1.0 <= step1["train/router/max_load"] <= 2.0
    final = [r for r in read_metrics(run) if "eval/loss" in r][-1]
    assert "eval/aux_loss" in final and "eval/router/idle_experts" in final


def test_moe_refuses_split_micro_batches(capsys, tmp_path):
    """Sequence and tensor parallelism split the micro-batch the router's loss is defined on: refused by --check."""
    for key in ("parallel.sequence_parallel_size=2", "parallel.tensor_parallel_size=2"):
        code, out = check_here(["--config", MOE, f"output_dir={tmp_path / 'r'}", key, "deepspeed=ds_configs/zero2.json"],
                               capsys, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT="29999")
        assert code == 2 and f"{key.split('=')[0]}: 'data/models/tiny-qwen3-moe/config.json' (model_type qwen3_moe) is " \
            f"a mixture of experts (4 experts, top-2)" in out, out[-2000:]


@pytest.mark.extended
def test_mixtral_dpo_zero3_trains(tmp_path):
    """The tiny Mixtral loads and trains 2 DPO steps at ZeRO-3 on 2 ranks, its router loss and statistics logged
    (the GPT-2 tokenizer of ``parity_dpo.yaml``, so the vocabulary is raised to its 50,257 tokens)."""
    run = tmp_path / "mixtral"
    proc = ok(launch(CONFIGS / "parity_dpo.yaml", [
        f"output_dir={run}", "model.path=data/models/tiny-mixtral", "model.config_overrides={vocab_size: 50257}",
        "deepspeed=ds_configs/zero3.json", "ds.zero_optimization.stage3_param_persistence_threshold=0",
        "train.max_steps=2", "train.save_every=0", "export=false", f"data.cache_dir={tmp_path / 'cache'}"],
        timeout=300))
    assert "ZeRO-3 gathers each MixtralSparseMoeBlock whole" in proc.stdout
    steps = _steps(run)
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert math.isfinite(row["train/loss"]) and row["train/aux_loss"] > 0.5  # about 1 (E x sum f_e P_e)
        assert sum(row[f"train/router/expert{e}_share"] for e in range(4)) == pytest.approx(1.0)
