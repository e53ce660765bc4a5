"""The hybrid targets' linear-attention kernels as torch custom ops, so that a compiled layer runs them
without a graph break.

Dynamo traces FLA's Triton kernels badly (model.target: 10 graphs, 2.3x slower), and behind
torch.compiler.disable each Gated DeltaNet layer fell into five graphs: the break at the kernel call ends the
layer's graph at the attention module and compiles the module's forward as a frame of its own, cut again at
the causal conv and at the delta rule. Every graph is one more guard check and launch from the host (the
trainer's compiled target ran 29.4 ms of kernels in a 41.1 ms call that way, bound by the host;
docs/journal.md). As custom ops (torch.library.custom_op) the kernels stay opaque to dynamo and
inductor but sit inside one graph per layer, and the query, key and value they take are made contiguous in
that graph by inductor instead of eagerly by FLA's input guard.

The delta rule's op covers the training forward's calls: whole sequences, no state in or out, no packed
sequences; other calls (the decode walk's cached steps) go to the opaque function as before. The causal
conv is stateless, so every call takes its op. Each op runs the device dispatch of model.kernels (FLA on
CUDA, transformers' torch implementation elsewhere) of the modelling module it was installed for.

The query and key are L2-normalised in the graph, inside the copy that makes them contiguous for FLA, and FLA
gets them normalised (use_qk_l2norm_in_kernel=False): its two l2norm kernels a layer are gone, 12 launches
fewer per forward of the 27B-shaped slice at the same device time (344 against 353 us; docs/journal.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflash_trainer.model.kernels import CHUNK_OP, CONV_OP

# (modelling module name, kernel name) -> the device dispatch the op runs; filled by `traced`.
_DISPATCH: dict[tuple[str, str], Callable[..., Any]] = {}

# fla/modules/norm/l2norm.py and transformers' l2norm (modeling_qwen3_5) both use 1e-6.
L2NORM_EPS = 1e-6


# The stride order only: FLA's conv reads any strides. On CUDA inductor pads the fused in_proj GEMM's output
# rows (comprehensive padding: torch 2.11 does, 2.13 leaves it unpadded), and under the default for custom
# ops (needs_exact_strides) the q|k|v columns are copied out of it before every conv (182 us a 27B-shaped
# forward; docs/journal.md). Note: inductor's FX graph cache keys leave a custom op's tags out.
@torch.library.custom_op("dflash::causal_conv1d", mutates_args=(), tags=(torch.Tag.needs_fixed_stride_order,))
def causal_conv1d(
    module: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D], contiguous (FLA's layout; transformers' conv takes and gives [B, D, T])."""
    out = _DISPATCH[(module, CONV_OP)](x.transpose(1, 2), weight, bias, activation=activation)
    return out.transpose(1, 2).contiguous()


@causal_conv1d.register_fake
def _(module: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dflash::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(
    module: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
) -> torch.Tensor:
    """The delta rule over whole sequences, no initial or final state: [B, T, HV, V], contiguous."""
    out, _state = _DISPATCH[(module, CHUNK_OP)](
        query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
    )
    return out.contiguous()


@chunk_gated_delta_rule.register_fake
def _(module: str, query, key, value, g, beta, use_qk_l2norm_in_kernel: bool):
    return torch.empty_like(value, memory_format=torch.contiguous_format)


def l2norm(x: Tensor) -> Tensor:
    """FLA's l2norm_fwd over the last dimension: in fp32, x / sqrt(sum(x^2) + eps), back in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def traced(
    module: str, name: str, dispatch: Callable[..., Any], opaque: Callable[..., Any]
) -> Callable[..., Any]:
    """What the modelling module calls under `name` in compiled layers: the custom op for the training
    forward's calls, `opaque` (the dispatch behind torch.compiler.disable) for any other."""
    _DISPATCH[(module, name)] = dispatch
    if name == CONV_OP:
        # The layers hand the conv and the delta rule their own **kwargs (position ids and the like), which
        # neither the FLA kernels nor transformers' torch functions read.
        def conv(
            hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
            **_kwargs: Any,
        ) -> Tensor:  # fmt: skip
            op = torch.ops.dflash.causal_conv1d
            return op(module, hidden_states.transpose(1, 2), weight, bias, activation).transpose(1, 2)

        return conv
    if name == CHUNK_OP:

        def chunk(
            query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
            initial_state: Tensor | None = None, output_final_state: bool = False,
            use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None, **kwargs: Any,
        ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
            if initial_state is not None or output_final_state or cu_seqlens is not None:
                return opaque(
                    query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    cu_seqlens=cu_seqlens, **kwargs,
                )  # fmt: skip
            op = torch.ops.dflash.chunk_gated_delta_rule
            if use_qk_l2norm_in_kernel:  # fused by inductor into the copy below
                query, key = l2norm(query), l2norm(key)
            q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
            return op(module, q, k, v, g, beta, False), None

        return chunk
    return opaque
