"""The walk's drafter over a fixed buffer (what its CUDA graph replays) against the drafter over the context
as it grows: the same guesses, with sliding and full layers, across prompts that leave stale features in the
buffer past the context."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_trainer.evaluation.draft_runner import DraftRunner, cast_linear_weights, draft_block
from dflash_trainer.method.mask import block_attention_mask
from dflash_trainer.model.drafter import SLIDING, DFlashDrafter

MAX_CONTEXT = 40


@pytest.fixture
def parts(small_spec):
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec).eval()
    with torch.no_grad():  # spread logits: guesses that do not hang on the last bit of a sum
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    embed = nn.Embedding(small_spec.vocab_size, small_spec.hidden_size)
    head = nn.Linear(small_spec.hidden_size, small_spec.vocab_size, bias=False)
    return drafter, embed, head


def _features(n: int, spec, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randn(1, n, len(spec.target_layer_ids) * spec.hidden_size, generator=g).to(device)


def _steps(
    runner: DraftRunner, drafter, embed, head, prompt_len: int, kept: list[int], g, device="cpu"
) -> int:
    """One prompt's walk of the drafter: the runner's guesses against draft_block over the grown context."""
    spec = drafter.spec
    context = _features(prompt_len, spec, g, device)
    runner.start(context)
    checked = 0
    for k in kept:
        block = torch.randint(0, spec.vocab_size, (1, spec.block_size), generator=g).to(device)
        want = draft_block(drafter, embed, head, context, block)
        assert torch.equal(runner.guesses(block), want), (runner.kind, context.shape[1])
        more = _features(k, spec, g, device)
        context = torch.cat([context, more], dim=1)
        runner.extend(more)
        checked += 1
    return checked


@torch.no_grad()
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_guesses_over_the_buffer_equal_guesses_over_the_context(parts, kind: str, bf16: bool) -> None:
    drafter, embed, head = parts
    spec = drafter.spec
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        runner = DraftRunner(
            drafter, embed, head, kind=kind, max_context=MAX_CONTEXT, block_size=spec.block_size
        )
        g = torch.Generator().manual_seed(1)
        # The longer prompt first: the second one's buffer holds its features past its own context.
        assert _steps(runner, drafter, embed, head, 12, [1, 4, 2, 4, 3, 1], g) == 6
        assert _steps(runner, drafter, embed, head, 5, [4, 1, 3], g) == 3
    assert runner.kind == kind


@torch.no_grad()
@torch.no_grad()
def test_weights_cast_once_give_autocasts_outputs(parts) -> None:
    """Under bf16 autocast the runner holds the linear weights cast once (a capture would recast them at
    every replay): the drafter's hidden states are bitwise autocast's, and the norms keep fp32 weights."""
    drafter, embed, head = parts
    spec = drafter.spec
    g = torch.Generator().manual_seed(6)
    context, n = _features(9, spec, g), spec.block_size
    block = embed(torch.randint(0, spec.vocab_size, (1, n), generator=g))
    positions = torch.arange(9 + n)[None]
    anchors, valid = torch.tensor([[9]]), torch.ones(1, 1, dtype=torch.bool)
    masks = {
        t: block_attention_mask(anchors, valid, 9, n, 6 if t == SLIDING else None) for t in spec.layer_types
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner = DraftRunner(drafter, embed, head, kind="static", max_context=MAX_CONTEXT, block_size=n)
        cast = runner._forward(context, block, positions, masks)
        plain = drafter(context, block, positions, masks)
        assert all(w.dtype == torch.bfloat16 and w.dim() == 2 for w in runner._weights.values())
        assert len(runner._weights) == 7 * spec.num_layers + 1  # q k v o, gate up down; fc
        assert torch.equal(cast, plain)
        assert not DraftRunner(drafter, embed, head, kind="dynamic", max_context=8, block_size=n)._weights
    assert not DraftRunner(drafter, embed, head, kind="static", max_context=8, block_size=n)._weights  # fp32


@torch.no_grad()
def test_a_kept_runner_reads_the_drafters_new_weights_in_place(parts) -> None:
    """A runner kept for the next walk casts the drafter's weights as they are now into the tensors it holds
    (a kept graph reads them there), and guesses as the drafter does with them."""
    drafter, embed, head = parts
    spec = drafter.spec
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner = DraftRunner(
            drafter, embed, head, kind="static", max_context=MAX_CONTEXT, block_size=spec.block_size
        )
        held = {name: w.data_ptr() for name, w in runner._weights.items()}
        for p in drafter.parameters():
            p.mul_(-1.5)  # in place, as an optimizer step or the leader's broadcast
        runner.refresh_weights()
        assert {name: w.data_ptr() for name, w in runner._weights.items()} == held
        now = cast_linear_weights(drafter)
        assert now.keys() == held.keys()
        assert all(torch.equal(runner._weights[name], w) for name, w in now.items())
        assert _steps(runner, drafter, embed, head, 12, [1, 4, 2], torch.Generator().manual_seed(7)) == 3


@torch.no_grad()
def test_a_shorter_block_runs_over_the_context(parts) -> None:
    """A prompt's last block is shorter: its slots see each other, so it is not padded into the buffer's
    forward."""
    drafter, embed, head = parts
    spec = drafter.spec
    runner = DraftRunner(
        drafter, embed, head, kind="static", max_context=MAX_CONTEXT, block_size=spec.block_size
    )
    g = torch.Generator().manual_seed(2)
    context = _features(9, spec, g)
    runner.start(context)
    block = torch.randint(0, spec.vocab_size, (1, 2), generator=g)
    assert torch.equal(runner.guesses(block), draft_block(drafter, embed, head, context, block))


def test_a_context_past_the_buffer_is_named(parts) -> None:
    drafter, embed, head = parts
    spec = drafter.spec
    runner = DraftRunner(drafter, embed, head, kind="static", max_context=10, block_size=spec.block_size)
    g = torch.Generator().manual_seed(3)
    runner.start(_features(8, spec, g))
    with pytest.raises(ValueError, match="context of 11 tokens past the drafter's 10"):
        runner.extend(_features(3, spec, g))


@torch.no_grad()
def test_a_graph_that_fails_to_capture_leaves_the_drafter_static(parts, monkeypatch, caplog) -> None:
    """A capture error costs the drafter its graph, not its guesses: it goes on over the buffer and says so
    once."""
    drafter, embed, head = parts
    spec = drafter.spec
    runner = DraftRunner(
        drafter, embed, head, kind="graph", max_context=MAX_CONTEXT, block_size=spec.block_size
    )
    assert runner.kind == "static"  # no CUDA here
    runner.kind = "graph"  # what CUDA would have chosen

    def failing_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("dflash_trainer.evaluation.cuda_graph.capture", failing_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    g = torch.Generator().manual_seed(4)
    with caplog.at_level("WARNING"):
        assert _steps(runner, drafter, embed, head, 6, [2, 4, 1, 3], g) == 4
    assert runner.kind == "static"
    failures = [r for r in caplog.records if "drafter's CUDA graph failed to capture" in r.getMessage()]
    assert len(failures) == 1, failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_graph_replays_equal_guesses_over_the_context_on_cuda(parts) -> None:
    drafter, embed, head = (m.cuda() for m in parts)
    spec = drafter.spec
    runner = DraftRunner(
        drafter, embed, head, kind="graph", max_context=MAX_CONTEXT, block_size=spec.block_size
    )
    g = torch.Generator().manual_seed(5)
    # The first full block runs eagerly (kernels, autotune), the second captures, the rest replay.
    assert _steps(runner, drafter, embed, head, 12, [1, 4, 2, 4, 3, 1], g, "cuda") == 6
    assert _steps(runner, drafter, embed, head, 5, [4, 1, 3], g, "cuda") == 3
    assert runner.kind == "graph" and runner._graphed.captured
