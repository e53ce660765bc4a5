"""L5, the CTs of one multi-node job (the group training_job; roles/training_job): the checkpoint directory is
one directory for the whole job (a file the trainer's user writes in one CT, every other CT reads as that
user: on NFS the CT's root is a plain user, host uid 100000), and the job's interface exists.

Runs against any inventory; an inventory without the group has no host to check here.
"""

from __future__ import annotations

import shlex
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.verify.backends import host_for
from tests.verify.conftest import _inventory, group_hosts

GROUP = "training_job"
DEFAULTS = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "roles/trainer_service/defaults/main.yml").read_text()
)


def as_trainer(hostvars: dict[str, Any], script: str) -> str:
    """script as the trainer's user, who owns the job's files on the shared storage."""
    user = hostvars.get("trainer_service_user", DEFAULTS["trainer_service_user"])
    return f"runuser -u {user} -- sh -c {shlex.quote(script)}"


def test_job_interface_exists(host, hostvars: dict[str, Any]) -> None:
    ifname = hostvars.get("training_job_socket_ifname", "eth0")
    assert host.run(f"test -e /sys/class/net/{ifname}").rc == 0, (
        f"no interface {ifname} (training_job_socket_ifname)"
    )


def test_checkpoint_dir_is_shared_by_every_ct_of_the_job(
    request: pytest.FixtureRequest, host, inventory_hostname: str, hostvars: dict[str, Any]
) -> None:
    path = hostvars["training_job_checkpoint_dir"]
    assert host.file(path).is_directory, f"training_job_checkpoint_dir {path} is not a directory"
    marker = f"{path}/.verify-{inventory_hostname}-{uuid.uuid4().hex[:8]}"
    wrote = host.run(as_trainer(hostvars, f"echo {inventory_hostname} > {marker}"))
    assert wrote.rc == 0, f"the trainer's user cannot write {marker}: {wrote.stderr.strip()}"
    try:
        all_hostvars = _inventory(request.config)["_meta"]["hostvars"]
        for peer in group_hosts(request.config, GROUP):
            if peer == inventory_hostname:
                continue
            peer_vars = all_hostvars[peer]
            seen = host_for(peer, peer_vars, all_hostvars).run(as_trainer(peer_vars, f"cat {marker}"))
            assert seen.stdout.strip() == inventory_hostname, (
                f"{peer} cannot see {marker}, which {inventory_hostname} wrote: {path} is not one shared "
                "directory"
            )
    finally:
        host.run(as_trainer(hostvars, f"rm -f {marker}"))


def test_rdma_devices_are_character_devices_in_the_ct(host, hostvars: dict[str, Any]) -> None:
    devices = hostvars.get("training_job_rdma_devices") or []
    if not devices:
        pytest.skip("training_job_rdma_devices is empty: NCCL runs over the job's interface")
    missing = [d for d in devices if host.run(f"test -c /dev/{d}").rc != 0]
    assert not missing, f"not character devices in the CT: {missing} (list them in ct_gpu_extra_devices too)"
    memlock = host.run("sh -c 'ulimit -Hl'").stdout.strip()
    assert memlock == "unlimited", f"RDMA registers pinned memory: the CT's hard memlock is {memlock}"
