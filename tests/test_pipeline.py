"""Pipeline parallelism (``parallel.pipeline_parallel_size``, finetune/parallel/pipeline.py, finetune/engine/pipeline.py):
two pipeline stages on 2 CPU ranks (and 2 stages x 2 data-parallel ranks on 4) against one device on the same global
batch (tests/parity_reference.py: transformers' full logits and cross-entropy, torch's AdamW and clipping), for a
Llama with a tied head on packed rows, GPT-2 and BERT's masked LM; a resume at the same layout; the exports (the end
of the run's and ``finetune export``'s of a checkpoint); ``finetune plan``'s bubble; the refusals, in process.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import REPO, assert_resume_repeats, cpu_env, launch, logged, max_rel, ok, one_refusal
from parity_reference import reference_run

CONFIG = REPO / "tests" / "configs" / "parity_pipeline.yaml"

GPT2 = ["recipe=gpt_clm", "model.path=data/models/tiny-gpt2", "model.tokenizer_path=data/models/tiny-gpt2",
        "model.init=pretrained", "model.config_overrides={resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, n_layer: 3}",
        "data.train_files=[data/wikitext2/test.parquet]", "data.validation_files=[data/wikitext2/validation.parquet]",
        "data.messages_column=", "data.chat_template=", "data.max_seq_len=32", "data.max_train_rows=200",
        "train.max_grad_norm=0.25", "train.max_steps=3", "train.save_every=0", "export=false"]
"""GPT-2 (tied head, learned positions) as ``gpt_clm``: rows packed into blocks (run_clm's group_texts)."""

BERT = ["recipe=bert_mlm", "model.path=data/models/bert-small",
        "model.tokenizer_path=data/models/bert-base-uncased-tokenizer", "model.init=scratch",
        "model.config_overrides={hidden_size: 64, intermediate_size: 128, num_attention_heads: 2, hidden_dropout_prob: "
        "0.0, attention_probs_dropout_prob: 0.0, num_hidden_layers: 3}",
        "data.train_files=[data/wikitext2/test.parquet]", "data.validation_files=[data/wikitext2/validation.parquet]",
        "data.messages_column=", "data.chat_template=", "data.packing=false", "data.max_seq_len=32",
        "data.max_train_rows=200", "train.max_steps=3", "train.save_every=0", "export=false"]
"""BERT masked LM (tied decoder with its own bias), padded rows of different lengths."""


def _reference(overrides: list[str], world: int, steps: int):
    from finetune.config import load_run_config
    cfg = load_run_config(CONFIG, [*overrides, f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"])
    return reference_run(cfg, world, steps)


def _assert_equal(run, ref, steps: int, weighted: bool = True) -> None:
    """Every step's loss within 1e-5 relative of one device's and its gradient norm within 1e-4. ``weighted``: the
    micro-batches' own means differ from the global weighting, so the weighting is tested (not for run_clm's blocks,
    whose micro-batches all hold the same number of targets)."""
    assert not weighted or max(abs(a - b) / b for a, b in zip(ref.micro_batch_losses, ref.token_losses)) > 1e-5
    losses, norms = logged(run, "train/loss"), logged(run, "train/grad_norm")
    assert len(losses) == steps, losses
    print(f"pipeline parity: losses max rel {max_rel(losses, ref.losses):.2e}, grad norms max rel "
          f"{max_rel(norms, ref.grad_norms):.2e}", file=sys.__stdout__)  # the figures docs/parallelism.md quotes
    assert max_rel(losses, ref.losses) <= 1e-5, (losses, ref.losses)
    assert max_rel(norms, ref.grad_norms) <= 1e-4, (norms, ref.grad_norms)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("pipeline") / "llama"
    proc = ok(launch(CONFIG, [f"output_dir={run}"]))
    return run, proc.stdout


def test_two_stages_equal_one_device_resume_and_export(llama_run, tmp_path, capsys):
    """Llama (tied head) sft on packed rows, 2 stages: 4 steps equal one device; the launch says how the layers were
    split; the step-2 checkpoint holds one file per pipeline layer and resumes with steps 3-4 equal; the end-of-run
    export's logits equal the engine's, and ``finetune export`` of the last checkpoint writes the same weights, which
    equal one device's."""
    from safetensors.torch import load_file

    from conftest import finetune_here
    run, out = llama_run
    assert "layout: world 2 = pipeline stages 2 x data-parallel 1" in out
    assert "pipeline parallelism: 2 stages x 1 data-parallel; this rank holds layers 0-" in out
    ref = _reference([], 1, 4)
    _assert_equal(run, ref, 4)
    ckpt = run / "checkpoints" / "step2"
    assert json.loads((ckpt / "pipeline_layers.json").read_text())["layers"][0]["names"] == \
        {"embed": "model.embed_tokens"}
    assert sorted(p.name for p in ckpt.glob("layer_*-model_states.pt")) == [f"layer_{i:02d}-model_states.pt"
                                                                             for i in range(7)]
    check = json.loads((run / "export_check.json").read_text())
    assert check["max_abs_logit_diff"] <= 1e-5, check
    code, said = finetune_here(["export", run / "checkpoints" / "step4", tmp_path / "again"], capsys)
    assert code == 0, said[-2000:]
    first, again = load_file(run / "export" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(first) == sorted(again)
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        assert torch.allclose(tensor.float(), ref.state_dict[name], rtol=1e-4, atol=1e-5), name
    assert_resume_repeats(CONFIG, [], run, tmp_path / "resumed", step=2)


def test_plan_gives_each_stage_and_the_bubble(capsys):
    """``finetune plan``: each stage's parameters (the config's uniform split; the launch logs 3,327,424 on stage 0,
    and the model's 3,364,480 with the tied head's second copy of 3,216,448 leave 3,253,504 for stage 1) and the bubble
    ``(P - 1) / (m + P - 1)``."""
    from conftest import finetune_here
    from finetune.parallel.pipeline import bubble_fraction

    assert bubble_fraction(2, 4) == pytest.approx(1 / 5) and bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 4) == 0.0
    code, out = finetune_here(["plan", CONFIG, "--gpus-per-node", "2"], capsys)
    assert code == 0, out
    assert "pipeline parallelism 2 (DeepSpeed's 1F1B schedule, 4 micro batches a step): bubble (P - 1) / (m + P - 1) " \
           "= 0.200" in out
    assert "stage 0: 3,327,424 parameters" in out and "stage 1: 3,253,504 parameters" in out


@pytest.mark.parametrize("overrides, words", [
    (["parallel.pipeline_parallel_size=3"], "parallel.pipeline_parallel_size: 3 does not divide the world size 2"),
    (["ds.zero_optimization.stage=3"], "DeepSpeed's pipeline engine runs with ZeRO 0-1"),
    (["recipe=dpo", "data.messages_column=", "data.train_files=[data/gsm8k_pref/train.parquet]",
      "data.validation_files=[data/gsm8k_pref/test.parquet]"], "recipe dpo does not run on the pipeline engine"),
    (["model.path=data/models/tiny-mixtral", "model.tokenizer_path=data/models/tiny-gpt2", "model.config_overrides={vocab_size: 50257}"],
     "model type 'mixtral' is not split into pipeline stages here (supported: llama, qwen2, qwen3, mistral, gpt2, "
     "bert)"),
    (["parallel.tiled_mlp=true"], "parallel.tiled_mlp is not combined with pipeline parallelism"),
    (["train.loss_weighting=micro_batch"], "train.loss_weighting must be token"),
])
def test_refusals_one_line_each(overrides, words):
    """What the pipeline engine does not run is refused in one line before any model is built."""
    line = one_refusal(CONFIG, *overrides)
    assert words in line, line


def test_resume_with_another_pipeline_size_is_refused(llama_run):
    """A pipeline checkpoint resumed with another number of stages: one line that says how to go on."""
    from finetune.lifecycle.checkpoint import resume_layout

    run, _ = llama_run
    problems, notes, universal = resume_layout(run / "checkpoints" / "step2", 2, {"zero_optimization": {"stage": 0}},
                                               pp=1)
    assert len(problems) == 1 and not universal, problems
    assert "2 pipeline stage(s), this launch has 2, 0 and 1" in problems[0]
    assert "export it (finetune export" in problems[0]


VARIANTS = {"gpt2": GPT2, "bert": BERT,
            "sft_lora": ["model.lora.r=8", "train.max_steps=3", "train.save_every=0"],
            "sft_padded": ["data.packing=false", "train.max_steps=3", "train.save_every=0", "export=false"],
            "zero1": ["ds.zero_optimization.stage=1", "train.max_steps=3", "train.save_every=0", "export=false"],
            "compute_split": ["parallel.pipeline_partition_method=compute", "train.max_steps=3", "train.save_every=0",
                              "export=false"],
            "qwen3": ["model.path=data/models/tiny-qwen3", "model.config_overrides={}", "train.max_steps=3",
                      "train.save_every=0"]}
"""Extended runs on 2 stages besides the default one: GPT-2 and BERT, LoRA (the adapters trained on both stages, the
export merged and checked), padded rows, ZeRO-1 (DeepSpeed's optimizer takes the norm and the clipping), the default
``compute`` split (the layers on the first stage, the tied head alone on the second), Qwen3 (q/k norms, tied head; its
export checked too)."""


@pytest.mark.extended
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_more_two_stage_runs_equal_one_device(variant, tmp_path):
    """GPT-2 (packed blocks), BERT's masked LM (padded rows; the head's own bias beside the tied decoder weight),
    sft with LoRA, on padded rows, at ZeRO-1, with the compute split and on Qwen3, each on 2 stages: 3 steps equal one
    device."""
    over = VARIANTS[variant]
    run = tmp_path / variant
    ok(launch(CONFIG, [*over, f"output_dir={run}"]))
    _assert_equal(run, _reference(over, 1, 3), 3, weighted=variant != "gpt2")
    if variant == "sft_lora":
        assert json.loads((run / "export_check.json").read_text())["max_abs_logit_diff_adapter"] <= 1e-5


@pytest.mark.extended
def test_four_stages_equal_one_device(tmp_path):
    """4 stages on 4 CPU ranks (the middle ones receive activations and send them on, and send gradients back):
    3 steps equal one device."""
    run = tmp_path / "pp4"
    over = ["parallel.pipeline_parallel_size=4", "train.max_steps=3", "train.save_every=0"]
    proc = ok(launch(CONFIG, [*over, f"output_dir={run}"], nproc=4))
    assert "layout: world 4 = pipeline stages 4 x data-parallel 1" in proc.stdout
    _assert_equal(run, _reference(over, 1, 3), 3)
    assert json.loads((run / "export_check.json").read_text())["max_abs_logit_diff"] <= 1e-5


@pytest.mark.extended
def test_two_stages_by_two_data_parallel_equal_one_device(tmp_path):
    """2 stages x 2 data-parallel ranks on 4 CPU ranks (the global batch twice as large): 3 steps equal one device on
    the same 16 rows a step."""
    run = tmp_path / "pp2dp2"
    over = ["train.max_steps=3", "train.save_every=0", "export=false"]
    proc = ok(launch(CONFIG, [*over, f"output_dir={run}"], nproc=4))
    assert "layout: world 4 = pipeline stages 2 x data-parallel 2" in proc.stdout
    _assert_equal(run, _reference(over, 2, 3), 3)


def _chain(model, batch: dict, shift: bool, mode: str = "loss"):
    """The pipeline's layers of ``model`` run one after another in this process (no DeepSpeed): what the stages
    compute together."""
    from finetune.engine.pipeline import _Shared, layer_specs, stage_batch
    shared = _Shared(shift=shift, chunk=7)  # several chunks of the head's cross-entropy
    shared.mode, shared.count_correct = mode, True  # as in evaluation (finetune.engine.pipeline.eval_sums)
    specs, records = layer_specs(model, shared)
    x = stage_batch(batch, shift)[0]
    for spec in specs:
        x = spec.build()(x)
    return x, records


def _rows(vocab: int, packed: bool) -> dict:
    """Two rows of 12 tokens: padded (the second has 5 pad positions) or packed (three examples, positions
    restarting), labels -100 on pads and on each packed example's first token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    labels = ids.clone()
    if packed:
        pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
        labels[pos == 0] = -100
        return {"input_ids": ids, "position_ids": pos, "labels": labels}
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("family, packed", [(f, p) for f in ("llama3", "qwen2.5", "qwen3", "mistral-sliding", "gpt2")
                                             for p in (False, True)] + [("bert", False)])  # bert_mlm does not pack
def test_stage_layers_equal_the_plain_forward(family, packed):
    """The conformance matrix's tiny configs of the supported families (Llama 3's rope scaling, Qwen2.5's tied
    embeddings, Qwen3's q/k norms, Mistral's 4-token sliding window on 12-token rows), GPT-2 and BERT's masked LM,
    split into pipeline layers and run in a chain: the loss sum at the targets equals the plain model's
    cross-entropy, padded and packed (positions restarting: packed examples never attend to each other), and the
    logits equal the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    from finetune.recipes.common.targets import shift_labels
    from test_architectures import FAMILIES, _config
    torch.manual_seed(0)
    if family in FAMILIES:
        model = AutoModelForCausalLM.from_config(_config(family)).eval()
    elif family == "gpt2":
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "gpt2", vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)).eval()
    else:
        model = AutoModelForMaskedLM.from_config(AutoConfig.for_model(
            "bert", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    shift = family != "bert"
    batch = _rows(96, packed)
    if family == "gpt2" and packed:  # GPT-2 packs run_clm's blocks: positions run on, the mask is causal
        batch["position_ids"] = torch.arange(12).expand(2, 12)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()  # with a cache transformers ignores packing
        targets = shift_labels(batch["labels"]) if shift else batch["labels"]
        pick = targets != -100
        want = torch.nn.functional.cross_entropy(logits[pick], targets[pick], reduction="sum")
        (loss, correct), records = _chain(model, batch, shift)
        got_logits, _ = _chain(model, batch, shift, mode="logits")
    assert torch.allclose(loss, want, rtol=1e-5), (loss, want)
    assert correct == (logits[pick].argmax(-1) == targets[pick]).sum()
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    assert torch.allclose(got_logits[mask], logits[mask], atol=1e-5)
    prefixes = {p for r in records for p in r["names"].values()}  # what the export's renaming covers: every weight
    missing = [n for n, _ in model.named_parameters() if not any(n == p or n.startswith(p + ".") for p in prefixes)]
    assert not missing, missing
