"""The lab itself, as testinfra sees it: `make test` runs this after `make lab`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from proxmoxer import ProxmoxAPI
from testinfra.host import Host

from lab import image, seed, services
from lab.settings import REPO, load_settings
from tests.verify.backends import LxcAttachBackend

SETTINGS = load_settings(REPO / "inventory" / "lab")


@pytest.fixture(scope="module", params=[c.name for c in SETTINGS.containers])
def container(request: pytest.FixtureRequest) -> Host:
    return Host(LxcAttachBackend(request.param))


def test_container_boots_systemd_as_pid1(container: Host) -> None:
    assert container.run("cat /proc/1/comm").stdout.strip() == "systemd"
    assert container.run("systemctl is-system-running").stdout.strip() == "running"


def test_container_is_debian_12(container: Host) -> None:
    assert container.system_info.distribution == "debian"
    assert container.system_info.release.startswith("12")


def test_ct_has_sized_dev_shm() -> None:
    for spec in (c for c in SETTINGS.containers if c.role == "ct"):
        ct = Host(LxcAttachBackend(spec.name))
        shm = ct.mount_point("/dev/shm")
        assert shm.filesystem == "tmpfs"
        assert f"size={spec.shm_size_mb * 1024}k" in shm.options


def test_ct_runs_the_image_its_record_names() -> None:
    """lab-ct200 was unpacked from the archive the lab keeps for it, the one the L2 role uploads."""
    for spec in (c for c in SETTINGS.containers if c.role == "ct"):
        record = image.read_record(image.ct_record_path(SETTINGS, spec.name))
        assert record is not None, f"no record of the image {spec.name} was made from"
        inside = Host(LxcAttachBackend(spec.name)).file("/etc/dflash/image.json").content_string
        assert json.loads(inside) == record.manifest, f"{spec.name} runs another image than {record.name}"
        assert record.manifest["variant"] == "cpu"
        assert record.path.is_relative_to(SETTINGS.lab_dir / "images"), "the lab does not keep its own copy"


def test_fakepve_answers_with_lab_credentials() -> None:
    password = (SETTINGS.secrets_dir / "pve_password").read_text()
    api = ProxmoxAPI(
        SETTINGS.fakepve_host,
        port=SETTINGS.fakepve_port,
        user="root@pam",
        password=password,
        verify_ssl=False,
    )
    assert [n["node"] for n in api.nodes.get()] == ["pve1"]


def test_lab_secrets_are_root_only() -> None:
    for path in SETTINGS.secrets_dir.iterdir():
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
    assert SETTINGS.secrets_dir.stat().st_mode & 0o077 == 0


def test_bucket_lists_shards_and_model() -> None:
    listing = seed.bucket_listing(SETTINGS)
    shards = [k for k in listing if k.startswith(seed.SHARDS_PREFIX) and k.endswith(".arrow")]
    assert len(shards) == seed.NUM_SHARDS
    assert f"{seed.MODEL_PREFIX}config.json" in listing
    assert f"{seed.MODEL_PREFIX}model.safetensors" in listing


def test_services_listen_on_loopback_only() -> None:
    for daemon in services.daemons(SETTINGS):
        out = (
            Host(LxcAttachBackend(SETTINGS.containers[0].name))
            .run(f"ss -Hltn 'sport = :{daemon.port}'")
            .stdout
        )
        addresses = {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}
        assert addresses == {daemon.host}, f"{daemon.name} listens on {addresses}"


def test_lab_passwords_never_on_a_command_line() -> None:
    password = (SETTINGS.secrets_dir / "pve_password").read_text()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert password.encode() not in cmdline.read_bytes(), f"{cmdline} carries the fakepve password"
        except (FileNotFoundError, ProcessLookupError):
            continue
