"""What each GGUF type costs, measured by llama.cpp itself (``xllamacpp``) on one Hugging Face export.

For each type the export is written as a GGUF file (``finetune.lifecycle.gguf_export.write_gguf``) and llama.cpp
continues the 10 prompts of ``finetune.lifecycle.gguf_check.PROMPTS`` greedily (32 tokens):

* ``agree``: prompts whose continuation is transformers' on the export (same text);
* ``as written``: mean |log-probability difference| (nats) against transformers on the weights as the file holds them
  (the conversion's error: what ``finetune export --gguf`` checks);
* ``vs export``: the same against the unrounded export (the conversion plus the type's rounding);
* ``vs f16 file``: against llama.cpp's own log-probabilities on the f16 file, on the tokens both files continue alike.

``--scale FILE.gguf`` adds llama.cpp on an existing GGUF (the shared SmolLM2 Q4_1) against transformers on ``export``
when ``export`` is that file's dequantized copy: the scale a Q4 file's differences have. ``--adapter-base`` checks the
export's ``adapter/`` as llama.cpp's GGUF LoRA over that base (a ``.gguf``, or a folder written as f16).

    python scripts/gguf_measure.py runs/x/export --types f16,bf16,q8_0,q4_0,q4_1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.lifecycle import gguf_check, gguf_export  # noqa: E402


def _llama_runs(path: Path, prompts: list[list[int]]) -> list[tuple]:
    with gguf_check.server(path) as srv:
        return [gguf_check.llama_greedy(srv, p, 32) for p in prompts]


def _vs(runs: list[tuple], ref: list[tuple]) -> float:
    """Mean |difference| of llama.cpp's log-probabilities on two files, over the tokens both continue alike."""
    diffs = []
    for (_, ids_a, lp_a, _), (_, ids_b, lp_b, _) in zip(runs, ref):
        for a, b, x, y in zip(ids_a, ids_b, lp_a, lp_b):
            if a != b:
                break
            diffs.append(abs(x - y))
    return sum(diffs) / max(1, len(diffs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("export", help="a Hugging Face export folder of a supported family")
    p.add_argument("--types", default="f16,bf16,q8_0,q4_0,q4_1")
    p.add_argument("--scale", default=None, help="an existing .gguf whose dequantized copy is EXPORT")
    p.add_argument("--adapter-base", default=None, help="base .gguf (or folder) for the export's adapter/")
    args = p.parse_args()
    from transformers import AutoTokenizer

    folder = Path(args.export)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prompts = [tokenizer(t)["input_ids"] for t in gguf_check.PROMPTS]
    rows, f16_runs = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in ["f16"] + [t for t in args.types.split(",") if t != "f16"]:
            t0 = time.time()
            path = gguf_export.write_gguf(folder, Path(tmp) / gguf_export.file_name(qtype), qtype)
            r = gguf_check.compare(path, folder, chat=True, as_written=lambda m, q=qtype: gguf_export.as_written(m, q))
            runs = _llama_runs(path, prompts)
            f16_runs = f16_runs or runs
            rows.append((qtype, path.stat().st_size / 2**20, r["agree"], r["mean_abs_logprob_diff"],
                         r["mean_abs_logprob_diff_unrounded"], _vs(runs, f16_runs),
                         r["chat"]["equal"] if r["chat"] else None, time.time() - t0))
            path.unlink()
        if args.scale:
            r = gguf_check.compare(args.scale, folder)
            rows.append((f"{Path(args.scale).name}", Path(args.scale).stat().st_size / 2**20, r["agree"],
                         float("nan"), r["mean_abs_logprob_diff"], float("nan"),
                         r["chat"]["equal"] if r["chat"] else None, 0.0))
        if args.adapter_base:
            written = gguf_export.export_gguf(folder, Path(tmp) / "adapter", "f16", adapter=True,
                                              base=args.adapter_base)
            check = Path(str(written[0]) + ".check.json").read_text()
            print(f"adapter over {args.adapter_base}: {check}")
    print("| type | MiB | agree | as written | vs export | vs f16 file | chat equal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for qtype, mib, agree, written, export, f16, chat, _ in rows:
        print(f"| {qtype} | {mib:.0f} | {agree}/10 | {written:.2e} | {export:.2e} | {f16:.2e} | {chat} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
