"""The sections of the one-command GPU proof, ``scripts/gpu_check.sh`` (docs/gpu-check.md).

``python scripts/gpu_check.py SECTION --out DIR [--dry-run]`` runs one section and appends its figures to
``DIR/figures.jsonl`` (one JSON object per figure: ``section``, ``name``, ``value``, ``unit``, ``target``, ``met``
and what was measured); ``table`` reads them and writes ``DIR/summary.md``. ``gpu_check.sh`` runs every section
under its own time limit, so one failure leaves the others running. ``--dry-run`` (``gpu_check.sh
--cpu-dry-run``): the same code on CPU ranks with tiny shapes, so that the script cannot rot between the runs
that have a GPU; no target is judged then.

Sections, in the order the shell script runs them:

* ``selftest``: ``finetune selftest`` on one GPU (every row but ``hybrid_rollout``), one figure per row.
* ``precision``: one optimizer step of ``sft``, ``dpo`` and ``grpo`` on the tests' tiny models
  (``tests/configs``), bf16 against fp32, one launch each (``grpo`` on fixed completions, teacher-forced:
  ``tests/grpo_teacher_forced.py``, so both precisions train on the same sequences): the step's loss and gradient
  norm. The first step's ``dpo`` loss (policy = reference: ``log 2``) and ``grpo`` loss (ratio 1) do not depend on
  the logits; their gradient norms do. The dry run takes ``sft`` only.
* ``throughput``: tokens/s and MFU of a Llama-3.2-1B-shaped model (``LLAMA_1B`` of ``scripts/bench.py``, random weights
  from the config), bf16, packed 4,096-token rows of WikiText-2, finetune against HF Trainer + DeepSpeed ZeRO-2 on the same
  card in the same run (``scripts/bench.py --preset llama1b``). MFU is the PaLM estimate
  (:func:`finetune.training.meter.model_flops_per_token`): ``6 x parameters`` per token plus attention's
  ``12 x layers x hidden x seq``, over the card's dense bf16 peak.
* ``longest``: the longest packed sequence that trains one step on the card: HF Trainer with gradient
  checkpointing (doubling from :data:`LONG_START` until a length fails with CUDA's out-of-memory error), then
  finetune with gradient checkpointing, the tiled MLP, activation offload and its chunked head loss, from 4x
  HF's longest (the target) upwards while the section's time lasts. Lengths are powers of two: each result is
  a lower bound within 2x.
* ``generation``: GRPO's rollout on the 1B shape (bf16, ZeRO-0): completions/s of 8 prompts x 8 completions of
  256 tokens, sampled, through :class:`finetune.engine.rollout.HFGenerateRollout` with ``fast_generation`` on and
  off; and the greedy completions of ``fast`` on and off, which must be identical.
* ``hybrid``: DeepSpeed's hybrid engine (:class:`~finetune.engine.rollout.HybridEngineGenerate`): the self-test's
  ``hybrid_rollout`` row and the same completions/s; last, because its first use builds DeepSpeed's inference
  kernels.

Every figure names its card (``torch.cuda.get_device_name``) and the commit. Exit status: 0 when the section
ran (a target missed is a figure, not a failure), 1 when it could not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGETS = {"mfu": 0.40, "tokens_per_s_ratio": 1.3, "longest_ratio": 4.0, "fast_generation_ratio": 2.0}
"""The issue's targets (issue 52): MFU, tokens/s over HF Trainer's, longest sequence over HF Trainer's, fast
generation's completions/s over plain ``generate``'s."""

LONG_START = 16384
"""The first length HF Trainer tries in ``longest`` (GPU; the dry run starts at 64)."""

PRECISION_TOLERANCE = {"loss": 2e-2, "grad_norm": 5e-2}
"""bf16 against fp32, relative, for ``precision`` (bf16 keeps 8 bits of mantissa: about 4e-3 per rounding; a
broken bf16 path is off by O(1))."""


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Figures:
    """Appends figures to ``<out>/figures.jsonl``."""

    def __init__(self, out: Path, section: str, dry: bool):
        self.path, self.section, self.dry = out / "figures.jsonl", section, dry
        self.card, self.commit = device_name(), commit()

    def add(self, name: str, value, unit: str = "", target: float | None = None, higher: bool = True,
            **detail) -> dict:
        met = None
        if target is not None and value is not None and not self.dry:
            met = bool(value >= target) if higher else bool(value <= target)
        row = {"section": self.section, "name": name, "value": value, "unit": unit, "target": target,
               "target_is": None if target is None else (">=" if higher else "<="), "met": met, "card": self.card,
               "commit": self.commit, "dry_run": self.dry, **detail}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        shown = "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else value
        print(f"gpu_check: {self.section}: {name} = {shown} {unit}"
              + (f" (target {row['target_is']} {target}: {'met' if met else 'NOT met'})" if met is not None else ""),
              flush=True)
        return row


def _bench():
    """``scripts/bench.py`` as a module (its launch helpers and presets)."""
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_for(dry: bool) -> dict:
    env = dict(os.environ)
    env.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if dry:
        env.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    return env


# ---------------------------------------------------------------------------------------------------- selftest
def selftest(out: Path, figs: Figures, dry: bool, rows: list[str], name: str, timeout: float) -> None:
    """``finetune selftest --checks <rows>`` in one process (one GPU), within ``timeout`` seconds (past it, one
    ``FAIL`` figure says so); one figure per row, the rows in ``<out>/<name>.json``."""
    checks = ["--checks", ",".join(rows)]
    result = out / f"{name}.json"
    try:
        proc = subprocess.run([sys.executable, "-m", "finetune", "selftest", "--json", str(result), *checks],
                              cwd=REPO, env=env_for(dry), text=True, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        figs.add(",".join(rows), "FAIL", "", detail=f"finetune selftest ran past {timeout:g} s")
        return
    print(proc.stdout + proc.stderr[-4000:], flush=True)
    if not result.exists():
        raise SystemExit(f"gpu_check: selftest wrote no {result} (exit {proc.returncode})")
    for row in json.loads(result.read_text())["rows"]:
        figs.add(row["name"], row["status"], "", measured=row["measured"], tolerance=row["tolerance"],
                 detail=row["detail"], seconds=round(row["seconds"], 2))


def selftests(out: Path, figs: Figures, dry: bool, budget: float) -> None:
    """Every self-test row but ``hybrid_rollout`` (the ``hybrid`` section's): the quick rows in one process, then
    ``liger_fused_ce`` in another (its first use compiles Liger's Triton kernels), so that a slow compile costs that
    row only. The dry run takes the rows that run on CPUs quickly."""
    from finetune.preflight.selftest import CHECKS

    if dry:
        selftest(out, figs, dry, ["collectives", "chunked_head", "bf16_forward", "sdpa_packing"], "selftest", budget)
        return
    start = time.time()
    selftest(out, figs, dry, [c for c in CHECKS if c not in ("hybrid_rollout", "liger_fused_ce")], "selftest",
             budget * 0.6)
    selftest(out, figs, dry, ["liger_fused_ce"], "selftest_liger", max(10.0, budget - (time.time() - start)))


# --------------------------------------------------------------------------------------------------- precision
PRECISION_RUNS = {
    "sft": ("tests/configs/tiny_sft.yaml", "finetune/run.py", []),
    "dpo": ("tests/configs/parity_dpo.yaml", "finetune/run.py", ["train.dpo.rpo_alpha=0"]),
    "grpo": ("tests/configs/tiny_grpo.yaml", "tests/grpo_teacher_forced.py",
             ["train.grpo.rewards=[tests/grpo_rewards.py:has_digit]", "train.grpo.reward_weights=[]",
              "train.grpo.max_completion_length=10"]),
}
"""Recipe -> (run config, entry point, overrides) of ``precision``: the tests' tiny models (``max_completion_length``
10: ``tests/grpo_teacher_forced.LENGTH``)."""


def _one_step(recipe: str, precision: str, root: Path, dry: bool) -> dict:
    """One single-process launch training one step; its first ``metrics.jsonl`` training row."""
    config, entry, extra = PRECISION_RUNS[recipe]
    run = root / f"{recipe}-{precision}"
    env = env_for(dry)
    env["MASTER_PORT"] = str(_bench().free_port())
    cmd = [sys.executable, entry, "--config", config, *extra, f"output_dir={run}", "train.max_steps=1",
           "train.gradient_accumulation_steps=1", "train.eval_every=0", "train.eval_on_start=false",
           "train.save_every=0", "export=false", "train.sample_prompt=", f"train.precision={precision}",
           f"ds.bf16.enabled={'true' if precision == 'bf16' else 'false'}", "train.log_every=1"]
    log = root / f"{recipe}-{precision}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{recipe} {precision} failed (exit {code}):\n{log.read_text()[-2500:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if "train/loss" in r)


def precision(out: Path, figs: Figures, dry: bool, work: Path) -> None:
    """bf16 against fp32: one step of each recipe; all six launches at once on a GPU (tiny models), two on CPUs."""
    recipes = ["sft"] if dry else list(PRECISION_RUNS)  # the dry run: the code path once, at a third of the cost
    jobs = [(r, p) for r in recipes for p in ("fp32", "bf16")]
    with ThreadPoolExecutor(2 if dry else len(jobs)) as pool:
        done = dict(zip(jobs, pool.map(lambda j: _one_step(*j, work, dry), jobs)))
    for recipe in recipes:
        ref, got = done[(recipe, "fp32")], done[(recipe, "bf16")]
        for key, tol in PRECISION_TOLERANCE.items():
            a, b = got[f"train/{key}"], ref[f"train/{key}"]
            figs.add(f"{recipe}_{key}_rel_diff", abs(a - b) / max(abs(b), 1e-12), "", tol, higher=False,
                     bf16=a, fp32=b)


# -------------------------------------------------------------------------------------------------- throughput
def _bench_json(cmd: list[str], env: dict, log: Path) -> list[dict]:
    """Run ``scripts/bench.py``; its JSON result lines (``{"bench": ...}``)."""
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True).returncode
    text = log.read_text()
    print(text[-3000:], flush=True)
    if code != 0:
        raise RuntimeError(f"scripts/bench.py failed (exit {code}); log {log}")
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"bench"')]


def throughput(out: Path, figs: Figures, dry: bool, work: Path) -> None:
    """finetune against HF Trainer + ZeRO-2 on the 1B shape (``scripts/bench.py --preset llama1b``)."""
    # the dry run launches finetune only: HF Trainer's launch (scripts/bench_hf.py) runs in its longest section
    cmd = [sys.executable, "scripts/bench.py", "--preset", "llama1b", "--nproc", "1", "--rounds", "1",
           "--no-warm-up", "--contenders", "finetune" if dry else "finetune,hf", "--keep", str(work / "throughput"),
           *(["--tiny", "--steps", "3", "--skip", "1"] if dry else ["--gpu", "--steps", "10", "--skip", "3"])]
    results = {r["contender"]: r for r in _bench_json(cmd, env_for(dry), work / "throughput.log")}
    ours, hf = results["finetune"], results.get("hf", {})
    figs.add("finetune_tokens_per_s", ours["real_tokens_per_s"], "tokens/s")
    figs.add("hf_trainer_tokens_per_s", hf.get("real_tokens_per_s"), "tokens/s")
    figs.add("tokens_per_s_ratio", ours["real_tokens_per_s"] / hf["real_tokens_per_s"] if hf else None, "x",
             TARGETS["tokens_per_s_ratio"])
    figs.add("finetune_mfu", ours.get("mfu"), "", TARGETS["mfu"],
             formula="6 x parameters + 12 x layers x hidden x seq FLOPs per token, over the card's dense bf16 peak")
    figs.add("hf_trainer_mfu", hf.get("mfu"), "")
    for c, r in results.items():
        if r.get("gpu_max_allocated_mb"):
            figs.add(f"{'hf_trainer' if c == 'hf' else c}_peak_gpu_mb", r["gpu_max_allocated_mb"], "MB")


# ----------------------------------------------------------------------------------------------------- longest
def longest(out: Path, figs: Figures, dry: bool, work: Path, budget_s: float) -> None:
    """The longest packed sequence that trains a step: HF Trainer + gradient checkpointing first, then finetune
    from 4x HF's longest (module docstring)."""
    from finetune.config import load_run_config

    bench = _bench()
    preset = bench.PRESETS["long_context"]
    env = env_for(dry)
    shape = bench.LLAMA_TINY if dry else bench.LLAMA_1B
    precision_ = "fp32" if dry else "bf16"
    args = argparse.Namespace(nproc=1, lock="", timeout=budget_s)
    base = [o for o in preset["overrides"] if not o.startswith(("model.config_overrides", "deepspeed="))]
    base += [f"model.config_overrides={shape}", "deepspeed=ds_configs/zero2.json", "train.log_every=1",
             "train.eval_every=0", "train.eval_on_start=false", "train.save_every=0", "export=false",
             "train.sample_prompt=", f"train.precision={precision_}", "train.max_steps=1",
             "model.gradient_checkpointing=true", f"data.max_train_rows={200 if dry else 0}"]
    if not dry:  # WikiText-2's test split has about 280k GPT-2 tokens: four copies hold a 1M-token row
        import pyarrow as pa
        import pyarrow.parquet as pq

        text = pq.read_table(REPO / "data/wikitext2/test.parquet", columns=["text"])
        pq.write_table(pa.concat_tables([text] * 4), work / "long.parquet")
        base.append(f"data.train_files=[{work / 'long.parquet'}]")
    ours = ["parallel.tiled_mlp=true", "model.offload_activations=true"]
    start, deadline = time.time(), time.time() + budget_s
    tried: dict[str, dict[int, str]] = {"hf": {}, "finetune": {}}

    def fits(contender: str, length: int) -> bool:
        run = work / f"longest-{contender}-{length}"
        overrides = [*base, *(ours if contender == "finetune" else []), f"data.max_seq_len={length}"]
        before = set(__import__("glob").glob("/dev/shm/deepspeed_allreduce_buffer_*"))
        t0 = time.time()
        try:
            if contender == "hf":
                cfg = load_run_config(REPO / preset["config"], overrides)
                spec = {**bench.hf_spec(cfg, 1, precision_), "log_every": 1, "sampling": "random", "out": str(run)}
                run.mkdir(parents=True)
                (run / "spec.json").write_text(json.dumps(spec))
                cmd = bench.deepspeed_cmd(args, "scripts/bench_hf.py", "--spec", str(run / "spec.json"))
            else:
                cmd = bench.deepspeed_cmd(args, "finetune/run.py", "--config", preset["config"], *overrides,
                                          f"output_dir={run}")
            args.timeout = max(10.0, deadline - time.time())
            bench.run_launch(cmd, env, run.with_suffix(".log"), args.timeout)
            tried[contender][length] = "fits"
        except RuntimeError as e:
            text = run.with_suffix(".log").read_text() if run.with_suffix(".log").exists() else str(e)
            if not re.search(r"OutOfMemoryError|CUDA out of memory|out of memory", text):
                raise
            tried[contender][length] = "out of memory"
        except subprocess.TimeoutExpired:
            tried[contender][length] = "out of time"
        finally:
            bench.clean_shm(before)
        print(f"gpu_check: longest: {contender} {length} tokens: {tried[contender][length]} "
              f"({time.time() - t0:.0f} s)", flush=True)
        return tried[contender][length] == "fits"

    cap = 64 if dry else 1 << 18  # HF's longest below 256k tokens (the dry run: one trial each, 64 then 256 tokens)
    n, hf_longest = (64 if dry else LONG_START), 0
    while n <= cap and fits("hf", n):
        hf_longest, n = n, 2 * n
    figs.add("hf_trainer_longest", hf_longest, "tokens", tried=tried["hf"],
             note="a power of two; the next one failed" if n <= cap else f"the cap {cap}")
    first = n = max(4 * hf_longest, 64 if dry else LONG_START)
    ours_longest = 0
    while n <= 4 * cap and time.time() < deadline - 30 and fits("finetune", n):
        ours_longest, n = n, 2 * n
    n = first // 2
    while not ours_longest and n >= max(hf_longest, 1) and time.time() < deadline - 30:  # below the target: how far
        ours_longest = n if fits("finetune", n) else 0
        n //= 2
    figs.add("finetune_longest", ours_longest, "tokens", tried=tried["finetune"],
             note="started at 4x HF Trainer's longest; a lower bound when the section's time ran out")
    figs.add("longest_ratio", ours_longest / hf_longest if hf_longest else None, "x", TARGETS["longest_ratio"],
             seconds=round(time.time() - start))


# -------------------------------------------------------------------------------------------------- generation
def _prompts(tokenizer, count: int, dev):
    import pyarrow.parquet as pq

    questions = pq.read_table(REPO / "data/gsm8k/train.parquet", columns=["question"]).column(0).to_pylist()[:count]
    tokenizer.padding_side = "left"
    enc = tokenizer(questions, return_tensors="pt", padding=True)
    return enc["input_ids"].to(dev), enc["attention_mask"].to(dev)


def _engine(model, hybrid: bool, dry: bool):
    import deepspeed

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}, "steps_per_print": 10**9,
          "bf16": {"enabled": not dry}}
    if hybrid:
        ds["hybrid_engine"] = {"enabled": True, "max_out_tokens": 1024, "inference_tp_size": 1,
                               "release_inference_cache": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def generation(out: Path, figs: Figures, dry: bool, work: Path) -> None:
    """Completions/s of GRPO's rollout backends on the 1B shape, and the greedy completions of fast on and off."""
    import torch
    import yaml
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.engine.rollout import RolloutRequest, SamplingConfig, make_rollout
    from finetune.parallel import distributed as dist_utils

    dist_utils.export_rank_env()
    dist_utils.init(10.0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts, per_prompt, new_tokens = (8, 8, 256) if not dry else (2, 2, 8)
    bench = _bench()
    shape = yaml.safe_load(bench.LLAMA_TINY if dry else bench.LLAMA_1B)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2", local_files_only=True)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = LlamaConfig.from_pretrained(REPO / "data/models/tiny-llama", local_files_only=True, **shape)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32 if dry else torch.bfloat16)
    ids, mask = _prompts(tokenizer, prompts, dev)
    engine = _engine(model, hybrid=False, dry=dry)
    sampled = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, n_samples_per_prompt=per_prompt)
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, n_samples_per_prompt=1)

    def timed(rollout, sampling) -> tuple[float, object]:
        with rollout.weights():
            rollout.generate(RolloutRequest(ids, mask), sampling, seed=1)  # warm-up (kernels, allocator)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = rollout.generate(RolloutRequest(ids, mask), sampling, seed=2)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return time.perf_counter() - t0, batch

    rates, greedy_out = {}, {}
    for fast in (False, True):
        rollout = make_rollout(engine, tokenizer, "hf_generate", gather=False, fast=fast)
        seconds, batch = timed(rollout, sampled)
        tokens = int(batch.attention_mask[:, ids.shape[1]:].sum())
        rates[fast] = prompts * per_prompt / seconds
        figs.add(f"completions_per_s_fast_{'on' if fast else 'off'}", rates[fast], "completions/s",
                 seconds=round(seconds, 3), completion_tokens=tokens)
        with rollout.weights():
            greedy_out[fast] = rollout.generate(RolloutRequest(ids, mask), greedy, seed=3).input_ids
    figs.add("fast_generation_ratio", rates[True] / rates[False], "x", TARGETS["fast_generation_ratio"])
    same = (greedy_out[True] == greedy_out[False]).all(1).float().mean().item()
    figs.add("greedy_completions_identical", same, "fraction of prompts", 1.0)
    engine.destroy()


def hybrid(out: Path, figs: Figures, dry: bool, work: Path, budget: float) -> None:
    """DeepSpeed's hybrid engine: ``finetune selftest``'s ``hybrid_rollout`` row (its first use builds DeepSpeed's
    inference kernels, which may take minutes: last, so that an overrun costs this section only), then the
    rollout's completions/s on the 1B shape (8 prompts x 8 sampled completions of 256 tokens), as ``generation``."""
    import torch

    selftest(out, figs, dry, ["hybrid_rollout"], "selftest_hybrid", budget)
    if not torch.cuda.is_available():
        figs.add("completions_per_s_hybrid_engine", None, "completions/s",
                 skipped="DeepSpeed's hybrid engine needs a CUDA GPU (its inference kernels)")
        return
    import yaml
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.engine.rollout import RolloutRequest, SamplingConfig, make_rollout
    from finetune.parallel import distributed as dist_utils

    dist_utils.export_rank_env()
    dist_utils.init(10.0)
    dev = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "data/models/tiny-gpt2", local_files_only=True)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = LlamaConfig.from_pretrained(REPO / "data/models/tiny-llama", local_files_only=True,
                                         **yaml.safe_load(_bench().LLAMA_1B))
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(config)
    engine = _engine(model.to(torch.bfloat16), hybrid=True, dry=False)
    ids, mask = _prompts(tokenizer, 8, dev)
    rollout = make_rollout(engine, tokenizer, "hybrid_engine")
    sampled = SamplingConfig(max_new_tokens=256, temperature=1.0, n_samples_per_prompt=8)
    with rollout.weights():
        rollout.generate(RolloutRequest(ids, mask), sampled, seed=1)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rollout.generate(RolloutRequest(ids, mask), sampled, seed=2)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    figs.add("completions_per_s_hybrid_engine", 64 / seconds, "completions/s", seconds=round(seconds, 3))


# ------------------------------------------------------------------------------------------------------- table
def table(out: Path) -> str:
    """``summary.md``: every figure of ``figures.jsonl`` as one Markdown table, the card and commit on top."""
    path = out / "figures.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    first = rows[0] if rows else {"card": device_name(), "commit": commit(), "dry_run": None}
    lines = [f"# GPU check: {first['card']}, commit {first['commit']}" + (" (CPU dry run: tiny shapes, no target "
                                                                         "judged)" if first.get("dry_run") else ""),
             "", "| section | figure | value | target | met |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        v = r["value"]
        shown = "n/a" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
        target = "" if r.get("target") is None else f"{r['target_is']} {r['target']}"
        met = {True: "yes", False: "**no**", None: ""}[r.get("met")]
        lines.append(f"| {r['section']} | {r['name']} | {shown} {r.get('unit', '')} | {target} | {met} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


SECTIONS = ("selftest", "precision", "throughput", "longest", "generation", "hybrid")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=[*SECTIONS, "table", "failed"])
    p.add_argument("--out", required=True, help="the output folder (figures.jsonl, summary.md, selftest.json)")
    p.add_argument("--dry-run", action="store_true", help="CPU ranks, tiny shapes, no target judged")
    p.add_argument("--budget", type=float, default=150.0, help="seconds the section may take (longest)")
    p.add_argument("--why", default="", help="with 'failed': what ended the section (recorded as a figure)")
    p.add_argument("--name", default="", help="with 'failed': the section that failed")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section == "table":
        print(table(out))
        return 0
    if args.section == "failed":
        Figures(out, args.name, args.dry_run).add("section_failed", args.why)
        return 0
    import tempfile

    figs = Figures(out, args.section, args.dry_run)
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{args.section}_") as tmp:
        work = Path(tmp)
        if args.section == "selftest":
            selftests(out, figs, args.dry_run, args.budget)
        elif args.section == "precision":
            precision(out, figs, args.dry_run, work)
        elif args.section == "throughput":
            throughput(out, figs, args.dry_run, work)
        elif args.section == "longest":
            longest(out, figs, args.dry_run, work, args.budget)
        elif args.section == "generation":
            generation(out, figs, args.dry_run, work)
        else:
            hybrid(out, figs, args.dry_run, work, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
