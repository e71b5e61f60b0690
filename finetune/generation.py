"""Text generation from an exported model: the end-of-run sample of causal-LM recipes.

The sample is generated from the export folder by one process with a plain fp32 copy of the model, outside
DeepSpeed: whatever the ZeRO stage, the other ranks may already have left. Decoding is transformers'
``generate`` (greedy, or temperature / top-k sampling seeded for reproducibility).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.export import plain_model_construction


def sample_text(export_dir: Path, prompt: str, new_tokens: int = 120, temperature: float = 0.0, top_k: int = 0,
                seed: int = 42) -> str:
    """Continuation of ``prompt`` by the causal LM exported in ``export_dir`` (CPU, fp32, one process).

    Args:
        export_dir: a Hugging Face folder (config, weights, tokenizer) such as ``<run>/export``.
        prompt: text to continue (tokenized without special tokens).
        new_tokens: tokens to generate.
        temperature: 0 for greedy decoding, else the softmax temperature of multinomial sampling.
        top_k: with sampling, keep only the k most likely tokens at each step (0: all of them).
        seed: seed of the sampling RNG (forked: the caller's RNG state is untouched).

    Returns:
        The prompt followed by the generated text (special tokens skipped).
    """
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    with plain_model_construction():
        model = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True, dtype=torch.float32).eval()
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k or None} if temperature > 0 else \
        {"do_sample": False}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # synced_gpus=False: this plain copy runs on one rank only; transformers would otherwise sync every
        # decoding step with the other ranks whenever a ZeRO-3 engine lives in the process (and they have left)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             pad_token_id=tokenizer.pad_token_id, synced_gpus=False, **sampling)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_sample(run_dir: Path, cfg) -> str:
    """The end-of-run sample of ``train.sample_prompt`` from ``run_dir/export`` (:func:`sample_text` with the
    ``train.sample_*`` settings and ``train.seed``), written to ``run_dir/sample.txt``; returns it."""
    sample = sample_text(run_dir / "export", cfg.train.sample_prompt, cfg.train.sample_tokens,
                         cfg.train.sample_temperature, cfg.train.sample_top_k, cfg.train.seed)
    (run_dir / "sample.txt").write_text(sample + "\n")
    return sample
