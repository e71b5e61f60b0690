"""Side-by-side benchmark of on-policy distillation: finetune's ``distill`` recipe against TRL 1.16's
``DistillationTrainer``, on the same student, teacher, prompts, batch layout, divergence and generation settings.

Both sides start from the same weights (folders this script writes under ``--out``, seeded: a Llama student of 2
layers, hidden 64, and a teacher of 4 layers, hidden 128, both on the 8,192-token GSM8K BPE of
``data/models/gsm8k-bpe-8k``: the LM head is about a quarter of the student's matmul FLOPs, as in a 0.5-1B model),
and train every row on-policy (TRL's trainer has no offline share: ``on_policy_fraction: 1``), the generalized JSD
with ``beta`` 0.5 at temperature 1 (``alpha`` 1: no cross-entropy term, as TRL), completions of up to
``--completion`` tokens sampled at temperature 1 (top-p 1, top-k 0), ``--micro`` prompts per rank, no accumulation,
ZeRO-2, fp32, AdamW at lr 1e-5 (constant), 2 CPU ranks, ``--steps`` optimizer steps of which the first ``--skip``
are not timed. Contenders, alternated over ``--rounds``:

* ``finetune``: ``finetune/run.py`` on ``distill_gsm8k.yaml`` with those overrides (the rollout's fast generation:
  each prompt prefilled once, a preallocated KV cache);
* ``trl``: ``DistillationTrainer`` at TRL's defaults for what this comparison does not fix (gradient checkpointing
  on: ``DistillationConfig``'s default);
* ``trl_best``: the same without gradient checkpointing (the faster choice on these sizes) and with dropout off.

Trained tokens are completion tokens, EOS included (``train/completions/mean_length`` x rows; TRL's
``completions/mean_length`` x rows); tokens/s is their sum over the timed steps over the timed steps' wall time.
Peak memory: each rank's peak resident set (VmHWM). Prints a table and the ratios finetune / each TRL contender.

``--real``: the teacher is the real SmolLM2-135M-Instruct (from its GGUF file, ``bash scripts/get_smollm2.sh``,
converted once as a run converts it), the student a seeded 4-layer, hidden-128 model of its config and tokenizer
(``distill_smollm2_gsm8k.yaml``'s), the prompts GSM8K questions as a user turn rendered by the model's own ChatML
template on both sides (ours: ``data/gsm8k/train_chat.parquet``'s conversations up to the answer; TRL: the same
question as a conversational ``prompt``).

    python scripts/bench_distill.py --steps 10 --skip 2 --rounds 2 --lock /tmp/heavy.lock
    python scripts/bench_distill.py --real --steps 10 --skip 2 --rounds 2 --contenders finetune,trl_best
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BPE = REPO / "data" / "models" / "gsm8k-bpe-8k"
CONFIG = "finetune/recipes/configs/distill_gsm8k.yaml"
REAL_GGUF = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_CONFIG = "finetune/recipes/configs/distill_smollm2_gsm8k.yaml"
REAL_STUDENT = dict(num_hidden_layers=4, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32)
SHAPES = {"student": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256, head_dim=16),
          "teacher": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=512, head_dim=32)}


def write_models(out: Path) -> dict[str, Path]:
    """The student and teacher folders (seeded random weights, the BPE tokenizer), written once under ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folders = {}
    for name, shape in SHAPES.items():
        folder = out / name
        folders[name] = folder
        if (folder / "model.safetensors").is_file():
            continue
        config = AutoConfig.from_pretrained(REPO / "data" / "models" / "tiny-llama")
        config.update(dict(shape, vocab_size=8192, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                           num_attention_heads=4, num_key_value_heads=2, use_cache=True))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for f in BPE.iterdir():
            shutil.copy(f, folder / f.name)
    return folders


def write_real_models(out: Path, bench) -> dict[str, Path]:
    """``--real``: the converted SmolLM2 folder as the teacher and a seeded student of its config (the
    :data:`REAL_STUDENT` shape), tokenizer, chat template and generation config, written once under ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from finetune.config import DataConfig

    teacher = bench.converted(REAL_GGUF, DataConfig())
    student = out / "real-student"
    if not (student / "model.safetensors").is_file():
        config = AutoConfig.from_pretrained(teacher)
        config.update(REAL_STUDENT)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(student)
        AutoTokenizer.from_pretrained(teacher).save_pretrained(student)
        GenerationConfig.from_pretrained(teacher).save_pretrained(student)
    return {"student": student, "teacher": teacher}


def ours(args, models: dict, out: Path, env: dict, bench) -> dict:
    """One launch of the toolkit; the timed steps' trained tokens and wall time from its ``metrics.jsonl``."""
    overrides = [f"model.path={models['student']}", "model.tokenizer_path=", "model.init=pretrained",
                 f"train.distill.teacher={models['teacher']}", "train.distill.loss=jsd", "train.distill.beta=0.5",
                 "train.distill.temperature=1.0", "train.distill.alpha=1.0", "train.distill.on_policy_fraction=1",
                 f"train.distill.max_completion_length={args.completion}", "train.distill.top_p=1.0",
                 "train.distill.top_k=0", "data.packing=false", f"data.max_seq_len={384 if args.real else 128}",
                 f"train.micro_batch_size={args.micro}", "train.gradient_accumulation_steps=1",
                 f"train.max_steps={args.steps}", "train.lr=1e-5", "train.lr_scheduler=constant",
                 "train.warmup_steps=0", "train.weight_decay=0.0", "train.eval_every=0", "train.eval_on_start=false",
                 "train.save_every=0", "train.log_every=1", "export=false", "train.sample_prompt=",
                 "deepspeed=ds_configs/zero2.json", f"output_dir={out}"]
    if args.real:
        overrides += ["model.config_overrides={}", "train.eval_max_batches=1"]
    cmd = bench.deepspeed_cmd(args, "finetune/run.py", "--config", REAL_CONFIG if args.real else CONFIG,
                              *overrides)
    _, peaks = bench.run_launch(cmd, env, out.with_suffix(".log"), args.timeout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    timed = [r for r in rows if r["step"] > args.skip]
    start = next(r["time"] for r in rows if r["step"] == args.skip)
    tokens = sum(r["train/completions/mean_length"] * args.micro * args.nproc for r in timed)
    return {"tokens": tokens, "seconds": timed[-1]["time"] - start, "peaks": peaks,
            "final_loss": rows[-1]["train/loss"]}


def trl(args, models: dict, variant: str, out: Path, env: dict, bench) -> dict:
    """One launch of this script's TRL side (:func:`trl_rank`) under ``deepspeed``."""
    out.mkdir(parents=True)
    spec = {"out": str(out), "variant": variant, "steps": args.steps, "micro": args.micro,
            "completion": args.completion, "real": args.real, "student": str(models["student"]), "teacher": str(models["teacher"])}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = bench.deepspeed_cmd(args, "scripts/bench_distill.py", "--trl-spec", str(out / "spec.json"))
    _, peaks = bench.run_launch(cmd, env, out.with_suffix(".log"), args.timeout)
    r = json.loads((out / "rank0.json").read_text())
    ends, lengths = r["step_ends"], {int(k): v for k, v in r["lengths"].items()}
    tokens = sum(lengths[s] * args.micro * args.nproc for s in range(args.skip + 1, args.steps + 1))
    return {"tokens": tokens, "seconds": ends[args.steps - 1] - ends[args.skip - 1], "peaks": peaks,
            "final_loss": r["losses"][str(args.steps)] if str(args.steps) in r["losses"] else None}


def trl_rank(spec_path: str) -> None:
    """TRL's side on one rank: ``DistillationTrainer`` with the spec's settings; writes ``rank<r>.json`` (each step's
    end time and logged ``completions/mean_length`` and loss)."""
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    spec = json.loads(Path(spec_path).read_text())
    out, best = Path(spec["out"]), spec["variant"] == "best"
    tok = AutoTokenizer.from_pretrained(spec["student"], local_files_only=True)
    tok.padding_side = "left"
    rows = datasets.load_dataset("parquet", data_files=[str(REPO / "data" / "gsm8k" / "train.parquet")],
                                 split="train", cache_dir=str(out / "hf-datasets"))
    rows = rows.select_columns(["question"]).rename_column("question", "prompt")
    if spec.get("real"):  # a user turn, rendered by the model's own chat template
        rows = rows.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    step_ends: list[float] = []
    lengths: dict[int, float] = {}
    losses: dict[int, float] = {}

    class Meter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths[state.global_step] = float(logs["completions/mean_length"])
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    config = DistillationConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["micro"], gradient_accumulation_steps=1,
        max_steps=spec["steps"], learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        seed=42, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, bf16=False, fp16=False, deepspeed=ds, use_cpu=not torch.cuda.is_available(),
        max_completion_length=spec["completion"], temperature=1.0, top_p=1.0, top_k=0, beta=0.5,
        **({"gradient_checkpointing": False, "disable_dropout": True} if best else {}))
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32, local_files_only=True)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32, local_files_only=True)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=rows,
                                  processing_class=tok, callbacks=[Meter()])
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    (out / f"rank{rank}.json").write_text(json.dumps({"step_ends": step_ends, "lengths": lengths, "losses": losses}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--micro", type=int, default=4, help="prompts per rank per step")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--real", action="store_true", help="the real SmolLM2-135M-Instruct as the teacher")
    p.add_argument("--contenders", default="finetune,trl_best,trl")
    p.add_argument("--out", default="runs/bench_distill")
    p.add_argument("--lock", default="")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--trl-spec", default="", help=argparse.SUPPRESS)  # the TRL side, run under deepspeed
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_spec:
        trl_rank(args.trl_spec)
        return 0
    args.nproc = 2
    sys.path.insert(0, str(REPO / "scripts"))
    import bench

    out = (REPO / args.out).resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    models = write_real_models(out.parent, bench) if args.real else write_models(out.parent)
    env = bench.environment(False)
    results: dict[str, list[dict]] = {c: [] for c in args.contenders.split(",")}
    for r in range(args.rounds):
        for name in results:
            run = out / f"{name}-{r}"
            shm = set(bench.glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
            res = ours(args, models, run, env, bench) if name == "finetune" else \
                trl(args, models, "best" if name == "trl_best" else "defaults", run, env, bench)
            bench.clean_shm(shm)
            results[name].append(res)
            print(f"{name} round {r}: {res['tokens'] / res['seconds']:.1f} trained tokens/s, peak MB per rank "
                  f"{max(res['peaks'].values()) / 1024:.0f}, loss {res['final_loss']}", flush=True)
    summary = {}
    for name, runs in results.items():
        summary[name] = {"tokens_per_s": sum(x["tokens"] for x in runs) / sum(x["seconds"] for x in runs),
                         "by_round": [x["tokens"] / x["seconds"] for x in runs],
                         "peak_mb_per_rank": max(max(x["peaks"].values()) for x in runs) / 1024,
                         "final_loss": [x["final_loss"] for x in runs]}
    print(f"\n{'contender':<10} {'trained tok/s':>14} {'peak MB/rank':>13}  ours/this  (by round)")
    base = summary.get("finetune")
    for name, s in summary.items():
        ratio = base["tokens_per_s"] / s["tokens_per_s"] if base else float("nan")
        rounds = [a / b for a, b in zip(base["by_round"], s["by_round"])] if base else []
        print(f"{name:<10} {s['tokens_per_s']:>14.1f} {s['peak_mb_per_rank']:>13.0f}  {ratio:>8.2f}x  "
              f"({', '.join(f'{x:.2f}' for x in rounds)}; median {statistics.median(rounds) if rounds else 0:.2f})")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
