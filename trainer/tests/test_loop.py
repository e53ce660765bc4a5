"""The training loop on a tiny target on CPU: flag combinations, exact resume, stop, EMA, evaluation."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_config

from dflash_trainer.checkpoint import list_checkpoints, load_checkpoint
from dflash_trainer.config import TrainConfig, load_config
from dflash_trainer.data.synth import synth_shards
from dflash_trainer.model.tiny import TINY_MASK_TOKEN_ID
from dflash_trainer.train.loop import Run, train
from dflash_trainer.train.trainer import lr_factor


@pytest.fixture(scope="module")
def shards(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    synth_shards(
        tiny_target("qwen3_5"), out, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID
    )
    return out


def make_config(tmp_path: Path, target: Path, shards: Path, **train: object) -> TrainConfig:
    keys = {"max_steps": 20, "checkpoint_every": 10, "ema_every": 3, "keep_last": 2} | train
    path = tiny_run_config(
        tmp_path / "train.toml",
        target,
        shards,
        data={"held_out": 4, "shuffle_window": 5},
        optim={"lr": 3e-3},
        train={"checkpoint_dir": tmp_path / "ckpt", **keys},
    )
    return load_config(path)


def test_lr_schedule_warms_up_then_decays():
    f = [lr_factor(s, total=100, warmup=4, schedule="cosine", min_ratio=0.1) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(f[4:])) and f[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize(
    ("checkpointing", "compile_"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_flag_combinations_train(tmp_path, tiny_target, shards, checkpointing, compile_):
    # aot_eager: the same Dynamo capture and AOT autograd (where checkpointing and compile meet) without
    # inductor's C++ build, which costs ~35 s on 2 cores; inductor runs on the GPU machine.
    cfg = make_config(
        tmp_path,
        tiny_target("qwen3_5"),
        shards,
        max_steps=2,
        gradient_checkpointing=checkpointing,
        compile=compile_,
        compile_backend="aot_eager",
    )
    seen = []
    result = train(cfg, hooks=[seen.append], on_ready=lambda: seen.append("ready"))
    assert seen[0] == "ready" and [m.step for m in seen[1:]] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m.loss)) and m.grad_norm > 0 for m in seen[1:])
    assert result.checkpoint is not None and result.checkpoint.name == "step-00000002"


def test_resume_is_exact(tmp_path, tiny_target, shards):
    target = tiny_target("qwen3_5")
    straight = train(make_config(tmp_path / "a", target, shards))
    assert straight.step == 20

    cfg = make_config(tmp_path / "b", target, shards)
    assert train(cfg, max_steps=10).step == 10
    # Fresh objects, as a new process builds them; they find the step-10 checkpoint and go on.
    resumed = train(cfg)
    assert resumed.step == 20

    a, a_ema = load_checkpoint(straight.checkpoint)
    b, b_ema = load_checkpoint(resumed.checkpoint)
    for name, tensor in a["trainer"]["drafter"].items():
        assert torch.equal(tensor, b["trainer"]["drafter"][name]), name
    for name, tensor in a_ema["shadow"].items():
        assert torch.equal(tensor, b_ema["shadow"][name]), name
    assert a["data"] == b["data"]
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "ckpt")] == ["step-00000010", "step-00000020"]


def test_stop_event_saves_and_returns(tmp_path, tiny_target, shards):
    stop = threading.Event()

    def stop_at_3(m):
        if m.step == 3:
            stop.set()

    result = train(make_config(tmp_path, tiny_target("qwen3_5"), shards), hooks=[stop_at_3], stop=stop)
    assert result.stopped and result.step == 3 and result.checkpoint.name == "step-00000003"


def test_ema_follows_the_weights_on_the_cpu(tmp_path, tiny_target, shards):
    run = Run(make_config(tmp_path, tiny_target("qwen3_5"), shards, ema_decay=0.5))
    start = {k: v.clone() for k, v in run.ema.weights().items()}
    for _ in range(3):
        run.train_step()
    shadow = run.ema.weights()
    name = "fc.weight"
    live = dict(run.drafter.named_parameters())[name].detach()
    assert shadow[name].device.type == "cpu" and shadow[name].dtype == torch.float32
    # One update at step 3 with decay 0.5: halfway between the start and the weights of step 3.
    assert torch.allclose(shadow[name], 0.5 * start[name] + 0.5 * live)
    assert run.ema.num_updates == 1


def test_evaluation_reports_acceptance(tmp_path, tiny_target, shards):
    cfg = make_config(tmp_path, tiny_target("qwen3_5"), shards, eval_walk_prompts=2, eval_walk_new_tokens=6)
    run = Run(cfg)
    figures = run.evaluate()
    timed = {"walk_tok_s", "walk_s"}
    again = run.evaluate()
    # fixed anchors and prompts: the same blocks and the same walk each time
    assert {k: v for k, v in figures.items() if k not in timed} == {
        k: v for k, v in again.items() if k not in timed
    }
    assert 1.0 <= figures["anchor_accept"] <= 4.0 and 1.0 <= figures["walk_tau"] <= 4.0
    assert figures["walk_steps"] >= 2 * 6 / 4 and figures["walk_s"] > 0
    assert (
        set(figures)
        == {"loss", "anchor_accept", "acc_1", "acc_2", "acc_3"}
        | {"walk_tau", "walk_tau_pooled", "walk_steps"}
        | timed
    )
