"""A GGUF file checked by llama.cpp itself against the Hugging Face export it was written from.

llama.cpp runs in process through ``xllamacpp`` (a prebuilt CPU llama.cpp: ``Server(CommonParams)``,
``handle_completions``, ``handle_chat_completions``), the program that will serve the file. For each prompt (token
ids, so both sides read the same tokens) llama.cpp continues greedily with ``n_probs`` and returns each token's
log-probability; transformers continues the same prompt greedily on the export, and scores llama.cpp's continuation
with one teacher-forced forward, so the log-probabilities compare at the same positions even after the two
continuations part.

* ``agree``: prompts whose greedy continuations are the same tokens (llama.cpp's server leaves a token that ends
  inside a UTF-8 character out of its token list: the reported ones must then be transformers' in order, the others
  such byte tokens, and the counts equal);
* ``mean_abs_logprob_diff``: the mean absolute difference of the log-probabilities of llama.cpp's tokens (nats);
* ``chat``: llama.cpp's chat endpoint (the file's ``tokenizer.chat_template``) replies what transformers replies
  greedily to the same messages through ``apply_chat_template``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "In 1969, the first humans",
    "A list of prime numbers: 2, 3, 5,",
)
"""Ten prompts no shipped data set holds: what a user would try on the served model first."""


def available() -> bool:
    """True when ``xllamacpp`` (llama.cpp) can be imported."""
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


@contextlib.contextmanager
def server(path: str | Path, n_ctx: int = 512, lora: str | Path | None = None, lora_scale: float = 1.0,
           threads: int | None = None):
    """llama.cpp serving ``path`` in process (one slot, CPU, attention without flash attention and a float32 KV
    cache), with a GGUF LoRA adapter when ``lora`` is given."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = str(path)
    p.n_ctx = n_ctx
    p.n_parallel = 1
    p.warmup = False
    p.cpuparams.n_threads = threads or max(1, min(4, os.cpu_count() or 1))
    p.cpuparams_batch.n_threads = p.cpuparams.n_threads
    p.sampling.seed = 0
    p.verbosity = -1  # llama.cpp's per-request log lines stay out of the run's output
    # exact attention: llama.cpp's CPU flash attention and its default float16 KV cache round queries, keys and
    # values to float16, noise that parts the greedy paths of sharp small models; the check is of the file
    p.flash_attn_type = 0
    p.cache_type_k = xllamacpp.ggml_type.GGML_TYPE_F32
    p.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
    if lora is not None:
        info = xllamacpp.CommonAdapterLoraInfo(str(lora), lora_scale)
        p.lora_adapters = [info]
    srv = xllamacpp.Server(p)
    try:
        yield srv
    finally:
        del srv


def llama_greedy(srv, prompt: list[int], n: int) -> tuple[str, list[int], list[float], int]:
    """llama.cpp's greedy continuation of the token ids ``prompt`` (``n`` tokens at most): its text, the ids and
    log-probabilities (before sampling) llama.cpp reports, and how many tokens it generated. The server leaves out
    a token that ends inside a UTF-8 character (a byte token), so the ids may be fewer than the tokens."""
    r = srv.handle_completions({"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "n_probs": 1,
                                "cache_prompt": False, "samplers": ["top_k"]})
    if "error" in r:
        raise RuntimeError(f"llama.cpp: {r['error']}")
    choice = r["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return choice["text"], [c["id"] for c in content], [c["logprob"] for c in content], r["usage"]["completion_tokens"]


def paired_logprobs(model, prompt: list[int], ids: list[int], logps: list[float], complete: bool,
                    theirs: list[int], partial) -> list[float]:
    """``|llama.cpp's - transformers'|`` log-probability of each token llama.cpp reported: scored on llama.cpp's own
    continuation when it reported every token, else along transformers' continuation while the two agree (skipping
    the byte tokens llama.cpp leaves out: ``partial(token)`` is true for them)."""
    if complete:
        return [abs(a - b) for a, b in zip(logps, hf_logprobs(model, prompt, ids))]
    ref, out, j = hf_logprobs(model, prompt, theirs), [], 0
    for token, logp in zip(ids, logps):
        while j < len(theirs) and theirs[j] != token and partial(theirs[j]):
            j += 1
        if j == len(theirs) or theirs[j] != token:
            break
        out.append(abs(logp - ref[j]))
        j += 1
    return out


def hf_greedy(model, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """transformers' greedy continuation (``generate``, ``do_sample=False``), stopping at ``eos`` as llama.cpp does
    (the end-of-generation token included, as llama.cpp returns it)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos or None, pad_token_id=(eos or [0])[0])
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of ``tokens`` after ``prompt`` (one teacher-forced forward)."""
    if not tokens:
        return []
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def compare(gguf_path: str | Path, folder: str | Path, prompts=PROMPTS, n: int = 32, chat: bool = True,
            lora: str | Path | None = None, as_written=None) -> dict:
    """llama.cpp on ``gguf_path`` against transformers on the Hugging Face ``folder`` (module docstring).

    Args:
        as_written: ``f(model)`` that rounds the reference's weights in place to what the file holds (its float16,
            bfloat16 or quantized blocks, dequantized): the continuations and log-probabilities then compare the
            conversion (names, layouts, metadata, tokenizer) apart from the precision the user chose, which
            ``mean_abs_logprob_diff_unrounded`` (llama.cpp's tokens scored by the unrounded export) measures.

    Returns:
        ``{"prompts", "agree", "mean_abs_logprob_diff", "max_abs_logprob_diff", "mean_abs_logprob_diff_unrounded",
        "tokens", "chat"}``; ``chat`` is None when the tokenizer has no chat template or ``chat`` is false, else
        ``{"equal", "llama_cpp", "transformers"}``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    try:
        gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
        eos = gen.eos_token_id
    except OSError:
        eos = tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    prompts = [tokenizer(t, add_special_tokens=True)["input_ids"] if isinstance(t, str) else list(t) for t in prompts]
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chat = chat and bool(tokenizer.chat_template)
    with server(gguf_path, lora=lora) as srv:  # llama.cpp first, then freed: one model in memory at a time
        runs = [llama_greedy(srv, prompt, n) for prompt in prompts]
        if chat:
            r = srv.handle_chat_completions({"messages": messages, "max_tokens": 16, "temperature": 0.0,
                                             "top_k": 1, "samplers": ["top_k"]})
            llama_reply = r["choices"][0]["message"]["content"]
    unrounded = []
    partial = functools.cache(lambda t: not tokenizer.decode([t]) or "\ufffd" in tokenizer.decode([t]))
    if as_written is not None:  # the unrounded export's log-probabilities of llama.cpp's tokens, then rounded in place
        for prompt, (_, ours, logps, generated) in zip(prompts, runs):
            theirs = hf_greedy(model, prompt, n, eos) if len(ours) != generated else []
            unrounded += paired_logprobs(model, prompt, ours, logps, len(ours) == generated, theirs, partial)
        as_written(model)
    agree, diffs = 0, []
    for prompt, (_, ours, logps, generated) in zip(prompts, runs):
        theirs = hf_greedy(model, prompt, n, eos)
        complete = len(ours) == generated
        pairs = paired_logprobs(model, prompt, ours, logps, complete, theirs, partial)
        agree += (ours == theirs) if complete else (len(pairs) == len(ours) and generated == len(theirs))
        diffs += pairs
    if as_written is None:
        unrounded = diffs
    reply = None
    if chat:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        hf_reply = tokenizer.decode(hf_greedy(model, list(ids), 16, eos), skip_special_tokens=True)
        reply = {"equal": llama_reply.strip() == hf_reply.strip(), "llama_cpp": llama_reply, "transformers": hf_reply}
    return {"prompts": len(prompts), "agree": agree, "tokens": len(diffs),
            "mean_abs_logprob_diff": sum(diffs) / max(1, len(diffs)), "max_abs_logprob_diff": max(diffs, default=0.0),
            "mean_abs_logprob_diff_unrounded": sum(unrounded) / max(1, len(unrounded)),
            "chat": reply}
