import torch

from dflash_trainer.method.anchors import eligible_anchors, sample_anchors


def _mask() -> torch.Tensor:
    m = torch.zeros(3, 32, dtype=torch.bool)
    m[0, 10:32] = True  # prompt 0..9, response to the end
    m[1, 5:20] = True  # response 5..19, then padding
    return m  # row 2: nothing supervised


def test_eligible_positions() -> None:
    ok = eligible_anchors(_mask(), block_size=4)
    assert ok[0].nonzero().squeeze(1).tolist() == list(range(9, 29))  # a+1 supervised, a+4 <= 32
    assert ok[1].nonzero().squeeze(1).tolist() == list(range(4, 19))
    assert not ok[2].any()


def test_samples_are_distinct_sorted_eligible_and_capped() -> None:
    mask = _mask()
    ok = eligible_anchors(mask, 4)
    anchors, valid = sample_anchors(mask, 8, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 8)
    assert valid.sum(dim=1).tolist() == [8, 8, 0]
    for row in range(3):
        picked = anchors[row][valid[row]]
        assert ok[row, picked].all()
        assert picked.tolist() == sorted(set(picked.tolist()))


def test_fewer_eligible_than_max() -> None:
    anchors, valid = sample_anchors(_mask(), 100, 4, torch.Generator().manual_seed(0))
    assert valid.sum(dim=1).tolist() == [20, 15, 0]
    assert anchors[0][valid[0]].tolist() == list(range(9, 29))


def test_fresh_each_call_and_reproducible_from_seed() -> None:
    gen = torch.Generator().manual_seed(1)
    first, _ = sample_anchors(_mask(), 4, 4, gen)
    second, _ = sample_anchors(_mask(), 4, 4, gen)
    again, _ = sample_anchors(_mask(), 4, 4, torch.Generator().manual_seed(1))
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


def test_nothing_eligible_keeps_shape() -> None:
    anchors, valid = sample_anchors(torch.zeros(2, 8, dtype=torch.bool), 4, 4, torch.Generator())
    assert anchors.shape == (2, 1) and not valid.any()
