"""`dflash-train launch -- serve` of an N:M configuration, end to end on CPU: the launcher starts a 1:1
pipeline (tiny target, synthetic shards, gloo); READY/STATUS/WATCHDOG arrive from the drafter leader on a fake
NOTIFY_SOCKET; SIGTERM mid-run saves at the reached step and every process exits 0; the resumed run ends with
exactly the weights, EMA and optimizer state of a run that was never stopped; one tracker writer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_config

from dflash_trainer.checkpoint import latest_checkpoint, load_checkpoint
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID

pytestmark = pytest.mark.system

STEPS = 30


def write_config(path: Path, target: Path, shards: Path, checkpoints: Path, **extra: dict) -> Path:
    return tiny_run_config(
        path,
        target,
        shards,
        data={"shuffle_window": 5},
        optim={"lr": 3e-3},
        train={"max_steps": STEPS, "checkpoint_dir": checkpoints, "checkpoint_every": 100, "ema_every": 3},
        topology={"targets": 1, "drafters": 1},
        service={"status_every": 1},
        **extra,
    )


def serve(config: Path, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash_trainer.service", "launch", "--nproc-per-node", "2", "--", "serve"]
    environ = os.environ | {"OMP_NUM_THREADS": "1"} | env
    return subprocess.Popen(
        [*cmd, str(config)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def test_serve_pipeline_notifies_stops_and_resumes_exactly(tiny_target, tmp_path: Path) -> None:
    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    straight_cfg = write_config(tmp_path / "a.toml", target, shards, tmp_path / "a")
    board = tmp_path / "tensorboard"
    stopped_cfg = write_config(
        tmp_path / "b.toml", target, shards, tmp_path / "b", trackers={"tensorboard": board}
    )
    straight = serve(straight_cfg)  # runs while the stopped run below starts (two cores)

    # The stopped run, with a fake systemd notify socket.
    sock_path = str(tmp_path / "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(sock_path)
    server.settimeout(1.0)
    proc = serve(stopped_cfg, NOTIFY_SOCKET=sock_path, WATCHDOG_USEC="3000000")
    messages: list[str] = []
    sent_at = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            messages.append(server.recv(4096).decode())
        except TimeoutError:
            continue
        if sent_at is None and any(m.startswith("STATUS=step 3 ") for m in messages):
            proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to every rank
            sent_at = time.time()
    assert sent_at is not None, "no STATUS=step 3 arrived:\n" + "\n".join(messages)
    log = finish(proc, timeout=120)
    stop_s = time.time() - sent_at
    server.close()

    assert [m for m in messages if m.startswith("READY=1")] == ["READY=1\nSTATUS=loaded; training"]
    assert "WATCHDOG=1" in messages
    assert any(m.startswith("STOPPING=1") for m in messages)
    statuses = [m for m in messages if m.startswith("STATUS=step ")]
    assert statuses[0].startswith("STATUS=step 1 loss ") and " tok/s lr " in statuses[0]
    reached = load_checkpoint(latest_checkpoint(tmp_path / "b"))[0]
    step = reached["trainer"]["step"]
    assert 3 <= step < STEPS and reached["position"]["next_item"] == step, log
    assert f"stopped at step {step}; checkpoint {tmp_path / 'b'}/step-{step:08d}" in log
    assert "all 2 rank(s) stopped cleanly" in log
    assert stop_s < 30, f"{stop_s:.1f} s from SIGTERM to exit"
    print(f"stopped at step {step}, {stop_s:.1f} s after SIGTERM")

    resumed_log = finish(serve(stopped_cfg))
    assert f"resumed from {tmp_path / 'b'}/step-{step:08d} (step {step})" in resumed_log
    assert f"finished at step {STEPS}; checkpoint {tmp_path / 'b'}/step-{STEPS:08d}" in resumed_log
    finish(straight)

    a, a_ema = load_checkpoint(latest_checkpoint(tmp_path / "a"))
    b, b_ema = load_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert a["trainer"]["step"] == b["trainer"]["step"] == STEPS
    assert a["position"] == b["position"] and a["data"] == b["data"]
    for name, tensor in a["trainer"]["drafter"].items():
        assert torch.equal(tensor, b["trainer"]["drafter"][name]), name
    for name, tensor in a_ema["shadow"].items():
        assert torch.equal(tensor, b_ema["shadow"][name]), name
    assert a_ema["num_updates"] == b_ema["num_updates"]
    assert len(list(board.glob("events.out.tfevents.*"))) == 2  # one writer (the leader) per start
    for key, state in a["trainer"]["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], b["trainer"]["optimizer"]["state"][key]["exp_avg_sq"])
