import torch

from dflash_trainer.method.acceptance import accepted_run, anchor_accept


def test_run_stops_at_first_mismatch_and_ignores_slot_zero() -> None:
    target = torch.tensor([[[9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [9, 1, 2, 3, 4]]])
    draft = torch.tensor([[[0, 1, 2, 0, 4], [0, 5, 2, 3, 4], [0, 1, 2, 3, 4]]])
    assert accepted_run(draft, target).tolist() == [[2, 0, 4]]
    valid = torch.tensor([[True, True, True]])
    assert anchor_accept(draft, target, valid) == (3 + 1 + 5) / 3


def test_invalid_blocks_do_not_count() -> None:
    target = torch.tensor([[[9, 1, 2], [9, 1, 2]]])
    draft = torch.tensor([[[0, 1, 2], [0, 0, 0]]])
    assert anchor_accept(draft, target, torch.tensor([[True, False]])) == 3.0
    assert anchor_accept(draft, target, torch.tensor([[False, False]])) == 0.0
