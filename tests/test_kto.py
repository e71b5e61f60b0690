"""KTO (recipe ``kto``) on real runs, against a plain-PyTorch KTO written from the paper.

Runs (2 CPU ranks, fp32, ``tests/configs/parity_kto.yaml``: 8 unpaired rows per step, 2 steps, desirable weight 1 and
undesirable weight 1.5, a 24-row validation file): per-step ``train/loss``, ``train/grad_norm`` and ``train/kl`` equal
:func:`kto_reference` (one process, full logits, a frozen copy of the initial model as the reference, forwarded at
every step; the KL estimate ``z`` over the whole global batch) at the parity battery's tolerances (loss 1e-5 relative,
grad norm 1e-4). Step 1's ``z`` is 0 (policy = reference); step 2's is positive, so it is checked too.

* ZeRO-3, micro batch 2 x accumulation 2 (default suite), and in the same test, in one process, the toolkit's
  ``forward`` and KL estimate on the same global batches cut as micro batch 1 x accumulation 4: the same step-2 loss,
  while a KL estimate per micro-batch (as TRL's, per device batch) gives another one.
* ZeRO-0, micro batch 1 x accumulation 4 (extended): the same values as the textbook (and so as the ZeRO-3 run).

Checks before any model (``--check``, in process): missing columns, empty completions, labels that are not
true/false (an int 2, a string column, a null), a split of one row, a conversational completion without an assistant
turn, bad ``train.kto`` values: one line each, exit 2. ``finetune plan`` counts a row as two sequences.
"""

from __future__ import annotations

import copy

import pyarrow.parquet as pq
import pytest
import torch
from conftest import CONFIGS, REPO, check_files, launch, ok, read_metrics, reference_optimizer, scratch_model, \
    simulated_ranks, train_losses, write_parquet
from finetune.config import load_run_config
from finetune.recipes import kto
from finetune.recipes.common.pairs import REFERENCE_COLUMN
from test_dpo import full_logps, grad_norms, max_rel

pytestmark = pytest.mark.slow

CONFIG = CONFIGS / "parity_kto.yaml"


def kto_row_loss(pol, ref, desirable, z, beta, w_d, w_u):
    """Ethayarajh et al. 2024 eq. 8 with TRL's weights: ``w_d (1 - sigma(beta (r - z)))`` for a desirable row,
    ``w_u (1 - sigma(beta (z - r)))`` for an undesirable one, ``r = log pi - log pi_ref``."""
    r = pol - ref
    return torch.where(desirable, w_d * (1 - torch.sigmoid(beta * (r - z))), w_u * (1 - torch.sigmoid(beta * (z - r))))


def _halves(b: dict) -> tuple[dict, dict]:
    k = b["input_ids"].shape[0] // 2
    first = {key: b[key][:k] for key in ("input_ids", "attention_mask", "labels")}
    return first, {key: b[key][k:] for key in ("input_ids", "attention_mask", "labels")}


def kto_reference(cfg, world: int, steps: int, split=None) -> dict:
    """One process: the toolkit's global batches (same sampler and collator per simulated rank), the same init,
    AdamW, schedule and clipping; a step's ``z`` is the mean over its global batch of the KL pairs' ``log pi -
    log pi_ref`` (no grad), clamped at 0, and its loss the mean over its rows of :func:`kto_row_loss`.

    With ``split`` (the same config with another micro batch x accumulation), before each optimizer step the toolkit's
    own ``kto.forward`` and ``kto.kl_sums`` run on the same model on that split's batches: ``toolkit`` (global ``z``,
    as the loop's ``before_step``) and ``per_micro`` (``z`` of each micro-batch alone) losses."""
    torch.set_num_threads(1)
    t, s = cfg.train, cfg.train.kto
    _, _, _, samplers, loaders = simulated_ranks(cfg, world)
    gas = t.gradient_accumulation_steps
    model = scratch_model(cfg).train()
    reference = copy.deepcopy(model).eval()
    step = reference_optimizer(model, t, steps)
    its = []
    for smp, dl in zip(samplers, loaders):
        smp.set_epoch(0)
        its.append(iter(dl))
    other = None
    if split is not None:
        _, _, _, o_samplers, o_loaders = simulated_ranks(split, world)
        for smp in o_samplers:
            smp.set_epoch(0)
        other = [iter(dl) for dl in o_loaders]
    out = {"losses": [], "grad_norms": [], "kls": [], "toolkit": [], "per_micro": []}
    for _ in range(steps):
        micro = [next(it) for it in its for _ in range(gas)]
        rows = sum(b["desirable"].shape[0] for b in micro)
        with torch.no_grad():
            kl = sum((full_logps(model, _halves(b)[1]) - full_logps(reference, _halves(b)[1])).sum() for b in micro)
        z = torch.clamp(kl / rows, min=0)
        total = 0.0
        for b in micro:
            completions = _halves(b)[0]
            with torch.no_grad():
                ref = full_logps(reference, completions)
            loss = kto_row_loss(full_logps(model, completions), ref, b["desirable"], z, s.beta, s.desirable_weight,
                                s.undesirable_weight).sum() / rows
            loss.backward()
            total += loss.item()
        if other is not None:
            o_micro = [next(it) for it in other for _ in range(split.train.gradient_accumulation_steps)]
            with torch.no_grad():
                for b in o_micro:
                    b[REFERENCE_COLUMN] = full_logps(reference, b)
                z_tool = kto.kl_estimate(sum(kto.kl_sums(model, b) for b in o_micro))
                out["toolkit"].append(sum(kto.forward(model, {**b, kto.KL_COLUMN: z_tool}, settings=s).loss_sum
                                          for b in o_micro).item() / rows)
                out["per_micro"].append(sum(kto.forward(model, b, settings=s).loss_sum for b in o_micro).item() / rows)
        norm = step()
        out["losses"].append(total)
        out["grad_norms"].append(norm)
        out["kls"].append(float(z))
    return out


@pytest.fixture(scope="module")
def small_validation(tmp_path_factory):
    """The first 24 rows of the shipped KTO test split (the reference pass of 398 rows would cost 15 s a run)."""
    table = pq.read_table(REPO / "data/gsm8k_kto/test.parquet").slice(0, 24)
    path = tmp_path_factory.mktemp("kto-data") / "validation.parquet"
    pq.write_table(table, path)
    return path


def _overrides(cache, validation, extra=()) -> list[str]:
    return [f"data.cache_dir={cache}", f"data.validation_files=[{validation}]", *extra]


def _check_run(run, ref) -> None:
    losses = train_losses(run)
    assert sorted(losses) == [1, 2]
    got = [losses[s] for s in sorted(losses)]
    assert max_rel(got, ref["losses"]) <= 1e-5, (got, ref["losses"])
    assert max_rel(grad_norms(run), ref["grad_norms"]) <= 1e-4, (grad_norms(run), ref["grad_norms"])
    kls = [r["train/kl"] for r in sorted(read_metrics(run), key=lambda r: r["step"]) if "train/kl" in r]
    assert kls[0] == 0.0 and ref["kls"][0] == 0.0  # policy = reference at step 1
    assert ref["kls"][1] > 0.1 and abs(kls[1] - ref["kls"][1]) <= 1e-5 * ref["kls"][1], (kls, ref["kls"])
    last = {k: v for r in read_metrics(run) if r["step"] == 2 for k, v in r.items()}
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"):
        assert f"train/{name}" in last and f"eval/{name}" in last, name
    assert "eval/perplexity" not in last


def test_zero3_equals_the_textbook_kto_whatever_the_split(tmp_path, small_validation):
    """ZeRO-3, 2 ranks x micro batch 2 x accumulation 2: loss, grad norm and KL estimate of both steps equal the
    textbook's. In one process, the toolkit's forward on the same global batches cut as micro batch 1 x accumulation
    4 gives the step-2 loss too (the KL estimate is the global batch's), where a KL estimate per micro-batch does
    not."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    proc = ok(launch(CONFIG, [f"output_dir={run}", "ds.zero_optimization.stage=3",
                              *_overrides(cache, small_validation)]))
    assert "kto: reference log-probabilities of 48 train rows computed" in proc.stdout
    cfg = load_run_config(CONFIG, _overrides(cache, small_validation))
    split = load_run_config(CONFIG, _overrides(cache, small_validation, ["train.micro_batch_size=1",
                                                                        "train.gradient_accumulation_steps=4"]))
    ref = kto_reference(cfg, world=2, steps=2, split=split)
    _check_run(run, ref)
    assert max_rel(ref["toolkit"], ref["losses"]) <= 1e-5, (ref["toolkit"], ref["losses"])
    assert abs(ref["per_micro"][1] - ref["losses"][1]) > 1e-4 * ref["losses"][1], (ref["per_micro"], ref["losses"])


@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_zero0_micro1_x_accumulation4_equals_the_textbook_kto(tmp_path, small_validation):
    """ZeRO-0, 2 ranks x micro batch 1 x accumulation 4 (the same 8 rows per step as the ZeRO-3 test, cut otherwise):
    the textbook's values of the micro batch 2 x accumulation 2 batches."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    ok(launch(CONFIG, [f"output_dir={run}", "ds.zero_optimization.stage=0", "train.micro_batch_size=1",
                       "train.gradient_accumulation_steps=4", *_overrides(cache, small_validation)]))
    _check_run(run, kto_reference(load_run_config(CONFIG, _overrides(cache, small_validation)), world=2, steps=2))


def test_kl_pairs_are_the_previous_rows_completion():
    """Tokenization: row j's KL sequence is its prompt with row j-1's completion (row 0: the batch's last row's), as
    TRL rotates them; labels on the completion only."""
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    cfg = load_run_config(CONFIG, ["data.max_seq_len=512"])
    tokenizer = load_tokenizer(cfg, get_recipe("kto"))
    rows = pq.read_table(REPO / "data/gsm8k_kto/train.parquet").slice(0, 5).to_pydict()
    fn = kto.tokenize_function(tokenizer, cfg.data)
    out = fn(rows)
    assert len(out["input_ids"]) == 5 and out["label"] == [int(v) for v in rows["label"]], fn.summary()
    for j in range(5):
        completion = tokenizer.decode([t for t, lab in zip(out["kl_input_ids"][j], out["kl_labels"][j]) if lab != -100])
        prompt = tokenizer.decode([t for t, lab in zip(out["kl_input_ids"][j], out["kl_labels"][j]) if lab == -100])
        assert completion.startswith(rows["completion"][j - 1].strip()[:40]), (j, completion)
        assert prompt == rows["prompt"][j]
    assert "5 rows -> 5 examples" in fn.summary()


def test_a_mixture_of_experts_policy_adds_its_router_loss():
    """kto with an MoE policy (the tiny Qwen3-MoE): ``forward`` returns the router's load-balancing term (the model's
    own ``aux_loss`` of the completion forward times ``router_aux_loss_coef``) and the router statistics, as
    ``gpt_clm`` and ``dpo`` do (:mod:`finetune.engine.moe`)."""
    cfg = load_run_config(CONFIG, ["model.path=data/models/tiny-qwen3-moe", "model.config_overrides={vocab_size: 50257}"])
    model = scratch_model(cfg).train()
    batch = dict(next(iter(simulated_ranks(cfg, 1)[4][0])))
    batch[REFERENCE_COLUMN] = torch.zeros(batch["input_ids"].shape[0])
    batch[kto.KL_COLUMN] = torch.tensor(0.0)
    out = kto.forward(model, batch)
    half = batch["input_ids"].shape[0] // 2
    own = model(input_ids=batch["input_ids"][:half], attention_mask=batch["attention_mask"][:half],
                output_router_logits=True).aux_loss
    assert float(out.aux_loss.detach()) == pytest.approx(model.config.router_aux_loss_coef * float(own.detach()), rel=1e-5)
    assert out.aux_loss.requires_grad and "router/max_load" in out.metrics


def test_bad_rows_are_one_line_each_before_any_model(tmp_path, capsys):
    good = {"prompt": ["a?", "b?"], "completion": ["yes", "no"], "label": [True, False]}
    missing = write_parquet(tmp_path / "missing.parquet", {"prompt": ["a?"], "completion": ["yes"]})
    empty = write_parquet(tmp_path / "empty.parquet", {**good, "completion": ["yes", "  "]})
    two = write_parquet(tmp_path / "two.parquet", {**good, "label": [1, 2]})
    text = write_parquet(tmp_path / "text.parquet", {**good, "label": ["true", "false"]})
    null = write_parquet(tmp_path / "null.parquet", {**good, "label": [True, None]})
    assert check_files(CONFIG, tmp_path, [missing, empty, two, text, null], ["train.kto.beta=0"]) == 2
    err = capsys.readouterr().err
    assert "missing.parquet' has no column 'label'" in err and "data.completion_column" in err
    assert "empty.parquet' row 1 of column 'completion' is null or empty (1 such rows)" in err
    assert "two.parquet' row 1 of column 'label' is 2, not true/false (1/0)" in err
    assert "text.parquet' column 'label' has type string; kto reads bool labels" in err
    assert "null.parquet' row 1 of column 'label' is null" in err
    assert "train.kto.beta: 0.0 must be > 0" in err and "Traceback" not in err
    one = write_parquet(tmp_path / "one.parquet", {k: v[:1] for k, v in good.items()})
    assert check_files(CONFIG, tmp_path, [one]) == 2
    assert "needs at least 2 rows" in capsys.readouterr().err
    user = [{"role": "user", "content": "2+2?"}]
    chat = write_parquet(tmp_path / "chat.parquet", {"prompt": [user, user],
                                                     "completion": [[{"role": "assistant", "content": "4"}],
                                                                    [{"role": "user", "content": "5"}]],
                                                     "label": [True, False]})
    assert check_files(CONFIG, tmp_path, [chat], [f"data.chat_template={REPO / 'data/chat_templates/chatml.jinja'}"]) == 2
    assert "chat.parquet' row 1 of column 'completion' is a completion without an assistant turn" in \
        capsys.readouterr().err
    ok_file = write_parquet(tmp_path / "ok.parquet", good)
    assert check_files(CONFIG, tmp_path, [ok_file]) == 0


def test_plan_counts_the_completion_and_its_kl_pair():
    """``finetune plan``: a kto row is two sequences (its completion and its KL pair), as a dpo pair: the same
    activation memory as ``parity_dpo.yaml`` (the same model, micro batch 2 and 128 tokens)."""
    from finetune.preflight import plan

    kto_cfg, dpo_cfg = load_run_config(CONFIG), load_run_config(CONFIGS / "parity_dpo.yaml")
    assert plan.model_shape(kto_cfg).sequences_per_row == 2
    kto_options = plan.make_plan(kto_cfg, 2, 1, 80 * 2**30, None)[1]
    dpo_options = plan.make_plan(dpo_cfg, 2, 1, 80 * 2**30, None)[1]
    assert [e.gpu for e in kto_options] == [e.gpu for e in dpo_options]
    sft_cfg = load_run_config(CONFIG, ["recipe=sft", "data.prompt_column=prompt", "data.response_column=completion"])
    assert plan.model_shape(sft_cfg).sequences_per_row == 1
