"""dflash-train.service runs with least privilege (roles/trainer_service/templates/hardening.j2), read
from the running processes' /proc as the kernel enforces it, not from the unit file: the trainer's own user,
no way back to root (NoNewPrivs), no capabilities, a read-only system except its own directories, and no read
access to the secrets and S3 credentials of root. The secrets file is written so that systemd's parser gives
back every value as it was."""

from __future__ import annotations

import json
import shlex

import yaml

from tests.l5_service.lab import REPO
from tests.l5_service.test_service import START_S
from tests.verify.test_l5_service import FIND_TRAINER_SECRET

DEFAULTS = yaml.safe_load((REPO / "roles/trainer_service/defaults/main.yml").read_text())
USER = DEFAULTS["trainer_service_user"]
UID = DEFAULTS["trainer_service_uid"]


def status_fields(ct, pid: str) -> dict[str, str]:
    text = ct.sh(f"cat /proc/{pid}/status").stdout
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def trainer_pids(ct) -> list[str]:
    """The launcher (MainPID) and every rank under it."""
    main = ct.show("MainPID")
    ranks = ct.sh(f"pgrep -P {main}", check=False).stdout.split()
    return [main, *ranks]


def test_the_running_trainer_is_its_own_user_without_privileges(fresh):
    ct = fresh
    ct.sh("systemctl start dflash-train", timeout=START_S)
    try:
        pids = trainer_pids(ct)
        assert len(pids) == 3, pids  # the launcher and the lab's two ranks
        for pid in pids:
            f = status_fields(ct, pid)
            assert f["Uid"].split() == [str(UID)] * 4, (pid, f["Uid"])
            assert f["NoNewPrivs"].strip() == "1", (pid, f["NoNewPrivs"])
            assert int(f["CapBnd"], 16) == 0 and int(f["CapEff"], 16) == 0, (pid, f["CapBnd"], f["CapEff"])
        # ProtectSystem=strict: / is read-only in the ranks' mount namespace, their state directory is not.
        rank = pids[1]
        state = "/var/lib/dflash-svc-test/train/.probe"
        probe = ct.sh(
            f"nsenter -t {rank} -m sh -c 'touch /usr/lib/.dflash-probe; echo usr=$?;"
            f" touch {state} && rm {state}; echo state=$?'",
            check=False,
        ).stdout.split()
        assert probe == ["usr=1", "state=0"], probe
    finally:
        ct.sh("systemctl stop dflash-train", check=False)


def test_the_trainers_user_cannot_read_roots_secrets(fresh):
    ct = fresh
    for path in ("/etc/dflash/secrets.env", "/etc/dflash/aws/credentials"):
        if ct.sh(f"test -e {path}", check=False).returncode != 0:
            continue  # L4's credentials exist where L4 ran (make provision), not in every lab
        read = ct.sh(f"runuser -u {USER} -- cat {path}", check=False)
        assert read.returncode != 0 and "Permission denied" in read.stderr, (path, read.stdout)


def test_a_secret_with_quotes_hash_and_dollar_arrives_unchanged(ct):
    value = "a#b \"c\" 'd' $HOME `e` f\\g"
    try:
        ct.converge("-e", json.dumps({"trainer_service_secrets": {"DFLASH_PROBE_SECRET": value}}))
        got = ct.sh(
            "systemd-run --quiet --wait --pipe -p EnvironmentFile=/etc/dflash/secrets.env"
            " /usr/bin/printenv DFLASH_PROBE_SECRET"
        ).stdout
        assert got == value + "\n", (got, value)
        # Written, read by systemd, never anywhere else: not in the journal, a command line or another file.
        found = ct.sh(f"python3 -c {shlex.quote(FIND_TRAINER_SECRET)} /etc/dflash/secrets.env").stdout.split()
        assert found == ["1"], f"the secret appears in: {found[1:]}"
    finally:
        ct.converge()


# What the unit's hardening adds in the unprivileged CT, and what the CT enforces already (the directive is
# then silently redundant there: ProtectKernelTunables, ProtectControlGroups, ProtectKernelLogs,
# RestrictRealtime).
ENFORCED_BY_THE_UNIT = [
    "run as root",
    "gain privileges (NoNewPrivs 0)",
    "hold capabilities",
    "write /usr",
    "write /etc",
    "read /root",
    "see other /tmp files",
    "new user namespace",
    "change personality",
]
ENFORCED_BY_THE_CT = ["write /proc/sys", "write /sys/fs/cgroup", "read /dev/kmsg", "realtime scheduling"]
HARDENING_KEYS = [
    "User",
    "Group",
    "SupplementaryGroups",
    "UMask",
    "NoNewPrivileges",
    "CapabilityBoundingSet",
    "AmbientCapabilities",
    "ProtectSystem",
    "PrivateTmp",
    "ProtectHome",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectHostname",
    "RestrictAddressFamilies",
    "RestrictNamespaces",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "LockPersonality",
    "SystemCallArchitectures",
]


def probe(ct, props: list[str]) -> dict[str, str]:
    args = " ".join(f"-p {shlex.quote(p)}" for p in props)
    out = ct.sh(f"systemd-run --quiet --wait --pipe {args} /usr/local/sbin/dflash-probe-hardening").stdout
    return dict(line.rsplit(": ", 1) for line in out.splitlines())


def test_what_the_hardening_enforces_and_what_the_unprivileged_ct_enforces_already(ct):
    script = (REPO / "tests/l5_service/probe_hardening.sh").read_text()
    tool = "/usr/local/sbin/dflash-probe-hardening"
    ct.sh(f"cat > {tool} <<'EOF'\n{script}EOF\nchmod 0755 {tool}")
    ct.sh(": > /tmp/.dflash-probe-outside")
    unit = ct.sh("systemctl cat dflash-train.service").stdout.splitlines()
    props = [line for line in unit if line.split("=", 1)[0] in HARDENING_KEYS]
    assert len({p.split("=", 1)[0] for p in props}) == len(HARDENING_KEYS), props
    try:
        plain, hardened = probe(ct, []), probe(ct, props)
    finally:
        ct.sh("rm -f /usr/local/sbin/dflash-probe-hardening /tmp/.dflash-probe-outside", check=False)
    assert {k: plain[k] for k in ENFORCED_BY_THE_UNIT} == dict.fromkeys(ENFORCED_BY_THE_UNIT, "allowed"), (
        plain
    )
    assert {k: hardened[k] for k in ENFORCED_BY_THE_UNIT} == dict.fromkeys(ENFORCED_BY_THE_UNIT, "refused"), (
        hardened
    )
    for k in ENFORCED_BY_THE_CT:
        assert plain[k] == hardened[k] == "refused", (k, plain[k], hardened[k])
