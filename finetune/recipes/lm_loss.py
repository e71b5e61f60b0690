"""Token cross-entropy of a language model computed only where the loss uses it (``bert_mlm``, ``gpt_clm``).

A masked LM takes its loss at the ~15% masked positions, a causal LM at every position whose next
token is a target; running the output head and a full ``[tokens, vocab]`` softmax everywhere else is
wasted work (for a BERT with the full vocabulary the MLM head plus cross-entropy is most of a CPU step). Here:

* **The head runs at target positions only.** :func:`find_head` finds the module that turns the final
  hidden states into logits: the child of the model (the innermost ``transformers.PreTrainedModel`` on
  the way, so a ``peft`` wrapper is looked through) whose subtree holds ``get_output_embeddings()``:
  BERT's ``cls`` (head transform + vocabulary projection), RoBERTa's and GPT-2's ``lm_head``,
  DistilBERT's ``vocab_projector``. During :func:`token_loss_sum` only, that module's ``forward`` is
  replaced on the instance: the model still calls it as a module (so DeepSpeed's ZeRO-3 hooks gather
  its parameters, tied embeddings included), it receives the hidden states ``[batch, seq, hidden]``,
  keeps the rows whose target is not -100 and returns the summed cross-entropy (0-dim float32), which
  the model hands back as its ``logits``. Outside that call the model is untouched (the export check
  compares full logits).
* **Chunked cross-entropy.** The selected rows go through the head and ``F.cross_entropy`` in chunks
  of at most :func:`chunk_tokens` rows (fp32 logits of one chunk stay under
  :data:`LOGITS_CHUNK_ELEMENTS` elements), so the fp32 ``[targets, vocab]`` logits are never
  materialised whole. With more than one chunk and gradients on, a plain ``torch.nn.Linear`` head of at most
  :data:`FUSED_HEAD_MAX_ELEMENTS` elements (GPT-2's, Llama's, Qwen's ``lm_head``; not for ``per_row`` sums) takes
  :class:`LinearCrossEntropy`: each chunk's gradients are computed in the forward pass, so nothing is recomputed
  (the PyTorch form of Liger's kernel below). Any other head has each chunk (head + cross-entropy)
  wrapped in ``torch.utils.checkpoint`` (non-reentrant), as TRL's chunked NLL does: only the chunk's
  hidden states are kept and its logits are recomputed in the backward pass, inside the head's ZeRO-3
  backward window (the head's output is what DeepSpeed hooks, so its parameters are gathered before
  the recomputation runs). A single chunk (the usual MLM micro-batch) is not checkpointed: nothing
  is recomputed.

* **Liger's fused linear cross-entropy on CUDA GPUs.** When the head is a plain ``torch.nn.Linear`` (GPT-2's,
  Llama's and Qwen's ``lm_head``), the rows are on a CUDA device, gradients are on and ``liger-kernel`` is
  installed (the ``gpu`` extra), the projection and the cross-entropy run in Liger's fused Triton kernel
  (``LigerFusedLinearCrossEntropyLoss``, reduction ``sum``, fp32 gradient accumulation; Hsu et al. 2024,
  "Liger Kernel", arXiv:2410.10989): it computes the gradients chunk by chunk in the forward pass, so nothing
  is recomputed and no ``[targets, vocab]`` logits are kept. Everywhere else (CPUs, evaluation, MLM heads with a
  transform before the projection) the chunked PyTorch path above runs. :func:`fused_head_loss` says which, and
  the first use is logged. Not yet run on a GPU: ``tests/test_head_loss.py::test_liger_fused_head_equals_chunked``
  (skipped without CUDA) checks it against the full head (fp32, 1e-4) and the chunked path (bf16) where a GPU is
  present; it is not yet run under ZeRO-3 (where DeepSpeed still gathers the head's weight for the backward pass,
  which Liger does not need).

The chunked path gives the full head's numbers: the sum of per-position cross-entropies over the same
positions, in fp32 (``tests/test_head_loss.py`` checks losses at 1e-6 and gradients at 1e-5 of their largest
magnitude, at ZeRO 0 and 3, MLM and CLM).
What a model does to its head's output before returning it as logits is applied to each chunk's logits too
(:func:`logits_transform`: Gemma-2/3's ``final_logit_softcapping``, ``c * tanh(z / c)``; Cohere's ``logit_scale``;
Granite's ``logits_scaling``), so the loss is the cross-entropy of the logits the model returns and samples from
(such models take the checkpointed chunks, not the fused kernels). The model then applies the same transform to the
returned loss; every forward checks that it did exactly that, so a model that changes its head's output in a way not
in that table is refused with a clear error on its first step (the loss would be wrong).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import checkpoint

from finetune import patches
from finetune.engine import moe
from finetune.parallel import distributed as dist_utils
from finetune.logs import logger

LOGITS_CHUNK_ELEMENTS = 2**24
"""Most fp32 logits (rows x vocabulary) one chunk of the cross-entropy materialises: 64 MiB (e.g. 549 rows of
BERT's 30,522-token vocabulary, 333 of GPT-2's 50,257). Every byte of a chunk is live at the step's memory peak (a
fixed cost on top of the activations, which is what limits the longest trainable sequence); a few hundred rows
still keep the head's matrix products efficient."""

FUSED_HEAD_MAX_ELEMENTS = 2**26
"""Largest head weight (vocabulary x hidden) :class:`LinearCrossEntropy` takes: its fp32 gradient (here at most
256 MiB) is held from the forward to the backward pass; a larger head is checkpointed chunk by chunk instead."""

_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its head module (found once)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (``engine.module``); other modules are returned as they are."""
    while not isinstance(model, transformers.PreTrainedModel) and isinstance(getattr(model, "module", None),
                                                                             torch.nn.Module):
        model = model.module
    return model


def find_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output head of ``model`` (a transformers LM, possibly inside a DeepSpeed engine or a peft wrapper).

    Returns:
        The direct child of the innermost ``PreTrainedModel`` that holds ``model.get_output_embeddings()``
        (or that module itself when it is such a child): the module called with the final hidden states.

    Raises:
        ValueError: the model has no output embeddings (not a masked or causal LM).
    """
    root = unwrap(model)
    if root in _HEADS:
        return _HEADS[root]
    emb = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    path = next((name for name, m in root.named_modules() if m is emb), None) if emb is not None else None
    if path is None or path == "":
        raise ValueError(f"{type(root).__name__} has no output embeddings (get_output_embeddings()); the token loss "
                         f"needs a masked or causal language model")
    parts = path.split(".")
    owner, owner_depth = root, 0
    module = root
    for depth, part in enumerate(parts[:-1], start=1):
        module = getattr(module, part)
        if isinstance(module, transformers.PreTrainedModel):
            owner, owner_depth = module, depth
    head = getattr(owner, parts[owner_depth])
    _HEADS[root] = head
    return head


def logits_transform(model: torch.nn.Module):
    """What ``model``'s forward does to its output head's result before returning it as ``logits``, element-wise,
    as ``(description, function)``; None when it returns the head's output as it is.

    Known (transformers 5.23): ``final_logit_softcapping`` ``c`` of the text config (Gemma-2, Gemma-3, Gemma-3n:
    ``c * tanh(z / c)``), ``logit_scale`` ``s`` (Cohere, Cohere2: ``z * s``) and ``logits_scaling`` ``s`` (Granite,
    Granite-MoE: ``z / s``). A model that does anything else is caught by the check after each forward
    (:func:`token_loss_sum`, ``grpo.completion_logps``)."""
    root = unwrap(model)
    config = getattr(root, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        return f"final_logit_softcapping={cap:g}", lambda z: torch.tanh(z / cap) * cap
    scale = getattr(text, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1 and str(getattr(text, "model_type", "")).startswith("cohere"):
        return f"logit_scale={scale:g}", lambda z: z * scale
    scaling = getattr(text, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and scaling != 1:
        return f"logits_scaling={scaling:g}", lambda z: z / scaling
    return None


@contextlib.contextmanager
def head_output(head: torch.nn.Module):
    """While active, every output of ``head`` is appended to the yielded list as the model receives it: after the
    module's other forward hooks, so under ZeRO-3 it is the tensor DeepSpeed's hooks wrapped (its backward gathers
    the head's parameters again), whatever the model does with it afterwards (a logit transform)."""
    seen: list = []
    handle = head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        yield seen
    finally:
        handle.remove()


def check_head_output(model, head: torch.nn.Module, returned: torch.Tensor, seen: list, transform) -> torch.Tensor:
    """The head's output of one forward (``seen``, :func:`head_output`) after checking that the model returned it
    as :func:`logits_transform` says (``returned``: the model's ``logits``).

    Raises:
        RuntimeError: the head ran otherwise than once, or the model changed its output in another way.
    """
    if len(seen) != 1:
        raise RuntimeError(f"{type(unwrap(model)).__name__} called its output head {type(head).__name__} {len(seen)} "
                           f"times in one forward; the target-position loss supports models that call it once")
    got = seen[0]
    expected = got if transform is None else transform[1](got.detach())
    if returned.shape != expected.shape or not _same(returned.detach(), expected.detach()):
        known = f" other than {transform[0]}" if transform else ""
        raise RuntimeError(f"{type(unwrap(model)).__name__} changes the output of its head {type(head).__name__} "
                           f"before returning it{known} (e.g. logit soft-capping or scaling of a kind finetune does "
                           f"not know); the target-position loss does not support such models")
    return got


def chunk_tokens(vocab_size: int) -> int:
    """Rows per cross-entropy chunk for a vocabulary of ``vocab_size``: ``LOGITS_CHUNK_ELEMENTS // vocab_size``
    (at least 1)."""
    return max(1, LOGITS_CHUNK_ELEMENTS // max(int(vocab_size), 1))


def _ce_sum(head_fn, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head_fn(hidden).float(), targets, reduction="sum")


def _ce_rows(head_fn, hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    per = F.cross_entropy(head_fn(hidden).float(), targets, reduction="none")
    return torch.zeros(n_rows, dtype=per.dtype, device=per.device).index_add(0, rows, per)


def chunked_cross_entropy(head_fn, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                          count_correct: bool = False, rows: torch.Tensor | None = None,
                          n_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy of ``head_fn(hidden)`` against ``targets``, ``chunk`` rows at a time.

    Args:
        head_fn: ``[rows, hidden] -> [rows, vocab]`` logits (any float dtype; upcast to fp32 per chunk).
        hidden: ``[n, hidden]`` hidden states of the target positions.
        targets: ``[n]`` int64 class ids (no -100).
        chunk: rows per chunk; with more than one chunk and gradients enabled each chunk is checkpointed
            (its logits are recomputed in the backward pass instead of kept).
        count_correct: also count rows whose argmax logit is the target (evaluation; not checkpointed).

    Returns:
        ``(loss_sum, correct)``: 0-dim float32 (differentiable; 0 for ``n == 0``, still connected to the
        head so every parameter gets a gradient) and 0-dim int64, or ``None`` without ``count_correct``.
    """
    if rows is None:
        pieces = [(h, y, None) for h, y in zip(hidden.split(chunk), targets.split(chunk))] or [(hidden, targets, None)]
    else:
        pieces = list(zip(hidden.split(chunk), targets.split(chunk), rows.split(chunk))) or [(hidden, targets, rows)]
    recompute = torch.is_grad_enabled() and len(pieces) > 1 and not count_correct
    loss = None
    correct = torch.zeros((), dtype=torch.long, device=targets.device) if count_correct else None
    for h, y, r in pieces:
        if recompute:
            part = (checkpoint(_ce_sum, head_fn, h, y, use_reentrant=False) if r is None
                    else checkpoint(_ce_rows, head_fn, h, y, r, n_rows, use_reentrant=False))
        else:
            logits = head_fn(h).float()
            part = (F.cross_entropy(logits, y, reduction="sum") if r is None else
                    torch.zeros(n_rows, dtype=logits.dtype, device=logits.device).index_add(
                        0, r, F.cross_entropy(logits, y, reduction="none")))
            if r is not None and len(y) == 0:  # still connected to the head (every parameter gets a gradient)
                part = part + logits.sum() * 0
            if count_correct:
                correct += (logits.argmax(dim=-1) == y).sum()
            del logits
        loss = part if loss is None else loss + part
    return loss, correct


_ANNOUNCED: set = set()


@functools.cache
def _liger_loss_class():
    """``liger_kernel``'s ``LigerFusedLinearCrossEntropyLoss``, or None when it (or Triton) cannot be imported."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
    except Exception:  # noqa: BLE001  (not installed, no Triton, no CUDA build: the chunked path runs)
        return None
    return LigerFusedLinearCrossEntropyLoss


def fused_head_loss(head: torch.nn.Module, hidden: torch.Tensor, count_correct: bool = False,
                    forward_replaced: bool = False) -> str | None:
    """Why the fused kernel does not run for ``head`` on ``hidden``, or None when it does.

    The fused path (Liger's fused linear cross-entropy) needs: gradients on and no accuracy count (training), a
    head that is exactly ``torch.nn.Linear`` running its class's ``forward`` (not a peft/LoRA layer;
    ``forward_replaced``: someone other than this module set an instance-level ``forward``), CUDA hidden states
    that require gradients (Liger 0.8.5 computes no weight gradient otherwise), at least one target row, and
    ``liger-kernel`` importable.

    Args:
        head: the output head (:func:`find_head`).
        hidden: ``[n, hidden]`` hidden states of the target rows.
        count_correct: an accuracy count is wanted (evaluation).
        forward_replaced: the head's ``forward`` was replaced on the instance before the loss call.

    Returns:
        None (fused), or a short reason for the chunked path, e.g. ``"CPU tensors"``.
    """
    if not torch.is_grad_enabled() or count_correct:
        return "evaluation"
    if type(head) is not torch.nn.Linear or forward_replaced:
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return f"the head is {kind}{' with a replaced forward' if forward_replaced else ''}, not torch.nn.Linear"
    if not hidden.is_cuda:
        return "CPU tensors" if hidden.device.type == "cpu" else f"{hidden.device.type} tensors"
    if not hidden.requires_grad:  # Liger computes the weight's gradient only through the input's (0.8.5)
        return "hidden states without gradients"
    if hidden.shape[0] == 0:
        return "no target rows"
    if _liger_loss_class() is None:
        return "liger-kernel is not installed (pip install -e .[gpu])"
    return None


def add_head_gradients(grads: tuple, logits_grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                       start: int) -> None:
    """Add one chunk's share to a linear head's gradients ``grads`` = ``(input [n, hidden], weight [vocab, hidden]
    fp32, bias [vocab] fp32)`` (None where not wanted), from the loss's gradient ``logits_grad`` (``[rows, vocab]``
    fp32) with respect to the logits ``h @ weight.T + bias`` of the chunk's hidden states ``h`` (rows ``start`` on):
    ``dL/dh = g W``, ``dL/dW += g^T h``, ``dL/db += sum g``."""
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        grad_h[start:start + len(h)] = logits_grad.to(weight.dtype) @ weight
    if grad_w is not None:
        grad_w.addmm_(logits_grad.t(), h.float())
    if grad_b is not None:
        grad_b += logits_grad.sum(0)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``targets`` whose gradients are computed in the
    forward pass, chunk by chunk: nothing is recomputed in the backward pass and no ``[rows, vocab]`` logits outlive
    their chunk. The PyTorch form of Liger's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989), for
    devices Liger's Triton kernel does not run on (CPUs): per chunk, logits ``z = h W^T + b`` (fp32), loss
    ``logsumexp(z) - z[y]``, ``dL/dz = softmax(z) - onehot(y)``, then ``dL/dh = dL/dz W`` and
    ``dL/dW += dL/dz^T h`` (fp32 accumulation), ``dL/db += sum(dL/dz)``. The backward pass scales the stored
    gradients by the incoming one. Same FLOPs as autograd's forward + backward of a plain head; the checkpointed
    chunks of :func:`chunked_cross_entropy` run the head's forward twice. The price: ``dL/dW`` (fp32, the head's
    size) is held from the forward to the backward pass, which is why :func:`torch_fused_head` takes this path only
    for heads of at most :data:`FUSED_HEAD_MAX_ELEMENTS` elements.

    ``apply(hidden [n, hidden], weight [vocab, hidden], bias [vocab] or None, targets [n] int64 (no -100),
    chunk: int) -> 0-dim float32``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], targets[start:start + chunk]
            # in place: no second [rows, vocab] tensor (logsumexp and softmax would each allocate one)
            grad = F.linear(h, weight, bias).float()
            grad -= grad.max(dim=-1, keepdim=True).values
            picked = grad.gather(1, y[:, None])
            total = grad.exp_().sum(dim=-1, keepdim=True)
            loss += (total.log() - picked).sum()
            grad /= total  # softmax
            grad[torch.arange(len(y), device=y.device), y] -= 1
            add_head_gradients((grad_h, grad_w, grad_b), grad, h, weight, start)
            del grad
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
                (grad_w * grad_out).to(ctx.dtypes[0]) if grad_w is not None else None,
                (grad_b * grad_out).to(ctx.dtypes[1]) if grad_b is not None else None, None, None)


def torch_fused_head(head: torch.nn.Module, hidden: torch.Tensor, chunk: int, count_correct: bool = False,
                     forward_replaced: bool = False) -> bool:
    """Whether :class:`LinearCrossEntropy` computes the head loss where Liger's kernel does not run.

    It does for training (gradients on, no accuracy count) with a head that is exactly ``torch.nn.Linear`` with its
    class's ``forward``, more than one chunk of ``chunk`` rows in ``hidden`` ``[n, hidden]`` (one chunk is not
    recomputed anyway), and a weight of at most :data:`FUSED_HEAD_MAX_ELEMENTS` elements (its fp32 gradient is held
    from the forward to the backward pass; larger heads keep the checkpointed chunks)."""
    return (torch.is_grad_enabled() and not count_correct and type(head) is torch.nn.Linear and not forward_replaced
            and hidden.shape[0] > chunk and head.weight.numel() <= FUSED_HEAD_MAX_ELEMENTS)


def _fused_ce_sum(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``head(hidden)`` against ``targets`` in Liger's fused kernel (0-dim float32)."""
    loss_fn = _liger_loss_class()(reduction="sum", accum_dtype=torch.float32)
    return loss_fn(head.weight, hidden, targets, head.bias).float()


def _announce(path: str) -> None:
    """Log, once per path and process (rank 0), which head loss runs."""
    if path not in _ANNOUNCED:
        _ANNOUNCED.add(path)

        if dist_utils.is_main():
            logger.info(f"head loss: {path}")


_HEAD_WHY = ("the LM head runs only at the target positions, in chunks, inside the model's own forward (transformers "
             "computes the logits of every position); restored when the loss is computed")


@contextlib.contextmanager
def _head_returns_loss(head: torch.nn.Module, targets: torch.Tensor, chunk: int, count_correct: bool,
                       per_row: bool = False, transform=None):
    """While active, calling ``head(hidden [batch, seq, hidden])`` returns the summed cross-entropy at ``targets``
    (``[batch, seq]``, -100 = no loss; ``per_row``: ``[batch]`` sums, one per sequence) of the head's logits after
    ``transform`` (:func:`logits_transform`); the result and the correct count are also kept on the yielded state."""
    state = SimpleNamespace(loss=None, correct=None, calls=0)
    own = vars(head).get("forward")  # an instance-level forward someone else set (restored afterwards)
    original = head.forward

    def forward(hidden, *args, **kwargs):
        state.calls += 1
        if state.calls > 1:
            raise RuntimeError(f"{type(head).__name__} (the output head) was called twice in one forward; the "
                               f"target-position loss supports models that call their head once")
        if hidden.shape[:-1] != targets.shape:
            raise RuntimeError(f"the output head {type(head).__name__} got hidden states of shape "
                               f"{tuple(hidden.shape)}, expected [batch, seq, hidden] matching the labels "
                               f"{tuple(targets.shape)}")
        keep = targets != -100
        rows, wanted = hidden[keep], targets[keep]
        why_not = fused_head_loss(head, rows, count_correct, forward_replaced=own is not None)
        if transform is not None and why_not not in ("evaluation",):
            why_not = f"the model transforms its head's logits ({transform[0]})"
        if why_not is None and per_row:
            why_not = "per-sequence sums"
        if why_not is None and (args or kwargs):
            why_not = "the head takes arguments besides the hidden states"
        if why_not is None:
            _announce("Liger fused linear cross-entropy at the target positions (CUDA)")
            state.loss, state.correct = _fused_ce_sum(head, rows, wanted), None
        elif not (per_row or args or kwargs or transform) and torch_fused_head(head, rows, chunk, count_correct,
                                                                                own is not None):
            _announce(f"chunked PyTorch cross-entropy at the target positions, gradients in the forward pass "
                      f"({why_not})")
            state.loss = LinearCrossEntropy.apply(rows, head.weight, head.bias, wanted, chunk)
            state.correct = None
        else:
            if torch.is_grad_enabled() and why_not != "evaluation":
                _announce(f"chunked PyTorch cross-entropy at the target positions ({why_not})")
            row_of = keep.nonzero()[:, 0] if per_row else None
            post = transform[1] if transform is not None else (lambda z: z)
            state.loss, state.correct = chunked_cross_entropy(
                lambda h: post(original(h, *args, **kwargs)), rows, wanted, chunk, count_correct, row_of,
                targets.shape[0])
        return state.loss

    with patches.applied(patches.instance_forward(head, forward, _HEAD_WHY)):
        yield state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` equals ``b``, NaN equal to NaN (a diverged step's loss is NaN; the loop skips that step)."""
    return torch.equal(a, b) or bool(torch.isnan(a).all() and torch.isnan(b).all())


def token_loss_sum(model, inputs: dict, targets: torch.Tensor, count_correct: bool = False,
                   per_row: bool = False, router: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model(**inputs)`` with its head and cross-entropy only at the positions where ``targets != -100``.

    Args:
        model: a masked or causal LM from transformers, or a DeepSpeed engine (or peft model) around one.
        inputs: the model's keyword inputs (``input_ids``, ``attention_mask``, ...; no ``labels``).
        targets: ``[batch, seq]`` int64: the class the logits at each position should predict (for a causal
            LM the labels already shifted by one), -100 where no loss is taken.
        count_correct: also return how many target positions have their target as the argmax (evaluation).
        per_row: sum per sequence instead: ``[batch]`` float32, the negative log-likelihood of each row's targets
            (preference losses need one log-probability per sequence); never on the fused kernel.
        router: a dict to fill with the router's loss term and statistics when the model is a mixture of experts
            (it is then asked for its router logits): :func:`finetune.engine.moe.router_terms`'s ``aux_loss`` and
            ``metrics``; left empty for a dense model. None: the router logits are not asked for.

    Returns:
        ``(loss_sum, correct)``: the cross-entropy summed over target positions (0-dim float32, fp32 logits;
        ``[batch]`` with ``per_row``; the tensor the model returned, so a ZeRO-3 backward gathers the head's
        parameters) and the number of correct argmax predictions (0-dim int64), or ``None`` without
        ``count_correct``.

    Raises:
        RuntimeError: the model modifies its head's output before returning it otherwise than
            :func:`logits_transform` says, or calls its head otherwise than once on ``[batch, seq, hidden]`` states.
    """
    head = find_head(model)
    emb = unwrap(model).get_output_embeddings()
    vocab = getattr(emb, "out_features", None) or getattr(unwrap(model).config, "vocab_size", 32768)
    extra = moe.router_inputs(unwrap(model).config) if router is not None else {}
    transform = logits_transform(model)
    with _head_returns_loss(head, targets, chunk_tokens(vocab), count_correct, per_row, transform) as state, \
            head_output(head) as seen:
        out = model(**inputs, **extra)
    if state.loss is None:
        raise RuntimeError(f"{type(unwrap(model)).__name__} never called its output head {type(head).__name__}; "
                           f"the target-position loss cannot run on this model")
    got = check_head_output(model, head, out.logits, seen, transform)
    if extra:
        router.update(moe.router_terms(unwrap(model).config, out, inputs.get("attention_mask")))
    return got, state.correct
