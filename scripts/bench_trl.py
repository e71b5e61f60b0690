"""The TRL contenders of ``scripts/bench.py``'s ``dpo``, ``dpo_realistic``, ``reward``, ``grpo``, ``vlm_sft`` and
``distill`` presets (run by it under ``deepspeed``): TRL's ``DPOTrainer``, ``RewardTrainer``, ``GRPOTrainer``,
``SFTTrainer`` or ``DistillationTrainer`` + DeepSpeed.

Written as a TRL user writes it: ``datasets`` reads the parquet pairs (``prompt``/``chosen``/``rejected`` text
columns, TRL's standard form), ``DPOTrainer(model, args=DPOConfig(...), train_dataset=..., processing_class=tokenizer)``
(or ``RewardTrainer`` / ``RewardConfig``). Model (config + overrides, random init from the seed; with
``bench.py --init-from`` the folder's weights), ``max_length`` (= our ``data.max_seq_len``; DPO: TRL's default
``keep_start`` truncation, as ours cuts the end; reward: TRL drops longer pairs), micro batch x accumulation,
ZeRO stage, precision, optimizer (torch AdamW), schedule, ``beta``, seed and number of steps come from the same
spec as the toolkit's run (``--spec``, written by ``scripts/bench.py``).
TRL's own default ``disable_dropout=True`` matches the recipes' dropout-free policy. The spec's ``variant``:

* ``defaults`` (contender ``trl``): TRL's defaults. DPO: the reference is a copy of the initial model (what TRL
  loads from the model's path when given none) run on every batch (``precompute_ref_log_probs=False``), gradient
  checkpointing on (``DPOConfig``'s and ``RewardConfig``'s default), random order.
* ``best`` (contender ``trl_best``): every speed option of TRL 1.16 that applies here.
  ``precompute_ref_log_probs=True`` with no reference model: TRL computes the reference log-probabilities of the
  training pairs once before training with the policy's initial weights (``precompute_ref_batch_size`` = the micro
  batch, as ours) and keeps no second model; ``gradient_checkpointing`` as the toolkit's run (off by default);
  length grouping (``train_sampling_strategy="group_by_length"``, transformers' ``LengthGroupedSampler``, per
  rank) on a ``length`` column (prompt + the longer completion; DPO; chosen + rejected tokens for reward) added
  to TRL's tokenized dataset, which has no ``input_ids`` column for the sampler to measure. Not applicable in TRL
  1.16: ``padding_free`` (disabled since its DPO refactor: it warns and pads; FlashAttention only, which CPUs
  lack), ``use_logits_to_keep`` (no longer a ``DPOConfig`` option in 1.16; only GRPO keeps logits of the
  completion), ``use_liger_kernel`` (deprecated; Triton kernels, GPUs only).

GRPO (spec recipe ``grpo``): ``GRPOTrainer(model, reward_funcs=[...], args=GRPOConfig(...), train_dataset=...,
processing_class=tokenizer)``, the prompts in a ``prompt`` column (the data's prompt column renamed) with the reward
columns beside it (``answer``), the reward functions the spec's ``path/to/file.py:function`` entries (the ones the
toolkit's run loads: ``scripts/bench_rewards.py``), imported from their file. The toolkit's ``micro_batch_size``
counts prompts, TRL's ``per_device_train_batch_size`` completions: it is ``micro_batch_size x num_generations``, so
both train the same prompts and completions per step; ``num_generations``, ``max_completion_length``, sampling
(``temperature``, ``top_p``, ``top_k``), ``loss_type``, ``beta``, ``epsilon``, ``scale_rewards``,
``mask_truncated_completions`` and ``num_iterations`` (1) are the toolkit's; generation is transformers'
``generate`` (``use_vllm=False``). TRL's prompts are not cut (it has no prompt limit; the preset's
``data.max_seq_len`` cuts none of the toolkit's either). Variants:

* ``defaults`` (``trl``): ``GRPOConfig``'s defaults otherwise: gradient checkpointing on, one generation batch per
  optimizer step (``steps_per_generation`` = ``gradient_accumulation_steps``), dropout as the model has it (none in
  the benchmark's Llama).
* ``best`` (``trl_best``): every GRPO speed option of TRL 1.16 that applies on CPU ranks at ZeRO-2.
  ``gradient_checkpointing`` as the toolkit's run (off by default: no recomputation in backward; TRL's default is
  on); ``disable_dropout=True`` (as the toolkit; free here, the model has none). Left at their defaults, each
  for its reason: ``steps_per_generation`` / ``generation_batch_size`` (the default already generates all of a
  rank's completions of the step in one ``generate`` call; more steps per generation would train later steps on
  stale completions and add an old-policy forward pass per micro-batch: other work than the toolkit's);
  ``cache_implementation`` (``static`` pays off only when compiled, and TRL's ``GenerationConfig`` sets
  ``disable_compile=True``; the default dynamic cache grows in place); ``torch_empty_cache_steps`` (None already;
  it empties CUDA's cache only); ``pad_to_multiple_of`` (``auto``: none off Neuron); ``ds3_gather_for_generation``
  (ZeRO-3 only); ``use_vllm`` / ``vllm_*`` (GPUs; the benchmark compares HF ``generate`` on both sides);
  ``use_transformers_continuous_batching`` (transformers' paged continuous-batching engine, another generation
  path than the ``generate`` both sides are to use; it gains when completions of very different lengths share a
  batch); ``use_liger_kernel`` (Triton, GPUs); ``log_completions`` (off already).

Vision-language SFT (spec recipe ``vlm_sft``, the ``vlm_sft`` preset): ``SFTTrainer(model, args=SFTConfig(
assistant_only_loss=True, ...), train_dataset=..., processing_class=processor)`` on the rows' ``messages`` and
``images`` columns (TRL's conversational vision form), the model's own ``AutoProcessor``; TRL's
``DataCollatorForVisionLanguageModeling`` renders and processes each batch's images as it collates it, and the
loss is on the assistant turns (``{% generation %}``), as the toolkit's. ``defaults`` (``trl``): ``SFTConfig``'s
defaults otherwise (gradient checkpointing on); ``best`` (``trl_best``): gradient checkpointing as the toolkit's
run. Not applicable to vision rows in TRL 1.16: packing and ``padding_free`` (refused for vision datasets); length
grouping gains nothing on rows of one length.

A real model with LoRA (the ``grpo_smollm2`` and ``dpo_smollm2`` presets): the spec's ``lora`` (the toolkit's
``model.lora``) becomes ``peft_config=peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules, use_dora,
use_rslora)`` of ``GRPOTrainer`` / ``DPOTrainer``, as a TRL user adapts a model (``DPOTrainer``'s reference is then the
base model with the adapters off, as the toolkit's; with ``validation_files`` its ``evaluate()`` after the last step
gives the held-out ``eval_rewards/accuracies``). For GRPO the prompts are conversations (one user message), which
TRL renders with the model's own chat template, as the toolkit does. With ``validation_files`` in the spec, the held-out greedy accuracy before the
first step and after the last (not timed; :func:`greedy_accuracy`): one greedy answer of at most
``max_completion_length`` tokens per validation prompt, the prompt rendered as TRL renders it, scored by the first
reward function, the mean over the prompts of every rank: what the toolkit's GRPO evaluation logs as
``eval/reward``.

GRPO with tools or an environment (the ``grpo_tools`` preset; ``train.grpo.tools`` / ``environment``): TRL's
``GRPOTrainer(tools=[...], environment_factory=Factory)`` with the same functions and class (imported from their
files), ``max_tool_calling_iterations`` and ``max_completion_length`` (tool results included on both sides), the
prompts rendered with the toolkit's ``data.chat_template`` (set as the tokenizer's chat template; TRL keeps it: it
is prefix-preserving), and TRL's own Qwen3 response template with the tokenizer's EOS as the end of a turn (TRL
sets a response template only for the chat templates it ships, and ``chatml_tools.jinja`` writes Qwen's Hermes
tool calls). Both variants as above; TRL re-encodes each rollout's whole prompt and completion so far at every tool
turn (no option of TRL 1.16 keeps the KV cache across its tool turns). The logged ``tools/call_frequency`` of each
step goes into ``tool_calls``.

On-policy distillation (spec recipe ``distill``, the ``distill`` preset): ``DistillationTrainer(model,
teacher_model=..., args=DistillationConfig(...), train_dataset=..., processing_class=tokenizer)`` on the data's
prompt column as ``prompt`` (TRL tokenizes it as the toolkit's ``sft`` tokenization does: the text with the
tokenizer's special tokens), the teacher loaded from the toolkit's ``train.distill.teacher`` folder
(``from_pretrained``, fp32; TRL wraps it in a DeepSpeed inference engine), the student as for the other recipes.
TRL's trainer is always on-policy (every prompt gets one completion sampled by the student: the toolkit's
``on_policy_fraction`` 1) with no cross-entropy term (``alpha`` 1); anything else is refused. From the toolkit's
``train.distill``: ``beta`` (``loss`` ``jsd``: its ``beta``, the same mixture ``(1 - beta) p_s + beta p_t``;
``forward_kl``: 0; ``reverse_kl``: 1), ``temperature`` (sampling and loss, as the toolkit's), ``top_p``, ``top_k``
and ``max_completion_length``; generation is transformers' ``generate`` (``use_vllm=False``). Variants:

* ``defaults`` (``trl``): ``DistillationConfig``'s defaults otherwise: gradient checkpointing on, dropout as the model
  has it (none in the benchmark's Llama).
* ``best`` (``trl_best``): gradient checkpointing as the toolkit's run (off by default: no recomputation of the
  student's layers in backward), ``disable_dropout=True`` (as the toolkit; free here). Left at their defaults, each
  for its reason: ``cache_implementation`` (``static`` pays off only when compiled, and TRL's ``GenerationConfig``
  sets ``disable_compile=True``; the default dynamic cache grows in place); ``pad_to_multiple_of`` (``auto``: none off
  Neuron); ``shuffle_dataset`` (the order of one epoch of the same prompts costs nothing); ``ds3_gather_for_generation``
  (ZeRO-3 only); ``use_vllm`` / ``vllm_*`` (GPUs; both sides use HF-style decoding on CPU ranks); no option of
  ``DistillationConfig`` groups prompts by length or keeps the teacher's logits of fewer positions (its chunked
  divergence projects the completion positions only already, every one of them off Triton devices).

Trained tokens (``counts``): the completion tokens of each micro-batch ``compute_loss`` trains (``completion_mask``,
EOS included), with the positions of its prompt and completion (pad included); the same phases as GRPO's are timed.

Measured, per rank, into ``<out>/rank<r>.json``: the wall time at the end of each optimizer step (Unix seconds), the
non-pad tokens and positions of each collated micro-batch (DPO: chosen and rejected sequences, stacked as ours;
reward: the same; GRPO: the prompt and completion masks of each micro-batch ``compute_loss`` trains, i.e. prompt +
completion up to its EOS), (rank 0) the logged loss, ``rewards/accuracies`` (DPO), ``accuracy`` (reward) or
``reward`` (GRPO: the mean reward of the step's completions) of each step, (GRPO) the wall seconds of each
generation (``generate``: HF ``generate``; ``generate_and_score``: with the prompts' tokenization, scoring and the
advantages), each training forward (``compute_loss``) and each ``training_step`` (those, the backward pass and,
under DeepSpeed, the optimizer step: accelerate's ``backward`` runs ``engine.step()``), to show where a step's time
goes,
(``defaults``, DPO) TRL's reference log-probabilities of the first 4 pairs and (reward) the held-out accuracy of
``trainer.evaluate`` on the validation pairs after training (not timed). The model starts from the weights
``finetune`` builds for a scratch model (``no_init_weights`` + ``init_weights`` after the seed), so both sides have
the same reference. Benchmark contender only: the ``finetune`` package never imports TRL.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

from bench_records import leave, step_meter


def greedy_accuracy(net, tokenizer, rows, reward, max_new_tokens: int, batch: int, columns: list[str]) -> tuple:
    """Held-out greedy accuracy of ``net`` on this rank's share of ``rows`` (a ``datasets`` split with a ``prompt``
    column: conversations or text), summed over the ranks: ``(mean score, prompts)``. Each prompt is rendered as TRL
    renders it (the chat template with the generation prompt, else the text with the tokenizer's special tokens),
    left-padded in batches of ``batch``, answered greedily (at most ``max_new_tokens`` tokens, stopping at the EOS)
    and scored by ``reward`` (TRL's signature; ``None`` scores count as 0)."""
    import torch

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    mine = rows.select(range(rank, len(rows), world))
    total = torch.zeros(2, dtype=torch.float64)
    training, side = net.training, tokenizer.padding_side
    net.eval()
    tokenizer.padding_side = "left"
    try:
        with torch.no_grad():
            for i in range(0, len(mine), batch):
                chunk = mine[i:i + batch]
                chat = isinstance(chunk["prompt"][0], list)
                texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if chat else p
                         for p in chunk["prompt"]]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
                out = net.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                scores = reward(prompts=chunk["prompt"], completions=completions,
                                **{c: chunk[c] for c in columns})
                total += torch.tensor([sum(x or 0.0 for x in scores), len(scores)], dtype=torch.float64)
    finally:
        net.train(training)
        tokenizer.padding_side = side
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return float(total[0] / max(total[1], 1)), int(total[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="JSON spec written by scripts/bench.py")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args()
    spec = json.loads(Path(args.spec).read_text())

    import datasets
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", 0))
    reward = spec["recipe"] == "reward"
    grpo = spec["recipe"] == "grpo"
    vlm = spec["recipe"] == "vlm_sft"
    distill = spec["recipe"] == "distill"
    sft = spec["recipe"] == "sft"
    best = spec.get("variant", "defaults") == "best"
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"], local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # the datasets cache (tokenized pairs and TRL's precomputed reference) per launch: each launch pays TRL's own
    # preparation, as the toolkit's launch pays its reference pass (bench.py removes its cached one per launch)
    cache = str(out / "hf-datasets")
    columns = {spec["prompt_column"] or "prompt": "prompt", spec["chosen_column"]: "chosen",
               spec["rejected_column"]: "rejected"}

    def pairs(files: list[str], limit: int = 0):
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
        if limit:
            ds = ds.select(range(min(limit, len(ds))))
        return ds.select_columns(list(columns)).rename_columns({k: v for k, v in columns.items() if k != v})

    def prompts(files: list[str], limit: int = 0):
        """GRPO's rows: the prompt column as ``prompt`` (TRL's name) and the reward columns."""
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
        if limit:
            ds = ds.select(range(min(limit, len(ds))))
        name = spec["prompt_column"] or "prompt"
        ds = ds.select_columns(list(dict.fromkeys([name, *spec["reward_columns"]])))
        return ds.rename_column(name, "prompt") if name != "prompt" else ds

    def conversations(files: list[str], limit: int = 0):
        """SFT's vision rows: the conversations as ``messages`` and the images as ``images`` (TRL's names)."""
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
        if limit:
            ds = ds.select(range(min(limit, len(ds))))
        names = {spec["messages_column"] or "messages": "messages", spec["image_column"]: "images"}
        ds = ds.select_columns(list(names))
        return ds.rename_columns({k: v for k, v in names.items() if k != v})

    def prompt_completions(files: list[str], limit: int = 0):
        """Text SFT's rows: each conversation as TRL's conversational prompt-completion form (the turns before the
        last as ``prompt``, the last, the assistant's answer, as ``completion``), so that TRL's
        ``completion_only_loss`` trains the answer only, as the toolkit's answer-only loss (``assistant_only_loss``
        needs ``{% generation %}`` markers, which the model's stock ChatML template lacks and TRL 1.16 adds only to
        the templates it ships)."""
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
        if limit:
            ds = ds.select(range(min(limit, len(ds))))
        name = spec["messages_column"] or "messages"
        ds = ds.map(lambda r: {"prompt": r[name][:-1], "completion": r[name][-1:]})
        return ds.select_columns(["prompt", "completion"])

    raw = (prompts if grpo or distill else conversations if vlm else prompt_completions if sft else pairs)(
        spec["train_files"], spec.get("max_train_rows") or 0)
    config = AutoConfig.from_pretrained(spec["model"], local_files_only=True)
    for k, v in spec["config_overrides"].items():
        setattr(config, k, v)
    auto = (transformers.AutoModelForSequenceClassification if reward else
            transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM)
    torch.manual_seed(spec["seed"])
    if spec.get("init") == "pretrained":  # bench.py --init-from: the folder's weights, as finetune's model.init
        # a packed SFT export says use_cache false (finetune's recipes.sft); finetune's rollout decodes with a cache
        # anyway, and TRL would recompute every sequence at every token: both sides decode with one
        config.use_cache = True
        model = auto.from_pretrained(spec["model"], config=config, dtype=torch.float32, local_files_only=True)
        model.generation_config.use_cache = True
    else:
        with no_init_weights():  # the initial weights of finetune's scratch model (engine.model.scratch_model),
            model = auto.from_config(config, dtype=torch.float32)  # so both references agree
        model.init_weights()

    counts: list[tuple[int, int]] = []  # (non-pad tokens, positions) of each collated micro-batch, in order
    step_ends: list[float] = []
    step_cpu: list[float] = []
    losses: dict[int, float] = {}
    accuracies: dict[int, float] = {}
    accuracy_key = "accuracy" if reward else "rewards/accuracies"
    rewards: dict[int, float] = {}  # GRPO: the logged mean reward of each step
    tool_calls: dict[int, float] = {}  # GRPO with tools: the logged tools/call_frequency of each step
    phases: dict[str, list[float]] = {}  # GRPO: wall seconds of each call of the timed parts (per rank)

    logged = {accuracy_key: accuracies, **({"reward": rewards, "tools/call_frequency": tool_calls} if grpo else {})}
    meter = step_meter(step_ends, step_cpu, losses, logged)

    half = spec["precision"]
    common = dict(
        output_dir=str(out / "trainer"), per_device_train_batch_size=spec["micro_batch_size"],
        per_device_eval_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], max_steps=spec["steps"],
        learning_rate=spec["lr"], weight_decay=spec["weight_decay"], warmup_steps=spec["warmup_steps"],
        lr_scheduler_type=spec["lr_scheduler"], max_grad_norm=spec["max_grad_norm"], seed=spec["seed"],
        logging_steps=spec.get("log_every", 1), save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, bf16=half == "bf16", fp16=half == "fp16",
        deepspeed=spec["hf_deepspeed"], use_cpu=not torch.cuda.is_available(), max_length=spec["max_seq_len"])
    if grpo or distill:  # no max_length (prompts are not cut; completions: max_completion_length)
        del common["max_length"]
    if best and (grpo or distill):  # checkpointing as the toolkit's run; dropout off (as the toolkit; module docstring)
        common.update(gradient_checkpointing=bool(spec.get("gradient_checkpointing")), disable_dropout=True)
    elif best and vlm:  # checkpointing as the toolkit's run (the rows have one length: no length grouping to gain)
        common.update(gradient_checkpointing=bool(spec.get("gradient_checkpointing")))
    elif best and sft:  # checkpointing as the toolkit's run; packing below (TRL's fastest layout)
        common.update(gradient_checkpointing=bool(spec.get("gradient_checkpointing")))
    elif best:  # checkpointing as the toolkit's run; length-grouped batches (on the ``length`` column added below)
        # (remove_unused_columns=False keeps that column, which is no model input, for the sampler; TRL's collators
        # read their own keys only)
        common.update(gradient_checkpointing=bool(spec.get("gradient_checkpointing")),
                      train_sampling_strategy="group_by_length", remove_unused_columns=False)
    adapters = {}
    if spec.get("lora"):  # the toolkit's model.lora as peft's LoraConfig, handed to TRL as its users do
        from peft import LoraConfig

        lo = spec["lora"]
        targets = lo["target_modules"]
        adapters["peft_config"] = LoraConfig(
            r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"], use_dora=lo["use_dora"],
            use_rslora=lo["use_rslora"], task_type="CAUSAL_LM",
            target_modules="all-linear" if targets == ["all-linear"] else targets,
            modules_to_save=lo["modules_to_save"] or None)
    if grpo:
        import importlib.util

        from trl import GRPOConfig, GRPOTrainer

        def load_reward(entry: str):
            """A ``path/to/file.py:function`` entry (``train.grpo.rewards``, ``tools``, ``environment``), imported
            from its file."""
            path, _, name = entry.rpartition(":")
            if not path.endswith(".py"):
                raise SystemExit(f"bench_trl.py: {entry!r} is no path/to/file.py:function entry (TRL needs a "
                                 f"callable; the grpo preset's rewards come from scripts/bench_rewards.py)")
            module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return getattr(module, name)

        g = spec["grpo"]
        agentic = {}
        if g.get("tools") or g.get("environment"):  # multi-turn (grpo_tools preset): TRL's tools= / environment_factory=
            import re

            from trl.chat_template_utils import qwen3_template

            if spec.get("chat_template"):  # data.chat_template: the template finetune renders the prompts with
                tokenizer.chat_template = Path(spec["chat_template"]).read_text()
            # TRL parses a completion's tool calls with the tokenizer's response template, which it sets only for the
            # chat templates it ships (add_response_schema); data/chat_templates/chatml_tools.jinja writes Qwen's
            # Hermes form (<tool_call>{json}</tool_call>, then EOS), so a TRL user sets TRL's own Qwen3 template, its
            # end-of-turn marker this tokenizer's EOS
            response = copy.deepcopy(qwen3_template)
            response["fields"]["content"]["close_pattern"] = re.escape(tokenizer.eos_token) + r"\s*"
            tokenizer.response_template = response
            agentic["tools"] = [load_reward(e) for e in g.get("tools") or []] or None
            if g.get("environment"):
                agentic["environment_factory"] = load_reward(g["environment"])
        reward_funcs = [load_reward(e) for e in g["rewards"]]
        if spec.get("validation_files"):  # before the first step (not timed): the start of the gain
            held = prompts(spec["validation_files"])
            heldout_start = greedy_accuracy(model, tokenizer, held, reward_funcs[0], g["max_completion_length"],
                                            spec["eval_micro_batch_size"], spec["reward_columns"])
        common["per_device_train_batch_size"] *= g["num_generations"]  # TRL counts completions, ours prompts
        common["per_device_eval_batch_size"] = common["per_device_train_batch_size"]
        gargs = GRPOConfig(**common, num_generations=g["num_generations"],
                           max_completion_length=g["max_completion_length"], temperature=g["temperature"],
                           top_p=g["top_p"], top_k=g["top_k"], loss_type=g["loss_type"], beta=g["beta"],
                           epsilon=g["epsilon"], epsilon_high=g["epsilon_high"] or None,
                           scale_rewards=g["scale_rewards"], mask_truncated_completions=g["mask_truncated_completions"],
                           importance_sampling_level=g["importance_sampling_level"],
                           num_iterations=g["num_iterations"], reward_weights=g["reward_weights"] or None,
                           use_vllm=False,
                           **({"max_tool_calling_iterations": g["max_tool_calling_iterations"]} if agentic else {}))
        trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=gargs,
                              train_dataset=raw, processing_class=tokenizer, callbacks=[meter], **agentic,
                              **adapters)
    elif distill:
        from trl import DistillationConfig, DistillationTrainer

        d = spec["distill"]
        if d["on_policy_fraction"] != 1 or d["alpha"] != 1:
            raise SystemExit(f"bench_trl.py: TRL's DistillationTrainer trains every row on-policy on the divergence "
                             f"alone; the toolkit's run has on_policy_fraction {d['on_policy_fraction']} and alpha "
                             f"{d['alpha']} (the distill preset sets 1 and 1)")
        tokenizer.padding_side = "left"  # TRL's requirement (it pads the prompts itself)
        dargs = DistillationConfig(**common, max_completion_length=d["max_completion_length"],
                                   temperature=d["temperature"], top_p=d["top_p"], top_k=d["top_k"],
                                   beta={"forward_kl": 0.0, "reverse_kl": 1.0}.get(d["loss"], d["beta"]),
                                   use_vllm=False)
        teacher = transformers.AutoModelForCausalLM.from_pretrained(d["teacher"], dtype=torch.float32,
                                                                    local_files_only=True)
        trainer = DistillationTrainer(model=model, teacher_model=teacher, args=dargs, train_dataset=raw,
                                      processing_class=tokenizer, callbacks=[meter])
    elif sft:
        from trl import SFTConfig, SFTTrainer

        # best: TRL's best-fit-decreasing packing into rows of max_length, padding-free (position_ids restart per
        # example: transformers' masks keep examples apart on sdpa and eager too), as the toolkit packs; defaults:
        # one conversation per row, padded. The held-out conversations are evaluated after the last step.
        held = prompt_completions(spec["validation_files"]) if spec.get("validation_files") else None
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, completion_only_loss=True, packing=best,
                                                         eval_packing=False),
                             train_dataset=raw, eval_dataset=held, processing_class=tokenizer, callbacks=[meter],
                             **adapters)
    elif vlm:
        from trl import SFTConfig, SFTTrainer

        # the model's processor renders the conversations and processes the images in TRL's collator, batch by
        # batch; the loss on the assistant turns only ({% generation %} in the template), as the toolkit's
        processor = transformers.AutoProcessor.from_pretrained(spec["tokenizer"], local_files_only=True)
        processor.tokenizer = tokenizer
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, assistant_only_loss=True, packing=False),
                             train_dataset=raw, processing_class=processor, callbacks=[meter])
    elif reward:
        from trl import RewardConfig, RewardTrainer

        # the held-out pairs are tokenized (and filtered by length) with the training pairs, evaluated after training
        held = pairs(spec["validation_files"]) if spec.get("validation_files") else None
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=raw, eval_dataset=held,
                                processing_class=tokenizer, callbacks=[meter])
    else:
        from trl import DPOConfig, DPOTrainer

        dargs = DPOConfig(**common, beta=spec["dpo_beta"], loss_type=["sigmoid"], precompute_ref_log_probs=best)
        # TRL reloads the reference from the model's path when none is given; a model built from a config has none,
        # so the reference is handed over as TRL would load it: a copy of the initial weights (frozen and run by TRL
        # on every batch). With precompute_ref_log_probs, none: TRL runs the policy's initial weights once.
        # With LoRA (peft_config) TRL's reference is the base model with the adapters off, as the toolkit's.
        reference = None if best or adapters else copy.deepcopy(model)
        held = pairs(spec["validation_files"]) if spec.get("validation_files") else None
        trainer = DPOTrainer(model=model, ref_model=reference, args=dargs, train_dataset=raw, eval_dataset=held,
                             processing_class=tokenizer, callbacks=[meter], **adapters)
    if grpo or distill:
        compute_loss = trainer.compute_loss

        def counting_loss(model_, inputs, *a, **kw):
            """Count the trained micro-batch: GRPO prompt + completion tokens (non-pad), distillation its completion
            tokens (the trained ones, EOS included); and its positions (prompt + completion, pad included)."""
            pm, cm = inputs["prompt_mask"], inputs["completion_mask"]
            counts.append((int(cm.sum() if distill else pm.sum() + cm.sum()), int(pm.numel() + cm.numel())))
            return compute_loss(model_, inputs, *a, **kw)

        trainer.compute_loss = counting_loss

        def timed(name: str, key: str) -> None:
            """Wall seconds of each call of the trainer's method ``name`` into ``phases[key]`` (where a step's time
            goes: ``generate``, HF generate alone; ``generate_and_score``, with tokenizing, scoring, gathering the
            rewards and the advantages; ``train_forward``, ``compute_loss``; ``training_step``, all of these, the
            backward pass and, under DeepSpeed, the optimizer step)."""
            method = getattr(trainer, name)

            def run(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return method(*a, **kw)
                finally:
                    phases.setdefault(key, []).append(time.perf_counter() - t0)

            setattr(trainer, name, run)

        timed("_generate_single_turn", "generate")
        timed("_generate_and_score_completions", "generate_and_score")
        timed("compute_loss", "train_forward")
        timed("training_step", "training_step")  # the above + backward + (DeepSpeed) the optimizer step
    if best and not grpo and not vlm and not distill and not sft:  # what LengthGroupedSampler measures (training and, for
        # reward, evaluation): TRL's tokenized rows have no input_ids column
        def with_length(ds):
            if reward:
                lengths = [len(c) + len(r) for c, r in zip(ds["chosen_ids"], ds["rejected_ids"])]
            else:
                lengths = [len(p) + max(len(c), len(r)) for p, c, r in
                           zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"])]
            return ds.add_column("length", lengths)

        trainer.train_dataset = with_length(trainer.train_dataset)
        if trainer.eval_dataset is not None:
            trainer.eval_dataset = with_length(trainer.eval_dataset)
    collate = trainer.data_collator

    def counting_collate(rows):
        batch = collate(rows)
        if "attention_mask" in batch:  # chosen rows, then rejected rows (DPO and reward collators); SFT's rows
            mask = batch["attention_mask"]
            counts.append((int(mask.sum()), int(mask.numel())))
        else:  # SFT padding-free: one flat row of the packed examples, no pad
            counts.append((int(batch["input_ids"].numel()), int(batch["input_ids"].numel())))
        return batch

    reference_first = []
    if not reward and not best and not grpo and not vlm and not distill and not sft and not adapters:
        # TRL's own reference log-probabilities of the first pairs (its compute_ref_log_probs on its collated batch),
        # for scripts/bench.py to compare with finetune's cached ones
        first = collate([trainer.train_dataset[i] for i in range(min(4, len(trainer.train_dataset)))])
        chosen, rejected = trainer.compute_ref_log_probs(trainer.ref_model, first)
        reference_first = [[float(c), float(r)] for c, r in zip(chosen.tolist(), rejected.tolist())]
    if not grpo and not distill:  # their collators return the prompt rows; the trained batches: compute_loss
        trainer.data_collator = counting_collate
    trainer.train()
    heldout = None
    if (reward or not (grpo or vlm or distill)) and trainer.eval_dataset is not None:  # after the timed steps
        trainer.data_collator = collate
        metrics = trainer.evaluate()
        heldout = {"accuracy": metrics.get("eval_accuracy", metrics.get("eval_rewards/accuracies")),
                   "loss": metrics.get("eval_loss"), "pairs": len(trainer.eval_dataset)}
    if grpo and spec.get("validation_files"):  # after the last step (not timed)
        accuracy, n = greedy_accuracy(trainer.model, tokenizer, held, reward_funcs[0], g["max_completion_length"],
                                      spec["eval_micro_batch_size"], spec["reward_columns"])
        heldout = {"accuracy": accuracy, "start": heldout_start[0], "pairs": n}
    peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    (out / f"rank{rank}.json").write_text(json.dumps({"step_ends": step_ends, "step_cpu": step_cpu, "counts": counts,
                                                      "losses": losses, "reward_accuracies": accuracies,
                                                      "rewards": rewards, "tool_calls": tool_calls,
                                                      "phases": phases,
                                                      "reference_logps_first": reference_first,
                                                      "heldout": heldout, "gpu_max_allocated": peak_gpu}))
    leave()

if __name__ == "__main__":
    main()
