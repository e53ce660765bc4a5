"""One Triton kernel for a logits chunk's cross-entropy: loss, greedy token and input-side gradient per row.

The fused loss (method.loss._GradInForwardCE) needs, per supervised position, w * (logsumexp - logit[y]), the
argmax, and (softmax - onehot) * w to multiply into the head. In torch that is ten passes over a
[2048, 248320] chunk in fp32 (the upcast, argmax, logsumexp's four, the in-place softmax, the label's -1, the
weight, the cast back). This kernel reads the bf16 logits twice and writes the gradient once, over the logits
(Liger-Kernel's cross-entropy kernel does the same; this one adds the argmax and the position weight).
Arithmetic is fp32 as in the torch path; only the order of the sums differs. On an H200 the reference drafter
step went from 279.7 to 250.9 ms with it, side by side in one run (docs/journal.md).
"""

from __future__ import annotations

import os
from typing import Any

import torch

_MAX_BLOCK = 32768  # elements of a row per iteration (Liger's choice for a 64K-element budget in bf16)


def _kernel() -> Any:
    """The jitted kernel, built on first use: importing triton costs a CPU-only run (the lab) seconds."""
    global _CE_ROWS
    if _CE_ROWS is None:
        import triton
        import triton.language as tl

        @triton.jit
        def ce_rows_kernel(
            logits_ptr, stride, labels_ptr, weights_ptr, loss_ptr, argmax_ptr, V, BLOCK: tl.constexpr
        ):
            row = tl.program_id(0).to(tl.int64)
            base = logits_ptr + row * stride
            y = tl.load(labels_ptr + row)
            w = tl.load(weights_ptr + row).to(tl.float32)
            x_y = tl.load(base + y).to(tl.float32)  # read before the second pass writes over it
            cols = tl.arange(0, BLOCK)
            # Pass 1: running max (it is also the argmax's value) and the sum of exp below it.
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.full((), 0.0, tl.float32)
            best = tl.full((), 0, tl.int64)
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
                block_max = tl.max(x, 0)
                block_arg = tl.argmax(x, 0, tie_break_left=True)  # torch.argmax: the first of equal maxima
                new_m = tl.maximum(m, block_max)
                s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
                best = tl.where(block_max > m, start + block_arg.to(tl.int64), best)
                m = new_m
            lse = m + tl.log(s)
            tl.store(loss_ptr + row, (lse - x_y) * w)
            tl.store(argmax_ptr + row, best)
            # Pass 2: (softmax - onehot) * w, in the logits' dtype, over the logits.
            for start in range(0, V, BLOCK):
                idx = start + cols
                keep = idx < V
                x = tl.load(base + idx, mask=keep, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - tl.where(idx == y, 1.0, 0.0)) * w
                tl.store(base + idx, g.to(logits_ptr.dtype.element_ty), mask=keep)

        _CE_ROWS = ce_rows_kernel
    return _CE_ROWS


_CE_ROWS: Any = None


def runs_here(t: torch.Tensor) -> bool:
    """Whether the kernel can take `t`: a CUDA tensor, or any tensor under Triton's interpreter
    (TRITON_INTERPRET=1, read by triton at import; how the CPU tests run this kernel)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def ce_rows_(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` [n, V]: returns (w * (logsumexp - logit[y]) as fp32 [n], argmax [n] int64) and
    overwrites the logits with (softmax - onehot(y)) * w in their own dtype.

    labels: Long[n] in [0, V) (ignored positions carry a label of 0 and a weight of 0); weights: [n].
    Where it runs: `runs_here`.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"ce_rows_: logits must be a row-major [n, V] matrix, got {tuple(logits.shape)}")
    n, vocab = logits.shape
    if labels.shape != (n,) or weights.shape != (n,):
        shapes = f"labels {tuple(labels.shape)} and weights {tuple(weights.shape)}"
        raise ValueError(f"ce_rows_: {shapes} for {n} rows")
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return loss, argmax
    kernel = _kernel()
    block = min(_MAX_BLOCK, 1 << (vocab - 1).bit_length())
    args = (logits, logits.stride(0), labels.contiguous(), weights.contiguous(), loss, argmax, vocab)
    kernel[(n,)](*args, BLOCK=block, num_warps=32 if block >= 8192 else 4)
    return loss, argmax
