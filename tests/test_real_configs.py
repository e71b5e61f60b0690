"""Where real models and real runs differ from the tiny test models: reward-model configs whose pad token is not the
tokenizer's, GRPO plans at real accumulation, exported generation settings, target counts of real global batches and
the private transformers registry that expert parallelism rewrites (issue 50, items 5, 7, 8, 10b, 10c).

All in one process (no launch); the packed export's ``config.json`` and ``generation_config.json`` are asserted in
``tests/test_sft.py::test_sft_chat_two_ranks_qwen3``, which already runs a packed sft launch with export.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIGS, REPO, check_here
from finetune.config import load_run_config


# ---------------------------------------------------------------------------------------------------------
# Item 5: a reward model scores a text the same alone and next to a longer one
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config_pad", [None, 0], ids=["config-without-pad", "config-pad-another-token"])
def test_a_reward_model_scores_a_text_the_same_alone_and_batched(tmp_path, config_pad):
    """A one-label Llama sequence classifier saved with the GPT-2 tokenizer (no pad token: EOS pads) whose
    ``config.pad_token_id`` is None or another token than the tokenizer's: TRL 1.16 sets the config's pad id to the
    tokenizer's, so the score of a text right-padded next to a longer one is its score alone (else transformers reads
    it at a padding position, or raises for a batch of two without a config pad id)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

    from finetune.recipes.common.rewards import RewardModel

    tok = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2", local_files_only=True)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         num_labels=1, pad_token_id=config_pad, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")

    rm = RewardModel(tmp_path / "rm", "train.grpo.rewards[0]")
    prompts, completions = ["Name a colour.", "What is 2 + 3? Think step by step"], [" Red", " and say: it is 5."]
    alone = rm(prompts=prompts[:1], completions=completions[:1])
    batched = rm(prompts=prompts, completions=completions)
    assert batched[0] == pytest.approx(alone[0], abs=1e-6)
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", local_files_only=True).eval()
    with torch.no_grad():  # one unpadded row: the last position, whatever the config's pad id
        want = plain(**tok(prompts[0] + completions[0], return_tensors="pt")).logits[0, 0].item()
    assert alone[0] == pytest.approx(want, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Item 7: finetune plan counts the generation of the whole step (every micro batch of the accumulation)
# ---------------------------------------------------------------------------------------------------------

def test_plan_counts_the_generation_of_every_accumulated_micro_batch():
    """grpo joins the step's micro batches into one ``generate`` call per rank: the plan's KV cache and prefill at
    accumulation 4 are 4x those at accumulation 1 (printed and in the estimate), and ZeRO 3 adds the whole gathered
    model beyond the rank's partition while it generates."""
    import dataclasses
    import re

    from finetune.preflight import plan

    shapes, lines = {}, {}
    for acc in (1, 4):
        cfg = load_run_config(CONFIGS / "tiny_grpo.yaml", ["train.micro_batch_size=1",
                                                           f"train.gradient_accumulation_steps={acc}",
                                                           "train.grpo.max_completion_length=464"])
        text, _, _ = plan.make_plan(cfg, gpus_per_node=2, nodes=1, gpu_bytes=80 * 2**30, cpu_bytes=None)
        lines[acc] = next(line for line in text.splitlines() if line.startswith("generation every step"))
        shapes[acc] = plan.model_shape(cfg)
    # tiny Llama in fp32: 2 (K, V) x 2 layers x 2 key-value heads x 16 x 4 bytes = 512 bytes per sequence and token
    kv = {acc: float(re.search(r"KV cache ([0-9.]+) MiB", lines[acc]).group(1)) for acc in lines}
    assert kv == {1: 1.0, 4: 4.0}, lines  # 4 (x 4) sequences of 48 + 464 tokens
    assert "x 16 x 512 tokens" in lines[4] and "x 4 x 512 tokens" in lines[1], lines
    one, four = (plan.generation_bytes(shapes[a], 1, 4) for a in (1, 4))
    assert four == {k: 4 * v for k, v in one.items()} and one["KV cache"] == 2**20

    # the estimate: a head of 16 outputs (a small-vocabulary model), so that generation outgrows training's activations
    shape = dataclasses.replace(shapes[4], head_outputs=16)
    ds = plan.cfg_ds(cfg, 2, "fp32")
    e2, e3 = (plan.estimate(shape, ds, stage, False, False, 1, 512, 2, 1, "fp32") for stage in (2, 3))
    during = sum(plan.generation_bytes(shape, 1, 4).values())
    assert e2.gpu["generation beyond training"] == during - e2.gpu["activations"] - e2.gpu["logits"] > 0
    gathered = e3.gpu["generation beyond training"] - e2.gpu["generation beyond training"]
    # the whole model gathered next to the rank's partition, instead of training's gathered layers
    assert gathered == shape.params * 4 + shape.params * 4 / 2 - e3.gpu["parameters"] > 0


# ---------------------------------------------------------------------------------------------------------
# Item 10b: the step's target count is exact above 2^24 targets per global batch
# ---------------------------------------------------------------------------------------------------------

def test_the_step_target_count_is_exact_above_2_to_the_24():
    """The step's collective sums the targets of its micro-batches (gpt_clm's count: labels after the shift that
    are not -100) exactly: 2^24 + 1 targets over two micro-batches (a global batch of 512 rows of 32k tokens has
    more), where float32 would give 2^24."""
    from finetune.recipes import get_recipe
    from finetune.training.trainer import step_collective

    recipe = get_recipe("gpt_clm")
    # int8 labels (0: a target) keep the 16.8M positions at 16 MiB; one row each, the first position is no target
    micro = [{"labels": torch.zeros(1, 2**23 + 1, dtype=torch.int8)}, {"labels": torch.zeros(1, 2**23 + 2,
                                                                                            dtype=torch.int8)}]
    assert sum(int(recipe.count_targets(b)) for b in micro) == 2**24 + 1
    targets, stop = step_collective(recipe, micro, True, lambda: False, torch.device("cpu"))
    assert int(targets.item()) == 2**24 + 1 and not stop
    targets, stop = step_collective(recipe, micro, True, lambda: True, torch.device("cpu"), replicas=1)
    assert int(targets.item()) == 2**24 + 1 and stop


# ---------------------------------------------------------------------------------------------------------
# Item 10c: expert parallelism's patch of transformers' private output-capture registry is guarded
# ---------------------------------------------------------------------------------------------------------

def test_the_autoep_registry_patch_refuses_a_registry_of_another_form(tmp_path, capsys, monkeypatch):
    """``expert.registry_patch`` rewrites ``transformers.utils.output_capturing._CanRecordRegistry.get``: on the
    checked transformers it works (a string key and a default read the dict, a model as before; restored after); a
    ``get`` of another signature or a missing class is one line naming the transformers version, the attribute and the
    fix, raised by the patch and reported by ``--check`` before any model is built."""
    import transformers
    from transformers.utils import output_capturing

    from finetune import patches
    from finetune.errors import RunFailure
    from finetune.parallel import expert

    registry, cls = output_capturing._CAN_RECORD_REGISTRY, output_capturing._CanRecordRegistry
    original = cls.get
    with patches.applied(expert.registry_patch()):
        assert registry.get("<class 'no.such.Model'>", "default") == "default"
        assert registry.get(torch.nn.Linear(1, 1)) == {}
    assert cls.get is original

    def dict_like_get(self, key, default=None):  # a transformers that changed its registry
        return dict.get(self, key, default)

    fix = "install transformers==5.23.0 or set parallel.expert_parallel_size=1"  # the version pyproject.toml pins
    monkeypatch.setattr(cls, "get", dict_like_get)
    with pytest.raises(RunFailure) as err:
        expert.registry_patch()
    line = str(err.value)
    assert "\n" not in line and f"transformers {transformers.__version__}" in line and fix in line, line
    assert "_CanRecordRegistry.get has the signature ['self', 'key', 'default']" in line, line
    monkeypatch.undo()

    monkeypatch.delattr(output_capturing, "_CanRecordRegistry")
    with pytest.raises(RunFailure, match=r"output_capturing\._CanRecordRegistry is missing .*" + fix):
        expert.registry_patch()
    code, out = check_here(["--config", CONFIGS / "parity_gpt.yaml", f"output_dir={tmp_path / 'run'}",
                            "parallel.expert_parallel_size=2"], capsys, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    errors = [x for x in out.splitlines() if x.startswith("finetune: error:") and "_CanRecordRegistry" in x]
    assert code == 2 and len(errors) == 1 and fix in errors[0], out[-3000:]


# ---------------------------------------------------------------------------------------------------------
# Item 8: an export generates with the source model's use_cache (the packed launch: tests/test_sft.py)
# ---------------------------------------------------------------------------------------------------------

def test_the_export_takes_use_cache_from_the_source_model(tmp_path):
    """``export.source_use_cache``: the source's ``use_cache`` (True for the shipped Qwen3 config, False for a source
    that says so), a ``model.config_overrides`` value first, True for a source that cannot be read any more."""
    import json
    import shutil

    from finetune.lifecycle.export import source_use_cache

    sft = CONFIGS / "parity_sft.yaml"
    assert source_use_cache(load_run_config(sft, ["model.path=data/models/tiny-qwen3"])) is True
    shutil.copytree(REPO / "data/models/tiny-qwen3", tmp_path / "no-cache",
                    ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((tmp_path / "no-cache" / "config.json").read_text())
    (tmp_path / "no-cache" / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    assert source_use_cache(load_run_config(sft, [f"model.path={tmp_path / 'no-cache'}"])) is False
    assert source_use_cache(load_run_config(sft, [f"model.path={tmp_path / 'no-cache'}",
                                                  "model.config_overrides={use_cache: true}"])) is True
    shutil.rmtree(tmp_path / "no-cache")
    assert source_use_cache(load_run_config(sft, [f"model.path={tmp_path / 'no-cache'}"])) is True
