"""QLoRA against LoRA, side by side: the base model's memory per rank, the loss after the same steps, tokens/s.

Builds a Llama whose cost split is like a real one's (8 layers, hidden 512, grouped-query attention 8/4 heads,
gated MLP 1408, the 8k BPE tokenizer's vocabulary with tied embeddings: the embedding is 15% of the parameters,
as in Llama-3-8B's 13%), saves it as a pretrained folder, and launches the real toolkit (``deepspeed``, CPU ranks by
default) twice on the same ``sft`` GSM8K run: LoRA r=16 on every linear layer, then the same with
``model.quantization.bits=4`` (NF4, double quantization, fp32 compute). Reported per launch:

* **base weights per rank**: the model's weights as stored before the adapters are added (the ``model:`` log line,
  :func:`finetune.engine.quantize.model_bytes`: parameters, buffers, 4-bit quantization state);
* **peak RSS added per rank**: ``peak_rss_train_mib - rss_before_model_mib`` (:mod:`finetune.lifecycle.health`),
  all the rank's memory from the model's load to the end of training (weights, adapters, optimizer states,
  activations, DeepSpeed buffers, the load's transient copies), averaged over the ranks;
* **loss**: the mean training loss of the last 5 steps (the same batches in both);
* **tokens/s**: the median of ``train/tokens_per_s`` after the first 3 steps.

Usage (from the repository root)::

    python scripts/bench_qlora.py                      # 2 ranks, 30 steps
    python scripts/bench_qlora.py --steps 60 train.micro_batch_size=4
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import launch, ok, read_metrics  # noqa: E402  (free master port per launch, CPU environment)

CONFIG = REPO / "finetune" / "recipes" / "configs" / "sft_gsm8k.yaml"


def build_model(out: Path) -> int:
    """Save the benchmark's Llama (random weights from seed 0) and tokenizer in ``out``; returns its parameters."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "gsm8k-bpe-8k")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=1024, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def figures(run: Path, nproc: int) -> dict:
    log = (run / "logs" / "rank0.log").read_text()
    weights = float(re.search(r"\(([\d.]+) MiB of weights on this rank\)", log).group(1))
    added = []
    for r in range(nproc):
        rec = json.loads((run / "launches" / "1" / "ranks" / f"rank{r}.json").read_text())
        added.append(rec["peak_rss_train_mib"] - rec["rss_before_model_mib"])
    metrics = [m for m in read_metrics(run) if "train/loss" in m]
    return {"weights_mib": weights, "peak_added_mib": statistics.mean(added),
            "loss": statistics.mean(m["train/loss"] for m in metrics[-5:]),
            "tokens_per_s": statistics.median(m["train/tokens_per_s"] for m in metrics[3:])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per launch")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both launches")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_qlora_") as tmp:
        model = Path(tmp) / "model"
        n = build_model(model)
        common = [f"model.path={model}", "model.tokenizer_path=", "model.init=pretrained", "model.lora.r=16",
                  "deepspeed=ds_configs/zero2.json", "ds.bf16.enabled=false", f"train.max_steps={args.steps}",
                  "train.log_every=1", "train.eval_every=0", "train.save_every=0", "export=false",
                  "data.max_train_rows=2000", *args.overrides]
        out = {}
        for name, extra in (("LoRA", []), ("QLoRA (NF4)", ["model.quantization.bits=4"])):
            run = Path(tmp) / name.split()[0]
            ok(launch(CONFIG, [*common, *extra, f"output_dir={run}"], nproc=args.nproc, timeout=3600))
            out[name] = figures(run, args.nproc)
    lora, qlora = out["LoRA"], out["QLoRA (NF4)"]
    print(f"model: Llama, {n:,} parameters; {args.nproc} CPU ranks, ZeRO 2, fp32, {args.steps} steps, sft GSM8K")
    print(f"{'':14} {'base weights/rank':>18} {'peak RSS added/rank':>20} {'loss (last 5)':>14} {'tokens/s':>9}")
    for name, f in out.items():
        print(f"{name:14} {f['weights_mib']:14.1f} MiB {f['peak_added_mib']:16.1f} MiB {f['loss']:14.4f} "
              f"{f['tokens_per_s']:9.0f}")
    print(f"QLoRA / LoRA: base weights {qlora['weights_mib'] / lora['weights_mib']:.3f}x, peak RSS added "
          f"{qlora['peak_added_mib'] / lora['peak_added_mib']:.3f}x, loss {qlora['loss'] / lora['loss'] - 1:+.2%}, "
          f"tokens/s {qlora['tokens_per_s'] / lora['tokens_per_s']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
