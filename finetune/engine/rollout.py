"""Generation inside the DeepSpeed engine for online RL, behind DeepSpeed's rollout interface.

DeepSpeed 0.19.8 declares how a trainer talks to whatever generates its completions
(``deepspeed.runtime.rollout``): a :class:`~deepspeed.runtime.rollout.RolloutRequest` of left-padded prompts in,
a :class:`~deepspeed.runtime.rollout.RolloutBatch` of prompt + response out, the sampling knobs in a
:class:`~deepspeed.runtime.rollout.SamplingConfig`, and ``sync_weights`` to push new weights to a backend that
keeps its own copy. :class:`HFGenerateRollout` is that interface over transformers' ``generate`` on the engine's own
module: it runs on every device and every ZeRO stage, with LoRA adapters as they are, and needs no weight sync
(the rollout reads the weights the optimizer just wrote). DeepSpeed's own ``HybridEngineRollout`` (CUDA graphs,
its inference kernels) and a vLLM server backend for GPU clusters fit behind the same interface; neither can run
on a CPU, so neither is wired here (docs/online-rl.md, "Generation backends").

ZeRO-3 holds each rank's shard of every parameter. :meth:`HFGenerateRollout.weights` gathers the whole model on
every rank for a block of generation (``deepspeed.zero.GatheredParameters`` over all parameters, as TRL's
``unwrap_model_for_generation`` with ``ds3_gather_for_generation``): one gather per optimizer step, then every
decoding step runs locally. With ``gather=False`` (models that do not fit whole on one device) nothing is gathered
and ``generate`` runs with ``synced_gpus``: every layer is gathered at every decoding step, all ranks in lockstep
until the longest generation of any rank ends (transformers' ZeRO-3 path).
"""

from __future__ import annotations

import contextlib

import torch
from deepspeed.runtime.rollout import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

from finetune.parallel import distributed as dist_utils


class HFGenerateRollout(RolloutEngine):
    """DeepSpeed's :class:`~deepspeed.runtime.rollout.RolloutEngine` over transformers' ``generate`` on the
    training engine's module.

    Args:
        engine: the DeepSpeed engine (or a plain / peft-wrapped causal LM: one process, nothing to gather).
        tokenizer: the run's tokenizer (``pad_token_id``, ``eos_token_id``).
        gather: under ZeRO-3, gather the whole model for :meth:`weights` (else ``synced_gpus`` generation).
    """

    name = "hf_generate"

    def __init__(self, engine, tokenizer, gather: bool = True):
        self.engine, self.tokenizer, self.gather = engine, tokenizer, gather
        self.model = getattr(engine, "module", engine)

    def _zero3(self) -> bool:
        stage = getattr(self.engine, "zero_optimization_stage", None)
        return stage is not None and stage() == 3

    @contextlib.contextmanager
    def weights(self):
        """While active, the model's whole weights are on every rank (ZeRO-3 with ``gather``; else nothing to do)
        and it is in eval mode (no dropout); the training mode is restored on leaving. Every rank must enter it
        (the gather is a collective)."""
        was_training = self.model.training
        self.model.eval()
        try:
            if self._zero3() and self.gather:
                import deepspeed
                with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
                    yield
            else:
                yield
        finally:
            self.model.train(was_training)

    def generate(self, request: RolloutRequest, sampling: SamplingConfig, seed: int | None = None) -> RolloutBatch:
        """``sampling.n_samples_per_prompt`` completions of each prompt, no gradient.

        Args:
            request: ``prompt_ids`` / ``prompt_attention_mask`` ``[B, T_p]`` int64, left-padded.
            sampling: ``max_new_tokens``; ``temperature`` 0 for greedy decoding, else sampling with ``top_p`` and
                ``top_k`` (<= 0: off).
            seed: seeds torch's RNG for this call (forked: the caller's RNG state is untouched); None: as it is.

        Returns:
            A :class:`~deepspeed.runtime.rollout.RolloutBatch` on the CPU: ``input_ids`` ``[B n, T_p + T_r]`` (a
            prompt's ``n`` completions consecutive; the response padded with the pad token after its EOS),
            ``attention_mask`` (1 on the real prompt tokens and on the response up to and including its first EOS),
            ``response_start_idx`` ``[B n]`` = ``T_p``.
        """
        device = next(self.model.parameters()).device
        ids = request.prompt_ids.to(device)
        mask = request.prompt_attention_mask.to(device)
        if sampling.temperature > 0:
            knobs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                     "top_k": max(sampling.top_k, 0)}
        else:
            knobs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        synced = self._zero3() and not self.gather and dist_utils.world_size() > 1
        tok = self.tokenizer
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                      num_return_sequences=sampling.n_samples_per_prompt,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                      synced_gpus=synced, **knobs)
        out = out.cpu()
        prompt_len = ids.shape[1]
        response = out[:, prompt_len:]
        is_eos = response == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(out),), response.shape[1]))
        response_mask = (torch.arange(response.shape[1])[None] <= first[:, None]).long()
        prompt_mask = request.prompt_attention_mask.cpu().repeat_interleave(sampling.n_samples_per_prompt, 0)
        return RolloutBatch(input_ids=out, attention_mask=torch.cat([prompt_mask, response_mask], 1),
                            response_start_idx=torch.full((len(out),), prompt_len, dtype=torch.long))

    def sync_weights(self, step: int) -> None:
        """Nothing to push: the rollout runs on the training engine's own weights."""
