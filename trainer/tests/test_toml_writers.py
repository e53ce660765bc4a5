"""The one TOML writer (dflash_trainer.config.to_toml: `config show`, smoke.toml, rehearsal configs and,
through the trainer_service filter plugin, the deployed train.toml) reads back as what it was given, tables
inside tables included."""

from __future__ import annotations

import importlib.util
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.config import to_toml

FILTER = Path(__file__).resolve().parents[2] / "roles/trainer_service/filter_plugins/dflash_train_config.py"
spec = importlib.util.spec_from_file_location("dflash_train_config_writer", FILTER)
assert spec is not None and spec.loader is not None
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)

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
    "config.to_toml": to_toml,
    "trainer_service filter": render.to_toml,
}


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
def test_a_table_value_round_trips(writer: Callable[[dict[str, dict[str, Any]]], str]) -> None:
    assert tomllib.loads(writer(TABLES)) == TABLES
