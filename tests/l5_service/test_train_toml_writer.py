"""train.toml's writer (roles/trainer_service/filter_plugins/dflash_train_config.py, to_toml): an inventory's
trainer_service_config may hold a table inside a table, which must read back as itself (tomli-w's dumps)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "dflash_train_config_writer", REPO / "roles/trainer_service/filter_plugins/dflash_train_config.py"
)
assert spec is not None and spec.loader is not None
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)

TABLES: dict[str, dict[str, Any]] = {
    "model": {"target_path": '/srv/targets/"q" \\ one\nline', "dtype": "bfloat16"},
    "train": {"lr": 1e-4, "max_steps": 10, "resume": True, "ids": [1, 16, 31], "grid": [[1, 2], ["a"]]},
    "trackers": {"tensorboard": "/var/tb", "wandb": {"project": "dflash", "tags": ["a", "b"]}},
    "deep": {"one": {"two": {"three": 3}}},
    "odd keys": {"a.b": 1, "ü": "x"},
}


def test_a_table_value_round_trips() -> None:
    assert tomllib.loads(render.to_toml(TABLES)) == TABLES


def test_an_inventory_table_inside_a_table_reaches_train_toml() -> None:
    reference = (REPO / "trainer/configs/reference.toml").read_text()
    tables = render.merge(reference, {"trackers": {"wandb": {"project": "p", "tags": ["lab"]}}})
    assert tomllib.loads(render.to_toml(tables))["trackers"]["wandb"] == {"project": "p", "tags": ["lab"]}
