"""Checkpoints carry across topologies: one process, 1:1, 2:1 and 1:2 (gloo on CPU, tiny target).

One process is the 1:1 pipeline in-process, and a run's items, anchors and learning rate do not depend on the
number of target ranks: a run that goes one process -> 1:1 -> 2:1 ends bit-exact with a run that never
stopped. A change of the drafter count resumes from the same state and goes on at the same data position.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_config

from dflash_trainer.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from dflash_trainer.config import load_config
from dflash_trainer.data.shards import ShardReader, list_shards, split_held_out
from dflash_trainer.distributed.local import spawn_local
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID
from dflash_trainer.train.loop import train

pytestmark = pytest.mark.system
STEPS = 12
PRELOAD = ["dflash_trainer.train.loop", "dflash_trainer.model.target"]


def config(tmp_path: Path, name: str, target: Path, shards: Path) -> Path:
    return tiny_run_config(
        tmp_path / f"{name}.toml",
        target,
        shards,
        data={"held_out": 4, "shuffle_window": 5},
        optim={"lr": 3e-3},
        train={
            "max_steps": STEPS,
            "checkpoint_dir": tmp_path / name,
            "checkpoint_every": 4,
            "ema_every": 2,
            "eval_every": 4,
        },
    )


def pipeline(cfg: Path, targets: int, drafters: int, *extra: str) -> dict:
    out = cfg.with_suffix(f".{targets}x{drafters}.json")
    argv = [str(cfg), "--resume", "--cpu", "--targets", str(targets), "--drafters", str(drafters)]
    spawn_local(
        [*argv, "--metrics-out", str(out), *extra],
        targets + drafters,
        env={"OMP_NUM_THREADS": "1"},
        preload=PRELOAD,
    )
    return json.loads(out.read_text())


def assert_same(a: Path, b: Path) -> None:
    (sa, ea), (sb, eb) = load_checkpoint(a), load_checkpoint(b)
    for name, tensor in sa["trainer"]["drafter"].items():
        assert torch.equal(tensor, sb["trainer"]["drafter"][name]), name
    for name, tensor in ea["shadow"].items():
        assert torch.equal(tensor, eb["shadow"][name]), name
    for key, state in sa["trainer"]["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], sb["trainer"]["optimizer"]["state"][key]["exp_avg_sq"])
    assert sa["data"] == sb["data"] and ea["num_updates"] == eb["num_updates"]


def test_checkpoints_carry_across_topologies(tiny_target, tmp_path: Path) -> None:
    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)

    straight = train(load_config(config(tmp_path, "a", target, shards)))
    assert straight.step == STEPS

    # One process to step 4, the 1:1 pipeline to step 8, then 2 targets and 1 drafter to the end.
    b = config(tmp_path, "b", target, shards)
    assert train(load_config(b), max_steps=4).step == 4
    one_one = pipeline(b, 1, 1, "--max-steps", "8")
    leader = next(r for r in one_one["ranks"] if r["role"] == "drafter")["extra"]
    assert leader["steps"] == 8 and set(leader["eval"]) >= {
        "loss",
        "anchor_accept",
        "walk_tau",
    }  # from target 0
    assert [p.name for p in list_checkpoints(tmp_path / "b")][-2:] == ["step-00000004", "step-00000008"]
    pipeline(b, 2, 1)
    assert_same(straight.checkpoint, latest_checkpoint(tmp_path / "b"))

    # From step 8 with two drafters: the same state, then two items a step from item 8 on.
    c = config(tmp_path, "c", target, shards)
    (tmp_path / "c").mkdir()
    shutil.copytree(tmp_path / "b" / "step-00000008", tmp_path / "c" / "step-00000008")
    ranks = pipeline(c, 1, 2)["ranks"]
    drafters = [r["extra"] for r in ranks if r["role"] == "drafter"]
    assert len({d["param_sum"] for d in drafters}) == 1  # both replicas loaded the checkpoint
    state, ema = load_checkpoint(latest_checkpoint(tmp_path / "c"))
    assert state["trainer"]["step"] == STEPS and ema["num_updates"] == STEPS // 2
    assert state["position"] == {
        "step": STEPS, "next_item": 8 + 2 * 4, "rows": 16 * 2, "drafters": 2, "horizon": [STEPS, "steps"],
    }  # fmt: skip
    cfg = load_config(c)
    train_segments, _ = split_held_out(list_shards(shards), cfg.data.held_out)
    reader = ShardReader(train_segments, seed=0, shuffle_window=5)
    assert state["data"] == reader.state_at(16 * 2)

    # And back to one process: it resumes the 1:2 checkpoint and its state is the 1:2 run's.
    resumed = train(cfg)
    assert resumed.step == STEPS and not resumed.stopped
