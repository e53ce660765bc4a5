"""The trainer's TOML writers (`config show`, smoke.toml and rehearsal configs) read back as what they were
given, tables inside tables included: each is tomli-w's dumps."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

import pytest

from dflash_trainer.cli import to_toml
from dflash_trainer.service.smoke import dump_toml

# A table inside a table ([trackers.wandb]), three levels deep, keys that need quoting, strings that need
# escaping, lists of lists: what a hand-written scalar-and-list writer got wrong.
TABLES: dict[str, dict[str, Any]] = {
    "model": {"target_path": '/srv/targets/"q" \\ one\nline', "dtype": "bfloat16"},
    "train": {"lr": 1e-4, "max_steps": 10, "resume": True, "ids": [1, 16, 31], "grid": [[1, 2], ["a"]]},
    "trackers": {"tensorboard": "/var/tb", "wandb": {"project": "dflash", "tags": ["a", "b"]}},
    "deep": {"one": {"two": {"three": 3}}},
    "odd keys": {"a.b": 1, "ü": "x", "": 0},
    "empty": {},
}

WRITERS: dict[str, Callable[[dict[str, dict[str, Any]]], str]] = {
    "cli.to_toml": to_toml,
    "smoke.dump_toml": dump_toml,
}


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
def test_a_table_value_round_trips(writer: Callable[[dict[str, dict[str, Any]]], str]) -> None:
    assert tomllib.loads(writer(TABLES)) == TABLES
