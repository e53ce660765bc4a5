import torch

from dflash_trainer.method.mask import block_attention_mask


def test_context_before_anchor_own_block_only() -> None:
    anchors, valid = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    m = block_attention_mask(anchors, valid, ctx_len=8, block_size=3, sliding_window=None)[0].int()
    # keys: context 0..7, then block 0 (3 slots), block 1 (3 slots)
    expected = [
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
    assert m.tolist() == expected


def test_sliding_window_limits_context_per_query_position() -> None:
    anchors, valid = torch.tensor([[6]]), torch.tensor([[True]])
    m = block_attention_mask(anchors, valid, ctx_len=8, block_size=3, sliding_window=3)[0].int()
    # query positions 6, 7, 8 see context c < 6 with q - c < 3
    assert m[:, :8].tolist() == [
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert m[:, 8:].all()  # the block itself (window >= block size)


def test_invalid_block_sees_only_itself() -> None:
    anchors, valid = torch.tensor([[4, 0]]), torch.tensor([[True, False]])
    m = block_attention_mask(anchors, valid, ctx_len=8, block_size=2, sliding_window=None)[0]
    assert not m[2:, :8].any() and m[2:, 10:].all()
