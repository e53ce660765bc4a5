"""The training TOML of the tiny target, shared by the loop, pipeline and service tests (and the TOML writer
test_config uses): one base, each test overriding keys by section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID


def toml_value(value: Any) -> str:
    return (
        str(value).lower()
        if isinstance(value, bool)
        else json.dumps(str(value) if isinstance(value, Path) else value)
    )


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    return "".join(
        f"[{name}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in table.items())
        for name, table in sections.items()
    )


def tiny_run_config(path: Path, target: Path, shards: Path, **overrides: dict[str, Any]) -> Path:
    """Writes the tiny run's TOML at `path`; overrides such as train={...} add or replace keys."""
    sections: dict[str, dict[str, Any]] = {
        "model": {"target_path": target},
        "drafter": {"num_layers": 2, "block_size": 4, "gamma": 4.0, "mask_token_id": TINY_MASK_TOKEN_ID},
        "data": {"shards": shards, "seq_len": 24, "max_anchors": 4, "held_out": 2},
        "optim": {"batch": 2},
        "train": {"eval_every": 0, "device": "cpu", "eval_walk_new_tokens": 8},
    }
    for name, table in overrides.items():
        sections.setdefault(name, {}).update(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(sections))
    return path


TINY_JOB_STEPS = 6  # conftest's tiny_job: a run of this many steps


def run_cli(
    argv: list[str], *, code: str | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """`python -m dflash_trainer.service ARGV` (or `python -c CODE ARGV`) in a subprocess: (code, output)."""
    entry = ["-c", code] if code else ["-m", "dflash_trainer.service"]
    cmd = [sys.executable, *entry, *argv]
    environ = os.environ | {"OMP_NUM_THREADS": "1", "DFLASH_MANIFEST_PINS_DIR": "/nonexistent"} | (env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300, check=False)
    return proc.returncode, proc.stdout + proc.stderr
