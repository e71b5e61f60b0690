"""NEFTune (``train.neftune_noise_alpha``, :mod:`finetune.engine.neftune`): noise on the input embeddings in
training forwards only, of transformers' magnitude; evaluation and the export are unaffected: a 2-rank run with
NEFTune on evaluates the same loss as ``finetune evaluate`` of its export without it, and its export passes the
check against the engine's logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CONFIGS, REPO, check_here, finetune_here, free_port, launch, ok, read_metrics

SFT = CONFIGS / "tiny_sft.yaml"


def test_noise_in_training_forwards_only_of_transformers_magnitude():
    """Training: each embedding moves by at most alpha / sqrt(positions x hidden), and the noise is fresh every
    forward; eval: the very logits of the model without the hook; the weights are the model's own. Also through a
    LoRA-wrapped model (the hook on the base model's embeddings)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.engine import neftune

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "data/models/tiny-llama"),
                                             dtype=torch.float32)
    ids = torch.randint(0, 1000, (2, 24))
    plain_embed = model.get_input_embeddings()(ids).detach()
    model.eval()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    alpha = 5.0
    handle = neftune.activate(model, alpha)
    magnitude = alpha / math.sqrt(24 * plain_embed.shape[-1])
    model.train()
    first, second = model.get_input_embeddings()(ids).detach(), model.get_input_embeddings()(ids).detach()
    assert 0.5 * magnitude < (first - plain_embed).abs().max() <= magnitude + 1e-7
    assert not torch.equal(first, second)  # fresh noise every forward
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    handle.remove()
    assert neftune.activate(model, 0.0) is None

    import peft

    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    neftune.activate(wrapped, alpha)
    wrapped.train()
    assert not torch.equal(wrapped.get_input_embeddings()(ids), plain_embed)


def _noise(model, **inputs) -> torch.Tensor:
    """The noise NEFTune added to the input embeddings in one training forward of ``model(**inputs)``."""
    seen = []
    embed = model.get_input_embeddings()
    handle = embed.register_forward_hook(lambda m, a, out: seen.append(out.detach()))  # runs after NEFTune's
    model(**inputs)
    handle.remove()
    embed.eval()  # the embeddings without noise
    plain = embed(inputs["input_ids"]).detach()
    embed.train()
    return seen[0] - plain


def test_noise_scales_with_each_examples_length():
    """Issue 68 item 7: the magnitude is ``alpha / sqrt(L x d)`` with ``L`` each example's length (the paper's and
    its code's), not the row's: examples of 4, 12 and 8 tokens packed into one row (``position_ids`` restarting, as
    ``sft`` packing and flash attention's flattened micro-batch give them) each get their own magnitude; padded rows
    (``attention_mask``) get their real length's, and no noise on the pads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.engine import neftune

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "data/models/tiny-llama"),
                                             dtype=torch.float32)
    d, alpha = model.config.hidden_size, 5.0
    neftune.activate(model, alpha)
    model.train()

    lengths = (4, 12, 8)
    ids = torch.randint(0, 1000, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    noise = _noise(model, input_ids=ids, position_ids=pos)
    start = 0
    for n in lengths:
        bound = alpha / math.sqrt(n * d)
        got = noise[0, start:start + n].abs().max()
        assert 0.9 * bound < got <= bound + 1e-7, (n, got, bound)
        start += n

    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.tensor([[1] * 5 + [0] * 4, [1] * 9])
    noise = _noise(model, input_ids=ids, attention_mask=mask)
    for row, n in enumerate((5, 9)):
        bound = alpha / math.sqrt(n * d)
        assert 0.9 * bound < noise[row, :n].abs().max() <= bound + 1e-7, (row, noise[row, :n].abs().max(), bound)
    assert not noise[0, 5:].any(), "noise on the pads"


def test_bad_alpha_and_other_recipes_are_one_line(tmp_path, capsys):
    for config, value, want in ((SFT, "-1", "train.neftune_noise_alpha: must be a finite number >= 0"),
                                (CONFIGS / "tiny_grpo.yaml", "5", "NEFTune is for the causal-LM recipes gpt_clm and sft")):
        code, out = check_here(["--config", config, f"output_dir={tmp_path / 'run'}",
                                f"train.neftune_noise_alpha={value}"], capsys)
        errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
        assert code == 2 and len(errors) == 1 and want in errors[0], out[-2000:]


@pytest.mark.slow
@pytest.mark.extended  # suite budget: python -m pytest -m extended
def test_a_neftune_run_evaluates_and_exports_as_without_it(tmp_path, capsys, monkeypatch):
    """Issue 54's acceptance: 2 ranks, ZeRO-2, NEFTune alpha 5; the run's final evaluation (every validation row,
    the hook attached, eval mode) equals ``finetune evaluate`` of its export on one rank without NEFTune (the same
    weights), and the export passed its check against the engine's logits."""
    run = tmp_path / "run"
    proc = ok(launch(SFT, [f"output_dir={run}", "train.neftune_noise_alpha=5", "train.max_steps=3",
                           "train.eval_max_batches=0", "data.max_train_rows=24"]))
    said = "NEFTune: noise alpha 5 on the input embeddings, training forwards only"
    assert said in proc.stdout and all(said in (run / "logs" / f"rank{r}.log").read_text() for r in (0, 1))
    final = [r for r in read_metrics(run) if "eval/loss" in r][-1]
    assert final["step"] == 3
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "evaluation.json"
    code, printed = finetune_here(["evaluate", run, "--config", SFT, "--out", out, "train.eval_max_batches=0",
                                   "train.micro_batch_size=2"], capsys)
    assert code == 0, printed[-3000:]
    again = json.loads(out.read_text())["metrics"]["eval/loss"]
    assert again == pytest.approx(final["eval/loss"], rel=1e-5), (again, final)
