"""Which target layers feed the drafter."""

from __future__ import annotations


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """K layers evenly spaced from 1 to L-3 (one layer: the middle).

    Same rounding as dflash's `build_target_layer_ids`, which serving uses when a config has no ids:
    64 layers and 5 draft layers give [1, 16, 31, 46, 61].
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise ValueError(f"a {num_target_layers}-layer target is too shallow for {num_draft_layers} features")
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
