"""The decode walk's target side: prefill, the verify forward of a drafted block, and an exact rollback.

Rollback. Attention KV is cut to the accepted length; the Gated DeltaNet layers of hybrid targets
(Qwen3.5/3.6, Qwen3-Next) carry a recurrent and a conv state that cannot be cut. Their states before the
verify forward are kept, and the forward's own inputs to each layer's conv and delta rule are recorded; the
states after the accepted tokens are then the conv window over the kept inputs and one delta-rule step over
the accepted tokens from the kept recurrent state (what serving engines do), not a second forward of the
target ("recorded"). "rerun" restores the states and runs the accepted tokens through the whole target again:
the same states, a second forward per rejection. (dflash 0.1.0's crop rewinds only the conv state: on a hybrid
target it leaks rejected drafts into the recurrent state.)

Cache kinds. "dynamic": transformers' DynamicCache, the attention KV grows by concatenation. "static": a
StaticCache of the walk's longest prompt plus its new tokens, reused for every prompt; the verify forward gets
its positions and its attention mask (a query attends to the cache up to its own position) from fixed buffers.
"graph": the static verify forward of a whole block captured once in a CUDA graph and replayed: a verify step
of an eager 64-layer target is bound by its host (about 2 ms of Python and launches per layer; the device
needs a fraction of that), a replay is not. A verify of a shorter block (a prompt's last) and the prefill run
eagerly over the same cache. The graph needs SDPA attention (the mask is SDPA's boolean form) and a target
without routed experts (their dispatch reads the router's choice on the host); others walk "dynamic".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from dflash_trainer.evaluation.cuda_graph import Graphed
from dflash_trainer.model.kernels import DELTA_RULE_OPS

RECURRENT_OP = "torch_recurrent_gated_delta_rule"
Rollback = Literal["recorded", "rerun"]
CacheKind = Literal["graph", "static", "dynamic"]
FULL_ATTENTION = "full_attention"


@dataclass
class _DeltaRuleCall:
    """One layer's delta rule in a verify forward: its inputs, and the module's recurrent form to redo it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    recurrent: Callable[..., Any]


class _DeltaRuleRecorder:
    """Records every delta-rule call of the hybrid modelling modules while `calls` is a list (in call order:
    the order of the layers). Installed for a walk, removed after it."""

    def __init__(self) -> None:
        self.calls: list[_DeltaRuleCall] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from transformers.models.qwen3_5 import modeling_qwen3_5
        from transformers.models.qwen3_next import modeling_qwen3_next

        patched = []
        for module in (modeling_qwen3_5, modeling_qwen3_next):
            recurrent = getattr(module, RECURRENT_OP, None)
            for name in DELTA_RULE_OPS:
                fn = getattr(module, name, None)
                if fn is not None and recurrent is not None:
                    patched.append((module, name, fn))
                    setattr(module, name, self._recording(fn, recurrent))
        try:
            yield
        finally:
            for module, name, fn in reversed(patched):
                setattr(module, name, fn)

    def _recording(self, fn: Callable[..., Any], recurrent: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # the device dispatch's marks (its __dict__) stay readable
        def record(*args: Any, **kwargs: Any) -> Any:
            if self.calls is not None:
                self.calls.append(_DeltaRuleCall(args, kwargs, recurrent))
            return fn(*args, **kwargs)

        return record


recorder = _DeltaRuleRecorder()


def graph_refusal(model: nn.Module) -> str | None:
    """Why the verify forward of `model` cannot run over a static cache and a CUDA graph; None when it can."""
    config: Any = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention {getattr(config, '_attn_implementation', None)!r} is not sdpa"
    if getattr(config, "num_experts", 0):
        return "routed experts"
    return None


@dataclass
class _VerifyOutput:
    """What the walk reads of a verify forward (the graph's static tensors: read before the next replay)."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


def _first(out: _VerifyOutput, size: int) -> _VerifyOutput:
    """The verify output of a block's first `size` positions (views)."""
    if out.logits.shape[1] == size:
        return out
    return _VerifyOutput(out.logits[:, :size], tuple(h[:, :size] for h in out.hidden_states))


class TargetCache:
    """The target's KV cache for one walk (every prompt in turn) with an exact rollback for attention and
    Gated DeltaNet layers."""

    def __init__(
        self,
        model: nn.Module,
        rollback: Rollback = "recorded",
        *,
        kind: CacheKind = "dynamic",
        max_len: int = 0,
        block_size: int = 0,
    ) -> None:
        lm: Any = model  # a transformers causal LM (typed loosely: nn.Module hides its methods)
        self.model = lm
        self.config: Any = self.model.config
        self.rollback_mode = rollback
        device = self.model.get_input_embeddings().weight.device
        if kind != "dynamic" and (graph_refusal(model) is not None or max_len < 1 or block_size < 1):
            kind = "dynamic"
        if kind == "graph" and device.type != "cuda":
            kind = "static"
        self.kind: CacheKind = kind
        self.block_size = block_size
        self.length = 0
        self._saved: list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, bool]]] = []
        # The verify forward's inputs to each linear layer's conv (by layer) and delta rule (in layer order).
        self._conv_inputs: dict[int, torch.Tensor] = {}
        self._calls: list[_DeltaRuleCall] = []
        self._recording = False
        self._graphed = Graphed(self._run_buffers, "the verify forward", "this walk goes on without graphs")
        self._verified = 0  # tokens the last verify forward ran (a padded block's included)
        self._redo_graphs: dict[int, Graphed[None]] = {}  # the recorded rollback by kept length
        self._redo_graphed = True  # until a rollback graph fails to capture
        if kind == "dynamic":
            self._new_cache(DynamicCache(config=self.config))
            return
        self._new_cache(StaticCache(config=self.config, max_cache_len=max_len))
        # The static verify's inputs: token ids, positions and the attention mask, filled before each verify.
        self._ids = torch.zeros(1, block_size, dtype=torch.long, device=device)
        self._positions = torch.zeros(1, block_size, dtype=torch.long, device=device)
        self._offsets = torch.arange(block_size, device=device)
        self._kv_index = torch.arange(max_len, device=device)
        self._mask = torch.zeros(1, 1, block_size, max_len, dtype=torch.bool, device=device)
        types = getattr(self.config, "layer_types", None) or [FULL_ATTENTION]
        self._masks = {t: (self._mask if t == FULL_ATTENTION else None) for t in set(types)}

    def close(self) -> None:
        """Releases the walk's CUDA graphs (the verify's and each rollback's)."""
        self._graphed.release()
        for redo in self._redo_graphs.values():
            redo.release()
        self._redo_graphs.clear()

    def _new_cache(self, cache: DynamicCache | StaticCache) -> None:
        self.cache = cache
        self._saved = []  # the snapshot's buffers, made at this cache's first verify
        self._redo_graphs.clear()
        layers = cache.layers
        if any(isinstance(layer, DynamicSlidingWindowLayer | StaticSlidingWindowLayer) for layer in layers):
            raise ValueError("the decode walk cannot roll back a sliding-window target cache")
        linear, attention = LinearAttentionCacheLayerMixin, DynamicLayer | StaticLayer
        self.linear: list[Any] = [layer for layer in layers if isinstance(layer, linear)]
        self.attention: list[Any] = [layer for layer in layers if isinstance(layer, attention)]
        if self.rollback_mode == "recorded":
            for layer in self.linear:  # this cache's own layers: an instance attribute shadows the method
                layer.update_conv_state = self._conv_recorder(layer, layer.update_conv_state)

    def _conv_recorder(self, layer: Any, update: Callable[..., Any]) -> Callable[..., Any]:
        def record(conv_states: torch.Tensor, state_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            if self._recording and state_idx == 0:
                self._conv_inputs[id(layer)] = conv_states
            return update(conv_states, state_idx, *args, **kwargs)

        return record

    def prefill(self, ids: torch.Tensor) -> Any:
        """A new prompt: the cache emptied, then the prompt's forward (its last token's logits)."""
        if self.kind == "dynamic":
            if self.length:
                self._new_cache(DynamicCache(config=self.config))
        else:
            self.cache.reset()
        self.length = 0
        return self.forward(ids, logits_to_keep=1)

    def verify(self, block: torch.Tensor) -> Any:
        """The verify forward of a drafted block, with what a rollback needs kept (hybrid targets).

        Over a static cache a shorter block (a prompt's last) is padded to the block size: every layer is
        causal, so its own positions' logits and features are those of the short forward; the padding's
        cache entries are dropped by the rollback like a rejected draft's."""
        size = block.shape[1]
        static = self.kind != "dynamic" and size <= self.block_size
        if static and size < self.block_size:
            block = torch.nn.functional.pad(block, (0, self.block_size - size))
        self._verified = block.shape[1]
        if self.linear:
            self.snapshot()
        # The recorded rollback's inputs are recorded at an eager run and at the capture; each replay
        # refreshes the tensors its capture recorded.
        records = bool(self.linear) and self.rollback_mode == "recorded"
        recording = self._recorded if records else contextlib.nullcontext
        if not static:
            with recording():
                out = self.forward(block)
        else:
            self._fill(block)
            if self.kind == "graph":
                out = self._graphed(recording)
                if self._graphed.failed:  # said once in the log; the walk goes on over the static cache
                    self.kind = "static"
            else:
                with recording():
                    out = self._run_buffers()
            self.length += block.shape[1]
        return _first(_VerifyOutput(out.logits, tuple(out.hidden_states)), size)

    @contextlib.contextmanager
    def _recorded(self) -> Iterator[None]:
        """Records the forward run inside (each linear layer's conv input and delta-rule call), in place of
        the last forward's."""
        self._conv_inputs, self._calls = {}, []
        self._recording, recorder.calls = True, self._calls
        try:
            yield
        finally:
            self._recording, recorder.calls = False, None

    def forward(self, ids: torch.Tensor, *, logits_to_keep: int = 0, features: bool = True) -> Any:
        out = self.model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=features,
            logits_to_keep=logits_to_keep,
        )
        self.length += ids.shape[1]
        return out

    def _fill(self, block: torch.Tensor) -> None:
        """The static verify's inputs for `block` at the cache's current length."""
        self._ids.copy_(block)
        torch.add(self._offsets, self.length, out=self._positions[0])
        torch.le(self._kv_index[None, :], self._positions[0, :, None], out=self._mask[0, 0])

    def _run_buffers(self) -> Any:
        return self.model(
            input_ids=self._ids,
            position_ids=self._positions,
            attention_mask=self._masks,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )

    def snapshot(self) -> None:
        """Copies the fixed-size linear-attention states (cheap); attention KV is rolled back by cutting. The
        copies keep their buffers from one verify to the next (a rollback graph reads them in place)."""
        if not self._saved:  # this cache's first verify
            self._saved = [
                (
                    {i: torch.empty_like(s) for i, s in layer.conv_states.items() if s is not None},
                    {i: torch.empty_like(s) for i, s in layer.recurrent_states.items() if s is not None},
                    {},
                )
                for layer in self.linear
            ]
        # One launch per dtype for every state (about 100 for the 27B target: 0.7 ms of host time a step one
        # by one); foreach's fused kernel needs one dtype a call, else it copies one by one.
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for layer, (conv, rec, prev) in zip(self.linear, self._saved, strict=True):
            pairs = [(s, layer.conv_states[i]) for i, s in conv.items()]
            pairs += [(s, layer.recurrent_states[i]) for i, s in rec.items()]
            for saved, live in pairs:
                lists = by_dtype.setdefault(saved.dtype, ([], []))
                lists[0].append(saved)
                lists[1].append(live)
            prev.clear()
            prev.update(layer.has_previous_state)
        for saved_states, live_states in by_dtype.values():
            torch._foreach_copy_(saved_states, live_states)

    def _cut_attention(self, length: int) -> None:
        for layer in self.attention:
            if not layer.is_initialized:
                continue
            static = isinstance(layer, StaticLayer)  # (no narrowing: its write position is a tensor)
            if static:  # positions past `length` are masked and overwritten later
                layer.cumulative_length.fill_(length)
            elif layer.get_seq_length() > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def rollback(self, start: int, keep: int, tokens: torch.Tensor) -> None:
        """After a verify of `tokens` from position `start`: keep its first `keep` tokens, drop the rest."""
        if keep == self._verified:
            return
        if not self.linear:
            self._cut_attention(start + keep)
            self.length = start + keep
            return
        if self._recorded_complete():
            self._cut_attention(start + keep)
            self._redo(keep)
            self.length = start + keep
            return
        # A recurrent state after `keep` of the block's tokens never existed: restore the state before the
        # block and run the kept tokens again.
        self._cut_attention(start)
        for layer, (conv, rec, prev) in zip(self.linear, self._saved, strict=True):
            for i, s in conv.items():
                layer.conv_states[i].copy_(s)
            for i, s in rec.items():
                layer.recurrent_states[i].copy_(s)
            layer.has_previous_state.update(prev)
        self.length = start
        self.forward(tokens[:, :keep], logits_to_keep=1, features=False)

    def _recorded_complete(self) -> bool:
        """Whether the verify forward recorded one conv input and one delta-rule call per linear layer with
        a single state each (else the rollback runs the tokens again: exact, a forward slower)."""
        return (
            self.rollback_mode == "recorded"
            and len(self._calls) == len(self.linear)
            and all(id(layer) in self._conv_inputs for layer in self.linear)
            and all(len(conv) == 1 and len(rec) == 1 for conv, rec, _prev in self._saved)
        )

    def _redo(self, keep: int) -> None:
        """The recorded rollback; after a graphed verify, from one CUDA graph per kept length (its first
        time eagerly: FLA's recurrent kernel compiles then). Its inputs (the verify graph's recorded
        tensors, the snapshot buffers) and outputs (the cache's states) keep their addresses."""
        if not self._graphed.captured or not self._redo_graphed:
            self._redo_linear_states(keep)
            return
        redo = self._redo_graphs.get(keep)
        if redo is None:
            redo = self._redo_graphs[keep] = Graphed(
                functools.partial(self._redo_linear_states, keep),
                "the rollback",
                "this walk rolls back without graphs",
            )
        redo()
        self._redo_graphed = not redo.failed  # the verify graph stays either way

    def _redo_linear_states(self, keep: int) -> None:
        """Each linear layer's states after the block's first `keep` tokens, from its states before the block
        and the verify forward's own inputs: the conv window over the kept inputs, and the delta rule's
        recurrent form over the kept tokens from the kept recurrent state."""
        for layer, (conv, rec, _prev), call in zip(self.linear, self._saved, self._calls, strict=True):
            before = conv[0]
            window = torch.cat([before, self._conv_inputs[id(layer)][..., :keep]], dim=-1)
            conv_state, recurrent_state = layer.conv_states[0], layer.recurrent_states[0]
            assert conv_state is not None and recurrent_state is not None  # a verify forward filled them
            conv_state.copy_(window[..., -before.shape[-1] :])
            query, key, value = call.args[:3]
            kw = call.kwargs
            _out, state = call.recurrent(
                query[:, :keep],
                key[:, :keep],
                value[:, :keep],
                g=kw["g"][:, :keep],
                beta=kw["beta"][:, :keep],
                initial_state=rec[0],
                output_final_state=True,
                use_qk_l2norm_in_kernel=kw.get("use_qk_l2norm_in_kernel", False),
            )
            recurrent_state.copy_(state)
