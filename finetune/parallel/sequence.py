"""Sequence parallelism (DeepSpeed Ulysses) for Hugging Face causal LMs, and the memory levers of long sequences.

**Sequence parallelism** (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509; Bekman et al. 2025, "Arctic
Long Sequence Training", arXiv:2506.13996; DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``):

* :func:`start_sequence_parallel` registers ``UlyssesSPAttentionHF`` with transformers for the model's attention
  implementation (``sdpa`` or ``flash_attention_2``; DeepSpeed refuses ``eager``) and creates the SP groups; the
  returned ``mpu`` goes to ``deepspeed.initialize``. Each attention layer then trades sequence for heads with an
  all-to-all, attends over the whole sequence with ``heads / sp`` heads, and trades back.
* :class:`SequenceShard` cuts every collated micro-batch along the sequence in the data path (the collator), an
  equivalent of DeepSpeed's ``UlyssesSPDataLoaderAdapter`` for loaders whose SP ranks already hold the same rows:
  labels are shifted by one **before** the cut (``shift_labels``: the last token of a shard predicts the first of
  the next), the length is padded to a multiple of ``sp`` (pad positions continue the row's positions, come after
  every real token, take no loss, and causal attention never lets a real token see them; a row stays one example
  for attention, with no mask), ``position_ids`` are made explicit (Ulysses gathers
  them to mask causally), and ``attention_mask`` is replaced by the shard's real-token count (Ulysses discards
  masks: right padding under causal attention needs none).
* Packed rows whose ``position_ids`` restart per example (``sft`` packing) keep examples apart under ``sdpa``:
  :func:`start_sequence_parallel` wraps the core ``sdpa`` so that, given the gathered ``position_ids`` and no mask,
  it attends each example on its own (causal, no mask: nothing of size ``seq x seq``, sdpa's flash or
  memory-efficient kernel); under a flash kernel the data pipeline joins each micro-batch into one row first and
  the variable-length kernel reads the gathered ``position_ids`` (:func:`finetune.data.batch.flatten`).
* Loss: each rank sums the token losses of its shard and counts its shard's targets; the loop's target count is
  the sum over all ranks (every target counted once), and DeepSpeed divides the gradient sum over all ranks by the
  data-parallel size, so the loop scales by ``dp x accumulation / targets`` (:mod:`finetune.training.trainer`): SP=2 trains
  the same model as SP=1.
* Losses of whole sequences (``dpo``: a pair's log-probabilities): every slice carries its rows' whole target
  counts (``row_targets``); :func:`sum_over_sequence` adds the slices' sums over the SP group differentiably, and
  each rank weighs what it then computes whole by :func:`sequence_weight` (``1 / sp``), so it counts once.
* :func:`sequence_parallel_off` restores transformers' own model for work on whole sequences (the export check,
  text generation during evaluation and at the end: every rank generates its own prompts, as without SP): every
  change this module made goes through :mod:`finetune.patches`, and all of them are undone for the block.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from finetune import patches
from finetune.config import RunConfig
from finetune.errors import ConfigError
from finetune.parallel import distributed as dist_utils
from finetune.parallel.layout import SIZE_KEYS, Layout, head_problems

DIMENSION = "sequence"
"""The name of this dimension in a recipe's ``Capabilities.parallel``."""


def check(cfg: RunConfig, model_config, supported: Collection[str], problems: list[str], offered: str = "") -> None:
    """What sequence parallelism and the long-sequence memory levers (``parallel.tiled_mlp``,
    ``model.offload_activations``) need of the run, one problem line each, before any model is built.

    Args:
        cfg: the run config.
        model_config: the transformers config (``num_attention_heads``, ``num_key_value_heads``), or None.
        supported: the parallel dimensions the recipe supports (its ``Capabilities.parallel``).
        offered: the recipes that support sequence parallelism, for the lines (``"gpt_clm and sft"``).
        problems: where the lines go.
    """
    if cfg.model.offload_activations and not cfg.model.gradient_checkpointing:
        problems.append("model.offload_activations: offloads the hidden states that gradient checkpointing keeps; set "
                        "model.gradient_checkpointing=true too (or model.offload_activations=false)")
    if cfg.parallel.tiled_mlp and DIMENSION not in supported:
        problems.append(f"parallel.tiled_mlp: recipe {cfg.recipe} is not a causal LM"
                        f"{f' ({offered} tile their decoder MLPs)' if offered else ''}; set parallel.tiled_mlp=false")
    sp = cfg.parallel.sequence_parallel_size
    key = SIZE_KEYS["sp"]
    if sp < 1:
        problems.append(f"{key}: {sp} must be 1 (off) or more")
        return
    if sp == 1:
        return
    if DIMENSION not in supported:
        problems.append(f"{key}: recipe {cfg.recipe} does not support sequence parallelism"
                        f"{f' ({offered} do)' if offered else ''}; set {key}=1")
    if cfg.model.attn_implementation == "eager":
        problems.append(f"{key}: model.attn_implementation=eager cannot be sequence-parallel (DeepSpeed's Ulysses "
                        f"needs an implementation that masks causally without a 4D mask); use sdpa or "
                        f"flash_attention_2")
    if cfg.train.loss_weighting != "token":
        problems.append(f"{key}: train.loss_weighting={cfg.train.loss_weighting} averages each micro-batch on its own, "
                        f"but a sequence-parallel rank holds only a slice of it; use train.loss_weighting=token")
    problems += head_problems(model_config, sp, key, f"each sequence-parallel rank attends with heads / {sp}",
                              kv_multiple=True)


_ULYSSES_WHY = ("DeepSpeed's Ulysses attention and the packed-row sdpa under sequence parallelism: "
                "UlyssesSPAttentionHF.register_with_transformers writes the attention table itself")
_KV_WHY = ("DeepSpeed 0.19.8's Ulysses forward overwrites num_key_value_groups when it replicates key/value heads, "
           "which repeat_kv reads in whole-sequence work (upstream: deepspeedai/DeepSpeed#8316 carries the count per "
           "attention instead)")
_MASK_WHY = ("transformers builds each rank's mask for its own slice before any attention runs, a [rows, 1, seq / sp, "
             "seq / sp] tensor whenever the slice's position_ids restart (packed rows), which DeepSpeed's Ulysses "
             "discards: the sdpa entry of the mask table returns none while sequence parallelism trains; no upstream "
             "issue")
_MLP_WHY = ("tiled MLPs (DeepSpeed's TiledMLP, ALST), set on the module instance (the class is untouched); "
            "no upstream issue: transformers offers no per-module forward hook that replaces the computation")
_ZERO3_WHY = ("DeepSpeed's ZeRO-3 reduce-scatter divides gradients by the world size, not the data-parallel size, "
              "under sequence parallelism (upstream: deepspeedai/DeepSpeed#6841; #5555 fixed ZeRO-0 alone)")


def start_sequence_parallel(model, cfg: RunConfig, lay: Layout, micro_batch: int | None = None):
    """Register DeepSpeed's Ulysses attention for ``model``'s attention implementation and create the SP groups.

    All ranks call it, after the model is built and before ``deepspeed.initialize`` (which takes the returned
    ``mpu``). The core ``sdpa`` is first wrapped with :func:`packed_sdpa` so that packed rows keep their examples
    apart. The attention table entry and every attention module's ``num_key_value_groups`` (which the Ulysses
    forward overwrites when it replicates key/value heads) are recorded as patches (:mod:`finetune.patches`).

    Args:
        model: the built transformers model (its ``config`` names the heads and the attention implementation).
        cfg: the run config (``model.attn_implementation``, ``train.micro_batch_size``).
        lay: the layout (``sp`` > 1).
        micro_batch: rows of the batches the model gets (default ``train.micro_batch_size``; 1 when the data
            pipeline flattens each micro-batch into one row, :func:`finetune.data.batch.flattens`).

    Returns:
        DeepSpeed's ``parallel_state_sp`` module (the ``mpu``), or None when ``lay.sp`` is 1.
    """
    if lay.sp == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = cfg.model.attn_implementation
    micro_batch = cfg.train.micro_batch_size if micro_batch is None else micro_batch
    for m in model.modules():
        if isinstance(getattr(m, "num_key_value_groups", None), int):
            patches.apply(patches.watch_attribute(m, "num_key_value_groups", _KV_WHY))
    table = patches.apply(patches.attention_function(attn, ALL_ATTENTION_FUNCTIONS[attn], _ULYSSES_WHY))
    if attn == "sdpa":
        ALL_ATTENTION_FUNCTIONS[attn] = packed_sdpa(table.original)
        patches.apply(patches.mask_function(attn, no_local_mask, _MASK_WHY))
    config = copy.deepcopy(unwrap_config(model))
    text = config.get_text_config()
    if getattr(text, "num_key_value_heads", None) is None:  # GPT-2 and other MHA configs name no KV heads
        text.num_key_value_heads = text.num_attention_heads
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=SimpleNamespace(config=config), core_attn_implementation=attn, sequence_parallel_size=lay.sp,
        micro_batch_size=micro_batch, seq_length_is_variable=True)
    ALL_ATTENTION_FUNCTIONS[attn] = _heads_out(ALL_ATTENTION_FUNCTIONS[attn])
    # DeepSpeed's groups module aliases the model-parallel queries to the SP group, and its checkpoints then record
    # a tensor-parallel degree of sp, which ds_to_universal cannot convert ("model-state file count 1 does not match
    # tp_degree=2"): the same groups, with a tensor-parallel size of 1 said explicitly
    groups = SimpleNamespace(**{k: v for k, v in vars(mpu).items() if callable(v) and not k.startswith("_")})
    groups.get_tensor_model_parallel_world_size = lambda: 1
    groups.get_tensor_model_parallel_rank = lambda: 0
    return groups


ZERO3_SP_AVERAGE_CHECKED = ("0.19.8",)
"""DeepSpeed versions whose ZeRO-3 reduce-scatter divides by the world size under SP, as
:func:`fix_zero3_average` corrects (read in ``deepspeed/runtime/zero/stage3.py`` and tested against one device)."""
_ZERO3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def check_zero3_average(stage: int, sp: int, version: str | None = None) -> str | None:
    """The problem line when ZeRO-3 under sequence parallelism runs on a DeepSpeed whose gradient average
    :func:`fix_zero3_average` has not been checked against (None when it has, or when it does not apply).

    A newer DeepSpeed may divide correctly (the correction would then make gradients ``sp`` times too large) or
    rename the method (nothing would be corrected: ``sp`` times too small); neither may pass silently.
    """
    if stage != 3 or sp == 1:
        return None
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if version in ZERO3_SP_AVERAGE_CHECKED:
        return None
    return (f"parallel.sequence_parallel_size: ZeRO-3 under sequence parallelism needs finetune's correction of "
            f"DeepSpeed's reduce-scatter average, checked for DeepSpeed {', '.join(ZERO3_SP_AVERAGE_CHECKED)} only "
            f"(this is {version}); install deepspeed=={ZERO3_SP_AVERAGE_CHECKED[-1]}, or use ZeRO 1/2 with sequence "
            f"parallelism")


def fix_zero3_average(engine, lay: Layout) -> bool:
    """Make ZeRO-3's reduce-scatter of gradients average over the data-parallel ranks under sequence parallelism.

    DeepSpeed 0.19.8's ZeRO-3 reduces gradients over all ranks (data x sequence parallel) in two ways: a contiguous
    bucket is divided by ``world / sp`` (the data-parallel size, as ZeRO 0-2 do), but the reduce-scatter path
    (``reduce_scatter: true``, ZeRO-3's default, and any bucket larger than ``reduce_bucket_size``) goes through
    ``reduce_scatter_coalesced``, which divides by ``world``: gradients ``sp`` times too small, and so the gradient
    norm and clipping (found by ``tests/test_sequence_parallel.py``: the grad norm was exactly half the
    single-device one at SP=2; ``finetune selftest``'s sequence_parallel row checks it on the node). The optimizer's
    ``__avg_scatter_grads`` is wrapped on this optimizer instance (the class is untouched; a process-scope
    patch of :mod:`finetune.patches`) to multiply its partitions by ``sp``. Only on the DeepSpeed versions of :data:`ZERO3_SP_AVERAGE_CHECKED`
    (:func:`check_zero3_average` refuses others before any model is built).

    Returns:
        True when the engine is a ZeRO-3 engine under SP and was patched.

    Raises:
        RunFailure: a ZeRO-3 engine under SP on an unchecked DeepSpeed version, or whose optimizer lacks the method
            (renamed or restructured upstream): training on would give gradients ``sp`` times too small.
    """
    if lay.sp == 1 or engine.zero_optimization_stage() != 3:
        return False
    import deepspeed

    patches.require_version("deepspeed", deepspeed.__version__, ZERO3_SP_AVERAGE_CHECKED,
                            "finetune's correction of ZeRO-3's reduce-scatter average under sequence parallelism")

    def average_over_data_parallel(reduce_scatter):
        def average(params, communication_data_type):
            return [g.mul(lay.sp) for g in reduce_scatter(params, communication_data_type)]

        return average

    patches.apply(patches.instance_method(engine.optimizer, _ZERO3_SCATTER, average_over_data_parallel, _ZERO3_WHY))
    return True


def tile_mlps(model) -> int:
    """Replace the forward of every MLP (modules named ``mlp``) by DeepSpeed's ``TiledMLP``: the sequence is cut into
    ``ceil(seq / hidden)`` tiles, each tile's MLP runs without keeping activations, and backward recomputes it tile by
    tile (Bekman et al. 2025, ALST). Under ZeRO-3 the tile count is all-reduced (the maximum) so that every rank
    gathers the same parameters as often; at ZeRO 0-2 nothing is exchanged, so ranks that run different numbers of
    forwards (text generation) never wait for each other. :func:`sequence_parallel_off` puts the plain forwards back
    for whole-sequence work.

    Args:
        model: the built transformers model (peft-wrapped or not).

    Returns:
        How many modules were tiled.

    Raises:
        ConfigError: the model has no module named ``mlp``.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    mlps = [m for name, m in model.named_modules() if name.split(".")[-1] == "mlp"]
    if not mlps:
        raise ConfigError(f"parallel.tiled_mlp: {type(model).__name__} has no module named 'mlp' to tile (Llama, "
                          f"Qwen, Mistral and GPT-2 layers have one); set parallel.tiled_mlp=false")
    for mlp in mlps:
        original = type(mlp).forward

        def forward(x, _mlp=mlp, _original=original):
            shards = torch.tensor(max(1, math.ceil(x.shape[-2] / x.shape[-1])), device=x.device)
            if dist_utils.world_size() > 1 and is_deepspeed_zero3_enabled():
                torch.distributed.all_reduce(shards, op=torch.distributed.ReduceOp.MAX)
            return TiledMLP.apply(_contiguous(_original), _mlp, x, int(shards), list(_mlp.parameters()))

        patches.apply(patches.instance_forward(mlp, forward, _MLP_WHY))
    return len(mlps)


def _contiguous(forward):
    """``forward(module, x)`` on a contiguous ``x``: ``TiledMLP`` hands the MLP slices of the sequence (strided views
    when the batch holds several rows), which GPT-2's ``Conv1D`` cannot ``view``."""

    def tile_forward(module, x):
        return forward(module, x.contiguous())

    return tile_forward


def _heads_out(ulysses):
    """The Ulysses attention returning ``[batch, seq, heads, head_dim]``, as transformers' attention functions do.

    DeepSpeed's returns ``[batch, seq, heads x head_dim]``: models that reshape with ``reshape(*input_shape, -1)``
    (Llama, Qwen) accept both, GPT-2 (``reshape(*shape[:-2], -1)``) only the former.
    """

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = ulysses(module, query, key, value, attention_mask, *args, **kwargs)
        return out.view(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), weights

    return attention


def unwrap_config(model):
    """The transformers config of ``model`` (a transformers model, or a peft wrapper around one)."""
    return model.config if hasattr(model, "config") else model.get_base_model().config


def sequence_parallel_off():
    """Within the block, the model is transformers' own again, whole sequences on every rank (the export check,
    text generation): every model-scope patch (:func:`finetune.patches.suspended`) is undone, i.e. the attention
    functions Ulysses replaced, the MLP forwards :func:`tile_mlps` replaced, and each attention module's
    ``num_key_value_groups``, which DeepSpeed's Ulysses forward overwrites when the SP size exceeds the key/value
    heads (it replicates them: ``kv_replication_factor``), and which ``repeat_kv`` reads under eager attention or
    ``sdpa`` with a mask. All are put back as they were on leaving. No-op when nothing was changed.
    """
    return patches.suspended("model")


def no_local_mask(*args, **kwargs) -> None:
    """The ``sdpa`` entry of transformers' mask table (``ALL_MASK_ATTENTION_FUNCTIONS``) while sequence parallelism
    trains: no mask.

    transformers builds each rank's mask from its own slice before any attention runs; for a slice whose
    ``position_ids`` restart (packed rows) that is a ``[rows, 1, seq / sp, seq / sp]`` boolean tensor in every
    forward and every recomputation, quadratic in the length, and DeepSpeed's Ulysses discards it: it attends over
    the gathered sequence and keeps examples apart by the gathered ``position_ids`` (:func:`packed_sdpa`). The model
    then passes ``attention_mask=None``. :func:`sequence_parallel_off` puts transformers' own mask function back.
    Takes the mask function's arguments (``batch_size``, ``q_length``, ..., ``mask_function``) and returns None.
    """
    return None


def segments(pos: torch.Tensor) -> list[list[tuple[int, int]]]:
    """The examples of each row of packed ``position_ids`` ``[rows, seq]``: ``[(start, end), ...]`` per row, a new
    example wherever the position does not grow (it restarts)."""
    starts = F.pad((pos[:, 1:] <= pos[:, :-1]), (1, 0), value=True)
    out = []
    for row in starts.tolist():
        first = [i for i, s in enumerate(row) if s]
        out.append(list(zip(first, first[1:] + [len(row)])))
    return out


def packed_sdpa(sdpa):
    """``sdpa`` that keeps packed examples apart when it gets no mask but ``position_ids`` that restart, without
    any ``[seq, seq]`` tensor.

    Ulysses discards the mask transformers made for the local shard and passes the gathered ``position_ids``
    ``[batch, seq]`` instead; a row whose positions restart holds several examples (``sft`` packing), and each
    token may attend only to earlier tokens of its own example (the block-diagonal causal mask of
    ``transformers.masking_utils``). Each example is attended on its own (``sdpa`` with no mask, causal: PyTorch's
    flash or memory-efficient kernel, memory linear in its length) and the outputs are joined; a dense mask of the
    gathered sequence would cost ``seq x seq`` per row in every layer and in every recomputation, and would keep
    sdpa off its flash kernel (``scripts/bench_packed_attention.py`` measures both). Rows without a restart go to
    ``sdpa`` as they are.

    Args:
        sdpa: transformers' attention function ``(module, query, key, value, attention_mask, *args, **kwargs) ->
            (output, weights)``, query/key/value ``[batch, heads, seq, head_dim]``, output ``[batch, seq, heads,
            head_dim]`` (``transformers.integrations.sdpa_attention.sdpa_attention_forward``).

    Returns:
        An attention function of the same signature; with ``position_ids`` ``[batch, seq]`` (int64) that restart and
        no mask, it returns the joined per-example outputs and ``None`` weights.
    """

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        pos = kwargs.get("position_ids")
        if attention_mask is not None or pos is None or pos.shape[-1] != query.shape[-2] or pos.shape[-1] < 2 \
                or not bool((pos[:, 1:] <= pos[:, :-1]).any()):
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k != "position_ids"}
        rows = segments(pos)
        if len(rows) != query.shape[0]:  # one row of positions for every row of the batch
            rows = rows[:1] * query.shape[0]
        out = []
        for b, row in enumerate(rows):
            parts = [sdpa(module, query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e], None, *args,
                          **rest)[0] for s, e in row]
            out.append(torch.cat(parts, dim=1))  # [1, seq, heads, head_dim] (transformers' attention output)
        return torch.cat(out, dim=0), None

    return attention


def sequence_group():
    """This rank's sequence-parallel process group (DeepSpeed's ``parallel_state_sp``, created by
    :func:`start_sequence_parallel`), or None when sequence parallelism is off."""
    import sys

    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if state is None or not torch.distributed.is_initialized():
        return None
    try:
        return state.get_sequence_parallel_group()
    except AssertionError:  # DeepSpeed asserts when the groups were never created
        return None


def sum_over_sequence(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks of this rank's SP group, differentiably (``torch.distributed.nn.functional.
    all_reduce``: the backward sums the gradients over the group too); ``t`` itself without SP.

    For sums over a whole sequence that each rank holds a slice of (a DPO sequence's log-probability ``[rows]``):
    every SP rank then holds the whole sums. A loss ``f`` of them that each rank adds with weight ``1 / sp``
    (:func:`sequence_weight`) has, once DeepSpeed sums the gradients over the ranks, the gradient of ``f`` counted
    once: each rank's slice receives ``sum over the group of f' / sp = f'``.
    """
    group = sequence_group()
    if group is None:
        return t
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t, group=group)


def sequence_rank() -> int:
    """This rank's place in its SP group (0 without sequence parallelism)."""
    group = sequence_group()
    return 0 if group is None else torch.distributed.get_rank(group)


def sequence_weight() -> float:
    """``1 / sp`` under sequence parallelism (1.0 without): the weight of a quantity every SP rank computes whole
    (after :func:`sum_over_sequence`) in sums over all ranks, so that it counts once."""
    group = sequence_group()
    return 1.0 if group is None else 1.0 / torch.distributed.get_world_size(group)


class SequenceShard:
    """Collator wrapper: the full micro-batch of the SP group's rows -> this rank's slice of every sequence.

    Input (the recipe's collated batch, :mod:`finetune.data.batch`): ``input_ids`` and ``labels`` ``[B, S]``, and
    ``attention_mask`` ``[B, S]`` (right padding) or packed rows' ``position_ids`` ``[B, S]`` and ``num_tokens``.
    Output: ``input_ids``, ``position_ids`` and ``shift_labels`` ``[B, S' / sp]`` (int64, ``S'`` = ``S`` rounded up
    to a multiple of ``sp``) and ``num_tokens`` (0-dim int64: real tokens in this slice; for packed rows an equal
    share of the micro-batch's count, so that the sum over the SP group is exact), ``row_targets`` ``[B]`` (int64:
    each whole row's target count, the same on every slice: for losses of whole sequences); no ``labels`` and no
    ``attention_mask`` (see the module docstring). Keeps ``row_seeded`` and ``set_epoch`` of the wrapped collator.
    A batch whose ``labels`` are one per row (``[B]``: ``grpo``'s prompt batches, from which the recipe generates the
    sequences it trains on and cuts them itself, :func:`finetune.recipes.grpo.loss.completion_logps`) passes whole.

    Raises:
        ValueError: (when called) a row is padded on the left (a real token after a pad), which causal attention
            without a mask cannot ignore.
    """

    def __init__(self, collator, lay: Layout, pad_id: int = 0):
        self.collator, self.lay, self.pad_id = collator, lay, pad_id
        self.row_seeded = getattr(collator, "row_seeded", False)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped collator (MLM-style per-row seeds)."""
        getattr(self.collator, "set_epoch", lambda e: None)(epoch)

    def __call__(self, rows):
        batch = self.collator(rows)
        if batch["labels"].dim() == 1:  # a prompt batch (grpo): the recipe cuts the sequences it builds from it
            return batch
        return shard_batch(batch, self.lay.sp, self.lay.sp_rank, self.pad_id)


def shard_batch(batch: dict, sp: int, sp_rank: int, pad_id: int = 0) -> dict:
    """Slice ``sp_rank`` of ``sp`` of a collated causal-LM batch (:class:`SequenceShard` describes both sides)."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    mask = batch.get("attention_mask")
    if mask is not None:
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("sequence parallelism needs right-padded rows (real tokens first); this batch is padded "
                             "on the left: set the tokenizer's padding_side to 'right'")
        real = mask.bool()
    else:
        real = torch.ones_like(ids, dtype=torch.bool)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, dtype=torch.long).expand(rows, seq)
    # next-token targets, shifted before the cut (a flattened batch, finetune.data.batch.flatten, comes shifted)
    shift = batch["shift_labels"] if "shift_labels" in batch else F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    pad = -seq % sp
    if pad:
        ids = F.pad(ids, (0, pad), value=pad_id)
        shift = F.pad(shift, (0, pad), value=-100)
        real = F.pad(real, (0, pad), value=False)
        # the padding continues the last example's positions (no restart: rows stay one example for attention,
        # with no mask; pad positions come after every real token and take no loss; the pre-flight check keeps
        # data.max_seq_len rounded up to a multiple of sp within the model's positions)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, dtype=pos.dtype).expand(rows, pad)], dim=1)
    chunk = (seq + pad) // sp
    part = slice(chunk * sp_rank, chunk * (sp_rank + 1))
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "shift_labels", "attention_mask",
                                                        "position_ids", "num_tokens")}
    if "num_tokens" in batch and mask is None:  # packed rows: the whole micro-batch's count, split (sums exactly)
        out["num_tokens"] = _share(batch["num_tokens"], sp, sp_rank)
    else:
        out["num_tokens"] = real[:, part].sum()
    out.update(input_ids=ids[:, part].contiguous(), position_ids=pos[:, part].contiguous(),
               shift_labels=shift[:, part].contiguous(), row_targets=(shift != -100).sum(dim=1))
    return out


def _share(total: torch.Tensor, sp: int, sp_rank: int) -> torch.Tensor:
    """``sp_rank``'s part of ``total`` split into ``sp`` near-equal integer parts (they sum to ``total``)."""
    t = int(total)
    return torch.tensor(t // sp + (1 if sp_rank < t % sp else 0))

