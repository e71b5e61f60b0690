"""Supervised fine-tuning (instruction / chat SFT) of any ``AutoModelForCausalLM``, with the loss on the answers only.

Data, one of two forms (:func:`form`):

* **prompt/response**: ``data.prompt_column`` and ``data.response_column`` (text). An example is
  ``tokens(prompt) + tokens(response) + [EOS]`` (the prompt with the tokenizer's special tokens, e.g. Llama's
  BOS; the prompt is used verbatim, so a separator belongs in it); the prompt tokens get label -100, the
  response and its EOS are trained on.
* **chat**: ``data.messages_column``, a list of ``{role, content}`` per row, rendered with
  ``data.chat_template`` (a Jinja string or a file, e.g. the shipped ``data/chat_templates/chatml.jinja``) or
  else the tokenizer's own chat template (no template at all is a ``ConfigError`` before any model is built).
  Every assistant turn is trained on (multi-turn too); system, user and template tokens get label -100.
  Templates that mark assistant text with ``{% generation %}`` (the shipped one) give the mask through
  transformers' ``apply_chat_template(return_assistant_tokens_mask=True)``; for other templates each assistant
  turn is the difference between rendering the conversation up to it with ``add_generation_prompt=True`` and
  rendering it including the turn (so the turn's end marker, e.g. Qwen's ``<|im_end|>``, is trained on too).
  Conversations without an assistant turn are dropped and counted. With ``data.tools_column`` each conversation
  is rendered with its row's tool schemas (``apply_chat_template(tools=...)``: e.g. the shipped
  ``data/chat_templates/chatml_tools.jinja`` lists them in a system turn), the prompt format ``grpo`` shows a
  model that it offers ``train.grpo.tools`` or an ``environment``, so expert trajectories with tool calls
  (``data/guess_number/train_chat.parquet``) teach the format that multi-turn GRPO then samples.

The first label of every example is -100 (nothing predicts it), so a packed row and its examples run one by one
have exactly the same targets. An example longer than ``data.max_seq_len`` is cut to it
(``data.truncation: truncate``; dropped if no answer token is left) or left out (``drop``); the counts and the
fill ratio are logged once per split (:meth:`SftExamples.summary`).

Packing (``data.packing: true``, the default): the examples of each map batch (1,000 rows) are packed whole
into rows of at most ``max_seq_len`` tokens by best-fit decreasing bin packing (:func:`pack`), with
``position_ids`` restarting at 0 for every example and no ``attention_mask`` in the batch. From such
``position_ids`` transformers (``masking_utils.find_packed_sequence_indices``) builds a block-diagonal causal
mask for ``sdpa`` and ``eager`` attention; under a flash-attention kernel the data pipeline joins each
micro-batch into one row (:func:`finetune.data.batch.flatten`), the only shape for which transformers runs the
variable-length kernel; so attention never crosses from one example into another and a packed row computes exactly what its examples
compute alone (``tests/test_sft.py``). Rows of a micro batch are padded to the longest; the padding is a
segment of its own (positions from 0) after the last example, with label -100. Without packing each example
is a row, right-padded per batch with an ``attention_mask``.

The data pipeline (forms, templates, answer masks, packing, checks) is :mod:`finetune.recipes.common.chat`, which
``distill`` and the preference recipes render with too. Loss, token counts and eval metrics are the shared causal-LM
loss's (:mod:`finetune.recipes.common.targets`, as ``gpt_clm``'s): next-token cross-entropy over labels != -100, i.e.
answer tokens; eval loss and perplexity are per answer token.
"""
from __future__ import annotations

from finetune.parallel import pipeline, sequence, tensor
from finetune.recipes import Capabilities, Recipe
from finetune.recipes.common.chat import (
    MODEL_CLASS,
    cache_key,
    check_labels,
    columns,
    generation_pairs,
    make_collator,
    prepare_model_config,
    prepare_tokenizer,
    tokenize_function,
)
from finetune.recipes.common.targets import count_targets, forward

RECIPE = Recipe(name="sft", model_class=MODEL_CLASS,
                capabilities=Capabilities(parallel=frozenset({sequence.DIMENSION, tensor.DIMENSION, pipeline.DIMENSION}), packs_rows=True,
                                          generates_text=True, checks_columns=True, counts_rows=True,
                                          noisy_embeddings=True),
                prepare_tokenizer=prepare_tokenizer, tokenize_function=tokenize_function, make_collator=make_collator,
                forward=forward, count_targets=count_targets, columns=columns, cache_key=cache_key,
                check_data=check_labels, prepare_model_config=prepare_model_config, generation_pairs=generation_pairs)
