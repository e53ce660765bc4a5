import torch

from dflash_trainer.method.blocks import IGNORE_INDEX, block_input_ids, block_labels, block_positions

IDS = torch.arange(100, 120)[None]  # token at position p is 100 + p
MASK_ID = 7


def test_block_inputs_are_anchor_then_masks() -> None:
    anchors, valid = torch.tensor([[3, 10]]), torch.tensor([[True, False]])
    ids = block_input_ids(IDS, anchors, valid, 4, MASK_ID)
    assert ids.tolist() == [[103, 7, 7, 7, 7, 7, 7, 7]]
    assert block_positions(anchors, 4).tolist() == [[3, 4, 5, 6, 10, 11, 12, 13]]


def test_slot_k_predicts_token_at_anchor_plus_k() -> None:
    # Off by one in either direction (anchor+k-1 or anchor+k+1) trains a drafter that serves garbage.
    anchors, valid = torch.tensor([[3, 10]]), torch.tensor([[True, True]])
    labels, weight = block_labels(IDS, anchors, valid, 4, torch.ones_like(IDS, dtype=torch.bool))
    assert labels.tolist() == [[IGNORE_INDEX, 104, 105, 106, IGNORE_INDEX, 111, 112, 113]]
    assert weight.tolist() == [[0, 1, 1, 1, 0, 1, 1, 1]]


def test_unsupervised_past_end_and_invalid_carry_no_weight() -> None:
    loss_mask = torch.ones_like(IDS, dtype=torch.bool)
    loss_mask[0, 5] = False
    anchors, valid = torch.tensor([[3, 17, 8]]), torch.tensor([[True, True, False]])
    labels, weight = block_labels(IDS, anchors, valid, 4, loss_mask)
    assert weight.tolist() == [[0, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert labels[0, 2].item() == IGNORE_INDEX  # position 5 unsupervised
    assert labels[0, 7].item() == IGNORE_INDEX  # position 20 is past the sequence
