import math

import pytest
import torch
import torch.nn.functional as F

from dflash_trainer.method.loss import LOSS_IMPLS, chunked_block_loss, gamma_for_block_size, position_weights


def test_gamma_table_and_override() -> None:
    assert [gamma_for_block_size(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    with pytest.raises(ValueError, match="block_size 12"):
        gamma_for_block_size(12)


def test_position_weights() -> None:
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert w[15].item() == pytest.approx(math.exp(-14 / 7))
    assert torch.all(w[2:] < w[1:-1])


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 12, 16, generator=gen, requires_grad=True)
    head = torch.randn(50, 16, generator=gen)
    labels = torch.randint(0, 50, (2, 12), generator=gen)
    weight = torch.rand(2, 12, generator=gen) * (torch.rand(2, 12, generator=gen) > 0.3)
    return hidden, head, labels, weight


@pytest.mark.parametrize("impl", LOSS_IMPLS)
@pytest.mark.parametrize("chunk", [1, 5, 7, 100])
def test_chunked_equals_unchunked_value_and_grad(chunk: int, impl: str) -> None:
    hidden, head, labels, weight = _case(0)
    ce = F.cross_entropy((hidden @ head.t()).flatten(0, 1), labels.flatten(), reduction="none")
    reference = (ce * weight.flatten()).sum() / weight.sum()
    (ref_grad,) = torch.autograd.grad(reference, hidden)

    loss, stats = chunked_block_loss(hidden, head, labels, weight, chunk, impl=impl)
    (grad,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, ref_grad)
    assert stats.num_tokens == int((weight > 0).sum())
    greedy = (hidden @ head.t()).argmax(-1)
    assert torch.equal(stats.predictions[weight > 0], greedy[weight > 0])
    assert (stats.predictions[weight == 0] == -1).all()


@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_ignored_labels_are_never_indexed(impl: str) -> None:
    hidden, head, labels, weight = _case(1)
    labels = torch.where(weight > 0, labels, -100)
    loss, _ = chunked_block_loss(hidden, head, labels, weight, 4, impl=impl)
    assert torch.isfinite(loss)


def test_an_ignored_label_with_weight_adds_no_loss_and_no_gradient_in_every_impl() -> None:
    hidden, head, labels, weight = _case(4)
    labels[0, :6] = -100  # supervised positions whose label is F.cross_entropy's ignore_index
    got = {}
    for impl in LOSS_IMPLS:
        loss, _ = chunked_block_loss(hidden, head, labels, weight, 5, impl=impl)
        (grad,) = torch.autograd.grad(loss, hidden)
        got[impl] = (loss, grad)
        assert torch.all(grad[0, :6] == 0)
    torch.testing.assert_close(got["fused"], got["checkpointed"])
    torch.testing.assert_close(got["fused-torch"], got["checkpointed"])


def test_fused_matches_checkpointed_under_bf16_autocast() -> None:
    """The trainer's precision: bf16 matmuls over fp32 logits. The fused loss computes the same gradient in
    another order (scaled before the bf16 matmul, by the upstream gradient after it): equal up to bf16."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 40, 64, generator=gen, requires_grad=True)
    head = torch.randn(300, 64, generator=gen) * 0.1
    labels = torch.randint(0, 300, (2, 40), generator=gen)
    weight = torch.rand(2, 40, generator=gen)
    got = {}
    for impl in LOSS_IMPLS:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = chunked_block_loss(hidden, head, labels, weight, 16, impl=impl)
        (grad,) = torch.autograd.grad(loss * 3.0, hidden)  # an upstream gradient other than 1
        got[impl] = (loss, grad, stats.predictions)
    for impl in ("fused", "fused-torch"):
        torch.testing.assert_close(got[impl][0], got["checkpointed"][0])
        torch.testing.assert_close(got[impl][1], got["checkpointed"][1], rtol=2e-2, atol=1e-4)
        assert torch.equal(got[impl][2], got["checkpointed"][2])


def test_a_head_that_trains_takes_the_checkpointed_path() -> None:
    hidden, head, labels, weight = _case(6)
    head.requires_grad_(True)
    loss, _ = chunked_block_loss(hidden, head, labels, weight, 4)  # fused asked, the head needs its gradient
    grad_head, _ = torch.autograd.grad(loss, (head, hidden))
    assert grad_head.abs().sum() > 0
    with pytest.raises(ValueError, match="one of fused, fused-torch, checkpointed"):
        chunked_block_loss(hidden, head, labels, weight, 4, impl="liger")


def test_no_supervised_position_gives_zero_with_graph() -> None:
    hidden, head, labels, _ = _case(2)
    loss, stats = chunked_block_loss(
        hidden, head, labels, torch.zeros(2, 12), 4
    )  # both impls: nothing to fuse
    loss.backward()
    assert loss.item() == 0.0 and stats.num_tokens == 0 and hidden.grad is not None
