"""Before any model is built: the ``train.grpo`` settings, the reward functions and the prompt data checked, one
line per problem (:func:`check_rows`)."""

from __future__ import annotations

import math

import pyarrow.parquet as pq

from finetune.config import RunConfig
from finetune.data import images
from finetune.data.dataset import file_schemas, missing_columns, string_type
from finetune.errors import ConfigError
from finetune.recipes.grpo.prompts import PromptRows, columns, prepare_tokenizer, prompt_column, tokenizer_of
from finetune.recipes.grpo.agent import agent_of
from finetune.recipes.grpo.scoring import reward_functions
from finetune.recipes.grpo.tools import template_problem
from finetune.recipes.common.chat import TemplateCheck, message_problem, template_text, tokenizer_template_problem


def _text_or_messages(typ) -> bool:
    return string_type(typ) or str(typ).startswith(("list", "large_list"))


def _all_dropped(cfg: RunConfig, key: str, f: str, p_col: str, prompts: list, problems: list[str]) -> None:
    """One line when ``data.truncation: drop`` would leave none of a file's prompts (every one longer than
    ``data.max_seq_len`` tokens), the launch's empty-split refusal, found before any model is built."""
    try:
        encode = PromptRows(tokenizer_of(cfg), cfg.data).encode
    except Exception:  # noqa: BLE001  (the tokenizer's own check reports it)
        return
    shortest = None
    for p in prompts:
        try:
            n = len(encode(p))
        except Exception:  # noqa: BLE001  (malformed prompts are reported above)
            return
        if n <= cfg.data.max_seq_len:
            return
        shortest = n if shortest is None else min(shortest, n)
    problems.append(f"{key}: every prompt of '{f}' is longer than data.max_seq_len={cfg.data.max_seq_len} tokens "
                    f"(the shortest has {shortest}), so data.truncation=drop leaves none; raise data.max_seq_len or "
                    f"set data.truncation=truncate (keeps each prompt's last tokens)")


def _tool_problems(cfg: RunConfig, problems: list[str]) -> None:
    """Tools and environments (:mod:`finetune.recipes.grpo.agent`): files that load, functions with schemas, a chat
    template that renders tools, settings in range, and a layout the multi-turn loop runs on."""
    g = cfg.train.grpo
    if not g.tools and not g.environment:
        return
    if g.max_tool_calling_iterations < 1:
        problems.append(f"train.grpo.max_tool_calling_iterations: {g.max_tool_calling_iterations} must be >= 1")
    if not (math.isfinite(float(g.tool_timeout_s)) and g.tool_timeout_s > 0):
        problems.append(f"train.grpo.tool_timeout_s: {g.tool_timeout_s} must be a number of seconds > 0")
    if g.generation_backend != "hf_generate":
        problems.append(f"train.grpo.generation_backend: {g.generation_backend} runs single-turn rollouts only; with "
                        f"train.grpo.tools or environment use generation_backend=hf_generate")
    if not g.gather_for_generation:
        problems.append("train.grpo.gather_for_generation: false makes every rank generate in lockstep, which "
                        "rollouts with different numbers of tool turns per rank cannot keep; set it true (the "
                        "model gathered once per step) with train.grpo.tools or environment")
    try:
        agent = agent_of(cfg)
    except ConfigError as e:
        problems.extend(e.problems)
        return
    try:
        tok = tokenizer_of(cfg)
    except Exception:  # noqa: BLE001  (the tokenizer's own check reports it)
        return
    why = template_problem(tok, agent.schemas, template_text(cfg.data))
    if why:
        problems.append(f"data.chat_template: {why}")


def check_rows(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """Check the grpo settings, reward functions and data before any model is built; one line per problem.

    Problems: ``train.grpo`` values out of range or unsupported (``beta`` > 0 without LoRA);
    reward functions that cannot load (:func:`finetune.recipes.common.rewards.load`: path, import, name, signature,
    weights);
    a file without the prompt or a reward column; a prompt column neither text nor messages; null or empty prompts
    (the first row and their number); a malformed conversational prompt or one the chat template fails on. With an
    image-text model (:func:`_image_problems`): what does not go with images, a file without the image column, the
    first row whose images cannot be read or do not match its image parts, a model folder without a processor.
    """
    g, d = cfg.train.grpo, cfg.data
    if g.num_generations < 2:
        problems.append(f"train.grpo.num_generations: {g.num_generations}; GRPO compares each completion with the "
                        f"others of its prompt and needs at least 2")
    for key in ("max_completion_length", "num_iterations"):
        if getattr(g, key) < 1:
            problems.append(f"train.grpo.{key}: {getattr(g, key)} must be >= 1")
    for key in ("temperature", "top_p", "epsilon", "epsilon_high", "beta"):
        if not math.isfinite(float(getattr(g, key))):
            problems.append(f"train.grpo.{key}: {getattr(g, key)} is not a finite number")
    if g.temperature <= 0:
        problems.append(f"train.grpo.temperature: {g.temperature} must be > 0 (GRPO samples its completions)")
    if not 0 < g.top_p <= 1:
        problems.append(f"train.grpo.top_p: {g.top_p} must be in (0, 1]")
    if g.top_k < 0:
        problems.append(f"train.grpo.top_k: {g.top_k} must be >= 0 (0: off)")
    if g.epsilon <= 0 or g.epsilon_high < 0:
        problems.append(f"train.grpo.epsilon: {g.epsilon} must be > 0 and epsilon_high {g.epsilon_high} >= 0 "
                        f"(0: epsilon)")
    if g.beta < 0:
        problems.append(f"train.grpo.beta: {g.beta} must be >= 0")
    if g.beta > 0 and cfg.model.lora is None:
        problems.append(f"train.grpo.beta: {g.beta} > 0 needs a reference model; finetune takes the base model "
                        f"under LoRA (model.lora) as the reference; without LoRA set beta=0 (TRL's default)")
    if g.log_completions < 0:
        problems.append(f"train.grpo.log_completions: {g.log_completions} must be >= 0")
    _tool_problems(cfg, problems)
    sp = cfg.parallel.sequence_parallel_size
    if sp > 1 and g.generation_backend != "hf_generate":
        problems.append(f"train.grpo.generation_backend: {g.generation_backend} is not checked under sequence "
                        f"parallelism (parallel.sequence_parallel_size={sp}: its inference kernels would generate "
                        f"with the training layout's groups); use generation_backend=hf_generate, or "
                        f"parallel.sequence_parallel_size=1")
    try:
        reward_functions(cfg)
    except ConfigError as e:
        problems.extend(e.problems)
    if images.in_prompts(cfg):
        _image_problems(cfg, train_files, validation_files, problems)
        return
    p_col = prompt_column(d)
    conversational = False
    templates = TemplateCheck(cfg, prepare_tokenizer)
    for key, f, schema in file_schemas(train_files, validation_files):
        reads = "grpo reads data.prompt_column (default 'prompt') and data.reward_columns (default ['answer'])"
        problem = missing_columns(key, f, schema, columns(d), reads)
        if problem:
            problems.append(problem)
            continue
        if not _text_or_messages(schema.field(p_col).type):
            problems.append(f"{key}: '{f}' column '{p_col}' has type {schema.field(p_col).type}, neither text "
                            f"nor a list of {{role, content}} messages")
            continue
        prompts = pq.read_table(f, columns=[p_col]).column(p_col).to_pylist()
        empty = [i for i, v in enumerate(prompts) if v is None or not v or (isinstance(v, str) and not v.strip())]
        if empty:
            problems.append(f"{key}: '{f}' row {empty[0]} of column '{p_col}' is null or empty ({len(empty):,} "
                            f"such rows); fix or remove them")
        start = len(problems)
        answered = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list):
                conversational = True
                problem = message_problem(prompt)
                if problem:
                    problems.append(f"{key}: '{f}' row {i} of column '{p_col}' is {problem}; a conversational "
                                    f"prompt is a list of {{role, content}} messages")
                    break
                if prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
                    answered.append(i)
        if answered and len(problems) == start:
            problems.append(f"{key}: '{f}' row {answered[0]} of column '{p_col}' ends with an assistant message "
                            f"({len(answered):,} such rows): grpo would render the answer into the prompt and "
                            f"open a new assistant turn after it; give the conversations up to the turn the "
                            f"model completes (drop the last assistant message of a chat SFT file)")
        if d.truncation == "drop" and len(problems) == start and prompts and not empty:
            _all_dropped(cfg, key, f, p_col, prompts, problems)
        if len(problems) == start and conversational:
            templates.check(key, f, [p_col], ((i, p_col, list(p)) for i, p in enumerate(prompts)
                                              if isinstance(p, list)), problems)
    if conversational and not template_text(d):
        tokenizer_template_problem(cfg, problems)


def _image_problems(cfg: RunConfig, train_files: list[str], validation_files: list[str], problems: list[str]) -> None:
    """An image-text model's prompts: no tools or environment, ``hybrid_engine`` rollout or ``train.eval_generate``
    with them; the files, their image rows and the processor as :func:`finetune.data.images.check_prompt_files`
    checks them; no prompt ends with an assistant message."""
    g, d = cfg.train.grpo, cfg.data
    where = f"model.path '{cfg.model.path}' is an image-text model (its prompts hold images)"
    if g.tools or g.environment:
        problems.append(f"train.grpo.tools / environment: not available with images yet ({where}); use a text "
                        f"model for tool-calling rollouts")
    if g.generation_backend != "hf_generate":
        problems.append(f"train.grpo.generation_backend: {g.generation_backend} takes token ids alone; {where}: use "
                        f"hf_generate")
    if cfg.train.eval_generate.prompts:
        problems.append(f"train.eval_generate.prompts: {cfg.train.eval_generate.prompts}; {where}: grpo's evaluation "
                        f"already generates on the validation prompts with their images (eval/reward); set it to 0")
    p_col = prompt_column(d)
    passed = images.check_prompt_files(cfg, "grpo", columns(d, with_images=True),
                                       "data.prompt_column (default 'prompt'), data.reward_columns (default "
                                       "['answer']) and data.image_column (default 'images')",
                                       train_files, validation_files, problems)
    for key, f in passed:
        prompts = pq.read_table(f, columns=[p_col]).column(p_col).to_pylist()
        answered = [i for i, p in enumerate(prompts) if p and p[-1].get("role") == "assistant"]
        if answered:
            problems.append(f"{key}: '{f}' row {answered[0]} of column '{p_col}' ends with an assistant message "
                            f"({len(answered):,} such rows); give the conversations up to the turn the model "
                            f"completes")
