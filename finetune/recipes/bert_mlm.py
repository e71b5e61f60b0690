"""BERT masked-language-model fine-tuning (Devlin et al. 2019, "BERT", section 3.1).

Rows are tokenized with ``[CLS] ... [SEP]`` and truncated to ``data.max_seq_len``; masking is
``transformers.DataCollatorForLanguageModeling.torch_mask_tokens`` (``data.mlm_probability`` of tokens
selected; of those 80% ``[MASK]``, 10% random, 10% kept), applied to each row before padding with a
``torch.Generator`` seeded from ``(train.seed, epoch, row index)`` (the row's ``"_seed"``, see
:class:`finetune.data.dataset.RowSeededCollate`). Masks thus depend on neither the world size, nor the split of
the global batch into micro-batches, nor RNG state (exact resume with DataLoader workers), and every
epoch sees new masks. Evaluation masks use epoch 0, the same at every evaluation.
Loss: the head and the cross-entropy run at the masked positions only (:mod:`finetune.recipes.lm_loss`).
Eval metrics: loss, perplexity and masked-token accuracy.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling
from transformers.data.data_collator import pad_without_fast_tokenizer_warning

from finetune.data.batch import LossOutput, model_inputs
from finetune.config import DataConfig
from finetune.errors import ConfigError
from finetune.parallel import pipeline
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.lm_loss import token_loss_sum

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


class MLMCollator:
    """Masks each row with its own generator, then pads the batch.

    Called with rows (dicts of lists of int: ``input_ids``, ``attention_mask``, ``token_type_ids``,
    ``special_tokens_mask``, and ``_seed`` when the rows come through :class:`finetune.data.dataset.RowSeededCollate`).
    Each row's ``input_ids`` [1, len] go through ``DataCollatorForLanguageModeling.torch_mask_tokens`` with
    ``generator = torch.Generator().manual_seed(row["_seed"])``; a row without ``_seed`` uses the global
    torch RNG. Returns ``input_ids``, ``attention_mask``, ``token_type_ids`` and ``labels`` (int64,
    [micro_batch, seq], padded on the tokenizer's padding side; ``labels`` is -100 on unmasked and pad
    positions).
    """

    row_seeded = True
    """Ask :class:`finetune.data.dataset.RowSeededCollate` for a ``_seed`` per row."""

    def __init__(self, tokenizer, mlm_probability: float, pad_to_multiple_of: int | None):
        self.tokenizer = tokenizer
        self.pad_to_multiple_of = pad_to_multiple_of
        self.masker = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability,
                                                      return_tensors="pt")

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        masked, labels = [], []
        for row in rows:
            row = dict(row)
            seed = row.pop("_seed", None)
            special = row.pop("special_tokens_mask", None)
            ids = torch.tensor(row["input_ids"], dtype=torch.long)[None]
            special = None if special is None else torch.tensor(special, dtype=torch.bool)[None]
            self.masker.generator = None if seed is None else torch.Generator().manual_seed(seed)
            try:
                ids, row_labels = self.masker.torch_mask_tokens(ids, special_tokens_mask=special)
            finally:
                self.masker.generator = None
            row["input_ids"] = ids[0].tolist()
            masked.append(row)
            labels.append(row_labels[0])
        batch = dict(pad_without_fast_tokenizer_warning(self.tokenizer, masked, return_tensors="pt",
                                                        pad_to_multiple_of=self.pad_to_multiple_of))
        seq = batch["input_ids"].shape[1]
        batch["labels"] = torch.full((len(rows), seq), -100, dtype=torch.long)
        for i, row_labels in enumerate(labels):
            if self.tokenizer.padding_side == "left":
                batch["labels"][i, seq - len(row_labels):] = row_labels
            else:
                batch["labels"][i, :len(row_labels)] = row_labels
        return batch


def make_collator(tokenizer, data_cfg: DataConfig):
    """:class:`MLMCollator`: masks each row (seeded per row), pads per batch (labels -100 on unmasked tokens)."""
    return MLMCollator(tokenizer, data_cfg.mlm_probability, data_cfg.pad_to_multiple_of or None)


def forward(model, batch: dict, metrics: bool = False) -> LossOutput:
    """Masked-LM loss of one micro-batch: the head (transform + vocabulary projection) and the cross-entropy run
    only at the masked positions (``labels != -100``), in chunks (:func:`finetune.recipes.lm_loss.token_loss_sum`).

    Args:
        model: the engine (or a transformers masked LM); called with :func:`~finetune.recipes.model_inputs` of
            ``batch``.
        batch: ``input_ids``, ``attention_mask`` (, ``token_type_ids``) and ``labels`` (int64, [batch, seq]).
        metrics: also return masked-token accuracy sums (``masked_accuracy``: argmax at a masked position is
            its original token).

    Returns:
        :class:`~finetune.recipes.LossOutput` with the cross-entropy summed over masked positions (0-dim float32,
        as transformers' ``ForMaskedLMLoss`` with a sum).
    """
    labels = batch["labels"]
    inputs = model_inputs(batch)
    loss, correct = token_loss_sum(model, inputs, labels, count_correct=metrics)
    n = count_targets(batch)
    return LossOutput(loss, n, {"masked_accuracy": (correct, n)} if metrics else {})


def count_targets(batch: dict) -> torch.Tensor:
    """Masked positions (``labels != -100``) in the batch's ``labels`` [batch, seq]; 0-dim int64."""
    return (batch["labels"] != -100).sum()


def target_fraction(data_cfg: DataConfig) -> float:
    """Share of positions that are loss targets: the masked ones (``data.mlm_probability``)."""
    return data_cfg.mlm_probability


RECIPE = Recipe(name="bert_mlm", model_class=MODEL_CLASS,
                capabilities=Capabilities(parallel=frozenset({pipeline.DIMENSION}), eval_metrics=("masked_accuracy",)),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, target_fraction=target_fraction)
