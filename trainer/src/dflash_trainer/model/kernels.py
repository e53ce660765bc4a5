"""Pick the linear-attention kernels of the hybrid targets per call, by device.

transformers binds the gated-delta-rule ops of Qwen3.5 and Qwen3-Next to flash-linear-attention at import
time whenever `fla` imports, and those Triton kernels fail on CPU tensors. Dispatching per call keeps the
FLA kernels on CUDA and falls back to transformers' torch implementation elsewhere (tests, CPU CI).

The Gated DeltaNet's depthwise causal convolution is bound to the `causal_conv1d` package when it imports
and to a torch `F.conv1d` otherwise (about 9 % of a 27B-shaped target forward on an H200). The trainer does
not pin `causal_conv1d` (a CUDA extension built per torch release); flash-linear-attention, which it pins,
ships a Triton one. On CUDA tensors that one runs instead, through `fla_causal_conv1d_fn`, which adapts
transformers' channels-first call to FLA's channels-last kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

_OPS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_CONV = "causal_conv1d_fn"
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


def _dispatcher(kernel: Callable[..., Any], torch_impl: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(first: Any, *args: Any, **kwargs: Any) -> Any:
        impl = kernel if first.is_cuda else torch_impl
        return impl(first, *args, **kwargs)

    setattr(dispatch, _MARK, True)
    dispatch.torch_impl = torch_impl  # type: ignore[attr-defined]  (tests compare the two paths)
    return dispatch


def _install(module: ModuleType) -> None:
    for name in _OPS:
        op = getattr(module, name)
        if getattr(op, _MARK, False):
            continue
        # The hub-kernel wrapper keeps transformers' own torch function as __wrapped__.
        setattr(module, name, _dispatcher(op, getattr(op, "__wrapped__", op)))
    conv = getattr(module, _CONV, None)
    if conv is not None and not getattr(conv, _MARK, False):
        # inspect.unwrap reaches transformers' own torch conv under the hub and fallback wrappers.
        setattr(module, _CONV, _dispatcher(fla_causal_conv1d_fn, inspect.unwrap(conv)))


def install_device_dispatch() -> None:
    """Idempotent; affects only the two hybrid modelling modules."""
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        _install(module)


def conv_backend(module: ModuleType = modeling_qwen3_5) -> str:
    """What a CUDA forward of the hybrid layers uses for the causal conv (logged once at load)."""
    conv = getattr(module, _CONV, None)
    return "flash-linear-attention (Triton)" if getattr(conv, _MARK, False) else "transformers' torch conv"
