"""``train.eval_generate``: answers generated during evaluation on 2 CPU ranks, in lockstep under ZeRO-3, equal one
process's greedy ``generate`` on the export; scores, files and TensorBoard text; exact match on constructed
outputs; the input checks.

The run: ``tests/configs/tiny_sft.yaml`` (GSM8K chat form, ChatML template), 4 steps, evaluations at 2 and 4, 5
prompts (an odd number: rank 1 runs a filler generation to stay in step with rank 0), 12 new tokens, GSM8K's answer
pattern. The reference: the export loaded with plain transformers in this process, greedy, the same prompts.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CONFIGS, check_here, launch, ok, read_metrics
from finetune.training.generation import answer_of, exact_match, rouge_l

pytestmark = pytest.mark.slow

SFT = CONFIGS / "tiny_sft.yaml"
PATTERN = "#### (-?[0-9.,]+)"
GEN = ["train.max_steps=4", "train.eval_every=2", "train.eval_generate.prompts=5",
       "train.eval_generate.max_new_tokens=12", f"train.eval_generate.answer_pattern={PATTERN}"]


def _single_process_outputs(export, prompts: int, new_tokens: int) -> list[str]:
    """Greedy answers of the export, one process, plain transformers, to the run's first validation prompts."""
    from transformers import AutoModelForCausalLM

    from finetune.config import load_run_config
    from finetune.data.dataset import validation_rows
    from finetune.engine.model import load_tokenizer
    from finetune.recipes import recipe_for

    cfg = load_run_config(str(SFT), [])
    recipe = recipe_for(cfg)
    tok = load_tokenizer(cfg, recipe)
    pairs = recipe.generation_pairs(tok, validation_rows(cfg.data, recipe.columns(cfg.data), cfg.train.seed, 40),
                                    cfg.data)[:prompts]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids, _ in pairs:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            outs.append(tok.decode(y[0, len(ids):], skip_special_tokens=True))
    return outs


@pytest.mark.parametrize("stage", [3, 0])
def test_generation_during_eval_equals_one_process_on_the_export(tmp_path, stage):
    run = tmp_path / "run"
    ok(launch(SFT, [f"output_dir={run}", f"deepspeed=ds_configs/zero{stage}.json", *GEN]))
    rows = {r["step"]: r for r in read_metrics(run) if "eval/rougeL" in r}
    assert sorted(rows) == [2, 4]
    for step in (2, 4):
        assert 0.0 <= rows[step]["eval/rougeL"] <= 1.0 and 0.0 <= rows[step]["eval/generation_exact_match"] <= 1.0
        records = [json.loads(line) for line in (run / "eval" / f"step{step}_generations.jsonl").read_text().splitlines()]
        assert [r["index"] for r in records] == list(range(5))
        assert all(r["prompt"].rstrip().endswith("<|im_start|>assistant") for r in records), records[0]["prompt"]
        assert all("####" in r["reference"] for r in records)
        mean = sum(r["rougeL"] for r in records) / 5
        assert rows[step]["eval/rougeL"] == pytest.approx(mean, rel=1e-9)
        assert all(r["rougeL"] == pytest.approx(rouge_l(r["reference"], r["output"])) for r in records)
    final = [json.loads(line)["output"] for line in (run / "eval" / "step4_generations.jsonl").read_text().splitlines()]
    assert final == _single_process_outputs(run / "export", 5, 12)
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").rglob("events.out.tfevents.*"))
    assert b"eval/generations" in events and b"eval/rougeL" in events


def test_exact_match_and_checks(capsys):
    ref = "She pays 3 * 4 = 12 dollars.\n#### 1,200"
    assert answer_of(ref, PATTERN) == "1200"
    assert exact_match(ref, "so the total is #### 1200.", PATTERN) == 1.0  # separators and the final period
    assert exact_match(ref, "#### 1201", PATTERN) == 0.0  # wrong
    assert exact_match(ref, "the answer is 1200", PATTERN) == 0.0  # no pattern in the output
    assert exact_match("no answer here", "#### 1200", PATTERN) is None  # left out of the mean
    assert answer_of("x = 5", r"= \d+") == "= 5"  # no group: the whole match
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("the cat sat", "dogs run") == 0.0
    code, out = check_here(["--config", CONFIGS / "parity_cls.yaml", "train.eval_generate.prompts=2",
                            "train.eval_generate.top_p=0", "train.eval_generate.answer_pattern=(x",
                            "train.eval_generate.max_new_tokens=0"], capsys)
    assert code == 2
    for line in ("train.eval_generate: recipe seq_cls does not generate text",
                 "train.eval_generate.top_p: must be in (0, 1], got 0",
                 "train.eval_generate.answer_pattern: '(x' is not a regular expression",
                 "train.eval_generate.max_new_tokens: must be > 0, got 0"):
        assert f"finetune: error: {line}" in out, out[-2000:]
