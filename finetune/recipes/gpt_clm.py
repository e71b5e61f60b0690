"""Causal-language-model fine-tuning (GPT-2 and other ``AutoModelForCausalLM`` models).

With ``data.packing: true`` (default) texts are tokenized, joined with EOS and cut into full blocks of
``data.max_seq_len`` tokens, as in transformers' ``run_clm.py`` ``group_texts``: no pad tokens, every
position trains (the tail shorter than a block in each map batch of 1,000 rows is dropped).
With packing off, each text is truncated to ``max_seq_len`` and padded per batch; pad positions get
label -100. The pad token defaults to EOS when the tokenizer has none (GPT-2 has none).
Loss: the causal-LM loss every causal-LM recipe shares (:mod:`finetune.recipes.common.targets`: labels shifted by
one, then the LM head and the cross-entropy at target positions only, chunked). Eval metrics: loss and perplexity.
"""

from __future__ import annotations

from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    default_data_collator,
)

from finetune.config import DataConfig, RunConfig
from finetune.parallel import expert, pipeline, sequence, tensor
from finetune.recipes import Capabilities, Recipe, pad_with_eos
from finetune.recipes.common.targets import count_targets, forward

MODEL_CLASS = AutoModelForCausalLM


def prepare_tokenizer(tokenizer):
    """Use EOS as the pad token when there is none.

    Raises:
        ConfigError: the tokenizer has neither a pad nor an EOS token.
    """
    return pad_with_eos(tokenizer, "gpt_clm")


def tokenize_function(tokenizer, data_cfg: DataConfig):
    """Batched map function: text -> ``input_ids``/``attention_mask`` (+ ``labels`` when packing)."""
    col, block = data_cfg.text_column, data_cfg.max_seq_len

    def packed(batch):
        texts = [t for t in batch[col] if t is not None and t.strip()]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        stream = [tok for row in ids for tok in row + [tokenizer.eos_token_id]]
        n = (len(stream) // block) * block
        blocks = [stream[i:i + block] for i in range(0, n, block)]
        return {"input_ids": blocks, "attention_mask": [[1] * block for _ in blocks],
                "labels": [list(b) for b in blocks]}

    def unpacked(batch):
        texts = [t for t in batch[col] if t is not None and t.strip()]
        return tokenizer(texts, truncation=True, max_length=block)

    return packed if data_cfg.packing else unpacked


def generation_pairs(tokenizer, rows: list[dict], data_cfg: DataConfig) -> list[tuple[list[int], str]]:
    """``train.eval_generate``'s prompts and references for plain text: the first half of each text's words is the
    prompt, the rest the reference continuation. Texts of fewer than 4 words are left out."""
    pairs = []
    for row in rows:
        words = (row.get(data_cfg.text_column) or "").split()
        if len(words) >= 4:
            half = len(words) // 2
            pairs.append((tokenizer(" ".join(words[:half]), add_special_tokens=False)["input_ids"],
                          " ".join(words[half:])))
    return pairs


def make_collator(tokenizer, data_cfg: DataConfig):
    """Packed: stack equal-length blocks. Unpacked: pad per batch, labels -100 on pad positions."""
    if data_cfg.packing:
        return default_data_collator
    return DataCollatorForLanguageModeling(tokenizer, mlm=False,
                                           pad_to_multiple_of=data_cfg.pad_to_multiple_of or None,
                                           return_tensors="pt")


def cache_key(data_cfg: DataConfig) -> dict:
    """Packing decides the tokenized rows (blocks of ``data.max_seq_len`` or one row per text)."""
    return {"packing": data_cfg.packing}


def check_tokenizer(tokenizer, cfg: RunConfig, problems: list[str]) -> None:
    """Packing puts the EOS token between texts: a tokenizer without one cannot pack."""
    if cfg.data.packing and tokenizer.eos_token_id is None:
        problems.append(f"model.tokenizer_path: tokenizer '{tokenizer.name_or_path}' has no EOS token, which "
                        f"data.packing=true puts between texts; set data.packing=false or use a tokenizer with an "
                        f"EOS token")


RECIPE = Recipe(name="gpt_clm", model_class=MODEL_CLASS,
                capabilities=Capabilities(parallel=frozenset({sequence.DIMENSION, tensor.DIMENSION, expert.DIMENSION,
                                                              pipeline.DIMENSION}),
                                          packs_rows=True,
                                          generates_text=True, noisy_embeddings=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, cache_key=cache_key, check_tokenizer=check_tokenizer,
                generation_pairs=generation_pairs)
