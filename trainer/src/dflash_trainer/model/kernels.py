"""Pick the linear-attention kernels of the hybrid targets per call, by device.

transformers binds the gated-delta-rule ops of Qwen3.5 and Qwen3-Next to flash-linear-attention at import
time whenever `fla` imports, and those Triton kernels fail on CPU tensors. Dispatching per call keeps the
FLA kernels on CUDA and falls back to transformers' torch implementation elsewhere (tests, CPU CI).

The Gated DeltaNet's depthwise causal convolution is bound to the `causal_conv1d` package when it imports
and to a torch `F.conv1d` otherwise (about 9 % of a 27B-shaped target forward on an H200). The trainer does
not pin `causal_conv1d` (a CUDA extension built per torch release); flash-linear-attention, which it pins,
ships a Triton one. On CUDA tensors that one runs instead, through `fla_causal_conv1d_fn`, which adapts
transformers' channels-first call to FLA's channels-last kernel.

Qwen3.5's Gated DeltaNet repeats its query and key heads to the value heads (repeat_interleave) before the
delta rule, a copy of both in every layer; FLA's kernels take the grouped heads themselves (GVA, value head i
reads key head i // (HV // H): fla/ops/gated_delta_rule/chunk.py). `skip_qk_head_repeat` turns the layer's
repeat off and the dispatch repeats for transformers' torch implementation only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

# The linear-attention kernels' names in transformers' hybrid modelling modules (model.target and
# model.kernel_ops replace the same names for compiled layers).
CHUNK_OP = "torch_chunk_gated_delta_rule"
DELTA_RULE_OPS = (CHUNK_OP, "torch_recurrent_gated_delta_rule")
CONV_OP = "causal_conv1d_fn"
_MARK = "_dflash_device_dispatch"


def fla_causal_conv1d_fn(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **_: Any,
) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` contract ([B, D, T] in and out, weight [D, W]) on FLA's Triton conv.

    FLA's `causal_conv1d` takes [B, T, D] (fla/modules/causal_conv1d/ops.py) and returns (y, final_state);
    transformers hands the conv a transposed view of the q|k|v projection, so the transpose back is free.
    """
    from fla.modules.causal_conv1d import causal_conv1d

    y, _state = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return y.transpose(1, 2)


# Each runs before the first CUDA launch of a dispatch below, until one returns (service.probes_beside: the
# GPU probes' verdict, and their autotune results on disk before the rank's first FLA kernel looks for them).
_BEFORE_FIRST_LAUNCH: list[Callable[[], None]] = []


def hold_first_launch(wait: Callable[[], None]) -> None:
    """`wait` runs before this process's first FLA kernel launch; what it raises, that launch raises."""
    _BEFORE_FIRST_LAUNCH.append(wait)


def _first_launch() -> None:
    while _BEFORE_FIRST_LAUNCH:
        _BEFORE_FIRST_LAUNCH[0]()  # raised: still held, the next launch asks again
        _BEFORE_FIRST_LAUNCH.pop(0)


def _dispatcher(kernel: Callable[..., Any], torch_impl: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(first: Any, *args: Any, **kwargs: Any) -> Any:
        if first.is_cuda and _BEFORE_FIRST_LAUNCH:
            _first_launch()
        impl = kernel if first.is_cuda else torch_impl
        return impl(first, *args, **kwargs)

    return _marked(dispatch, torch_impl)


def _delta_rule_dispatcher(
    kernel: Callable[..., Any], torch_impl: Callable[..., Any], kernel_takes_groups: bool
) -> Callable[..., Any]:
    """(query, key, value, ...) with query/key heads possibly grouped: FLA takes them as they are;
    transformers' torch implementation (on CPU, or everywhere when FLA did not import) gets them repeated,
    as the layer would have repeated them."""

    def dispatch(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if query.is_cuda and _BEFORE_FIRST_LAUNCH:
            _first_launch()
        if query.is_cuda and kernel_takes_groups:
            return kernel(query, key, value, *args, **kwargs)
        groups = value.shape[2] // query.shape[2]
        if groups > 1:  # the repeat the layer skipped (skip_qk_head_repeat), exactly as it did it
            query, key = (t.repeat_interleave(groups, dim=2) for t in (query, key))
        return (kernel if query.is_cuda else torch_impl)(query, key, value, *args, **kwargs)

    return _marked(dispatch, torch_impl)


def _marked(dispatch: Callable[..., Any], torch_impl: Callable[..., Any]) -> Callable[..., Any]:
    setattr(dispatch, _MARK, True)
    dispatch.torch_impl = torch_impl  # type: ignore[attr-defined]  (tests compare the two paths)
    return dispatch


def _fla_imports() -> bool:
    """What transformers' hub wrapper decided at import: FLA's functions if `fla` imports, else its own."""
    try:
        importlib.import_module("fla")
    except Exception:  # any failure means transformers fell back, as it does
        return False
    return True


def _install(module: ModuleType) -> None:
    for name in DELTA_RULE_OPS:
        op = getattr(module, name)
        if getattr(op, _MARK, False):
            continue
        # The hub-kernel wrapper keeps transformers' own torch function as __wrapped__.
        setattr(module, name, _delta_rule_dispatcher(op, getattr(op, "__wrapped__", op), _fla_imports()))
    conv = getattr(module, CONV_OP, None)
    if conv is not None and not getattr(conv, _MARK, False):
        # inspect.unwrap reaches transformers' own torch conv under the hub and fallback wrappers.
        setattr(module, CONV_OP, _dispatcher(fla_causal_conv1d_fn, inspect.unwrap(conv)))


def install_device_dispatch() -> None:
    """Idempotent; affects only the two hybrid modelling modules."""
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        _install(module)


# Qwen3_5GatedDeltaNet (transformers 5.15-5.17) names num_k_heads five times: set in __init__, read for
# key_dim there, and in forward only in the repeat:
#   if self.num_v_heads // self.num_k_heads > 1: query = query.repeat_interleave(...); key = ...
# (the class source: the hub decorators wrap forward without functools.wraps).
_REPEAT_GUARD = "if self.num_v_heads // self.num_k_heads > 1:"
_NUM_K_HEADS_MENTIONS = 5


def grouped_heads_available() -> bool:
    """Whether `skip_qk_head_repeat` applies with this transformers (its layer source as expected and the
    device dispatch installed): the Qwen3.5 delta rule then runs on grouped query/key heads."""
    source = inspect.getsource(modeling_qwen3_5.Qwen3_5GatedDeltaNet)
    if source.count("num_k_heads") != _NUM_K_HEADS_MENTIONS or _REPEAT_GUARD not in source:
        return False
    return all(getattr(getattr(modeling_qwen3_5, name), _MARK, False) for name in DELTA_RULE_OPS)


def skip_qk_head_repeat(model: nn.Module) -> int:
    """Let each Qwen3.5 Gated DeltaNet layer of `model` hand grouped query/key heads to the delta rule (the
    dispatch repeats them for the torch implementation); returns how many layers changed.

    The layer decides with `num_v_heads // num_k_heads > 1`, and its forward reads num_k_heads only there,
    so the layer's num_k_heads is set to num_v_heads. A transformers whose forward reads it elsewhere (or does
    not install the dispatch) keeps its repeat: correct, only slower. Qwen3-Next also reads num_k_heads in
    its projection split, so it is left alone.
    """
    if not grouped_heads_available():
        return 0
    changed = 0
    for layer in model.modules():
        if isinstance(layer, modeling_qwen3_5.Qwen3_5GatedDeltaNet) and layer.num_v_heads > layer.num_k_heads:
            layer.num_k_heads = layer.num_v_heads
            changed += 1
    return changed


def conv_backend(module: ModuleType = modeling_qwen3_5) -> str:
    """What a CUDA forward of the hybrid layers uses for the causal conv (logged once at load)."""
    conv = getattr(module, CONV_OP, None)
    return "flash-linear-attention (Triton)" if getattr(conv, _MARK, False) else "transformers' torch conv"
