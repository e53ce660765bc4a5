"""The deployed train.toml: trainer/configs/reference.toml with the inventory's named keys replaced.

The trainer's own configuration module (trainer/src/dflash_trainer/config.py) does the work: its overlay, its
checks and its ConfigError, its TOML writer and its rank count. The controller's venv (.venv) does not carry
the trainer package (it would bring torch), so that one file is loaded by path: at module level it imports
only the standard library and tomli-w. Also used by scripts/check_inventory.py (loaded by path), so that
`make provision` refuses a bad configuration or a rank-count mismatch before it touches a host:
- merge(reference_text, *overrides): the reference's tables, each override table's keys replacing the
  reference's (config.overlay: a key set to null/None removes it, a table is never replaced whole).
- ranks(tables): the trainer's checks of the tables (a ConfigError names the key), then [topology]'s rank
  count (TopologyConfig.ranks), the one source of the unit's process count.
- rank_problems(tables, ct_gpus, nproc): the configuration's ConfigError, or the mismatches of [topology],
  the CT's GPUs and a stale trainer_service_nproc, each naming the three values.
- to_toml(tables): TOML text (config.to_toml).
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

TRAINER_CONFIG = Path(__file__).resolve().parents[3] / "trainer/src/dflash_trainer/config.py"
# What a message calls the configuration it checks.
SOURCE = "train.toml (trainer/configs/reference.toml + trainer_service_config)"
CONFIG_DIR = Path("/etc/dflash")  # the unit's train.toml lives here (trainer_service_config_dir)


def _load_trainer_config() -> ModuleType:
    name = "dflash_trainer_config"  # not dflash_trainer.config: its package is not there to import
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TRAINER_CONFIG)
    assert spec is not None and spec.loader is not None, TRAINER_CONFIG
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their type hints through sys.modules
    spec.loader.exec_module(module)
    return module


config = _load_trainer_config()
ConfigError = config.ConfigError


def merge(reference_text: str, *overrides: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    try:
        return config.overlay(tomllib.loads(reference_text), *overrides)
    except config.ConfigError as e:
        raise ConfigError(f"trainer_service_config.{e.key}", e.message) from None


def check(tables: dict[str, dict[str, Any]]) -> Any:
    """The trainer's checks that need no target (config.check_tables) and absolute paths: the unit may write
    only the paths it lists in ReadWritePaths=, which systemd takes absolute. Returns the TrainConfig."""
    for key in config.path_keys():
        section, name = key.split(".")
        value = tables.get(section, {}).get(name)
        if isinstance(value, str) and not value.startswith("/"):
            raise ConfigError(key, f"{value!r} is relative: a deployed configuration names absolute paths")
    return config.check_tables(tables, base=CONFIG_DIR)


def ranks(tables: dict[str, dict[str, Any]]) -> int:
    topo = check(tables).topology
    if topo.ranks is None:
        raise ConfigError(
            "topology",
            f"targets = {topo.targets!r}, drafters = {topo.drafters!r}: a deployed configuration names both "
            "as integers (the unit starts targets + drafters ranks)",
        )
    return int(topo.ranks)


def rank_problems(
    tables: dict[str, dict[str, Any]], ct_gpus: Any, nproc: Any = None, nnodes: Any = 1
) -> list[str]:
    """The configuration's error, else every disagreement between [topology], ct_gpus and a
    trainer_service_nproc left in an inventory; with several nodes (the CTs of training_job) each CT holds
    [topology]'s ranks / nnodes."""
    try:
        n = ranks(tables)
    except ConfigError as e:
        return [f"{SOURCE}: {e}"]
    nodes = int(nnodes or 1)
    topo = tables["topology"]
    if nodes > 1:
        if n % nodes:
            return [
                f"[topology] {topo['targets']} targets + {topo['drafters']} drafters = {n} ranks do not "
                f"split evenly over the {nodes} CTs of training_job: each CT runs the same number of ranks"
            ]
        n //= nodes
    device = tables.get("train", {}).get("device", "auto")
    gpus = len(ct_gpus) if isinstance(ct_gpus, list) else None
    unit = f"{nproc} (set)" if nproc is not None else f"{n} (derived)"
    said = (
        f"[topology] {topo['targets']} targets + {topo['drafters']} drafters = {n * nodes} ranks"
        + (f" ({n} on each of {nodes} CTs)" if nodes > 1 else "")
        + ", "
        f"trainer_service_nproc {unit}, ct_gpus {gpus if gpus is not None else ct_gpus!r} GPU(s)"
    )
    problems = []
    if nproc is not None and str(nproc) != str(n):
        problems.append(f"{said}: remove trainer_service_nproc (the unit's process count is [topology]'s)")
    if gpus is not None:
        if gpus and gpus != n:
            problems.append(f"{said}: one GPU per rank: change [topology] or ct_gpus")
        if not gpus and device == "cuda":
            problems.append(f"{said}: train.device is cuda but the CT gets no GPU")
    return problems


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    return config.to_toml(tables)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "dflash_train_config": merge,
            "dflash_rank_count": ranks,
            "dflash_rank_problems": rank_problems,
            "dflash_to_toml": to_toml,
        }


def _template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def host_problems(host: str, hostvars: dict[str, Any], reference_text: str, nnodes: int = 1) -> list[str]:
    """scripts/check_inventory.py: a training CT's configuration and rank count from its inventory variables,
    not templated: a key whose value is a template keeps the reference's value here (the play checks the
    rendered one)."""
    overrides = hostvars.get("trainer_service_config") or {}
    if isinstance(overrides, dict):
        overrides = {
            table: {k: v for k, v in keys.items() if not _template(v)} if isinstance(keys, dict) else keys
            for table, keys in overrides.items()
        }
    try:
        tables = merge(reference_text, overrides if isinstance(overrides, dict) else {})
    except ConfigError as e:
        return [f"{host}: {e}"]
    gpus = hostvars.get("ct_gpus", [])
    nproc = hostvars.get("trainer_service_nproc")
    return [f"{host}: {p}" for p in rank_problems(tables, gpus, nproc, nnodes)]
