"""Position-weighted cross-entropy over the target's LM head, computed in chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_trainer.method import ce_rows

# Decay of the loss weight along the block, from the paper: gamma 7 for B=16, 5 for 10, 4 for 8.
_GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


def gamma_for_block_size(block_size: int) -> float:
    try:
        return _GAMMA_BY_BLOCK_SIZE[block_size]
    except KeyError:
        known = sorted(_GAMMA_BY_BLOCK_SIZE)
        raise ValueError(f"no reference gamma for block_size {block_size} (known: {known}); set it") from None


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Float[Bs]: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass(frozen=True)
class LossStats:
    predictions: torch.Tensor  # Long[B,N]: drafter greedy token where weight > 0, else -1
    weight_sum: torch.Tensor  # scalar: normaliser of the loss
    num_tokens: int  # positions with weight > 0


LOSS_IMPLS = ("fused", "fused-torch", "checkpointed")


def _chunk_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor):
    logits = (hidden @ head.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weight).sum(), logits.argmax(dim=-1)


def _matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives a matmul of `t` here (bf16 under the trainer's autocast), else t's own."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


class _GradInForwardCE(torch.autograd.Function):
    """sum(w * CE(h @ W^T, y)) over chunks, with d/dh computed in the forward while each chunk's logits exist.

    The LM head is frozen, so its backward needs only the input gradient, (softmax - onehot) * w @ W;
    computing it in the forward (the approach of Liger-Kernel's fused linear cross-entropy) spends 4 H*V
    FLOPs per position where recomputing the chunk under activation checkpointing spent 6, and passes over
    the [chunk, V] fp32 logits fewer times. The gradient kept for backward is [n, H]; backward only scales it.
    With `rows_kernel`, where Triton runs (CUDA), each chunk's loss, argmax and softmax gradient come from one
    kernel over the bf16 logits (method.ce_rows) instead of ten torch passes over an fp32 copy.
    """

    @staticmethod
    def forward(ctx, h, head, y, w, chunk_size, dtype, rows_kernel):  # type: ignore[override]
        ignored = y < 0  # F.cross_entropy's ignore_index (-100): no loss, no gradient
        w = torch.where(ignored, 0.0, w)
        y = torch.where(ignored, 0, y)
        head_c = head.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        preds = torch.empty_like(y)
        kernel = rows_kernel and ce_rows.runs_here(h)
        for start in range(0, h.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            logits = h[sl].to(dtype) @ head_c.t()
            if kernel:  # one Triton kernel: the gradient over the logits, in their dtype
                loss_rows, preds[sl] = ce_rows.ce_rows_(logits, y[sl], w[sl])
                total += loss_rows.sum()
                grad = logits
            else:  # the same in torch, in fp32 (CPU runs; the benchmark's side-by-side)
                logits = logits.float()
                preds[sl] = logits.argmax(dim=-1)
                lse = torch.logsumexp(logits, dim=-1)
                rows = torch.arange(logits.shape[0], device=h.device)
                total += ((lse - logits[rows, y[sl]]) * w[sl]).sum()
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                grad[rows, y[sl]] -= 1.0
                grad.mul_(w[sl, None])
            grad_h[sl] = (grad.to(dtype) @ head_c).to(h.dtype)
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(preds)
        return total, preds

    @staticmethod
    def backward(ctx, grad_total, _grad_preds):  # type: ignore[override]
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_total.to(grad_h.dtype), None, None, None, None, None, None


def chunked_block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int,
    *,
    impl: str = "fused",
) -> tuple[torch.Tensor, LossStats]:
    """sum(weight * CE(hidden @ W^T, labels)) / sum(weight), never holding more than one chunk of logits.

    Only positions with weight > 0 are computed. `impl`: "fused" (the default for a frozen head) computes the
    input gradient in the forward, chunk by chunk (_GradInForwardCE), each chunk's softmax in one Triton
    kernel where Triton runs; "fused-torch" the same with the softmax in torch; "checkpointed" runs each
    chunk under activation checkpointing and recomputes its [chunk, V] logits in backward (also the path for
    a head that trains). All equal the unchunked loss in value and gradients; peak memory is one chunk.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r}: one of {', '.join(LOSS_IMPLS)}")
    flat_w = weight.reshape(-1)
    idx = flat_w.nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)
    y = labels.reshape(-1).index_select(0, idx)
    w = flat_w.index_select(0, idx).float()
    total = hidden.new_zeros((), dtype=torch.float32) + hidden.sum() * 0.0  # keeps the graph when empty
    preds = []
    if impl != "checkpointed" and not lm_head_weight.requires_grad and idx.numel():
        args = (h, lm_head_weight, y, w, chunk_size, _matmul_dtype(h), impl == "fused")
        part, pred = _GradInForwardCE.apply(*args)
        total = total + part
        preds.append(pred)
    else:
        for start in range(0, idx.numel(), chunk_size):
            sl = slice(start, start + chunk_size)
            part, pred = checkpoint(_chunk_loss, h[sl], lm_head_weight, y[sl], w[sl], use_reentrant=False)
            total = total + part
            preds.append(pred)
    weight_sum = w.sum()
    loss = total / weight_sum.clamp(min=math.ulp(1.0))
    predictions = torch.full_like(labels.reshape(-1), -1)
    if preds:
        predictions[idx] = torch.cat(preds)
    stats = LossStats(predictions.view_as(labels), weight_sum.detach(), int(idx.numel()))
    return loss, stats
