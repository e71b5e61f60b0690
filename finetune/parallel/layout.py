"""The layout of the ranks and every rule about the sizes of the parallel dimensions, computed here once.

**Layout** (:class:`Layout`, in the spirit of torchtitan's ``ParallelDims``): ``world = dp x sp x tp`` (sequence and
tensor parallelism are not combined); expert parallelism (``ep``, DeepSpeed AutoEP) shards the experts over runs of
``ep`` consecutive ranks without cutting the rows, so it is not a factor of ``dp``. The sequence-parallel (SP) and
tensor-parallel (TP) groups are runs of consecutive ranks, as DeepSpeed builds them (``parallel_state_sp``; AutoTP's
mesh with TP inner): ranks ``[i * sp, (i + 1) * sp)`` share the rows of data-parallel rank ``i``. The samplers, the
evaluation shards, the global batch (``micro x accumulation x dp``), the loss scaling and the logs use the data-
parallel rank and size, never the global ones.

The rules: :func:`size_problems` (each size divides the world size), :func:`data_parallel_size` (the data-parallel
size of any world and split, a checkpoint's included) and :func:`head_problems` (heads divisible by a size); the
checks of a run config that read them are in :mod:`finetune.parallel.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config import RunConfig
from finetune.errors import ConfigError
from finetune.parallel import distributed as dist_utils


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions and this rank's coordinates in them (``world = dp x sp x tp``; sp and tp are
    not combined). SP and TP groups are runs of consecutive ranks, as DeepSpeed builds them (``parallel_state_sp``;
    AutoTP's ``(data_parallel, tensor_parallel)`` mesh with TP inner)."""

    world: int
    """Ranks in the job."""
    sp: int = 1
    """Sequence-parallel size (``parallel.sequence_parallel_size``)."""
    rank: int = 0
    """Global rank."""
    tp: int = 1
    """Tensor-parallel size (``parallel.tensor_parallel_size``)."""
    pp: int = 1
    """Pipeline-parallel size (``parallel.pipeline_parallel_size``): stages, each a slice of the layers. Ranks are
    ``pp x dp`` with the data-parallel index inner (DeepSpeed's ``PipeDataParallelTopology``): stage ``s`` holds
    ranks ``[s x dp, (s + 1) x dp)``, and the ranks of one pipeline (one per stage) read the same rows."""
    ep: int = 1
    """Expert-parallel size (``parallel.expert_parallel_size``): ranks that share the experts of each MoE layer
    (DeepSpeed AutoEP). It does not cut the rows: every rank of an expert-parallel group reads its own, so ``dp`` is
    unchanged; the ranks holding the same experts (``world / ep``, every ``ep``-th rank) average their gradients."""

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world / (sp x tp x pp)`` (ranks that see different rows; :func:`data_parallel_size`)."""
        return data_parallel_size(self.world, self.sp, self.tp, self.pp)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: the index of its SP or TP group (``rank // (sp x tp)``); under pipeline
        parallelism its place within its stage (``rank % dp``)."""
        if self.pp > 1:
            return self.rank % self.dp
        return self.rank // (self.sp * self.tp)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (``rank // dp``)."""
        return self.rank // self.dp if self.pp > 1 else 0

    @property
    def sp_rank(self) -> int:
        """This rank's place in its SP group (``rank % sp``): which slice of each sequence it holds."""
        return self.rank % self.sp

    @property
    def tp_rank(self) -> int:
        """This rank's place in its TP group (``rank % tp``): which slice of each split weight it holds."""
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (``rank % ep``, consecutive ranks as DeepSpeed's
        ``_create_expert_and_data_parallel`` builds them): it holds experts ``[ep_rank x E / ep, (ep_rank + 1) x E /
        ep)`` of each MoE layer of ``E`` experts."""
        return self.rank % self.ep

    @property
    def replicas(self) -> int:
        """Ranks that hold the same rows and so compute the same sums (target counts, losses, tokens): ``tp x pp``
        (every stage of a pipeline reads the same rows). Sums all-reduced over every rank are divided by it; SP ranks
        hold disjoint slices and count once each."""
        return self.tp * self.pp

    def describe(self) -> str:
        """``layout: world 4 = data-parallel 2 x sequence-parallel 2 x tensor-parallel 1; this rank ...`` (logs)."""
        if self.pp > 1:
            return (f"layout: world {self.world} = pipeline stages {self.pp} x data-parallel {self.dp}; this rank "
                    f"(global {self.rank}): stage {self.pp_rank}, data-parallel rank {self.dp_rank}")
        return (f"layout: world {self.world} = data-parallel {self.dp} x sequence-parallel {self.sp} x tensor-parallel "
                f"{self.tp}{f' (experts over {self.ep}-rank groups)' if self.ep > 1 else ''}; this rank (global "
                f"{self.rank}): data-parallel rank {self.dp_rank}, sequence-parallel rank {self.sp_rank}, "
                f"tensor-parallel rank {self.tp_rank}{f', expert-parallel rank {self.ep_rank}' if self.ep > 1 else ''}")


SIZE_KEYS = {"sp": "parallel.sequence_parallel_size", "tp": "parallel.tensor_parallel_size",
             "ep": "parallel.expert_parallel_size", "pp": "parallel.pipeline_parallel_size"}
"""The run-config key of each parallel size but data parallelism (which is what is left of the world size)."""


def size_problems(world: int, sp: int, tp: int, ep: int = 1, pp: int = 1) -> list[str]:
    """One line per parallel size above 1 that does not divide ``world`` (sizes below 1 are
    :func:`finetune.parallel.checks.check`'s). ``ep``: DeepSpeed's AutoEP builds expert-parallel groups of ``ep``
    consecutive ranks (``build_folding_spec``: the stage size must be a multiple of ``ep``)."""
    out = []
    for size, key in ((sp, SIZE_KEYS["sp"]), (tp, SIZE_KEYS["tp"]), (ep, SIZE_KEYS["ep"]), (pp, SIZE_KEYS["pp"])):
        if size > 1 and world % size:
            out.append(f"{key}: {size} does not divide the world size {world}; launch a multiple of {size} ranks or "
                       f"choose a divisor of {world}")
    if not out and sp > 1 and tp > 1 and world % (sp * tp):
        out.append(f"parallel: sequence-parallel size {sp} x tensor-parallel size {tp} does not divide the world size "
                   f"{world}")
    return out


def data_parallel_size(world: int, sp: int = 1, tp: int = 1, pp: int = 1) -> int:
    """Ranks that see different rows: ``world / (sp x tp x pp)``; ``world`` itself when the split does not divide it
    (the caller reports that through :func:`size_problems`), and at least 1."""
    split = sp * tp * pp if min(sp, tp, pp) > 0 and world % (sp * tp * pp) == 0 else 1
    return max(1, world // split)


def head_problems(model_config, size: int, key: str, what: str, kv_multiple: bool = False) -> list[str]:
    """One line per head count of ``model_config`` (a transformers config, or None) not divisible by ``size``.

    Args:
        model_config: the transformers config (its text config's ``num_attention_heads``, ``num_key_value_heads``).
        size: the parallel size the heads are split over.
        key: the run-config key named in the lines.
        what: how each rank holds them (``"attends with heads / 2"``), for the lines.
        kv_multiple: a size that is a multiple of the key/value heads is accepted too (DeepSpeed's Ulysses
            replicates key/value heads: ``kv_replication_factor``).
    """
    if model_config is None or size <= 1:
        return []
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    out = []
    if isinstance(heads, int) and heads % size:
        out.append(f"{key}: the model's {heads} attention heads are not divisible by {size} ({what}); choose a "
                   f"divisor of {heads}")
    if isinstance(kv, int) and kv % size and not (kv_multiple and size % kv == 0):
        if kv_multiple:
            out.append(f"{key}: the model's {kv} key/value heads and {size} divide neither way (DeepSpeed replicates "
                       f"key/value heads only when {size} is a multiple of them); choose a divisor or a multiple of "
                       f"{kv}")
        else:
            out.append(f"{key}: the model's {kv} key/value heads are not divisible by {size} ({what}); choose a "
                       f"divisor of {kv}")
    return out


def layout(cfg: RunConfig, world: int | None = None, rank: int | None = None) -> Layout:
    """The layout of ``cfg`` for this process (world size and rank from the launcher, or as given).

    Raises:
        ConfigError: a parallel size is below 1 or does not divide the world size.
    """
    world = dist_utils.world_size() if world is None else world
    rank = dist_utils.rank() if rank is None else rank
    sp, tp, ep, pp = (cfg.parallel.sequence_parallel_size, cfg.parallel.tensor_parallel_size,
                      cfg.parallel.expert_parallel_size, cfg.parallel.pipeline_parallel_size)
    problems = size_problems(world, sp, tp, ep, pp) + [f"{SIZE_KEYS[k]}: {v} must be 1 (off) or more"
                                                       for k, v in (("sp", sp), ("tp", tp), ("ep", ep), ("pp", pp))
                                                       if v < 1]
    if problems:
        raise ConfigError(problems[0])
    return Layout(world=world, sp=sp, rank=rank, tp=tp, ep=ep, pp=pp)
