"""Decode walk: real block speculative decoding on held-out prompts, the acceptance length serving sees.

Greedy, one prompt at a time, exactly the loop of dflash 0.1.0's `dflash_generate` (the method authors'
client): the drafter proposes a block [last token, B-1 guesses] from the target features of every token so
far, the target verifies the block in one forward with its KV cache, the longest matching run plus the
target's own next token is kept, and decoding advances by that length. tau is what dflash's benchmark prints
as "Average Acceptance length": per prompt the mean of tokens produced per target forward, then the mean
over prompts; the pooled mean (every step weighted alike) is reported too.

Lossless by construction: the target's cache is rolled back exactly after a rejection. Attention KV is cut
to the accepted length; the Gated DeltaNet layers of hybrid targets (Qwen3.5/3.6, Qwen3-Next) carry a
recurrent and a conv state that cannot be cut. Their states before the verify forward are kept, and the
forward's own inputs to each layer's conv and delta rule are recorded; the states after the accepted tokens
are then the conv window over the kept inputs and one delta-rule step over the accepted tokens from the kept
recurrent state (what serving engines do), not a second forward of the 27B target ("recorded"). "rerun"
restores the states and runs the accepted tokens through the whole target again: the same states, a second
forward per rejection. (dflash 0.1.0's crop rewinds only the conv state: on a hybrid target it leaks rejected
drafts into the recurrent state.)

The drafter is re-run over the whole context each step (no drafter KV cache): the same arithmetic as dflash's
cached drafter, and cheap next to the target's verify forward at evaluation lengths.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from dflash_trainer.method.mask import block_attention_mask
from dflash_trainer.model.drafter import SLIDING, DFlashDrafter
from dflash_trainer.model.kernels import DELTA_RULE_OPS

RECURRENT_OP = "torch_recurrent_gated_delta_rule"
Rollback = Literal["recorded", "rerun"]


@dataclass(frozen=True)
class WalkSettings:
    max_new_tokens: int = 128  # per prompt, as dflash_generate's max_new_tokens
    block_size: int | None = None  # None: the drafter's
    stop_token_ids: tuple[int, ...] = ()  # end a prompt's walk at these (as dflash_generate's stop_token_ids)
    # Called after every verify step with what the walk is doing (the service keeps systemd's watchdog fed and
    # the journal informed: on the reference target an evaluation's walk ran 375 s, past WatchdogSec=300).
    progress: Callable[[str], None] | None = field(default=None, compare=False)
    # How a hybrid target's Gated DeltaNet states are rolled back after a rejection (module docstring).
    rollback: Rollback = "recorded"


@dataclass
class PromptWalk:
    """One prompt: dflash_generate's `acceptance_lengths` (tokens produced per verify) and its output ids."""

    acceptance_lengths: list[int]
    output_ids: torch.Tensor  # Long[1, prompt + generated], as dflash_generate returns
    rejections: int  # verify steps in which a drafted token was rejected
    accepted_drafts: int  # drafted tokens the target accepted


@dataclass
class WalkResult:
    tau: float  # mean over prompts of each prompt's mean acceptance length (dflash's benchmark figure)
    tau_pooled: float  # mean over all verify steps of all prompts
    steps: int  # target verify forwards
    new_tokens: int  # tokens generated, the prefill's first token included
    accepted_drafts: int
    rejections: int
    seconds: float  # wall time of the whole walk, prefills included
    walks: list[PromptWalk] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "walk_tau": self.tau,
            "walk_tau_pooled": self.tau_pooled,
            "walk_tok_s": self.tokens_per_s,
            "walk_steps": float(self.steps),
            "walk_s": self.seconds,
        }


def stop_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The target's end-of-sequence ids from its generation config, as dflash's benchmark stops on them."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return ()
    return (ids,) if isinstance(ids, int) else tuple(ids)


def prompts_from_rows(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor, num: int, max_len: int
) -> list[torch.Tensor]:
    """Up to `num` prompts: each row's unsupervised prefix (its prompt), the last `max_len` tokens of it.

    Rows that start supervised (no prompt) are skipped.
    """
    prompts = []
    for ids, supervised, real in zip(input_ids, loss_mask.bool(), attention_mask.bool(), strict=True):
        first = int(supervised.nonzero()[0]) if supervised.any() else int(real.sum())
        if first == 0:
            continue
        prompts.append(ids[max(0, first - max_len) : first].clone())
        if len(prompts) == num:
            break
    return prompts


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


_recorder = _DeltaRuleRecorder()


class _TargetCache:
    """The target's DynamicCache with an exact rollback for attention and Gated DeltaNet layers."""

    def __init__(self, model: nn.Module, rollback: Rollback = "recorded") -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        layers = self.cache.layers
        if any(isinstance(layer, DynamicSlidingWindowLayer) for layer in layers):
            raise ValueError("the decode walk cannot roll back a sliding-window target cache")
        self.linear = [layer for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.attention = [layer for layer in layers if isinstance(layer, DynamicLayer)]
        self.length = 0
        self.rollback_mode = rollback
        self._saved: list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, bool]]] = []
        # The verify forward's inputs to each linear layer's conv (by layer) and delta rule (in layer order).
        self._conv_inputs: dict[int, torch.Tensor] = {}
        self._calls: list[_DeltaRuleCall] = []
        self._recording = False
        if rollback == "recorded":
            for layer in self.linear:  # this cache's own layers: an instance attribute shadows the method
                layer.update_conv_state = self._conv_recorder(  # type: ignore[method-assign]
                    layer, layer.update_conv_state
                )

    def _conv_recorder(self, layer: Any, update: Callable[..., Any]) -> Callable[..., Any]:
        def record(conv_states: torch.Tensor, state_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            if self._recording and state_idx == 0:
                self._conv_inputs[id(layer)] = conv_states
            return update(conv_states, state_idx, *args, **kwargs)

        return record

    def verify(self, block: torch.Tensor) -> Any:
        """The verify forward of a drafted block, with what a rollback needs kept (hybrid targets)."""
        if not self.linear:
            return self.forward(block)
        self.snapshot()
        if self.rollback_mode == "rerun":
            return self.forward(block)
        self._conv_inputs, self._calls = {}, []
        self._recording, _recorder.calls = True, self._calls
        try:
            return self.forward(block)
        finally:
            self._recording, _recorder.calls = False, None

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

    def snapshot(self) -> None:
        """Copies the fixed-size linear-attention states (cheap); attention KV is rolled back by cutting."""
        self._saved = [
            (
                {i: s.clone() for i, s in layer.conv_states.items() if s is not None},
                {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None},
                dict(layer.has_previous_state),
            )
            for layer in self.linear
        ]

    def _cut_attention(self, length: int) -> None:
        for layer in self.attention:
            if layer.is_initialized and layer.get_seq_length() > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def rollback(self, start: int, keep: int, tokens: torch.Tensor) -> None:
        """After a verify of `tokens` from position `start`: keep its first `keep` tokens, drop the rest."""
        if keep == tokens.shape[1]:
            return
        if not self.linear:
            self._cut_attention(start + keep)
            self.length = start + keep
            return
        if self._recorded_complete():
            self._cut_attention(start + keep)
            self._redo_linear_states(keep)
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


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    # dflash's extract_context_feature: entry i + 1 for layer i (the last entry is after the final norm).
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _draft(
    drafter: DFlashDrafter, embed: nn.Module, head: nn.Module, context: torch.Tensor, block: torch.Tensor
) -> torch.Tensor:
    """Greedy guesses for block slots 1..N-1: one block anchored after the whole context."""
    spec = drafter.spec
    ctx_len, n = context.shape[1], block.shape[1]
    device = context.device
    anchors = torch.tensor([[ctx_len]], device=device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    masks = {
        t: block_attention_mask(anchors, valid, ctx_len, n, spec.sliding_window if t == SLIDING else None)
        for t in set(spec.layer_types)
    }
    positions = torch.arange(ctx_len + n, device=device)[None]
    hidden = drafter(context, embed(block), positions, masks)
    return head(hidden[:, 1:]).argmax(dim=-1)


@torch.no_grad()
def walk_prompt(
    model: nn.Module, drafter: DFlashDrafter, prompt: torch.Tensor, settings: WalkSettings, *, label: str = ""
) -> PromptWalk:
    """dflash_generate (greedy) for one prompt Long[T] or Long[1, T]; returns its steps and output."""
    spec = drafter.spec
    block_size = settings.block_size or spec.block_size
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    device = embed.weight.device
    input_ids = prompt.reshape(1, -1).to(device)
    n_in = input_ids.shape[1]
    max_length = n_in + settings.max_new_tokens
    out = torch.full((1, max_length + 1), spec.mask_token_id, dtype=torch.long, device=device)
    stops = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)

    target = _TargetCache(model, settings.rollback)
    prefill = target.forward(input_ids, logits_to_keep=1)
    out[:, :n_in] = input_ids
    out[:, n_in] = prefill.logits[:, -1].argmax(dim=-1)
    context = _features(prefill.hidden_states, spec.target_layer_ids)

    lengths: list[int] = []
    rejections = accepted_drafts = 0
    start = n_in
    stopped = bool(torch.isin(out[:, start], stops).any())
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        block = out[:, start : start + size].clone()
        if size > 1:
            block[:, 1:] = _draft(drafter, embed, head, context, block)
        verify = target.verify(block)
        posterior = verify.logits.argmax(dim=-1)
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0])
        out[:, start : start + accepted + 1] = block[:, : accepted + 1]
        out[:, start + accepted + 1] = posterior[:, accepted]
        produced = min(accepted + 1, max_length - start - 1)
        if stops.numel():
            hit = torch.isin(out[0, start + 1 : start + produced + 1], stops).nonzero()
            if hit.numel():
                produced, stopped = int(hit[0]) + 1, True
        accepted_drafts += accepted
        rejections += int(accepted < size - 1)
        if start + produced + 1 < max_length and not stopped:  # the walk goes on from here
            target.rollback(start, produced, block)
        kept = _features(verify.hidden_states, spec.target_layer_ids)[:, :produced]
        context = torch.cat([context, kept], dim=1)
        start += produced
        lengths.append(produced)
        if settings.progress is not None:
            settings.progress(f"decode walk{label}: {start - n_in} of {settings.max_new_tokens} tokens")
    return PromptWalk(lengths, out[:, : min(start + 1, max_length)], rejections, accepted_drafts)


def _unwrap(module: nn.Module) -> DFlashDrafter:
    """The plain drafter under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while not isinstance(module, DFlashDrafter):
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"not a DFlash drafter: {type(module).__name__}")
        module = inner
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_walk(
    model: nn.Module, drafter: nn.Module, prompts: Sequence[torch.Tensor], settings: WalkSettings
) -> WalkResult:
    """Walks every prompt; `model` is the full causal LM (all layers and the LM head).

    The drafter is put in eval mode for the walk and back in its previous mode after. Runs in the caller's
    precision context.
    """
    if not prompts:
        raise ValueError("the decode walk needs at least one prompt")
    draft = _unwrap(drafter)
    # A training target is cut after its last captured layer (its config says so too); logits need them all.
    built, expected = len(model.model.layers), draft.spec.num_target_layers
    if built != expected:
        raise ValueError(
            f"the decode walk needs the whole target: {built} of {expected} layers built (load it full=True)"
        )
    was_training = draft.training
    draft.eval()
    device = model.get_input_embeddings().weight.device
    try:
        _sync(device)
        t0 = time.perf_counter()
        # Layers compiled in place for training (train.compile) would recompile for every context length.
        with torch.compiler.set_stance("force_eager"), _recorder.installed():
            walks = [
                walk_prompt(model, draft, p, settings, label=f" prompt {i} of {len(prompts)}")
                for i, p in enumerate(prompts, 1)
            ]
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        draft.train(was_training)
    new_tokens = [w.output_ids.shape[1] - p.numel() for w, p in zip(walks, prompts, strict=True)]
    return summarize(walks, new_tokens, seconds)


def summarize(walks: Sequence[PromptWalk], new_tokens: Sequence[int], seconds: float) -> WalkResult:
    """dflash's benchmark summary: tau = mean over prompts (with steps) of the per-prompt mean; pooled too."""
    per_prompt = [
        sum(w.acceptance_lengths) / len(w.acceptance_lengths) for w in walks if w.acceptance_lengths
    ]
    pooled = [n for w in walks for n in w.acceptance_lengths]
    return WalkResult(
        tau=sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
        tau_pooled=sum(pooled) / len(pooled) if pooled else 0.0,
        steps=len(pooled),
        new_tokens=sum(new_tokens),
        accepted_drafts=sum(w.accepted_drafts for w in walks),
        rejections=sum(w.rejections for w in walks),
        seconds=seconds,
        walks=list(walks),
    )
