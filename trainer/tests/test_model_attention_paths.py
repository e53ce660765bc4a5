"""The block-sparse FlexAttention path against the reference (masked SDPA over the Bool block mask).

PyTorch has no FlexAttention backward on CPU, so here the mask rule is compared element by element, the tile
sparsity is checked to cover every visible pair, and drafter outputs are compared; the gradient test runs
where CUDA is (and the drafter benchmark repeats the check on the GPU it measures).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_trainer.method.mask import block_attention_mask, visible_key_intervals
from dflash_trainer.model.attention import block_mask_mod, flex_block_mask
from dflash_trainer.model.drafter import DFlashDrafter

CTX_LEN = 21  # not a multiple of any tile
# Second sequence: two padding blocks (anchor 0, invalid) and close anchors.
ANCHORS = torch.tensor([[3, 9, 14, 17], [2, 5, 0, 0]])
VALID = torch.tensor([[True, True, True, True], [True, True, False, False]])
BLOCK = 4


def _reference(window: int | None) -> torch.Tensor:
    return block_attention_mask(ANCHORS, VALID, CTX_LEN, BLOCK, window)


@pytest.mark.parametrize("window", [None, 6, 3, 1])  # 3 and 1 are shorter than the block
def test_mask_mod_equals_reference_mask(window: int | None) -> None:
    batch, num = ANCHORS.shape
    n = num * BLOCK
    mod = block_mask_mod(ANCHORS, VALID, CTX_LEN, BLOCK, window)
    ours = create_mask(mod, batch, 1, n, CTX_LEN + n, device="cpu")[:, 0]
    assert torch.equal(ours, _reference(window))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("tile", [4, 8])
def test_block_mask_tiles_cover_every_visible_pair_and_skip_others(window: int | None, tile: int) -> None:
    ref = _reference(window)
    bm = flex_block_mask(ANCHORS, VALID, CTX_LEN, BLOCK, window, tile=tile)
    dense_tiles = bm.to_dense()[:, 0].bool()  # [B, q tiles, kv tiles], partial or full
    n, keys = ref.shape[1:]
    covered = dense_tiles.repeat_interleave(tile, 1).repeat_interleave(tile, 2)[:, :n, :keys]
    assert not (ref & ~covered).any(), "a visible pair lies in a skipped tile"
    # Every tile kept holds at least one visible pair: the kernel skips all the others.
    padded = torch.zeros(
        ref.shape[0], dense_tiles.shape[1] * tile, dense_tiles.shape[2] * tile, dtype=torch.bool
    )
    padded[:, :n, :keys] = ref
    per_tile = padded.unflatten(1, (-1, tile)).unflatten(3, (-1, tile)).any(dim=(2, 4))
    assert torch.equal(per_tile, dense_tiles)


def _inputs(spec, device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    context = torch.randn(2, CTX_LEN, 2 * spec.hidden_size, generator=gen)
    noise = torch.randn(2, ANCHORS.shape[1] * spec.block_size, spec.hidden_size, generator=gen)
    return (context.to(device, dtype), noise.to(device, dtype), ANCHORS.to(device), VALID.to(device))


def _drafter(spec, attention: str, device: str = "cpu") -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(spec, attention=attention).to(device)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [6, 3])
def test_flex_forward_equals_dense(small_spec, window: int) -> None:
    spec = dataclasses.replace(small_spec, sliding_window=window)
    assert spec.block_size == BLOCK
    inputs = _inputs(spec)
    with torch.no_grad():
        dense = _drafter(spec, "dense").eval().forward_blocks(*inputs)
        flex = _drafter(spec, "flex").eval().forward_blocks(*inputs)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_auto_is_dense_on_cpu(small_spec) -> None:
    from dflash_trainer.model.attention import resolve_impl

    assert DFlashDrafter(small_spec).attention == "auto"
    assert resolve_impl("auto", torch.device("cpu")) == "dense"
    assert resolve_impl("auto", torch.device("cuda")) == "flex"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on CPU")
@pytest.mark.parametrize("window", [6, 3])
def test_flex_outputs_and_gradients_equal_dense_on_cuda(small_spec, window: int) -> None:
    spec = dataclasses.replace(small_spec, sliding_window=window)
    inputs = _inputs(spec, "cuda")
    results = []
    for attention in ("dense", "flex"):
        drafter = _drafter(spec, attention, "cuda").train()
        out = drafter.forward_blocks(*inputs)
        (out * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
        results.append((out.detach(), grads))
    (dense, dense_grads), (flex, flex_grads) = results
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("window", [None, 6, 3, 1])
def test_visible_key_intervals_are_the_reference_mask_rows(window: int | None) -> None:
    ref = _reference(window)
    intervals = visible_key_intervals(ANCHORS, VALID, CTX_LEN, BLOCK, window)
    keys = torch.arange(ref.shape[2])
    lo_c, hi_c, lo_b, hi_b = (intervals[..., i, None] for i in range(4))
    rows = ((keys >= lo_c) & (keys < hi_c)) | ((keys >= lo_b) & (keys < hi_b))
    assert torch.equal(rows, ref)


def _random_layout(seed: int, batch: int, num: int, ctx_len: int):
    """Sorted anchors as sample_anchors makes them; the last sequence ends in three padding blocks."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, ctx_len, (batch, num), generator=gen).sort(dim=1).values
    valid = torch.ones(batch, num, dtype=torch.bool)
    valid[-1, -3:] = False
    return anchors, valid


@pytest.mark.parametrize(
    ("seed", "num", "block", "ctx_len", "window", "tile", "full_tiles"),
    [
        (0, 24, 16, 384, None, 128, True),  # aligned: every length a multiple of the tile
        (1, 24, 16, 384, 300, 128, False),  # rows of a tile spread wider than the window leaves whole
        (2, 13, 4, 70, None, 16, True),  # rows and keys end inside a tile
        (3, 13, 4, 70, 9, 16, False),  # a window shorter than the tile: no tile is full
        (4, 9, 8, 64, 2, 8, False),  # a window shorter than the block
        (5, 40, 16, 200, 90, 32, True),
    ],
)
def test_flex_block_mask_equals_create_block_mask(
    seed, num, block, ctx_len, window, tile, full_tiles
) -> None:
    """Same tensors as PyTorch's create_block_mask over the mask_mod: the kernel does the same work."""
    anchors, valid = _random_layout(seed, 2, num, ctx_len)
    n = num * block
    mod = block_mask_mod(anchors, valid, ctx_len, block, window)
    expected = create_block_mask(mod, 2, None, n, ctx_len + n, device="cpu", BLOCK_SIZE=tile)
    ours = flex_block_mask(anchors, valid, ctx_len, block, window, tile=tile)
    assert bool(expected.full_kv_num_blocks.sum() > 0) == full_tiles, "the case does not test what it says"
    assert ours.seq_lengths == expected.seq_lengths
    assert ours.BLOCK_SIZE == expected.BLOCK_SIZE
    names = (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    )
    for name in names:
        assert torch.equal(getattr(ours, name), getattr(expected, name)), name
