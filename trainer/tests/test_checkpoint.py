"""Checkpoints: atomic directories, keep-last-K, RNG states restored exactly, safe loading."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dflash_trainer.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_name,
    step_of_name,
)


def draws(generator: torch.Generator) -> tuple:
    return (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(1)),
        float(torch.rand(1, generator=generator)),
    )


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    generator = torch.Generator().manual_seed(7)
    path = save_checkpoint(tmp_path, 1, {"rng": rng_state(generator)}, {}, keep_last=1)
    expected = draws(generator)
    state, _ = load_checkpoint(path)  # weights_only=True: nothing but tensors and plain containers
    set_rng_state(state["rng"], generator)
    assert draws(generator) == expected


def test_keeps_the_last_k_and_ignores_half_written_ones(tmp_path):
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, step, {"step": step}, {"x": torch.ones(2) * step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000015", "step-00000020"]
    (tmp_path / ".tmp-step-00000025-999").mkdir()  # a save that died before its rename
    assert latest_checkpoint(tmp_path).name == "step-00000020"
    state, ema = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == {"step": 20} and torch.equal(ema["x"], torch.full((2,), 20.0))
    save_checkpoint(tmp_path, 25, {"step": 25}, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000025"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, {"v": 1}, {}, keep_last=3)
    save_checkpoint(tmp_path, 3, {"v": 2}, {}, keep_last=3)
    assert load_checkpoint(latest_checkpoint(tmp_path), ema=False) == ({"v": 2}, None)
    assert latest_checkpoint(tmp_path / "none") is None


def test_a_checkpoint_name_gives_back_its_step_and_anything_else_is_refused():
    assert step_of_name(step_name(12)) == 12
    for name in (".tmp-step-00000012-4242", "step-12", "ema.pt"):
        with pytest.raises(ValueError, match="not a checkpoint name"):
            step_of_name(name)
