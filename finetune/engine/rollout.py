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
every rank for a block of generation (``deepspeed.zero.GatheredParameters`` over all parameters) and takes
DeepSpeed's ZeRO-3 module hooks off while it holds it (:func:`zero3_hooks_off`, TRL's ``unwrap_model_for_generation``
with ``ds3_gather_for_generation``: ``remove_hooks`` / ``add_hooks``): one gather per optimizer step, then every
decoding step runs locally with no collective, so ranks whose completions end at different lengths never wait for
each other. With the hooks on, each submodule's forward would release its parameters after running and the next
token would gather them again (every parameter above ``stage3_param_persistence_threshold``: every layer of a real
model). With ``gather=False`` (models that do not fit whole on one device) nothing is gathered
and ``generate`` runs with ``synced_gpus``: every layer is gathered at every decoding step, all ranks in lockstep
until the longest generation of any rank ends (transformers' ZeRO-3 path).

With ``fast`` (``train.grpo.fast_generation``, the default) three things change, none of them the greedy
completions or the sampling distribution: each prompt is prefilled once and its KV cache repeated for its ``n``
completions (``generate`` with ``num_return_sequences`` prefills every copy; :meth:`HFGenerateRollout._prefill_once`),
the cache of each full-attention layer is reserved for the whole completion and written in place
(:class:`ReservedLayer`; ``DynamicLayer`` concatenates, a copy of the cache per layer and token), and a sampled token
is drawn by inverting the cumulative distribution with one uniform number per row (:class:`InverseCdfSampler`), where
``generate``'s ``torch.multinomial`` draws an exponential variate for every vocabulary entry. What each saves on the
``grpo`` bench's model: docs/performance.md, "Against TRL's ``GRPOTrainer``".

Across the turns of a multi-turn rollout (tools, environments: :func:`finetune.recipes.grpo.tools.tool_turns`), ``fast``
also keeps the KV cache: inside one :meth:`HFGenerateRollout.weights` block, each ``generate`` call's cache is kept
with the real tokens it covers (:class:`TurnCache`), and a later call whose every row extends one of those rows
(its previous turn, then the tool result's tokens) starts from the cached keys and values of that row instead of
encoding the whole prefix again (:meth:`HFGenerateRollout._cached_prefix`). The cached entries are gathered into
the new call's left-padded layout, real token by real token: a token's key and value depend only on the tokens
before it and on its position, which counts real tokens, so they are the entries a full prefill would compute
(float rounding aside: the greedy completions are those of the full prefill). Only the new tokens (the longest
row's new tail) are encoded. It falls back to a full prefill, and says why once per process
(:data:`TURN_CACHE_STATS`), when a row does not extend a cached one, a call asks for several completions per
prompt, generation runs in lockstep (ZeRO-3 without ``gather_for_generation``), ``fast_generation`` is off, the
model keeps no ``DynamicCache`` or has cache layers other than full attention (sliding-window, linear-attention),
or the call is outside ``weights()`` (the weights may change between calls). The idea is the prefix caching of
inference servers (vLLM's automatic prefix caching, SGLang's RadixAttention) for one rollout's own turns.

Completions are sampled from the policy the loss assumes: ``softmax(logits / temperature)`` with top-k / top-p and
nothing else. A model's ``generation_config.json`` may add logits processors of its own (Qwen2.5-Instruct ships
``repetition_penalty: 1.05``; others ``no_repeat_ngram_size``, ``min_new_tokens``, ``suppress_tokens``, ``min_p``,
``typical_p``); ``generate`` would apply each one that the call does not override. :func:`policy_generation_config`
replaces the model's generation config for the call with transformers' global defaults (TRL passes a whole
``GenerationConfig`` for the same reason), and :func:`overridden_settings` names what the model's file set, logged
once per process.

A completion ends at the first of its model's end tokens (:func:`stop_token_ids`): the tokenizer's EOS and every
id of the ``generation_config.json``'s ``eos_token_id``, which real chat models set to a list (Gemma's
``<end_of_turn>`` beside ``<eos>``, Llama 3's ``<|eot_id|>`` and ``<|eom_id|>`` beside ``<|end_of_text|>``), as TRL
1.16's ``GRPOTrainer`` stops and masks; the tokenizer's EOS alone would let a Gemma completion run on past its turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
from deepspeed.runtime.rollout import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from finetune.data import images
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils


class InverseCdfSampler(LogitsProcessor):
    """The last logits processor of a greedy ``generate``: draws each row's next token from ``softmax(scores)`` and
    returns scores that are 0 at the drawn token and ``-inf`` elsewhere, so greedy decoding picks it.

    The draw inverts the cumulative distribution (float64) at one uniform number per row: the same distribution as
    ``torch.multinomial`` (tokens of probability 0, e.g. cut by top-k, are never drawn) from ``B`` random numbers
    instead of ``B x V`` exponential variates (torch's multinomial, a per-step cost that grows with the vocabulary).
    Uses torch's global RNG on the scores' device.
    """

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``scores`` ``[B, V]`` float (after the warpers) -> ``[B, V]`` of the same dtype, one 0 per row."""
        cdf = scores.softmax(-1, dtype=torch.float64).cumsum_(-1)
        u = torch.rand((len(scores), 1), dtype=torch.float64, device=scores.device) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


class ReservedLayer(DynamicLayer):
    """A :class:`~transformers.cache_utils.DynamicLayer` whose keys and values are views of buffers reserved for
    ``capacity`` positions: each decoding step writes its position in place, where ``DynamicLayer`` concatenates
    (a copy of the whole cache, per layer and step). Past ``capacity`` it grows as ``DynamicLayer``."""

    @classmethod
    def reserve(cls, layer: DynamicLayer, capacity: int) -> "ReservedLayer":
        """``layer``'s cached ``[B, H, T, D]`` keys and values in buffers of ``max(T, capacity)`` positions."""
        new = cls()
        new.dtype, new.device, new.is_initialized = layer.keys.dtype, layer.keys.device, True
        b, h, t, d = layer.keys.shape
        new._k = layer.keys.new_empty((b, h, max(t, capacity), d))
        new._v = layer.values.new_empty((b, h, max(t, capacity), layer.values.shape[-1]))
        new._k[:, :, :t].copy_(layer.keys)
        new._v[:, :, :t].copy_(layer.values)
        new.keys, new.values = new._k[:, :, :t], new._v[:, :, :t]
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t, n = self.keys.shape[-2], key_states.shape[-2]
        if t + n > self._k.shape[-2] or key_states.shape[0] != self._k.shape[0]:
            return super().update(key_states, value_states, *args, **kwargs)
        self._k[:, :, t:t + n].copy_(key_states)
        self._v[:, :, t:t + n].copy_(value_states)
        self.keys, self.values = self._k[:, :, :t + n], self._v[:, :, :t + n]
        return self.keys, self.values


def sampling_processors(sampling: SamplingConfig) -> LogitsProcessorList:
    """``sampling``'s warpers in ``generate``'s order (temperature, top-k, top-p; each only when it changes
    anything, as ``generate`` adds them), then :class:`InverseCdfSampler`."""
    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        out.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p))
    out.append(InverseCdfSampler())
    return out


def _parameter_offload(engine):
    """The ZeRO-3 parameter coordinator that owns the module hooks (``engine.optimizer.parameter_offload``, or the
    optimizer itself in DeepSpeed versions that keep them there); None outside ZeRO-3 or before an optimizer."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return None
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if hasattr(offload, "forward_hooks") and hasattr(offload, "_register_deepspeed_module") else None


@contextlib.contextmanager
def zero3_hooks_off(engine):
    """While active, DeepSpeed's ZeRO-3 forward and backward module hooks are removed from ``engine``'s module (no
    submodule gathers or releases its parameters around its forward), and so is its top-level forward pre-hook
    (``DeepSpeedZeRoOffload.fwd_pre_hook``: the coordinator's ``reset_step``, which broadcasts while a prefetch
    trace is recorded, so a rank that runs the root module's forward more often than another, e.g. more tool
    turns, would wait for a broadcast the other never makes); on leaving they are registered again, the pre-hook
    first as DeepSpeed orders them, and the prefetch trace is invalidated (``_register_deepspeed_module`` of the root
    does it). TRL 1.16's own ``remove_hooks`` / ``add_hooks`` (``trl.models.utils``) on DeepSpeed 0.19.8's
    ``DeepSpeedZeRoOffload``, plus the pre-hook, which TRL leaves on. Use it only while every parameter is gathered
    (``deepspeed.zero.GatheredParameters``); outside ZeRO-3 it does nothing."""
    offload = _parameter_offload(engine)
    if offload is None:
        yield
        return
    from trl.models.utils import add_hooks, remove_hooks  # TRL's import: only where ZeRO-3 generates

    module = offload.module
    remove_hooks(engine)
    pre = getattr(offload, "fwd_pre_hook", None)
    start = module._forward_pre_hooks.get(pre.id) if pre is not None else None
    if start is not None:
        pre.remove()
    try:
        yield
    finally:
        if start is not None:
            offload.fwd_pre_hook = module.register_forward_pre_hook(start)
        add_hooks(engine)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids a completion ends at: the tokenizer's ``eos_token_id`` first, then each id of the model's
    ``generation_config.eos_token_id`` (an int or a list) not already there (TRL 1.16 ``GRPOTrainer``'s
    ``eos_token_ids``). ``model``: the causal LM (or a wrapper with ``generation_config``), or None."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in ([own] if isinstance(own, int) else list(own or [])):
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def policy_generation_config(model) -> GenerationConfig:
    """A generation config with transformers' global defaults only (no logits processor of the model's own), with
    the model's special token ids; put on the model for a rollout's ``generate`` call
    (:meth:`HFGenerateRollout.generate`)."""
    own = getattr(model, "generation_config", None)
    clean = GenerationConfig()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        setattr(clean, key, getattr(own, key, None))
    return clean


_SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "top_h", "epsilon_cutoff",
                  "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                  "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens", "suppress_tokens",
                  "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id",
                  "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values", "guidance_scale",
                  "watermarking_config", "stop_strings", "num_beams", "length_penalty")
"""``GenerationConfig`` keys that change which token ``generate`` picks (its logits processors, warpers and
stopping criteria besides EOS and the length)."""


def overridden_settings(model) -> dict:
    """The settings of ``model.generation_config`` (its ``generation_config.json``) among :data:`_SAMPLING_KEYS` that
    differ from transformers' global defaults, as ``{key: value}``: what a rollout does not apply."""
    own = getattr(model, "generation_config", None)
    if own is None:
        return {}
    defaults = GenerationConfig._get_default_generation_params()
    found = {}
    for key in _SAMPLING_KEYS:
        value = getattr(own, key, None)
        if value is None or value == defaults.get(key) or (key == "do_sample" and not value):
            continue
        found[key] = value
    return found


_ANNOUNCED: set = set()


def announce_overrides(model) -> None:
    """Log once per process (rank 0) which of the model's generation settings the rollouts do not apply."""
    found = overridden_settings(model)
    key = repr(sorted(found.items(), key=lambda kv: kv[0]))
    if not found or key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    if dist_utils.is_main():
        text = ", ".join(f"{k}={v!r}" for k, v in sorted(found.items()))
        logger.info(f"rollout: the model's generation_config sets {text}; completions are sampled from the policy "
                    f"itself (train.grpo.temperature, top_p, top_k only), so these are not applied")


@dataclasses.dataclass
class TurnCache:
    """The KV cache of a ``generate`` call inside :meth:`HFGenerateRollout.weights`, for the next turn."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer, keys and values ``[R, H_kv, L, D]`` of the call's rows (on the model's device)."""
    positions: list[torch.Tensor]
    """Per row, the columns ``< L`` that hold its real tokens (int64, ascending)."""
    index: dict[tuple[int, ...], int]
    """Each row's real tokens (prompt, then the response up to and including its EOS) -> the row."""
    lengths: list[int]
    """The distinct lengths of the rows' real tokens, longest first."""


TURN_CACHE_STATS = {"reused": 0, "full": 0, "cached_tokens": 0, "encoded_tokens": 0, "why_not": {}}
"""Counts of this process's continuation calls inside ``weights()``: ``reused`` (started from the cache),
``full`` (a full prefill after a cached call), the real tokens taken from the cache and the prefix tokens encoded
again (the reused calls' rows), and ``why_not``: reason -> calls that fell back for it."""
_TURNS: dict[int, TurnCache | None] = {}
"""id(model) -> the last call's :class:`TurnCache` while a ``weights()`` block of that model is open."""
_TOLD: set[str] = set()


def _no_reuse(why: str) -> None:
    TURN_CACHE_STATS["full"] += 1
    TURN_CACHE_STATS["why_not"][why] = TURN_CACHE_STATS["why_not"].get(why, 0) + 1
    if why not in _TOLD and dist_utils.is_main():
        _TOLD.add(why)
        logger.info(f"rollout: a turn is encoded from its whole prefix, not from the previous turn's KV cache: {why}")


class HFGenerateRollout(RolloutEngine):
    """DeepSpeed's :class:`~deepspeed.runtime.rollout.RolloutEngine` over transformers' ``generate`` on the
    training engine's module.

    Args:
        engine: the DeepSpeed engine (or a plain / peft-wrapped causal LM: one process, nothing to gather).
        tokenizer: the run's tokenizer (``pad_token_id``, ``eos_token_id``; with the model's generation config:
            :meth:`stop_ids`).
        gather: under ZeRO-3, gather the whole model for :meth:`weights` (else ``synced_gpus`` generation).
        fast: one prefill per prompt and :class:`InverseCdfSampler` (module docstring); False: ``generate`` with
            ``num_return_sequences`` and its own sampling. ``synced_gpus`` generation always runs the latter.
    """

    name = "hf_generate"

    def __init__(self, engine, tokenizer, gather: bool = True, fast: bool = True):
        self.engine, self.tokenizer, self.gather, self.fast = engine, tokenizer, gather, fast
        self.model = getattr(engine, "module", engine)

    def stop_ids(self) -> list[int]:
        """The ids a completion ends at (:func:`stop_token_ids` of the model and the tokenizer)."""
        return stop_token_ids(self._base(), self.tokenizer)

    def _zero3(self) -> bool:
        stage = getattr(self.engine, "zero_optimization_stage", None)
        return stage is not None and stage() == 3

    @contextlib.contextmanager
    def weights(self):
        """While active, the model's whole weights are on every rank (ZeRO-3 with ``gather``: one gather, DeepSpeed's
        module hooks off (:func:`zero3_hooks_off`), so decoding runs no collective; else nothing to do) and it is in
        eval mode (no dropout); the hooks and the training mode are restored on leaving. Every rank must enter it
        (the gather is a collective)."""
        was_training = self.model.training
        self.model.eval()
        key, opened = id(self.model), id(self.model) not in _TURNS
        if opened:  # the turns' KV caches live as long as these weights (module docstring)
            _TURNS[key] = None
        try:
            if self._zero3() and self.gather:
                import deepspeed
                with deepspeed.zero.GatheredParameters(list(self.model.parameters())), zero3_hooks_off(self.engine):
                    yield
            else:
                yield
        finally:
            if opened:
                _TURNS.pop(key, None)
            self.model.train(was_training)

    def generate(self, request: RolloutRequest, sampling: SamplingConfig, seed: int | None = None,
                 inputs: dict | None = None) -> RolloutBatch:
        """``sampling.n_samples_per_prompt`` completions of each prompt, no gradient.

        Args:
            request: ``prompt_ids`` / ``prompt_attention_mask`` ``[B, T_p]`` int64, left-padded.
            sampling: ``max_new_tokens``; ``temperature`` 0 for greedy decoding, else sampling with ``top_p`` and
                ``top_k`` (<= 0: off).
            seed: seeds torch's RNG for this call (forked: the caller's RNG state is untouched); None: as it is.
            inputs: more model inputs of the prompts (an image-text model's ``pixel_values``, ``image_grid_thw``,
                ... as its processor joins a batch): they go to the prefill (``fast``) or to ``generate``, which
                repeats them for the ``n`` completions (transformers' ``_expand_inputs_for_generation``, each model's
                own where its image tensors are not one row per prompt).

        Returns:
            A :class:`~deepspeed.runtime.rollout.RolloutBatch` on the CPU: ``input_ids`` ``[B n, T_p + T_r]`` (a
            prompt's ``n`` completions consecutive; the response padded with the pad token after its end token:
            :meth:`stop_ids`), ``attention_mask`` (1 on the real prompt tokens and on the response up to and including
            its first end token),
            ``response_start_idx`` ``[B n]`` = ``T_p``.

        Decodes with a KV cache whatever the model's ``use_cache`` says (an SFT export of packed rows says false),
        and with none of the model's own generation settings (:func:`policy_generation_config`). Inside
        :meth:`weights` with ``fast``, a prompt that extends a previous call's row starts from that row's KV cache
        (module docstring); the tokens are those of a full prefill.
        """
        device = next(self.model.parameters()).device
        ids = request.prompt_ids.to(device)
        mask = request.prompt_attention_mask.to(device)
        n = sampling.n_samples_per_prompt
        synced = self._zero3() and not self.gather and dist_utils.world_size() > 1
        fast = self.fast and not synced
        if sampling.temperature > 0 and fast:
            knobs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                     "logits_processor": sampling_processors(sampling)}
        elif sampling.temperature > 0:
            knobs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                     "top_k": max(sampling.top_k, 0)}
        else:
            knobs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        tok, stops = self.tokenizer, self.stop_ids()
        inputs = {k: v.to(device) for k, v in (inputs or {}).items()}
        base = self._base()
        announce_overrides(base)
        suppressed = image_token_ids(base.config)
        if suppressed:  # an image-text model: never an image placeholder in a completion (image_token_ids)
            knobs["suppress_tokens"] = suppressed
        key = id(self.model)
        session = key in _TURNS  # inside weights(): keep this call's cache for the next turn
        keep = session and fast and self._caches_dynamically()
        previous = _TURNS.get(key)
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                _generation_config(base, policy_generation_config(base)):
            if seed is not None:
                torch.manual_seed(seed)
            cache = None
            if session and not keep and dist_utils.is_main() and "off" not in _TOLD:
                _TOLD.add("off")
                logger.info("rollout: turns are encoded from their whole prefix, no KV cache kept across turns: "
                            + ("lockstep ZeRO-3 generation (gather_for_generation false)" if synced else
                               "fast_generation is off" if not self.fast else "the model keeps no DynamicCache"))
            if previous is not None:  # a continuation: from the previous turn's cache where every row extends one
                if inputs:
                    _no_reuse("a prompt with images")
                elif n > 1:
                    _no_reuse("several completions per prompt")
                else:
                    cache = self._cached_prefix(previous, ids, mask, sampling.max_new_tokens)
            if cache is None and fast and ids.shape[1] > 1 and self._caches_dynamically() and (n > 1 or keep):
                cache = self._prefill_once(ids, mask, n, sampling.max_new_tokens, inputs)
            if cache is not None:  # the images are in the cache: generate decodes from the prompt's last token
                ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
                knobs |= {"past_key_values": cache, "num_return_sequences": 1}
            else:
                knobs |= {"num_return_sequences": n, **inputs}
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                      pad_token_id=tok.pad_token_id, eos_token_id=stops,
                                      synced_gpus=synced, use_cache=True, **knobs)
        batch = response_batch(out, request.prompt_attention_mask, request.prompt_ids.shape[1], stops, n)
        if session:
            _TURNS[key] = _turn_cache(cache, batch) if keep and cache is not None else None
        return batch

    def _cached_prefix(self, turn: TurnCache, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) \
            -> DynamicCache | None:
        """The KV cache of ``ids[:, :-1]`` (``[R, W]`` left-padded, one completion each) from ``turn``'s rows that
        each row extends: the cached real tokens gathered into this call's layout (row ``i``'s first ``K - pad_i``
        real tokens, ``K`` the same for all rows: the longest new tail decides it; zeros on the padding), then the
        rest encoded, the full-attention layers reserved for ``new_tokens`` more; None (a full prefill) when a row
        extends no cached row."""
        width = ids.shape[1]
        cpu_ids, cpu_mask = ids.cpu(), mask.cpu().bool()
        source, take = [], []
        for row, m in zip(cpu_ids, cpu_mask):
            real = row[m].tolist()
            found = next((turn.index[k] for k in (tuple(real[:n]) for n in turn.lengths if n < len(real))
                          if k in turn.index), None)
            if found is None:
                _no_reuse("a prompt that extends no row of the previous call")
                return None
            source.append(found)
            take.append((width - len(real), len(turn.positions[found])))  # (padding, cached real tokens)
        k = min(pad + cached for pad, cached in take)
        if k <= 0:
            _no_reuse("nothing of the prompts cached")
            return None
        column = torch.zeros((len(source), k), dtype=torch.long)
        valid = torch.zeros((len(source), k), dtype=torch.bool)
        for i, (o, (pad, _)) in enumerate(zip(source, take)):
            n = max(0, k - pad)
            if n:
                column[i, k - n:] = turn.positions[o][:n]
                valid[i, k - n:] = True
        device = ids.device
        column, valid, rows = column.to(device), valid.to(device), torch.tensor(source, device=device)
        base = self._base()
        cache = DynamicCache(config=base.config.get_text_config(decoder=True))
        if len(cache.layers) != len(turn.layers):
            _no_reuse("the model's cache layers changed")
            return None
        layers = []
        for keys, values in turn.layers:
            picked = []
            for t in (keys, values):
                t = t.index_select(0, rows)
                at = column[:, None, :, None].expand(t.shape[0], t.shape[1], k, t.shape[3])
                picked.append(torch.gather(t, 2, at).masked_fill_(~valid[:, None, :, None], 0.0))
            layer = DynamicLayer()
            layer.dtype, layer.device, layer.is_initialized = picked[0].dtype, picked[0].device, True
            layer.keys, layer.values = picked
            layers.append(layer)
        cache.layers = layers
        TURN_CACHE_STATS["reused"] += 1
        TURN_CACHE_STATS["cached_tokens"] += int(valid.sum())
        TURN_CACHE_STATS["encoded_tokens"] += int(mask[:, k:width - 1].sum())
        if k < width - 1:  # the new tokens but the last (generate runs that one and decodes)
            params = inspect.signature(base.forward).parameters
            extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
            if "position_ids" in params:
                extra["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, k:-1]
            self.model(input_ids=ids[:, k:-1], attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True,
                       **extra)
        cache.layers = [ReservedLayer.reserve(x, width + new_tokens) for x in cache.layers]
        return cache

    def _base(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def _caches_dynamically(self) -> bool:
        """The model keeps transformers' ``DynamicCache`` (decoder-only attention models; not Mamba-like states)."""
        base = self._base()
        return not base.config.is_encoder_decoder and getattr(base, "_supports_default_dynamic_cache", lambda: False)()

    def _prefill_once(self, ids: torch.Tensor, mask: torch.Tensor, n: int, new_tokens: int,
                      inputs: dict | None = None) -> DynamicCache:
        """The KV cache of each prompt but its last token, computed once and repeated ``n`` times (``[B n]`` rows, a
        prompt's copies consecutive, as ``num_return_sequences`` orders them), its full-attention layers reserved for
        the whole generation (:class:`ReservedLayer`); ``generate`` then runs the last prompt token and decodes.
        Positions as ``generate`` makes them from the left-padded mask (``cumsum - 1``, 0 on the padding), passed
        when the model's forward takes them, unless it computes its own (:func:`own_positions`); ``inputs``: the
        prompts' image tensors, encoded with them (a prompt's last token is never an image's; the per-token inputs,
        :data:`finetune.data.images.TOKEN_KEYS`, cut as the ids are); a model that keeps its rotary offsets per row
        (Qwen2.5-VL's ``rope_deltas``, from the prefill's 3-D positions) has them repeated as the cache is, so
        ``generate`` continues every copy at its prompt's positions."""
        base = self._base()
        cache = DynamicCache(config=base.config.get_text_config(decoder=True))
        params = inspect.signature(base.forward).parameters
        extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        extra |= {k: v[:, :-1] if k in images.TOKEN_KEYS else v for k, v in (inputs or {}).items()}
        if "position_ids" in params and not own_positions(base):
            extra["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, :-1]
        self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True, **extra)
        cache.batch_repeat_interleave(n)
        for m in (base, getattr(base, "model", None)):  # Qwen2.5-VL's offsets of its 3-D positions, one per row
            deltas = getattr(m, "rope_deltas", None)
            if isinstance(deltas, torch.Tensor) and deltas.shape[0] == ids.shape[0] and n > 1:
                m.rope_deltas = deltas.repeat_interleave(n, 0)
        cache.layers = [ReservedLayer.reserve(x, ids.shape[1] + new_tokens) if type(x) is DynamicLayer
                        and x.is_initialized else x for x in cache.layers]
        return cache

    def sync_weights(self, step: int) -> None:
        """Nothing to push: the rollout runs on the training engine's own weights."""


IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                    "vision_start_token_id")
"""Config keys of an image-text model's placeholder tokens: each stands for image (or video) features that only the
processor places, and Qwen2.5-VL's rotary positions start an image at ``vision_start_token_id``."""


def image_token_ids(config) -> list[int]:
    """The placeholder token ids of an image-text model's config (:data:`IMAGE_TOKEN_KEYS`; none for a text model),
    which generation never samples (``generate``'s ``suppress_tokens``): a sampled image token would have no image
    features in the training pass (transformers refuses the forward: "Image features and image tokens do not
    match"). The sampling distribution is then the model's renormalised over the other tokens, as top-k and top-p
    truncate it; the loss's log-probabilities stay the full softmax's, as with those (TRL's)."""
    if getattr(config, "vision_config", None) is None:
        return []
    ids = {getattr(config, k, None) for k in IMAGE_TOKEN_KEYS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def own_positions(model) -> bool:
    """The model computes its positions from the attention mask and its image grid (Qwen2.5-VL's 3-D rotary
    positions: ``get_rope_index``), so a caller passes none."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(hasattr(m, "get_rope_index") for m in (model, getattr(model, "model", None)) if m is not None)


def _turn_cache(cache: DynamicCache, batch: RolloutBatch) -> TurnCache | None:
    """What the next turn needs of a call's ``cache`` (which covers ``batch.input_ids``' first columns); None when
    a layer is not full attention (its cache is not one entry per column)."""
    if not all(isinstance(x, DynamicLayer) and type(x) in (DynamicLayer, ReservedLayer) and x.is_initialized
               for x in cache.layers):
        _no_reuse("cache layers other than full attention (sliding-window, linear-attention)")
        return None
    length = cache.get_seq_length()
    real = batch.attention_mask.bool()
    index = {}
    for i, (row, m) in enumerate(zip(batch.input_ids, real)):
        index.setdefault(tuple(row[m].tolist()), i)
    return TurnCache(layers=[(x.keys, x.values) for x in cache.layers],
                     positions=[m[:length].nonzero().flatten() for m in real],
                     index=index, lengths=sorted({len(k) for k in index}, reverse=True))


@contextlib.contextmanager
def _generation_config(model, config: GenerationConfig):
    """``model.generation_config`` is ``config`` while active (restored after)."""
    own = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = own


def response_batch(out: torch.Tensor, prompt_mask: torch.Tensor, prompt_len: int, eos: int | list[int],
                   n: int) -> RolloutBatch:
    """A :class:`~deepspeed.runtime.rollout.RolloutBatch` on the CPU from generated ``[B n, T_p + T_r]`` ids (pad after
    each response's first end token, one of ``eos``: :func:`stop_token_ids`): the attention mask is the prompts'
    ``[B, T_p]`` mask repeated ``n`` times, then 1 on each response up to and including its first end token (all of
    it without one)."""
    out = out.cpu()
    response = out[:, prompt_len:]
    is_eos = torch.isin(response, torch.tensor([eos] if isinstance(eos, int) else list(eos), dtype=response.dtype))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(out),), response.shape[1]))
    response_mask = (torch.arange(response.shape[1])[None] <= first[:, None]).long()
    return RolloutBatch(input_ids=out, attention_mask=torch.cat([prompt_mask.cpu().repeat_interleave(n, 0),
                                                                 response_mask], 1),
                        response_start_idx=torch.full((len(out),), prompt_len, dtype=torch.long))


HYBRID_ENGINE_MODELS = ("gpt2", "gpt_neo", "gpt_neox", "gptj", "bloom", "opt", "llama")
"""``model_type`` of the transformers causal LMs DeepSpeed 0.19.8's hybrid engine has inference kernels for (the
transformers layer classes of its ``module_inject.replace_policy.replace_policies``)."""


class HybridEngineGenerate(HFGenerateRollout):
    """DeepSpeed's own :class:`~deepspeed.runtime.rollout.HybridEngineRollout` behind finetune's rollout calls
    (``train.grpo.generation_backend: hybrid_engine``).

    On CUDA GPUs, with ``hybrid_engine.enabled`` in the DeepSpeed config (the toolkit sets it for this backend), the
    engine is DeepSpeed's ``DeepSpeedHybridEngine``: its ``eval()`` swaps the layers' forwards for DeepSpeed's
    inference kernels (for the models of :data:`HYBRID_ENGINE_MODELS`) and ``train()`` swaps them back, so
    :meth:`weights` switches the **engine**, not only the module. ``HybridEngineRollout`` samples through
    ``generate`` with EOS off (every rank decodes ``max_new_tokens`` steps, what ZeRO's collectives need) and pads
    each response after its first EOS; with ``n`` > 1 it prefills each prompt once (``use_shared_prefill``, hybrid
    engine only). :func:`response_batch` then gives the same batch layout as :class:`HFGenerateRollout`; with the
    same seed the completions equal those of ``generate`` with ``num_return_sequences`` (``fast=False``).

    The toolkit refuses this backend before any model is built on the CPU (DeepSpeed has no CPU build of the
    inference kernels), with LoRA (the kernels copy the base weights; the adapters would be left out), under ZeRO-3
    and for other model types; ``finetune selftest``'s ``hybrid_rollout`` row checks it on a GPU node.

    Args:
        engine: the DeepSpeed engine (a ``DeepSpeedHybridEngine`` on GPUs; any object with a ``.module`` causal LM
            runs ``HybridEngineRollout``'s ``generate`` path).
        tokenizer: the run's tokenizer (``pad_token_id``, ``eos_token_id``).
    """

    name = "hybrid_engine"

    def __init__(self, engine, tokenizer):
        super().__init__(engine, tokenizer, gather=False, fast=False)

    @contextlib.contextmanager
    def weights(self):
        """While active, the engine is in eval mode (the hybrid engine's inference forwards); training mode after."""
        switch = self.engine if hasattr(self.engine, "eval") else self.model
        was_training = self.model.training
        switch.eval()
        try:
            yield
        finally:
            switch.train(was_training)

    def generate(self, request: RolloutRequest, sampling: SamplingConfig, seed: int | None = None,
                 inputs: dict | None = None) -> RolloutBatch:
        """As :meth:`HFGenerateRollout.generate`, through DeepSpeed's ``HybridEngineRollout`` (text prompts only).

        Raises:
            ValueError: ``inputs`` given (DeepSpeed's rollout takes token ids alone; refused before training by the
                ``grpo`` checks).
        """
        if inputs:
            raise ValueError("the hybrid_engine rollout takes no image inputs; use generation_backend hf_generate")
        from deepspeed.runtime.rollout import HybridEngineRollout
        from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

        device = next(self.model.parameters()).device
        n = sampling.n_samples_per_prompt
        shared = n > 1 and hasattr(self.engine, "prepare_shared_prefill") and not self._zero3()
        rollout = HybridEngineRollout(self.engine, self.tokenizer, HybridEngineRolloutConfig(use_shared_prefill=shared))
        base = self._base()
        announce_overrides(base)
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                _generation_config(base, policy_generation_config(base)):
            if seed is not None:
                torch.manual_seed(seed)
            batch = rollout.generate(RolloutRequest(request.prompt_ids.to(device),
                                                    request.prompt_attention_mask.to(device)), sampling)
        return response_batch(batch.input_ids, request.prompt_attention_mask, request.prompt_ids.shape[1],
                              self.stop_ids(), n)


def make_rollout(engine, tokenizer, backend: str = "hf_generate", gather: bool = True,
                 fast: bool = True) -> HFGenerateRollout:
    """The rollout of ``train.grpo.generation_backend``: :class:`HFGenerateRollout` (``hf_generate``, with
    ``gather`` and ``fast``) or :class:`HybridEngineGenerate` (``hybrid_engine``)."""
    if backend == "hybrid_engine":
        return HybridEngineGenerate(engine, tokenizer)
    return HFGenerateRollout(engine, tokenizer, gather=gather, fast=fast)


def lockstep(engine, gather: bool) -> bool:
    """Whether generation on ``engine`` runs layer by layer in lockstep with the other ranks (``generate``'s
    ``synced_gpus``): ZeRO-3 over more than one rank without ``gather`` (``gather_for_generation``)."""
    stage = getattr(engine, "zero_optimization_stage", None)
    return stage is not None and stage() == 3 and not gather and dist_utils.world_size() > 1


def sampling_seed(train_seed: int, step: int, row_seeds: torch.Tensor) -> int:
    """A sampling seed from ``train.seed``, the optimizer step and the step's rows' seeds (``row_seeds`` ``[R]``
    int64): the same on a resume and whatever the rank."""
    return (train_seed * 1_000_003 + step * 7919 + int(row_seeds.sum()) * 31 + int(row_seeds[0])) % (2 ** 63 - 1)


def complete(engine, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingConfig, tokenizer,
             seed: int, inputs: dict | None = None, backend: str = "hf_generate", gather: bool = True,
             fast: bool = True) -> dict:
    """``sampling.n_samples_per_prompt`` completions of each prompt through :func:`make_rollout` (no gradient; the
    caller holds the rollout's :meth:`~HFGenerateRollout.weights`), as the recipes that sample (``grpo``, ``distill``)
    train on them.

    Args:
        engine: the engine (or a plain causal LM).
        input_ids, attention_mask: ``[B, T_p]`` int64 prompts, left-padded.
        sampling: ``max_new_tokens``, ``temperature`` (0: greedy), ``top_p``, ``top_k``, ``n_samples_per_prompt``.
        tokenizer: ``pad_token_id`` and ``eos_token_id``.
        seed: the sampling seed (:func:`sampling_seed`).
        inputs: the prompts' other model inputs (image tensors as the model's processor joins them), or None.
        backend, gather, fast: :func:`make_rollout`'s; ``gather`` False under ZeRO-3: generation in lockstep
            (:func:`lockstep`).

    Returns:
        ``completion_ids`` ``[B n, C]`` int64 (pad after the end token), ``completion_mask`` ``[B n, C]`` float32 (1 up
        to and including the first end token: :func:`stop_token_ids`), ``terminated`` ``[B n]`` bool (an end token
        was generated), ``lengths`` ``[B n]`` int64.
    """
    rollout = make_rollout(engine, tokenizer, backend, gather=gather, fast=fast)
    out = rollout.generate(RolloutRequest(input_ids, attention_mask), sampling, seed, inputs)
    p = int(out.response_start_idx[0]) if len(out.response_start_idx) else input_ids.shape[1]
    completion, cmask = out.input_ids[:, p:], out.attention_mask[:, p:].float()
    stops = rollout.stop_ids()
    terminated = (torch.isin(completion, torch.tensor(stops, dtype=completion.dtype)) & cmask.bool()).any(1)
    return {"completion_ids": completion, "completion_mask": cmask, "terminated": terminated,
            "lengths": cmask.sum(1).long()}
