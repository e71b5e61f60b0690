"""Side-by-side benchmark: ``finetune`` vs Hugging Face Trainer + DeepSpeed on the same model, data and batch layout.

Each contender is launched with the ``deepspeed`` launcher on the same ranks, model (config + overrides, random
init from ``train.seed``), training rows (empty texts dropped), micro batch x accumulation, ZeRO stage, precision,
optimizer (torch AdamW), LR schedule and number of optimizer steps. Contenders:

* ``finetune``: ``finetune/run.py`` on the preset's run config (length-grouped global batches for unpacked rows);
* ``bare``: ``scripts/bench_bare.py``, a bare ``recipe.forward(engine, batch) / backward / step`` loop on the same
  run config's batches, drawn and moved to the device before the timing starts: ``finetune``'s step time over
  this one is the overhead of the toolkit's loop (data loading, counting, logging, stop checks);
* ``hf``: ``Trainer`` as users run it by default (``scripts/bench_hf.py``; random sampler, per-batch padding);
* ``hf_grouped``: ``Trainer`` with ``train_sampling_strategy="group_by_length"`` (``group_by_length=True`` of
  transformers 4; ``LengthGroupedSampler``, per rank; unpacked presets only);
* ``hf_ddp``: ``hf_grouped`` under torch's ``DistributedDataParallel`` (gloo on CPU ranks, NCCL on GPUs)
  instead of the DeepSpeed dict: ``Trainer`` without ``deepspeed=``, its other way to use several ranks;
* ``hf_rebalance``: ``Trainer`` with ``train_sampling_strategy="batch_rebalance"`` (new in transformers 5: balances
  padded cost across ranks and accumulation steps of each global batch; unpacked presets only);
* ``finetune[<optimizer>]`` (``--optimizer adamw,muon``, instead of the preset's contenders): ``finetune`` with
  ``train.optimizer=<optimizer>``, one contender per setting: loss after the same steps and time per step side by side.

Presets: ``bert_mlm`` (the issue's BERT MLM set-up), ``gpt_clm`` (packed blocks; HF with ``run_clm.py``'s
``group_texts``), ``seq_cls`` (the shipped SST-2 classifier; HF as ``run_glue.py``: ``DataCollatorWithPadding``) and
``sft`` (the shipped GSM8K prompt/response SFT; ours packs examples into rows, HF trains one padded example per row
with the same answer-only labels), ``dpo`` (the shipped GSM8K DPO; its model spends 96% of its matmul FLOPs in the
LM head), ``dpo_realistic`` (the same DPO on a model whose LM head has a real 0.5B-1B model's share, 28%: a Llama
shape of 6 layers, hidden 256, with the 8,192-token BPE of ``data/models/gsm8k-bpe-8k``) and ``reward`` (the shipped
GSM8K reward model recipe on that shape's body; held-out accuracy of the 200 test pairs after the timed steps;
``reward_prompt_only`` the same on pairs that share only their prompt: each rejected response is the next pair's
chosen one, where the shipped pairs share all but the final answer, the best case of the recipe's prefix sharing).
Preference contenders (``scripts/bench_trl.py``; pairs/s is real tokens/s over the tokens per pair, the same rows on
both sides):

* ``trl``: TRL's ``DPOTrainer`` / ``RewardTrainer`` with its defaults (DPO: a reference model run on every batch;
  gradient checkpointing on, ``DPOConfig``'s and ``RewardConfig``'s default; random order);
* ``trl_best``: TRL with every speed option of TRL 1.16 that applies (``precompute_ref_log_probs=True`` and no
  reference model, gradient checkpointing as ours, length-grouped batches; the module docstring of
  ``scripts/bench_trl.py`` names each option and the ones that do not apply).

``grpo``: the shipped GSM8K GRPO recipe (online RL: each step generates ``num_generations`` completions of each
prompt with HF ``generate``, scores them, trains the clipped policy loss) on the ``dpo_realistic`` shape against
TRL's ``GRPOTrainer`` (``scripts/bench_trl.py``: ``trl`` with ``GRPOConfig``'s defaults, gradient checkpointing
on; ``trl_best`` with its speed options that apply on CPU ranks, named with the ones that do not in that module's
docstring). The same prompts (the first ``--steps`` x global batch GSM8K questions), ``num_generations`` 4,
``max_completion_length`` 64, sampling at temperature 1 (no top-p, top-k), the same reward functions
(``scripts/bench_rewards.py``, loaded by both: format and exact match), loss ``dapo``, ``beta`` 0,
``num_iterations`` 1, the same prompts and completions per step (``train.micro_batch_size`` counts prompts, TRL's
``per_device_train_batch_size`` completions: micro x 4). Its rows are prompts: ``compl/s`` is rows/s x
``num_generations``; real tokens are the trained sequences' prompt + completion tokens (completions up to their EOS;
finetune: the step's ``attention_mask``, TRL: ``prompt_mask`` + ``completion_mask`` of each micro-batch
``compute_loss`` trains); ``mean reward`` is the mean of every step's mean reward (all launches), ``last reward``
that of the last steps (the final-loss window). A step's time includes its generation on both sides.
From random weights almost every reward is 0 on both sides; ``--init-from <folder>`` starts every contender from a
trained model (``model.path=<folder> model.init=pretrained``, its config and tokenizer; TRL's side loads it with
``from_pretrained``; a packed SFT export's ``use_cache: false`` is turned on for TRL's generation, as finetune's
rollout decodes with a cache anyway), e.g. the export of the shipped GSM8K SFT run on this preset's shape, trained
800 steps (after its default 150 the answers do not reach GSM8K's ``####`` marker yet; docs/performance.md)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 finetune/run.py --config finetune/recipes/configs/sft_gsm8k.yaml \
        output_dir=runs/bench_sft_init model.tokenizer_path=data/models/gsm8k-bpe-8k train.max_steps=800 \
        train.eval_every=400 train.save_every=800 "model.config_overrides=<REALISTIC_SHAPE, below>"
    python scripts/bench.py --preset grpo --init-from runs/bench_sft_init/export --lock /tmp/heavy.lock

``grpo_tools``: multi-turn GRPO with tools (issue 53): the ``grpo`` preset's sampling, loss and batch layout on
the shipped guess-the-number environment (``data/environments/guess_number.py``: one instance per rollout, reset with
the row's ``low``, ``high``, ``secret``; its ``guess`` method the only tool; its ``get_reward`` the only reward), the
games of ``data/guess_number/train.parquet`` as chat prompts rendered with ``data/chat_templates/chatml_tools.jinja``
(the tool's schema in a system turn), with the shipped guess-number chain's GRPO budget and learning rate
(``grpo_guess_number.yaml``: ``max_completion_length`` 768, the model's turns and the tool results;
``max_tool_calling_iterations`` 8; lr 5e-5: the ``grpo`` preset's 5e-4 is a learning rate for random weights, and
its first AdamW update can break an SFT model's tool-call format), against TRL's
``GRPOTrainer(environment_factory=...)`` (``scripts/bench_trl.py``: the same template, TRL's Qwen3 response template
with this tokenizer's EOS, the same iterations, budget and learning rate). ``tool calls`` is ``tools/call_frequency``
(tool calls per rollout, mean over the steps) of each side. From random weights no rollout calls the tool; the loop
runs from an SFT export trained on the expert games: the chain's (``sft_guess_number.yaml``, the command in
docs/online-rl.md; docs/performance.md's figures), or one of the preset's shape (positions 1,024: prompt and
completion exceed the shape's 512)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 finetune/run.py --config finetune/recipes/configs/sft_gsm8k_chat.yaml \
        output_dir=runs/bench_guess_sft model.tokenizer_path=data/models/gsm8k-bpe-8k \
        "model.config_overrides=<REALISTIC_SHAPE, max_position_embeddings: 1024>" \
        data.train_files=[data/guess_number/train_chat.parquet] data.validation_files=[] data.tools_column=tools \
        data.chat_template=data/chat_templates/chatml_tools.jinja data.max_seq_len=1024 train.micro_batch_size=2 \
        train.max_steps=120 train.eval_every=0 train.eval_on_start=false train.save_every=120
    python scripts/bench.py --preset grpo_tools --init-from runs/bench_guess_sft/export --lock /tmp/heavy.lock

``grpo_smollm2``: GRPO on a real pretrained model (issue 69), the README's main run
(``grpo_smollm2_arithmetic.yaml``: SmolLM2-135M-Instruct from its GGUF file, LoRA rank 16 on every linear layer, 4
two-digit additions x 8 completions of at most 12 tokens per rank and step, lr 2e-4) against TRL's
``GRPOTrainer(peft_config=LoraConfig(...))`` from the same weights (the file converted once by
``finetune.engine.gguf``; TRL loads that folder), the same conversational prompts (the model's own ChatML template on
both sides), the same reward (``scripts/bench_rewards.py:last_integer_match``, the config's ``exact_match`` on the
last integer). Both sides also evaluate the held-out greedy accuracy over the 200 test questions before the first
step and after the last (not timed; ``held-out 0`` and ``held-out acc``): the gain of the same steps side by side.
Needs the model file (``bash scripts/get_smollm2.sh``); not part of ``--preset all``::

    python scripts/bench.py --preset grpo_smollm2 --steps 10 --skip 2 --rounds 1 --lock /tmp/heavy.lock

``grpo_smollm2_tools``: GRPO with the calculator tool on the real model (``grpo_smollm2_calculator.yaml``, from the
export of ``sft_smollm2_calculator.yaml``: run that first with ``output_dir=runs/sft_smollm2_calculator_for_grpo``)
against TRL's ``GRPOTrainer(tools=[calculate])`` with the same LoRA; completions/s and each side's mean reward and
``tools/call_frequency``::

    python scripts/bench.py --preset grpo_smollm2_tools --steps 6 --skip 2 --rounds 1 --contenders finetune,trl_best

``dpo_smollm2``: DPO on the real model's own sampled pairs (``dpo_smollm2_arithmetic.yaml``: LoRA rank 16 on every
linear layer, sigmoid loss, beta 0.1, 4 conversational pairs per rank and step, lr 5e-5) against TRL's
``DPOTrainer(peft_config=LoraConfig(...))`` from the same weights; both sides' held-out reward accuracy over the
test pairs after the last step (not timed). Needs the model file; not part of ``--preset all``::

    python scripts/bench.py --preset dpo_smollm2 --steps 10 --skip 2 --rounds 1 --lock /tmp/heavy.lock

``vlm_sft``: vision-language SFT (issue 55), the shipped ``vlm_sft_digits.yaml`` (the tiny SmolVLM from scratch, the
32x32 digits, the loss on the answer digit and its end-of-turn token) against TRL's ``SFTTrainer`` with the model's
processor on the same rows (``scripts/bench_trl.py``: ``assistant_only_loss=True``, TRL's vision collator processing
each batch's images); ``rows/s`` is samples/s::

    python scripts/bench.py --preset vlm_sft --steps 30 --rounds 2

``distill``: on-policy knowledge distillation, the shipped ``distill_gsm8k.yaml`` recipe with every row's response
replaced by a completion the student samples (``train.distill.on_policy_fraction`` 1: TRL's ``DistillationTrainer``
is always on-policy), against TRL 1.16's ``DistillationTrainer`` (``scripts/bench_trl.py``: ``trl`` with
``DistillationConfig``'s defaults, gradient checkpointing on; ``trl_best`` without it and with dropout off; that
module's docstring names the options that do not apply). The student is the ``dpo_realistic`` shape from scratch (the
same seeded weights on both sides), the teacher twice its layers and width (:data:`TEACHER_SHAPE`: 12 layers, hidden
512, intermediate 1,536, 8 query / 4 key-value heads; 42M parameters against the student's 6.8M, so the teacher's
forward costs about 6 times the student's per token) on the same 8,192-token BPE, written by the benchmark with
seeded random weights and the tokenizer's files into its output folder (:func:`write_teacher`; ``--teacher
<folder>``: a trained one of the same vocabulary instead; ``--init-from``: the student's weights). The same prompts
(the first ``--steps`` x global batch GSM8K questions, tokenized alike: the text with the tokenizer's special
tokens), 4 prompts per rank, no accumulation, ZeRO-2, one completion of up to 64 tokens per prompt sampled at
temperature 1 (top-p 1, top-k 0), the generalized JSD with ``beta`` 0.5 at temperature 1 and nothing else in the loss
(``alpha`` 1: TRL has no cross-entropy term), AdamW at the same learning rate and schedule. Its ``real tok/s`` are
trained tokens: completion tokens with their EOS (finetune: ``train/completions/mean_length`` x prompts per step;
TRL: the ``completion_mask`` of each micro-batch ``compute_loss`` trains); ``rows/s`` are prompts/s; ``pos/s`` the
trained sequences' positions (prompt + completion, pad included). A step's time includes its generation on both
sides. The summary lines give each side's trained tokens/s, prompts/s, peak MB per rank and final loss, the ratios
finetune / this, and where a step's time goes (finetune: the logged ``time/<phase>_s``; TRL: its timed methods)::

    python scripts/bench.py --preset distill --steps 10 --skip 2 --rounds 2 --lock /tmp/heavy.lock

The preference presets train one epoch: the training rows are those the steps train (``--steps`` x global batch;
``epoch`` in :data:`PRESETS`), so each side's reference pass covers the rows it trains, as in a real one-epoch run.

An untimed warm-up launch comes first (:func:`warm_up`: DeepSpeed's one-time builds of its CPU ops), then the
contenders alternate (``finetune, hf, hf_grouped, finetune, ...``) for ``--rounds`` rounds so drifting machine load
hits all alike. Per contender (all rounds pooled; the first ``--skip`` steps of each launch are warm-up, not timed):

* real tokens/s: non-pad tokens of all ranks over the wall time of the timed steps; positions/s likewise with pad;
  also per round (``real_tokens_per_s_per_round``), to show the noise;
* step time: median and spread (interquartile range) of the per-step wall times;
* rank 0's CPU time per timed step (``time.process_time`` of its process, all threads; median over rounds): the
  work of the contender itself, which a busy or shared machine does not inflate as it does wall time (a rank
  waiting in a gloo collective sleeps, so waiting is not counted);
* time to first step: from starting the launcher (with ``--lock``: from taking the lock) to the end of optimizer step
  1 (imports, data, model, DeepSpeed set-up; the tokenized data are cached after the first round), median over rounds
  (n/a for ``finetune`` with ``--log-every`` above 1: its first logged step is the end of the first window);
* peak memory per rank: the largest ``VmHWM`` (peak resident set) of a launch's rank processes (CPU ranks; sampled
  every 0.2 s from ``/proc``), median over rounds (it moves by +-30 MB between identical launches; each round's
  figure is in ``peak_rss_per_rank_mb_per_round``), or ``torch.cuda.max_memory_allocated`` on GPUs;
* MFU (GPUs of the peak table in ``finetune/logs.py``; n/a on CPUs): ``finetune``'s logged ``train/mfu``, median
  over the timed steps; the other contenders' from their real tokens/s (same model, same FLOPs per real token);
* rows/s: rows of the global batch (pairs for ``dpo`` and ``reward``) per second of the timed steps;
* end to end (``e2e``): real tokens of every step of a launch (warm-up steps included) over the wall time from
  starting the launcher (with ``--lock``: taking the lock) to the end of the last optimizer step, all rounds pooled
  (``e2e s``: that time, mean per launch; ``e2e ours/this``: finetune's end-to-end tokens/s over this contender's).
  It includes start-up, data preparation, and the reference log-probabilities: finetune's reference pass (before the
  first step, over the training and validation pairs; its cached values are removed before each launch) and TRL's
  precomputation (``trl_best``; TRL's datasets cache is per launch, so it tokenizes and precomputes each time);
  finetune's tokenized data are cached across rounds (a few seconds for the first round);
* held-out accuracy (``reward``): the share of the 200 test pairs ranked right after the last step (finetune:
  ``eval/accuracy`` of one evaluation at ``--steps``; TRL: ``trainer.evaluate()``; neither timed; each side keeps
  the pairs that fit ``max_seq_len`` its own way);
* final loss: mean training loss of the last 5 steps, or of the last ``--log-every`` steps (each step taking its
  log window's mean) when that is more (the rows differ between contenders, so compare within noise); ``dpo``:
  also the final reward accuracy (``rewards/accuracies``, train, same window);
* ratio: real tokens/s of ``finetune`` over each other contender's, all rounds pooled (``ours/this``), and the
  median over rounds of the same ratio within each round (``by rounds``: a pair launched back to back shares the
  machine's load of the moment, so a slow round does not skew it); ``bare``: the loop overhead, also printed as
  a percentage of step time (``bare``'s tokens/s over ours, minus 1), pooled and round by round.

``long_context`` (its own flow, not part of ``--preset all``): the longest packed sequence that trains
``--search-steps`` (3) optimizer steps within a per-rank peak-memory budget (``--memory-budget`` MB: the peak
resident set, ``VmHWM``, of each rank process on CPU ranks; with ``--gpu``, the largest rank's
``torch.cuda.max_memory_allocated``, read after the launch), for ``finetune_sp2`` (SP = 2 with gradient checkpointing, activation offload and the tiled MLP; the
chunked head loss is always on), ``finetune_sp1`` (the same levers, data parallel) and ``hf`` (Trainer + DeepSpeed
ZeRO-3 + gradient checkpointing, ``group_texts`` blocks). All: a Llama architecture from config (4 layers, hidden
256, 4 query / 2 key-value heads, 16.8M parameters of which 12.9M are the GPT-2 vocabulary's tied embedding), the
GPT-2 tokenizer, the WikiText-2 test articles concatenated (EOS between them) and cut into blocks of the length
tried, ZeRO-3, micro batch 1. On CPU ranks every contender's search trials run with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed (``--malloc-mmap-threshold``, :data:`LONG_CONTEXT_MMAP_THRESHOLD`), so the peak
resident set is the live tensors' peak, not what the allocator keeps after frees (the timed launches run with each
contender's own allocator settings). Each trial is one launch, killed as soon as a rank's sampled peak exceeds the budget
(a trial that does not fit costs only the time to reach the budget); lengths are doubled from ``--start-length``
until one does not fit, then bisected (multiples of 256) until the bracket is at most 1/``--resolution`` of the
longest fitting length. Every trial's peak per rank is printed (memory against length; MB per 1k tokens between
consecutive lengths). Then, at the common length (the longest that fits every contender), the contenders are
timed side by side (``--steps`` per launch, alternating for ``--rounds``) at the same global batch of 2 rows (SP = 2
accumulates 2 micro-batches): tokens/s, each over ``hf``'s, and the final loss.

Every preset first prints its model's LM-head share of the matmul FLOPs per position (:func:`lm_head_share`: head
``2 h V`` over head + ``2 x`` the layers' matmul weights + attention's ``4 L s d_attn``).

Prints a table and one JSON line per contender (``{"bench": preset, "contender": ..., ...}``). Needs the
``bench`` extra (``pip install -e .[bench]``: accelerate, which HF Trainer requires, and trl); the package never
imports them.

Usage (from the repository root; CPU ranks unless ``--gpu``)::

    python scripts/bench.py                                   # bert_mlm, 2 ranks, 40 steps, 2 rounds
    python scripts/bench.py --preset gpt_clm --steps 60 --rounds 3
    python scripts/bench.py --preset all                      # every preset, one after the other
    python scripts/bench.py --preset dpo_realistic --lock /tmp/heavy.lock   # finetune vs TRL (defaults and best)
    python scripts/bench.py --preset bert_mlm --steps 3 --rounds 1 --nproc 1 --tiny   # a smoke run (tests)
    python scripts/bench.py --preset grpo --steps 8 --rounds 2 --lock /tmp/heavy.lock   # finetune vs GRPOTrainer
    python scripts/bench.py --preset grpo --steps 3 --skip 1 --rounds 1 --tiny --no-warm-up   # its smoke run
    python scripts/bench.py --preset grpo_tools --init-from runs/bench_guess_sft/export   # multi-turn, tools
    python scripts/bench.py --preset distill --steps 10 --skip 2 --rounds 2 --lock /tmp/heavy.lock  # vs TRL
    python scripts/bench.py --gpu --nproc 1 --preset gpt2_medium_clm     # one GPU, bf16 (also bert_large_mlm)
    python scripts/bench.py --preset gpt_clm --optimizer adamw,muon   # finetune[adamw] vs finetune[muon]
    python scripts/bench.py --preset long_context             # longest sequence per contender in 1280 MB per rank
    python scripts/bench.py --preset long_context --lock /tmp/heavy.lock   # each launch holds a flock(1) file

From a fresh clone (CPU ranks)::

    python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[bench]" \
        && python scripts/bench.py --preset long_context
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REALISTIC_SHAPE = ("{num_hidden_layers: 6, hidden_size: 256, intermediate_size: 768, num_attention_heads: 4, "
                   "num_key_value_heads: 2, head_dim: 64, vocab_size: 8192, pad_token_id: 0, bos_token_id: 0, "
                   "eos_token_id: 0}")
"""The ``dpo_realistic`` and ``reward`` presets' model: ``data/models/tiny-llama``'s config with these overrides and
the tokenizer of ``data/models/gsm8k-bpe-8k`` (its ``<|endoftext|>``, id 0, is BOS, EOS and pad)."""
REALISTIC_TINY = ("{num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4, "
                  "num_key_value_heads: 2, head_dim: 16, vocab_size: 8192, pad_token_id: 0, bos_token_id: 0, "
                  "eos_token_id: 0}")

TEACHER_SHAPE = ("{num_hidden_layers: 12, hidden_size: 512, intermediate_size: 1536, num_attention_heads: 8, "
                 "num_key_value_heads: 4, head_dim: 64, vocab_size: 8192, pad_token_id: 0, bos_token_id: 0, "
                 "eos_token_id: 0}")
"""The ``distill`` preset's teacher: :data:`REALISTIC_SHAPE` with twice its layers, hidden size, intermediate size
and heads (42M parameters, 4.2M of them the tied embedding), on the same vocabulary."""
TEACHER_TINY = ("{num_hidden_layers: 2, hidden_size: 128, intermediate_size: 256, num_attention_heads: 4, "
                "num_key_value_heads: 2, head_dim: 32, vocab_size: 8192, pad_token_id: 0, bos_token_id: 0, "
                "eos_token_id: 0}")
"""The teacher of ``--tiny`` runs of the ``distill`` preset (twice :data:`REALISTIC_TINY`)."""

LLAMA_1B = ("{hidden_size: 2048, intermediate_size: 8192, num_hidden_layers: 16, num_attention_heads: 32, "
            "num_key_value_heads: 8, head_dim: 64, vocab_size: 128256, tie_word_embeddings: true, "
            "rope_parameters: {rope_type: default, rope_theta: 500000.0}, rms_norm_eps: 1.0e-5, "
            "max_position_embeddings: 1048576}")
"""Llama-3.2-1B's shape (its ``config.json``; 1.24 B parameters, the embedding tied to the head) as run-config
overrides of ``data/models/tiny-llama``: random weights, no download (the ``llama1b`` preset, scripts/gpu_check.py)."""
LLAMA_TINY = ("{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 4, "
              "num_key_value_heads: 2, head_dim: 16, vocab_size: 50257, tie_word_embeddings: true, "
              "max_position_embeddings: 4096}")
"""The dry runs' stand-in for :data:`LLAMA_1B` (the GPT-2 tokenizer's ids fit its vocabulary)."""

PRESETS: dict[str, dict] = {
    # The issue's set-up: BERT 4 layers, hidden 256, WikiText-2 rows of up to 256 tokens, micro batch 8, ZeRO-2.
    "bert_mlm": {"config": "finetune/recipes/configs/bert_mlm_wikitext2.yaml",
                 "overrides": ["model.config_overrides={num_hidden_layers: 4, hidden_size: 256, "
                               "intermediate_size: 1024, num_attention_heads: 4}", "data.max_seq_len=256",
                               "train.micro_batch_size=8", "train.gradient_accumulation_steps=1",
                               "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2"],
                 "contenders": ["finetune", "bare", "hf", "hf_grouped", "hf_rebalance"],
                 "tiny": ["model.config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
                          "num_attention_heads: 2}", "data.max_seq_len=64", "train.micro_batch_size=4"]},
    # Packed causal LM: the byte-level GPT-2 of data/models/gpt2-bytes as shipped (2 layers, hidden 128; the default
    # run config sets a size of its own), 128-token blocks; HF with group_texts.
    "gpt_clm": {"config": "finetune/recipes/configs/gpt_clm_wikitext2.yaml",
                "overrides": ["model.config_overrides={}", "train.micro_batch_size=16",
                              "train.gradient_accumulation_steps=1", "deepspeed=ds_configs/zero2.json",
                              "train.warmup_steps=2"],
                "contenders": ["finetune", "bare", "hf"],
                "tiny": ["model.config_overrides={n_layer: 1, n_embd: 64, n_inner: 128, n_head: 2}",
                         "data.max_seq_len=64", "train.micro_batch_size=4"]},
    # The shipped SST-2 classifier (BERT 2 layers, hidden 128, from scratch), sentences of up to 64 tokens.
    "seq_cls": {"config": "finetune/recipes/configs/seq_cls_sst2.yaml",
                "overrides": ["train.micro_batch_size=16", "train.gradient_accumulation_steps=1",
                              "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2"],
                "contenders": ["finetune", "bare", "hf", "hf_grouped"],
                "tiny": ["train.micro_batch_size=4"]},
    # NER on the real all-MiniLM-L6-v2 (issue 71): token_cls_wnut17.yaml (WNUT-17, micro 16 sentences per rank) against
    # HF Trainer with run_ner.py's tokenization, alignment and DataCollatorForTokenClassification (``hf_grouped``:
    # length-grouped) from the same weights; ``heldout``: the entity F1 (seqeval) of the 500 held-out sentences after
    # the last step (ours: eval/f1; HF: run_ner.py's compute_metrics on trainer.predict; neither timed). ``real``:
    # the weights come from ../shared/models/all-minilm-l6-v2 (or model.path=...), so not part of ``--preset all``.
    "token_cls": {"config": "finetune/recipes/configs/token_cls_wnut17.yaml", "heldout": True, "real": True,
                  "heldout_key": "eval/f1", "overrides": ["deepspeed=ds_configs/zero0.json"],
                  "contenders": ["finetune", "hf", "hf_grouped", "hf_ddp"], "tiny": []},
    # Question answering on the real all-MiniLM-L6-v2 (issue 71): qa_squad.yaml (SQuAD-form questions, micro 16
    # questions per rank) against HF Trainer with run_qa.py's windows and labels and DataCollatorWithPadding
    # (``hf_grouped``: length-grouped) from the same weights; ``heldout``: the SQuAD F1 of the 96 held-out questions
    # after the last step (ours: eval/f1; HF: run_qa.py's post-processing on trainer.predict; neither timed).
    "qa": {"config": "finetune/recipes/configs/qa_squad.yaml", "heldout": True, "real": True,
           "heldout_key": "eval/f1", "overrides": ["deepspeed=ds_configs/zero0.json"],
           "contenders": ["finetune", "hf", "hf_grouped", "hf_ddp"], "tiny": []},
    # Sentence embeddings on the real all-MiniLM-L6-v2 (issue 71): embed_stsb.yaml (STS-B pairs, micro 32 pairs per
    # rank, each anchor against every positive of both ranks) against sentence-transformers' SentenceTransformerTrainer
    # with MultipleNegativesRankingLoss from the same folder (``st``: its defaults, each rank's own negatives; ``st_gather``:
    # gather_across_devices, the same negatives as ours); ``heldout``: retrieval NDCG@10 on the STS-B dev pairs after
    # the last step (both scored by finetune.recipes.embed.retrieval; not timed).
    "embed": {"config": "finetune/recipes/configs/embed_stsb.yaml", "heldout": True, "real": True,
              "heldout_key": "eval/ndcg_at_10", "overrides": ["deepspeed=ds_configs/zero0.json"],
              "contenders": ["finetune", "st", "st_gather"], "tiny": []},
    # The same from the same folder on question-to-passage retrieval: embed_squad.yaml (SQuAD questions, each to the
    # paragraph that answers it; micro 32 pairs per rank, paragraphs up to 256 tokens); ``heldout``: NDCG@10 of the 96
    # held-out questions among their article's 39 paragraphs after the last step. A paragraph answers 5 questions on
    # average, so a batch holds copies of a positive: finetune leaves them out of the softmax (train.embed.
    # mask_duplicates); ``st_nodup`` draws batches without them (BatchSamplers.NO_DUPLICATES), the others keep them.
    "embed_squad": {"config": "finetune/recipes/configs/embed_squad.yaml", "heldout": True, "real": True,
                    "heldout_key": "eval/ndcg_at_10", "overrides": [],
                    "contenders": ["finetune", "st", "st_gather", "st_nodup"], "tiny": []},
    # The shipped GSM8K SFT (Llama 2 layers, hidden 64): ours best-fit packs examples into 256-token rows; HF Trainer
    # trains one example per row, padded per batch (answer-only labels in both).
    "sft": {"config": "finetune/recipes/configs/sft_gsm8k.yaml",
            "overrides": ["train.micro_batch_size=4", "train.gradient_accumulation_steps=1",
                          "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2"],
            "contenders": ["finetune", "bare", "hf", "hf_grouped"],
            # 384 tokens: no pair of the file's first 32 is cut, so none is dropped as identical after truncation
            # and finetune's first pairs are TRL's (reference_agreement compares them by position)
            "tiny": ["data.max_seq_len=384", "train.micro_batch_size=2"]},
    # The shipped GSM8K DPO (Llama 2 layers, hidden 64, pairs up to 256 tokens), sigmoid loss, beta 0.1: ours (reference
    # log-probabilities computed once before training) vs TRL's DPOTrainer with its defaults (``trl``: reference
    # forward in every step, gradient checkpointing) and at its best (``trl_best``: precomputed reference, no
    # checkpointing, length grouping). ``epoch``: one epoch, the training rows are the rows the steps train (both
    # reference passes cover them). 97% of this model's matmul FLOPs are in its LM head (50,257 tokens, hidden 64).
    "dpo": {"config": "finetune/recipes/configs/dpo_gsm8k.yaml", "epoch": True,
            "overrides": ["train.micro_batch_size=4", "train.gradient_accumulation_steps=1",
                          "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2"],
            "contenders": ["finetune", "trl", "trl_best"],
            # 384 tokens: no pair of the file's first 32 is cut, so none is dropped as identical after truncation
            # and finetune's first pairs are TRL's (reference_agreement compares them by position)
            "tiny": ["data.max_seq_len=384", "train.micro_batch_size=2"]},
    # The same DPO on a model whose LM head has a real model's share of the matmul FLOPs (Qwen2.5-0.5B: 29%): a Llama
    # shape of 6 layers, hidden 256, intermediate 768, 4 query / 2 key-value heads, with the 8,192-token BPE of
    # data/models/gsm8k-bpe-8k (scripts/make_bpe_tokenizer.py; GPT-2's 50,257 tokens would need a model too large
    # for CPU ranks): 28% at 256 tokens (lm_head_share). The docs' headline is finetune over trl_best here.
    "dpo_realistic": {"config": "finetune/recipes/configs/dpo_gsm8k.yaml", "epoch": True,
                      "overrides": [f"model.config_overrides={REALISTIC_SHAPE}",
                                    "model.tokenizer_path=data/models/gsm8k-bpe-8k", "train.micro_batch_size=4",
                                    "train.gradient_accumulation_steps=1", "deepspeed=ds_configs/zero2.json",
                                    "train.warmup_steps=2", "train.lr=1e-3"],
                      "contenders": ["finetune", "trl", "trl_best"],
                      "tiny": [f"model.config_overrides={REALISTIC_TINY}", "data.max_seq_len=384",
                               "train.micro_batch_size=2"]},
    # The shipped GSM8K reward model recipe on the realistic shape's body (a one-output score head: no LM head)
    # against TRL's RewardTrainer, defaults (gradient checkpointing, random order) and best (no checkpointing,
    # length grouping); the held-out accuracy of the 200 test pairs after the timed steps (``heldout``).
    "reward": {"config": "finetune/recipes/configs/reward_gsm8k.yaml", "epoch": True, "heldout": True,
               "overrides": [f"model.config_overrides={{num_labels: 1, {REALISTIC_SHAPE[1:-1]}}}",
                             "model.tokenizer_path=data/models/gsm8k-bpe-8k", "train.micro_batch_size=4",
                             "train.gradient_accumulation_steps=1", "deepspeed=ds_configs/zero2.json",
                             "train.warmup_steps=2", "train.lr=1e-3"],
               "contenders": ["finetune", "trl", "trl_best"],
               "tiny": [f"model.config_overrides={{num_labels: 1, {REALISTIC_TINY[1:-1]}}}",
                        "data.max_seq_len=384", "train.micro_batch_size=2"]},
    # The same on pairs that share only their prompt (each rejected response is the next pair's chosen one,
    # prompt_only_pairs), as real preference data (a conversation, two answers) mostly do: the shipped GSM8K pairs
    # share all but the final answer, the best case of the reward recipe's prefix sharing.
    "reward_prompt_only": {"config": "finetune/recipes/configs/reward_gsm8k.yaml", "epoch": True, "heldout": True,
                           "prompt_only": True, "overrides": [], "contenders": ["finetune", "trl", "trl_best"],
                           "tiny": []},
    # Online RL: the shipped GSM8K GRPO recipe on the realistic shape, from scratch (the shipped config starts from
    # an SFT export of another model; random init from the seed here, as TRL's side builds it: both sides' rewards
    # stay near 0, the comparison is of the work per step) against TRL's GRPOTrainer, defaults and best. Per step
    # and rank: 2 prompts x 4 completions of at most 64 tokens (sampling at temperature 1, no top-p / top-k), scored
    # by the same two functions (scripts/bench_rewards.py: format and exact match), the dapo loss, beta 0 (no
    # reference), one optimizer step per generation batch. Prompts up to 256 tokens (GSM8K's longest training
    # question has 189 with this BPE): none is cut, as TRL cuts none. ``epoch``: both sides draw from the same first
    # prompts.
    "grpo": {"config": "finetune/recipes/configs/grpo_gsm8k.yaml", "epoch": True, "grpo": True,
             "overrides": ["model.path=data/models/tiny-llama", "model.init=scratch",
                           f"model.config_overrides={REALISTIC_SHAPE}", "model.tokenizer_path=data/models/gsm8k-bpe-8k",
                           "data.max_seq_len=256", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
                           "deepspeed=ds_configs/zero2.json", "train.warmup_steps=0", "train.lr=1e-3",
                           "train.grpo.num_generations=4", "train.grpo.max_completion_length=64",
                           "train.grpo.temperature=1.0", "train.grpo.top_p=1.0", "train.grpo.top_k=0",
                           "train.grpo.loss_type=dapo", "train.grpo.beta=0", "train.grpo.num_iterations=1",
                           "train.grpo.rewards=[scripts/bench_rewards.py:format_reward, "
                           "scripts/bench_rewards.py:exact_match]"],
             "contenders": ["finetune", "trl", "trl_best"],
             "tiny": [f"model.config_overrides={REALISTIC_TINY}", "train.grpo.max_completion_length=16"]},
    # Multi-turn online RL with tools (issue 53): the grpo preset's shape and settings on the shipped guess-the-number
    # environment (data/environments/guess_number.py: one instance per rollout, its guess method the tool, its
    # get_reward the only reward), the games of data/guess_number/train.parquet as chat prompts rendered with
    # data/chat_templates/chatml_tools.jinja (the tool's schema in a system turn: about 425 prompt tokens with this
    # BPE), against TRL's GRPOTrainer(environment_factory=...) with the same template, iterations and completion budget
    # (tool results included), and the chain's GRPO budget and learning rate (grpo_guess_number.yaml). From random
    # weights no rollout calls the tool; --init-from an SFT export trained on the expert games
    # (data/guess_number/train_chat.parquet; the module docstring) makes the loop run (tools/call_frequency per
    # contender).
    # Vision-language SFT (issue 55): the shipped vlm_sft_digits.yaml (the tiny SmolVLM of data/models/tiny-smolvlm
    # from scratch, the 32x32 digits of data/digits, the loss on the answer) against TRL's SFTTrainer on the same rows
    # (TRL's conversational vision form), model, processor, batch and ZeRO stage (scripts/bench_trl.py).
    "vlm_sft": {"config": "finetune/recipes/configs/vlm_sft_digits.yaml", "overrides": [],
                "contenders": ["finetune", "trl", "trl_best"], "tiny": ["train.micro_batch_size=4"]},
    "grpo_tools": {"config": "finetune/recipes/configs/grpo_gsm8k.yaml", "epoch": True, "grpo": True, "tools": True,
                   "overrides": ["model.path=data/models/tiny-llama", "model.init=scratch",
                                 f"model.config_overrides={{{REALISTIC_SHAPE[1:-1]}, max_position_embeddings: 1024}}",
                                 "model.tokenizer_path=data/models/gsm8k-bpe-8k",
                                 "data.train_files=[data/guess_number/train.parquet]",
                                 "data.validation_files=[data/guess_number/test.parquet]",
                                 "data.prompt_column=prompt", "data.reward_columns=[low, high, secret]",
                                 "data.chat_template=data/chat_templates/chatml_tools.jinja",
                                 "data.max_seq_len=512", "train.micro_batch_size=2",
                                 "train.gradient_accumulation_steps=1", "deepspeed=ds_configs/zero2.json",
                                 "train.warmup_steps=0", "train.lr=5e-5", "train.grpo.num_generations=4",
                                 "train.grpo.max_completion_length=768", "train.grpo.temperature=1.0",
                                 "train.grpo.top_p=1.0", "train.grpo.top_k=0", "train.grpo.loss_type=dapo",
                                 "train.grpo.beta=0", "train.grpo.num_iterations=1", "train.grpo.rewards=[]",
                                 "train.grpo.environment=data/environments/guess_number.py:GuessNumber",
                                 "train.grpo.max_tool_calling_iterations=8"],
                   "contenders": ["finetune", "trl", "trl_best"],
                   "tiny": [f"model.config_overrides={REALISTIC_TINY}", "train.grpo.max_completion_length=24",
                            "train.grpo.max_tool_calling_iterations=1"]},
    # GRPO on the real SmolLM2-135M-Instruct (issue 69): the README's main run (grpo_smollm2_arithmetic.yaml: LoRA
    # rank 16 on every linear layer, 4 prompts x 8 completions of at most 12 tokens per rank and step, two-digit
    # additions as one user message each, rendered by the model's own ChatML template) against TRL's
    # GRPOTrainer(peft_config=LoraConfig(...)) from the same weights (the GGUF file converted once by
    # finetune.engine.gguf; TRL loads that folder), the same conversational prompts and the same reward
    # (scripts/bench_rewards.py:last_integer_match: the config's exact_match on the last integer). ``heldout``: the
    # greedy accuracy over the 200 test questions before the first step and after the last, on both sides (not
    # timed). ``real``: needs the model file (scripts/get_smollm2.sh), so not part of ``--preset all``.
    "grpo_smollm2": {"config": "finetune/recipes/configs/grpo_smollm2_arithmetic.yaml", "epoch": True, "grpo": True,
                     "heldout": True, "real": True,
                     "overrides": ["train.grpo.rewards=[scripts/bench_rewards.py:last_integer_match]"],
                     "contenders": ["finetune", "trl", "trl_best"], "tiny": []},
    # GRPO with a tool on the real SmolLM2-135M-Instruct (issue 69): grpo_smollm2_calculator.yaml (the SFT export of
    # sft_smollm2_calculator.yaml, LoRA rank 16, 4 prompts x 8 rollouts of at most 96 tokens per rank and step,
    # data/tools/calculator.py:calculate offered through data/chat_templates/chatml_tools.jinja) against TRL's
    # GRPOTrainer(tools=[calculate], peft_config=LoraConfig(...)) from the same export, the same prompts, reward
    # (last_integer_match) and tool budget. No ``heldout``: TRL's greedy evaluator here runs no tool turns, so both
    # sides' training reward and tools/call_frequency are the figures of the gain. ``real``: needs the export.
    "grpo_smollm2_tools": {"config": "finetune/recipes/configs/grpo_smollm2_calculator.yaml", "epoch": True,
                           "grpo": True, "tools": True, "real": True,
                           "overrides": ["train.grpo.rewards=[scripts/bench_rewards.py:last_integer_match]"],
                           "contenders": ["finetune", "trl", "trl_best"], "tiny": []},
    # SFT of the real SmolLM2-135M-Instruct on GSM8K chat (issue 69): sft_smollm2_gsm8k.yaml (LoRA rank 16 on every
    # linear layer, the model's own ChatML template, answer-only loss, packed rows of 384 tokens, 2 per rank) against
    # HF Trainer + peft (one conversation per row, padded; ``hf_grouped``: length-grouped) and TRL's SFTTrainer
    # (prompt-completion rows, completion-only loss; ``trl_best``: packed, padding-free) from the same weights.
    # ``heldout``: the held-out loss over the 200 test conversations after the last step (finetune and TRL; not
    # timed), the generated answers off. ``real``: needs the model file.
    "sft_smollm2": {"config": "finetune/recipes/configs/sft_smollm2_gsm8k.yaml", "heldout": True, "real": True,
                    "overrides": ["train.eval_generate.prompts=0"],
                    "contenders": ["finetune", "hf_grouped", "trl", "trl_best"], "tiny": []},
    # DPO on the real SmolLM2-135M-Instruct's own sampled pairs (issue 69; dpo_smollm2_arithmetic.yaml: LoRA rank 16 on
    # every linear layer, sigmoid loss, beta 0.1, conversational pairs rendered by the model's own ChatML template)
    # against TRL's DPOTrainer(peft_config=LoraConfig(...)) from the same weights (its reference: the base model with
    # the adapters off, as ours; trl_best precomputes it before training, as ours; trl, its default, forwards it in
    # every step). ``heldout``: the held-out reward accuracy over the test
    # pairs after the last step, on both sides (not timed). ``real``: needs the model file.
    "dpo_smollm2": {"config": "finetune/recipes/configs/dpo_smollm2_arithmetic.yaml", "epoch": True, "dpo": True,
                    "heldout": True, "real": True, "overrides": [], "contenders": ["finetune", "trl", "trl_best"],
                    "tiny": []},
    # On-policy distillation: the shipped distill recipe with every row's response sampled by the student (TRL's
    # DistillationTrainer is always on-policy), the realistic shape from scratch as the student, a teacher of twice
    # its layers and width (TEACHER_SHAPE; written by main with seeded random weights, or --teacher), 4 prompts per
    # rank, one completion of at most 64 tokens each (temperature 1, no top-p / top-k), the generalized JSD with
    # beta 0.5 at temperature 1, alpha 1 (no cross-entropy: TRL has none), against TRL's DistillationTrainer,
    # defaults and best. ``epoch``: both sides train the same first prompts.
    "distill": {"config": "finetune/recipes/configs/distill_gsm8k.yaml", "epoch": True, "distill": True,
                "overrides": ["model.path=data/models/tiny-llama", "model.init=scratch",
                              f"model.config_overrides={REALISTIC_SHAPE}",
                              "model.tokenizer_path=data/models/gsm8k-bpe-8k", "data.packing=false",
                              "data.max_seq_len=256", "train.micro_batch_size=4",
                              "train.gradient_accumulation_steps=1", "deepspeed=ds_configs/zero2.json",
                              "train.warmup_steps=0", "train.lr=1e-4", "train.lr_scheduler=constant",
                              "train.distill.loss=jsd", "train.distill.beta=0.5", "train.distill.temperature=1.0",
                              "train.distill.alpha=1.0", "train.distill.on_policy_fraction=1",
                              "train.distill.max_completion_length=64", "train.distill.top_p=1.0",
                              "train.distill.top_k=0"],
                "contenders": ["finetune", "trl", "trl_best"],
                "tiny": [f"model.config_overrides={REALISTIC_TINY}", "train.micro_batch_size=2",
                         "train.distill.max_completion_length=16"]},
    # GPU presets (--gpu; bf16): the issue's BERT-large-size MLM and GPT-2-medium-size CLM, random init from the
    # shipped architecture configs. Too slow for CPU ranks: --preset all runs them only with --gpu.
    "bert_large_mlm": {"config": "finetune/recipes/configs/bert_mlm_wikitext2.yaml", "gpu": True,
                       "overrides": ["model.path=data/models/bert-large-config", "data.max_seq_len=512",
                                     "train.micro_batch_size=32", "train.gradient_accumulation_steps=1",
                                     "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2", "train.lr=1e-4"],
                       "contenders": ["finetune", "bare", "hf", "hf_grouped"],
                       "tiny": ["model.config_overrides={num_hidden_layers: 2, hidden_size: 64, "
                                "intermediate_size: 128, num_attention_heads: 2}", "data.max_seq_len=64",
                                "train.micro_batch_size=4"]},
    "gpt2_medium_clm": {"config": "finetune/recipes/configs/gpt_clm_wikitext2.yaml", "gpu": True,
                        "overrides": ["model.path=data/models/gpt2-medium-config", "model.config_overrides={}",
                                      "data.max_seq_len=1024",
                                      "model.tokenizer_path=data/models/gpt2-bytes",  # byte ids, < its vocab
                                      "train.micro_batch_size=16", "train.gradient_accumulation_steps=1",
                                      "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2", "train.lr=1e-4"],
                        "contenders": ["finetune", "bare", "hf"],
                        "tiny": ["model.config_overrides={n_layer: 1, n_embd: 64, n_inner: 128, n_head: 2}",
                                 "data.max_seq_len=64", "train.micro_batch_size=4"]},
    # scripts/gpu_check.sh's throughput and MFU (--gpu --nproc 1): a Llama-3.2-1B shape from config (random weights;
    # scripts/gpu_check.py LLAMA_1B), bf16, WikiText-2 packed into 4,096-token rows, 2 rows x 2 accumulated per step,
    # ZeRO-2, the GPT-2 tokenizer (its ids fit the 128,256-token vocabulary); HF with run_clm.py's group_texts.
    "llama1b": {"config": "finetune/recipes/configs/gpt_clm_wikitext2.yaml", "gpu": True,
                "overrides": ["model.path=data/models/tiny-llama", "model.tokenizer_path=data/models/tiny-gpt2",
                              "model.init=scratch", f"model.config_overrides={LLAMA_1B}", "data.max_seq_len=4096",
                              "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
                              "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2", "train.lr=1e-4"],
                "contenders": ["finetune", "hf"],
                "tiny": [f"model.config_overrides={LLAMA_TINY}", "data.max_seq_len=128", "train.micro_batch_size=2"]},
    # Pipeline parallelism (issue 72): two stages against ZeRO-3 on the same model, global batch and steps. A Llama
    # architecture from config (8 layers, hidden 256, GQA), WikiText-2 packed into 256-token rows, micro batch 4 and 32
    # rows a step on 2 ranks: the pipeline (one data-parallel rank) accumulates 8 micro batches, ZeRO-3 (two) 4. The
    # bubble measured on every step (train/pipeline_idle) is printed against (P - 1) / (m + P - 1).
    "pipeline": {"config": "finetune/recipes/configs/gpt_clm_wikitext2.yaml", "pipeline": True,
                 "overrides": ["model.path=data/models/tiny-llama", "model.tokenizer_path=data/models/tiny-gpt2",
                               "model.init=scratch", "model.config_overrides={num_hidden_layers: 8, hidden_size: 256, "
                               "intermediate_size: 1024, num_attention_heads: 4, num_key_value_heads: 2, "
                               "head_dim: 64}", "data.max_seq_len=256", "train.micro_batch_size=4",
                               "deepspeed=ds_configs/zero2.json", "train.warmup_steps=2", "train.lr=1e-3"],
                 "contenders": {"finetune_p2": ["parallel.pipeline_parallel_size=2", "ds.zero_optimization.stage=0",
                                                "train.gradient_accumulation_steps=8"],
                                "finetune_z3": ["ds.zero_optimization.stage=3", "train.gradient_accumulation_steps=4"]},
                 "tiny": ["model.config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
                          "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}", "data.max_seq_len=64"]},
    # The longest packed sequence that trains within a per-rank memory budget (its own flow: long_context()). A
    # Llama architecture from config (GQA: 4 query / 2 key-value heads), GPT-2 tokenizer, WikiText-2 test articles
    # packed into blocks of the length tried, ZeRO-3, micro batch 1, one validation batch at the end (finetune).
    "long_context": {"config": "finetune/recipes/configs/gpt_clm_wikitext2.yaml", "search": True,
                     "overrides": ["model.path=data/models/tiny-llama", "model.tokenizer_path=data/models/tiny-gpt2",
                                   "model.config_overrides={num_hidden_layers: 4, hidden_size: 256, "
                                   "intermediate_size: 1024, num_attention_heads: 4, num_key_value_heads: 2, "
                                   "head_dim: 64, max_position_embeddings: 131072}",
                                   "deepspeed=ds_configs/zero3.json", "train.micro_batch_size=1",
                                   "train.gradient_accumulation_steps=1", "train.warmup_steps=1", "train.lr=1e-3",
                                   "train.eval_max_batches=1", "model.gradient_checkpointing=true"],
                     # contender -> its own overrides; "hf" is Trainer + ZeRO-3 + gradient checkpointing
                     "contenders": {"finetune_sp2": ["parallel.sequence_parallel_size=2", "parallel.tiled_mlp=true",
                                                     "model.offload_activations=true"],
                                    "finetune_sp1": ["parallel.sequence_parallel_size=1", "parallel.tiled_mlp=true",
                                                     "model.offload_activations=true"],
                                    "hf": []},
                     "tiny": ["model.config_overrides={num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, "
                              "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
                              "max_position_embeddings: 4096}"]},
}
"""Per preset: base run config, overrides, contenders, ``tiny`` overrides (``--tiny``: a smoke run, for tests), and
``gpu`` (presets sized for a GPU: ``--preset all`` includes them only with ``--gpu``); ``search``: the
``long_context`` flow (:func:`long_context`; not part of ``--preset all``); ``real``: a real model's file the
repository does not ship (not part of ``--preset all``); ``heldout``: the held-out metric after the last step (grpo:
also before the first)."""
PRESETS["reward_prompt_only"].update(overrides=PRESETS["reward"]["overrides"], tiny=PRESETS["reward"]["tiny"])


LONG_CONTEXT_BUDGET_MB = 1280
"""Default ``--memory-budget`` of the ``long_context`` preset (MB per rank). With the allocator's retention out of
the figure (:data:`LONG_CONTEXT_MMAP_THRESHOLD`), most of this is what a rank holds at any length (the runtime,
the ZeRO-3 partitions, the head loss's chunk); the rest already takes SP = 2 to lengths whose 3 steps take minutes
on CPU ranks (attention's time is quadratic in the length). Figures: docs/performance.md."""

LONG_CONTEXT_MMAP_THRESHOLD = 65536
"""Default ``--malloc-mmap-threshold`` (bytes): the ``long_context`` search trials on CPU ranks run every contender
with glibc's ``MALLOC_MMAP_THRESHOLD_`` at this size. glibc's default threshold starts at 128 KiB and rises to the
size of each large block freed (up to 32 MiB), after which blocks of that size come from the heap and stay resident
after they are freed; the peak resident set then counts memory no tensor holds, differently from launch to launch.
A fixed threshold maps every block above it on its own and unmaps it when freed, so a rank's peak resident set is
its live tensors' peak plus the runtime, the CPU counterpart of ``torch.cuda.max_memory_allocated``."""


def environment(gpu: bool) -> dict:
    env = dict(os.environ)
    env.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    if not gpu:
        env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    return env


def free_port() -> int:
    """A master port below the ephemeral range (``finetune.parallel.distributed.free_port``: the kernel's pick can
    go to another process's outgoing connection before the master listens)."""
    from finetune.parallel.distributed import free_port as pick

    return pick()


class PeakRSS(threading.Thread):
    """Largest ``VmHWM`` (kB) of each rank process (a descendant with ``--local_rank`` in its command line), or with
    ``every_process`` of the root and each of its descendants; ``anon``: the largest ``RssAnon`` sampled (kB), the
    part of the resident set that is the process's own memory, without the file pages (a memory-mapped dataset's
    pages that were read) the kernel can drop at any time."""

    def __init__(self, root_pid: int, every_process: bool = False, budget_kb: int | None = None):
        super().__init__(daemon=True)
        self.root, self.peaks, self.anon, self.done = root_pid, {}, {}, threading.Event()
        self.every = every_process
        self.budget, self.over = budget_kb, False  # budget: kill the root's process group once a peak exceeds it
        self.first_child: float | None = None  # when the root was first seen with a child (flock: the lock taken)

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                kids = psutil.Process(self.root).children(recursive=True)
                if kids and self.first_child is None:
                    self.first_child = time.time()
                kids += [psutil.Process(self.root)] if self.every else []
            except psutil.Error:
                kids = []
            for kid in kids:
                try:
                    if not self.every and not any(a.startswith("--local_rank") for a in kid.cmdline()):
                        continue
                    status = Path(f"/proc/{kid.pid}/status").read_text()
                except (OSError, psutil.Error):
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peaks[kid.pid] = max(self.peaks.get(kid.pid, 0), int(line.split()[1]))
                    elif line.startswith("RssAnon:"):
                        self.anon[kid.pid] = max(self.anon.get(kid.pid, 0), int(line.split()[1]))
            if self.budget and not self.over and max(self.peaks.values(), default=0) > self.budget:
                self.over = True  # fail fast: the launch (its own session) and every rank in it
                try:
                    os.killpg(self.root, 9)
                except OSError:
                    pass
            self.done.wait(0.2)


LAUNCH_PORTS: set[int] = set()  # the master ports deepspeed_cmd gave out (clean_shm removes their buffers only)


def deepspeed_cmd(args, script: str, *script_args: str) -> list[str]:
    """``deepspeed --num_gpus <nproc> --master_port <free port> <script> <script_args...>`` (this venv's launcher),
    under ``flock <--lock>`` when given (the lock held for this launch only)."""
    lock = ["flock", args.lock] if getattr(args, "lock", "") else []
    runner = Path(sys.executable).parent / "deepspeed"  # elsewhere (pip install --target): the same runner's module
    launcher = [str(runner)] if runner.is_file() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    port = free_port()
    LAUNCH_PORTS.add(port)
    return [*lock, *launcher, "--num_gpus", str(args.nproc), "--master_port", str(port), script, *script_args]


class OverBudget(RuntimeError):
    """A launch killed because a rank's peak resident set exceeded the memory budget (``run_launch(budget_kb=)``)."""

    def __init__(self, peaks: dict[int, int]):
        super().__init__(f"a rank's peak resident set exceeded the budget: {peaks}")
        self.peaks = peaks


def run_launch(cmd: list[str], env: dict, log: Path, timeout: float,
               anon: dict | None = None, budget_kb: int | None = None) -> tuple[float, dict[int, int]]:
    """Run ``cmd`` (a ``deepspeed`` launch) to completion; returns (start time, peak VmHWM kB per rank pid). The start
    is when the command is started, or under ``flock`` (``--lock``) when the lock is taken (flock starts the launcher
    as its child then; sampled every 0.2 s): the wait for the lock is no part of any figure. With
    ``anon``, fills it with the largest sampled ``RssAnon`` kB per rank pid (:class:`PeakRSS`). With ``budget_kb``
    the launch runs in a session of its own, which is killed as soon as a rank's sampled peak exceeds the budget
    (:class:`OverBudget` is raised)."""
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=budget_kb is not None)
        meter = PeakRSS(proc.pid, budget_kb=budget_kb)
        meter.start()
        try:
            code = proc.wait(timeout=timeout)
        finally:
            meter.done.set()
            meter.join()
    if meter.over:
        raise OverBudget(meter.peaks)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {code}); its output: {log}\n"
                           + log.read_text()[-3000:])
    if anon is not None:
        anon.update(meter.anon)
    if cmd[0] == "flock" and meter.first_child is not None:
        start = meter.first_child
    return start, meter.peaks


def converted(path: str, data_cfg) -> Path:
    """The folder ``finetune.engine.gguf`` converts the GGUF file ``path`` into (made once, under the run's cache,
    :func:`finetune.data.dataset.default_cache_dir`, as a run would), for both sides of a preset on a real model."""
    from finetune.data.dataset import default_cache_dir
    from finetune.engine import gguf

    file = Path(path) if Path(path).is_absolute() else REPO / path
    if not file.is_file():
        raise SystemExit(f"bench.py: no model file '{file}': fetch it with bash scripts/get_smollm2.sh")
    folder, note = gguf.ensure_converted(str(file), default_cache_dir(data_cfg))
    if note:
        print(note, flush=True)
    return folder


def clean_shm(before: set[str]) -> None:
    """Remove the ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` files a launch left (HF Trainer
    leaves them): those made since ``before`` on a master port of :func:`deepspeed_cmd`'s, never the buffer of another
    job's launch beside this one (its ranks may not have mapped it yet)."""
    for path in set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) - before:
        if not path.rsplit("_", 2)[-2].isdigit() or int(path.rsplit("_", 2)[-2]) not in LAUNCH_PORTS:
            continue
        try:
            os.unlink(path)
        except OSError:
            pass


def ours(preset: dict, overrides: list[str], args, out: Path, env: dict) -> dict:
    """One launch of the toolkit; per-step wall times, tokens and positions from its ``metrics.jsonl``."""
    cmd = deepspeed_cmd(args, "finetune/run.py", "--config", preset["config"], *overrides, f"output_dir={out}")
    start, peaks = run_launch(cmd, env, out.with_suffix(".log"), args.timeout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # grpo: greedy exact match, the accuracy; dpo: the held-out pairs ranked right by the implicit reward
    held = preset.get("heldout_key") or ("eval/reward" if preset.get("grpo") else "eval/rewards/accuracies"
                                         if preset.get("dpo") else "eval/accuracy")
    evals = [r for r in rows if held in r]
    evals_all = [r for r in rows if any(k.startswith("eval/") for k in r)]
    rows = [r for r in rows if "train/loss" in r]
    accuracies = [r.get("train/rewards/accuracies", r.get("train/accuracy")) for r in rows
                  if "train/rewards/accuracies" in r or "train/accuracy" in r]
    records = [json.loads(f.read_text()) for f in (out / "launches" / "1" / "ranks").glob("rank*.json")]
    gpu = max((r.get("peak_gpu_allocated_mib") or 0 for r in records), default=0) * 2**20
    # One row per log window (train.log_every steps; the last window may be shorter): spread evenly over its steps.
    ends, cpu, tokens, positions, losses, mfu, rewards, tool_calls = [], [], [], [], [], [], [], []
    completion_lengths: list[float] = []  # distill: mean trained tokens per sampled completion (EOS included)
    phases: dict[str, list[float]] = {}  # time/<phase>_s of each logged step (finetune.training.meter)
    prev = {"step": 0, "train/tokens_seen": 0}
    for r in rows:
        n = r["step"] - prev["step"]
        window_tokens = r["train/tokens_seen"] - prev["train/tokens_seen"]
        for k in range(1, n + 1):
            for out, key in ((ends, "time"), (cpu, "cpu_time")):  # the first window's start is unknown: its end only
                out.append(prev[key] + (r[key] - prev[key]) * k / n if key in prev else r[key] if k == n else math.nan)
            tokens.append(window_tokens / n)
            positions.append(window_tokens / n / r["train/padding_ratio"])
            losses.append(r["train/loss"])
            mfu.append(r.get("train/mfu"))
            if "train/reward" in r:  # grpo: the mean reward of the window's completions
                rewards.append(r["train/reward"])
            if "train/tools/call_frequency" in r:  # grpo with tools: tool calls per rollout
                tool_calls.append(r["train/tools/call_frequency"])
            if "train/completions/mean_length" in r:  # distill's on-policy rows
                completion_lengths.append(r["train/completions/mean_length"])
        for key in (k for k in r if k.startswith("time/") and k.endswith("_s")):
            phases.setdefault(key[5:-2], []).append(r[key])
        prev = r
    return {"start": start, "ends": ends, "cpu": cpu, "tokens": tokens, "positions": positions, "losses": losses,
            "peaks": peaks, "gpu_peak": gpu or None, "mfu": mfu, "reward_accuracies": accuracies, "rewards": rewards,
            "tool_calls": tool_calls, "completion_lengths": completion_lengths, "phases": phases,
            "heldout_accuracy": evals[-1][held] if evals else None,
            "heldout_start": evals[0][held] if len(evals) > 1 else None,
            "heldout_metrics": {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {},
            "heldout_loss": losses_held[-1] if (losses_held := [r["eval/loss"] for r in evals_all
                                                               if "eval/loss" in r]) else None,
            "shared_tokens": statistics.fmean(shared) if (shared := [r["train/shared_tokens"] for r in rows
                                                                    if "train/shared_tokens" in r]) else None,
            "pipeline_idle": [r["train/pipeline_idle"] for r in rows if "train/pipeline_idle" in r]}


HF_SAMPLING = {"hf": "random", "hf_grouped": "group_by_length", "hf_rebalance": "batch_rebalance",
               "hf_ddp": "group_by_length"}


def rank_records(out: Path, start: float, peaks: dict, nproc: int, gas: int, steps: int) -> dict:
    """One launch's numbers from the ``rank<r>.json`` files ``bench_hf.py`` and ``bench_bare.py`` write."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    tokens, positions = [], []
    for s in range(steps):  # step s trains on the micro-batches [s * gas, (s + 1) * gas) of every rank
        micro = [c for r in ranks for c in r["counts"][s * gas:(s + 1) * gas]]
        tokens.append(sum(c[0] for c in micro))
        positions.append(sum(c[1] for c in micro))
    logged = sorted((int(k), v) for k, v in ranks[0]["losses"].items())  # (step, loss); HF: mean since its last log
    # each step takes the loss of the log window it belongs to (the first logged step at or after it)
    losses = [next((v for k, v in logged if k >= s), None) for s in range(1, steps + 1)]
    accuracies = [v for _, v in sorted((int(k), v) for k, v in ranks[0].get("reward_accuracies", {}).items())]
    logged_rewards = sorted((int(k), v) for k, v in ranks[0].get("rewards", {}).items())  # grpo
    rewards = [next((v for k, v in logged_rewards if k >= s), None) for s in range(1, steps + 1)] \
        if logged_rewards else []
    logged_calls = sorted((int(k), v) for k, v in ranks[0].get("tool_calls", {}).items())  # grpo with tools
    tool_calls = [next((v for k, v in logged_calls if k >= s), None) for s in range(1, steps + 1)] \
        if logged_calls else []
    return {"start": start, "ends": ranks[0]["step_ends"][:steps], "cpu": ranks[0]["step_cpu"][:steps],
            "tokens": tokens, "positions": positions, "reward_accuracies": accuracies, "rewards": rewards,
            "tool_calls": [c for c in tool_calls if c is not None],
            "losses": losses, "peaks": peaks,
            "gpu_peak": max((r["gpu_max_allocated"] or 0) for r in ranks) or None}


def trainer_launch(script: str, spec: dict, args, out: Path, env: dict) -> dict:
    """One launch of a Trainer-based contender ``script`` (``scripts/bench_hf.py``, ``scripts/bench_st.py``) on
    ``spec``; per-step times, the counts of its collated micro-batches and its held-out figures (rank 0's)."""
    out.mkdir(parents=True)
    spec = {**spec, "out": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = deepspeed_cmd(args, script, "--spec", str(out / "spec.json"))
    start, peaks = run_launch(cmd, env, out.with_suffix(".log"), args.timeout)
    records = rank_records(out, start, peaks, args.nproc, spec["gradient_accumulation_steps"], spec["steps"])
    heldout = json.loads((out / "rank0.json").read_text()).get("heldout") or {}
    return {**records, "heldout_accuracy": heldout.get("accuracy"), "heldout_metrics": heldout}


def hf(spec: dict, sampling: str, args, out: Path, env: dict) -> dict:
    """One launch of ``scripts/bench_hf.py`` (HF ``Trainer``) with its train ``sampling`` strategy."""
    return trainer_launch("scripts/bench_hf.py", {**spec, "sampling": sampling}, args, out, env)


ST_VARIANTS = {"st": "defaults", "st_gather": "gather", "st_nodup": "gather_nodup"}
"""Contender -> ``scripts/bench_st.py``'s ``variant`` (sentence-transformers' defaults; its negatives gathered
across ranks; gathered, with its no-duplicates batch sampler)."""


def st(spec: dict, variant: str, args, out: Path, env: dict) -> dict:
    """One launch of ``scripts/bench_st.py`` (``SentenceTransformerTrainer``) with its ``variant``."""
    return trainer_launch("scripts/bench_st.py", {**spec, "variant": variant}, args, out, env)


TRL_VARIANTS = {"trl": "defaults", "trl_best": "best"}
"""Contender -> ``scripts/bench_trl.py``'s ``variant`` (TRL's defaults, or every speed option of TRL that applies)."""


def trl(spec: dict, variant: str, args, out: Path, env: dict) -> dict:
    """One launch of ``scripts/bench_trl.py`` (TRL's ``DPOTrainer`` or ``RewardTrainer`` by the spec's recipe, with
    its ``variant``: ``defaults`` or ``best``); the same records as :func:`hf`, and the held-out metrics (reward)."""
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps({**spec, "variant": variant, "out": str(out)}))
    cmd = deepspeed_cmd(args, "scripts/bench_trl.py", "--spec", str(out / "spec.json"))
    start, peaks = run_launch(cmd, env, out.with_suffix(".log"), args.timeout)
    records = rank_records(out, start, peaks, args.nproc, spec["gradient_accumulation_steps"], spec["steps"])
    rank0 = json.loads((out / "rank0.json").read_text())
    heldout = rank0.get("heldout") or {}
    return {**records, "heldout_accuracy": heldout.get("accuracy"), "heldout_pairs": heldout.get("pairs"),
            "heldout_loss": heldout.get("loss"),
            "heldout_start": heldout.get("start"),
            "phases": rank0.get("phases") or {}}


def reference_agreement(cache: Path, trl_out: Path) -> str:
    """The ``dpo`` preset's direct check: TRL's reference log-probabilities of the first 4 training pairs against
    finetune's cached ones (``<cache>/reference/dpo-train-*.npy``, rows in the same file order)."""
    import numpy as np

    theirs = json.loads((trl_out / "rank0.json").read_text())["reference_logps_first"]
    files = sorted((cache / "reference").glob("dpo-train-*.npy"), key=lambda p: p.stat().st_mtime)
    if not files:
        return "dpo: no cached reference log-probabilities of finetune to compare with TRL's"
    ours = np.load(files[-1])[: len(theirs)]
    diff = float(np.max(np.abs(ours - np.array(theirs)) / np.abs(np.array(theirs))))
    return (f"dpo: reference log-probabilities of the first {len(theirs)} pairs, finetune (cached, chunked head) vs "
            f"TRL (its reference model): max relative difference {diff:.2e}; finetune {ours[0].round(3).tolist()}, "
            f"TRL {np.round(theirs[0], 3).tolist()} (pair 0)")


def bare(preset: dict, overrides: list[str], args, out: Path, env: dict, gas: int) -> dict:
    """One launch of ``scripts/bench_bare.py``: the toolkit's batches, model and loss in a bare engine loop."""
    cmd = deepspeed_cmd(args, "scripts/bench_bare.py", "--config", preset["config"], "--out", str(out), *overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    start, peaks = run_launch(cmd, env, out.with_suffix(".log"), args.timeout)
    return rank_records(out, start, peaks, args.nproc, gas, args.steps)


def summarize(name: str, runs: list[dict], skip: int, last: int = 5, rows_per_step: int = 0,
              completions_per_row: int = 0) -> dict:
    """Pool the launches of one contender (see the module docstring for each number); ``completions_per_row``
    (grpo: ``num_generations``) adds completions/s and the mean rewards."""
    step_times, tokens, positions, seconds, first, losses, peaks, per_round, medians = [], 0, 0, 0.0, [], [], [], [], []
    mfu, cpu, accuracy, e2e_tokens, e2e_seconds, heldout, rewards, last_rewards = [], [], [], 0, 0.0, [], [], []
    tool_calls, heldout_start, heldout_loss = [], [], []
    for r in runs:
        ends = r["ends"]
        times = [b - a for a, b in zip(ends, ends[1:])]  # step s + 1's wall time, s = 1..
        timed = times[max(skip - 1, 0):]
        step_times += timed
        seconds += sum(timed)
        tokens += sum(r["tokens"][len(ends) - len(timed):])
        positions += sum(r["positions"][len(ends) - len(timed):])
        per_round.append(sum(r["tokens"][len(ends) - len(timed):]) / sum(timed))
        medians.append(statistics.median(timed))
        cpu.append((r["cpu"][-1] - r["cpu"][len(ends) - len(timed) - 1]) / len(timed))  # rank 0, s per timed step
        mfu += [m for m in r.get("mfu", [])[len(ends) - len(timed):] if m is not None]
        if math.isfinite(ends[0]):  # unknown for finetune with --log-every > 1
            first.append(ends[0] - r["start"])
        losses.append(statistics.fmean(r["losses"][-last:]))
        if r.get("reward_accuracies"):
            accuracy.append(statistics.fmean(r["reward_accuracies"][-last:]))
        if r.get("rewards"):  # grpo: every step's mean reward (warm-up steps included), and the last steps'
            rewards += r["rewards"]
            last_rewards.append(statistics.fmean(r["rewards"][-last:]))
        tool_calls += r.get("tool_calls") or []  # grpo with tools: every step's tool calls per rollout
        peaks.append(max(r["peaks"].values(), default=0) / 1024 or None)  # the launch's largest rank, MiB
        e2e_tokens += sum(r["tokens"][:len(ends)])  # every step, from the launcher's start to the last step's end
        e2e_seconds += ends[-1] - r["start"]
        if r.get("heldout_accuracy") is not None:
            heldout.append(r["heldout_accuracy"])
        if r.get("heldout_start") is not None:
            heldout_start.append(r["heldout_start"])
        if r.get("heldout_loss") is not None:
            heldout_loss.append(r["heldout_loss"])
    q = statistics.quantiles(step_times, n=4) if len(step_times) > 1 else [step_times[0]] * 3
    return {"contender": name, "real_tokens_per_s": tokens / seconds, "positions_per_s": positions / seconds,
            "rows_per_s": rows_per_step * len(step_times) / seconds if rows_per_step else None,
            "completions_per_s": (completions_per_row * rows_per_step * len(step_times) / seconds
                                  if completions_per_row and rows_per_step else None),
            "mean_reward": statistics.fmean(rewards) if rewards else None,
            "final_reward": statistics.fmean(last_rewards) if last_rewards else None,
            "tool_call_frequency": statistics.fmean(tool_calls) if tool_calls else None,
            "step_time_median_s": statistics.median(step_times), "step_time_iqr_s": q[2] - q[0],
            "timed_steps": len(step_times), "time_to_first_step_s": statistics.median(first) if first else None,
            "peak_rss_per_rank_mb": statistics.median(peaks) if all(peaks) else None,
            "gpu_max_allocated_mb": max((r["gpu_peak"] or 0) for r in runs) / 2**20 or None,
            "final_loss": statistics.fmean(losses), "rounds": len(runs), "real_tokens_per_s_per_round": per_round,
            "step_time_median_s_per_round": medians, "peak_rss_per_rank_mb_per_round": peaks,
            "mfu": statistics.median(mfu) if mfu else None,
            "rank0_cpu_s_per_step": statistics.median(cpu), "rank0_cpu_s_per_step_per_round": cpu,
            "final_reward_accuracy": statistics.fmean(accuracy) if accuracy else None,
            "e2e_real_tokens_per_s": e2e_tokens / e2e_seconds, "e2e_seconds_per_launch": e2e_seconds / len(runs),
            "e2e_real_tokens_per_s_per_round": [sum(r["tokens"][:len(r["ends"])]) / (r["ends"][-1] - r["start"])
                                                for r in runs],
            "heldout_accuracy": statistics.fmean(heldout) if heldout else None,
            "heldout_start": statistics.fmean(heldout_start) if heldout_start else None,
            "heldout_accuracy_per_round": heldout,
            "heldout_loss": statistics.fmean(heldout_loss) if heldout_loss else None,
            "shared_tokens": statistics.fmean(shared) if (shared := [r["shared_tokens"] for r in runs
                                                                    if r.get("shared_tokens") is not None]) else None}


def grpo_summary(name: str, results: list[dict]) -> str:
    """The ``grpo`` preset's lines: per contender completions/s, trained tokens/s, peak MB per rank and the mean
    rewards, and ``finetune``'s ratios over each other contender (throughput: higher is better for us; memory:
    ours/this, lower is better for us)."""
    ours = results[0]
    lines = [f"{name}: completions/s, trained (prompt + completion, non-pad) tokens/s, peak RSS MB per rank, mean "
             f"reward over every step (and the last steps)"
             + (", tools/call_frequency (tool calls per rollout, mean over steps)"
                if any(r.get("tool_call_frequency") is not None for r in results) else "")]
    for r in results:
        line = (f"  {r['contender']:<10} {r['completions_per_s']:7.2f} compl/s {r['real_tokens_per_s']:8.0f} tok/s "
                f"{r['peak_rss_per_rank_mb'] or float('nan'):7.0f} MB/rank  reward {r['mean_reward'] or 0:.4f} "
                f"(last {r['final_reward'] or 0:.4f})")
        if r.get("tool_call_frequency") is not None:
            line += f"  tool calls/rollout {r['tool_call_frequency']:.2f}"
        if r.get("heldout_accuracy") is not None:  # the heldout presets: greedy accuracy before -> after
            start = r.get("heldout_start")
            line += f"  held-out {'n/a' if start is None else f'{start:.3f}'} -> {r['heldout_accuracy']:.3f}"
        if r is not ours:
            line += (f"  finetune/{r['contender']}: completions/s "
                     f"{ours['completions_per_s'] / r['completions_per_s']:.2f}x, tokens/s "
                     f"{ours['real_tokens_per_s'] / r['real_tokens_per_s']:.2f}x (by rounds "
                     f"{r['ratio_ours_over_this_median_of_rounds']:.2f}x), peak MB per rank "
                     f"{(ours['peak_rss_per_rank_mb'] or 0) / (r['peak_rss_per_rank_mb'] or 1):.2f}x")
        lines.append(line)
    return "\n".join(lines)


def phase_medians(runs: list[dict], skip: int, steps: int) -> dict[str, float]:
    """Median seconds per call of each timed phase over the timed steps of every launch (``phases``: finetune's
    ``time/<phase>_s`` per logged step, TRL's timed methods per call; the calls of the first ``skip`` steps are left
    out, ``len(calls) / steps`` calls per step)."""
    pooled: dict[str, list[float]] = {}
    for r in runs:
        for key, values in (r.get("phases") or {}).items():
            per_step = max(len(values) // steps, 1)
            pooled.setdefault(key, []).extend(values[skip * per_step:])
    return {k: statistics.median(v) for k, v in pooled.items() if v}


def distill_summary(name: str, results: list[dict], phases: dict[str, dict[str, float]]) -> str:
    """The ``distill`` preset's lines: per contender trained (completion) tokens/s, prompts/s, peak MB per rank and
    final loss, with ``finetune``'s ratios over each other contender (throughput: higher is better for us; memory:
    ours/this, lower is better for us), then where a step's time goes (median seconds per call, timed steps)."""
    ours = results[0]
    lines = [f"{name}: trained (completion, EOS included) tokens/s, prompts/s, median step s, peak RSS MB per rank, "
             f"final loss (the divergence per trained token, last steps)"]
    for r in results:
        line = (f"  {r['contender']:<10} {r['real_tokens_per_s']:8.1f} tok/s {r['rows_per_s']:6.2f} prompts/s "
                f"{r['step_time_median_s']:6.2f} s/step {r['peak_rss_per_rank_mb'] or float('nan'):7.0f} MB/rank "
                f"loss {r['final_loss']:.5f}")
        if r is not ours:
            line += (f"  finetune/{r['contender']}: tokens/s {ours['real_tokens_per_s'] / r['real_tokens_per_s']:.2f}x"
                     f" (by rounds {r['ratio_ours_over_this_median_of_rounds']:.2f}x), peak MB per rank "
                     f"{(ours['peak_rss_per_rank_mb'] or 0) / (r['peak_rss_per_rank_mb'] or 1):.2f}x")
        lines.append(line)
    lines.append(f"{name}: seconds per call (median over the timed steps; finetune: time/<phase>_s of rank 0, "
                 f"before_step = the on-policy generation; TRL: generate = transformers' generate, "
                 f"generate_and_score = with the prompts' tokenization and padding, train_forward = compute_loss "
                 f"(student and teacher forwards, divergence), training_step = all of it + backward + optimizer)")
    for c, p in phases.items():
        lines.append(f"  {c:<10} " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()))
    return "\n".join(lines)


def paired(ours: dict, this: dict) -> float:
    """Round-by-round comparison of two contenders launched back to back in each round (robust to a slow round,
    which hits both of a pair alike): the median over rounds of ours/this real tokens/s."""
    return statistics.median(a / b for a, b in zip(ours["real_tokens_per_s_per_round"],
                                                   this["real_tokens_per_s_per_round"]))


def lm_head_share(cfg, seq_len: int | None = None) -> str:
    """The LM head's share of the model's matmul FLOPs per position (forward; backward scales every term alike), as
    one printable line: head ``2 h V`` (the output projection: hidden ``h`` x vocabulary ``V``) over head + layers,
    the layers counted as ``2 N`` (``N``: the weights of every ``nn.Linear`` / ``Conv1D`` but the head, i.e. the
    layers' matmul parameters; embedding lookups cost none) plus attention's ``4 L s d_attn`` (scores and weighted
    sum over ``s`` positions of context, ``L`` layers, ``d_attn`` = heads x head size; Kaplan et al. 2020, "Scaling
    Laws for Neural Language Models", table 1, with both matmuls counted), at ``s`` = ``seq_len`` (default
    ``data.max_seq_len``: the full context, the smallest share). Models without an LM head (classifiers, the reward
    model's one score) report 0% (their output layer is counted with the layers). The model is built from its config
    (``model.path`` + ``config_overrides``) on the meta device: no weights, no memory."""
    import torch
    import transformers
    from transformers.pytorch_utils import Conv1D

    config = transformers.AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    for k, v in (cfg.model.config_overrides or {}).items():
        setattr(config, k, v)
    auto = {"bert_mlm": transformers.AutoModelForMaskedLM, "seq_cls": transformers.AutoModelForSequenceClassification,
            "token_cls": transformers.AutoModelForTokenClassification,
            "qa": transformers.AutoModelForQuestionAnswering, "embed": transformers.AutoModel,
            "reward": transformers.AutoModelForSequenceClassification,
            "vlm_sft": transformers.AutoModelForImageTextToText}.get(cfg.recipe,
                                                                           transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(config)
    head = model.get_output_embeddings()
    head_w = head.weight.numel() if head is not None else 0
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head)
    text = config.get_text_config()
    h, layers = text.hidden_size, text.num_hidden_layers
    d_attn = text.num_attention_heads * (getattr(text, "head_dim", None) or h // text.num_attention_heads)
    s = seq_len or cfg.data.max_seq_len
    head_f, layer_f = 2 * head_w, 2 * body + 4 * layers * s * d_attn
    what = (f"LM head {head_w / h:,.0f} x {h}" if head is not None else "no LM head (a classifier's output only)")
    return (f"LM-head share of the matmul FLOPs per position {head_f / (head_f + layer_f):.1%} ({what}: "
            f"{head_f / 1e6:.1f} MFLOP; layers {2 * body / 1e6:.1f} MFLOP of weights + "
            f"{4 * layers * s * d_attn / 1e6:.1f} of attention at {s} positions; {layers} layers, hidden {h})")


def hf_spec(cfg, steps: int, precision: str) -> dict:
    """What ``scripts/bench_hf.py`` needs of the resolved run config, and its DeepSpeed dict (``auto`` sizes)."""
    from finetune.engine.ds_config import load_ds_json

    ds = load_ds_json(cfg.deepspeed)
    ds.update({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
               "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"}})
    t, d, m = cfg.train, cfg.data, cfg.model
    return {"recipe": cfg.recipe, "model": m.path, "tokenizer": m.tokenizer_path or m.path,
            "config_overrides": m.config_overrides, "train_files": d.train_files, "max_train_rows": d.max_train_rows,
            "max_seq_len": d.max_seq_len, "mlm_probability": d.mlm_probability, "text_column": d.text_column,
            "label_column": d.label_column, "prompt_column": d.prompt_column, "response_column": d.response_column,
            "chosen_column": d.chosen_column, "rejected_column": d.rejected_column, "dpo_beta": t.dpo.beta,
            "micro_batch_size": t.micro_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps, "steps": steps, "lr": t.lr,
            "weight_decay": t.weight_decay, "warmup_steps": t.warmup_steps, "lr_scheduler": t.lr_scheduler,
            "max_grad_norm": t.max_grad_norm, "seed": t.seed, "precision": precision, "hf_deepspeed": ds,
            "gradient_checkpointing": m.gradient_checkpointing,
            "grpo": dataclasses.asdict(t.grpo), "distill": dataclasses.asdict(t.distill),
            "reward_columns": list(d.reward_columns), "init": m.init,
            "lora": dataclasses.asdict(m.lora) if m.lora is not None and m.lora.r else None,
            "eval_micro_batch_size": t.eval_micro_batch_size or t.micro_batch_size,
            "messages_column": d.messages_column, "image_column": d.image_column,
            "tokens_column": d.tokens_column, "tags_column": d.tags_column, "label_all_tokens": d.label_all_tokens,
            "question_column": d.question_column, "context_column": d.context_column,
            "answers_column": d.answers_column, "doc_stride": d.doc_stride, "n_best_size": d.n_best_size,
            "max_answer_length": d.max_answer_length, "version_2_with_negative": d.version_2_with_negative,
            "null_score_diff_threshold": d.null_score_diff_threshold,
            "anchor_column": d.anchor_column, "positive_column": d.positive_column,
            "negative_column": d.negative_column, "score_column": d.score_column, "embed": dataclasses.asdict(t.embed),
            "chat_template": d.chat_template if d.chat_template and Path(d.chat_template).is_file() else ""}


def init_from(folder: str) -> list[str]:
    """``--init-from``'s overrides: the folder's weights, config and tokenizer instead of the preset's model (TRL's
    side loads it with ``from_pretrained``: ``hf_spec``'s ``init``); none without a folder."""
    if not folder:
        return []
    return [f"model.path={Path(folder).resolve()}", "model.init=pretrained", "model.config_overrides={}",
            "model.tokenizer_path="]


def write_teacher(shape: str, folder: Path, seed: int = 0) -> Path:
    """The ``distill`` preset's teacher: ``data/models/tiny-llama``'s config with the ``shape`` overrides (YAML
    flow mapping, :data:`TEACHER_SHAPE`), random weights from ``seed`` (``from_config``), saved with
    ``save_pretrained`` into ``folder`` with the files of the tokenizer of ``data/models/gsm8k-bpe-8k`` (the
    student's); a folder that already holds weights is kept."""
    import shutil

    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    config = AutoConfig.from_pretrained(REPO / "data" / "models" / "tiny-llama", local_files_only=True)
    for k, v in yaml.safe_load(shape).items():
        setattr(config, k, v)
    config.use_cache = True
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for f in (REPO / "data" / "models" / "gsm8k-bpe-8k").iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


def table(preset: str, results: list[dict]) -> str:
    """The results as a text table, one line per contender."""
    cols = [("real tok/s", "{:.0f}", "real_tokens_per_s"), ("pos/s", "{:.0f}", "positions_per_s"),
            ("step med s", "{:.3f}", "step_time_median_s"), ("IQR s", "{:.3f}", "step_time_iqr_s"),
            ("r0 CPU s", "{:.3f}", "rank0_cpu_s_per_step"),
            ("1st step s", "{:.1f}", "time_to_first_step_s"), ("peak MB/rank", "{:.0f}", "peak_rss_per_rank_mb"),
            ("rows/s", "{:.1f}", "rows_per_s"), ("compl/s", "{:.2f}", "completions_per_s"),
            ("final loss", "{:.4f}", "final_loss"), ("mean reward", "{:.4f}", "mean_reward"),
            ("last reward", "{:.4f}", "final_reward"), ("tool calls", "{:.2f}", "tool_call_frequency"),
            ("reward acc", "{:.3f}", "final_reward_accuracy"), ("ours/this", "{:.2f}", "ratio_ours_over_this"),
            ("by rounds", "{:.2f}", "ratio_ours_over_this_median_of_rounds"), ("MFU", "{:.1%}", "mfu"),
            ("e2e tok/s", "{:.0f}", "e2e_real_tokens_per_s"), ("e2e s", "{:.1f}", "e2e_seconds_per_launch"),
            ("e2e ours/this", "{:.2f}", "e2e_ratio_ours_over_this"), ("held-out 0", "{:.3f}", "heldout_start"),
            ("held-out acc", "{:.3f}", "heldout_accuracy"), ("held-out loss", "{:.4f}", "heldout_loss"),
            ("shared tok", "{:.2f}", "shared_tokens")]
    lines = [f"{preset}:", f"{'contender':<13}" + "".join(f"{h:>14}" for h, _, _ in cols)]
    for r in results:
        cells = [fmt.format(r[key]) if r.get(key) is not None else "n/a" for _, fmt, key in cols]
        lines.append(f"{r['contender']:<13}" + "".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def prompt_only_pairs(src: str, dst: Path) -> str:
    """``src``'s pairs with each rejected response replaced by the next pair's chosen one (the last pair's by the
    first's), written to ``dst``: every pair then shares only its prompt (a wrong but well-formed solution)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(src)
    chosen = table.column("chosen").to_pylist()
    pq.write_table(table.set_column(table.schema.get_field_index("rejected"), "rejected",
                                    pa.array(chosen[1:] + chosen[:1])), dst)
    return str(dst)


def warm_up(preset: dict, overrides: list[str], args, out: Path, env: dict) -> None:
    """One untimed launch of the toolkit before the timed rounds (1 step, its own cache): DeepSpeed builds its CPU
    ops (``deepspeed_shm_comm``, ``cpu_adam``) on the first launch after an install, some 20 s that would otherwise
    be charged to whichever contender runs first; the page cache also warms up for all contenders alike."""
    t0 = time.perf_counter()
    before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    cmd = deepspeed_cmd(args, "finetune/run.py", "--config", preset["config"], *overrides, "train.max_steps=1",
                        "data.max_train_rows=400", f"output_dir={out}")
    try:
        run_launch(cmd, {**env, "FINETUNE_CACHE": str(out.with_suffix(".cache"))}, out.with_suffix(".log"), args.timeout)
    finally:
        clean_shm(before)
    print(f"  warm-up launch (untimed): {time.perf_counter() - t0:.1f} s", flush=True)


def longest_fitting(fits, start: int, step: int = 256, fraction: int = 8, cap: int | None = None):
    """The longest length (a multiple of ``step``) for which ``fits(length)`` holds, assuming it is monotone:
    doubling from ``start`` up to the first length that does not fit (halving instead while ``start`` does not fit,
    down to ``step``), then bisection until the bracket is at most ``max(step, longest / fraction)`` wide. With
    ``cap``, doubling stops there (the result is then a lower bound). Returns ``(longest or 0, {length: fits})``
    in the order tried."""
    tried: dict[int, bool] = {}

    def probe(n: int) -> bool:
        tried[n] = bool(fits(n))
        return tried[n]

    lo, hi, n = 0, None, start
    if probe(n):
        lo = n
        while cap is None or 2 * n <= cap:
            n *= 2
            if not probe(n):
                hi = n
                break
            lo = n
        if hi is None:
            return lo, tried
    else:
        hi = n
        while n // 2 >= step and lo == 0:
            n //= 2
            if probe(n):
                lo = n
            else:
                hi = n
        if lo == 0:
            return 0, tried
    while hi - lo > max(step, lo // fraction):
        mid = (lo + hi) // 2 // step * step
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def long_context(preset: dict, name: str, args, root: Path, env: dict, precision: str) -> None:
    """The ``long_context`` flow (module docstring): per contender, the longest packed length that trains
    ``--search-steps`` steps within ``--memory-budget`` MB per rank (:func:`longest_fitting`; each trial one launch,
    killed as soon as a rank's sampled peak exceeds the budget); then, at the common length (the longest that fits
    every contender), the contenders timed side by side, alternating for ``--rounds`` rounds, at the same global
    batch (SP=2: 2 micro-batches of 1 row accumulated = the 2 rows of the data-parallel contenders)."""
    from finetune.config import load_run_config

    budget_kb = args.memory_budget * 1024
    base = [*preset["overrides"], *(preset["tiny"] if args.tiny else []), "train.log_every=1",
            "train.eval_every=0", "train.eval_on_start=false", "train.save_every=0", "export=false",
            "train.sample_prompt=", f"train.precision={precision}", *args.overrides]
    contenders = [c for c in preset["contenders"] if not args.contenders or c in args.contenders.split(",")]

    def overrides_for(c: str, length: int, steps: int, accumulate: bool = False) -> list[str]:
        sp = next((int(o.split("=")[1]) for o in preset["contenders"][c] if "sequence_parallel_size" in o), 1)
        gas = sp if accumulate else 1  # same global batch: SP=2 accumulates the rows data parallelism runs at once
        return [*base, *preset["contenders"][c], f"data.max_seq_len={length}", f"train.max_steps={steps}",
                f"train.gradient_accumulation_steps={gas}"]

    # the search trials' environment, the same for every contender (LONG_CONTEXT_MMAP_THRESHOLD)
    search_env = dict(env)
    if args.malloc_mmap_threshold and not args.gpu:
        search_env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)

    def launch(c: str, length: int, steps: int, out: Path, budget: int | None, accumulate: bool = False) -> dict:
        before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
        overrides = overrides_for(c, length, steps, accumulate)
        try:
            if c == "hf":
                cfg = load_run_config(REPO / preset["config"], overrides)
                spec = {**hf_spec(cfg, steps, precision), "log_every": 1}
                if budget is None:
                    return hf(spec, "random", args, out, env)
                out.mkdir(parents=True)
                (out / "spec.json").write_text(json.dumps({**spec, "sampling": "random", "out": str(out)}))
                cmd = deepspeed_cmd(args, "scripts/bench_hf.py", "--spec", str(out / "spec.json"))
            else:
                if budget is None:
                    return ours(preset, overrides, args, out, env)
                cmd = deepspeed_cmd(args, "finetune/run.py", "--config", preset["config"], *overrides,
                                    f"output_dir={out}")
            out.parent.mkdir(parents=True, exist_ok=True)
            _, peaks = run_launch(cmd, search_env, out.with_suffix(".log"), args.timeout, budget_kb=budget)
            return {"peaks": peaks}
        finally:
            clean_shm(before)

    trials: dict[str, list[dict]] = {c: [] for c in contenders}
    longest: dict[str, int] = {}
    for c in contenders:
        def fits(length: int, c: str = c) -> bool:
            t0 = time.perf_counter()
            out = root / f"{name}-{c}-{length}"
            try:
                if args.gpu:  # GPU ranks: torch.cuda.max_memory_allocated of the largest rank, after the launch
                    r = launch(c, length, args.search_steps, out, None)
                    peaks = {0: (r["gpu_peak"] or 0) / 1024}
                    ok = peaks[0] <= budget_kb
                    why = "fits" if ok else "over budget"
                else:
                    peaks, ok, why = launch(c, length, args.search_steps, out, budget_kb)["peaks"], True, "fits"
            except OverBudget as e:
                peaks, ok, why = e.peaks, False, "over budget (killed)"
            # any other failure (a crash, a refused config) stops the benchmark: it says nothing about memory
            mb = sorted(round(v / 1024) for v in peaks.values())[-args.nproc:]  # the ranks (not their data workers)
            trials[c].append({"length": length, "fits": ok, "peak_rss_mb_per_rank": mb,
                              "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  {c:<13} {length:>7} tokens: {why:<22} peak MB per rank {mb} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            return ok

        longest[c], _ = longest_fitting(fits, args.start_length, fraction=args.resolution, cap=args.max_length)
        print(f"{name}: {c}: longest trained length {longest[c]} tokens "
              f"(budget {args.memory_budget} MB per rank)", flush=True)

    common = min(longest.values())
    results = []
    if common and args.rounds:
        runs: dict[str, list[dict]] = {c: [] for c in contenders}
        for rnd in range(args.rounds):
            for c in contenders:
                t0 = time.perf_counter()
                runs[c].append(launch(c, common, args.steps, root / f"{name}-{c}-timed-{common}-{rnd}", None,
                                      accumulate=True))
                print(f"  round {rnd} {c:<13} at {common} tokens: {time.perf_counter() - t0:6.1f} s", flush=True)
        rows = 2 if args.nproc >= 2 else 1
        results = [summarize(c, r, args.skip, 5, rows) for c, r in runs.items()]
        hf_r = next((r for r in results if r["contender"] == "hf"), None)
        for r in results:
            r["ratio_ours_over_this"] = None
            if hf_r:  # this contender's tokens/s over HF's (pooled, and round by round)
                r["ratio_ours_over_this"] = r["real_tokens_per_s"] / hf_r["real_tokens_per_s"]
                r["ratio_ours_over_this_median_of_rounds"] = paired(r, hf_r)
        print(table(f"{name} at the common length {common} tokens (ratio: this / hf)", results))
    lines = [f"{name}: longest packed length that trains {args.search_steps} steps within {args.memory_budget} MB "
             f"per rank (peak RSS on CPU ranks, MALLOC_MMAP_THRESHOLD_="
             f"{search_env.get('MALLOC_MMAP_THRESHOLD_', 'glibc default')}), {args.nproc} ranks, {precision}:",
             f"{'contender':<14}{'longest':>9}{'peak MB/rank':>14}{'trials':>8}{'search s':>10}"]
    for c in contenders:
        fit = [t for t in trials[c] if t["fits"] and t["length"] == longest[c]]
        peak = max(fit[0]["peak_rss_mb_per_rank"]) if fit and fit[0]["peak_rss_mb_per_rank"] else None
        lines.append(f"{c:<14}{longest[c]:>9}{peak if peak is not None else 'n/a':>14}{len(trials[c]):>8}"
                     f"{sum(t['seconds'] for t in trials[c]):>10.0f}")
    ratios = {}
    for a, b, target in (("finetune_sp2", "hf", 4.0), ("finetune_sp2", "finetune_sp1", 1.8)):
        if longest.get(a) and longest.get(b):
            ratios[f"{a}/{b}"] = longest[a] / longest[b]
            lines.append(f"longest {a} / {b}: {longest[a] / longest[b]:.2f}x (target >= {target}x)")
    print("\n".join(lines))
    for c in contenders:  # peak memory against length, of the trials that trained
        fit = sorted((t["length"], max(t["peak_rss_mb_per_rank"])) for t in trials[c]
                     if t["fits"] and t["peak_rss_mb_per_rank"])
        slopes = [f"{1024 * (m2 - m1) / (l2 - l1):.1f}" for (l1, m1), (l2, m2) in zip(fit, fit[1:])]
        print(f"{name}: {c}: peak MB per rank by length: "
              + ", ".join(f"{n}: {m}" for n, m in fit) + f"; MB per 1k tokens between them: {', '.join(slopes)}")
    for c in contenders:
        timed = next((r for r in results if r["contender"] == c), {})
        print(json.dumps({"bench": name, "contender": c, "longest_length": longest[c],
                          "memory_budget_mb": args.memory_budget,
                          "malloc_mmap_threshold": search_env.get("MALLOC_MMAP_THRESHOLD_"),
                          "common_length": common or None,
                          "length_ratios": ratios, "trials": trials[c], **{k: v for k, v in timed.items()
                                                                            if k != "contender"}}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bert_mlm", choices=[*PRESETS, "all"])
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per timed launch (default 40; long_context: 6, at the common length)")
    p.add_argument("--rounds", type=int, default=2, help="launches per contender, alternating")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps per launch left out of the timing")
    p.add_argument("--log-every", type=int, default=1,
                   help="log every N steps (finetune's train.log_every, HF's logging_steps); finetune's step times "
                        "are then the mean of each N-step window")
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    p.add_argument("--gpu", action="store_true", help="GPU ranks (bf16); default: CPU ranks, fp32")
    p.add_argument("--tiny", action="store_true", help="small model and data: a smoke run of the benchmark")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--contenders", default="", help="comma-separated subset of the preset's contenders, and finetune[key=value] "
                   "contenders: finetune with that run-config override (e.g. finetune[train.reward.share_prefix=false])")
    p.add_argument("--keep", default="", help="folder to keep the launches' run folders in (default: temporary)")
    p.add_argument("--optimizer", default="", help="comma-separated finetune optimizers (train.optimizer: adamw,muon): "
                   "the contenders are then finetune[<optimizer>] each, side by side in the same rounds")
    p.add_argument("--no-warm-up", action="store_true", help="skip the untimed warm-up launch (smoke runs: the "
                   "first contender's launch then pays DeepSpeed's one-time op builds, if any)")
    p.add_argument("--teacher", default="", help="distill preset: the teacher's model folder (weights and a "
                   "tokenizer of the student's vocabulary) instead of the random one of TEACHER_SHAPE it writes")
    p.add_argument("--init-from", default="", help="a model folder (e.g. an SFT export of the preset's shape) every "
                   "contender starts from instead of random weights from train.seed (its config and tokenizer)")
    p.add_argument("--lock", default="", help="hold this flock(1) file during each launch (not between them), so "
                   "other heavy jobs on the machine interleave with the benchmark's launches")
    g = p.add_argument_group("long_context preset")
    g.add_argument("--memory-budget", type=int, default=LONG_CONTEXT_BUDGET_MB,
                   help="MB per rank: peak resident set (VmHWM) of each rank process on CPU ranks, "
                   "torch.cuda.max_memory_allocated with --gpu")
    g.add_argument("--start-length", type=int, default=2048, help="first length tried (then doubled or halved)")
    g.add_argument("--max-length", type=int, default=None, help="stop doubling here (the result is then a bound)")
    g.add_argument("--resolution", type=int, default=4,
                   help="bisect until the bracket is at most 1/N of the longest fitting length (and 256 tokens)")
    g.add_argument("--search-steps", type=int, default=3, help="optimizer steps a trial must train")
    g.add_argument("--malloc-mmap-threshold", type=int, default=LONG_CONTEXT_MMAP_THRESHOLD,
                   help="CPU search trials: glibc's MALLOC_MMAP_THRESHOLD_ (bytes) for every contender's ranks, so "
                   "freed blocks above it return to the OS and the peak resident set follows the live tensors; "
                   "0: glibc's default (a threshold that grows with the blocks freed, which keeps freed memory)")
    p.add_argument("overrides", nargs="*", help="extra key=value run-config overrides for every contender")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 6 if args.preset == "long_context" else 40
    if args.steps <= args.skip:
        p.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    if args.log_every > 1 and (args.skip % args.log_every or args.steps % args.log_every):
        p.error(f"--log-every {args.log_every} must divide --skip {args.skip} and --steps {args.steps} (whole windows)")

    from finetune.config import load_run_config
    from finetune.engine import gguf

    precision = "bf16" if args.gpu else "fp32"
    env = environment(args.gpu)
    status = 0
    with tempfile.TemporaryDirectory(prefix="finetune_bench_") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        env.setdefault("FINETUNE_CACHE", str(root / "cache"))
        every = [n for n, pr in PRESETS.items() if (args.gpu or not pr.get("gpu")) and not pr.get("search")
                 and not pr.get("real")]
        for name in every if args.preset == "all" else [args.preset]:
            preset = PRESETS[name]
            if preset.get("search"):
                long_context(preset, name, args, root, env, precision)
                continue
            tiny = [*preset["tiny"], "data.max_train_rows=400"] if args.tiny else []
            derived = []
            if preset.get("prompt_only"):
                data = load_run_config(REPO / preset["config"]).data
                derived = [f"data.{key}=[{prompt_only_pairs(files[0], root / f'{name}-{key}.parquet')}]"
                           for key, files in (("train_files", data.train_files),
                                              ("validation_files", data.validation_files))]
            if preset.get("distill"):  # the teacher: --teacher, or one of random weights written here once
                teacher = Path(args.teacher) if args.teacher else write_teacher(
                    TEACHER_TINY if args.tiny else TEACHER_SHAPE, root / f"{name}-teacher{'-tiny' * args.tiny}")
                derived.append(f"train.distill.teacher={teacher.resolve()}")
            overrides = [*preset["overrides"], *derived, *tiny, f"train.max_steps={args.steps}",
                         f"train.log_every={args.log_every}", "train.eval_every=0", "train.eval_on_start=false",
                         "train.eval_max_batches=1", "train.save_every=0", "export=false", "train.sample_prompt=",
                         f"train.precision={precision}", *init_from(args.init_from), *args.overrides]
            cfg = load_run_config(REPO / preset["config"], overrides)
            t = cfg.train
            if preset.get("epoch"):  # one epoch: the rows the steps train (both sides' reference passes cover them)
                overrides.append(f"data.max_train_rows="
                                 f"{args.steps * t.micro_batch_size * t.gradient_accumulation_steps * args.nproc}")
            if preset.get("heldout"):  # one evaluation of every held-out pair after the last step (not timed)
                overrides += [f"train.eval_every={args.steps}", "train.eval_max_batches=0"]
                if preset.get("grpo"):  # and before the first: the gain
                    overrides.append("train.eval_on_start=true")
            if gguf.is_gguf(cfg.model.path):  # one converted folder for both sides (TRL loads a folder)
                overrides.append(f"model.path={converted(cfg.model.path, cfg.data)}")
            cfg = load_run_config(REPO / preset["config"], overrides)
            spec = {**hf_spec(cfg, args.steps, precision), "log_every": args.log_every,
                    "validation_files": cfg.data.validation_files if preset.get("heldout") else []}
            t = cfg.train
            print(f"{name}: {cfg.model.path} {cfg.model.config_overrides}, max_seq_len {cfg.data.max_seq_len}, "
                  f"micro {t.micro_batch_size} x accum {t.gradient_accumulation_steps} x {args.nproc} ranks, "
                  f"{cfg.deepspeed}, {precision}, seed {t.seed}, {args.steps} steps x {args.rounds} rounds "
                  f"(first {args.skip} per launch not timed)", flush=True)
            print(f"{name}: {lm_head_share(cfg)}", flush=True)
            if preset.get("distill"):
                teacher_cfg = dataclasses.replace(cfg, model=dataclasses.replace(
                    cfg.model, path=cfg.train.distill.teacher, config_overrides={}))
                print(f"{name}: teacher {cfg.train.distill.teacher}: {lm_head_share(teacher_cfg)}", flush=True)
            if not args.no_warm_up:
                warm_up(preset, overrides, args, root / f"{name}-warmup", env)
            chosen = args.contenders.split(",") if args.contenders else preset["contenders"]
            # finetune[key=value]: finetune with that override, a contender of its own (e.g. a lever turned off)
            extra = [c for c in chosen if c.startswith("finetune[") and "=" in c]
            runs: dict[str, list[dict]] = {c: [] for c in [*preset["contenders"], *extra] if c in chosen}
            if args.optimizer:  # finetune against itself, one optimizer setting per contender
                runs = {f"finetune[{o}]": [] for o in args.optimizer.split(",")}
            for rnd in range(args.rounds):
                for c in runs:
                    out = root / f"{name}-{c}-{rnd}"
                    before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
                    t0 = time.perf_counter()
                    try:
                        if c == "finetune":
                            if cfg.recipe == "dpo":  # each launch computes its reference (end-to-end column)
                                for f in (Path(env["FINETUNE_CACHE"]) / "reference").glob("dpo-*.npy"):
                                    f.unlink()
                            runs[c].append(ours(preset, overrides, args, out, env))
                        elif isinstance(preset["contenders"], dict) and c in preset["contenders"]:
                            runs[c].append(ours(preset, [*overrides, *preset["contenders"][c]], args, out, env))
                        elif c.startswith("finetune["):
                            setting = c[9:-1] if "=" in c else f"train.optimizer={c[9:-1]}"
                            runs[c].append(ours(preset, [*overrides, setting], args, out, env))
                        elif c in ST_VARIANTS:
                            runs[c].append(st(spec, ST_VARIANTS[c], args, out, env))
                        elif c in TRL_VARIANTS:
                            runs[c].append(trl(spec, TRL_VARIANTS[c], args, out, env))
                        elif c == "bare":
                            runs[c].append(bare(preset, overrides, args, out, env, t.gradient_accumulation_steps))
                        else:  # hf_ddp: torch's DistributedDataParallel instead of the DeepSpeed dict
                            runs[c].append(hf({**spec, "hf_deepspeed": None} if c == "hf_ddp" else spec,
                                              HF_SAMPLING[c], args, out, env))
                    finally:
                        clean_shm(before)
                    print(f"  round {rnd} {c:<10}: {time.perf_counter() - t0:6.1f} s", flush=True)
            rows = t.micro_batch_size * t.gradient_accumulation_steps * args.nproc  # global batch (dpo: pairs)
            per_row = t.grpo.num_generations if preset.get("grpo") else 0  # grpo: rows are prompts
            if preset.get("distill"):  # finetune's trained tokens: the completions' mean length x prompts per step
                for c, launches in runs.items():
                    for r in launches:
                        if c.startswith("finetune"):
                            r["tokens"] = [n * rows for n in r["completion_lengths"]]
            results = [summarize(c, r, args.skip, max(5, args.log_every), rows, per_row) for c, r in runs.items()]
            base = results[0]["real_tokens_per_s"] if results[0]["contender"].startswith("finetune") else None
            for r in results:
                r["ratio_ours_over_this"] = base / r["real_tokens_per_s"] if base else None
                if base and results[0]["mfu"] is not None and r is not results[0]:  # same model: FLOPs per real token
                    r["mfu"] = results[0]["mfu"] * r["real_tokens_per_s"] / base
                r["ratio_ours_over_this_median_of_rounds"] = paired(results[0], r) if base else None
                r["e2e_ratio_ours_over_this"] = (results[0]["e2e_real_tokens_per_s"] / r["e2e_real_tokens_per_s"]
                                                 if base else None)
            print(table(name, results))
            if base and "bare" in runs:
                bare_r = results[list(runs).index("bare")]
                overhead = bare_r["real_tokens_per_s"] / base - 1
                print(f"{name}: loop overhead of finetune over the bare engine loop on its own batches: "
                      f"{100 * overhead:+.1f}% step time (all rounds pooled); {100 * (1 / paired(results[0], bare_r) - 1):+.1f}% "
                      f"(round by round, median over rounds); rank 0's CPU time per step "
                      f"{100 * (results[0]['rank0_cpu_s_per_step'] / bare_r['rank0_cpu_s_per_step'] - 1):+.1f}%")
            if "trl" in runs and "finetune" in runs and cfg.recipe == "dpo":
                print(reference_agreement(Path(env["FINETUNE_CACHE"]), root / f"{name}-trl-0"))
            if preset.get("grpo") and base:
                print(grpo_summary(name, results))
            if preset.get("distill") and base:
                print(distill_summary(name, results, {c: phase_medians(r, args.skip, args.steps)
                                                      for c, r in runs.items()}))
            if preset.get("pipeline"):  # the measured bubble against the schedule's formula
                for c, launches in runs.items():
                    idle = [x for r in launches for x in r.get("pipeline_idle", [])[args.skip:]]
                    over = [*overrides, *preset["contenders"][c]]
                    if idle:
                        stages = int(next(o for o in over if "pipeline_parallel_size" in o).split("=")[1])
                        m = int(next(o for o in reversed(over) if "gradient_accumulation_steps" in o).split("=")[1])
                        print(f"{name}: {c} measured bubble (train/pipeline_idle: each rank's share of the pipeline "
                              f"schedule outside its forward and backward passes, median over ranks' means and timed "
                              f"steps) {statistics.median(idle):.3f}; (P - 1) / (m + P - 1) = "
                              f"{(stages - 1) / (m + stages - 1):.3f} for P = {stages}, m = {m}", flush=True)
            if preset.get("heldout"):  # every held-out metric of each launch (embed: spearman, MRR@10, ...)
                for c, launches in runs.items():
                    for i, r in enumerate(launches):
                        if r.get("heldout_metrics"):
                            print(f"{name}: {c} round {i} held-out " + ", ".join(
                                f"{k} {v:.4f}" for k, v in sorted(r["heldout_metrics"].items())
                                if isinstance(v, float)), flush=True)
            for r in results:
                print(json.dumps({"bench": name, **r}))
    return status


if __name__ == "__main__":
    sys.exit(main())
