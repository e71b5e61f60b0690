"""BERT masked-language-model fine-tuning (Devlin et al. 2019, "BERT", section 3.1).

Rows are tokenized with ``[CLS] ... [SEP]`` and truncated to ``data.max_seq_len``; masking is
``transformers.DataCollatorForLanguageModeling`` (``data.mlm_probability`` of tokens selected; of those
80% ``[MASK]``, 10% random, 10% kept), applied per batch so every epoch sees new masks.
Eval metrics: loss, perplexity and masked-token accuracy.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling

from finetune.config import ConfigError, DataConfig

MODEL_CLASS = AutoModelForMaskedLM


def prepare_tokenizer(tokenizer):
    """Check the tokenizer can mask and pad.

    Raises:
        ConfigError: no ``mask_token`` or ``pad_token``.
    """
    if tokenizer.mask_token is None or tokenizer.pad_token is None:
        raise ConfigError(f"model.tokenizer_path: tokenizer '{tokenizer.name_or_path}' has no mask or pad token; "
                          f"bert_mlm needs both (use a BERT-style WordPiece tokenizer)")
    return tokenizer


def tokenize_function(tokenizer, data_cfg: DataConfig):
    """Batched map function: text -> ``input_ids``, ``attention_mask``, ``special_tokens_mask`` (lists of int)."""
    col, max_len = data_cfg.text_column, data_cfg.max_seq_len

    def fn(batch):
        texts = [t for t in batch[col] if t is not None and t.strip()]
        return tokenizer(texts, truncation=True, max_length=max_len, return_special_tokens_mask=True)

    return fn


def make_collator(tokenizer, data_cfg: DataConfig):
    """``DataCollatorForLanguageModeling(mlm=True)``: pads per batch and masks (labels -100 on unmasked tokens)."""
    return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=data_cfg.mlm_probability,
                                           pad_to_multiple_of=data_cfg.pad_to_multiple_of or None,
                                           return_tensors="pt")


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Masked positions (``labels != -100``) in ``labels`` [batch, seq]; 0-dim int64."""
    return (labels != -100).sum()


def eval_stats(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """Masked-token accuracy sums: argmax of ``logits`` [batch, seq, vocab] equals ``labels`` where masked."""
    mask = labels != -100
    correct = (logits.argmax(dim=-1) == labels) & mask
    return {"masked_accuracy": (correct.sum(), mask.sum())}
