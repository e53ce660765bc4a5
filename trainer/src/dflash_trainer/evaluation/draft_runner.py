"""The decode walk's drafter side: a block's greedy guesses from the target features of the whole context.

The drafter has no KV cache (as dflash's `dflash_generate` runs it with a fresh one each step, the same
arithmetic): each step it reads the target features of every token so far.

Kinds. "dynamic": the context is the features as they are, one tensor longer each step. "static": the features
sit in a buffer sized for the walk's longest context, and the drafter reads the whole buffer; the block's
attention mask (method.mask, anchored at the context's length) hides every key past the context, and the
positions of the block follow the length. Mask, positions and anchor are computed on the device from a
length tensor, so nothing the forward reads depends on the host. "graph": the static forward captured once
in a CUDA graph and replayed: the eager drafter of a walk step is bound by its host (14.0 ms a step on an
H100 for about 1 ms of device work, docs/benchmarks.md#decode-walk). A hidden key adds exactly zero to the
softmax, so the guesses are dynamic's up to the rounding of sums over a longer row. A shorter block (a
prompt's last) runs dynamically: its slots see each other, so padding would change the guesses.

Weights. Under autocast the drafter's linear layers cast their fp32 weights (the training copy) to bf16 at
each call; eagerly autocast caches the casts for the walk, but a capture runs with the cast cache off, so a
replay would cast them all again (about 16 GB of traffic a step for the reference drafter, most of its
7.1 ms on an H100). The static and graph kinds cast the linear weights once per walk, to what autocast would
have cast them to (bitwise the same matmuls), and run the drafter with them (torch.func.functional_call);
the norms keep their fp32 weights, as under autocast. A runner kept for the next walk casts them again into
the same tensors (`refresh_weights`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from dflash_trainer.evaluation.cuda_graph import Graphed
from dflash_trainer.evaluation.target_cache import CacheKind
from dflash_trainer.method.mask import block_attention_mask
from dflash_trainer.model.drafter import SLIDING, DFlashDrafter, DrafterSpec


def draft_block(
    drafter: DFlashDrafter, embed: nn.Module, head: nn.Module, context: torch.Tensor, block: torch.Tensor
) -> torch.Tensor:
    """Greedy guesses Long[1, N-1] for block slots 1..N-1: one block anchored after the whole context."""
    ctx_len = context.shape[1]
    anchors = torch.tensor([[ctx_len]], device=context.device)
    return _guesses(drafter.spec, drafter, embed, head, context, block, anchors)


def _guesses(
    spec: DrafterSpec,
    forward: Callable[..., torch.Tensor],
    embed: nn.Module,
    head: nn.Module,
    context: torch.Tensor,
    block: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """The guesses of `forward` (the drafter, or the drafter with other weights) with the block anchored at
    `anchors` (Long[1, 1], on the device) in a context of context.shape[1] keys; the keys at and past the
    anchor are hidden."""
    ctx_len, n = context.shape[1], block.shape[1]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    masks = {
        t: block_attention_mask(anchors, valid, ctx_len, n, spec.sliding_window if t == SLIDING else None)
        for t in set(spec.layer_types)
    }
    offsets = torch.arange(n, device=context.device)
    positions = torch.cat([torch.arange(ctx_len, device=context.device), anchors[0] + offsets])[None]
    hidden = forward(context, embed(block), positions, masks)
    return head(hidden[:, 1:]).argmax(dim=-1)


def cast_linear_weights(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's linear weights as autocast would cast them on their device (empty without autocast
    there, or when they are in its dtype already): held for a walk, they replace the casts of every call."""
    device = next(drafter.parameters()).device.type
    if not torch.is_autocast_enabled(device):
        return {}
    dtype = torch.get_autocast_dtype(device)
    return {
        f"{name}.weight": module.weight.detach().to(dtype)
        for name, module in drafter.named_modules()
        if isinstance(module, nn.Linear) and module.weight.dtype != dtype
    }


class DraftRunner:
    """One walk's drafter: `start` with a prompt's features, `extend` with the kept tokens' features after
    each verify, `guesses` for the next block."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed: nn.Module,
        head: nn.Module,
        *,
        kind: CacheKind,
        max_context: int,
        block_size: int,
    ) -> None:
        device = next(embed.parameters()).device
        if kind == "graph" and device.type != "cuda":
            kind = "static"
        self.kind: CacheKind = kind
        self.drafter, self.embed, self.head = drafter, embed, head
        self.max_context, self.block_size = max_context, block_size
        self.length = 0
        self._context: torch.Tensor | None = None  # dynamic: the features so far; static: the buffer
        self._anchor = torch.zeros(1, 1, dtype=torch.long, device=device)  # static: the context's length
        self._ids = torch.zeros(1, block_size, dtype=torch.long, device=device)
        self._graphed = Graphed(self._run_buffers, "the drafter", "this walk's drafter goes on without it")
        self._weights = cast_linear_weights(drafter) if kind != "dynamic" else {}

    def start(self, features: torch.Tensor) -> None:
        """A new prompt: its features [1, T, K*H]."""
        self.length = 0
        if self.kind == "dynamic":
            self._context = features
            self.length = features.shape[1]
            return
        if self._context is None:  # one buffer for every prompt of the walk: the graph reads its address
            shape = (1, self.max_context, features.shape[-1])
            self._context = torch.zeros(shape, dtype=features.dtype, device=features.device)
        self.extend(features)

    def extend(self, kept: torch.Tensor) -> None:
        """The features of the tokens the last verify kept."""
        assert self._context is not None, "start() first"
        if self.kind == "dynamic":
            self._context = torch.cat([self._context, kept], dim=1)
        else:
            end = self.length + kept.shape[1]
            if end > self.max_context:
                raise ValueError(
                    f"decode walk: a context of {end} tokens past the drafter's {self.max_context}"
                )
            self._context[:, self.length : end] = kept
        self.length += kept.shape[1]

    def guesses(self, block: torch.Tensor) -> torch.Tensor:
        """Greedy guesses Long[1, N-1] for the block's slots 1..N-1 (slot 0 is the last accepted token)."""
        assert self._context is not None, "start() first"
        if self.kind == "dynamic" or block.shape[1] != self.block_size:
            return draft_block(self.drafter, self.embed, self.head, self._context[:, : self.length], block)
        self._ids.copy_(block)
        self._anchor.fill_(self.length)
        if self.kind != "graph":
            return self._run_buffers()
        out = self._graphed()
        if self._graphed.failed:  # said once in the log; the drafter goes on over the buffer
            self.kind = "static"
        return out

    def refresh_weights(self) -> None:
        """The drafter's weights as they are now (it trained since the last walk), cast into the held ones in
        place: a kept graph reads them where they are."""
        if not self._weights:
            return
        modules = dict(self.drafter.named_modules())
        held = list(self._weights.values())
        now = [modules[name.removesuffix(".weight")].weight.detach() for name in self._weights]
        torch._foreach_copy_(held, now)  # the same rounding as the cast of .to(dtype)

    def close(self) -> None:
        """Releases the drafter's CUDA graph."""
        self._graphed.release()

    def _forward(self, *args: torch.Tensor | dict[str, object]) -> torch.Tensor:
        if not self._weights:
            return self.drafter(*args)
        out: torch.Tensor = functional_call(self.drafter, self._weights, args)
        return out

    def _run_buffers(self) -> torch.Tensor:
        assert self._context is not None
        return _guesses(
            self.drafter.spec, self._forward, self.embed, self.head, self._context, self._ids, self._anchor
        )
