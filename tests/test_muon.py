"""``train.optimizer: muon`` (issue 40, item 3): DeepSpeed's Muon with its auxiliary AdamW.

* One real 2-rank ZeRO-3 run of 6 steps on the parity GPT-2 (checkpoint at step 3), then a resume from step 3 on a
  copy: steps 4-6 repeat the uninterrupted run's losses exactly; the log names the Muon/AdamW counts, the loss falls,
  and the checkpoint holds Muon's momentum buffer (covering exactly the Muon matrices) and AdamW's two moments for the
  rest.
* In process: which parameters are Muon's (:mod:`finetune.engine.muon`), the DeepSpeed block, the checks before any
  model (one line each), ``finetune plan``'s optimizer bytes, what a resume may change.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import REPO, check_here, launch, ok, train_losses

from finetune import patches
from finetune.config import config_to_dict, load_run_config
from finetune.engine import muon
from finetune.engine.ds_config import resolve_ds_config
from finetune.lifecycle import resume as resume_policy
from finetune.preflight import plan

CONFIGS = REPO / "tests" / "configs"
PARITY = CONFIGS / "parity_gpt.yaml"
MUON = ["train.optimizer=muon", "train.max_steps=6", "train.save_every=3", "ds.zero_optimization.stage=3"]
# tiny-gpt2: hidden 2, 2 layers; per layer c_attn 2x6, attn c_proj 2x2, c_fc 2x8, mlp c_proj 8x2 = 48 matrix entries
MUON_MATRICES, MUON_PARAMS, ADAMW_TENSORS, ADAMW_PARAMS = 8, 96, 20, 102_618


def _tiny(model_class_name: str = "GPT2LMHeadModel", **overrides):
    import transformers

    config = transformers.AutoConfig.from_pretrained(REPO / "data" / "models" / "tiny-gpt2", **overrides)
    return getattr(transformers, model_class_name)(config)


def test_muon_zero3_resumes_exactly(tmp_path, capsys):
    """ZeRO-3, 2 ranks: 6 steps with a checkpoint at 3; a resume from step 3 repeats steps 4-6 exactly; a resume on
    1 rank is refused in one line by ``--check``."""
    _run_and_resume(tmp_path, MUON, capsys)


@pytest.mark.long  # the long checks: python -m pytest -m long (not in .ci/run)
@pytest.mark.parametrize("stage", [1])
def test_muon_zero12_resumes_exactly(tmp_path, stage, capsys):
    """The same at ZeRO 1, DeepSpeedZeroOptimizer's Muon path (ZeRO 2 is the same class and code path in DeepSpeed
    0.19.8's ``stage_1_and_2.py``, its partitioned gradients apart; left out for the CI budget)."""
    _run_and_resume(tmp_path, [*MUON[:-1], f"ds.zero_optimization.stage={stage}"], capsys)


def _run_and_resume(tmp_path, overrides, capsys):
    run = tmp_path / "run"
    proc = ok(launch(PARITY, [f"output_dir={run}", *overrides]))
    line = (f"optimizer: Muon on {MUON_MATRICES} matrices ({MUON_PARAMS} parameters), AdamW on {ADAMW_TENSORS} "
            f"tensors ({ADAMW_PARAMS:,} parameters)")
    assert line in proc.stdout, proc.stdout[-3000:]
    full = train_losses(run)
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1], full

    # what DeepSpeed saved: the Muon group's state is one momentum buffer (this rank's partition), AdamW's two moments
    momentum, adam_groups = 0, 0
    for rank in (0, 1):
        saved = torch.load(next((run / "checkpoints" / "step3").glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")),
                           weights_only=False, map_location="cpu")["optimizer_state_dict"]
        # MuonWithAuxAdam's own state dict: under ZeRO-3 'optimizer_state_dict', under ZeRO 1/2 'base_optimizer_state'
        sd = saved.get("optimizer_state_dict") or saved["base_optimizer_state"]
        for group in sd["param_groups"]:
            for i in group["params"]:
                state = sd["state"][i]
                if group["use_muon"]:
                    assert set(state) == {"momentum_buffer"}, state.keys()
                    momentum += state["momentum_buffer"].numel()
                else:
                    assert {"exp_avg", "exp_avg_sq"} <= set(state) and "momentum_buffer" not in state
                    adam_groups += 1
    # the two ranks' partitions cover every Muon matrix once (ZeRO 1/2 may pad a partition for alignment)
    assert MUON_PARAMS <= momentum < MUON_PARAMS + 2 * 64, momentum
    assert adam_groups == 4  # decayed and undecayed AdamW groups on each rank

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("step6"))
    ok(launch(PARITY, [f"output_dir={resumed}", *overrides], resume="latest"))
    again = train_losses(resumed)  # later records (the resumed launch's) win
    for step in (4, 5, 6):
        assert again[step] == pytest.approx(full[step], rel=1e-6), (step, again, full)

    # on 1 rank the checkpoint would go through a universal copy, which DeepSpeed's ds_to_universal cannot make of
    # Muon's momentum (KeyError: 'exp_avg'): --check (the launch's validation) refuses it in one line (issue 51)
    code, out = check_here(["--config", PARITY, f"output_dir={run}", *overrides, "--resume", "latest"], capsys)
    errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
    assert code == 2 and len(errors) == 1, out[-3000:]
    assert "train.optimizer=muon" in errors[0] and "universal" in errors[0] and "resume with 2 ranks" in errors[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resume_on_another_world_size_is_refused_in_one_line(tmp_path, monkeypatch, stage):
    """A Muon checkpoint of 2 ranks (its marker, shard names and config, as a save writes them) resumed on 1 rank:
    one line before any model, naming the layout to resume with (the universal copy it would need fails in DeepSpeed's
    ds_to_universal with KeyError: 'exp_avg', test_muon_zero3_resumes_exactly); the same checkpoint as AdamW's goes
    through the universal copy, and Muon on its own world size loads as it is."""
    import json

    from finetune.config import dump_yaml
    from finetune.errors import ConfigError
    from finetune.lifecycle import checkpoint as ckpt_utils
    from finetune.preflight.validate import validate_run

    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    overrides = [f"output_dir={run}", "train.optimizer=muon", f"ds.zero_optimization.stage={stage}"]
    ckpt = run / "checkpoints" / "step3"
    ckpt.mkdir(parents=True)
    for rank in (0, 1):
        (ckpt / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (ckpt / ckpt_utils.CONFIG_FILE).write_text(dump_yaml(config_to_dict(load_run_config(PARITY, overrides))))
    (ckpt / ckpt_utils.MARKER).write_text(json.dumps({"step": 3, "world_size": 2, "zero_stage": stage}))
    with pytest.raises(ConfigError) as refused:
        validate_run(load_run_config(PARITY, overrides), "latest", world_size=1, on_cpu=True)
    assert len(refused.value.problems) == 1, refused.value.problems
    line = refused.value.problems[0]
    assert line.startswith(f"--resume: '{ckpt}' was saved by train.optimizer=muon with world size 2 and ZeRO stage "
                           f"{stage}, this launch has world size 1") and "ds_to_universal cannot convert" in line, line
    assert line.endswith("start a new run from the export") and f"resume with 2 ranks and ds.zero_optimization.stage="\
        f"{stage}" in line, line
    assert not validate_run(load_run_config(PARITY, overrides), "latest", world_size=2, on_cpu=True).universal
    adamw = [o for o in overrides if o != "train.optimizer=muon"]
    (ckpt / ckpt_utils.CONFIG_FILE).write_text(dump_yaml(config_to_dict(load_run_config(PARITY, adamw))))
    assert validate_run(load_run_config(PARITY, adamw), "latest", world_size=1, on_cpu=True).universal


def test_tagging_by_module_type():
    """Embeddings, the tied LM head and 1-D tensors are AdamW's; GPT-2's Conv1D matrices Muon's; a classifier head
    (no output embeddings) AdamW's. DeepSpeed's own by-name rule would put GPT-2's wte and wpe on Muon."""
    model = _tiny()
    line = muon.tag(model)
    assert line == (f"optimizer: Muon on {MUON_MATRICES} matrices ({MUON_PARAMS} parameters), AdamW on "
                    f"{ADAMW_TENSORS} tensors ({ADAMW_PARAMS:,} parameters)")
    on = {n for n, p in model.named_parameters() if p.use_muon}
    assert on == {f"transformer.h.{i}.{m}.weight" for i in (0, 1)
                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert not model.transformer.wte.weight.use_muon and not model.lm_head.weight.use_muon
    assert not model.transformer.wpe.weight.use_muon
    assert muon.muon_parameter_count(model) == MUON_PARAMS

    cls = _tiny("GPT2ForSequenceClassification", num_labels=3)
    muon.tag(cls)
    assert not cls.score.weight.use_muon and cls.transformer.h[0].mlp.c_fc.weight.use_muon

    import deepspeed

    original = deepspeed.set_optimizer_flags
    ds_config = type("C", (), {"optimizer_name": "muon", "optimizer_params": {}})()
    with patches.applied(muon.keep_tags()):
        deepspeed.set_optimizer_flags(ds_config, model)
    assert deepspeed.set_optimizer_flags is original
    assert not model.transformer.wte.weight.use_muon  # kept
    deepspeed.set_optimizer_flags(ds_config, model)
    assert model.transformer.wte.weight.use_muon  # DeepSpeed's rule: no 'embed' in 'transformer.wte.weight'


def test_deepspeed_block():
    """The Muon block: AdamW's lr/betas/eps, muon_lr and momentum; ZeRO-3 without reduce_scatter."""
    cfg = load_run_config(PARITY, ["train.optimizer=muon", "train.muon_lr=0.03", "ds.zero_optimization.stage=3"])
    ds, problems = resolve_ds_config(cfg, 2, on_cpu=True)
    assert problems == []
    assert ds["optimizer"]["type"] == "Muon"
    params = ds["optimizer"]["params"]
    assert (params["lr"], params["muon_lr"], params["momentum"], params["weight_decay"]) == (0.02, 0.03, 0.95, 0.01)
    assert ds["zero_optimization"]["reduce_scatter"] is False
    ds, _ = resolve_ds_config(load_run_config(PARITY, []), 2, on_cpu=True)
    assert ds["optimizer"]["type"] == "AdamW" and ds["zero_optimization"]["reduce_scatter"] is True


def test_checks_before_any_model(tmp_path, capsys):
    """An unknown optimizer, ZeRO 0, LoRA, tensor parallelism: one line each naming the key, exit 2."""
    code, out = check_here(["--config", PARITY, f"output_dir={tmp_path / 'a'}", "train.optimizer=sgd"], capsys)
    assert code == 2 and "train.optimizer" in out and "muon" in out, out[-2000:]
    code, out = check_here(["--config", PARITY, f"output_dir={tmp_path / 'b'}", "train.optimizer=muon",
                            "deepspeed=ds_configs/zero0.json", "model.lora.r=4"], capsys)
    errors = [line for line in out.splitlines() if line.startswith("finetune: error:")]
    assert code == 2, out[-3000:]
    assert any("train.optimizer=muon needs ZeRO stage 1, 2 or 3" in e for e in errors), errors
    assert any("train.optimizer=muon is for full fine-tuning: model.lora" in e for e in errors), errors
    ranks = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2"}
    code, out = check_here(["--config", PARITY, f"output_dir={tmp_path / 'c'}", "train.optimizer=muon",
                            "parallel.tensor_parallel_size=2"], capsys, **ranks)
    assert code == 2 and "train.optimizer=muon with parallel.tensor_parallel_size > 1" in out, out[-3000:]
    code, out = check_here(["--config", PARITY, f"output_dir={tmp_path / 'd'}", "train.optimizer=muon"], capsys)
    assert code == 0, out[-3000:]


def test_plan_counts_one_momentum_buffer():
    """``finetune plan``: 4 bytes a Muon parameter (one momentum buffer), 8 for AdamW's; the header says so."""
    adamw = plan.model_shape(load_run_config(PARITY, []))
    shape = plan.model_shape(load_run_config(PARITY, ["train.optimizer=muon"]))
    assert (adamw.muon, shape.muon) == (0, MUON_PARAMS)
    n = shape.params
    for stage, world in ((1, 2), (3, 4)):
        e = plan.estimate(shape, {}, stage, False, False, 4, 32, world, 1, "fp32")
        a = plan.estimate(adamw, {}, stage, False, False, 4, 32, world, 1, "fp32")
        assert e.gpu["Muon momentum (fp32)"] == 4 * MUON_PARAMS / world
        assert e.gpu["Adam moments (fp32)"] == 8 * (n - MUON_PARAMS) / world
        assert a.gpu_total - e.gpu_total == pytest.approx(4 * MUON_PARAMS / world)
    cfg = load_run_config(PARITY, ["train.optimizer=muon"])
    text, options, _ = plan.make_plan(cfg, 2, 1, 80 * 2**30, None)
    assert {e.stage for e in options} == {1, 2, 3}  # ZeRO 0 is refused with Muon
    assert f"Muon: {MUON_PARAMS} in matrices with one fp32 momentum buffer" in text


def test_resume_refuses_another_optimizer():
    """The checkpoint's optimizer state belongs to its optimizer: a change is refused even with
    --resume-allow-changes; a checkpoint from before the key existed counts as adamw."""
    old = config_to_dict(load_run_config(PARITY, []))
    cfg = load_run_config(PARITY, ["train.optimizer=muon"])
    for allow in (False, True):
        problems, _ = resume_policy.review(old, 2, cfg, 2, allow)
        assert len(problems) == 1 and "train.optimizer changed ('adamw' -> 'muon')" in problems[0], problems
    for key in ("optimizer", "muon_lr", "muon_momentum"):
        del old["train"][key]
    assert resume_policy.review(old, 2, load_run_config(PARITY, []), 2, False) == ([], [])
    muon_old = config_to_dict(cfg)
    problems, notes = resume_policy.review(muon_old, 2, load_run_config(PARITY, ["train.optimizer=muon",
                                                                                 "train.muon_lr=0.01"]), 2, False)
    assert problems == [] and any("train.muon_lr" in n and "LR schedule is rebuilt" in n for n in notes), notes


def test_decayed_groups_under_muon():
    """Weight decay on resume goes to both halves of param group 0 (DeepSpeed's ``group0-muon/adam-params``)."""
    assert resume_policy._decays(0, {"name": "group0-muon-params", "use_muon": True})
    assert resume_policy._decays(1, {"name": "group0-adam-params", "use_muon": False})
    assert not resume_policy._decays(2, {"name": "group1-adam-params", "use_muon": False})
    assert resume_policy._decays(0, {}) and not resume_policy._decays(1, {})



def test_the_patch_is_guarded_by_the_deepspeed_version():
    """Another DeepSpeed may tag parameters differently or rename ``set_optimizer_flags``: refused before any model."""
    from finetune.engine import muon

    assert muon.version_problem(muon.MUON_CHECKED[-1]) is None
    line = muon.version_problem("0.20.0")
    assert line.startswith("train.optimizer=muon replaces DeepSpeed's set_optimizer_flags") and "0.20.0" in line
