"""scripts/check_inventory.py refuses a training CT whose train.toml the trainer would refuse, with the
trainer's own ConfigError (trainer/src/dflash_trainer/config.py, loaded by the trainer_service filter) naming
the host and the key, before any play. CPU-only: a copy of inventory/lab under tmp_path; the lab is never
touched."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab.settings import REPO

CHECK = REPO / "scripts" / "check_inventory.py"
SOURCE = "train.toml (trainer/configs/reference.toml + trainer_service_config)"


def lab_with(tmp_path: Path, **keys: dict) -> Path:
    """inventory/lab with trainer_service_config's tables overlaid by `keys` (table -> keys)."""
    inv = Path(shutil.copytree(REPO / "inventory/lab", tmp_path / "lab"))
    service = inv / "group_vars/training_cts/service.yml"
    data = yaml.safe_load(service.read_text())
    for table, values in keys.items():
        data["trainer_service_config"].setdefault(table, {}).update(values)
    service.write_text(yaml.safe_dump(data))
    return inv


def check(inventory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(inventory)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"topology": {"targets": 0}}, "topology.targets: must be >= 1, got 0"),
        ({"drafter": {"num_layer": 2}}, "drafter.num_layer: unknown key (known: mask_token_id, num_layers,"),
    ],
    ids=["targets-0", "unknown-key"],
)
def test_a_config_the_trainer_refuses_is_refused_with_its_error(
    tmp_path: Path, keys: dict, error: str
) -> None:
    proc = check(lab_with(tmp_path, **keys))
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"INVENTORY={tmp_path / 'lab'}: lab-ct200: {SOURCE}: {error}"), line


def test_a_templated_value_is_left_to_the_play(tmp_path: Path) -> None:
    proc = check(lab_with(tmp_path, drafter={"num_layers": "{{ lab_drafter_layers }}"}))
    assert proc.returncode == 0, proc.stderr
