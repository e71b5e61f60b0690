"""Make preference pairs from a model's own samples, scored by the task's checker (on-policy pairs for ``dpo``).

For every question of ``data/arithmetic`` (or another file of the same columns: a conversational ``prompt`` and its
``answer``), the model samples ``--samples`` answers at ``--temperature`` (the prompt rendered with the model's own
chat template and its generation prompt, as ``grpo`` renders it), each answer is scored by the same check as
``grpo_smollm2_arithmetic.yaml``'s ``exact_match`` reward (the answer's last integer equals ``answer``), and a
question that got both a right and a wrong answer gives up to ``--pairs-per-question`` pairs: a right answer as
``chosen``, a different wrong one as ``rejected``. This is the "self-rewarding" / on-policy pair construction of
Pang et al. 2024 ("Iterative Reasoning Preference Optimization") and of TRL's online DPO with a rule-based judge,
run once offline. Columns, TRL's conversational preference form: ``prompt`` (the question's messages), ``chosen``
and ``rejected`` (one assistant message each), ``answer``.

The model is a ``.gguf`` file (converted once by transformers' GGUF loader into the finetune cache, as a run does)
or a Hugging Face folder. Seeded and offline; the sampling is torch's, so the pairs depend on the torch build.

    bash scripts/get_smollm2.sh
    python scripts/make_self_pairs.py --out data/arithmetic_pairs            # train.parquet and test.parquet
    python scripts/make_self_pairs.py --questions 100 --samples 4 --out /tmp/pairs   # fewer
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = REPO / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LAST_INTEGER = r"(-?[0-9]+)(?![\s\S]*[0-9])"
"""``grpo_smollm2_arithmetic.yaml``'s ``train.grpo.answer_pattern``: the answer's last integer."""


def is_right(text: str, answer: str) -> bool:
    """The task's check, ``grpo``'s ``exact_match`` reward with the pattern above: the answers it finds in ``text`` and
    in ``answer`` (:func:`finetune.recipes.common.rewards.answer_of`) are equal."""
    from finetune.recipes.common.rewards import answer_of

    want = answer_of(answer, LAST_INTEGER)
    return want is not None and answer_of(text, LAST_INTEGER) == want


def load(model_path: str):
    """``(model, tokenizer)`` in fp32, eval mode; a ``.gguf`` is converted once into the finetune cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.config import DataConfig
    from finetune.data.dataset import default_cache_dir
    from finetune.engine import gguf

    folder = model_path
    if gguf.is_gguf(model_path):
        folder, _ = gguf.ensure_converted(model_path, default_cache_dir(DataConfig()))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    return model, tok


@torch.no_grad()
def sample(model, tok, prompts: list[list[dict]], samples: int, temperature: float, max_new_tokens: int,
           batch: int) -> list[list[str]]:
    """``samples`` answers per prompt (``[len(prompts)][samples]`` texts, special tokens removed)."""
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    per_call = max(1, batch // samples)
    out: list[list[str]] = []
    for start in range(0, len(texts), per_call):
        enc = tok(texts[start:start + per_call], return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                             num_return_sequences=samples, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id)
        decoded = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out += [[d.strip() for d in decoded[i:i + samples]] for i in range(0, len(decoded), samples)]
    return out


def pairs_of(prompt: list[dict], answer: str, answers: list[str], per_question: int, rng: random.Random) -> list[dict]:
    """Up to ``per_question`` pairs (a right answer chosen, a different wrong one rejected), each text used once."""
    right = list(dict.fromkeys(a for a in answers if a and is_right(a, answer)))
    wrong = list(dict.fromkeys(a for a in answers if a and not is_right(a, answer)))
    rng.shuffle(right)
    rng.shuffle(wrong)
    return [{"prompt": prompt, "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}], "answer": answer}
            for c, r in list(zip(right, wrong))[:per_question]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MODEL), help="a .gguf file or a Hugging Face folder")
    p.add_argument("--data", default=str(REPO / "data" / "arithmetic"), help="a folder of train/test.parquet")
    p.add_argument("--out", required=True, help="a new folder for train.parquet and test.parquet")
    p.add_argument("--questions", type=int, default=600, help="training questions sampled (the first N)")
    p.add_argument("--test-questions", type=int, default=200, help="held-out questions sampled (the first N)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--pairs-per-question", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="sequences per generate call")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"make_self_pairs.py: {out} exists; name a new folder (nothing is overwritten)", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tok = load(args.model)
    written: dict[str, dict] = {}
    for split, limit in (("train", args.questions), ("test", args.test_questions)):
        rows = pq.read_table(Path(args.data) / f"{split}.parquet").to_pylist()[:limit]
        start = time.monotonic()
        answers = sample(model, tok, [r["prompt"] for r in rows], args.samples, args.temperature,
                         args.max_new_tokens, args.batch)
        pairs = [pair for r, a in zip(rows, answers)
                 for pair in pairs_of(r["prompt"], r["answer"], a, args.pairs_per_question, rng)]
        right = sum(is_right(x, r["answer"]) for r, a in zip(rows, answers) for x in a)
        written[split] = {"questions": len(rows), "samples": len(rows) * args.samples,
                          "sampled_accuracy": round(right / max(1, len(rows) * args.samples), 4),
                          "questions_with_a_pair": len({json.dumps(x["prompt"]) for x in pairs}),
                          "pairs": len(pairs), "seconds": round(time.monotonic() - start, 1)}
        if not pairs:
            print(f"make_self_pairs.py: no {split} question got both a right and a wrong answer", file=sys.stderr)
            return 1
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(pairs), out / f"{split}.parquet")
    settings = {k: (str(Path(v).resolve().relative_to(REPO)) if isinstance(v, str) and Path(v).resolve().is_relative_to(REPO)
                    else v) for k, v in vars(args).items()}
    (out / "made_by.json").write_text(json.dumps({"command": " ".join(sys.argv), "args": settings,
                                                  "torch": torch.__version__, "splits": written}, indent=1) + "\n")
    print(json.dumps(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
