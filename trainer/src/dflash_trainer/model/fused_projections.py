"""One GEMM for the projections of a layer that read the same input, in the target's compiled forward.

The 27B-shaped target forward is bound by its GEMMs (96 % of the measured matmul rate; docs/journal.md),
and a Gated DeltaNet layer runs five of them on one input: q|k|v, z and the two 48-column b and a, which
cuBLAS runs as split-K GEMMs of 12 us each; the MLP runs gate and up apart, the attention q, k and v. One
wider GEMM per group fills the GPU better and launches fewer kernels.

transformers' layers call each projection by name (`self.in_proj_z(hidden_states)`), so their forwards stay
as they are. Instead:
- the group's weights become rows of one fused matrix: a view over them where they already lie back to back
  in one allocation (fast_load's views of a safetensors file, whose tensors are sorted by name: a, b, qkv, z
  and gate, up are neighbours); where other weights of that allocation lie between them (an attention
  layer's k_proj, o_proj, q_norm, q_proj, v_proj), the stretch they share is laid out again in place, the
  group first, and every weight in it re-pointed to its new place (`Neighbours.gather`); else one copy that
  replaces them (their old memory is freed); a group that could only be fused by keeping a second copy of
  its weights stays apart;
- each projection's forward, while compiled, is `linear(x, fused)[..., its rows]`: the group's calls become
  the same matmul, which `DEDUPLICATE_MATMULS` (an inductor post-grad pass) merges into one;
- outside a compiled region (the decode walk, eager captures) each projection runs its own weight, as before.

Parameter names and the state dict are unchanged; the weights are the same values, so the features are the
same up to the GEMM's accumulation order.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
import types
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger("dflash_trainer.target")

# Sibling projections (attribute names on one module) that transformers' Qwen3 / Qwen3.5 / Qwen3-Next layers
# apply to the same input.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5 Gated DeltaNet
    ("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next Gated DeltaNet
    ("q_proj", "k_proj", "v_proj"),  # attention
    ("gate_proj", "up_proj"),  # MLP (and Qwen3-Next's shared expert)
)
_FUSED = "_dflash_fused"


@dataclass
class FusedGroup:
    """One group's fused weight (and bias), shared by its projections."""

    weight: Tensor
    bias: Tensor | None


def _fused_forward(self: nn.Linear, x: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        group: FusedGroup = getattr(self, _FUSED)
        lo, hi = self._dflash_rows
        return F.linear(x, group.weight, group.bias)[..., lo:hi]
    return F.linear(x, self.weight, self.bias)


def _back_to_back(weights: list[Tensor]) -> Tensor | None:
    """A view of the weights as rows of one matrix, in memory order, when they lie back to back in one
    allocation; None otherwise."""
    first = weights[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for w in weights:
        if w.untyped_storage().data_ptr() != storage or not w.is_contiguous() or w.data_ptr() != end:
            return None
        end += w.nbytes
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


def _owns_its_memory(w: Tensor) -> bool:
    return w.is_contiguous() and w.untyped_storage().nbytes() == w.nbytes


def _offset(t: Tensor) -> int:
    """Where `t` starts in its allocation, in bytes."""
    return t.data_ptr() - t.untyped_storage().data_ptr()


def _alignment(offset: int) -> int:
    """What a tensor at `offset` is aligned to, up to the 16 bytes of a GPU's vector loads (cuBLAS's and
    Triton's fast paths want 16-byte aligned operands)."""
    return min(16, offset & -offset) if offset else 16


class Neighbours:
    """A model's parameters and buffers by the allocation they lie in, to lay a group's weights out together
    where they share one allocation with the weights between them (fast_load's view of a file)."""

    def __init__(self, model: nn.Module) -> None:
        self.by_allocation: dict[int, list[Tensor]] = defaultdict(list)
        seen: set[int] = set()
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                self.by_allocation[t.untyped_storage().data_ptr()].append(t)
        self.pinned: set[int] = set()  # the weights of fused groups (a view over them): never moved

    def gather(self, weights: list[Tensor]) -> bool:
        """Lays out the stretch of the allocation from the first weight of the group to the end of its last
        again, in place: the group's weights back to back in the group's order, then the others that lay in
        between, each weight re-pointed to its new place (the same values; the stretch is copied once). Only
        where that is safe: the group in one allocation, the stretch tiled exactly by contiguous weights of
        the model (no byte of something else in it), none of them in a fused group, none less aligned after
        the move than before (`_alignment`). Returns whether it moved them."""
        allocation = weights[0].untyped_storage()
        if any(w.untyped_storage().data_ptr() != allocation.data_ptr() for w in weights):
            return False
        lo = min(_offset(w) for w in weights)
        hi = max(_offset(w) + w.nbytes for w in weights)
        near = self.by_allocation[allocation.data_ptr()]
        inside = sorted((t for t in near if _offset(t) < hi and _offset(t) + t.nbytes > lo), key=_offset)
        end = lo
        for t in inside:
            if _offset(t) != end or not t.is_contiguous() or id(t) in self.pinned:
                return False  # a gap (bytes not the model's), an overlap, a strided or a pinned weight
            end += t.nbytes  # tiled from lo on, the last ends at hi: the group's last weight does
        group = {id(w) for w in weights}
        order = [*weights, *(t for t in inside if id(t) not in group)]
        places = list(itertools.accumulate((t.nbytes for t in order[:-1]), initial=lo))
        if any(new % _alignment(_offset(t)) for t, new in zip(order, places, strict=True)):
            return False
        raw = torch.empty(0, dtype=torch.uint8, device=weights[0].device).set_(allocation)
        before = raw[lo:hi].clone()
        for t, new in zip(order, places, strict=True):
            old = _offset(t) - lo
            raw[new : new + t.nbytes].copy_(before[old : old + t.nbytes])
        for t, new in zip(order, places, strict=True):
            t.data = raw[new : new + t.nbytes].view(t.dtype).view(t.shape)
        return True


def fuse_group(linears: list[nn.Linear], neighbours: Neighbours | None = None) -> str:
    """Fuse one group in place; returns "view", "gathered" (a view once `neighbours` laid them out
    together), "copy" or why it stayed apart."""
    weights = [lin.weight for lin in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return "apart: dtypes, devices or input widths differ"
    if len({lin.bias is None for lin in linears}) != 1:
        return "apart: some have a bias, some not"
    if any(w.requires_grad for w in weights):
        return "apart: trainable"  # the target is frozen; a trained weight must keep its own gradient
    in_memory = sorted(linears, key=lambda lin: lin.weight.data_ptr())
    fused = _back_to_back([lin.weight for lin in in_memory])
    how = "view"
    if fused is None and neighbours is not None and neighbours.gather(weights):
        in_memory, how = linears, "gathered"  # now back to back in the group's order
        fused = _back_to_back(weights)
    if fused is not None:
        linears = in_memory  # rows in memory order (by name in a safetensors file: the same in every layer)
    else:  # rows in the group's order: the same in every layer, so the layers of a kind share one graph
        if not all(_owns_its_memory(w) for w in weights):
            return "apart: the weights share memory with others (fusing would keep a second copy)"
        fused, how = torch.cat([lin.weight.detach() for lin in linears]), "copy"
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    group, lo = FusedGroup(fused, bias), 0
    for lin in linears:
        hi = lo + lin.weight.shape[0]
        if how == "copy":
            lin.weight = nn.Parameter(fused[lo:hi], requires_grad=False)
        setattr(lin, _FUSED, group)
        lin._dflash_rows = (lo, hi)
        lin.forward = types.MethodType(_fused_forward, lin)
        lo = hi
    return how


def fuse_projections(model: nn.Module) -> dict[str, int]:
    """Fuse every sibling group of `model` (see GROUPS); idempotent. Returns how many went which way."""
    outcome: dict[str, int] = {}
    neighbours = Neighbours(model)
    for module in model.modules():
        for names in GROUPS:
            linears = [lin for n in names if isinstance(lin := getattr(module, n, None), nn.Linear)]
            if len(linears) != len(names):
                continue
            done = all(hasattr(lin, _FUSED) for lin in linears)
            how = "already fused" if done else fuse_group(linears, neighbours)
            if hasattr(linears[0], _FUSED):
                neighbours.pinned.update(id(lin.weight) for lin in linears)
            outcome[how] = outcome.get(how, 0) + 1
    if outcome:
        log.info("target projections fused for the compiled forward: %s",
                 ", ".join(f"{n} {how}" for how, n in sorted(outcome.items())))  # fmt: skip
    return outcome


# Functional, deterministic aten ops whose repeated calls on the same arguments give the same tensor: a
# matmul and the views around it (F.linear on a 3-D input is view, permute, mm, view after decomposition).
_PURE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.t.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default,
}


def _key(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    return value


class DeduplicateMatmuls(CustomGraphPass):
    """Inductor post-grad pass: the same matmul (or view) of the same arguments computed once. A subclass of
    CustomGraphPass, so that inductor's FX graph cache keys on it (a warm restart still hits the cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[object, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _PURE:
                continue
            key = (node.target, _key(node.args), _key(node.kwargs))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> bytes:
        return hashlib.sha256(inspect.getsource(DeduplicateMatmuls).encode()).digest()


DEDUPLICATE_MATMULS = DeduplicateMatmuls()


def fused_compile_options(model: nn.Module, backend: object = "inductor") -> dict[str, object] | None:
    """Fuse `model`'s projections and return torch.compile's `options` that merge their matmuls; under another
    backend than inductor, nothing is fused (without the pass each projection would run its group's GEMM)."""
    if backend != "inductor":
        return None
    fuse_projections(model)
    return {"post_grad_custom_pre_pass": DEDUPLICATE_MATMULS}
