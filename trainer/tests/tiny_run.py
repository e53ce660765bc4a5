"""The training TOML of the tiny target, shared by the loop, pipeline and service tests (and the TOML writer
test_config uses): one base, each test overriding keys by section."""

from __future__ import annotations

import json
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
