"""Real training runs: both recipes, ZeRO 2 and 3 (GPT/ZeRO-2 and BERT/ZeRO-3 by default), 2 CPU ranks, fp32,
tiny models.

Each run is launched once per module (``runs`` fixture; the GPT/ZeRO-2 run once per session, as ``tiny_gpt_run``:
tests/test_evaluate.py evaluates a copy of it) and several tests read its run folder: loss
goes down, evaluation and TensorBoard scalars are there, checkpoints are complete, the export reloads
with ``from_pretrained`` and reproduces the engine's logits, and a resume continues bit-for-bit.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import CONFIGS, finetune_here, free_port, launch, ok, read_metrics, refused_here, train_losses

RECIPES = {"gpt": CONFIGS / "tiny_gpt.yaml", "bert": CONFIGS / "tiny_bert.yaml"}
# ZeRO-0 product runs are covered by tests/test_resume_changes.py (skipped steps) and test_parity.py, ZeRO-3 + CPU
# offload (training, export) by test_parity.py's sft-llama-offload-z3; they left this matrix for the 25-minute budget.
# The default suite runs the diagonal (GPT on ZeRO-2, BERT on ZeRO-3: both recipes, both stages); the crossed pair
# (GPT on ZeRO-3, BERT on ZeRO-2) left for the CI budget: the stages and recipes are each run. test_parity.py runs GPT
# under ZeRO-3, Llama sft under ZeRO-3 + CPU offload and BERT under ZeRO-0 and ZeRO-3 against the single-device
# reference.
RUNS = [("gpt", "zero2"), ("bert", "zero3")]
TRAIN_SCALARS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/tokens_per_s_per_device",
                 "train/padding_ratio", "time/data_wait_s", "time/before_step_s", "time/forward_s", "time/backward_s",
                 "time/optimizer_s"}
EVAL_SCALARS = {"eval/loss", "eval/perplexity"}
MODEL_CLASS = {"gpt": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """``runs(recipe, stage)`` -> run folder of a finished 16-step run (launched on first use; GPT/ZeRO-2 is the
    session's ``tiny_gpt_run``, which tests/test_evaluate.py evaluates too)."""
    cache: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("runs")

    def get(recipe: str, stage: str) -> Path:
        if (recipe, stage) == ("gpt", "zero2") and (recipe, stage) not in cache:
            cache[recipe, stage] = request.getfixturevalue("tiny_gpt_run")
        if (recipe, stage) not in cache:
            out = root / f"{recipe}_{stage}"
            ok(launch(RECIPES[recipe], [f"output_dir={out}", f"deepspeed=ds_configs/{stage}.json"]))
            cache[recipe, stage] = out
        return cache[recipe, stage]

    return get


def tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars read back from the TensorBoard event files with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize(("recipe", "stage"), RUNS)
def test_training_run(runs, recipe, stage):
    run = runs(recipe, stage)
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 17)), "one train loss per optimizer step"
    values = list(losses.values())
    assert all(math.isfinite(v) for v in values)
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3, f"loss did not go down: {values}"

    evals = [r for r in read_metrics(run) if "eval/perplexity" in r]
    assert [r["step"] for r in evals] == [8, 16]
    assert all(math.isclose(r["eval/perplexity"], math.exp(r["eval/loss"]), rel_tol=1e-9) for r in evals)
    if recipe == "bert":
        assert all(0.0 <= r["eval/masked_accuracy"] <= 1.0 for r in evals)

    scalars = tb_scalars(run)
    wanted = TRAIN_SCALARS | EVAL_SCALARS | ({"eval/masked_accuracy"} if recipe == "bert" else set())
    assert wanted <= set(scalars), f"missing in TensorBoard: {wanted - set(scalars)}"
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 17)), "indexed by optimizer step"
    assert not any(tag.startswith("Train/Samples/") for tag in scalars), "DeepSpeed's own per-step events are off"
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(values, rel=1e-6)  # TensorBoard keeps float32
    assert all(v > 0 for _, v in scalars["train/grad_norm"]) and all(v > 0 for _, v in scalars["train/tokens_per_s"])
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    for r in rows:  # throughput per device, padding, and the step-time split of each logged step (seconds)
        assert r["train/tokens_per_s_per_device"] == pytest.approx(r["train/tokens_per_s"] / 2, rel=1e-9)
        assert r["time/forward_s"] > 0 and r["time/backward_s"] > 0 and r["time/optimizer_s"] > 0
        assert 0 <= r["time/data_wait_s"] < 60
        assert "train/mfu" not in r, "MFU only on GPUs of the peak table"
    padding = [r["train/padding_ratio"] for r in rows]
    if recipe == "gpt":  # packed blocks: no padding at all
        assert padding == [1.0] * 16
    else:  # rows of up to 64 tokens, grouped by length per global batch: little padding, never none
        assert all(0.5 < p <= 1.0 for p in padding) and min(padding) < 1.0, padding
    log = (run / "logs" / "rank0.log").read_text()
    assert re.search(r"epoch 0 \(up to the last step\): padding ratio (0|1)\.\d{3} \(real tokens / positions", log)

    for step in (8, 16):
        assert (run / "checkpoints" / f"step{step}" / "COMPLETE").is_file()
        assert (run / "checkpoints" / f"step{step}" / "rng_state_rank1.pt").is_file()
    for name in ("run_config.yaml", "ds_config.json", "meta.json", "logs/rank0.log", "logs/rank1.log",
                 "export/config.json", "export/model.safetensors", "export/tokenizer_config.json"):
        assert (run / name).is_file(), name
    assert "| rank 1 |" in (run / "logs" / "rank1.log").read_text()
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # finetune/lifecycle/report.py, rank 0 at the end


@pytest.mark.parametrize(("recipe", "stage"), RUNS)
def test_plan_matches_measured_rss(runs, recipe, stage):
    """``finetune plan``'s per-rank figure for the run's own option vs the peak host memory each CPU rank added
    from just before the model was built to the end of training (``launches/1/ranks/rank<r>.json``, written by
    finetune/lifecycle/health.py): within 35% (measured: the plan 4-22% above; CPU-rank RSS moves with the
    allocator). On CPU ranks the plan's model states, activations (here mostly the logits) and DeepSpeed buffers all
    live in host memory, plus ``plan.CPU_RUNTIME_BYTES``."""
    from finetune.preflight import plan
    from finetune.config import load_run_config

    run = runs(recipe, stage)
    cfg = load_run_config(RECIPES[recipe], [f"deepspeed=ds_configs/{stage}.json"])
    shape = plan.model_shape(cfg)
    e = plan.estimate(shape, plan.cfg_ds(cfg, 2, "fp32"), int(stage[-1]), False, False, cfg.train.micro_batch_size,
                      cfg.data.max_seq_len, gpus_per_node=2, nodes=1, precision="fp32")
    predicted = plan.cpu_rank_bytes(e, 2) / 2**20
    for r in (0, 1):
        rec = json.loads((run / "launches" / "1" / "ranks" / f"rank{r}.json").read_text())
        measured = rec["peak_rss_train_mib"] - rec["rss_before_model_mib"]
        assert predicted == pytest.approx(measured, rel=0.35), (recipe, stage, r, predicted, measured, e.gpu)


@pytest.mark.parametrize(("recipe", "stage"), RUNS)
def test_export_reloads_with_engine_logits(runs, recipe, stage):
    """The export loads with plain ``from_pretrained`` and gives the trained engine's logits (fp32: 1e-5)."""
    import transformers
    from safetensors.torch import load_file

    run = runs(recipe, stage)
    tensors = load_file(run / "export" / "model.safetensors")
    assert tensors and all(t.numel() > 0 for t in tensors.values())
    model = getattr(transformers, MODEL_CLASS[recipe]).from_pretrained(run / "export", local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "export", local_files_only=True)
    assert tokenizer.vocab_size == model.config.vocab_size
    check = json.loads((run / "export_check.json").read_text())  # a summary, not the full logits
    assert check["finite"] and check["max_abs_logit_diff"] <= 1e-5 and not (run / "export_check.pt").exists()
    with torch.no_grad():
        logits = model(**{k: torch.tensor(v) for k, v in check["inputs"].items()}).logits
    assert list(logits.shape) == check["logits_shape"]
    assert logits.mean().item() == pytest.approx(check["engine_logits_mean"], abs=1e-5)
    assert logits.std().item() == pytest.approx(check["engine_logits_std"], abs=1e-5)
    assert logits.reshape(-1)[:8].tolist() == pytest.approx(check["engine_logits_head"], abs=1e-5)


@pytest.mark.parametrize(("recipe", "stage"), [("bert", "zero3")])  # GPT/ZeRO-2 resumes: test_launchers, test_slurm
def test_resume_continues_exactly(runs, recipe, stage, tmp_path):
    """Resume from the step-8 checkpoint: steps 9..16 repeat the uninterrupted run's losses (1e-6 relative)."""
    full = runs(recipe, stage)
    out = tmp_path / "resumed"
    proc = ok(launch(RECIPES[recipe], [f"output_dir={out}", f"deepspeed=ds_configs/{stage}.json"],
                     resume=str(full / "checkpoints" / "step8")))
    assert "resumed from" in proc.stdout
    resumed, reference = train_losses(out), train_losses(full)
    assert sorted(resumed) == list(range(9, 17))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), f"step {step}"
    evals = {r["step"]: r["eval/loss"] for r in read_metrics(out) if "eval/loss" in r}
    assert evals[16] == pytest.approx([r["eval/loss"] for r in read_metrics(full) if r["step"] == 16
                                       and "eval/loss" in r][0], rel=1e-6)
    # The second run with the same data and tokenizer read the tokenized cache instead of tokenizing.
    assert "cache hit" in (out / "logs" / "rank0.log").read_text()


def test_resume_latest_in_same_folder_and_refusal_to_overwrite(runs, tmp_path, capsys):
    """``--resume`` (latest) in a finished run folder has nothing left to train; a fresh start there is refused (by
    rank 0's checks of a 2-rank launch, run in this process)."""
    run = runs("gpt", "zero2")
    code, printed = refused_here(["--config", RECIPES["gpt"], f"output_dir={run}", "deepspeed=ds_configs/zero2.json"],
                                 capsys, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                 MASTER_PORT=str(free_port()))
    assert code != 0 and "already holds checkpoints" in printed
    # A kill mid-write left a torn last line: the resumed launch starts a fresh line, and its report skips the torn
    # one (counted in the log) instead of failing on it.
    metrics = run / "metrics.jsonl"
    intact = metrics.read_bytes()
    metrics.write_bytes(intact[:-20])
    report_before = (run / "report.png").stat().st_mtime_ns
    proc = ok(launch(RECIPES["gpt"], [f"output_dir={run}", "deepspeed=ds_configs/zero2.json", "train.max_steps=18"],
                     resume="latest"))
    assert "resumed from" in proc.stdout and "step16" in proc.stdout
    lines, n = metrics.read_bytes().splitlines(), intact.count(b"\n")
    assert lines[n - 1] == intact.splitlines()[-1][:-19]  # the torn row stays alone on its line
    assert json.loads(lines[n])["step"] == 17
    assert (run / "report.png").stat().st_mtime_ns > report_before
    assert "metrics.jsonl: 1 damaged line(s) skipped in report.png" in (run / "logs" / "rank0.log").read_text()
    metrics.write_bytes(b"".join(line + b"\n" for i, line in enumerate(lines) if i != n - 1))
    assert sorted(s for s in train_losses(run) if s > 16) == [17, 18]
    # The earlier export is kept aside, the new one comes from step 18.
    assert json.loads((run / "export" / "finetune_export.json").read_text())["step"] == 18
    assert json.loads((run / "export-step16" / "finetune_export.json").read_text())["step"] == 16


def test_export_command(runs, tmp_path, capsys):
    """``python -m finetune export <checkpoint> <out>`` (its ``main``, in this process) writes a loadable folder with
    its model card (``README.md``: what the run logged for that step); a non-empty target is refused. The end-of-run
    export's card has the last evaluation and the export check; a run folder without evaluation still gets a card."""
    import transformers
    from huggingface_hub import ModelCard

    from finetune.lifecycle.export import export_checkpoint

    run = runs("bert", "zero3")
    out = tmp_path / "hf"
    code, printed = finetune_here(["export", run / "checkpoints" / "step8", out], capsys)
    assert code == 0, printed[-3000:]
    model = transformers.AutoModelForMaskedLM.from_pretrained(out, local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) > 0
    code, printed = finetune_here(["export", run / "checkpoints" / "step8", out], capsys)
    assert code == 2 and "is not empty" in printed

    logged = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(run)
              if "eval/loss" in r}
    trained = yaml.safe_load((run / "checkpoints" / "step8" / "run_config.yaml").read_text())["train"]
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "fill-mask"
    assert {"finetune", "bert_mlm"} <= set(card.data.tags) and card.data.datasets == ["wikitext2"]
    assert card.data.base_model is None, "init: scratch starts from no model"
    meta = card.data.finetune
    assert meta["checkpoint_step"] == 8 and meta["chosen_by"] == {"named": "step8"}
    hp = meta["hyperparameters"]
    assert (hp["train.lr"], hp["train.micro_batch_size"], hp["train.gradient_accumulation_steps"], hp["train.seed"],
            hp["train.max_steps"]) == (trained["lr"], trained["micro_batch_size"],
                                       trained["gradient_accumulation_steps"], trained["seed"], trained["max_steps"])
    assert hp["global_batch_size"] == trained["micro_batch_size"] * trained["gradient_accumulation_steps"] * 2
    assert hp["zero_stage"] == 3 and hp["precision"] == "fp32" and meta["layout"]["world_size"] == 2
    assert meta["evaluation"]["step"] == 8 and meta["evaluation"]["metrics"] == logged[8]  # that step's, not the last
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == logged[8]
    assert "export_check" not in meta, "the run's export check is of step 16"

    card = ModelCard.load(run / "export" / "README.md")  # the end of the run: last step, last evaluation, the check
    meta = card.data.finetune
    assert meta["checkpoint_step"] == 16 and meta["chosen_by"] == {"last_step": 16}
    assert meta["evaluation"]["step"] == max(logged) == 16 and meta["evaluation"]["metrics"] == logged[16]
    check = json.loads((run / "export_check.json").read_text())
    assert meta["export_check"]["max_abs_logit_diff"] == check["max_abs_logit_diff"]
    gpt = ModelCard.load(runs("gpt", "zero2") / "export" / "README.md").data
    assert gpt.base_model == "tiny-gpt2" and gpt.pipeline_tag == "text-generation", "init: pretrained, a local folder"

    bare = tmp_path / "run_without_evaluation"  # the run's model config and run config, no metrics or records
    shutil.copytree(run / "model_config", bare / "model_config")
    shutil.copy(run / "run_config.yaml", bare / "run_config.yaml")
    card = ModelCard.load(export_checkpoint(run / "checkpoints" / "step8", tmp_path / "bare", run_dir=bare)
                          / "README.md")
    assert card.data.eval_results is None and "evaluation" not in card.data.finetune
    assert card.data.finetune["hyperparameters"]["train.lr"] == trained["lr"]
