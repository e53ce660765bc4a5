"""The L2 role (roles/pve_container) against a private fakepve with an ACL.

Create, no change on a rerun, memory in place, recreation refused unless forced, clear errors for a bad token,
an unreachable API and an offline node, and device entries correct and unduplicated after several runs.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

import fakepve.pytest_plugin as plugin
import pytest

from lab.fakepve_daemon import LAB_TIME_SCALE, LabFakePve
from tests.l2_container.conftest import GPUS

DEVICES = [f"/dev/nvidia{g}" for g in GPUS] + [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-caps/nvidia-cap1",
    "/dev/nvidia-caps/nvidia-cap2",
]
# As each devN entry names them: the GPU nodes' group and mode for the trainer (ct_gpu_gid, ct_gpu_mode).
# A node is 0660 and the CT's root's unless the entry says otherwise (pve-container src/PVE/LXC.pm
# create_passthrough_device_node).
ENTRIES = [f"{d},gid=44,mode=0660" for d in DEVICES]


def devn(config: dict) -> dict[str, str]:
    return {k: v for k, v in config.items() if k.startswith("dev") and k[3:].isdigit()}


def test_create_then_rerun_changes_nothing(pve, play, lab) -> None:
    first = play()
    assert first.rc == 0, first.error()
    ct = pve.ct(200)
    assert ct is not None and ct.status == "running"
    cfg = ct.config
    assert (cfg["memory"], cfg["cores"], cfg["hostname"], cfg["onboot"]) == (4096, 4, "ct200", 1)
    assert "unprivileged" not in cfg, "CT 200 must be privileged"
    assert "hwaddr=BC:24:11:AA:BB:CC" in cfg["net0"]
    assert "firewall=1" in cfg["net0"], "net0 lacks the Proxmox firewall"
    assert cfg["rootfs"].startswith("local-lvm:") and "size=8G" in cfg["rootfs"]
    assert sorted(devn(cfg).values()) == sorted(ENTRIES)
    conf = Path(lab["ct_pve_conf_dir"], "200.conf").read_text()
    assert "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=512m,create=dir 0 0\n" in conf
    assert "lxc.prlimit.memlock: unlimited\n" in conf
    second = play()
    assert second.rc == 0, second.error()
    assert second.changed == 0, f"second run changed {second.changed} things"


def image_record(tmp_path: Path, variant: str, **changes) -> Path:
    """A build record as image/build.sh writes it (build/image/VARIANT.json), for a tiny stand-in archive."""
    archive = tmp_path / f"debian-12-dflash-{variant}_0.1.0-gtest_amd64.tar.zst"
    archive.write_bytes(b"(\xb5/\xfd\x00\x00\x01\x00\x00")  # fakepve never unpacks it
    record = {
        "path": str(archive),
        "name": archive.name,
        "volid": f"local:vztmpl/{archive.name}",
        "sha256": hashlib.sha256(archive.read_bytes()).hexdigest(),
        "size_bytes": archive.stat().st_size,
        "manifest": {"variant": variant},
    } | changes
    path = tmp_path / f"{variant}.json"
    path.write_text(json.dumps(record))
    return path


def test_the_image_record_names_the_template_uploaded_and_used(pve, play, tmp_path: Path) -> None:
    record = image_record(tmp_path, "cuda")
    run = play(ct_template_src="", ct_variant="cuda", ct_image_record=str(record))
    assert run.rc == 0, run.error()
    name = json.loads(record.read_text())["name"]
    assert f"vztmpl/{name}" in pve.storages["local"]["volumes"], "the record's archive was not uploaded"
    created = [body for method, path, body in pve.requests if method == "POST" and path.endswith("/lxc")]
    assert created and f"vztmpl%2F{name}".encode() in created[0], "the CT was not created from that template"


def test_missing_image_record_names_it_and_the_build(pve, play, tmp_path: Path) -> None:
    run = play(ct_template_src="", ct_image_record=str(tmp_path / "cuda.json"))
    assert run.rc != 0
    assert f"ct_image_record {tmp_path / 'cuda.json'} does not exist" in run.error()
    assert "make image VARIANT=cuda" in run.error()
    assert not [r for r in pve.requests if "/storage" in r[1] or "/lxc" in r[1]], "the API was used"


def test_image_record_of_another_variant_or_a_changed_archive_refused(pve, play, tmp_path: Path) -> None:
    cpu = play(ct_template_src="", ct_variant="cuda", ct_image_record=str(image_record(tmp_path, "cpu")))
    assert cpu.rc != 0 and "does not describe a finished cuda image: variant cpu" in cpu.error()
    short = image_record(tmp_path, "cuda", size_bytes=10**9)
    changed = play(ct_template_src="", ct_variant="cuda", ct_image_record=str(short))
    assert changed.rc != 0 and "the record says 1000000000" in changed.error()
    # Same size, other bytes (a tampered or half-rewritten archive): refused by its sha256 before any upload.
    record = image_record(tmp_path, "cuda")
    archive = Path(json.loads(record.read_text())["path"])
    archive.write_bytes(archive.read_bytes()[:-1] + b"\x01")
    tampered = play(ct_template_src="", ct_variant="cuda", ct_image_record=str(record))
    assert tampered.rc != 0 and "sha256" in tampered.error() and "the record says" in tampered.error()
    assert not [r for r in pve.requests if "/upload" in r[1]], "a tampered archive was uploaded"


def test_cpu_variant_with_gpus_refused(pve, play) -> None:
    run = play(ct_variant="cpu")
    assert run.rc != 0
    assert "cuda when ct_gpus is set" in run.error()


def test_memory_change_applies_in_place(pve, play) -> None:
    assert play().rc == 0
    ct = pve.ct(200)
    started, net0 = ct.started_at, ct.config["net0"]
    run = play(ct_memory_mb=6144)
    assert run.rc == 0, run.error()
    assert pve.ct(200) is ct, "the CT was recreated for a memory change"
    assert ct.config["memory"] == 6144 and ct.status == "running" and ct.started_at == started
    assert ct.config["net0"] == net0, "an update changed the network entry (MAC not pinned?)"


def test_memory_below_shm_plus_trainer_refused_before_any_api_call(pve, play) -> None:
    run = play(ct_memory_mb=1024, ct_shm_size_mb=512, ct_trainer_memory_mb=1024)
    assert run.rc != 0
    assert "ct_memory_mb=1024 is below ct_shm_size_mb=512 + ct_trainer_memory_mb=1024" in run.error()
    assert not [r for r in pve.requests if "/lxc" in r[1] or "/storage" in r[1]], "the API was used"


@pytest.mark.slow  # three or more playbook runs
def test_recreation_refused_unless_forced(pve, play) -> None:
    assert play().rc == 0
    refused = play(ct_unprivileged=True)
    assert refused.rc != 0
    assert "must be destroyed and recreated" in refused.error() and "ct_force_recreate" in refused.error()
    assert "unprivileged" not in pve.ct(200).config, "a refused change was applied"
    forced = play(ct_unprivileged=True, ct_force_recreate=True)
    assert forced.rc == 0, forced.error()
    assert pve.ct(200).config.get("unprivileged") == 1 and pve.ct(200).status == "running"


def test_bad_token_is_one_clear_error(pve, play) -> None:
    run = play(pve_api_password="", pve_api_token_id="ci", pve_api_token_secret="wrong")
    assert run.rc != 0
    assert "authentication failed for root@pam!ci" in run.error() and "401" in run.error()
    assert pve.ct(200) is None


def test_unreachable_api_is_one_clear_error(play) -> None:
    """An unreachable API is one line, printed once, naming the API and the whole cause, not a cut one
    (docs/container-layers.md#how-l2-works, step 2)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once closed
    run = play(pve_api_host="127.0.0.1", pve_api_port=port)
    assert run.rc != 0
    lines = [line for line in run.out.splitlines() if f"Proxmox API https://127.0.0.1:{port}" in line]
    assert len(lines) == 1, "the error is printed more than once:\n" + "\n".join(lines)
    assert lines[0].endswith(
        f"Proxmox API https://127.0.0.1:{port}: login: cannot connect: [Errno 111] Connection refused"
        " (is pveproxy running?)"
    ), lines[0]


def test_offline_node_is_one_clear_error(pve, play) -> None:
    pve.set_node_offline("pve1")
    run = play()
    assert run.rc != 0 and "pve1" in run.error() and ("offline" in run.error() or "595" in run.error())


def test_token_for_the_api_and_pct_for_devn(pve, play, lab) -> None:
    """A token cannot set devN (the API refuses it, as PVE does); auto mode sets them with `pct` on the host,
    where root is root@pam, and the token does everything else. No raw device lines are needed."""
    refused = play(
        pve_api_password="", pve_api_token_id="ci", pve_api_token_secret="token-secret", ct_device_mode="api"
    )
    assert refused.rc != 0 and "root@pam" in refused.error()
    token = {"pve_api_password": "", "pve_api_token_id": "ci", "pve_api_token_secret": "token-secret"}
    run = play(**token, ct_features=[], ct_device_mode="auto")
    assert run.rc == 0, run.error()
    assert sorted(devn(pve.ct(200).config).values()) == sorted(ENTRIES)
    conf = Path(lab["ct_pve_conf_dir"], "200.conf").read_text()
    assert "lxc.mount.entry: /dev/nvidia" not in conf and "lxc.cgroup2.devices.allow" not in conf
    again = play(**token, ct_features=[], ct_device_mode="auto")
    assert again.rc == 0 and again.changed == 0, again.error()


# The token's privileges docs/container-layers.md documents for an unprivileged CT 200 (a privileged one also
# needs Sys.Modify on / to be created). fakepve checks each call against them as PVE's schema does.
LEAST_PRIVILEGES = (
    "VM.Allocate",
    "VM.Audit",
    "VM.Config.CPU",
    "VM.Config.Memory",
    "VM.Config.Network",
    "VM.Config.Options",
    "VM.Config.Disk",
    "VM.PowerMgmt",
    "Datastore.AllocateSpace",
    "Datastore.AllocateTemplate",
    "Datastore.Audit",
    "SDN.Use",
)


def test_least_privilege_token_provisions_an_unprivileged_ct(pve, play) -> None:
    pve.apitokens["root@pam!dflash"] = "least-secret"
    pve.grant("root@pam!dflash", "/", *LEAST_PRIVILEGES)
    token = {"pve_api_password": "", "pve_api_token_id": "dflash", "pve_api_token_secret": "least-secret"}
    # nesting, as inventory/example sets it for the hardened unit: VM.Allocate suffices on an unprivileged CT.
    run = play(**token, ct_unprivileged=True, ct_features=["nesting=1"])
    assert run.rc == 0, run.error()
    cfg = pve.ct(200).config
    assert cfg.get("unprivileged") == 1 and sorted(devn(cfg).values()) == sorted(ENTRIES), devn(cfg)


def test_api_certificate_checked_against_a_ca_bundle(pve, play, fakepve_cafile) -> None:
    """A PVE certificate is signed by the cluster's own CA: with that CA as pve_api_ca_file every API call
    verifies the certificate; without it the play stops with one line saying what to set."""
    untrusted = play(pve_api_validate_certs=True)
    assert untrusted.rc != 0
    assert "TLS certificate not trusted" in untrusted.error() and "pve_api_ca_file" in untrusted.error()
    run = play(pve_api_validate_certs=True, pve_api_ca_file=fakepve_cafile)
    assert run.rc == 0, run.error()
    assert pve.ct(200) is not None and pve.ct(200).status == "running"


def test_devn_through_a_token_is_refused_by_the_api(pve) -> None:
    """The contract the role relies on: with an ACL, Proxmox refuses devN to anyone but root@pam."""
    from proxmoxer import ProxmoxAPI
    from proxmoxer.core import ResourceException

    pve.add_ct(201, "probe", status="stopped", config={"unprivileged": 0})
    api = ProxmoxAPI(
        pve.host,
        port=pve.port,
        user="root@pam",
        token_name="ci",
        token_value="token-secret",
        verify_ssl=False,
    )
    with pytest.raises(ResourceException, match="only allowed for root@pam"):
        api.nodes("pve1").lxc(201).config.put(dev0="/dev/nvidia0")


@pytest.mark.slow  # three or more playbook runs
def test_devices_stay_unduplicated_across_runs_and_rewrites(pve, play, lab) -> None:
    assert play().rc == 0
    conf = Path(lab["ct_pve_conf_dir"], "200.conf")
    # What Proxmox does to the file between runs: its own keys first, a snapshot section after the main one.
    conf.write_text(
        "arch: amd64\ncores: 4\n" + conf.read_text() + "\n[before-upgrade]\narch: amd64\n"
        "lxc.prlimit.memlock: unlimited\n"
    )
    # A hand-made duplicate, and a GPU dropped from the inventory.
    pve.ct(200).config["dev9"] = "/dev/nvidia0"
    for _ in range(2):
        run = play(ct_gpus=[0])
        assert run.rc == 0, run.error()
    values = list(devn(pve.ct(200).config).values())
    assert sorted(values) == sorted(d for d in ENTRIES if not d.startswith("/dev/nvidia1,"))
    assert len(values) == len(set(values))
    text = conf.read_text()
    main, _, snapshot = text.partition("[before-upgrade]")
    assert main.count("lxc.prlimit.memlock: unlimited\n") == 1 and main.startswith("arch: amd64\ncores: 4\n")
    assert snapshot == "\narch: amd64\nlxc.prlimit.memlock: unlimited\n", "the snapshot section was touched"
    assert play(ct_gpus=[0]).changed == 0


def test_description_comes_back_as_pve_stores_it_and_a_rerun_changes_nothing(pve, play) -> None:
    """PVE answers the description with a trailing newline and community.proxmox compares strings split on
    commas: a description with a comma and without that newline is "changed" on every run against a real
    host."""
    first = play(ct_description="DFlash CT (managed by Ansible, roles/pve_container)")
    assert first.rc == 0, first.error()
    assert pve.ct(200) is not None
    second = play(ct_description="DFlash CT (managed by Ansible, roles/pve_container)")
    assert second.rc == 0, second.error()
    assert second.changed == 0, f"second run changed {second.changed} things"


def test_host_shutdown_gives_the_trainer_its_stop_timeout(pve, play) -> None:
    """A host reboot stops CT 200 with its startup down= timeout (180 s when unset), then kills it: the CT's
    timeout must cover the trainer unit's TimeoutStopSec (a checkpoint save) plus the rest of its shutdown."""
    run = play(trainer_service_timeout_stop_sec=900)
    assert run.rc == 0, run.error()
    ct = pve.ct(200)
    ct.shutdown_secs = 900 + 30  # the save takes the whole stop timeout, then the rest stops
    assert pve.host_shutdown("pve1") == {200: "clean"}, f"CT 200 startup is {ct.config.get('startup')!r}"


def test_shutdown_timeout_below_the_trainers_stop_timeout_is_refused(pve, play) -> None:
    run = play(trainer_service_timeout_stop_sec=900, ct_shutdown_timeout_s=600)
    assert run.rc != 0
    assert "ct_shutdown_timeout_s=600 is below" in run.error() and "900" in run.error()
    assert pve.ct(200) is None


def test_a_restarted_api_keeps_the_template_and_the_ct(pve, play, tmp_path: Path, _fakepve_pki) -> None:
    """A real host keeps its storage and /etc/pve across a restart of its API; the lab's daemon keeps them in
    state.json, so L2 against a restarted one uploads no template and changes nothing
    (docs/container-layers.md#how-l2-works)."""

    assert play().rc == 0
    state = tmp_path / "state.json"
    pve.state_path = state
    pve.save_state()
    LabFakePve.state_path = state  # read by the next server at start
    try:
        restarted = plugin._serve({"user": "root@pam", "password": "secret", "time_scale": 0}, _fakepve_pki)
    finally:
        LabFakePve.state_path = None
    try:
        assert restarted.pve.ct(200) is not None, "the restarted API lost CT 200"
        run = play(pve_api_port=restarted.pve.port)
        uploads = [r for r in restarted.pve.requests if r[1].endswith("/upload")]
    finally:
        restarted.stop()
    assert run.rc == 0, run.error()
    assert not uploads, "the template was uploaded again"
    assert run.changed == 0, f"L2 against the restarted API changed {run.changed} things"


def mounts(config: dict) -> dict[str, str]:
    return {k: v for k, v in config.items() if k.startswith("mp") and k[2:].isdigit()}


def test_mount_points_are_bind_mpn_entries_kept_exactly(pve, play, lab, tmp_path: Path) -> None:
    """ct_mount_points become bind mpN entries through pct (root@pam only, as devN); a rerun changes nothing,
    a storage volume mount point stays, a bind at a CT path no longer listed goes, and a host directory that
    is missing or a relative path is refused before anything is set, naming it."""
    shared = tmp_path / "mnt-pve-shared"
    shared.mkdir()
    wanted = [{"host_path": str(shared), "path": "/mnt/dflash-shared"}]
    run = play(ct_mount_points=wanted, ct_device_mode="auto")
    assert run.rc == 0, run.error()
    assert list(mounts(pve.ct(200).config).values()) == [f"{shared},mp=/mnt/dflash-shared"]
    # What a site adds by hand: a volume (data, never touched) and a bind the inventory does not list.
    pve.ct(200).config["mp1"] = "local-lvm:vm-200-disk-1,mp=/data,size=8G"
    pve.ct(200).config["mp2"] = "/srv/old,mp=/mnt/old"
    again = play(ct_mount_points=[*wanted, {**wanted[0], "path": "/mnt/ro", "read_only": True}])
    assert again.rc == 0, again.error()
    assert mounts(pve.ct(200).config) == {
        "mp0": f"{shared},mp=/mnt/dflash-shared",
        "mp1": "local-lvm:vm-200-disk-1,mp=/data,size=8G",
        "mp2": f"{shared},mp=/mnt/ro,ro=1",
    }
    same = play(ct_mount_points=[*wanted, {**wanted[0], "path": "/mnt/ro", "read_only": True}])
    assert same.rc == 0 and same.changed == 0, same.error()
    missing = play(ct_mount_points=[{"host_path": str(tmp_path / "nope"), "path": "/mnt/x"}])
    assert missing.rc != 0 and f"host_path {tmp_path / 'nope'}" in missing.error()
    assert "/mnt/x" not in str(pve.ct(200).config)
    relative = play(ct_mount_points=[{"host_path": str(shared), "path": "mnt/x"}])
    assert relative.rc != 0 and "ct_mount_points must be a list of" in relative.error()
    # Raw mode (no pct, no root@pam): the lines Proxmox would write for them, owned by the role, once each.
    both = [*wanted, {**wanted[0], "path": "/mnt/ro", "read_only": True}]
    raw = play(ct_mount_points=both, ct_device_mode="raw")
    assert raw.rc == 0, raw.error()
    lines = Path(lab["ct_pve_conf_dir"], "200.conf").read_text().splitlines()
    assert [ln for ln in lines if " none bind,create=dir" in ln or " none ro,bind,create=dir" in ln] == [
        f"lxc.mount.entry: {shared} mnt/dflash-shared none bind,create=dir 0 0",
        f"lxc.mount.entry: {shared} mnt/ro none ro,bind,create=dir 0 0",
    ]
    assert play(ct_mount_points=both, ct_device_mode="raw").changed == 0


# ------------------------------------------------------------------ API tasks that take time

GB = 1024**3


def template_on_host(pve, lab, gb: float) -> str:
    """The lab's template already on the host's storage, recorded at the size of a cuda image (upload skipped:
    proxmox_template finds it). A create from it takes LabFakePve's create_secs for that size."""
    name = Path(lab["ct_template_src"]).name
    pve.store_file("local", name, int(gb * GB), "vztmpl")
    return f"local:vztmpl/{name}"


def create_tasks(pve) -> list[dict]:
    return [t for t in pve.tasklog if t["type"] == "vzcreate" and t["id"] == "200"]


def test_a_create_longer_than_the_api_timeout_is_waited_for(pve, play, lab) -> None:
    """A 6 GB cuda template takes about 2 minutes to unpack, longer than pve_api_timeout_s (30 s): the create
    waits on its task (ct_create_timeout_s) instead of failing while the host goes on creating. Scaled: the
    API timeout 2 s, the create 125 PVE s = 6 s."""
    template_on_host(pve, lab, 6)
    run = play(pve_api_timeout_s=2)
    assert run.rc == 0, run.error()
    ct = pve.ct(200)
    assert ct is not None and ct.status == "running" and not ct.lock
    assert [t["exitstatus"] for t in create_tasks(pve)] == ["OK"]
    assert "still running: pve_container : API | create the CT" in run.out, "no progress while the create ran"
    again = play(pve_api_timeout_s=2)
    assert again.rc == 0 and again.changed == 0, again.error()


def test_a_rerun_waits_for_a_create_still_running(pve, play, lab) -> None:
    """A run that gave up on a long create (or two runs at once) leaves the create task running and CT 200
    locked (create): the next run waits for that task, then configures the CT, instead of failing on the
    lock."""
    from proxmoxer import ProxmoxAPI

    volid = template_on_host(pve, lab, 10)  # 205 PVE s = 10 s
    api = ProxmoxAPI(pve.host, port=pve.port, user="root@pam", password="secret", verify_ssl=False)
    api.nodes("pve1").lxc.create(
        vmid=200, ostemplate=volid, hostname="ct200", unprivileged=0, rootfs="local-lvm:8", memory=4096
    )
    assert pve.ct(200).lock == "create"
    run = play()
    assert run.rc == 0, run.error()
    ct = pve.ct(200)
    assert ct.status == "running" and not ct.lock
    assert "hwaddr=BC:24:11:AA:BB:CC" in ct.config["net0"], "the CT was not configured after the create"
    assert len(create_tasks(pve)) == 1, "a second create was started"


def test_a_ct_left_locked_by_a_dead_create_is_one_clear_error(pve, play) -> None:
    """A create whose task died (host rebooted, task killed) leaves `lock: create` and no task: one line that
    names the lock and the two ways out."""
    pve.add_ct(200, status="stopped", config={"lock": "create"}, defaults=False)
    run = play()
    assert run.rc != 0
    error = run.error()
    assert "CT 200 on pve1 is locked (create)" in error and "no create task runs" in error, error
    assert "pct destroy 200" in error and "pct unlock 200" in error, error
    assert pve.ct(200).config == {"lock": "create"}, "the role changed a half-made CT"


def test_check_mode_creates_nothing_and_finds_nothing_to_change(pve, play, lab) -> None:
    """--check before the CT exists says it would create it and touches nothing; after the create, --check
    with a changed raw line neither restarts nor changes the CT."""
    template_on_host(pve, lab, 1)
    dry = play("--check")
    assert dry.rc == 0, dry.error()
    assert pve.ct(200) is None and not create_tasks(pve), "check mode created the CT"
    assert "would be created from local:vztmpl/" in dry.out
    assert play().rc == 0
    ct = pve.ct(200)
    started = ct.started_at
    again = play("--check", ct_shm_size_mb=768)
    assert again.rc == 0, again.error()
    assert ct.status == "running" and ct.started_at == started and not shutdowns(pve), "check mode restarted"


# ------------------------------------------------------------------ restart that waits for the trainer


def shutdowns(pve) -> list[bytes]:
    return [body for method, path, body in pve.requests if method == "POST" and path.endswith("/shutdown")]


def test_restart_after_a_config_change_waits_for_the_trainers_save(pve, play) -> None:
    """A changed raw line restarts CT 200 (the handler). The trainer needs 300 PVE s to save its checkpoint,
    more than PVE's 60 s shutdown default (pve-container src/PVE/API2/LXC/Status.pm vm_shutdown: timeout
    default 60): the handler shuts the CT down with ct_shutdown_timeout_s (TimeoutStopSec + margin), waits for
    the task, and starts it again."""
    assert play(trainer_service_timeout_stop_sec=900).rc == 0
    ct = pve.ct(200)
    ct.shutdown_secs = 300
    run = play(trainer_service_timeout_stop_sec=900, ct_shm_size_mb=768, ct_start_timeout_s=10)
    assert run.rc == 0, run.error()
    assert ct.status == "running", f"CT 200 is {ct.status} after the restart"
    assert getattr(ct, "stop_kind", None) == "clean", "the checkpoint save was cut"
    assert [b for b in shutdowns(pve) if b"timeout=1020" in b], f"shutdown requests: {shutdowns(pve)}"


def test_a_restart_whose_shutdown_outlives_its_timeout_says_the_ct_state_and_what_to_run(pve, play) -> None:
    """The trainer's stop takes longer than ct_shutdown_timeout_s: the shutdown task fails (no forceStop, so
    the save is not cut: the CT goes on stopping), and the play stops with one line naming the CT's state and
    the commands to run; the role never kills the CT."""
    assert play(trainer_service_timeout_stop_sec=60).rc == 0
    ct = pve.ct(200)
    ct.shutdown_secs = 400  # ct_shutdown_timeout_s = 60 + 120 = 180
    run = play(trainer_service_timeout_stop_sec=60, ct_shm_size_mb=768)
    assert run.rc != 0
    error = run.error()
    assert "did not shut down within 180 s (ct_shutdown_timeout_s" in error, error
    assert "CT 200 on pve1 is" in error and "pct start 200" in error, error
    assert getattr(ct, "stop_kind", None) != "killed", "the role killed the CT"


def test_the_stand_in_shutdown_honours_its_timeout(pve) -> None:
    """The contract the restart relies on (pve-container src/PVE/LXC.pm vm_stop, vm_reboot): a shutdown
    longer than its timeout fails without forceStop while the CT goes on stopping; a reboot (`pct reboot`,
    60 s by default: lxc-stop's own default) kills it."""
    from proxmoxer import ProxmoxAPI

    api = ProxmoxAPI(pve.host, port=pve.port, user="root@pam", password="secret", verify_ssl=False)
    node = api.nodes("pve1")

    def wait(upid: str) -> dict:
        for _ in range(400):
            status = node.tasks(upid).status.get()
            if status["status"] == "stopped":
                return status
            time.sleep(0.05)
        raise AssertionError(f"task {upid} still running")

    a = pve.add_ct(201, "a", status="running")
    a.shutdown_secs = 100
    assert wait(node.lxc(201).status.shutdown.post())["exitstatus"] == "container did not stop"
    assert a.status == "running", "the CT stopped at once"
    time.sleep(100 * LAB_TIME_SCALE)
    assert a.status == "stopped" and a.stop_kind == "clean"
    b = pve.add_ct(202, "b", status="running")
    b.shutdown_secs = 100
    assert wait(node.lxc(202).status.reboot.post())["exitstatus"] == "OK"
    assert b.status == "running" and b.stop_kind == "killed"
    running = node.tasks.get(vmid=202, source="active")
    assert running == [] and node.tasks.get(vmid=202)[0]["status"] == "OK"


def test_a_feature_change_on_a_running_ct_restarts_it(pve, play) -> None:
    """A running CT takes a features change only at its next start (pve-container src/PVE/LXC/Config.pm:
    `features` is not in $LXC_FASTPLUG_OPTIONS, vmconfig_hotplug_pending leaves it pending): L2 restarts it,
    as for a changed device or raw line, so that the flag (nesting for the unit's sandboxing) applies now."""
    assert play().rc == 0
    ct = pve.ct(200)
    started = ct.started_at
    run = play(ct_features=["nesting=1", "keyctl=1"])
    assert run.rc == 0, run.error()
    assert not ct.pending, f"still pending after L2: {ct.pending}"
    assert ct.config["features"] == "keyctl=1,nesting=1", ct.config.get("features")  # as PVE writes it
    assert ct.status == "running" and ct.started_at != started, "CT 200 was not restarted"
    assert play(ct_features=["nesting=1", "keyctl=1"]).changed == 0
