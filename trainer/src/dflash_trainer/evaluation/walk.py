"""Decode walk: real block speculative decoding on held-out prompts, the acceptance length serving sees.

Greedy, one prompt at a time, exactly the loop of dflash 0.1.0's `dflash_generate` (the method authors'
client): the drafter proposes a block [last token, B-1 guesses] from the target features of every token so
far, the target verifies the block in one forward with its KV cache, the longest matching run plus the
target's own next token is kept, and decoding advances by that length. tau is what dflash's benchmark prints
as "Average Acceptance length": per prompt the mean of tokens produced per target forward, then the mean
over prompts; the pooled mean (every step weighted alike) is reported too.

Lossless by construction: the target's cache is rolled back exactly after a rejection, and on CUDA the verify
forward of a whole block is replayed from a CUDA graph over a static cache (evaluation/target_cache.py).

The drafter is re-run over the whole context each step (no drafter KV cache): the same arithmetic as dflash's
client; on CUDA from a CUDA graph over a buffer of the walk's longest context (evaluation/draft_runner.py).

A walk builds its target cache and drafter runner, and their graphs, and releases them at its end; a
`KeptWalk` keeps them for the next walk of the same target, drafter, settings and longest context (the
trainer's evaluations walk the same held-out prompts each time), which then replays from its first verify
step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_trainer.evaluation.draft_runner import DraftRunner
from dflash_trainer.evaluation.target_cache import CacheKind, Rollback, TargetCache, recorder
from dflash_trainer.model.drafter import DFlashDrafter


@dataclass(frozen=True)
class WalkSettings:
    max_new_tokens: int = 128  # per prompt, as dflash_generate's max_new_tokens
    block_size: int | None = None  # None: the drafter's
    stop_token_ids: tuple[int, ...] = ()  # end a prompt's walk at these (as dflash_generate's stop_token_ids)
    # Called after every verify step with what the walk is doing (the service keeps systemd's watchdog fed and
    # the journal informed: on the reference target an evaluation's walk ran 375 s, past WatchdogSec=300).
    progress: Callable[[str], None] | None = field(default=None, compare=False)
    # How a hybrid target's Gated DeltaNet states are rolled back after a rejection (target_cache.py).
    rollback: Rollback = "recorded"
    # The target's cache and verify forward, and the drafter's context: "graph" (CUDA graphs over static
    # buffers; "static" off CUDA), "static" or "dynamic" (target_cache.py, draft_runner.py).
    cache: CacheKind = "graph"
    # The drafter's kind when it differs from `cache` (bench_walk compares them); None: `cache`'s.
    draft: CacheKind | None = None


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
    cache: str = "dynamic"  # the target cache the walk ran on (a CacheKind)

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


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    # dflash's extract_context_feature: entry i + 1 for layer i (the last entry is after the final norm).
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def walk_prompt(
    target: TargetCache,
    drafter: DraftRunner,
    prompt: torch.Tensor,
    settings: WalkSettings,
    *,
    label: str = "",
) -> PromptWalk:
    """dflash_generate (greedy) for one prompt Long[T] or Long[1, T]; returns its steps and output."""
    spec = drafter.drafter.spec
    block_size = settings.block_size or spec.block_size
    device = target.model.get_input_embeddings().weight.device
    input_ids = prompt.reshape(1, -1).to(device)
    n_in = input_ids.shape[1]
    max_length = n_in + settings.max_new_tokens
    out = torch.full((1, max_length + 1), spec.mask_token_id, dtype=torch.long, device=device)
    stops = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)

    prefill = target.prefill(input_ids)
    out[:, :n_in] = input_ids
    out[:, n_in] = prefill.logits[:, -1].argmax(dim=-1)
    drafter.start(_features(prefill.hidden_states, spec.target_layer_ids))

    lengths: list[int] = []
    rejections = accepted_drafts = 0
    start = n_in
    stopped = bool(torch.isin(out[:, start], stops).any())
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        block = out[:, start : start + size].clone()
        if size > 1:
            block[:, 1:] = drafter.guesses(block)
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
        drafter.extend(_features(verify.hidden_states, spec.target_layer_ids)[:, :produced])
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


def _attention_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """SDPA without cuDNN on CUDA: cuDNN builds an execution plan for every new KV length, which the walk's
    growing context hits at every eager call (3.0 ms of host time per call on an H200,
    docs/benchmarks.md#decode-walk); the memory-efficient kernel takes the verify's mask without one."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


@dataclass(frozen=True)
class WalkParts:
    """What a walk's target cache and drafter runner are built for; equal parts can serve the same walk."""

    model: nn.Module  # compared by identity, as nn.Module is
    drafter: DFlashDrafter
    settings: WalkSettings  # progress is not compared
    max_len: int  # the longest prompt, its new tokens and a block: the static buffers' length
    block_size: int
    # The caller's autocast (enabled, dtype) on the walk's device: the drafter's weights are cast to it.
    autocast: tuple[bool, torch.dtype]

    def build(self) -> tuple[TargetCache, DraftRunner]:
        s = self.settings
        target = TargetCache(
            self.model, s.rollback, kind=s.cache, max_len=self.max_len, block_size=self.block_size
        )
        embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
        kind = s.draft or s.cache
        runner = DraftRunner(
            self.drafter, embed, head, kind=kind, max_context=self.max_len, block_size=self.block_size
        )
        return target, runner


class KeptWalk:
    """One walk's target cache and drafter runner, with their CUDA graphs, kept for the next walk with equal
    `WalkParts`: that walk replays from its first verify step instead of running it
    eagerly and capturing again. The drafter's weights are read afresh at each walk (it trains in between).
    The graphs' memory stays held between walks; `close()` gives it back."""

    def __init__(self) -> None:
        self._built_for: WalkParts | None = None
        self._parts: tuple[TargetCache, DraftRunner] | None = None

    def parts_for(self, parts: WalkParts) -> tuple[TargetCache, DraftRunner]:
        """The kept cache and runner when they were built for `parts`, else new ones (the old released)."""
        if self._parts is None or self._built_for != parts:
            self.close()
            self._parts, self._built_for = parts.build(), parts
        else:
            self._parts[1].refresh_weights()
        return self._parts

    def close(self) -> None:
        if self._parts is not None:
            target, runner = self._parts
            self._parts = self._built_for = None
            target.close()
            runner.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_walk(
    model: nn.Module,
    drafter: nn.Module,
    prompts: Sequence[torch.Tensor],
    settings: WalkSettings,
    keep: KeptWalk | None = None,
) -> WalkResult:
    """Walks every prompt; `model` is the full causal LM (all layers and the LM head). With `keep`, the
    walk's cache, drafter runner and graphs are the kept ones when they fit, and are kept for the next walk.

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
        block_size = settings.block_size or draft.spec.block_size
        max_len = max(p.numel() for p in prompts) + settings.max_new_tokens + block_size
        kept = keep if keep is not None else KeptWalk()
        precision = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
        target, runner = kept.parts_for(WalkParts(model, draft, settings, max_len, block_size, precision))
        walked = False
        # Layers compiled in place for training (train.compile) would recompile for every context length.
        try:
            with torch.compiler.set_stance("force_eager"), recorder.installed(), _attention_backends(device):
                walks = [
                    walk_prompt(target, runner, p, settings, label=f" prompt {i} of {len(prompts)}")
                    for i, p in enumerate(prompts, 1)
                ]
            walked = True
        finally:  # the graphs now, for training's memory, unless kept; a walk that failed halfway is not kept
            if keep is None or not walked:
                kept.close()
        kind = target.kind
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        draft.train(was_training)
    new_tokens = [w.output_ids.shape[1] - p.numel() for w, p in zip(walks, prompts, strict=True)]
    result = summarize(walks, new_tokens, seconds)
    result.cache = kind
    return result


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
