"""The deployed train.toml: trainer/configs/reference.toml with the inventory's named keys replaced.

Pure functions, also used by scripts/check_inventory.py (loaded by path) so that `make provision` refuses a
rank-count mismatch before it touches a host:
- merge(reference_text, *overrides): the reference's tables, each override table's keys replacing the
  reference's (a key set to null/None removes it: the trainer's default applies); tables are never replaced
  whole, so a key the inventory does not name keeps the reference's value.
- ranks(tables): targets + drafters of [topology], the one source of the unit's process count.
- rank_problems(tables, ct_gpus, nproc): the mismatches of [topology], the CT's GPUs and a stale
  trainer_service_nproc, each naming the three values.
- to_toml(tables): TOML text (tomli-w: tables at any depth, strings quoted, lists inline).
"""

from __future__ import annotations

import tomllib
from typing import Any

import tomli_w


def merge(reference_text: str, *overrides: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in tomllib.loads(reference_text).items()}
    for override in overrides:
        for table, keys in (override or {}).items():
            if not isinstance(keys, dict):
                raise ValueError(f"trainer_service_config.{table} must be a table of keys, got {keys!r}")
            target = tables.setdefault(str(table), {})
            for key, value in keys.items():
                if value is None:
                    target.pop(str(key), None)
                else:
                    target[str(key)] = value
    return tables


def ranks(tables: dict[str, dict[str, Any]]) -> int:
    topo = tables.get("topology", {})
    targets, drafters = topo.get("targets"), topo.get("drafters")
    if not (isinstance(targets, int) and isinstance(drafters, int)) or targets < 1 or drafters < 1:
        raise ValueError(
            f"[topology] targets = {targets!r}, drafters = {drafters!r}: a deployed configuration names both "
            "as integers >= 1 (the unit starts targets + drafters ranks)"
        )
    return targets + drafters


def rank_problems(
    tables: dict[str, dict[str, Any]], ct_gpus: Any, nproc: Any = None, nnodes: Any = 1
) -> list[str]:
    """Every disagreement between [topology], ct_gpus and a trainer_service_nproc left in an inventory; with
    several nodes (the CTs of training_job) each CT holds [topology]'s ranks / nnodes."""
    try:
        n = ranks(tables)
    except ValueError as e:
        return [str(e)]
    nodes = int(nnodes or 1)
    if nodes > 1:
        topo = tables["topology"]
        if n % nodes:
            return [
                f"[topology] {topo['targets']} targets + {topo['drafters']} drafters = {n} ranks do not "
                f"split evenly over the {nodes} CTs of training_job: each CT runs the same number of ranks"
            ]
        n //= nodes
    topo = tables["topology"]
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
    # tomli-w is in requirements/tools.lock (Ansible's venv); the trainer package, which wraps the same
    # call, is not installed there.
    return tomli_w.dumps(tables)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "dflash_train_config": merge,
            "dflash_rank_count": ranks,
            "dflash_rank_problems": rank_problems,
            "dflash_to_toml": to_toml,
        }


def host_problems(host: str, hostvars: dict[str, Any], reference_text: str, nnodes: int = 1) -> list[str]:
    """scripts/check_inventory.py: a training CT's rank count from its inventory variables (not templated:
    [topology] and ct_gpus are plain values; paths and other templated strings are not looked at)."""
    overrides = hostvars.get("trainer_service_config") or {}
    try:
        tables = merge(reference_text, overrides if isinstance(overrides, dict) else {})
    except ValueError as e:
        return [f"{host}: {e}"]
    gpus = hostvars.get("ct_gpus", [])
    nproc = hostvars.get("trainer_service_nproc")
    return [f"{host}: {p}" for p in rank_problems(tables, gpus, nproc, nnodes)]
