"""The real workload through the pipeline: a tiny target on a target rank, the DFlash drafter under DDP on two
drafter ranks, data from synthetic shards, checkpoint written by the leading drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_config

from dflash_trainer.checkpoint import list_checkpoints, load_checkpoint
from dflash_trainer.distributed.local import spawn_local
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID

pytestmark = pytest.mark.system


def test_tiny_dflash_one_target_two_drafters(tiny_target, tmp_path: Path) -> None:
    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=1, rows=16, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    config = tiny_run_config(
        tmp_path / "train.toml",
        target,
        shards,
        train={"max_steps": 4, "checkpoint_dir": tmp_path / "ckpt", "checkpoint_every": 100},
        topology={"targets": 1, "drafters": 2},
    )
    out = tmp_path / "metrics.json"
    spawn_local([str(config), "--metrics-out", str(out)], 3, preload=["dflash_trainer.train.loop"])

    ranks = sorted(json.loads(out.read_text())["ranks"], key=lambda r: r["rank"])
    assert [(r["role"], r["items"]) for r in ranks] == [("target", 8), ("drafter", 4), ("drafter", 4)]
    d1, d2 = ranks[1]["extra"], ranks[2]["extra"]
    assert d1["param_sum"] == d2["param_sum"]  # DDP through forward_blocks kept the replicas identical
    assert torch.isfinite(torch.tensor([d1["loss"], d2["loss"]])).all()
    [ckpt] = list_checkpoints(tmp_path / "ckpt")
    state, _ = load_checkpoint(ckpt)
    assert state["trainer"]["step"] == 4 and state["position"]["next_item"] == 8
