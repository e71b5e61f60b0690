"""Step 2 and 3 of a GRPO step: scoring and advantages. The run's reward functions, every completion scored on
its rank and the ranks agreeing (a failure stops every rank), the weighted sums, and the group-relative
advantages."""

from __future__ import annotations

import json

import torch

from finetune.config import RunConfig
from finetune.errors import ConfigError, RunFailure
from finetune.parallel import distributed as dist_utils
from finetune.recipes.common import rewards

_LOADED: dict[str, list] = {}


def reward_functions(cfg: RunConfig) -> list[rewards.RewardFunction]:
    """The run's reward functions (:func:`finetune.recipes.common.rewards.load`), loaded once per process and settings."""
    g = cfg.train.grpo
    key = json.dumps([g.rewards, g.reward_weights, cfg.data.reward_columns, g.answer_pattern, g.format_pattern,
                      g.max_completion_length, g.length_cache, g.environment], default=str)
    if key not in _LOADED:
        functions = rewards.load(cfg) if g.rewards or not g.environment else []
        if g.environment:  # its get_reward: a reward named after its class, weight 1 (TRL's environment_factory)
            from finetune.recipes.grpo.agent import agent_of, environment_reward

            probe = agent_of(cfg).factory()
            if callable(getattr(probe, "get_reward", None)):
                functions.append(rewards.RewardFunction(g.environment, type(probe).__name__, environment_reward, 1.0))
            elif not functions:
                raise ConfigError(f"train.grpo.rewards: empty, and train.grpo.environment {type(probe).__name__} has "
                                  f"no get_reward(); name a reward function or give the environment a get_reward()")
        _LOADED[key] = functions
    return _LOADED[key]


def score_everywhere(functions, prompts, texts, ids, cols) -> list:
    """Score on this rank, then agree with every rank: each rank's table, or the first failure raised on every rank
    as :class:`~finetune.errors.RunFailure` (one line: the function, the rank, what it did), so no rank waits for
    one that failed."""
    try:
        mine, error = rewards.score(functions, prompts, texts, ids, cols), None
    except rewards.RewardError as e:
        mine, error = None, str(e)
    everyone = dist_utils.all_gather_object((error, mine))
    for rank, (err, _) in enumerate(everyone):
        if err is not None:
            raise RunFailure(f"grpo: {err} (rank {rank}); fix the reward function, then --resume from the last "
                             f"checkpoint")
    return [table for _, table in everyone]


def combine(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[N, F]`` rewards (NaN: not scored) -> ``[N]`` weighted sums, NaN where no function scored."""
    total = (table * weights).nansum(1)
    return torch.where(torch.isnan(table).all(1), torch.nan, total)


def _nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (TRL's ``nanstd``); NaN below 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1).clamp(min=1)
    var = torch.where(count > 1, var, torch.nan)
    return var.sqrt().squeeze(dim) if dim is not None else var.sqrt().reshape(())


def advantages(rewards_: torch.Tensor, g: int, scale: str, batch_std: torch.Tensor | None = None) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (TRL 1.16's ``_generate_and_score_completions``).

    Args:
        rewards_: ``[P g]`` float32, a prompt's ``g`` completions consecutive; NaN: unscored.
        g: completions per prompt.
        scale: ``group``, ``batch`` or ``none`` (``train.grpo.scale_rewards``).
        batch_std: the global batch's reward standard deviation (``batch``).

    Returns:
        ``(advantages, group_std)``, each ``[P g]`` float32; unscored completions' advantages are 0.
    """
    grouped = rewards_.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g)
    std = _nanstd(grouped, dim=1).repeat_interleave(g)
    adv = rewards_ - mean
    if scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), std


def score_completions(functions, prompts, texts, ids, cols, scale: str = "none") \
        -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every completion of this rank scored by every function (:func:`score_everywhere`).

    Returns:
        ``(tables, table, rewards, batch_std)``: every rank's table (lists), this rank's ``[N, F]`` float32 table,
        its ``[N]`` weighted sums (:func:`combine`), and with ``scale`` ``batch`` the standard deviation of every
        rank's weighted sums (else None).
    """
    tables = score_everywhere(functions, prompts, texts, ids, cols)
    weights = torch.tensor([f.weight for f in functions], dtype=torch.float32)
    own = torch.tensor(tables[dist_utils.rank()], dtype=torch.float32).reshape(len(texts), -1)  # [B G, F]
    mine = combine(own, weights)
    batch_std = _nanstd(combine(torch.tensor([r for t in tables for r in t], dtype=torch.float32), weights)) \
        if scale == "batch" else None
    return tables, own, mine, batch_std
