"""The real-model tier (``pytest -m real``; issue 69): runs on the real pretrained SmolLM2-135M-Instruct, from its GGUF
file (``../shared/models/`` or where ``scripts/get_smollm2.sh`` put it). Minutes each, so neither in the suite nor in
the extended checks: run them before a change to a recipe, the GGUF path or the README's main command lands
(docs/development.md).

* The README's main command, from a fresh clone: fetch the model, convert it, GRPO with LoRA on two-digit additions;
  the held-out greedy accuracy rises by 15 points or more, the log prints it before and after with three held-out
  answers, and the merged export passes its check against the engine's logits.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, cpu_env, launch, ok, read_metrics, smollm2_gguf, train_losses
from test_architectures import _plain_logps
from test_readme import readme_block

pytestmark = [pytest.mark.real, pytest.mark.skipif(not smollm2_gguf().is_file(),
                                                   reason="the SmolLM2 GGUF file is not here (scripts/get_smollm2.sh)")]


def test_readme_main_command_fine_tunes_the_real_model(tmp_path):
    """The README's main command after its install steps (this venv stands in for the one it creates), in a fresh
    clone of the committed tree with a cold conversion cache: ``get_smollm2.sh`` places the GGUF, the launch converts it
    and trains; held-out accuracy +15 points or more, printed with three answers before and after, in under 10
    minutes (the README's promise, install excluded here)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    steps = [s.strip() for s in readme_block("<!-- main-command -->").split("&&")]
    fetch = next(s for s in steps if "get_smollm2.sh" in s)
    train = shlex.split(steps[-1])
    env_assignments = dict(a.split("=", 1) for a in train if re.match(r"^[A-Z_]+=", a))
    argv = [a for a in train if a not in {f"{k}={v}" for k, v in env_assignments.items()}]
    assert argv[0] == "deepspeed"
    env = cpu_env(**env_assignments, FINETUNE_CACHE=str(tmp_path / "cache"), SMOLLM2_SHARED_DIR=str(smollm2_gguf().parent))
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env['PATH']}" if (REPO / ".venv").exists() else env["PATH"]
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", fetch], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    proc = subprocess.run(argv, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "converted by transformers into" in proc.stdout  # a cold cache: the conversion is part of the command
    run = next((clone / "runs" / "grpo_smollm2_arithmetic").iterdir())
    evals = [r for r in read_metrics(run) if "eval/reward" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 10, evals
    before, after = evals[0]["eval/reward"], evals[-1]["eval/reward"]
    assert after - before >= 0.15, (before, after)
    assert f"eval/reward {before:.4g} (step 0) -> {after:.4g} (step 10)" in proc.stdout
    assert proc.stdout.count("held-out answer to 'What is ") == 3, proc.stdout[-3000:]
    assert (run / "export" / "model.safetensors").is_file() and (run / "export_check.json").is_file()
    assert took < 600, f"{took:.0f} s"
    print(f"README main command: {took:.0f} s, held-out accuracy {before:.3f} -> {after:.3f}", file=sys.stderr)


@pytest.fixture(scope="module")
def smollm2():
    """The real model in fp32 (converted from its GGUF file once into the user's cache, as a run does), its tokenizer
    with the stock ChatML template, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.engine import gguf

    folder, _ = gguf.ensure_converted(str(smollm2_gguf()), _cache())
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    return folder, tok, model


CONVERSATIONS = [[{"role": "user", "content": "What is 12 + 30? Answer with just the number."},
                  {"role": "assistant", "content": "42"}],
                 [{"role": "user", "content": "Name a primary colour."},
                  {"role": "assistant", "content": "Red is a primary colour."}]]


def test_every_causal_recipe_trains_on_the_real_models_own_log_probs(smollm2):
    """With the stock ChatML template, the real end of turn (``<|im_end|>``, the tokenizer's EOS and the generation
    config's ``eos_token_id``) and the real weights: ``sft``/``gpt_clm``'s token losses, ``dpo``/``kto``'s sequence
    log-probabilities, ``distill``'s student and teacher cross-entropies (the model as its own teacher: divergence
    0) and ``grpo``'s completion log-probabilities at the sampling temperature (prompt sharing on and off) equal
    ``log_softmax`` of the plain model's logits on the same tokens."""
    from finetune.config import DistillConfig, GrpoConfig
    from finetune.engine.rollout import stop_token_ids
    from finetune.recipes import distill, dpo, gpt_clm, grpo
    from finetune.recipes.common import chat

    _, tok, model = smollm2
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == end and model.generation_config.eos_token_id in (end, [end])
    assert stop_token_ids(model, tok) == [end]
    template = tok.chat_template
    rows = [chat.encode_messages(tok, m, template) for m in CONVERSATIONS]
    for (ids, labels), messages in zip(rows, CONVERSATIONS):  # answer-only: the reply and the turn's end
        trained = [t for t in labels if t != -100]
        assert tok.decode(trained).startswith(messages[-1]["content"] + "<|im_end|>"), tok.decode(trained)
    width = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    plain = _plain_logps(model, ids, mask)
    keep = labels[:, 1:] != -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        loss_sum = gpt_clm.forward(model, batch).loss_sum
        sequences, _ = dpo.sequence_logps(model, batch)
        _, stats = distill.distill_loss(model, batch, DistillConfig(loss="forward_kl"), model)
    want = -(plain * keep).sum()
    assert loss_sum.item() == pytest.approx(want.item(), rel=1e-4)
    assert torch.allclose(sequences, (plain * keep).sum(1), rtol=1e-4, atol=1e-3), (sequences, (plain * keep).sum(1))
    assert stats["ce"].item() == pytest.approx(want.item(), rel=1e-4)
    assert stats["teacher_ce"].item() == pytest.approx(want.item(), rel=1e-4)
    assert abs(stats["kd"].item()) < 1e-3 * int(keep.sum())
    # grpo: two prompts rendered with the template's generation prompt (left-padded), two completions each: one ends
    # with the real end of turn, one is cut without it
    prompts = [chat.prompt_ids(tok, m[:1], template) for m in CONVERSATIONS]
    p = max(len(x) for x in prompts)
    prompt_batch = {"input_ids": torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
                    "attention_mask": torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])}
    answers = [tok("42", add_special_tokens=False)["input_ids"] + [end], tok("4 and 2", add_special_tokens=False)["input_ids"],
               tok("Red.", add_special_tokens=False)["input_ids"] + [end], tok("Blue", add_special_tokens=False)["input_ids"]]
    c = max(len(a) for a in answers)
    completion = torch.tensor([a + [pad] * (c - len(a)) for a in answers])
    cmask = torch.tensor([[1.0] * len(a) + [0.0] * (c - len(a)) for a in answers])
    done = {"completion_ids": completion, "completion_mask": cmask,
            "terminated": torch.tensor([a[-1] == end for a in answers]), "lengths": cmask.sum(1).long()}
    zeros = torch.zeros(4)
    g = grpo._sequences(prompt_batch, done, GrpoConfig(num_generations=2), zeros, zeros, zeros, zeros[:, None])
    want = _plain_logps(model, g["input_ids"], g["attention_mask"], g["position_ids"], 0.7)[:, p - 1:]
    active = g["completion_mask"].bool()
    for share in (False, True):
        assert grpo.shares_prompts(model, g, share) == share
        with torch.no_grad():
            got, _ = grpo.completion_logps(model, g, 0.7, share)
        assert torch.allclose(got[active], want[active], rtol=1e-4, atol=1e-4), (share, (got - want)[active].abs().max())


def _cache() -> Path:
    """The conversion cache the fixture and the launches share (the user's, as a run's: converted once)."""
    from finetune.config import DataConfig
    from finetune.data.dataset import default_cache_dir

    return default_cache_dir(DataConfig())


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, smollm2):
    """``sft_smollm2_gsm8k.yaml`` on 2 ranks at ZeRO-3 (persistence threshold 0: every parameter gathered and
    released), LoRA, short rows: 2 steps from the GGUF file (a checkpoint at each step, the export); the same run
    resumed from its step-1 checkpoint; 1 step from the converted folder. ``(run, resumed, from_folder)``."""
    tmp = tmp_path_factory.mktemp("real_sft")
    common = ["deepspeed=ds_configs/zero3.json", "data.max_seq_len=128", "data.truncation=truncate",
              "data.max_train_rows=48", "data.validation_files=[]", "train.eval_on_start=false",
              "train.eval_generate.prompts=0", "train.log_every=1", "train.micro_batch_size=1"]
    env = cpu_env(FINETUNE_CACHE=str(_cache()))
    config = "finetune/recipes/configs/sft_smollm2_gsm8k.yaml"
    gguf_file = f"model.path={smollm2_gguf()}"
    ok(launch(config, [*common, gguf_file, f"output_dir={tmp / 'run'}", "train.max_steps=2", "train.save_every=1",
                       "export=true"], env=env, timeout=900))
    ok(launch(config, [*common, gguf_file, f"output_dir={tmp / 'resumed'}", "train.max_steps=2", "train.save_every=1",
                       "export=false"], resume=str(tmp / "run" / "checkpoints" / "step1"), env=env, timeout=900))
    ok(launch(config, [*common, f"model.path={smollm2[0]}", f"output_dir={tmp / 'folder'}", "train.max_steps=1",
                       "export=false"], env=env, timeout=900))
    return tmp / "run", tmp / "resumed", tmp / "folder"


def test_real_sft_at_zero3_trains_resumes_exactly_exports_and_matches_its_folder(sft_runs):
    """The real model through ``sft`` at ZeRO-3 with LoRA: the loss falls from a real value, the resumed step equals
    the uninterrupted one, the merged export reloads with the engine's logits (``export_check.json``), and the GGUF
    file trains as its converted folder does: the same first-step loss."""
    run, resumed, folder = sft_runs
    first = train_losses(run)
    assert sorted(first) == [1, 2] and 0.1 < first[1] < 5, first  # a pretrained model's loss on GSM8K answers
    assert train_losses(resumed) == pytest.approx({2: first[2]}, rel=1e-6)
    check = json.loads((run / "export_check.json").read_text())
    assert check["finite"] and check["max_abs_logit_diff"] <= check["tolerance"], check
    assert (run / "export" / "model.safetensors").is_file()
    assert train_losses(folder)[1] == pytest.approx(first[1], rel=1e-7), (train_losses(folder), first)


REAL_RUNS = {
    # DPO with LoRA on the model's own sampled pairs: the reference is the base model, adapters off
    "dpo": ("finetune/recipes/configs/dpo_smollm2_arithmetic.yaml",
            ["data.max_train_rows=16", "data.validation_files=[]", "train.micro_batch_size=2"]),
    # GRPO with LoRA, the calculator offered through the tools-capable ChatML template (its system turn lists the
    # tool, so the prompts are longer), 2 prompts x 4 completions per rank
    "grpo_tool": ("finetune/recipes/configs/grpo_smollm2_arithmetic.yaml",
                  ["train.grpo.tools=[data/tools/calculator.py:calculate]",
                   "data.chat_template=data/chat_templates/chatml_tools.jinja", "data.max_seq_len=320",
                   "train.grpo.max_completion_length=24", "train.grpo.num_generations=4",
                   "train.micro_batch_size=2", "data.max_train_rows=16", "data.validation_files=[]"]),
    # a small student from scratch with the real model (its GGUF file) as its teacher, partitioned as the student
    "distill": ("finetune/recipes/configs/distill_smollm2_gsm8k.yaml",
                ["data.max_seq_len=128", "data.truncation=truncate", "data.max_train_rows=32",
                 "data.validation_files=[]", "train.micro_batch_size=1", "train.warmup_steps=0"]),
}


@pytest.mark.parametrize("name", sorted(REAL_RUNS))
def test_real_recipe_at_zero3_trains_resumes_exactly_and_exports(name, tmp_path, smollm2):
    """``dpo``, ``grpo`` with a tool and ``distill`` on the real model at ZeRO-3 (persistence threshold 0, 2 ranks),
    2 steps from the GGUF file with a checkpoint at each, then the same run resumed from its step-1 checkpoint: a real
    loss, the resumed step equal to the uninterrupted one, and the export (merged LoRA for dpo and grpo) reloaded with
    the engine's logits (``export_check.json``)."""
    config, overrides = REAL_RUNS[name]
    common = ["deepspeed=ds_configs/zero3.json", f"model.path={smollm2_gguf()}", "train.eval_on_start=false",
              "train.log_every=1", "train.max_steps=2", "train.save_every=1", *overrides]
    if name == "distill":
        common.append(f"train.distill.teacher={smollm2_gguf()}")
    env = cpu_env(FINETUNE_CACHE=str(_cache()))
    ok(launch(config, [*common, f"output_dir={tmp_path / 'run'}", "export=true"], env=env, timeout=900))
    ok(launch(config, [*common, f"output_dir={tmp_path / 'resumed'}", "export=false"],
              resume=str(tmp_path / "run" / "checkpoints" / "step1"), env=env, timeout=900))
    first = train_losses(tmp_path / "run")
    assert sorted(first) == [1, 2] and all(abs(v) < 20 for v in first.values()), first
    assert train_losses(tmp_path / "resumed") == pytest.approx({2: first[2]}, rel=1e-6, abs=1e-7)
    check = json.loads((tmp_path / "run" / "export_check.json").read_text())
    assert check["finite"] and check["max_abs_logit_diff"] <= check["tolerance"], check
    if name == "grpo_tool":  # the tool was offered: the rollouts' tool metrics are logged
        assert any("train/tools/call_frequency" in r for r in read_metrics(tmp_path / "run")), read_metrics(tmp_path / "run")
