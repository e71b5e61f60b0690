"""Step 4 and the loss of a GRPO step: per-token log-probabilities of the completions (the head on the completion
positions only, in chunks; each prompt once for its completions where the model allows it), the clipped surrogate,
its sum by ``loss_type`` and the metrics (:func:`forward`), and evaluation's greedy completions scored."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from finetune import patches
from finetune.config import GrpoConfig, RunConfig
from finetune.data.batch import LossOutput
from finetune.engine.rollout import own_positions
from finetune.logs import logger
from finetune.parallel import distributed as dist_utils
from finetune.parallel import sequence
from finetune.recipes.common.masks import block_mask, sharing_problem
from finetune.recipes.grpo.agent import agent_of
from finetune.recipes.grpo.prompts import tokenizer_of
from finetune.recipes.grpo.rollout import greedy_completions
from finetune.recipes.grpo.scoring import reward_functions, score_completions
from finetune.recipes.lm_loss import check_head_output, chunk_tokens, find_head, head_output, logits_transform, unwrap


def count_targets(batch: dict, loss_type: str = "dapo") -> torch.Tensor:
    """What the step's loss is a mean over (the module docstring's table): a training batch's active completion
    tokens (``dapo``) or completions (the others); a prompt batch's (evaluation) real rows. Under sequence
    parallelism the ranks of an SP group hold the same rows: the group's first rank counts them, the others 0 (as
    ``dpo`` counts its pairs), so the count summed over all ranks is the global batch's."""
    labels = batch["labels"]
    if labels.dim() == 1:
        n = (labels != -100).sum()
    elif loss_type == "dapo":
        n = batch["completion_mask"].sum().long()
    else:
        n = torch.tensor(labels.shape[0], dtype=torch.long)
    return n if sequence.sequence_rank() == 0 else n * 0


_HEAD_WHY = ("grpo: the LM head runs on the completion positions only and returns their per-token log-probabilities "
             "at the sampling temperature; restored after the forward")


def _chunk_logps(head_fn, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = head_fn(hidden).float() / temperature
    logp = torch.log_softmax(logits, -1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def prompt_shared_rows(batch: dict, pad_token_id: int) -> dict:
    """A training micro-batch's ``B x G`` sequences as ``B`` rows, each prompt once followed by its ``G`` completions
    (prefix sharing: Wang et al. 2024, arXiv:2410.20305, as :func:`finetune.recipes.reward.shared_rows` does for
    preference pairs).

    Row ``i`` holds prompt ``i``'s real tokens (``P_i``, positions ``0..P_i - 1``), then each of its completions up to
    and including its EOS (``lengths``), each at the positions it has in its own sequence (``P_i, P_i + 1, ...``) and
    attending to the prompt and to its own earlier tokens only. Under causal attention every hidden state equals the
    one of the separate sequence (up to the order of float sums), so the log-probabilities and their gradients do
    too, and each prompt runs once instead of ``G`` times.

    Args:
        batch: :func:`before_step`'s micro-batch (``input_ids`` / ``attention_mask`` ``[B G, P + C]``, a prompt's
            ``G`` completions consecutive; ``prompt_length``; ``lengths``; ``group_size``).
        pad_token_id: filler of the rows' right padding.

    Returns:
        ``input_ids`` and ``position_ids`` ``[B, W]`` int64 (W: the longest row), ``allowed`` ``[B, 1, W, W]`` bool
        (query ``q`` may attend key ``k``), ``source`` ``[B G, C]`` int64: the index into the flattened ``[B W]``
        rows of the hidden state that predicts each completion token (its prompt's last token for the first; -1
        past the completion's length).
    """
    ids, mask, p = batch["input_ids"], batch["attention_mask"], int(batch["prompt_length"])
    g, lengths = int(batch["group_size"]), batch["lengths"].tolist()
    b, c = ids.shape[0] // g, ids.shape[1] - p
    rows, positions, segments, source = [], [], [], torch.full((ids.shape[0], c), -1, dtype=torch.long)
    for i in range(b):
        prompt = ids[i * g, :p][mask[i * g, :p].bool()]
        n_p = len(prompt)
        parts, pos, seg, at = [prompt], [torch.arange(n_p)], [torch.zeros(n_p, dtype=torch.long)], n_p
        for j in range(g):
            r, n = i * g + j, int(lengths[i * g + j])
            parts.append(ids[r, p:p + n].cpu())
            pos.append(n_p + torch.arange(n))
            seg.append(torch.full((n,), j + 1, dtype=torch.long))
            source[r, :n] = torch.cat([torch.tensor([n_p - 1]), at + torch.arange(n - 1)])
            at += n
        rows.append(torch.cat([x.cpu() for x in parts]))
        positions.append(torch.cat(pos))
        segments.append(torch.cat(seg))
    w = max(len(x) for x in rows)
    out_ids = torch.full((b, w), pad_token_id, dtype=torch.long)
    out_pos = torch.zeros((b, w), dtype=torch.long)
    out_seg = torch.full((b, w), -1, dtype=torch.long)  # padding: a segment of its own
    for i, (x, q, sg) in enumerate(zip(rows, positions, segments)):
        out_ids[i, :len(x)], out_pos[i, :len(x)], out_seg[i, :len(x)] = x, q, sg
        source[i * g:(i + 1) * g] = torch.where(source[i * g:(i + 1) * g] >= 0, source[i * g:(i + 1) * g] + i * w, -1)
    j = torch.arange(w)
    causal = j[None, :, None] >= j[None, None, :]
    key_seg, query_seg = out_seg[:, None, :], out_seg[:, :, None]
    allowed = causal & ((key_seg == 0) | (key_seg == query_seg))
    device = ids.device
    return {"input_ids": out_ids.to(device), "position_ids": out_pos.to(device), "allowed": allowed[:, None].to(device),
            "source": source.to(device)}


def shares_prompts(model, batch: dict, share: bool) -> bool:
    """Whether :func:`completion_logps` runs :func:`prompt_shared_rows`: asked for (``train.grpo.share_prompt``), more
    than one completion per prompt, the same prompt for a group's completions (an environment's observations may
    make them differ: ``prompts_differ``), no images, and a model that takes a block mask per row
    (:func:`finetune.recipes.common.masks.sharing_problem`: sdpa or eager attention, full or sliding-window layers; the
    flash-attention kernels take none). When it cannot, a line says why, once per process."""
    if not share or int(batch.get("group_size", 1)) <= 1 or bool(batch.get("prompts_differ", False)) \
            or batch.get("image_keys"):
        return False  # prompts_differ: an environment's observations gave a group's rollouts different prompts;
        # images: each row's image tokens take its own image features
    if sequence.sequence_group() is not None:  # Ulysses attends causally with no mask (sequence_slice)
        problem = "sequence parallelism (parallel.sequence_parallel_size > 1) attends with no mask"
    else:
        problem = sharing_problem(unwrap(model))
    if problem is not None and problem not in _SHARING_OFF:
        _SHARING_OFF.add(problem)
        if dist_utils.is_main():
            logger.info(f"grpo: prompt sharing off (train.grpo.share_prompt): {problem}; each completion runs with "
                        f"its own copy of the prompt")
    return problem is None


_SHARING_OFF: set = set()


def sequence_slice(batch: dict, sp: int, sp_rank: int, pad_token_id: int = 0) -> dict:
    """Slice ``sp_rank`` of ``sp`` of a training micro-batch's sequences under sequence parallelism (DeepSpeed
    Ulysses, :mod:`finetune.parallel.sequence`), and which completion tokens this slice predicts.

    Ulysses attends causally with no mask, so the rows are right-padded first: each row's real prompt tokens (its
    left padding dropped), then its ``C`` completion columns, then filler up to ``W`` (the longest row, rounded up to
    a multiple of ``sp``), at positions ``0..W - 1``: every real token keeps the position it has in
    :func:`before_step`'s row, and what follows a completion's last token (its padding, the filler) comes after
    every token that predicts a target, so causal attention never lets a target see it. Rank ``sp_rank`` holds
    columns ``[sp_rank W / sp, (sp_rank + 1) W / sp)`` of every row; the hidden state of column ``j`` predicts the
    token of column ``j + 1`` (the last column of a slice predicts the first of the next slice, as
    :func:`finetune.parallel.sequence.shard_batch` shifts the labels before the cut).

    Args:
        batch: :func:`before_step`'s micro-batch (``input_ids``, ``attention_mask`` ``[N, P + C]`` int64 with the
            prompts left-padded, ``prompt_length``).
        sp: the SP group's size.
        sp_rank: this rank's place in it.
        pad_token_id: the filler's token id.

    Returns:
        ``input_ids``, ``position_ids`` ``[N, W / sp]`` int64 (this rank's slice); ``source``, ``target``, ``dest``
        ``[K]`` int64: the flattened ``[N W / sp]`` index of each hidden state of the slice that predicts a completion
        token, that token, and its index in the flattened ``[N, C]`` completion grid (``K``: those of this slice;
        the slices of an SP group hold every ``(row, column)`` of the grid once).
    """
    ids, mask, p = batch["input_ids"], batch["attention_mask"], int(batch["prompt_length"])
    n, c, device = ids.shape[0], ids.shape[1] - p, ids.device
    real = mask[:, :p].sum(1).long()  # [N] each row's prompt tokens
    w = int(real.max()) + c
    w += -w % sp
    cols = torch.arange(w, device=device)
    taken = (p - real)[:, None] + cols[None, :]  # the column of the batch's row each right-padded column holds
    right = torch.where(taken < ids.shape[1], ids.gather(1, taken.clamp(max=ids.shape[1] - 1)), pad_token_id)
    size = w // sp
    mine = cols[size * sp_rank:size * (sp_rank + 1)]
    k = mine[None, :] - real[:, None] + 1  # [N, W / sp]: the completion column each hidden state predicts
    hit = (k >= 0) & (k < c)
    dest = torch.arange(n, device=device)[:, None] * c + k
    target = ids[:, p:].gather(1, k.clamp(0, max(c - 1, 0)))
    return {"input_ids": right[:, mine].contiguous(), "position_ids": mine.expand(n, size).contiguous(),
            "source": torch.arange(n * size, device=device).view(n, size)[hit], "target": target[hit],
            "dest": dest[hit]}


def completion_logps(model, batch: dict, temperature: float, share: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of the completion tokens (and their entropies) at ``temperature``.

    The output head (:func:`finetune.recipes.lm_loss.find_head`) runs only on the hidden states that predict
    completion tokens, in chunks of :func:`~finetune.recipes.lm_loss.chunk_tokens` positions (checkpointed when
    there are several and gradients are on); its forward is replaced on the instance for this call only. The logits
    are the ones the model samples from: what it does after its head (Gemma-2's soft-capping, Cohere's and Granite's
    scales: :func:`~finetune.recipes.lm_loss.logits_transform`) is applied to each chunk, and a model that does
    anything else is refused (:func:`~finetune.recipes.lm_loss.check_head_output`). With ``share``
    (:func:`shares_prompts`) the sequences run as :func:`prompt_shared_rows`, each prompt once.

    Args:
        model: the engine, or a (peft-wrapped) causal LM.
        batch: a training micro-batch of :func:`before_step` on the model's device.
        temperature: the logits are divided by it (``train.grpo.temperature``).
        share: run each prompt once for its completions (``train.grpo.share_prompt``) where the model allows it.

    Under sequence parallelism every rank of an SP group holds the whole micro-batch and runs the model on its slice
    of every sequence (:func:`sequence_slice`); the head runs on the slice's hidden states that predict completion
    tokens, and the slices' values are added over the group (:func:`finetune.parallel.sequence.sum_over_sequence`,
    differentiably), so every rank returns the whole ``[B G, C]`` values, as ``dpo`` does with its sequences' sums.

    Returns:
        ``(logps, entropy)``, each ``[B G, C]`` float32 (0 past a completion's length when shared); ``logps``
        differentiable when gradients are on.

    Raises:
        RuntimeError: the model changes its head's output in a way :func:`~finetune.recipes.lm_loss.logits_transform`
            does not know.
    """
    p = int(batch["prompt_length"])
    targets = batch["input_ids"][:, p:]
    head = find_head(model)
    original = head.forward
    state = {}
    transform = logits_transform(model)
    post = transform[1] if transform is not None else (lambda z: z)
    shared = prompt_shared_rows(batch, 0) if shares_prompts(model, batch, share) else None
    group = sequence.sequence_group()
    sliced = None if group is None else sequence_slice(batch, torch.distributed.get_world_size(group),
                                                       torch.distributed.get_rank(group))

    def forward(hidden, *args, **kwargs):
        if sliced is not None:  # this slice's hidden states that predict a completion token
            rows, flat_t = hidden.reshape(-1, hidden.shape[-1])[sliced["source"]], sliced["target"]
        elif shared is None:
            h = hidden[:, p - 1:-1]
            rows, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        else:  # the positions that predict a completion token, in [B G, C] order
            keep = shared["source"].reshape(-1) >= 0
            rows = hidden.reshape(-1, hidden.shape[-1])[shared["source"].reshape(-1)[keep]]
            flat_t = targets.reshape(-1)[keep]
        fn = lambda x: post(original(x, *args, **kwargs))  # noqa: E731
        size = chunk_tokens(getattr(unwrap(model).config, "vocab_size", 32768))
        parts = []
        for s in range(0, rows.shape[0], size):
            args_ = (rows[s:s + size], flat_t[s:s + size])
            if torch.is_grad_enabled() and rows.shape[0] > size:
                parts.append(checkpoint(lambda a, b: _chunk_logps(fn, a, b, temperature), *args_, use_reentrant=False))
            else:
                parts.append(_chunk_logps(fn, *args_, temperature))
        if sliced is not None:
            return _on_grid(fn, hidden, parts, sliced["dest"], targets, state)
        logps, entropy = torch.cat([x[0] for x in parts]), torch.cat([x[1] for x in parts])
        if shared is not None:
            logps = torch.zeros(keep.shape, dtype=logps.dtype, device=logps.device).masked_scatter(keep, logps)
            entropy = torch.zeros(keep.shape, dtype=entropy.dtype, device=entropy.device).masked_scatter(keep, entropy)
        state["entropy"] = entropy.view_as(targets)
        return logps.view_as(targets)

    with patches.applied(patches.instance_forward(head, forward, _HEAD_WHY)), head_output(head) as seen:
        if sliced is not None:  # Ulysses: no mask, the positions gathered over the group (right padding)
            out = model(input_ids=sliced["input_ids"], position_ids=sliced["position_ids"])
        elif shared is None:  # images: the prompts' image tensors too, positions the model's own where it has them
            pictures = {k: batch[k] for k in batch.get("image_keys", ())}
            positions = {} if pictures and own_positions(unwrap(model)) else {"position_ids": batch["position_ids"]}
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **positions,
                        **pictures)
        else:
            out = model(input_ids=shared["input_ids"], position_ids=shared["position_ids"],
                        attention_mask=block_mask(unwrap(model), shared["allowed"], shared["position_ids"]))
    logps = check_head_output(model, head, out.logits, seen, transform)
    if sliced is not None:  # each slice's tokens, 0 elsewhere: the whole grid on every rank of the group
        return sequence.sum_over_sequence(logps), sequence.sum_over_sequence(state["entropy"])
    return logps, state["entropy"]


def _on_grid(fn, hidden: torch.Tensor, parts: list, dest: torch.Tensor, targets: torch.Tensor, state: dict):
    """A slice's log-probabilities and entropies (``parts``: :func:`_chunk_logps` of its chunks) at their places
    ``dest`` of the ``[N, C]`` grid of ``targets``, 0 elsewhere (entropies into ``state``). A slice that predicts no
    completion token (all prompt) still runs the head on one hidden state, weighted 0: under ZeRO-3 every rank
    gathers the head's parameters and reduces their gradients as often as the others."""
    grid = torch.zeros(targets.numel(), dtype=torch.float32, device=hidden.device)
    if not parts:
        logp, _ = _chunk_logps(fn, hidden.reshape(-1, hidden.shape[-1])[:1], targets.reshape(-1)[:1] * 0, 1.0)
        state["entropy"] = grid.view_as(targets)
        return (grid + 0.0 * logp.sum()).view_as(targets)
    logps, entropy = torch.cat([x[0] for x in parts]), torch.cat([x[1] for x in parts])
    state["entropy"] = grid.scatter(0, dest, entropy).view_as(targets)
    return grid.scatter(0, dest, logps).view_as(targets)


def token_losses(logps, old, adv, mask, g: GrpoConfig, ref=None) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate per completion token (TRL 1.16's ``_compute_loss`` for ``grpo``, ``bnpo``,
    ``dr_grpo``, ``dapo``).

    Args:
        logps, old: ``[N, C]`` float32 log-probabilities under the policy (differentiable) and at generation.
        adv: ``[N]`` advantages.
        mask: ``[N, C]`` float32 active tokens.
        g: ``train.grpo``.
        ref: ``[N, C]`` reference log-probabilities (``beta`` > 0).

    Returns:
        ``(per_token_loss [N, C], parts)``: ``parts`` holds ``[N, C]`` clip indicators (``low``, ``high``) and the
        per-token ``kl`` (with ``ref``), detached.
    """
    log_ratio = logps - old
    if g.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef1 = torch.exp(log_ratio)
    high = g.epsilon_high or g.epsilon
    coef2 = torch.clamp(coef1, 1 - g.epsilon, 1 + high)
    a = adv[:, None]
    loss = -torch.min(coef1 * a, coef2 * a)
    parts = {"low": ((coef1 < 1 - g.epsilon) & (a < 0)).float().expand_as(mask).detach(),
             "high": ((coef1 > 1 + high) & (a > 0)).float().expand_as(mask).detach()}
    if ref is not None and g.beta > 0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        loss = loss + g.beta * kl
        parts["kl"] = kl.detach()
    return loss.expand_as(mask), parts


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, g: GrpoConfig) -> torch.Tensor:
    """A micro-batch's loss sum by ``loss_type`` (the module docstring's table), 0-dim float32."""
    masked = per_token * mask
    if g.loss_type == "dapo":
        return masked.sum()
    if g.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if g.loss_type == "dr_grpo":
        return masked.sum() / g.max_completion_length
    return masked.sum() / mask.sum().clamp(min=1.0) * mask.shape[0]  # bnpo


def _mean(values: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.float()
    if weights is None:
        ok = ~torch.isnan(values)
        return torch.nan_to_num(values).sum().double(), ok.sum().double()
    return (values * weights).sum().double(), weights.sum().double()


def forward(model, batch: dict, metrics: bool = False, settings: GrpoConfig | None = None,
            functions: list | None = None, cfg: RunConfig | None = None) -> LossOutput:
    """The GRPO loss of one training micro-batch (from :func:`before_step`), summed as ``loss_type`` says, with
    TRL's metrics; on a prompt batch (evaluation), greedy completions scored, loss 0.

    Returns:
        :class:`~finetune.data.batch.LossOutput` (``targets`` = :func:`count_targets`).
    """
    g = settings or GrpoConfig()
    if batch["labels"].dim() == 1:
        return _evaluate(model, batch, g, cfg)
    # under sequence parallelism every rank of an SP group computes the whole loss of the same rows (completion_logps
    # adds the slices' log-probabilities over the group): each adds 1 / sp of it, so it counts once (dpo's way)
    weight = sequence.sequence_weight()
    mask = batch["completion_mask"].float()
    logps, entropy = completion_logps(model, batch, g.temperature, g.share_prompt)
    old = batch.get("old_logps", logps.detach())
    per_token, parts = token_losses(logps, old, batch["advantages"].to(logps.dtype), mask, g, batch.get("ref_logps"))
    total = loss_sum(per_token, mask, g) * weight
    n = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    tokens = mask.sum().double()
    region = torch.clamp(parts["low"] + parts["high"], max=1)
    m = {"reward": _mean(batch["rewards"]),
         "reward_std": _mean(batch["group_std"]),
         "frac_reward_zero_std": ((batch["group_std"].nan_to_num(0.0) < 1e-6).double().sum(), n),
         "completions/mean_length": (batch.get("model_lengths", batch["lengths"]).double().sum(), n),
         "completions/clipped_ratio": ((~batch["terminated"]).double().sum(), n),
         "clip_ratio/low_mean": ((parts["low"] * mask).sum().double(), tokens),
         "clip_ratio/high_mean": ((parts["high"] * mask).sum().double(), tokens),
         "clip_ratio/region_mean": ((region * mask).sum().double(), tokens),
         "entropy": ((entropy * mask).sum().double(), tokens)}
    if "kl" in parts:
        m["kl"] = ((parts["kl"] * mask).sum().double(), tokens)
    if "tool_calls" in batch:  # multi-turn (TRL's names): calls per completion, failures per call, turns
        calls = batch["tool_calls"].double().sum()
        m["tools/call_frequency"] = (calls, n)
        m["tools/failure_frequency"] = (batch["tool_failures"].double().sum(), calls)
        m["tools/turns_mean"] = (batch["turns"].double().sum(), n)
        agent = agent_of(cfg) if cfg is not None else None
        if agent is not None and "tool_calls_by_name" in batch:  # each tool's calls per completion
            for name, count in zip(agent.names + ("(unknown)",), batch["tool_calls_by_name"].double().sum(0)):
                m[f"tools/{name}/call_frequency"] = (count, n)  # (unknown): a call naming no offered tool
    for j, f in enumerate(functions or []):
        m[f"rewards/{f.name}/mean"] = _mean(batch["reward_table"][:, j])
    return LossOutput(total, count_targets(batch, g.loss_type), metrics=m)


def _evaluate(model, batch: dict, g: GrpoConfig, cfg: RunConfig | None) -> LossOutput:
    """A prompt batch's greedy completions (one per prompt), scored on every rank: ``reward`` and
    ``rewards/<function>/mean`` over the real rows; loss 0."""
    if cfg is None:
        raise ValueError("grpo: evaluation needs the run config (bind it with configure)")
    tok, functions = tokenizer_of(cfg), reward_functions(cfg)
    with sequence.sequence_parallel_off():  # whole sequences: each rank generates its prompts, as without SP
        texts, ids, cols, calls = greedy_completions(model, batch, g, tok, cfg)
    _, table, r, _ = score_completions(functions, list(batch["prompts"]), texts, ids, cols)
    real = (batch["labels"] != -100).cpu()
    _write_eval_records(model, cfg, batch, texts, table, functions, real)
    m = {"reward": _mean(torch.where(real, r, torch.nan))}
    for j, f in enumerate(functions):
        m[f"rewards/{f.name}/mean"] = _mean(torch.where(real, table[:, j], torch.nan))
    if calls is not None:  # with tools: the greedy answers' tool calls per completion and the share that call one
        calls = calls.cpu().double()
        m["tools/call_frequency"] = ((calls * real).sum(), real.double().sum())
        m["tools/any_call_rate"] = (((calls > 0) & real).double().sum(), real.double().sum())
    device = batch["labels"].device
    m = {k: (a.to(device), b.to(device)) for k, (a, b) in m.items()}
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return LossOutput(zero, count_targets(batch), metrics=m)


def _write_eval_records(engine, cfg: RunConfig, batch: dict, texts: list[str], table: torch.Tensor, functions,
                        real: torch.Tensor) -> None:
    """The evaluation's greedy completions of every rank's real rows, appended by rank 0 to
    ``<run>/eval/step<N>_completions.jsonl`` (``N``: the optimizer steps done) and, the first 3 of a step, to
    TensorBoard as text ``eval/completions``."""
    mine = [{"index": i, "prompt": p, "completion": t,
             "rewards": {f.name: (None if math.isnan(v) else v) for f, v in zip(functions, row)}}
            for i, p, t, row, ok in zip(batch["row_index"], batch["prompts"], texts, table.tolist(), real.tolist()) if ok]
    if sequence.sequence_rank() != 0:  # the SP group's ranks evaluate the same rows: its first writes them
        mine = []
    everyone = dist_utils.all_gather_object(mine)
    if not dist_utils.is_main() or not cfg.output_dir:
        return
    step = int(getattr(engine, "global_steps", 0))
    folder = Path(cfg.output_dir) / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step{step}_completions.jsonl"
    fresh = not path.exists()
    records = sorted((r for part in everyone for r in part), key=lambda r: r["index"])
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps({"step": step, **r}, default=str) + "\n")
    writer = getattr(getattr(getattr(engine, "monitor", None), "tb_monitor", None), "summary_writer", None)
    if writer is not None and fresh and records:
        def cell(t) -> str:
            return str(t).replace("|", "\\|").replace("\n", "<br>")
        rows = [f"| {cell(str(r['prompt'])[-300:])} | {cell(r['completion'])} | {cell(r['rewards'])} |" for r in records[:3]]
        writer.add_text("eval/completions", "\n".join(["| prompt (end) | completion | rewards |", "|---|---|---|", *rows]),
                        step)
        writer.flush()
