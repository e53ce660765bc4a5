"""L5 service: dflash-train.service installed, enabled and shaped as docs/design.md section 6 says."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

GROUP = "training_cts"
UNIT = "dflash-train.service"
STAGE = "dflash-stage-model.service"
DEFAULTS = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "roles/trainer_service/defaults/main.yml").read_text()
)


def props(host, *names: str) -> dict[str, str]:
    out = host.check_output(f"systemctl show {UNIT} " + " ".join(f"-p {n}" for n in names))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_unit_installed_and_enabled(host):
    assert host.file(f"/etc/systemd/system/{UNIT}").exists
    assert host.service("dflash-train").is_enabled


def test_smoke_helper_installed(host):
    assert host.file("/usr/local/sbin/dflash-smoke").mode == 0o755


def test_configuration_present(host):
    cfg = host.file("/etc/dflash/train.toml")
    assert cfg.exists and cfg.user == "root"
    assert "[model]" in cfg.content_string and "[train]" in cfg.content_string


def test_secrets_file_root_only(host):
    secrets = host.file("/etc/dflash/secrets.env")
    assert secrets.exists and secrets.user == "root" and secrets.group == "root" and secrets.mode == 0o600


def configured(host, key: str) -> str:
    """KEY= as the unit's files set it (fragment, then drop-ins: the last assignment wins), '' when unset."""
    lines = host.check_output(f"systemctl cat {UNIT}").splitlines()
    values = [line.split("=", 1)[1].strip() for line in lines if line.startswith(f"{key}=")]
    return values[-1] if values else ""


def test_notify_watchdog_restart(host):
    p = props(host, "Type", "NotifyAccess", "Restart", "StartLimitBurst", "StartLimitIntervalUSec")
    assert p["Type"] == "notify" and p["NotifyAccess"] == "all"
    # From the unit's files, not `systemctl show -p WatchdogUSec`: systemd 252 shows the watchdog of the last
    # start, which for a unit it loaded at boot (the image's vendor copy) and never started reads "infinity"
    # across daemon-reloads until the first start.
    watchdog = configured(host, "WatchdogSec")
    assert watchdog not in ("0", "infinity", ""), f"WatchdogSec is {watchdog or 'unset'}"
    assert p["Restart"] == "on-failure" and int(p["StartLimitBurst"]) >= 1
    assert p["StartLimitIntervalUSec"] not in ("0", "")


def test_stop_kill_and_limits(host):
    p = props(host, "KillMode", "TimeoutStopUSec", "OOMPolicy", "LimitMEMLOCK", "SyslogIdentifier")
    assert p["KillMode"] == "mixed" and p["OOMPolicy"] == "kill"
    assert p["LimitMEMLOCK"] == "infinity"
    assert p["SyslogIdentifier"] == "dflash-train"
    assert p["TimeoutStopUSec"] not in ("0", "")


def test_preflight_before_start_and_secrets_file(host):
    text = host.check_output(f"systemctl cat {UNIT}")
    assert "ExecStartPre=" in text and " preflight " in text
    assert "EnvironmentFile=/etc/dflash/secrets.env" in text


def test_requires_the_model_staging(host, hostvars):
    """The inventory decides (the role's default: required), and the unit must say exactly that: a unit
    installed without the dependency where the inventory wants it fails here, it is never skipped."""
    want = hostvars.get(
        "trainer_service_requires_stage_model", DEFAULTS["trainer_service_requires_stage_model"]
    )
    p = props(host, "Requires", "After")
    requires, after = p["Requires"].split(), p["After"].split()
    if want:
        assert STAGE in requires and STAGE in after, (
            f"{UNIT} lacks Requires=/After={STAGE} (Requires={p['Requires']!r}); "
            "the inventory wants it (trainer_service_requires_stage_model)"
        )
    else:
        assert STAGE not in requires, (
            f"{UNIT} requires {STAGE} but the inventory sets trainer_service_requires_stage_model: false"
        )


def test_unit_runs_the_trainer_without_privileges(host):
    """What the unit asks systemd for; test_the_running_trainer_is_its_own_user_without_privileges
    (tests/l5_service/test_hardening.py) reads what the kernel enforces on the running ranks."""
    p = props(
        host,
        "User",
        "NoNewPrivileges",
        "CapabilityBoundingSet",
        "ProtectSystem",
        "PrivateTmp",
        "UMask",
        "RestrictSUIDSGID",
    )
    assert p["User"] == DEFAULTS["trainer_service_user"] and p["User"] != "root"
    assert p["NoNewPrivileges"] == "yes" and p["CapabilityBoundingSet"] == ""
    assert p["ProtectSystem"] == "strict" and p["PrivateTmp"] == "yes" and p["UMask"] == "0027"
    assert p["RestrictSUIDSGID"] == "yes"
    if host.service("dflash-train").is_running:  # on a host that trains: the launcher as the kernel sees it
        pid = host.check_output(f"systemctl show -p MainPID --value {UNIT}")
        status = dict(
            line.split(":", 1) for line in host.file(f"/proc/{pid}/status").content_string.splitlines()
        )
        assert status["NoNewPrivs"].strip() == "1" and int(status["CapBnd"], 16) == 0


# Every value of the trainer's secrets file (as systemd reads it: KEY="value" with \\ \" \` \$ escapes) looked
# for in the journal, every command line and the other files under /etc/dflash and /etc/systemd/system; only
# the names of the places holding one come back, never a value. Values under 8 characters are not looked for.
FIND_TRAINER_SECRET = r"""
import glob, re, subprocess, sys
values = []
for line in open(sys.argv[1]):
    m = re.match(r'^[A-Za-z_][A-Za-z0-9_]*="((?:[^"\\]|\\.)*)"\s*$', line)
    if m:
        values.append(re.sub(r'\\(.)', r'\1', m.group(1)))
values = [v for v in values if len(v) >= 8]
places = [p for p in glob.glob("/etc/dflash/**", recursive=True) + glob.glob("/etc/systemd/system/*")
          if p != sys.argv[1] and not p.endswith("/aws/credentials")]
hits = []
for p in places:
    try:
        text = open(p, errors="replace").read()
    except OSError:
        continue
    hits += [p] if any(v in text for v in values) else []
journal = subprocess.run(["journalctl", "--no-pager", "-o", "cat"], capture_output=True, text=True).stdout
hits += ["the journal"] if any(v in journal for v in values) else []
for cmd in glob.glob("/proc/[0-9]*/cmdline"):
    try:
        data = open(cmd, "rb").read()
    except OSError:
        continue
    hits += [cmd] if any(v.encode() in data for v in values) else []
print(len(values), " ".join(hits))
"""


def secret_places(host, path: str = "/etc/dflash/secrets.env") -> tuple[int, list[str]]:
    """How many secrets the file holds, and where else any of them appears."""
    out = host.check_output(f"python3 -c {shlex.quote(FIND_TRAINER_SECRET)} {path}").split()
    return int(out[0]), out[1:]


def test_no_trainer_secret_outside_its_file(host):
    _, hits = secret_places(host)
    assert hits == [], f"a value of /etc/dflash/secrets.env appears in: {hits}"
