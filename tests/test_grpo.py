"""The ``grpo`` recipe (online RL): its loss against a plain PyTorch GRPO, its advantages, its runs and its checks.

* In one process (default suite): with fixed completions (teacher-forced), the recipe's loss (``forward``'s sum
  divided by ``count_targets``) and gradients equal a plain PyTorch implementation of TRL 1.16's ``_compute_loss``
  (full logits at the training temperature, log-softmax, clipped surrogate, k3 KL, each ``loss_type``'s
  normalisation, token and sequence importance sampling) on one micro-batch; the group / batch / none advantages equal
  TRL's formula; the ``--check`` lines.
* Launched (2 CPU ranks): ZeRO-3 + LoRA + ``beta`` > 0 with the model gathered for generation trains, logs TRL's
  metric names, writes completions.jsonl, evaluates the reward and exports (verified against the engine's logits); a
  reward function that raises on rank 1 only ends both ranks with one line naming it (exit 4), no hang.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from conftest import CONFIGS, REPO, check_files, launch, ok, read_metrics, scratch_model, write_parquet
from finetune.config import GrpoConfig, load_run_config
from finetune.recipes import grpo

CONFIG = CONFIGS / "tiny_grpo.yaml"


def textbook_loss(model, ids, attn, p, mask, adv, old, ref, g: GrpoConfig, n_seq: int) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer._compute_loss`` on one process and one micro-batch, from the full logits."""
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, p - 1:-1].float() / g.temperature
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None]).squeeze(-1)
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if g.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - g.epsilon, 1 + (g.epsilon_high or g.epsilon))
    a = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    if g.beta:
        per_token_loss = per_token_loss + g.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if g.loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if g.loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if g.loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (n_seq * g.max_completion_length)
    return (per_token_loss * mask).sum() / mask.sum()  # dapo, one process, one micro-batch


@pytest.fixture(scope="module")
def fixed():
    """The tiny model, a prompt batch of 2 GSM8K questions and 4 fixed completions each (EOS at different places,
    one never ending), as :func:`grpo.before_step` assembles a training batch."""
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    cfg = load_run_config(CONFIG)
    tok = load_tokenizer(cfg, get_recipe("grpo"))
    rows = pq.read_table(REPO / "data/gsm8k/train.parquet").slice(0, 2).to_pydict()
    tokenized = grpo.tokenize_function(tok, cfg.data)({"question": rows["question"], "answer": rows["answer"]})
    prompt_rows = [{k: tokenized[k][i] for k in tokenized} | {"_seed": i} for i in range(2)]
    prompts = grpo.make_collator(tok, cfg.data)(prompt_rows)
    assert prompts["attention_mask"][1].sum() < prompts["attention_mask"].shape[1]  # one prompt is left-padded
    g = 4
    gen = torch.Generator().manual_seed(0)
    completion = torch.randint(100, 5000, (2 * g, 10), generator=gen)
    for row, at in enumerate([3, 9, 0, 5, 10, 2, 7, 4]):  # 10: no EOS (truncated)
        if at < 10:
            completion[row, at] = tok.eos_token_id
            completion[row, at + 1:] = tok.pad_token_id
    is_eos = completion == tok.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((2 * g,), 10))
    cmask = (torch.arange(10)[None] <= first[:, None]).float()
    c = {"completion_ids": completion, "completion_mask": cmask, "terminated": is_eos.any(1), "lengths": cmask.sum(1).long()}
    model = scratch_model(cfg).eval()
    return cfg, tok, prompts, c, model


@pytest.mark.parametrize(("loss_type", "level", "beta"), [("dapo", "token", 0.0), ("grpo", "token", 0.04),
                                                          ("dr_grpo", "token", 0.0), ("bnpo", "token", 0.0),
                                                          ("dapo", "sequence", 0.04)])
def test_forward_equals_a_plain_pytorch_grpo(fixed, loss_type, level, beta):
    """Loss and every parameter's gradient, each prompt run once for its completions (``share_prompt``), equal the
    plain implementation's on separate sequences (1e-6 relative, 1e-6 of the largest gradient) with generation-time log-probabilities that differ from the policy's, so tokens are clipped on both
    sides, and a reference that differs too (the KL term); the clip-ratio metrics see the clipping."""
    cfg, tok, prompts, c, model = fixed
    g = GrpoConfig(num_generations=4, max_completion_length=10, temperature=0.7, epsilon=0.2, epsilon_high=0.28,
                   beta=beta, loss_type=loss_type, importance_sampling_level=level)
    rewards_ = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 2.0, float("nan"), 1.0])
    adv, std = grpo.advantages(rewards_, 4, "group")
    batch = grpo._sequences(prompts, c, g, adv, rewards_, std, rewards_[:, None])
    p = int(batch["prompt_length"])
    assert grpo.shares_prompts(model, batch, g.share_prompt)  # the loss runs each prompt once for its completions
    assert grpo.prompt_shared_rows(batch, 0)["input_ids"].numel() < batch["input_ids"].numel() / 2
    with torch.no_grad():
        base, _ = grpo.completion_logps(model, batch, g.temperature)  # separate sequences
    gen = torch.Generator().manual_seed(1)
    batch["old_logps"] = base + 0.4 * torch.randn(base.shape, generator=gen)
    ref = base + 0.3 * torch.randn(base.shape, generator=gen)
    if beta:
        batch["ref_logps"] = ref
    model.zero_grad()
    out = grpo.forward(model, batch, settings=g)
    ours = out.loss_sum / grpo.count_targets(batch, loss_type)
    ours.backward()
    ours_grads = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    want = textbook_loss(model, batch["input_ids"], batch["attention_mask"], p, batch["completion_mask"], adv,
                         batch["old_logps"], ref, g, 8)
    want.backward()
    assert torch.allclose(ours, want, rtol=1e-6, atol=1e-7), (ours.item(), want.item())
    scale = max(q.grad.abs().max() for q in model.parameters())
    worst = max((a - q.grad).abs().max() for a, q in zip(ours_grads, model.parameters()))
    assert worst <= 1e-6 * scale, (worst, scale)
    low, high = (out.metrics[f"clip_ratio/{k}_mean"] for k in ("low", "high"))
    if level == "token":
        assert low[0] > 0 and high[0] > 0, (low, high)
    assert ("kl" in out.metrics) == bool(beta)
    assert out.metrics["completions/clipped_ratio"][0] == 1  # one completion never reached EOS


def test_advantages_and_masked_truncation(fixed):
    """``scale_rewards`` group / batch / none against TRL's formula (Bessel's std, + 1e-4); an unscored completion
    (NaN) is left out of its group's mean and gets 0; ``mask_truncated_completions`` removes the truncated one from
    the loss (dapo counts its tokens no more)."""
    r = torch.tensor([1.0, 0.0, 0.5, float("nan"), 2.0, 2.0, 3.0, 1.0])
    adv, std = grpo.advantages(r, 4, "group")
    first = torch.tensor([1.0, 0.0, 0.5])
    assert torch.allclose(adv[:3], (first - first.mean()) / (first.std() + 1e-4)) and adv[3] == 0
    second = r[4:]
    assert torch.allclose(adv[4:], (second - second.mean()) / (second.std() + 1e-4))
    batch_std = grpo._nanstd(r)
    adv_b, _ = grpo.advantages(r, 4, "batch", batch_std)
    scored = r[~torch.isnan(r)]
    assert torch.isclose(batch_std, scored.std())
    assert torch.allclose(adv_b[4:], (second - second.mean()) / (scored.std() + 1e-4))
    adv_n, _ = grpo.advantages(r, 4, "none")
    assert torch.allclose(adv_n[4:], second - second.mean())
    cfg, tok, prompts, c, model = fixed
    kept = grpo._sequences(prompts, c, GrpoConfig(num_generations=4), adv, r, std, r[:, None])
    cut = grpo._sequences(prompts, c, GrpoConfig(num_generations=4, mask_truncated_completions=True), adv, r, std,
                          r[:, None])
    assert grpo.count_targets(kept) - grpo.count_targets(cut) == 10  # the completion without EOS: 10 tokens


def test_reward_functions_get_completion_ids_with_their_eos(fixed):
    """``completion_ids`` reach the reward functions up to and including the EOS (TRL passes the completion mask's
    tokens), so the DAPO length penalty counts it; the text is decoded without it."""
    cfg, tok, prompts, c, model = fixed
    texts, ids = grpo._texts(tok, c)
    assert [len(x) for x in ids] == c["lengths"].tolist()
    for x, t, done in zip(ids, texts, c["terminated"].tolist()):
        assert (x[-1] == tok.eos_token_id) == done and tok.eos_token not in t


def test_recipes_against_a_reference_turn_every_dropout_off(tmp_path):
    """LoRA with ``lora_dropout`` 0.5 on a model with dropout in its config: for ``grpo``, ``dpo``, ``kto`` and
    ``reward`` (``Capabilities.disables_dropout``) two train-mode forwards are equal (TRL's
    ``disable_dropout_in_model``); for ``sft`` dropout stays as configured."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    from finetune.engine import lora
    from finetune.recipes import get_recipe

    cfg = load_run_config(CONFIG, ["model.lora.r=4", "model.lora.dropout=0.5"])
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    for name in ("grpo", "dpo", "kto", "reward", "sft"):
        recipe = get_recipe(name)
        auto = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
        config = LlamaConfig(vocab_size=200, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_dropout=0.3,
                             num_labels=1, pad_token_id=0)
        model = lora.apply(auto.from_config(config), cfg, recipe).train()
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
        assert torch.equal(a, b) == (name != "sft"), name


def test_check_names_every_bad_setting_and_reward_function(tmp_path, capsys):
    """``--check``, before any model: one line per problem, exit 2."""
    good = write_parquet(tmp_path / "good.parquet", {"question": ["1+1?", "2+2?"], "answer": ["#### 2", "#### 4"]})
    assert check_files(CONFIG, tmp_path, [good], [
        "train.grpo.rewards=[exact_match,tests/nowhere.py:f,tests/grpo_rewards.py:missing,tests/grpo_rewards.py:no_kwargs,format]",
        "train.grpo.reward_weights=[1,2]", "train.grpo.num_generations=1", "train.grpo.beta=0.1",
        "train.grpo.num_iterations=0"]) == 2
    err = capsys.readouterr().err
    for line in ("train.grpo.rewards[1]: 'tests/nowhere.py' is no file",
                 "train.grpo.rewards[2]: 'tests/grpo_rewards.py' has no function 'missing'",
                 "train.grpo.rewards[3]: 'tests/grpo_rewards.py:no_kwargs' has the signature no_kwargs(prompts, completions)",
                 "train.grpo.rewards[4]: format needs train.grpo.format_pattern",
                 "train.grpo.reward_weights: 2 weights for 5 reward functions",
                 "train.grpo.num_generations: 1", "train.grpo.beta: 0.1 > 0 needs a reference model",
                 "train.grpo.num_iterations: 0 must be >= 1"):
        assert line in err, (line, err)
    assert "Traceback" not in err
    bad = write_parquet(tmp_path / "bad.parquet", {"question": ["1+1?", "  "], "solution": ["2", "4"]})
    assert check_files(CONFIG, tmp_path, [bad]) == 2
    err = capsys.readouterr().err
    assert "bad.parquet' has no column 'answer'" in err and "data.reward_columns" in err
    assert check_files(CONFIG, tmp_path, [bad], ["data.reward_columns=[solution]"]) == 2
    assert "bad.parquet' row 1 of column 'question' is null or empty (1 such rows)" in capsys.readouterr().err
    # settings the launch would fail, diverge or train on with
    assert check_files(CONFIG, tmp_path, [good], ["train.grpo.temperature=inf", "train.grpo.reward_weights=[1,.nan]",
                                                  "train.grpo.length_cache=20"]) == 2
    err = capsys.readouterr().err
    for line in ("train.grpo.temperature: inf is not a finite number",
                 "train.grpo.reward_weights[1]: nan is not a finite number",
                 "train.grpo.length_cache: 20 is longer than train.grpo.max_completion_length 12"):
        assert line in err, (line, err)
    # every prompt dropped by data.truncation=drop: the launch's empty split, refused by --check
    assert check_files(CONFIG, tmp_path, [good], ["data.truncation=drop", "data.max_seq_len=2"]) == 2
    assert "every prompt of" in capsys.readouterr().err
    # a chat SFT file given to grpo: the prompts end with the answer
    chat = write_parquet(tmp_path / "chat.parquet", {
        "question": [[{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]],
        "answer": ["#### 2"]})
    assert check_files(CONFIG, tmp_path, [chat], ["model.tokenizer_path=data/models/tiny-qwen3"]) == 2
    assert "row 0 of column 'question' ends with an assistant message (1 such rows)" in capsys.readouterr().err


def test_the_hybrid_engine_backend_is_deepspeeds_rollout_with_generates_completions(fixed, tmp_path, capsys):
    """``generation_backend: hybrid_engine`` runs DeepSpeed's ``HybridEngineRollout`` (its ``generate`` path, EOS
    off, padded after the first EOS): with the same seed its completions and masks equal transformers' ``generate``
    with ``num_return_sequences`` (``fast_generation: false``), sampled and greedy, so the batch the loss sees is the
    same; DeepSpeed's inference kernels themselves run on GPUs only (``finetune selftest``'s ``hybrid_rollout``).
    ``--check`` refuses it on the CPU, with LoRA, under ZeRO-3 and for a model type without kernels."""
    from types import SimpleNamespace

    from finetune.engine.rollout import HFGenerateRollout, HybridEngineGenerate, RolloutRequest, SamplingConfig

    cfg, tok, prompts, _, model = fixed
    request = RolloutRequest(prompts["input_ids"], prompts["attention_mask"])
    p = prompts["input_ids"].shape[1]
    first = HFGenerateRollout(model, tok, fast=False).generate(
        request, SamplingConfig(max_new_tokens=12, temperature=0.0, n_samples_per_prompt=1), seed=0)
    eos = int(first.input_ids[0, p + 2])  # a token the model does generate ends completions early, as an EOS would
    shim = SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=eos)
    hybrid = HybridEngineGenerate(SimpleNamespace(module=model), shim)
    plain = HFGenerateRollout(model, shim, fast=False)
    for temperature, n in ((0.05, 3), (0.0, 1)):  # greedy evaluation: one completion per prompt
        sampling = SamplingConfig(max_new_tokens=12, temperature=temperature, n_samples_per_prompt=n)
        with hybrid.weights():
            a = hybrid.generate(request, sampling, seed=5)
        b = plain.generate(request, sampling, seed=5)
        width = b.input_ids.shape[1]  # generate stops when every completion has ended; the hybrid rollout does not
        assert torch.equal(a.input_ids[:, :width], b.input_ids) and (a.input_ids[:, width:] == tok.pad_token_id).all()
        assert torch.equal(a.attention_mask[:, :width], b.attention_mask) and not a.attention_mask[:, width:].any()
        assert (b.input_ids[:, p:] == eos).any() and (a.input_ids[:, p:] == eos).any(), "completions that end"
    good = write_parquet(tmp_path / "good.parquet", {"question": ["1+1?", "2+2?"], "answer": ["#### 2", "#### 4"]})
    assert check_files(CONFIG, tmp_path, [good], ["train.grpo.generation_backend=hybrid_engine", "model.lora.r=4",
                                                  "ds.zero_optimization.stage=3", "model.path=data/models/tiny-qwen3",
                                                  "model.tokenizer_path=data/models/tiny-qwen3"]) == 2
    err = capsys.readouterr().err
    for line in ("train.grpo.generation_backend: hybrid_engine needs CUDA GPUs",
                 "train.grpo.generation_backend: hybrid_engine cannot generate with LoRA adapters",
                 "train.grpo.generation_backend: hybrid_engine is not supported under ZeRO-3",
                 "no inference kernels for model type 'qwen3'"):
        assert line in err, (line, err)


def test_score_names_the_function_for_each_failure():
    """Wrong length, NaN, an infinity and ``SystemExit``: a RewardError naming the function (one line, exit 4 in a
    run); None is 'not scored' (NaN)."""
    from finetune.recipes.common import rewards

    cfg = load_run_config(CONFIG, ["train.grpo.rewards=[tests/grpo_rewards.py:wrong_length]", "train.grpo.reward_weights=[]"])
    args = (["p"] * 2, ["a1", ""], [[1], []], {"answer": ["#### 1", "#### 2"]})
    with pytest.raises(rewards.RewardError, match="wrong_length returned 1 values for 2 completions"):
        rewards.score(rewards.load(cfg), *args)
    cfg = load_run_config(CONFIG, ["train.grpo.rewards=[tests/grpo_rewards.py:returns_nan]", "train.grpo.reward_weights=[]"])
    with pytest.raises(rewards.RewardError, match="returns_nan returned NaN for completion 0"):
        rewards.score(rewards.load(cfg), *args)
    for fn, line in (("returns_inf", "returns_inf returned inf for completion 0"),
                     ("calls_exit", "calls_exit raised SystemExit: 3")):
        cfg = load_run_config(CONFIG, [f"train.grpo.rewards=[tests/grpo_rewards.py:{fn}]", "train.grpo.reward_weights=[]"])
        with pytest.raises(rewards.RewardError, match=line):
            rewards.score(rewards.load(cfg), *args)
    table = rewards.score(rewards.load(load_run_config(CONFIG)), *args)
    assert table[0] == [0.0, 1.0] and table[1][0] == 0.0 and table[1][1] != table[1][1]  # None -> NaN


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_metrics_with_nothing_to_measure_are_not_zero(tmp_path):
    """A reward function that scores nothing (None for every completion): ``train/reward`` and its function's mean
    are left out of the training log and the evaluation's are null (NaN), with a warning, never a made-up 0."""
    run = tmp_path / "run"
    proc = ok(launch(CONFIG, [f"output_dir={run}", "train.max_steps=1", "train.eval_every=1",
                              "train.grpo.rewards=[tests/grpo_rewards.py:scores_nothing]", "train.grpo.reward_weights=[]",
                              f"data.cache_dir={tmp_path / 'cache'}"]))
    rows = read_metrics(run)
    train = [r for r in rows if "train/loss" in r]
    assert train and all("train/reward" not in r and "train/rewards/scores_nothing/mean" not in r for r in train)
    evals = [r for r in rows if "eval/reward" in r]
    assert evals and all(r["eval/reward"] is None for r in evals), evals
    assert "nothing to measure" in proc.stdout


def _eos_after_yes(folder) -> None:
    """A tiny Llama (``data/models/tiny-llama``'s config, tied embeddings) that ends at once after the token ``' yes'``
    and almost never otherwise: its layers add nothing to the residual stream (``o_proj``, ``down_proj`` zero), the
    embedding's first dimension is 0 except for ``' yes'`` (1) and EOS (5), so after ``' yes'`` the EOS logit is 40
    and every other logit 0; after any other token EOS has logit 0 among random ones (p ~ 1 / vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "data/models/tiny-llama"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0
        emb[3763] = 0  # ' yes' (GPT-2 BPE)
        emb[3763, 0] = 1.0
        emb[50256] = 0  # EOS
        emb[50256, 0] = 5.0
    model.save_pretrained(folder)


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_zero3_generation_with_uneven_completions_finishes(tmp_path):
    """2 ranks, ZeRO-3 with every parameter partitioned (``stage3_param_persistence_threshold: 0``), the model
    gathered for generation: each step one rank's prompt ends in ``' yes'`` (its completions stop at EOS after one
    token) and the other's does not (its completions run to the 24-token limit). With DeepSpeed's module hooks left
    on, the ranks would issue different numbers of per-token gathers; the run finishes, and the logged lengths show
    the split (half the completions 1 token, half clipped)."""
    model = tmp_path / "model"
    _eos_after_yes(model)
    data = write_parquet(tmp_path / "prompts.parquet", {"question": ["Answer yes", "Answer no"], "answer": ["1", "2"]})
    run = tmp_path / "run"
    proc = ok(launch(CONFIG, [f"output_dir={run}", f"model.path={model}", "model.init=pretrained",
                              "deepspeed=ds_configs/zero3.json", "ds.zero_optimization.stage3_param_persistence_threshold=0",
                              f"data.train_files=[{data}]", f"data.validation_files=[{data}]", "data.max_train_rows=2",
                              "train.gradient_accumulation_steps=1", "train.max_steps=3", "train.lr=1e-6",
                              "train.grpo.max_completion_length=24", "train.grpo.rewards=[length]",
                              "train.grpo.reward_weights=[1.0]", f"data.cache_dir={tmp_path / 'cache'}"], timeout=300))
    train = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3], proc.stdout[-3000:]
    for r in train:
        assert r["train/completions/mean_length"] == pytest.approx((1 + 24) / 2), r
        assert r["train/completions/clipped_ratio"] == pytest.approx(0.5), r


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_zero3_lora_with_kl_trains_logs_and_exports(tmp_path):
    """ZeRO-3, LoRA, beta 0.04, the model gathered once per step for generation (2 ranks x micro batch 1 x
    accumulation 2), 4 steps: TRL's metric names in metrics.jsonl, completions.jsonl, eval/reward, the export verified;
    ZeRO-3's greedy evaluation completions are one process's."""
    run = tmp_path / "run"
    overrides = ["ds.zero_optimization.stage=3", "model.lora.r=4", "train.grpo.beta=0.04", "train.eval_every=2",
                 "train.eval_on_start=true", "export=true", f"data.cache_dir={tmp_path / 'cache'}",
                 "train.max_steps=4", "train.save_every=2"]
    ok(launch(CONFIG, [f"output_dir={run}", *overrides]))
    rows = read_metrics(run)
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 4
    for name in ("reward", "reward_std", "rewards/length/mean", "rewards/has_digit/mean", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "entropy", "kl"):
        assert f"train/{name}" in train[0], (name, sorted(train[0]))
    assert train[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: the adapters are zero, policy = reference
    assert all(r["time/before_step_s"] > 0 for r in train)  # generation and scoring are timed apart from forward
    assert any("eval/reward" in r for r in rows)
    sample = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(sample) == 16 and {"prompt", "completion", "reward", "rewards", "advantage"} <= set(sample[0])
    # the exact resume of this layout (ZeRO-3, LoRA, beta 0.04: the same completions, losses, rewards and KL) is
    # tests/test_grpo_agent_runs.py's, with tools; its second launch here left for the extended checks' budget
    assert (run / "checkpoints" / "step2" / "COMPLETE").is_file()
    assert json.loads((run / "export_check.json").read_text())["max_abs_logit_diff"] <= 1e-4
    # the step-0 evaluation generated greedily with the gathered ZeRO-3 weights (adapters zero): one process with the
    # same initial weights generates the same completions
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    records = [json.loads(line) for line in (run / "eval" / "step0_completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 and (run / "eval" / "step2_completions.jsonl").is_file()
    cfg = load_run_config(CONFIG, overrides)
    tok = load_tokenizer(cfg, get_recipe("grpo"))
    model = scratch_model(cfg).eval()
    encode, collate = grpo.PromptRows(tok, cfg.data).encode, grpo.make_collator(tok, cfg.data)
    for r in records:
        ids = encode(r["prompt"])[-cfg.data.max_seq_len:]
        row = {"input_ids": ids, "attention_mask": [1] * len(ids), grpo.PROMPT_COLUMN: r["prompt"],
               grpo.COLUMN_PREFIX + "answer": ""}
        alone = grpo.generate(model, collate([row]), cfg.train.grpo, tok, 1, False, 0, False)
        assert grpo._texts(tok, alone)[0][0] == r["completion"], r


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_a_reward_function_failing_on_one_rank_stops_every_rank(tmp_path):
    """ZeRO-3 with ``gather_for_generation: false`` (``synced_gpus`` generation, every rank in lockstep): step 1
    trains; rank 1's reward function raises at step 2: both ranks leave with exit 4 and one line naming the function
    and the rank, well before the collective timeout."""
    proc = launch(CONFIG, [f"output_dir={tmp_path / 'run'}", "train.grpo.rewards=[tests/grpo_rewards.py:fails_on_rank1]",
                           "train.grpo.reward_weights=[]", f"data.cache_dir={tmp_path / 'cache'}",
                           "train.dist_timeout_minutes=3", "ds.zero_optimization.stage=3",
                           "train.grpo.gather_for_generation=false"], timeout=170)
    assert proc.returncode == 4, proc.stdout[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "train/loss" in r] == [1]  # synced generation trained
    assert "grpo: reward function tests/grpo_rewards.py:fails_on_rank1 raised ZeroDivisionError: the scorer divided " \
           "by zero (rank 1)" in proc.stdout


def _has_digit(text: str) -> float | None:
    return None if not text else float(any(ch.isdigit() for ch in text))


def grpo_reference(cfg, world: int, steps: int) -> dict:
    """One process, the textbook way: the toolkit's global batches (same sampler and collator per simulated rank),
    each prompt's fixed completions (:func:`grpo_teacher_forced.fixed_completions`), each sequence run alone and
    unpadded (prompt + completion, positions from 0), its rewards (the test config's ``length`` with cache 6 and
    ``has_digit`` x 0.5), group advantages from ``torch.std``, TRL's per-token loss, and the step's loss as
    ``loss_type`` averages it over the **whole global batch**; the same init, AdamW, schedule and clipping. With
    ``num_iterations`` k, each generation batch trains k steps, its ratios to the log-probabilities the model gave
    when the batch was drawn."""
    from conftest import reference_optimizer, simulated_ranks

    torch.set_num_threads(1)
    t, g = cfg.train, cfg.train.grpo
    tok, _, _, samplers, loaders = simulated_ranks(cfg, world)
    model = scratch_model(cfg).train()
    step = reference_optimizer(model, t, steps)
    its = []
    for smp, dl in zip(samplers, loaders):
        smp.set_epoch(0)
        its.append(iter(dl))
    out = {"losses": [], "grad_norms": [], "per_micro": [], "max_ratio_change": []}
    cycle: tuple = ()
    for s in range(steps):
        if s % g.num_iterations:  # num_iterations: the generation batch of step s - s % num_iterations again
            seqs, old = cycle
        else:
            micro = [next(it) for it in its for _ in range(t.gradient_accumulation_steps)]
            seqs, old = _reference_batch(micro, g, tok), None
            if g.num_iterations > 1:  # the generating policy's log-probabilities, no gradient
                with torch.no_grad():
                    old = [_logps(model, prompt, c, g) for prompt, c, _, _ in seqs]
            cycle = seqs, old
        total_tokens = sum(len(c) for _, c, _, _ in seqs)
        micro_tokens = {k: sum(len(c) for _, c, _, j in seqs if j == k) for k in range(len(micro))}
        loss, per_micro, change = torch.zeros(()), 0.0, 0.0
        for i, (prompt, c, a, k) in enumerate(seqs):
            logps = _logps(model, prompt, c, g)
            ratio = torch.exp(logps - (logps.detach() if old is None else old[i]))
            change = max(change, (ratio - 1).abs().max().item())
            per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - g.epsilon, 1 + g.epsilon) * a)
            if g.loss_type == "dapo":
                loss = loss + per_token.sum() / total_tokens
                per_micro += per_token.sum().item() / micro_tokens[k] / len(micro)
            elif g.loss_type == "grpo":
                loss = loss + per_token.mean() / len(seqs)
            elif g.loss_type == "dr_grpo":
                loss = loss + per_token.sum() / (len(seqs) * g.max_completion_length)
            else:  # bnpo: each micro-batch's token mean, averaged over the micro-batches of every rank
                loss = loss + per_token.sum() / micro_tokens[k] / len(micro)
        loss.backward()
        out["grad_norms"].append(step())
        out["losses"].append(loss.item())
        out["per_micro"].append(per_micro)
        out["max_ratio_change"].append(change)
    return out


def _logps(model, prompt: list[int], c: list[int], g) -> torch.Tensor:
    """The completion tokens' log-probabilities of one unpadded sequence at the training temperature."""
    ids = torch.tensor([prompt + c])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / g.temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)


def _reference_batch(micro: list[dict], g, tok) -> list[tuple]:
    """A global batch's sequences ``(prompt ids, completion ids, advantage, micro-batch)``: each prompt's fixed
    completions, their rewards, group advantages from ``torch.std``."""
    from grpo_teacher_forced import fixed_completions

    seqs = []
    for k, b in enumerate(micro):
            for ids, mask in zip(b["input_ids"], b["attention_mask"]):
                prompt = ids[mask.bool()].tolist()
                done = fixed_completions(prompt, g.num_generations, tok.eos_token_id, tok.pad_token_id,
                                         g.max_completion_length)
                rewards_ = []
                for c in done:
                    text_ids = c[:-1] if c[-1] == tok.eos_token_id else c
                    n_tok = len(c)  # TRL's completion_ids: up to and including the EOS
                    start = g.max_completion_length - g.length_cache
                    length = 0.0 if n_tok <= start else max(-1.0, (start - n_tok) / g.length_cache)
                    digit = _has_digit(tok.decode(text_ids, skip_special_tokens=True))
                    rewards_.append(length + 0.5 * (digit if digit is not None else 0.0))
                r = torch.tensor(rewards_)
                adv = (r - r.mean()) / (r.std() + 1e-4)
                seqs += [(prompt, c, a, k) for c, a in zip(done, adv.tolist())]
    return seqs


def _parity_run(tmp_path, name: str, overrides: list[str], nproc: int = 2):
    from test_dpo import grad_norms

    run = tmp_path / name
    ok(launch(CONFIG, [f"output_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
                       "train.grpo.max_completion_length=10", *overrides], nproc=nproc,
              script="tests/grpo_teacher_forced.py"))
    losses = {r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r}
    return [losses[1], losses[2]], grad_norms(run)


@pytest.mark.slow
def test_zero3_dapo_equals_the_textbook_global_token_mean(tmp_path):
    """ZeRO-3, 2 ranks x micro batch 1 x accumulation 2, fixed completions of different lengths: both steps' loss
    and grad norm equal the one-process reference whose dapo loss is the mean over the global batch's active
    tokens; a mean of per-micro-batch token means (TRL's local variants) differs from it."""
    from test_dpo import max_rel

    losses, norms = _parity_run(tmp_path, "z3", ["ds.zero_optimization.stage=3"])
    cfg = load_run_config(CONFIG, [f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
                                   "train.grpo.max_completion_length=10"])
    ref = grpo_reference(cfg, world=2, steps=2)
    assert max_rel(losses, ref["losses"]) <= 1e-5, (losses, ref["losses"])
    assert max_rel(norms, ref["grad_norms"]) <= 1e-4, (norms, ref["grad_norms"])
    assert min(abs(x) for x in ref["losses"]) > 1e-3, ref  # the advantages do not vanish
    assert max_rel(ref["per_micro"], ref["losses"]) > 1e-3, ref  # per-micro-batch token means would differ


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
@pytest.mark.parametrize(("name", "overrides", "nproc"), [
    ("z0-grpo", ["ds.zero_optimization.stage=0", "train.grpo.loss_type=grpo"], 2),
    ("z3-grpo", ["ds.zero_optimization.stage=3", "train.grpo.loss_type=grpo"], 2),
    ("z0-dr_grpo", ["ds.zero_optimization.stage=0", "train.grpo.loss_type=dr_grpo"], 2),
    ("z0-bnpo", ["ds.zero_optimization.stage=0", "train.grpo.loss_type=bnpo"], 2),
    ("z2-world1", ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2"], 1)])
def test_other_stages_splits_and_world_sizes_equal_the_textbook(tmp_path, name, overrides, nproc):
    """Every other loss type at ZeRO 0 (2 ranks x accumulation 2), grpo at ZeRO 3 too (the loss types differ only in the
    normalisation, which is stage-blind; the stage's own path is the ZeRO-3 dapo and grpo runs): grpo (per-completion means, averaged over the
    global batch's completions), dr_grpo (the global batch's token sum / completions x max_completion_length), bnpo
    (each micro-batch's token mean, averaged over micro-batches, TRL's local normalisation); dapo on one rank at micro
    batch 2 x accumulation 2 (the same 4 prompts per step, cut otherwise; the 2-rank micro batch 2 x accumulation 1
    twin left for the extended checks' budget): each equals the reference of its own layout, and the dapo one equals
    the ZeRO-3 test's reference."""
    from test_dpo import max_rel

    losses, norms = _parity_run(tmp_path, name, overrides, nproc)
    cfg = load_run_config(CONFIG, [f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
                                   "train.grpo.max_completion_length=10", *overrides])
    ref = grpo_reference(cfg, world=nproc, steps=2)
    if "train.grpo.loss_type=grpo" in overrides:  # each completion's advantage is one per token: the loss is -mean(A) = 0
        assert max(abs(x) for x in losses + ref["losses"]) <= 1e-6, (losses, ref["losses"])
    else:
        assert max_rel(losses, ref["losses"]) <= 1e-5, (losses, ref["losses"])
    if any(o.startswith("train.micro_batch_size") for o in overrides):
        # the same global batches as the ZeRO-3 dapo test's 2 ranks x micro batch 1 x accumulation 2: the same steps
        base = grpo_reference(load_run_config(CONFIG, [f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
                                                       "train.grpo.max_completion_length=10"]), world=2, steps=2)
        assert max_rel(losses, base["losses"]) <= 1e-5, (losses, base["losses"])
    assert max_rel(norms, ref["grad_norms"]) <= 1e-4, (norms, ref["grad_norms"])
    assert min(ref["grad_norms"]) > 1e-2, ref
    if any(o in overrides for o in ("train.grpo.loss_type=dr_grpo", "train.grpo.loss_type=bnpo")):
        dapo = grpo_reference(load_run_config(CONFIG, [f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2",
                                                       "train.grpo.max_completion_length=10"]), world=2, steps=2)
        assert max_rel(losses, dapo["losses"]) > 1e-3, (losses, dapo["losses"])  # another normalisation


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_num_iterations_reuses_the_generation_batch_and_resumes_between_its_steps(tmp_path):
    """``num_iterations=2``, ZeRO-3, 2 ranks x accumulation 2, 3 steps: step 1 generates and trains (ratio 1), step
    2 trains the same completions with ratios to the generation-time log-probabilities (clipping acts), step 3
    generates the next batch; each step's loss and grad norm equal the one-process reference. A resume from the
    checkpoint of step 1 (between the two steps of one generation batch) trains steps 2 and 3 the same: the
    checkpoint kept the batch and its log-probabilities (regenerated from step 1's weights, the ratios would be 1).
    """
    from test_dpo import grad_norms, max_rel

    overrides = ["ds.zero_optimization.stage=3", "train.grpo.num_iterations=2", "train.max_steps=3",
                 "train.save_every=1", "train.grpo.max_completion_length=10", f"data.cache_dir={tmp_path / 'cache'}"]
    run = tmp_path / "run"
    ok(launch(CONFIG, [f"output_dir={run}", *overrides], script="tests/grpo_teacher_forced.py"))
    train = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    losses, norms = [train[s]["train/loss"] for s in (1, 2, 3)], grad_norms(run)
    ref = grpo_reference(load_run_config(CONFIG, overrides), world=2, steps=3)
    assert max_rel(losses, ref["losses"]) <= 1e-5, (losses, ref["losses"])
    assert max_rel(norms, ref["grad_norms"]) <= 1e-4, (norms, ref["grad_norms"])
    assert ref["max_ratio_change"][0] == 0 and ref["max_ratio_change"][1] > 0.05, ref  # step 2's ratios are not 1
    assert train[2]["train/clip_ratio/region_mean"] > 0, train[2]
    assert train[2]["train/reward"] == train[1]["train/reward"] != train[3]["train/reward"]
    assert (run / "checkpoints" / "step1" / "recipe_state_rank1.pt").is_file()
    resumed = tmp_path / "resumed"
    ok(launch(CONFIG, [f"output_dir={resumed}", *overrides], resume=str(run / "checkpoints" / "step1"),
              script="tests/grpo_teacher_forced.py"))
    again = {r["step"]: r["train/loss"] for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(again) == [2, 3] and max_rel([again[2], again[3]], losses[1:]) <= 1e-6, (again, losses)


def test_a_reward_model_folder_scores_as_trl_does(tmp_path):
    """A folder with a one-label sequence classifier and its tokenizer is a reward function: the score of prompt +
    completion (text joined, no special tokens, right-padded in a batch) is ``logits[:, 0]`` of that text alone; a
    two-label model is refused with the key."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from finetune.errors import ConfigError
    from finetune.recipes.common import rewards

    tok = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2", local_files_only=True)
    for labels in (1, 2):
        config = AutoConfig.from_pretrained(REPO / "data/models/tiny-llama", num_labels=labels,
                                            pad_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / f"rm{labels}")
        tok.save_pretrained(tmp_path / f"rm{labels}")
    cfg = load_run_config(CONFIG, [f"train.grpo.rewards=[{tmp_path / 'rm1'},length]", "train.grpo.reward_weights=[]"])
    fns = rewards.load(cfg)
    assert [f.name for f in fns] == ["reward_model", "length"]
    prompts, completions = ["What is 2 + 3?", "Name a colour."], [" It is 5, of course.", " Red"]
    table = rewards.score(fns, prompts, completions, [[1, 2, 3], [4]], {"answer": ["#### 5", "red"]})
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm1", local_files_only=True).eval()
    for i in range(2):
        alone = tok(prompts[i] + completions[i], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert table[i][0] == pytest.approx(model(**alone).logits[0, 0].item(), abs=1e-5)
    bad = load_run_config(CONFIG, [f"train.grpo.rewards=[{tmp_path / 'rm2'}]", "train.grpo.reward_weights=[]"])
    with pytest.raises(ConfigError, match=r"train.grpo.rewards\[0\]: .*rm2' is a model with 2 labels"):
        rewards.load(bad)


def test_plan_counts_the_rollout_and_its_kv_cache():
    """``finetune plan``: a row trains as ``num_generations`` sequences of prompt + completion tokens, and the
    generation's KV cache is 2 x layers x key-value heads x head size x sequences x tokens x bytes."""
    from finetune.preflight import plan

    cfg = load_run_config(CONFIG, ["train.micro_batch_size=3"])
    text, options, _ = plan.make_plan(cfg, gpus_per_node=2, nodes=1, gpu_bytes=80 * 2**30, cpu_bytes=None)
    shape = plan.model_shape(cfg)
    assert shape.generation == (4, 48 + 12) and shape.sequences_per_row == 4
    assert plan.kv_cache_bytes(shape, 3, 4) == 2 * 2 * shape.kv_heads * shape.head_dim * 3 * 4 * 60 * 4
    assert "generation every step: 4 sequences per row of up to 60 tokens, trained as 12 sequences" in text
    dense = plan.activation_bytes(shape, 12, 60, 4, False)
    zero2 = next(e for e in options if e.stage == 2 and not e.offload and not e.checkpointing)
    assert zero2.gpu["activations"] == dense["activations"]  # 3 rows x 4 completions of 60 tokens


def test_conversational_prompts_open_the_assistant_turn(tmp_path, capsys):
    """A prompt given as messages is rendered with the chat template and the assistant's turn opened (what the
    model continues); the raw messages reach the reward functions; a malformed conversation is one --check line."""
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import get_recipe

    chat = [f"data.chat_template={REPO / 'data/chat_templates/chatml.jinja'}", "data.prompt_column=prompt"]
    cfg = load_run_config(CONFIG, chat)
    tok = load_tokenizer(cfg, get_recipe("grpo"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    out = grpo.tokenize_function(tok, cfg.data)({"prompt": [messages], "answer": ["#### 4"]})
    text = tok.decode(out["input_ids"][0])
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?<|endoftext|>\n<|im_start|>assistant" in text, text
    assert out[grpo.PROMPT_COLUMN] == [messages] and out[grpo.COLUMN_PREFIX + "answer"] == ["#### 4"]
    bad = write_parquet(tmp_path / "chat.parquet", {"prompt": [messages, [{"role": "user"}]], "answer": ["#### 4", "#### 5"]})
    assert check_files(CONFIG, tmp_path, [bad], chat) == 2
    assert "chat.parquet' row 1 of column 'prompt' is" in capsys.readouterr().err


def test_inspect_shows_the_prompts(capsys, tmp_path):
    """``finetune inspect`` on a grpo config shows each row's prompt tokens, no labels and no 'nothing trained'
    warnings (training generates the completions)."""
    from finetune.commands import inspect as inspect_cmd

    assert inspect_cmd.main([str(CONFIG), f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    out = capsys.readouterr()
    assert "prompts only: every training step generates their completions" in out.out
    assert "--- row 0: 36 prompt tokens\nNatalia sold clips" in out.out and "warning" not in out.out + out.err


def test_a_resume_that_changes_num_iterations_is_refused_unless_allowed():
    """``train.grpo.num_iterations`` 2 -> 1 on resume: the checkpoint's position counts each step's prompts twice,
    so the continuation would skip or repeat prompts of the uninterrupted order: refused in one line, or a warning
    with ``--resume-allow-changes``."""
    from finetune.config import config_to_dict
    from finetune.lifecycle import resume

    old = config_to_dict(load_run_config(CONFIG, ["train.grpo.num_iterations=2"]))
    cfg = load_run_config(CONFIG)
    problems, _ = resume.review(old, 2, cfg, 2, allow=False)
    assert [p for p in problems if "train.grpo.num_iterations changed (2 -> 1)" in p and "skip or repeat" in p], problems
    problems, notes = resume.review(old, 2, cfg, 2, allow=True)
    assert not problems and any("num_iterations" in n and "continuing" in n for n in notes), notes
