"""The run config: typed dataclasses, YAML/JSON loading and strict ``key=value`` overrides.

Precedence (lowest to highest): **dataclass defaults < run-config file < command-line overrides**.
``finetune.config.load_run_config`` applies them in that order; ``tests/test_config.py`` pins it.

Overrides use dotted paths into the dataclasses (``train.lr=3e-5``, ``data.max_seq_len=256``,
``output_dir=/scratch/run1``) and, under the ``ds.`` prefix, into the DeepSpeed JSON
(``ds.zero_optimization.stage=2``, ``ds.bf16.enabled=false``); the latter are checked in
:mod:`finetune.engine.ds_config`. An unknown key or a value of the wrong type is an error, never
silently ignored (the nanoGPT ``configurator.py`` rule); every problem found is reported
together in one :class:`ConfigError` (the litgpt ``validate_args`` pattern).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from finetune.errors import ConfigError

# Choice fields: the allowed values live in the type and are checked when the config is loaded (_coerce).
Init = Literal["pretrained", "scratch"]
Attention = Literal["sdpa", "eager", "flash_attention_2"]
Truncation = Literal["truncate", "drop"]
Scheduler = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                    "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay"]
LossWeighting = Literal["token", "micro_batch"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
Optimizer = Literal["adamw", "muon"]
PreferenceLoss = Literal["sigmoid", "ipo", "simpo", "orpo"]
GrpoLoss = Literal["dapo", "grpo", "dr_grpo", "bnpo"]
Pooling = Literal["auto", "mean", "cls", "max", "lasttoken"]
ScaleRewards = Literal["group", "batch", "none"]
SamplingLevel = Literal["token", "sequence"]
GenerationBackend = Literal["hf_generate", "hybrid_engine"]
Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
Mode = Literal["min", "max"]
DataFormat = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion"]
QuantType = Literal["nf4", "fp4"]
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]


def choices(choice_type: Any) -> tuple[str, ...]:
    """The allowed values of a choice field's ``Literal`` type, in the order they are declared."""
    return typing.get_args(choice_type)


@dataclass
class LoraConfig:
    """LoRA adapters (``peft``): the base model is frozen, only the low-rank adapters train (docs/lora.md)."""

    r: int = 8
    """Rank of each adapter (``A``: r x in, ``B``: out x r); must be > 0."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's output is multiplied by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1)."""
    target_modules: list = field(default_factory=lambda: ["all-linear"])
    """Modules to adapt, by name (``c_attn`` matches every module whose name is ``c_attn`` or ends with ``.c_attn``), or ``all-linear``: every linear layer except the output layer."""
    use_dora: bool = False
    """DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"; peft's ``use_dora``): each adapted weight split into a trained magnitude vector and a direction that LoRA adapts."""
    use_rslora: bool = False
    """rsLoRA (Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA"; peft's ``use_rslora``): the adapter's output scaled by ``alpha / sqrt(r)`` instead of ``alpha / r``."""
    modules_to_save: list = field(default_factory=list)
    """Modules trained in full beside the adapters and saved in the adapter folder (peft's ``modules_to_save``), by name, e.g. ``[lm_head]``, or ``[embed_tokens, lm_head]`` for new tokens."""
    loraplus_lr_ratio: float = 0.0
    """LoRA+ (Hayou et al. 2024, "LoRA+: Efficient Low Rank Adaptation of Large Models"; peft's ``create_loraplus_optimizer`` groups): the ``B`` matrices and 1-D adapter parameters learn at ``lr`` x this ratio (the paper suggests 16), LoRA on embeddings at 1e-6; 0: off."""


@dataclass
class QuantizationConfig:
    """QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): the frozen base model's linear
    layers stored in 4 or 8 bits by bitsandbytes (transformers' ``BitsAndBytesConfig``), LoRA adapters trained on
    top in ``compute_dtype`` (docs/lora.md). Needs ``model.lora``, ``model.init: pretrained`` and ZeRO stage 0-2."""

    bits: int = 4
    """4 (``load_in_4bit``: 0.5 byte a weight plus one scale per 64 weights) or 8 (``load_in_8bit``, LLM.int8: 1 byte a weight plus one scale per output row)."""
    quant_type: QuantType = "nf4"
    """4-bit data type (``bnb_4bit_quant_type``): ``nf4`` (NormalFloat, the QLoRA paper's) or ``fp4``."""
    double_quant: bool = True
    """4-bit: quantize the per-block scales too (``bnb_4bit_use_double_quant``): about 0.37 bit a weight less."""
    compute_dtype: ComputeDtype = "auto"
    """The dtype the quantized weights are dequantized to for each matmul (``bnb_4bit_compute_dtype``); ``auto``: the run's precision (bfloat16, float16 or float32)."""


@dataclass
class ModelConfig:
    """Where the model and tokenizer come from (local folders only; the Hub is never contacted)."""

    path: str = ""
    """Local folder with ``config.json`` (and the weights when ``init: pretrained``), or a ``.gguf`` file (llama.cpp's format, quantized or not), converted once by transformers' GGUF loader into a cached folder ``<data.cache_dir>/gguf/<sha256>/`` that every rank loads."""
    tokenizer_path: str = ""
    """Local tokenizer folder (or a ``.gguf`` file holding one); empty means ``model.path``."""
    init: Init = "pretrained"
    """``pretrained``: load the weights from ``model.path``; ``scratch``: random init from ``config.json`` only."""
    config_overrides: dict = field(default_factory=dict)
    """Keys set on the model config before building, e.g. ``{num_hidden_layers: 2}`` for a small scratch model."""
    attn_implementation: Attention = "sdpa"
    """Attention kernel passed to transformers: ``sdpa`` (PyTorch scaled-dot-product), ``eager`` or ``flash_attention_2`` (needs ``flash-attn``, GPUs)."""
    lora: LoraConfig | None = None
    """LoRA adapters (``model.lora.r=8`` on the command line turns them on with the defaults below); null: full fine-tuning."""
    quantization: QuantizationConfig | None = None
    """QLoRA: the frozen base quantized by bitsandbytes (``model.quantization.bits=4`` turns it on with the defaults below; needs ``model.lora``); null: the base in the run's precision."""
    freeze: list = field(default_factory=list)
    """Parts of the model that do not train (no gradient, no optimizer state, exported as loaded): ``vision_tower``, ``projector``, ``language_model`` (a multimodal model's parts, resolved per architecture as LLaMA-Factory's ``freeze_*`` keys are: finetune.engine.freeze) or any dotted module path; empty: everything trains."""
    fused_kernels: bool = True
    """Replace modules that transformers computes as a chain of Python ops with one fused kernel of the same function before training (GPT-2's ``gelu_new`` -> ``F.gelu(approximate="tanh")``, :mod:`finetune.engine.kernels`): same values up to the run's own rounding (fp32: 4.8e-7 at most; bf16/fp16: one unit in the last place, the fused kernel being the more accurate), less activation memory; on CPU ranks also ``sdpa`` attention with dropout through :class:`finetune.engine.kernels.DropoutAttention` (SDPA's function, 5 bytes per attention score kept for the backward instead of 12); false keeps the model's own modules and attention."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (transformers' non-reentrant gradient checkpointing): less memory, about a third more compute."""
    offload_activations: bool = False
    """With ``gradient_checkpointing``: keep the checkpointed hidden states (each layer's input, ``[micro_batch, seq, hidden]``) in pinned host memory instead of on the GPU, copied back for the backward pass (``torch.autograd.graph.save_on_cpu``; ALST's activation-checkpoint offload). Exact; costs host-device transfers. No effect on CPU ranks."""


@dataclass
class DataConfig:
    """Local parquet inputs and how they become token batches."""

    train_files: list = field(default_factory=list)
    """Parquet files or glob patterns for the training split."""
    validation_files: list = field(default_factory=list)
    """Parquet files or globs for validation; empty means hold out ``validation_fraction`` of train."""
    validation_fraction: float = 0.05
    """Fraction of training rows held out for validation (fixed ``train.seed``) when no validation files."""
    text_column: str = "text"
    """Name of the text column in every parquet file."""
    text_pair_column: str = ""
    """seq_cls only: second text column for sentence pairs (NLI, paraphrase), tokenized as a pair; empty: single texts."""
    label_column: str = "label"
    """seq_cls: class label column (ints or strings; the sorted training labels become the model's id2label); kto: the desirability column (bool, or ints 0/1: true = desirable)."""
    max_seq_len: int = 128
    """Tokens per row: truncation length (MLM, unpacked CLM) or block length (packed CLM); token_cls: the window length of longer rows; qa: the length of each window of question and context."""
    tokens_column: str = "tokens"
    """token_cls only: a column of word lists (one sentence per row)."""
    tags_column: str = "ner_tags"
    """token_cls only: a column of tag lists, one tag per word (strings in the BIO/IOB2/BIOES scheme, read as they are, or int class ids; the sorted training tags become the model's id2label)."""
    label_all_tokens: bool = False
    """token_cls only: every sub-token of a word is labelled (its ``B-`` tag turned into ``I-``), not only the first (transformers' ``run_ner.py`` flag of the same name)."""
    doc_stride: int = 32
    """token_cls and qa: tokens each window of a row longer than ``max_seq_len`` shares with the previous window (``run_qa.py``'s ``doc_stride``); below ``max_seq_len`` minus the special tokens (qa: minus the question too)."""
    question_column: str = "question"
    """qa only: the question column (text)."""
    context_column: str = "context"
    """qa only: the context column (text the answer is a span of)."""
    answers_column: str = "answers"
    """qa only: the answers column, SQuAD's form: ``{text: [str], answer_start: [int]}`` (character offsets into the context; empty lists for an unanswerable question)."""
    version_2_with_negative: bool = False
    """qa only: questions may have no answer (SQuAD 2.0): evaluation may predict the null answer, chosen when its score beats the best span's by more than ``null_score_diff_threshold`` (``run_qa.py``'s flag of the same name)."""
    max_answer_length: int = 30
    """qa only: longest answer span, in tokens, that evaluation predicts (``run_qa.py``'s)."""
    n_best_size: int = 20
    """qa only: start and end positions evaluation pairs per window, the best of each (``run_qa.py``'s)."""
    null_score_diff_threshold: float = 0.0
    """qa with ``version_2_with_negative``: the null answer is predicted when its score minus the best span's exceeds this (``run_qa.py``'s)."""
    anchor_column: str = "anchor"
    """embed only: the anchor (query) column (text)."""
    positive_column: str = "positive"
    """embed only: the positive column (text that the anchor should be close to: a paraphrase, an answering passage)."""
    negative_column: str = ""
    """embed only: a hard-negative column (text close in form but not in meaning to the anchor; triplets); empty: pairs, the other rows' positives the only negatives."""
    score_column: str = ""
    """embed only: a column of pair similarity scores in [0, 1] (STS-B's 0-5 over 5): evaluation reports the Spearman correlation of the cosine similarity with it (``eval/spearman``), and a pair scored below ``train.embed.relevant_score`` is no positive pair (no loss term of its own; its texts stay in-batch negatives); empty: every pair is positive."""
    packing: bool = True
    """gpt_clm: concatenate texts (EOS between) and cut into full ``max_seq_len`` blocks, so no pad tokens; sft: best-fit pack whole examples into rows of ``max_seq_len`` (position ids restart, attention never crosses examples)."""
    prompt_column: str = ""
    """sft, vlm_sft, dpo, kto, reward and grpo: prompt column (text, no loss), used verbatim: put any separator into it; sft: with ``response_column``; dpo, kto and reward: text or a list of ``{role, content}`` messages, empty means ``prompt``."""
    response_column: str = ""
    """sft and vlm_sft: response column (text, trained on; sft: followed by EOS); with ``prompt_column`` (vlm_sft: the prompt a user turn that shows the row's images, then the prompt's text)."""
    completion_column: str = "completion"
    """kto only: the completion column (text, or a list of assistant messages when the prompt is a list of messages; TRL's unpaired form)."""
    chosen_column: str = "chosen"
    """dpo and reward: the preferred response (text, or a list of assistant messages when the prompt is a list of messages)."""
    rejected_column: str = "rejected"
    """dpo and reward: the dispreferred response, in the form of ``chosen_column``."""
    reward_columns: list = field(default_factory=lambda: ["answer"])
    """grpo only: columns passed to the reward functions as keyword arguments, one value per completion (TRL's ``**kwargs``; ``exact_match`` reads the first); every file must have them."""
    margin_column: str = ""
    """reward only: a numeric column of per-pair margins ``m`` (TRL's ``margin``): the loss is ``-log sigma(r_chosen - r_rejected - m)``; empty: no margin (a ``margin`` column in the files is then ignored, with a warning)."""
    format: DataFormat = "auto"
    """sft only: the form of the rows (finetune.data.formats): ``messages`` (OpenAI/TRL ``{role, content}`` lists), ``sharegpt`` (``conversations`` of ``{from, value}``), ``alpaca`` (``instruction``, ``input``, ``output``), ``prompt_completion`` (TRL's ``prompt``/``completion``, text or messages); ``auto``: the column keys when set, else recognised from the files' columns (one log line says which)."""
    messages_column: str = ""
    """sft only: chat column, a list of ``{role, content}`` per row; the loss is on every assistant turn."""
    tools_column: str = ""
    """sft only, with ``messages_column``: a column of the tools each conversation may call, a list of JSON schemas or that list as JSON text (TRL's ``tools`` column); the chat template renders them (``apply_chat_template(tools=...)``) as ``grpo`` renders ``train.grpo.tools`` and ``environment`` into its prompts; empty: no tools."""
    image_column: str = "images"
    """vlm_sft, and grpo and dpo on an image-text model (a ``model.path`` whose config has a ``vision_config``): a column of each row's images, a list of images as ``datasets.Image`` stores them (``{bytes, path}``) or of file paths (relative ones to the parquet file's folder), in the order of the ``{"type": "image"}`` parts of ``messages_column`` (TRL's conversational vision form)."""
    min_pixels: int = 0
    """Image-text recipes: each image smaller than this many pixels (width x height) is enlarged, its aspect ratio kept (bicubic), before the processor; a processor with its own ``min_pixels`` (Qwen2.5-VL) gets it too; 0: the processor's own setting."""
    max_pixels: int = 0
    """Image-text recipes: each image larger than this many pixels is shrunk, its aspect ratio kept (bicubic), before the processor (fewer image tokens per image where the processor makes them by size); a processor with its own ``max_pixels`` (Qwen2.5-VL) gets it too; 0: the processor's own setting."""
    chat_template: str = ""
    """sft, dpo, kto and reward: Jinja chat template for ``messages_column`` (a template string, or a file path like ``data/chat_templates/chatml.jinja``); empty: the tokenizer's own."""
    truncation: Truncation = "truncate"
    """sft, dpo, kto and reward: an example longer than ``max_seq_len`` is cut to it (``truncate``) or left out (``drop``); counted in the log."""
    group_by_length: bool = True
    """Fill each global batch with rows of similar length (mega-batches sorted by length, shuffled as batches, as
    transformers' ``LengthGroupedSampler``): less padding, no rank waiting for a wider one. No effect on packed rows."""
    mlm_probability: float = 0.15
    """MLM only: fraction of tokens selected for masking (BERT: 80% [MASK], 10% random, 10% kept)."""
    pad_to_multiple_of: int = 0
    """Pad each batch to a multiple of this (8 helps tensor cores); 0 pads to the longest row only."""
    cache_dir: str = ""
    """Where tokenized datasets are cached; empty means ``$FINETUNE_CACHE`` or ``~/.cache/finetune``."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: collate in the training process). Resume is exact with any value:
    MLM masks are seeded per row from ``(train.seed, epoch, row index)``, not from the RNG state."""
    sources: list = field(default_factory=list)
    """A weighted mixture instead of ``train_files``: a list of ``{name, train_files, weight}`` mappings, each optionally with its own ``validation_files``, ``validation_fraction``, ``max_train_rows`` and columns (``text_column``, ``prompt_column``, ``messages_column``, ...); each epoch draws rows from the sources in proportion to their weights (docs/data.md, mixtures)."""
    num_proc: int = 0
    """Processes that tokenize on each node (its local rank 0 forks them; the node's other ranks wait meanwhile);
    0: the CPUs that rank may use, at most 32. The tokenized rows are the same for any value."""
    max_train_rows: int = 0
    """Use only the first N training rows (0: all); for smoke tests."""
    tokenize_timeout_minutes: float = 1440.0
    """Minutes the other ranks wait for rank 0's first-time tokenization (a limit of its own: a large dataset
    takes longer than ``train.dist_timeout_minutes``, the limit of the training collectives)."""


@dataclass
class DpoConfig:
    """Preference training (recipe ``dpo``): the loss over chosen/rejected pairs (docs/preference.md)."""

    loss_type: PreferenceLoss = "sigmoid"
    """``sigmoid``: DPO (Rafailov et al. 2023); ``ipo``: IPO (Azar et al. 2023, length-averaged log-probabilities); ``simpo``: SimPO (Meng et al. 2024, length-averaged, no reference model); ``orpo``: ORPO (Hong et al. 2024: chosen NLL + beta x log odds ratio, no reference model)."""
    beta: float = 0.1
    """Temperature of the implicit reward ``beta * (log pi - log pi_ref)`` (SimPO: ``beta * average log pi``); > 0. TRL's default 0.1; SimPO's paper uses 2 to 2.5 (a SimPO run far from it is warned about)."""
    label_smoothing: float = 0.0
    """Probability that a pair's preference is flipped (conservative DPO, cDPO: Mitchell 2023; not TRL 1.16's ``sigmoid``, which has none); in [0, 0.5). sigmoid and simpo only (refused with ipo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin ``gamma`` (TRL's ``simpo_gamma``; the paper's gamma/beta ratio 0.5 at beta 1)."""
    rpo_alpha: float = 0.0
    """Weight of an SFT term: each pair's loss adds ``rpo_alpha`` x the chosen response's mean token negative log-likelihood (RPO, Pang et al. 2024; TRL 1.16 has no such option); 0: off."""


@dataclass
class KtoConfig:
    """Preference training on unpaired rows (recipe ``kto``): KTO's loss (Ethayarajh et al. 2024; docs/preference.md)."""

    beta: float = 0.1
    """Temperature of the implicit reward ``beta * (log pi - log pi_ref)``; > 0. TRL's default 0.1."""
    desirable_weight: float = 1.0
    """Weight of a desirable row's loss (TRL's ``desirable_weight``; the paper's lambda_D); > 0."""
    undesirable_weight: float = 1.0
    """Weight of an undesirable row's loss (TRL's ``undesirable_weight``; the paper's lambda_U); > 0."""


@dataclass
class RewardConfig:
    """Reward-model training (recipe ``reward``): the pairwise loss's extra term (docs/reward.md)."""

    center_rewards_coefficient: float = 0.0
    """Weight of ``(r_chosen + r_rejected)^2`` added to each pair's loss, pulling rewards towards mean zero (Eisenstein et al. 2023, eq. 2; TRL's ``center_rewards_coefficient``, which recommends 0.01); >= 0, 0: off."""
    share_prefix: bool = True
    """Run each pair as one row, chosen then the rejected sequence's tokens after the longest token prefix the two share, the rejected ones attending to that prefix through a block mask (Wang et al. 2024, "Accelerating Direct Preference Optimization with Prefix Sharing", arXiv:2410.20305): the same scores, the shared tokens computed once. Decoder classifiers (a ``score`` head) under ``sdpa`` or ``eager``; other models and kernels run the two sequences as separate rows (docs/reward.md)."""


@dataclass
class GrpoConfig:
    """Online RL from rewards (recipe ``grpo``): generation, rewards and the clipped policy loss; defaults are TRL
    1.16's ``GRPOConfig`` (docs/online-rl.md)."""

    num_generations: int = 8
    """Completions sampled per prompt (the group ``G`` whose rewards give the advantages); >= 2. A micro-batch of ``B`` prompts trains on ``B x G`` completions."""
    max_completion_length: int = 256
    """Tokens generated per completion at most (TRL's default is 512)."""
    temperature: float = 1.0
    """Sampling temperature; the training log-probabilities divide the logits by it too (as TRL); > 0."""
    top_p: float = 1.0
    """Nucleus sampling's probability mass (1: off)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    loss_type: GrpoLoss = "dapo"
    """How token losses are averaged (docs/online-rl.md): ``dapo`` over the active completion tokens of the whole global batch (every rank and accumulation step, exactly); ``grpo`` per completion over its tokens, then over completions; ``dr_grpo`` over completions x ``max_completion_length``; ``bnpo`` over each micro-batch's active tokens (TRL's local batch), then over micro-batches."""
    epsilon: float = 0.2
    """Lower clip of the importance ratio, ``1 - epsilon``, and the upper one when ``epsilon_high`` is 0; > 0."""
    epsilon_high: float = 0.0
    """Upper clip ``1 + epsilon_high`` (DAPO's clip-higher; its paper uses 0.28); 0: ``epsilon``."""
    beta: float = 0.0
    """Weight of the per-token KL to the reference (the k3 estimator, as TRL); 0: no reference pass. With LoRA the reference is the base model (adapters off); a full fine-tune with ``beta`` > 0 is refused (it would keep a second copy of the model)."""
    num_iterations: int = 1
    """Optimizer steps per generation batch (``mu``, TRL's ``num_iterations``): the sampler repeats each step's prompts this many times in a row; the first step generates, the others reuse its completions with importance ratios to the policy that generated them (its log-probabilities, one more no-gradient forward per generation batch), so ``epsilon``'s clipping acts; an epoch counts the repeated steps; a checkpoint between them keeps the batch (exact resume). 1: the ratio is 1 in value and its gradient that of the policy gradient."""
    importance_sampling_level: SamplingLevel = "token"
    """``token``: one importance ratio per token; ``sequence``: one per completion, the exponent of its tokens' mean log-ratio (GSPO, Zheng et al. 2025)."""
    scale_rewards: ScaleRewards = "group"
    """Advantages ``r - mean(group)`` divided by the group's standard deviation (``group``), the global batch's (``batch``, Dr. GRPO's remark), or not at all (``none``); + 1e-4 as TRL."""
    mask_truncated_completions: bool = False
    """Leave completions that reach ``max_completion_length`` without an EOS out of the loss (DAPO)."""
    rewards: list = field(default_factory=lambda: ["exact_match"])
    """Reward functions, summed with ``reward_weights``: built-ins ``exact_match`` (1 when the completion's answer, found by ``answer_pattern``, equals that of the first ``data.reward_columns`` column), ``format`` (1 when ``format_pattern`` matches the completion), ``length`` (DAPO's soft overlong penalty, 0 to -1 over the last ``length_cache`` tokens), a reward model folder (a ``reward`` export: any one-label ``AutoModelForSequenceClassification`` with its tokenizer; metric name ``reward_model``), or ``path/to/file.py:function`` with TRL's signature ``f(prompts, completions, **columns) -> list[float | None]``."""
    reward_weights: list = field(default_factory=list)
    """One weight per reward function; empty: all 1."""
    answer_pattern: str = "#### (-?[0-9.,]+)"
    """``exact_match``: regular expression that finds the answer in the completion and the reference column (its first group when it has one; GSM8K's default)."""
    format_pattern: str = ""
    """``format``: regular expression the completion must match (``re.search``, dot matches newline)."""
    length_cache: int = 0
    """``length``: tokens before ``max_completion_length`` where the penalty starts (DAPO's overlong buffer); 0: a quarter of ``max_completion_length``."""
    gather_for_generation: bool = True
    """ZeRO-3: gather the whole model on every rank once per generation round (TRL's ``ds3_gather_for_generation``); false: generate layer by layer with ``synced_gpus`` (slower; for models that do not fit gathered)."""
    fast_generation: bool = True
    """Generation prefills each prompt once for its ``num_generations`` completions (its KV cache repeated, reserved for the whole completion: no per-token concatenation) and samples by inverting the cumulative distribution (one random number per completion and token, where ``torch.multinomial`` draws one per vocabulary entry): the same greedy completions and sampling distribution as transformers' ``generate`` with ``num_return_sequences``, other draws for a seed; false: that ``generate`` call as it is. ``synced_gpus`` generation (``gather_for_generation: false``) always runs the latter."""
    share_prompt: bool = True
    """Train each prompt's ``num_generations`` sequences as one row: the prompt once, then its completions, each attending to the prompt and to itself only (a block attention mask; prefix sharing, as ``train.reward.share_prefix``): the same log-probabilities and gradients as separate sequences, the prompt's tokens computed once instead of ``num_generations`` times. Needs an attention implementation that takes a 4D mask (``sdpa``, ``eager``); under ``flash_attention_2`` the sequences run separately."""
    generation_backend: GenerationBackend = "hf_generate"
    """What generates the completions, behind DeepSpeed's rollout interface (``deepspeed.runtime.rollout``): ``hf_generate`` (transformers' ``generate`` on the engine's module; every device, ZeRO stage and LoRA) or ``hybrid_engine`` (DeepSpeed's ``HybridEngineRollout`` on its hybrid engine: DeepSpeed's inference kernels for the generation, CUDA GPUs only, ZeRO 0-2, no LoRA, GPT-2 / GPT-Neo / GPT-NeoX / GPT-J / BLOOM / OPT / Llama models; ``finetune selftest`` checks it on a GPU node)."""
    log_completions: int = 4
    """Completions written to ``<run>/completions.jsonl`` at every logged step (prompt, completion, rewards, advantage, with tools the turns, and the completion's token ids with the mask the loss used: ``finetune inspect --completions <run>`` shows them); 0: none."""
    tools: list = field(default_factory=list)
    """Tools the model may call, ``path/to/file.py:function`` each (TRL's ``tools``): Python functions with type hints and a Google-style docstring, offered through the chat template (``apply_chat_template(tools=...)``; prompts must be conversations). A completion that calls them gets their results and continues (multi-turn; :mod:`finetune.recipes.grpo.tools`); the results' tokens are never trained. Example: ``[data/tools/calculator.py:calculate]``."""
    environment: str = ""
    """An environment class or factory, ``path/to/file.py:Factory`` (TRL's ``environment_factory``): one instance per rollout, ``reset(**row)`` with the row's ``data.reward_columns``, its public methods offered as tools, and its ``get_reward()`` (when it has one) a reward of weight 1 named after the class. Example: ``data/environments/guess_number.py:GuessNumber``."""
    max_tool_calling_iterations: int = 4
    """Tool turns per rollout at most (TRL's ``max_tool_calling_iterations``); the completion's tokens, tool results included, stay within ``max_completion_length``."""
    tool_timeout_s: float = 10.0
    """Seconds a tool call may run; past it the model reads a timeout error (counted in ``tools/failure_frequency``) and the rollout goes on."""


@dataclass
class DistillConfig:
    """Knowledge distillation (recipe ``distill``): the teacher, the divergence and the on-policy share
    (docs/distillation.md)."""

    teacher: str = ""
    """The teacher: a local model folder (``config.json`` and weights, any ``AutoModelForCausalLM``) or a ``.gguf`` file (converted once, as ``model.path``'s), whose tokenizer has the student's vocabulary; frozen, in eval mode, without optimizer state, partitioned like the student under ZeRO-3."""
    loss: Divergence = "forward_kl"
    """The divergence per trained token between the teacher's and the student's next-token distributions at ``temperature``: ``forward_kl`` KL(teacher || student) (Hinton et al. 2015's soft targets), ``reverse_kl`` KL(student || teacher) (MiniLLM; mode seeking), ``jsd`` the generalized Jensen-Shannon divergence with ``beta`` (GKD: Agarwal et al. 2024; TRL's ``beta``)."""
    beta: float = 0.5
    """``jsd``: the mixture ``m = (1 - beta) p_student + beta p_teacher``, loss ``beta KL(p_teacher || m) + (1 - beta) KL(p_student || m)``; in (0, 1) (TRL's ``beta`` at 0 is ``forward_kl``, at 1 ``reverse_kl``)."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the divergence, and on-policy completions are sampled at it (TRL's ``temperature``); > 0. The cross-entropy term uses temperature 1."""
    alpha: float = 1.0
    """Loss per trained token: ``alpha x divergence + (1 - alpha) x cross-entropy`` of the row's own next token; in [0, 1]; 1: distillation only (TRL's), 0: plain SFT."""
    on_policy_fraction: float = 0.0
    """Share of the training rows (GKD's ``lmbda``) whose response is replaced, each step, by a completion the student samples from the row's prompt (the text before its first trained token), through the rollout engine ``grpo`` uses; the teacher scores it token by token. Each row is chosen by its own seed, so a resume draws the same rows and completions. In [0, 1]; > 0 needs ``data.packing: false``. 1: TRL's ``DistillationTrainer`` (every row on-policy)."""
    max_completion_length: int = 128
    """On-policy rows: tokens sampled per completion at most."""
    top_p: float = 1.0
    """On-policy sampling: nucleus sampling's probability mass (1: off)."""
    top_k: int = 0
    """On-policy sampling: the k most likely tokens only (0: all)."""
    gather_for_generation: bool = True
    """ZeRO-3: gather the student's weights on every rank for the on-policy generation (as ``train.grpo.gather_for_generation``); false: generate layer by layer with ``synced_gpus``."""
    cache_top_k: int = 0
    """Offline only: compute the teacher's ``k`` most likely next tokens and their log-probabilities (at ``temperature``) at every trained position of the training split once, before training, cached on disk (``<data.cache_dir>/teacher/``, keyed by the tokenized split, the teacher's files, ``k``, ``temperature``, the student's vocabulary size and the precision, as ``dpo``'s reference cache) and reused by later runs; training then runs no teacher forward, and both models are compared on those ``k`` ids plus one bucket holding the rest of each one's probability (exact when ``k`` is the vocabulary size). Costs ``8 k`` bytes of disk per trained token of the split, memory-mapped (a node's ranks share it in the page cache). Evaluation still runs the teacher. 0: off."""


@dataclass
class EmbedConfig:
    """Sentence-embedding training (recipe ``embed``): pooling and the multiple-negatives ranking loss
    (docs/encoders.md)."""

    scale: float = 20.0
    """The similarity scale: the loss is the cross-entropy of ``scale x cosine similarity`` (sentence-transformers' ``MultipleNegativesRankingLoss`` ``scale``, the inverse temperature of InfoNCE); > 0."""
    symmetric: bool = False
    """Also the loss of each positive retrieving its anchor among the batch's anchors, the two averaged (sentence-transformers' ``MultipleNegativesSymmetricRankingLoss``; CLIP's symmetric loss)."""
    gather_across_ranks: bool = True
    """The in-batch negatives of every anchor are the positives (and hard negatives) of every data-parallel rank's micro-batch, gathered with their gradient (``torch.distributed.nn.all_gather``; sentence-transformers' ``gather_across_devices``): 8 ranks give 8x the negatives. false: each rank's micro-batch alone."""
    mask_duplicates: bool = True
    """A candidate that is the same text as an anchor's own positive (one paragraph answering several questions of the batch; the same tokens after truncation) is no negative for that anchor: its logit is left out of the anchor's softmax, and with ``symmetric`` so is an anchor that repeats a positive's own anchor. sentence-transformers keeps such false negatives in its loss and avoids them by sampling instead (``BatchSamplers.NO_DUPLICATES``). false: every other candidate is a negative."""
    cached: bool = False
    """Gradient cache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"; sentence-transformers' ``CachedMultipleNegativesRankingLoss``): the negatives are the whole global batch (every micro-batch of the step on every rank), at the memory of one micro-batch: a first pass without gradients embeds every micro-batch, the loss's gradient with respect to each embedding is computed once, then each micro-batch runs again with its gradient. Costs one more forward per micro-batch; dropout draws the same masks in both passes."""
    pooling: Pooling = "auto"
    """How token states become one embedding: ``mean`` over real tokens, ``cls`` (the first token), ``max``, ``lasttoken`` (the last real token, for decoders); ``auto``: the sentence-transformers folder's ``1_Pooling/config.json`` when ``model.path`` is one, else ``mean``."""
    normalize: bool = False
    """The export's embeddings are unit length (a sentence-transformers ``Normalize`` module); a sentence-transformers ``model.path`` that has one keeps it. The loss and the evaluation use the cosine similarity either way."""
    relevant_score: float = 0.8
    """With ``data.score_column``: pairs scored at least this are positive pairs (trained on; the queries of the retrieval evaluation)."""


@dataclass
class EvalGenerateConfig:
    """Generation during evaluation (causal-LM recipes): answers to validation prompts, scored (docs/evaluation.md)."""

    prompts: int = 0
    """Validation examples to generate answers for at every evaluation (the first N of the validation split, shared between the ranks); 0: off."""
    max_new_tokens: int = 128
    """Tokens generated per prompt at most."""
    temperature: float = 0.0
    """0: greedy decoding; > 0: sampling at this temperature, seeded with ``train.seed`` (the same at every evaluation)."""
    top_p: float = 1.0
    """With sampling: nucleus sampling's probability mass (1: off)."""
    stop: list = field(default_factory=list)
    """Strings that end a generation early (transformers' ``stop_strings``), besides the EOS token."""
    answer_pattern: str = ""
    """Regular expression that finds the answer in the reference and in the output (its first group when it has one), for ``eval/generation_exact_match``; e.g. GSM8K's ``#### (-?[0-9.,]+)``; empty: no exact match."""


@dataclass
class EarlyStoppingConfig:
    """Stop when an evaluation metric stops improving (as HF Trainer's ``EarlyStoppingCallback``; docs/evaluation.md)."""

    patience: int = 0
    """Evaluations in a row without an improvement after which the run stops (a complete checkpoint, then the export as at the end); 0: off. Needs ``train.eval_every``."""
    metric: str = "eval/loss"
    """The evaluation metric watched: a key of ``metrics.jsonl`` (``eval/loss``, ``eval/perplexity``, ``eval/accuracy``, ``eval/rewards/accuracies``, ...)."""
    mode: Mode = "min"
    """``min``: lower is better; ``max``: higher is better."""
    min_delta: float = 0.0
    """An evaluation improves only when it beats the best value so far by more than this (>= 0)."""


@dataclass
class KeepBestConfig:
    """Keep the best checkpoint by an evaluation metric and export it (as HF Trainer's ``load_best_model_at_end``)."""

    metric: str = ""
    """Evaluation metric that ranks the checkpoints (e.g. ``eval/loss``); a checkpoint is saved at every evaluation, the best one is never pruned by ``train.keep_last_checkpoints`` and the export is made from it; empty: off."""
    mode: Mode = "min"
    """``min``: lower is better; ``max``: higher is better."""


@dataclass
class TrainConfig:
    """Batch sizes, optimizer, schedule and the step cadence of eval, logging and checkpoints."""

    micro_batch_size: int = 8
    """Rows per rank per forward pass (DeepSpeed ``train_micro_batch_size_per_gpu``)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step on each rank."""
    epochs: int = 1
    """Passes over the training data (ignored when ``max_steps`` > 0)."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means ``epochs`` full passes."""
    optimizer: Optimizer = "adamw"
    """``adamw``, or ``muon``: DeepSpeed's Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
    networks") on the 2-D hidden matrices, with an auxiliary AdamW (``lr``, ``adam_beta1/2``, ``adam_eps``) on the
    embeddings, the output head and every 1-D parameter (norms, biases), as in Jordan's Muon and Liu et al. 2025, "Muon
    is Scalable for LLM Training" (Moonlight); ZeRO 1-3, without LoRA, tensor or sequence parallelism (see
    docs/deepspeed.md)."""
    muon_lr: float = 0.02
    """Peak learning rate of the Muon matrices (``optimizer: muon``; the LR schedule scales it as it scales ``lr``).
    Default 0.02, Jordan et al. 2024's value (DeepSpeed's ``muon_lr``)."""
    muon_momentum: float = 0.95
    """Nesterov momentum of Muon (``optimizer: muon``); default 0.95, Jordan et al. 2024 and Moonlight's value."""
    lr: float = 5e-5
    """Peak learning rate of AdamW (with ``optimizer: muon``: of the auxiliary AdamW)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of AdamW, and of Muon with ``optimizer: muon`` (Moonlight's fix for Muon at scale);
    never on biases and normalization weights."""
    neftune_noise_alpha: float = 0.0
    """NEFTune (Jain et al. 2023; transformers' ``neftune_noise_alpha``, TRL's): uniform noise of magnitude ``alpha / sqrt(L x hidden)``, ``L`` each example's length (packed examples apart, pads without noise), on the input embeddings in training forwards only, never in evaluation, generation or the export; ``sft`` and ``gpt_clm``; the paper uses 5-15; 0: off."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    lr_scheduler: Scheduler = "linear"
    """transformers ``get_scheduler`` name: ``linear``, ``cosine``, ``constant_with_warmup``, ``constant``."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (DeepSpeed ``gradient_clipping``); 0 disables."""
    loss_weighting: LossWeighting = "token"
    """``token``: exact mean over all target tokens of the global batch; ``micro_batch``: DeepSpeed's plain mean of micro-batch means."""
    eval_every: int = 0
    """Evaluate every N optimizer steps (0: only at the end)."""
    eval_on_start: bool = False
    """Also evaluate before the first optimizer step (step 0) of a fresh run, so curves start where training did."""
    eval_max_batches: int = 0
    """Cap on eval micro-batches per rank (0: the whole validation split)."""
    eval_micro_batch_size: int = 0
    """Rows per rank per evaluation batch (HF Trainer's ``per_device_eval_batch_size``); 0: ``train.micro_batch_size``. Evaluation keeps no gradients, so it can take larger batches: a generating evaluation (``grpo``'s greedy answers, ``train.eval_generate``) decodes a batch in as many steps as one row, so fewer, larger batches take less time. Under sequence parallelism it must equal the micro batch (Ulysses cuts every batch alike)."""
    save_every: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end)."""
    keep_last_checkpoints: int = 0
    """Keep the newest N complete checkpoints, removing older ones once a newer one is complete (never the one resumed from or exported); 0 keeps all."""
    log_every: int = 10
    """Log train loss, lr, grad norm, tokens/s, padding ratio, the step-time split (timed on that step only) and MFU every N optimizer steps."""
    sample_prompt: str = ""
    """gpt_clm and sft: after the export, rank 0 prints the export's continuation of this prompt and writes it to ``sample.txt``; empty: no sample."""
    sample_tokens: int = 120
    """New tokens of the end-of-run sample."""
    sample_temperature: float = 0.0
    """Sampling temperature of the end-of-run sample; 0: greedy decoding (the most likely token at each step)."""
    sample_top_k: int = 0
    """With ``sample_temperature`` > 0: sample among the k most likely tokens only (0: all tokens). The sample is seeded with ``train.seed``, so a run's sample is reproducible."""
    precision: Precision = "auto"
    """``auto`` (bf16 on GPUs that support it, else fp16; fp32 on CPUs; an explicit bf16/fp16 ``enabled`` in the DeepSpeed JSON wins), ``fp32``, ``bf16`` or ``fp16``."""
    seed: int = 42
    """Seed for init, shuffling, masking, dropout and the validation split."""
    dist_timeout_minutes: float = 10.0
    """Collective-operation timeout: a dead rank makes the others fail after this long, not hang."""
    op_build_dir: str = ""
    """Folder DeepSpeed builds its just-in-time ops in (``TORCH_EXTENSIONS_DIR`` of the ranks; ``{job}`` becomes
    ``SLURM_JOB_ID``, ``local`` outside Slurm), e.g. ``/tmp/torch_extensions_{job}``: a job killed during a build then
    leaves its lock where no other job waits for it, at the cost of one build per job; empty: ``TORCH_EXTENSIONS_DIR``
    or torch's default ``~/.cache/torch_extensions/<python>_<accelerator>``, shared by every launch of the user."""
    max_bad_steps: int = 3
    """Consecutive optimizer steps with a non-finite loss or gradient norm (each skipped: no update) after which the run stops with an error."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Preference loss of the ``dpo`` recipe."""
    kto: KtoConfig = field(default_factory=KtoConfig)
    """Loss of the ``kto`` recipe (unpaired desirable/undesirable rows)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Loss of the ``reward`` recipe (a reward model trained on chosen/rejected pairs)."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """Generation, rewards and loss of the ``grpo`` recipe (online RL)."""
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    """Pooling and loss of the ``embed`` recipe (sentence embeddings)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Teacher, divergence and on-policy share of the ``distill`` recipe (knowledge distillation)."""
    eval_generate: EvalGenerateConfig = field(default_factory=EvalGenerateConfig)
    """Generation during evaluation: exact match and ROUGE-L of answers to validation prompts."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when an evaluation metric stops improving."""
    keep_best: KeepBestConfig = field(default_factory=KeepBestConfig)
    """Keep and export the best checkpoint by an evaluation metric."""


@dataclass
class ParallelConfig:
    """How the ranks split the work besides data parallelism (:mod:`finetune.parallel`)."""

    tensor_parallel_size: int = 1
    """Ranks that share each layer's weights (DeepSpeed AutoTP training: attention and MLP projections split by
    columns/rows, the same rows on every rank of a group); causal-LM recipes ``gpt_clm`` and ``sft`` on models AutoTP
    partitions (Llama, Qwen2, Qwen3; not GPT-2), ZeRO 0-2, without LoRA; 1: off. Data-parallel size = world size /
    this."""

    sequence_parallel_size: int = 1
    """Ranks that share each sequence (DeepSpeed Ulysses / ALST: each holds ``seq / size`` tokens of every row and
    attention exchanges heads for sequence with all-to-all); causal-LM recipes ``gpt_clm`` and ``sft``; 1: off.
    Data-parallel size = world size / this."""
    expert_parallel_size: int = 1
    """Ranks that share the experts of each mixture-of-experts layer (DeepSpeed AutoEP: each rank of a group holds
    ``experts / size`` of them and tokens travel to their experts by all-to-all; everything else, and the rows, stay
    data-parallel over all ranks); recipe ``gpt_clm`` on models with an AutoEP preset (Qwen3-MoE, Mixtral, ...),
    without LoRA, Muon, sequence or tensor parallelism; 1: off. The data-parallel size stays the world size."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (DeepSpeed's ``PipelineModule``/``PipelineEngine``, 1F1B schedule): each stage holds a
    contiguous slice of the layers and the micro-batches of a step flow through them
    (:mod:`finetune.parallel.pipeline`); recipes ``gpt_clm``, ``sft`` (LoRA too) and ``bert_mlm`` on Llama, Qwen2,
    Qwen3, Mistral, GPT-2 and BERT, ZeRO 0-1, without sequence, tensor or expert parallelism; 1: off. Data-parallel
    size = world size / this."""
    pipeline_partition_method: str = "compute"
    """How the layers are split into stages: ``compute`` (balanced matrix-multiply work per token: the layers' and
    the head's weights, the embedding lookups free), or DeepSpeed's ``partition_method`` ``parameters`` (balanced
    parameter counts: the embedding weighs as much as the head), ``uniform`` (balanced layer counts) or
    ``type:<regex>`` (balanced counts of the layers whose class name matches, e.g. ``type:Decoder``)."""
    tiled_mlp: bool = False
    """Compute each layer's MLP (modules named ``*.mlp``: Llama, Qwen, Mistral, GPT-2) in tiles of about
    ``hidden_size`` tokens along the sequence, recomputed in backward (DeepSpeed's ``TiledMLP``, from ALST): its
    ``[seq, intermediate]`` activations never exist whole. Exact (the MLP is position-wise), a second MLP forward
    per step; for long sequences, with or without sequence parallelism."""


@dataclass
class RunConfig:
    """One training run: recipe, model, data, DeepSpeed config, training schedule and run folder."""

    recipe: str = ""
    """Task recipe: ``bert_mlm``, ``gpt_clm``, ``seq_cls``, ``token_cls``, ``qa``, ``sft``, ``dpo``, ``kto``, ``reward``, ``grpo``, ``vlm_sft`` or ``distill`` (see ``finetune/recipes``)."""
    output_dir: str = ""
    """Run folder: logs, TensorBoard events, checkpoints, export and the resolved configs. Exactly this folder; a folder that already holds a run is refused unless ``--resume``. Wins over ``output_root``."""
    output_root: str = ""
    """Parent of runs (used when ``output_dir`` is empty): each launch gets a new run folder ``<output_root>/<YYYYmmdd-HHMMSS>[-job<SLURM_JOB_ID>]``; ``--resume`` continues the newest run under it; a requeued Slurm job finds its own."""
    deepspeed: str = "ds_configs/zero2.json"
    """DeepSpeed JSON file (relative paths are from the working directory)."""
    ds: dict = field(default_factory=dict)
    """Overrides merged into the DeepSpeed JSON (``ds.zero_optimization.stage=3`` on the command line)."""
    export: bool = True
    """Write a Hugging Face export (``output_dir/export``) at the end of training."""
    export_gguf: str = ""
    """Also write the export as the GGUF file llama.cpp and Ollama run: ``f16``, ``bf16``, ``f32``, ``q8_0``, ``q4_0`` or ``q4_1`` (``export/model-<type>.gguf`` and an Ollama ``Modelfile``; a LoRA run's merged model), checked by llama.cpp when ``xllamacpp`` is installed; Llama, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma-2, Gemma-3. Empty: none (``finetune export --gguf`` writes one later)."""
    export_gguf_check: bool = True
    """Check ``export_gguf``'s file with llama.cpp (``xllamacpp``) against the export: transformers on the CPU generates 320 tokens and scores them, with the model in float32 in host memory (false: written unchecked; ``finetune export --gguf`` checks it later)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data files and tokenization."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization and cadence."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sequence and tensor parallelism (the data-parallel size is what is left of the world size)."""


# ---------------------------------------------------------------------------------------------
# Loading and overriding
# ---------------------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# Names users bring from HF Trainer / other tools, mapped to ours (for "did you mean" hints).
_ALIASES = {"learning_rate": "lr", "num_train_epochs": "epochs", "per_device_train_batch_size": "micro_batch_size",
            "batch_size": "micro_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
            "max_length": "max_seq_len", "block_size": "max_seq_len", "seq_len": "max_seq_len",
            "lr_scheduler_type": "lr_scheduler", "max_grad_norm_clip": "max_grad_norm",
            "gradient_clipping": "max_grad_norm", "logging_steps": "log_every", "save_steps": "save_every",
            "save_total_limit": "keep_last_checkpoints",
            "eval_steps": "eval_every", "model_name_or_path": "path", "tokenizer_name": "tokenizer_path"}


def _section(typ: Any) -> tuple[type | None, bool]:
    """``(dataclass, optional)`` when ``typ`` is a config section (``LoraConfig`` or ``LoraConfig | None``), else
    ``(None, False)``. An optional section is null (off) until a key of it is set."""
    if dataclasses.is_dataclass(typ):
        return typ, False
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(typ)) == 2 and dataclasses.is_dataclass(args[0]):
        return args[0], True
    return None, False


def _suggest(key: str, options: list[str]) -> str:
    if _ALIASES.get(key) in options:
        return f" (did you mean '{_ALIASES[key]}'?)"
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(sorted(options))})"


def _coerce(value: Any, typ: Any, where: str, problems: list[str]) -> Any:
    """Convert ``value`` (from YAML or a CLI string) to ``typ``; append a problem and return None if impossible."""
    if typing.get_origin(typ) is Literal:
        allowed = choices(typ)
        if isinstance(value, str) and value in allowed:
            return value
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
        problems.append(f"{where}: '{value}' unknown (choose one of: {', '.join(allowed)})"
                        + (f"; did you mean '{close[0]}'?" if close else ""))
        return None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif typ is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            parsed = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
            if isinstance(parsed, list):
                return parsed
    elif typ is dict:
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            parsed = yaml.safe_load(value)
            if isinstance(parsed, dict):
                return parsed
    problems.append(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")
    return None


def _apply_mapping(obj: Any, mapping: dict, prefix: str, problems: list[str]) -> None:
    """Set dataclass ``obj``'s fields from a nested ``mapping`` (from the file), recursing into sub-configs."""
    types = _field_types(type(obj))
    for key, value in mapping.items():
        where = f"{prefix}{key}"
        if key not in types:
            problems.append(f"unknown key '{where}'{_suggest(str(key), list(types))}")
            continue
        typ = types[key]
        section, optional = _section(typ)
        if section is not None:
            if value is None and optional:
                setattr(obj, key, None)
                continue
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a mapping of {section.__name__} keys"
                                f"{' or null' if optional else ''}, got {value!r}")
                continue
            if getattr(obj, key) is None:
                setattr(obj, key, section())
            _apply_mapping(getattr(obj, key), value, where + ".", problems)
        elif typ is dict and key == "ds" and isinstance(value, dict):
            setattr(obj, key, deep_merge(getattr(obj, key), value))
        else:
            coerced = _coerce(value, typ, where, problems)
            if coerced is not None:
                setattr(obj, key, coerced)


def _apply_override(cfg: RunConfig, dotted: str, raw: str, problems: list[str]) -> None:
    """Apply one ``a.b.c=value`` override; ``ds.*`` paths go into ``cfg.ds`` verbatim (checked later)."""
    parts = dotted.split(".")
    if parts[0] == "ds":
        if len(parts) < 2:  # ds={...} replaces all overrides from the file
            value = _coerce(raw, dict, "ds", problems)
            if value is not None:
                cfg.ds = value
            return
        nested: dict = {}
        cur = nested
        for p in parts[1:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = parse_scalar(raw)
        cfg.ds = deep_merge(cfg.ds, nested)
        return
    obj: Any = cfg
    for i, p in enumerate(parts):
        types = _field_types(type(obj))
        where = ".".join(parts[: i + 1])
        if p not in types:
            problems.append(f"unknown key '{where}' in override '{dotted}={raw}'{_suggest(p, list(types))}")
            return
        section, optional = _section(types[p])
        if i < len(parts) - 1:
            if section is None:
                problems.append(f"override '{dotted}': '{where}' is a {types[p].__name__}, not a section")
                return
            if getattr(obj, p) is None:  # an optional section (model.lora) is switched on by setting one of its keys
                setattr(obj, p, section())
            obj = getattr(obj, p)
        else:
            if optional and raw.lower() in ("null", "none", "~"):  # model.lora=null: off
                setattr(obj, p, None)
                return
            if section is not None:
                problems.append(f"override '{dotted}={raw}': '{where}' is a section; set one of its keys"
                                f"{' (or =null)' if optional else ''}")
                return
            coerced = _coerce(raw, types[p], where, problems)
            if coerced is not None:
                setattr(obj, p, coerced)


def parse_scalar(raw: str) -> Any:
    """Parse a command-line value: YAML scalars (``true``, ``2``, ``[1, 2]``) plus floats like ``3e-5``."""
    value = yaml.safe_load(raw) if raw != "" else ""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def deep_merge(base: dict, update: dict) -> dict:
    """Return ``base`` updated recursively with ``update`` (new dict; nested dicts are merged, others replaced)."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_config_file(path: str | os.PathLike) -> dict:
    """Read a YAML or JSON run-config file into a dict.

    Raises:
        ConfigError: the file is missing, unparsable, or not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"run config '{p}' does not exist (pass --config <file.yaml>)")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"run config '{p}' cannot be parsed: {e}".replace("\n", " ")) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"run config '{p}' must be a mapping of keys, got {type(data).__name__}")
    return data


def load_run_config(path: str | os.PathLike | None, overrides: list[str] = (),
                    problems: list[str] | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from defaults, then the file at ``path``, then ``overrides``.

    Args:
        path: YAML/JSON run config, or None for defaults only.
        overrides: ``"dotted.key=value"`` strings; later ones win.
        problems: when a list is given, key problems (unknown keys, wrong types, malformed overrides) are
            appended to it instead of raised, and the config is returned with those keys left as they were,
            so that validation can report its own problems in the same pass (a file that cannot be read
            still raises).

    Returns:
        The merged config (not yet validated against the file system: see
        :func:`finetune.preflight.validate.validate_run`).

    Raises:
        ConfigError: every unknown key, wrong type or malformed override, all in one error.
    """
    cfg = RunConfig()
    collect = problems is not None
    problems = problems if collect else []
    if path is not None:
        _apply_mapping(cfg, read_config_file(path), "", problems)
    for item in overrides:
        if "=" not in item:
            problems.append(f"override '{item}' is not key=value (example: train.lr=3e-5)")
            continue
        key, raw = item.split("=", 1)
        _apply_override(cfg, key.strip(), raw.strip(), problems)
    if problems and not collect:
        raise ConfigError(problems)
    return cfg


def config_to_dict(cfg: RunConfig) -> dict:
    """The config as plain nested dicts (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)


def dump_yaml(data: dict) -> str:
    """YAML text of ``data`` with keys in definition order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def config_reference_markdown() -> str:
    """Markdown table of every run-config key: dotted name, type, default and its one-line docstring.

    The docstrings are read from this module's source (the string literal under each field), so the
    manual's reference (docs/config.md) is generated from the code (``python -m finetune.config``) and tested against it.
    """
    tree = ast.parse(inspect.getsource(__import__(__name__, fromlist=["_"])))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[node.name, a.target.id] = " ".join(str(b.value.value).split())

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            typ = _field_types(type(obj))[f.name]
            doc = docs.get((type(obj).__name__, f.name), "").replace("|", "\\|")
            section, optional = _section(typ)
            if optional and value is None:
                rows.append(f"| `{prefix}{f.name}` | section or null | `null` | {doc} |")
                value = section()
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
                continue
            name = " \\| ".join(choices(typ)) if typing.get_origin(typ) is Literal else typ.__name__
            rows.append(f"| `{prefix}{f.name}` | {name} | `{json.dumps(value)}` | {doc} |")

    walk(RunConfig(), "")
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_reference_markdown())
