"""Write ``data/models/gsm8k-bpe-8k/``: a byte-level BPE tokenizer of 8,192 tokens trained on the shipped GSM8K pairs.

The vocabulary of the ``dpo_realistic`` and ``reward`` benchmark presets (``scripts/bench.py``): with the GPT-2
tokenizer's 50,257 tokens, a model small enough for CPU ranks spends most of its matmul FLOPs in the LM head, unlike
a 0.5B-8B model (8-29%: ``scripts/bench.py``'s ``lm_head_share``); 8,192 tokens let a small Llama shape have a
realistic head share. Trained with Hugging Face
``tokenizers`` (``ByteLevel`` pre-tokenizer and decoder, ``BpeTrainer``, GPT-2's byte alphabet, so every text is
encodable) on the ``prompt``, ``chosen`` and ``rejected`` texts of ``data/gsm8k_pref/train.parquet``, in file order
(deterministic); saved as a ``PreTrainedTokenizerFast`` whose one special token ``<|endoftext|>`` (id 0) is its
BOS, EOS and pad token.

Usage: ``python scripts/make_bpe_tokenizer.py [--out data/models/gsm8k-bpe-8k] [--vocab-size 8192]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "data/models/gsm8k-bpe-8k"))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--data", default=str(REPO / "data/gsm8k_pref/train.parquet"))
    args = p.parse_args()

    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    table = pq.read_table(args.data, columns=["prompt", "chosen", "rejected"]).to_pydict()
    texts = [t for col in ("prompt", "chosen", "rejected") for t in table[col]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=2048)
    fast.save_pretrained(args.out)
    print(f"{args.out}: {len(fast)} tokens from {len(texts)} texts")


if __name__ == "__main__":
    main()
