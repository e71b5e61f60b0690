"""Reward-model training (recipe ``reward``) on real runs, against a plain-PyTorch reward model from the formula.

Runs (2 CPU ranks, fp32, ``tests/configs/parity_reward.yaml``: 8 pairs per step = 2 ranks x micro batch 2 x
accumulation 2, 4 steps, the shipped GSM8K pairs with a margin column added here, TRL's centring term 0.01, so
every part of the loss is exercised): ZeRO-3 (the loss is stage-blind; ZeRO-0's engine path is the parity
battery's). Per-step ``train/loss`` and
``train/grad_norm`` equal :func:`reward_reference` (one process, the toolkit's global batches, the same init,
AdamW, schedule and clipping; the score read by hand at each sequence's last non-pad token) at the parity battery's
tolerances (loss 1e-5 relative, grad norm 1e-4). TRL's metrics (``accuracy``, ``margin``, ``mean_reward``) are
logged for train and eval; the export loads in ``pipeline("text-classification")`` and scores a pair as the
reference model does, and as TRL's GRPO trainer scores completions with a reward model.

In process: bad inputs (missing columns, empty responses, a non-numeric or null margin, a negative centring
coefficient, a pad token the model config does not know) are one line each before any model (``--check``, exit 2);
the loss against the formula written out (margin, centring); a conversational pair is tokenized whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from conftest import CONFIGS, REPO, check_files, launch, ok, read_metrics, reference_optimizer, scratch_model, \
    simulated_ranks, train_losses, write_parquet
from finetune.config import RewardConfig, load_run_config
from finetune.recipes import reward

pytestmark = pytest.mark.slow

CONFIG = CONFIGS / "parity_reward.yaml"
PREF = REPO / "data" / "gsm8k_pref"
CHATML = REPO / "data" / "chat_templates" / "chatml.jinja"


def _with_margins(src: Path, dst: Path, rows: int) -> Path:
    """The first ``rows`` pairs of ``src`` with a float ``margin`` column (0, 0.25, ..., 1.0 cycling)."""
    table = pq.read_table(src).slice(0, rows)
    pq.write_table(table.append_column("margin", pa.array([0.25 * (i % 5) for i in range(table.num_rows)],
                                                          pa.float64())), dst)
    return dst


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("reward-data")
    train = _with_margins(PREF / "train.parquet", folder / "train.parquet", 96)
    test = _with_margins(PREF / "test.parquet", folder / "test.parquet", 40)
    return [f"data.train_files=[{train}]", f"data.validation_files=[{test}]", "data.margin_column=margin"]


def _cfg(data: list[str], cache: Path):
    return load_run_config(CONFIG, [*data, f"data.cache_dir={cache}"])


def last_token_scores(model, batch: dict, pad: int) -> torch.Tensor:
    """``[rows]``: the score head on the decoder's hidden state at each row's last token that is not ``pad``
    (written out, not transformers' pooling)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    positions = torch.arange(batch["input_ids"].shape[1])
    last = torch.where(batch["input_ids"] != pad, positions, -1).max(dim=1).values
    return model.score(hidden[torch.arange(hidden.shape[0]), last]).float()[:, 0]


def reward_pair_loss(rc, rr, m, c):
    """``-log sigma(r_c - r_r - m) + c (r_c + r_r)^2`` (TRL 1.16 RewardTrainer.compute_loss, per pair)."""
    return -torch.log(torch.sigmoid(rc - rr - m)) + c * (rc + rr) ** 2


def reward_reference(cfg, world: int, steps: int) -> dict:
    """One process: the toolkit's global batches (same sampler and collator per simulated rank), the same init,
    AdamW, schedule and clipping; the loss of a step is the mean over its pairs of :func:`reward_pair_loss`."""
    torch.set_num_threads(1)
    t, c = cfg.train, cfg.train.reward.center_rewards_coefficient
    tokenizer, splits, collator, samplers, loaders = simulated_ranks(cfg, world)
    gas = t.gradient_accumulation_steps
    model = scratch_model(cfg).train()
    step = reference_optimizer(model, t, steps)
    for smp in samplers:
        smp.set_epoch(0)
    its = [iter(dl) for dl in loaders]
    out = {"losses": [], "grad_norms": [], "accuracy": [], "tokenizer": tokenizer, "splits": splits}
    for _ in range(steps):
        micro = [next(it) for it in its for _ in range(gas)]
        n_pairs = sum(b["input_ids"].shape[0] // 2 for b in micro)
        total, right = 0.0, 0
        for b in micro:
            k = b["input_ids"].shape[0] // 2
            r = last_token_scores(model, b, tokenizer.pad_token_id)
            loss = reward_pair_loss(r[:k], r[k:], b["margin"], c).sum() / n_pairs
            loss.backward()
            total += loss.item()
            right += int((r[:k] > r[k:]).sum())
        norm = step()
        out["losses"].append(total)
        out["grad_norms"].append(norm)
        out["accuracy"].append(right / n_pairs)
    out["model"] = model.eval()
    return out


def max_rel(got, want) -> float:
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))


def _by_step(run: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for r in read_metrics(run):
        rows.setdefault(r["step"], {}).update(r)
    return rows


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reward-cache")


@pytest.fixture(scope="module")
def reference(data, cache) -> dict:
    return reward_reference(_cfg(data, cache), world=2, steps=4)


def _parity(tmp_path, data, cache, reference, stage: int) -> Path:
    run = tmp_path / f"z{stage}"
    ok(launch(CONFIG, [f"output_dir={run}", f"ds.zero_optimization.stage={stage}", *data, f"data.cache_dir={cache}"]))
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3, 4]
    got = [losses[s] for s in sorted(losses)]
    rows = _by_step(run)
    norms = [rows[s]["train/grad_norm"] for s in sorted(losses)]
    rel_loss, rel_norm = max_rel(got, reference["losses"]), max_rel(norms, reference["grad_norms"])
    print(f"reward parity ZeRO-{stage}: max rel loss {rel_loss:.2e}, max rel grad norm {rel_norm:.2e}")
    assert rel_loss <= 1e-5, (got, reference["losses"])
    assert rel_norm <= 1e-4, (norms, reference["grad_norms"])
    for s in sorted(losses):  # TRL's metrics as exact sums over the step's pairs
        assert rows[s]["train/accuracy"] == pytest.approx(reference["accuracy"][s - 1], abs=1e-9), s
    final = rows[4]
    for name in ("accuracy", "margin", "mean_reward", "shared_tokens"):
        assert f"train/{name}" in final and f"eval/{name}" in final, (name, final)
    assert final["train/shared_tokens"] > 0.3, final  # the pairs ran as shared-prefix rows (the default)
    assert 0.0 <= final["eval/accuracy"] <= 1.0 and "eval/perplexity" not in final
    assert json.loads((run / "export_check.json").read_text())["max_abs_logit_diff"] <= 1e-4
    return run


def test_zero3_equals_the_formula_and_the_export_is_a_text_classification_reward_model(tmp_path, data, cache,
                                                                                      reference):
    """ZeRO-3, 2 ranks x accumulation 2: loss 1e-5, grad norm 1e-4 against the one-process reference; the export
    in ``pipeline("text-classification")`` returns, under the label ``reward``, the raw score the reference model
    gives the same text."""
    run = _parity(tmp_path, data, cache, reference, 3)
    export = run / "export"
    scorer = pipeline("text-classification", model=str(export), tokenizer=str(export), device="cpu")
    row = pq.read_table(PREF / "test.parquet").slice(0, 2).to_pylist()
    texts = [r["prompt"] + r["chosen"] for r in row] + [r["prompt"] + r["rejected"] for r in row]
    tokenizer = reference["tokenizer"]
    for text in texts:
        got = scorer(text)[0]
        enc = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            want = last_token_scores(reference["model"], enc, tokenizer.pad_token_id).item()
        assert got["label"] == "reward"
        assert abs(got["score"] - want) <= 1e-4 * max(1.0, abs(want)), (got, want)
    # as TRL 1.16's GRPOTrainer scores completions with a reward model (_calculate_rewards): loaded with
    # num_labels=1, texts right-padded together without special tokens, logits[:, 0]
    model = AutoModelForSequenceClassification.from_pretrained(export, num_labels=1).eval()
    grpo_tokenizer = AutoTokenizer.from_pretrained(export)
    model.config.pad_token_id = grpo_tokenizer.pad_token_id
    inputs = grpo_tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                            add_special_tokens=False)
    with torch.inference_mode():
        rewards = model(**inputs).logits[:, 0]
    torch.testing.assert_close(rewards, torch.tensor([o["score"] for o in scorer(texts)]), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# In process: the formula, the checks before any model, the tokenization
# ---------------------------------------------------------------------------------------------------------


def test_loss_with_margin_and_centring_is_the_formula():
    """``forward`` on a stand-in model against ``-log sigma(r_c - r_r - m) + c (r_c + r_r)^2`` written out, summed
    over the real pairs (an eval filler pair counts for nothing), and TRL's metrics as sums with their counts."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(8, generator=g) * 3
    m = torch.rand(4, generator=g)

    class Scores(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": r[input_ids[:, 0]][:, None]})()

    batch = {"input_ids": torch.arange(8)[:, None], "attention_mask": torch.ones(8, 1, dtype=torch.long),
             "labels": torch.tensor([1, 1, 1, -100, 0, 0, 0, -100]), "margin": m}
    out = reward.forward(Scores(), batch, settings=RewardConfig(center_rewards_coefficient=0.05))
    rc, rr = r[:3], r[4:7]
    want = (-torch.log(1 / (1 + torch.exp(-(rc - rr - m[:3])))) + 0.05 * (rc + rr) ** 2).sum()
    torch.testing.assert_close(out.loss_sum, want)
    assert out.targets.item() == 3 == reward.count_targets(batch).item()
    ratio = {k: (n / d).item() for k, (n, d) in out.metrics.items()}
    assert ratio["accuracy"] == pytest.approx((rc > rr).float().mean().item())
    assert ratio["margin"] == pytest.approx((rc - rr).mean().item())
    assert ratio["mean_reward"] == pytest.approx(torch.cat([rc, rr]).mean().item())
    # without a margin column and centring: -log sigma(r_c - r_r), TRL's plain loss
    plain = reward.forward(Scores(), {k: v for k, v in batch.items() if k != "margin"})
    torch.testing.assert_close(plain.loss_sum, -F.logsigmoid(rc - rr).sum())


def test_shared_prefix_rows_give_the_separate_rows_scores_and_gradients():
    """Prefix sharing (``train.reward.share_prefix``, on by default) against the ``[2B, T]`` rows run separately, on
    GSM8K pairs whose rejected sequence shares the whole solution but its answer, one sharing only the prompt, one
    a prefix of its chosen sequence (the rejected score then read inside the shared prefix), an eval filler pair:
    the same scores and parameter gradients under ``sdpa``, and under ``eager`` through a LoRA wrapper, the shared
    tokens counted, and a row shorter than the two separate ones."""
    from peft import LoraConfig, get_peft_model

    tokenizer = reward.prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2"))
    pairs = pq.read_table(PREF / "train.parquet").slice(0, 4).to_pylist()
    rows = []
    for i, p in enumerate(pairs):
        prompt = tokenizer(p["prompt"])["input_ids"]
        chosen = prompt + tokenizer(p["chosen"])["input_ids"] + [tokenizer.eos_token_id]
        rejected = {1: prompt + tokenizer(" No idea.")["input_ids"] + [tokenizer.eos_token_id],
                    2: chosen[:-5]}.get(i, prompt + tokenizer(p["rejected"])["input_ids"] + [tokenizer.eos_token_id])
        rows.append({"input_ids": chosen, "attention_mask": [1] * len(chosen), "rejected_input_ids": rejected})
    batch = reward.RewardCollator(tokenizer.pad_token_id)(rows)
    batch["labels"][[3, 7]] = -100  # pair 3 is an eval filler
    shared = reward.shared_rows(batch["input_ids"], batch["attention_mask"], tokenizer.pad_token_id)
    lengths = batch["attention_mask"].sum(1)
    assert shared["shared"][1] == len(tokenizer(pairs[1]["prompt"])["input_ids"])  # the prompt only
    assert shared["shared"][2] == lengths[6] and shared["shared"][0] > 0.9 * lengths[4]
    assert shared["input_ids"].shape[1] < batch["input_ids"].shape[1] * 2
    for kernel, lora in (("sdpa", False), ("eager", True)):
        model = scratch_model(load_run_config(CONFIG, [f"model.attn_implementation={kernel}"]))
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
        got = {}
        for share in (False, True):
            model.zero_grad()
            out = reward.forward(model, batch, settings=RewardConfig(share_prefix=share))
            out.loss_sum.backward()
            got[share] = (out, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        (plain, g0), (fast, g1) = got[False], got[True]
        torch.testing.assert_close(fast.loss_sum, plain.loss_sum, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
        for name in ("accuracy", "margin", "mean_reward"):
            torch.testing.assert_close(fast.metrics[name][0], plain.metrics[name][0], rtol=1e-5, atol=1e-6)
        saved, total = fast.metrics["shared_tokens"]
        assert plain.metrics["shared_tokens"][0] == 0 and total == lengths[[0, 1, 2, 4, 5, 6]].sum()
        assert saved == shared["shared"][:3].sum(), (kernel, lora)


def _check(tmp_path, files: list[Path], extra: list[str] = ()) -> int:
    """:func:`conftest.check_files` on this module's config."""
    return check_files(CONFIG, tmp_path, files, extra)


def test_bad_pairs_and_margins_are_one_line_each_before_any_model(tmp_path, capsys):
    good = {"prompt": ["a?", "b?"], "chosen": ["yes", "no"], "rejected": ["no", "yes"]}
    missing = write_parquet(tmp_path / "missing.parquet", {"prompt": ["a?"], "chosen": ["yes"], "margin": [1.0]})
    empty = write_parquet(tmp_path / "empty.parquet", {**good, "chosen": ["  ", "no"], "margin": [1.0, 2.0]})
    text = write_parquet(tmp_path / "text.parquet", {**good, "margin": ["big", "small"]})
    null = write_parquet(tmp_path / "null.parquet", {**good, "margin": [0.5, None]})
    assert _check(tmp_path, [missing, empty, text, null],
                  ["data.margin_column=margin", "train.reward.center_rewards_coefficient=-1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ".parquet'" in line or "train.reward" in line]
    assert "missing.parquet' has no column 'rejected'" in err and "reward reads data.prompt_column" in err
    assert "empty.parquet' row 0 of column 'chosen' is null or empty" in err
    assert "text.parquet' column 'margin' has type string; a margin is a number" in err
    assert "null.parquet' row 1 of column 'margin' is None (1 such rows)" in err
    assert "train.reward.center_rewards_coefficient: -1.0 must be >= 0" in err
    assert len(lines) == 6, lines  # missing.parquet is the validation file too: its line twice
    assert "Traceback" not in err
    ok_file = write_parquet(tmp_path / "ok.parquet", good)
    assert _check(tmp_path, [ok_file]) == 0
    assert _check(tmp_path, [ok_file], ["model.config_overrides={num_labels: 1, pad_token_id: 0}"]) == 2
    err = capsys.readouterr().err
    assert "model.config_overrides.pad_token_id: the model config's pad_token_id is 0 but the tokenizer pads with " \
           "50256" in err


def test_a_conversational_pair_is_two_whole_sequences(tmp_path):
    tokenizer = reward.prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2"))
    cfg = load_run_config(CONFIG, [f"data.chat_template={CHATML}", "data.margin_column=margin"])
    fn = reward.tokenize_function(tokenizer, cfg.data)
    user = [{"role": "user", "content": "What is 2+2?"}]
    out = fn({"prompt": [user, "Same?", user], "chosen": ["It is 4.", " same", "4"],
              "rejected": [[{"role": "assistant", "content": "It is 5."}], " same", "5"], "margin": [0.5, 1.0, None]})
    assert len(out["input_ids"]) == 1 and out["margin"] == [0.5], fn.summary()
    summary = fn.summary()
    assert summary.startswith("reward: 3 rows -> 1 pairs") and "1 with identical chosen and rejected" in summary
    assert "1 with a null or non-finite margin" in summary
    chosen, rejected = (tokenizer.decode(out[k][0]) for k in ("input_ids", "rejected_input_ids"))
    assert chosen.startswith("<|im_start|>user\nWhat is 2+2?") and "<|im_start|>assistant\nIt is 4." in chosen
    assert "It is 5." in rejected and rejected.split("assistant")[0] == chosen.split("assistant")[0]
    batch = reward.make_collator(tokenizer, cfg.data)([{k: v[0] for k, v in out.items()}])
    assert batch["input_ids"].shape[0] == 2 and batch["labels"].tolist() == [0, 0]
    assert batch["margin"].tolist() == [0.5] and reward.count_targets(batch).item() == 1
