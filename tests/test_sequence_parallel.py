"""Sequence parallelism (DeepSpeed Ulysses, ``parallel.sequence_parallel_size``) trains what one device trains.

Real launches on 2 CPU ranks (gloo's all-to-all), each rank holding half of every sequence, against
:mod:`parity_reference` (a plain single-process PyTorch loop over the same global batches; data-parallel size 1):

* ``gpt_clm`` on padded rows of 3-32 tokens (odd lengths: the SP padding and the label shift across the shard
  boundary are exercised), the Llama-architecture model with 1 key/value head (Ulysses replicates it and overwrites
  ``num_key_value_groups``), tiled MLPs, ZeRO-2, 20 steps: per-step loss 1e-5, grad norm 1e-4, exported weights
  allclose 1e-5; the export is checked against the engine with Ulysses off (sdpa with the padded rows' mask: the
  KV-group count must be the model's own again), and generation during evaluation stops at different lengths on the
  two ranks (a stop string) without a collective per tiled MLP (which deadlocked them). The same run's step-10
  checkpoint then resumes on 1 rank without SP (universal checkpoint): steps 11-20 equal the reference, and the
  final evaluation (sharded along the sequence in the SP run) equals the 1-rank one.
* ``sft`` packed rows (``position_ids`` restart per example: the packed ``sdpa`` mask of
  :func:`finetune.parallel.sequence.packed_sdpa`) on the Llama-architecture model (4 query / 2 key-value heads), ZeRO-3,
  with the memory levers on (tiled MLP, gradient checkpointing with the checkpointed hidden states offloaded):
  losses 1e-5 and grad norms 1e-4 against the reference, which has none of them (this test found ZeRO-3's reduce-scatter dividing by the world size:
  :func:`finetune.parallel.sequence.fix_zero3_average`).

Measured when written (DeepSpeed 0.19.8, torch 2.13 CPU): gpt_clm losses 1.4e-7, grad norms 1.2e-6, weights 6e-6;
sft ZeRO-3 losses 2.6e-7, grad norms 1.5e-8.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, REPO, check_here, cpu_env, launch, ok, read_metrics, run_python

sys.path.insert(0, str(Path(__file__).parent))
from parity_reference import reference_run  # noqa: E402

GPT, SFT = CONFIGS / "parity_gpt.yaml", CONFIGS / "parity_sft.yaml"
GPT_SP = ["parallel.sequence_parallel_size=2", "train.micro_batch_size=8", "ds.zero_optimization.stage=2",
          "model.path=data/models/tiny-llama", "model.tokenizer_path=data/models/tiny-gpt2", "model.init=scratch",
          "model.config_overrides={num_key_value_heads: 1}", "train.save_every=10", "export=true",
          "train.eval_generate.prompts=4", "train.eval_generate.max_new_tokens=8", "train.eval_generate.stop=[e]",
          "parallel.tiled_mlp=true", "train.dist_timeout_minutes=2"]
SFT_SP = ["parallel.sequence_parallel_size=2", "train.micro_batch_size=4", "deepspeed=ds_configs/zero3.json",
          "train.max_steps=6", "export=true",
          "parallel.tiled_mlp=true", "model.gradient_checkpointing=true", "model.offload_activations=true"]


def _config(path: Path, overrides: list[str]):
    from finetune.config import load_run_config

    return load_run_config(path, [*overrides, f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"])


def _per_step(run: Path, key: str, launch_no: int | None = None) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run) if key in r and (launch_no is None or r["launch"] == launch_no)}


def check_export(run: Path) -> float:
    """The export check's maximum absolute logit difference (``export_check.json``)."""
    return json.loads((run / "export_check.json").read_text())["max_abs_logit_diff"]


def _max_rel(got: dict[int, float], want: list[float], steps) -> float:
    return max(abs(got[s] - want[s - 1]) / abs(want[s - 1]) for s in steps)


@pytest.mark.slow
def test_gpt_clm_sp2_equals_one_device_and_resumes_without_sp(tmp_path):
    run = tmp_path / "sp"
    proc = ok(launch(GPT, [f"output_dir={run}", *GPT_SP]))
    assert "sequence parallelism: DeepSpeed Ulysses over 2 ranks (sdpa)" in proc.stdout
    assert "= micro batch 8 x accumulation 1 x data-parallel size 1" in proc.stdout
    assert "layout: world 2 = data-parallel 1 x sequence-parallel 2" in proc.stdout
    assert "export check: max |logits(export) - logits(engine)|" in proc.stdout
    # one key/value head on 2 SP ranks: Ulysses replicates it and overwrites num_key_value_groups, which the export
    # check (sdpa with the padded rows' mask, whole sequences) and generation need back as it was
    assert check_export(run) <= 1e-4
    assert "eval/rougeL" in read_metrics(run)[-1] or any("eval/rougeL" in r for r in read_metrics(run))
    records = [json.loads(line) for line in (run / "eval" / "step20_generations.jsonl").read_text().splitlines()]
    assert len(records) == 4  # Ulysses off, 2 per rank
    # ZeRO-2 with tiled MLPs: the ranks decoded different numbers of tokens (the stop string ends some answers
    # early) without waiting for each other (a collective per MLP forward would deadlock them)
    assert len({len(r["output"]) for r in records}) > 1, records

    ref = reference_run(_config(GPT, GPT_SP[1:7]), 1, 20)
    losses, norms = _per_step(run, "train/loss"), _per_step(run, "train/grad_norm")
    assert sorted(losses) == list(range(1, 21))
    assert _max_rel(losses, ref.losses, range(1, 21)) <= 1e-5, (losses, ref.losses)
    assert _max_rel(norms, ref.grad_norms, range(1, 21)) <= 1e-4, (norms, ref.grad_norms)
    from safetensors.torch import load_file

    exported = load_file(run / "export" / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.allclose(tensor.float(), ref.state_dict[name], rtol=1e-5, atol=1e-5), name

    # The step-10 checkpoint on 1 rank, SP off: the same global batch of 8 rows; the universal checkpoint loads it.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step20")
    proc = ok(launch(GPT, [f"output_dir={resumed}", *GPT_SP, "parallel.sequence_parallel_size=1"], nproc=1,
                     resume="latest"))
    assert "universal checkpoint" in proc.stdout
    again = _per_step(resumed, "train/loss", launch_no=2)
    assert sorted(again) == list(range(11, 21))
    assert _max_rel(again, ref.losses, range(11, 21)) <= 1e-5, (again, ref.losses)
    # the final evaluation: sequences cut in two on 2 ranks (SP) = whole sequences on 1 rank
    sp_eval = _per_step(run, "eval/loss")[20]
    plain_eval = _per_step(resumed, "eval/loss", launch_no=2)[20]
    assert sp_eval == pytest.approx(plain_eval, rel=1e-5), (sp_eval, plain_eval)
    # every real token counted once: the SP ranks' slices of steps 11-20 add up to the whole rows' tokens
    assert _per_step(run, "train/tokens_seen")[20] == _per_step(resumed, "train/tokens_seen", launch_no=2)[20]


@pytest.mark.slow
def test_sft_packed_sp2_zero3_equals_one_device(tmp_path):
    run = tmp_path / "sft"
    proc = ok(launch(SFT, [f"output_dir={run}", *SFT_SP]))
    assert "ZeRO-3's reduce-scatter averages over the data-parallel ranks" in proc.stdout
    assert "tiled MLP (DeepSpeed TiledMLP): 2 modules" in proc.stdout
    assert "export check: max |logits(export) - logits(engine)|" in proc.stdout
    ref = reference_run(_config(SFT, SFT_SP[1:4]), 1, 6)
    losses, norms = _per_step(run, "train/loss"), _per_step(run, "train/grad_norm")
    assert sorted(losses) == list(range(1, 7))
    assert _max_rel(losses, ref.losses, range(1, 7)) <= 1e-5, (losses, ref.losses)
    assert _max_rel(norms, ref.grad_norms, range(1, 7)) <= 1e-4, (norms, ref.grad_norms)


def test_shards_add_up_to_the_batch():
    """Cut in 3 (a length of 7 padded to 9): the slices' inputs, positions and shifted labels joined are the batch's,
    the shift crosses the slice boundaries, the real-token and target counts add up, left padding is refused."""
    from finetune.parallel.sequence import shard_batch
    from finetune.recipes.common.targets import count_targets, shift_labels

    ids = torch.arange(1, 15).view(2, 7)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    parts = [shard_batch(dict(batch), 3, r, pad_id=0) for r in range(3)]
    assert all(p["input_ids"].shape == (2, 3) and "labels" not in p and "attention_mask" not in p for p in parts)
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "position_ids", "shift_labels")}
    assert torch.equal(joined["input_ids"][:, :7], ids) and torch.equal(joined["input_ids"][:, 7:], torch.zeros(2, 2,
                                                                                                                  dtype=torch.long))
    assert torch.equal(joined["shift_labels"][:, :7], shift_labels(labels))
    assert (joined["shift_labels"][:, 7:] == -100).all()
    # the padding continues the positions: no restart, so attention sees one example per row and needs no mask
    assert torch.equal(joined["position_ids"], torch.arange(9).expand(2, 9))
    assert sum(int(count_targets(p)) for p in parts) == int(count_targets(batch)) == 9
    assert sum(int(p["num_tokens"]) for p in parts) == 11
    with pytest.raises(ValueError, match="padded on the left"):
        shard_batch({"input_ids": ids, "attention_mask": mask.flip(1), "labels": labels}, 2, 0)


def test_tiled_mlp_equals_plain_and_whole_sequence_work_gets_the_plain_forwards():
    """GPT-2's MLPs tiled (``Conv1D`` views its input: the tiles of a 2-row batch are strided slices) give the plain
    loss and gradients; within :func:`finetune.parallel.sequence.sequence_parallel_off` every MLP runs its own class's forward
    (generation on each rank alone: no collective per MLP), and the tiles are back after it."""
    from transformers import GPT2LMHeadModel

    from finetune import patches
    from finetune.parallel import sequence

    torch.manual_seed(0)
    model = GPT2LMHeadModel.from_pretrained(REPO / "data" / "models" / "tiny-gpt2", dtype=torch.float32)
    ids = torch.randint(0, 1000, (2, 12))
    plain = model(input_ids=ids, labels=ids).loss
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    try:
        assert sequence.tile_mlps(model) == 2
        tiled = model(input_ids=ids, labels=ids).loss
        tiled.backward()
        assert torch.allclose(tiled, plain, rtol=1e-6)
        assert all(torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7) for n, p in model.named_parameters())
        tiled_forwards = [(p.target, p.current()) for p, _, _ in patches.active() if p.key == "forward"]
        assert len(tiled_forwards) == 2
        with sequence.sequence_parallel_off():
            assert all("forward" not in vars(m) and m.forward.__func__ is type(m).forward for m, _ in tiled_forwards)
        assert all(vars(m)["forward"] is f for m, f in tiled_forwards)
    finally:
        patches.restore_all()
    assert not patches.active() and all("forward" not in vars(m) for m, _ in tiled_forwards)


def test_zero3_average_correction_is_guarded_by_version():
    """The ZeRO-3 SP correction applies only on the DeepSpeed versions it was checked against; another version (one
    that may have fixed the division, or renamed the method) is refused with one line, ZeRO 0-2 and SP 1 never."""
    from finetune.parallel.sequence import ZERO3_SP_AVERAGE_CHECKED, check_zero3_average

    assert check_zero3_average(3, 2, ZERO3_SP_AVERAGE_CHECKED[-1]) is None
    assert check_zero3_average(2, 2, "0.20.0") is None and check_zero3_average(3, 1, "0.20.0") is None
    line = check_zero3_average(3, 2, "0.20.0")
    assert line.startswith("parallel.sequence_parallel_size: ZeRO-3 under sequence parallelism") and "0.20.0" in line


def test_packed_sdpa_keeps_examples_apart():
    """Without a mask and with restarting positions, the wrapped sdpa equals sdpa with transformers' block-diagonal
    causal mask (and plain causal sdpa without restarts), and never hands sdpa a mask or a whole packed row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from finetune.parallel.sequence import packed_sdpa

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril())[:, None]
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    received = []

    def spy(module, q, k, v, mask, *args, **kwargs):  # what the wrapped sdpa is handed
        received.append((mask, q.shape[-2]))
        return sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)

    got, _ = packed_sdpa(spy)(module, q, k, v, None, position_ids=pos)
    assert torch.allclose(got, want, atol=1e-6)
    # no [seq, seq] tensor: each example is attended on its own, with no mask (sdpa's causal kernels)
    assert received == [(None, 3), (None, 2), (None, 1), (None, 6)]
    plain, _ = sdpa_attention_forward(module, q, k, v, None)
    assert not torch.allclose(got[0], plain[0], atol=1e-3) and torch.allclose(got[1], plain[1], atol=1e-6)


RANKS = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def test_checks_before_any_model(tmp_path, capsys):
    """World size, heads, attention, recipe, loss weighting, eval batch, generation and block length: one line each,
    exit 2."""
    code, out = check_here(["--config", GPT, f"output_dir={tmp_path / 'r'}", "parallel.sequence_parallel_size=4",
                            "model.attn_implementation=eager", "train.loss_weighting=micro_batch",
                            "train.eval_micro_batch_size=3"], capsys, WORLD_SIZE="6", **RANKS)
    assert code == 2, out[-3000:]
    errs = [line for line in out.splitlines() if line.startswith("finetune: error:")]
    text = "\n".join(errs)
    for needle in ("parallel.sequence_parallel_size: 4 does not divide the world size 6",
                   "model.attn_implementation=eager cannot be sequence-parallel",
                   "train.loss_weighting=micro_batch averages each micro-batch on its own",
                   "the model's 2 attention heads are not divisible by 4",
                   "train.eval_micro_batch_size: 3 with sequence parallelism"):
        assert sum(needle in e for e in errs) == 1, (needle, text)
    assert not (tmp_path / "r").exists()
    code, out = check_here(["--config", CONFIGS / "tiny_bert.yaml", f"output_dir={tmp_path / 'b'}",
                            "parallel.sequence_parallel_size=2"], capsys, WORLD_SIZE="2", **RANKS)
    assert code == 2 and "recipe bert_mlm does not support sequence parallelism (dpo, gpt_clm, grpo and sft do)" in out


@pytest.mark.extended
@pytest.mark.slow
def test_four_ranks_two_data_parallel_by_two_sequence_parallel(tmp_path):
    """World 4 = data-parallel 2 x sequence-parallel 2: the two SP groups draw different rows (data-parallel rank
    and size), and the run equals one device on the global batch of 2 x 4 rows (losses 1e-5, grad norms 1e-4)."""
    run = tmp_path / "dp2sp2"
    over = ["parallel.sequence_parallel_size=2", "train.micro_batch_size=4", "ds.zero_optimization.stage=1",
            "train.max_steps=10"]
    proc = ok(launch(GPT, [f"output_dir={run}", *over], nproc=4, timeout=900))
    assert "layout: world 4 = data-parallel 2 x sequence-parallel 2" in proc.stdout
    ref = reference_run(_config(GPT, over[1:]), 2, 10)
    losses, norms = _per_step(run, "train/loss"), _per_step(run, "train/grad_norm")
    assert _max_rel(losses, ref.losses, range(1, 11)) <= 1e-5, (losses, ref.losses)
    assert _max_rel(norms, ref.grad_norms, range(1, 11)) <= 1e-4, (norms, ref.grad_norms)


TP = ["parallel.tensor_parallel_size=2", "train.micro_batch_size=4", "deepspeed=ds_configs/zero2.json",
      "train.max_steps=6", "train.save_every=3", "export=true"]


@pytest.mark.extended
@pytest.mark.slow
def test_tensor_parallel_equals_one_device_exports_and_resumes_on_one_rank(tmp_path):
    """AutoTP size 2 (ZeRO-2) on sft packed rows, Llama architecture (4 query / 2 key-value heads split in two): losses,
    grad norms and the export (gathered from the engine's split layers) equal one device; the step-3 checkpoint (one
    file per tensor-parallel rank) resumes on 1 rank without TP through its universal copy, exactly; ``finetune export``
    of a split checkpoint says how to export it. Measured when written: losses 1.8e-7, grad norms 1.2e-7, weights 3e-6. Extended (about a minute)."""
    run = tmp_path / "tp"
    proc = ok(launch(SFT, [f"output_dir={run}", *TP]))
    assert "layout: world 2 = data-parallel 1 x sequence-parallel 1 x tensor-parallel 2" in proc.stdout
    assert "export check: max |logits(export) - logits(engine)|" in proc.stdout
    assert (run / "checkpoints" / "step3" / "mp_rank_01_model_states.pt").is_file()
    ref = reference_run(_config(SFT, TP[1:4]), 1, 6)
    losses, norms = _per_step(run, "train/loss"), _per_step(run, "train/grad_norm")
    assert _max_rel(losses, ref.losses, range(1, 7)) <= 1e-5, (losses, ref.losses)
    assert _max_rel(norms, ref.grad_norms, range(1, 7)) <= 1e-4, (norms, ref.grad_norms)
    from safetensors.torch import load_file

    exported = load_file(run / "export" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(ref.state_dict[k].shape) for k in exported}
    for name, tensor in exported.items():
        assert torch.allclose(tensor.float(), ref.state_dict[name], rtol=1e-4, atol=1e-4), name

    refused = run_python(["-m", "finetune", "export", str(run / "checkpoints" / "step3"), str(tmp_path / "out")])
    assert refused.returncode == 2 and "is a tensor-parallel checkpoint" in refused.stdout, refused.stdout[-2000:]

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step6")
    proc = ok(launch(SFT, [f"output_dir={resumed}", *TP, "parallel.tensor_parallel_size=1"], nproc=1,
                     resume="latest"))
    assert "universal checkpoint" in proc.stdout
    again = _per_step(resumed, "train/loss", launch_no=2)
    assert sorted(again) == [4, 5, 6]
    assert _max_rel(again, ref.losses, range(4, 7)) <= 1e-5, (again, ref.losses)


def test_tensor_parallel_checks_before_any_model(tmp_path, capsys):
    """GPT-2 (AutoTP refuses it), heads not divisible, LoRA, ZeRO-3, TP with SP, generation: one line each, exit 2."""
    code, out = check_here(["--config", GPT, f"output_dir={tmp_path / 'g'}", "parallel.tensor_parallel_size=4"],
                           capsys, WORLD_SIZE="4", **RANKS)
    assert code == 2, out[-3000:]
    assert "model type 'gpt2' is not checked with DeepSpeed's AutoTP" in out
    assert "the model's 2 attention heads are not divisible by 4" in out
    # a type outside the checked list (Phi-3's fused projections) and ZeRO-0 (rank-local gradient norms)
    phi3 = tmp_path / "phi3"
    phi3.mkdir()
    conf = json.loads((REPO / "data" / "models" / "tiny-llama" / "config.json").read_text())
    (phi3 / "config.json").write_text(json.dumps({**conf, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 'p'}", f"model.path={phi3}",
                            "model.tokenizer_path=data/models/tiny-gpt2", "deepspeed=ds_configs/zero0.json",
                            "parallel.tensor_parallel_size=2"], capsys, WORLD_SIZE="4", **RANKS)
    assert code == 2, out[-3000:]
    assert "model type 'phi3' is not checked with DeepSpeed's AutoTP" in out
    assert "tensor_parallel_size: 2 with ZeRO stage 0; tensor parallelism runs with ZeRO 1-2" in out
    code, out = check_here(["--config", SFT, f"output_dir={tmp_path / 's'}", "parallel.tensor_parallel_size=2",
                            "parallel.sequence_parallel_size=2", "model.lora.r=4", "train.eval_generate.prompts=2"],
                           capsys, WORLD_SIZE="4", **RANKS)
    errs = [line for line in out.splitlines() if line.startswith("finetune: error:")]
    text = "\n".join(errs)
    assert code == 2, out[-3000:]
    for needle in ("tensor and sequence parallelism are not combined", "LoRA does not combine with AutoTP",
                   "parallel.tensor_parallel_size: train.eval_generate shares prompts",
                   "tensor parallelism runs with ZeRO 1-2"):
        assert sum(needle in e for e in errs) == 1, (needle, text)
