"""The GPU rehearsal's driver, run end to end on the CPU with a tiny target of the reference's structure.

The same sequence scripts/gpu_rehearsal.sh runs on a GPU machine: model random, preflight, launch -- serve
with a pause and SIGTERM (a checkpoint, exit 0), a resume to the end, export and export --check, the smoke
report; READY, STATUS and WATCHDOG arrive on the driver's notify socket as they would at systemd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRAINER_SRC = Path(__file__).resolve().parents[1] / "src"  # the side-by-side run's "before": the same

SMALL = {
    "drafter.mask_token_id": "511",
    "drafter.block_size": "4",
    "drafter.gamma": "4.0",
    "drafter.num_layers": "2",
    "drafter.layer_types": '["sliding_attention", "full_attention"]',
    "drafter.sliding_window": "16",
    "drafter.num_attention_heads": "4",
    "drafter.num_key_value_heads": "2",
    "drafter.head_dim": "16",
    "drafter.intermediate_size": "128",
    "data.seq_len": "64",
    "data.max_anchors": "8",
    "train.device": '"cpu"',
    "train.dtype": '"float32"',
    "train.compile": "false",
    "train.gradient_checkpointing": "false",
    "train.loss_chunk": "64",
    "train.ema_every": "1",
    "train.eval_walk_new_tokens": "8",  # the decode walk at the smoke's evaluation, kept short on CPU
}


@pytest.mark.system
def test_the_rehearsal_passes_on_a_tiny_reference_structured_target(tmp_path):
    """Two ranks (1:1 over gloo), as the two-GPU rehearsal; then the unit's first start after it, and the
    fault: one rank SIGKILLed mid-run."""
    out = tmp_path / "run"
    target = str(tmp_path / "target")
    cmd = [sys.executable, "-m", "dflash_trainer.service.rehearse", "--out", str(out),
           "--shape", "qwen3.6-mini", "--target-dir", target, "--steps", "6", "--stop-at", "3",
           "--nproc", "2", "--fault-rank", "1", "--fault-steps", "40", "--unit-start", "--unit-start-cold",
           "--unit-start-before", str(TRAINER_SRC)]  # fmt: skip
    for key, value in SMALL.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=os.environ | {"NO_COLOR": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "PASS"
    figures = json.loads((out / "rehearsal.json").read_text())
    phase1, phase2 = figures["phases"]
    assert phase1["exit_code"] == phase2["exit_code"] == 0
    assert phase1["ready_s"] is not None and phase2["ready_s"] is not None  # READY=1 reached the socket
    assert phase1["term_to_exit_s"] is not None and phase1["watchdog_pings"] >= 1
    assert phase1["checkpoint_stalls_s"], "each save logs its stall"
    assert {s["first_step"] for s in phase2["summaries"] if s.get("first_step")} == {4}  # resumed at 3
    # Each rank says where its start's seconds went: the drafter's parts and the checkpoint on a resume.
    lines = phase2["start_breakdown"]
    assert len(lines) == 2, lines
    drafter_start, target_start = sorted(lines, key=lambda line: "held-out rows" in line)
    for part in ("interpreter, imports, configuration", "drafter", "EMA", "checkpoint", "other"):
        assert part in drafter_start, phase2["start_breakdown"]
    assert "target" in target_start and "held-out rows" in target_start, phase2["start_breakdown"]
    assert (out / "export" / "config.json").is_file()
    # The unit's first start: the real configuration from step 0, each on caches of its own (cold), first
    # with the trainer at --unit-start-before.
    resumed = "resumed from "  # the drafter's line of a start from a checkpoint, as phase 2's
    assert resumed in (out / "phase2.log").read_text()
    for name in ("unit-start-before", "unit-start"):
        unit = figures[name.replace("-", "_")]
        assert unit["ok"] and unit["preflight_exit"] == 0 and unit["first_step_s"] > 0, unit
        assert f"triton {out}/cache-{name}/triton (" in unit["caches_preflight"], unit
        assert resumed not in (out / f"{name}.log").read_text()  # its own checkpoint directory: from step 0
    fault = figures["fault"]
    assert fault["exit_code"] not in (0, None) and fault["named"], fault  # the job ended, naming the rank
    assert fault["resumed_at"] == fault["checkpoint_step"] + 1 and fault["restart_exit"] == 0, fault


@pytest.mark.system
def test_the_unit_starts_alone_the_first_on_empty_caches_the_others_on_what_it_left(tmp_path):
    """--unit-start-only: no smoke run; a new CT's first start, then the side-by-side pair on its caches."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflash_trainer.service.rehearse", "--out", str(out), "--shape",
           "qwen3.6-mini", "--target-dir", str(tmp_path / "target"), "--nproc", "1", "--unit-start",
           "--unit-start-only", "--unit-start-before", str(TRAINER_SRC)]  # fmt: skip
    for key, value in SMALL.items():
        cmd += ["--set", f"{key}={value}"]
    env = os.environ | {"NO_COLOR": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "PASS"
    figures = json.loads((out / "rehearsal.json").read_text())
    assert "phases" not in figures and not (out / "phase1.log").exists()  # no smoke run
    assert not (out / "smoke.toml").exists()  # nor its configuration
    for name in ("unit_start_first", "unit_start_before", "unit_start"):
        assert figures[name]["ok"] and figures[name]["first_step_s"] > 0, figures[name]
        assert f"triton {out}/cache/triton (" in figures[name]["caches_preflight"], figures[name]


def test_the_fault_scenario_expects_the_resume_from_the_newest_checkpoint_on_disk(tmp_path):
    """A kill can land after step 12's save is renamed into place but before its log line (seen in CI): the
    restart rightly resumes at 13. Expected: the step on disk when the job ended (a half-written save is not
    one)."""
    from test_config import write_config

    from dflash_trainer.service.rehearse import _newest_checkpoint_step

    checkpoints = tmp_path / "checkpoints"
    config = write_config(tmp_path, {"train": {"checkpoint_dir": str(checkpoints)}})
    assert _newest_checkpoint_step(config) is None
    for name in ("step-00000006", "step-00000012", ".tmp-step-00000018-4242"):
        (checkpoints / name).mkdir(parents=True)
    assert _newest_checkpoint_step(config) == 12


def test_a_cut_target_gets_context_layers_inside_it_unless_set() -> None:
    """The reference's context layers (1, 16, 31, 46, 61) are outside a target cut to 8 or 16 layers: --layers
    puts every other layer from 1 (at most five) in their place; an explicit --set wins."""
    from dflash_trainer.service.rehearse import config_overrides

    assert config_overrides([], 8) == {"drafter.target_layer_ids": [1, 3, 5, 7]}
    assert config_overrides([("train.keep_last", 1)], 16) == {
        "train.keep_last": 1,
        "drafter.target_layer_ids": [1, 3, 5, 7, 9],
    }
    assert config_overrides([("drafter.target_layer_ids", [2, 4])], 8) == {"drafter.target_layer_ids": [2, 4]}
    assert config_overrides([("train.keep_last", 1)], None) == {"train.keep_last": 1}
