"""Layer checks against any inventory: `make verify INVENTORY=...` (pytest tests/verify --inventory PATH).

Each module holds one layer's checks and names the inventory group it checks in GROUP; every test that takes
the `host` fixture runs once per host of that group, so the output is one line per check and host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.verify.backends import host_for

REPO = Path(__file__).resolve().parents[2]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--inventory", default=str(REPO / "inventory" / "lab"), help="Ansible inventory to verify"
    )


def _inventory(config: pytest.Config) -> dict[str, Any]:
    cached = getattr(config, "_dflash_inventory", None)
    if cached is None:
        tool = Path(sys.executable).parent / "ansible-inventory"
        path = config.getoption("--inventory")
        proc = subprocess.run([str(tool), "-i", path, "--list"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise pytest.UsageError(f"inventory {path}: {proc.stderr.strip()}")
        cached = json.loads(proc.stdout)
        config._dflash_inventory = cached
    return cached


def group_hosts(config: pytest.Config, group: str) -> list[str]:
    return _inventory(config).get(group, {}).get("hosts", [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "inventory_hostname" in metafunc.fixturenames:  # host, hostvars, proxmox and what uses them
        group = metafunc.module.GROUP
        metafunc.parametrize("inventory_hostname", group_hosts(metafunc.config, group), scope="module")


@pytest.fixture(scope="module")
def hostvars(request: pytest.FixtureRequest, inventory_hostname: str) -> dict[str, Any]:
    return _inventory(request.config)["_meta"]["hostvars"][inventory_hostname]


@pytest.fixture(scope="module")
def host(request: pytest.FixtureRequest, inventory_hostname: str, hostvars: dict[str, Any]):
    all_hostvars = _inventory(request.config)["_meta"]["hostvars"]
    return host_for(inventory_hostname, hostvars, all_hostvars)


@pytest.fixture(scope="module")
def proxmox(request: pytest.FixtureRequest, hostvars: dict[str, Any]):
    """The Proxmox host of a CT (its ct_proxmox_host): the host's side of the CT, such as its config file."""
    name = hostvars.get("ct_proxmox_host")
    if not name:
        pytest.fail("ct_proxmox_host is not set for this CT in the inventory")
    all_hostvars = _inventory(request.config)["_meta"]["hostvars"]
    return host_for(name, all_hostvars.get(name, {}), all_hostvars)


@pytest.fixture
def gpus(hostvars: dict[str, Any]) -> list[int]:
    """CT 200's GPUs from the inventory (ct_gpus); checks that need them skip, saying why, without."""
    gpus = hostvars.get("ct_gpus") or []
    if not gpus:
        pytest.skip("no GPUs in the inventory (ct_gpus empty)")
    return [int(g) for g in gpus]
