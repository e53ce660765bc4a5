"""Pick the linear-attention kernels of the hybrid targets per call, by device.

transformers binds the gated-delta-rule ops of Qwen3.5 and Qwen3-Next to flash-linear-attention at import
time whenever `fla` imports, and those Triton kernels fail on CPU tensors. Dispatching per call keeps the
FLA kernels on CUDA and falls back to transformers' torch implementation elsewhere (tests, CPU CI).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

_OPS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_MARK = "_dflash_device_dispatch"


def _dispatcher(kernel: Callable[..., Any], torch_impl: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(query: Any, *args: Any, **kwargs: Any) -> Any:
        impl = kernel if query.is_cuda else torch_impl
        return impl(query, *args, **kwargs)

    setattr(dispatch, _MARK, True)
    return dispatch


def _install(module: ModuleType) -> None:
    for name in _OPS:
        op = getattr(module, name)
        if getattr(op, _MARK, False):
            continue
        # The hub-kernel wrapper keeps transformers' own torch function as __wrapped__.
        setattr(module, name, _dispatcher(op, getattr(op, "__wrapped__", op)))


def install_device_dispatch() -> None:
    """Idempotent; affects only the two hybrid modelling modules."""
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        _install(module)
