"""L4 data, inside CT 200: the shards synced from S3 and the target model staged in /dev/shm, both
matching their manifests. Reads what the roles deployed (/etc/dflash/*.sync.json, the unit): any inventory."""

from __future__ import annotations

import json
import re
import shlex

import pytest

GROUP = "training_cts"

SYNC_CONFIGS = "/etc/dflash/*.sync.json"
UNIT = "dflash-stage-model.service"
AWS_DIR = "/etc/dflash/aws"

# Sizes of every manifest entry, compared inside the container in one round trip (no hashing: 52 GB is slow).
CHECK_SIZES = r"""
import json, os, re, sys
d, name = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(d, name)))
bad = [e["path"] for e in m["files"] if not os.path.isfile(os.path.join(d, e["path"]))
       or os.path.getsize(os.path.join(d, e["path"])) != e["size"]]
listed = {e["path"] for e in m["files"]} | {name}
extra = [os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs]
extra = [p for p in extra if p not in listed and not p.startswith(".dflash-sync")]
print(json.dumps({"files": len(m["files"]), "bad": bad, "extra": extra}))
"""


FIND_SECRET = r"""
import configparser, glob, os, subprocess, sys
c = configparser.ConfigParser(); c.read(sys.argv[1])
key = c["default"]["aws_secret_access_key"].strip()
places = glob.glob("/etc/dflash/*.sync.json") + glob.glob("/etc/dflash/aws/config")
places += glob.glob("/etc/systemd/system/dflash-*") + glob.glob("/etc/systemd/system/dflash-*.d/*")
places += glob.glob("/var/lib/dflash/*/.dflash-sync.json")
hits = [p for p in places if os.path.isfile(p) and key in open(p, errors="replace").read()]
journal = subprocess.run(["journalctl", "--no-pager", "-o", "cat"], capture_output=True, text=True).stdout
hits += ["the journal"] if key in journal else []
for cmd in glob.glob("/proc/[0-9]*/cmdline"):
    try:
        hits += [cmd] if key.encode() in open(cmd, "rb").read() else []
    except OSError:
        pass
print(" ".join(hits))
"""


def sync_configs(host) -> list[dict]:
    out = host.run(f'for f in {SYNC_CONFIGS}; do [ -f "$f" ] && cat "$f"; echo; done').stdout
    return [json.loads(chunk) for chunk in re.split(r"\n(?=\{)", out.strip()) if chunk.strip()]


def exec_start(host) -> list[str]:
    value = host.run(f"systemctl show {UNIT} -p ExecStart --value").stdout
    m = re.search(r"argv\[\]=(.*?) ;", value)
    assert m, f"{UNIT}: no ExecStart ({value.strip()!r})"
    return shlex.split(m.group(1))


def arg(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_awscli_is_installed(host) -> None:
    for conf in sync_configs(host) or [{"aws": "/usr/bin/aws"}]:
        result = host.run(f"{conf['aws']} --version")
        assert result.rc == 0, f"{conf['aws']}: {result.stderr.strip()}"
        assert result.stdout.startswith("aws-cli/")


def test_s3_credentials_are_root_only(host) -> None:
    directory, creds = host.file(AWS_DIR), host.file(f"{AWS_DIR}/credentials")
    assert directory.is_directory and directory.user == "root" and directory.mode == 0o700
    assert creds.is_file and creds.user == "root" and creds.group == "root"
    assert creds.mode == 0o600, f"{creds.path} has mode {oct(creds.mode)}"


def test_no_secret_outside_the_credentials_file(host) -> None:
    """The secret key is looked for, inside the container, in the other files, the journal and every command
    line; only the names of the places holding it come back (never the value)."""
    result = host.run(f"python3 -c {shlex.quote(FIND_SECRET)} {AWS_DIR}/credentials")
    assert result.rc == 0, result.stderr.strip().splitlines()[-1:]
    assert result.stdout.split() == [], f"the S3 secret key appears in: {result.stdout.split()}"


def test_sync_configs_are_deployed(host) -> None:
    dests = {c["dest"] for c in sync_configs(host)}
    assert dests, f"no {SYNC_CONFIGS}: roles/shard_sync did not run"


def test_synced_directories_match_their_manifests(host) -> None:
    for conf in sync_configs(host):
        dest, name = conf["dest"], conf.get("manifest", "MANIFEST.json")
        assert host.file(f"{dest}/{name}").is_file, f"{dest}/{name}: missing, the last sync did not complete"
        result = host.run(f"python3 -c {shlex.quote(CHECK_SIZES)} {shlex.quote(dest)} {shlex.quote(name)}")
        assert result.rc == 0, result.stderr.strip().splitlines()[-1:]
        report = json.loads(result.stdout)
        assert report["files"] > 0, f"{dest}/{name} lists no files"
        assert not report["bad"], f"{dest}: wrong size or missing: {report['bad'][:5]}"
        assert not report["extra"], f"{dest}: files the manifest does not list: {report['extra'][:5]}"


def test_staging_unit_runs_at_every_boot(host) -> None:
    unit = host.service(UNIT)
    assert unit.is_enabled, f"{UNIT} is not enabled"
    wanted_by = host.run(f"systemctl show {UNIT} -p WantedBy -p Type -p RemainAfterExit").stdout
    assert "Type=oneshot" in wanted_by and "RemainAfterExit=yes" in wanted_by
    assert host.file(f"/etc/systemd/system/multi-user.target.wants/{UNIT}").is_symlink


def test_staging_unit_succeeded(host) -> None:
    state = host.run(f"systemctl show {UNIT} -p ActiveState -p Result").stdout.split()
    assert sorted(state) == ["ActiveState=active", "Result=success"], (
        f"{UNIT}: {state}; see journalctl -u {UNIT}"
    )


def test_staged_model_is_on_tmpfs(host) -> None:
    dest = arg(exec_start(host), "--dest")
    fstype = host.run(f"stat -f -c %T {shlex.quote(dest)}").stdout.strip()
    assert fstype == "tmpfs", f"{dest} is on {fstype}, not on /dev/shm's tmpfs"


def test_staged_model_matches_its_manifest(host) -> None:
    argv = exec_start(host)
    result = host.run(shlex.join([*argv, "--check"]))
    assert result.rc == 0, (result.stdout + result.stderr).strip().splitlines()[-1:]


@pytest.mark.parametrize("what", ["--source", "--dest"])
def test_staging_paths_exist(host, what: str) -> None:
    path = arg(exec_start(host), what)
    assert host.file(path).is_directory, f"{what} {path} is not a directory"
