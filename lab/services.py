"""Loopback daemons of the lab: fakepve (the Proxmox API double), moto's S3 server, the alerts' webhook
receiver and Prometheus (scraping the lab CT's node_exporter).

Each runs in its own session with a pid file and a log under lab_dir; `up` starts what is down,
restarts what is up but not answering, and refuses a port that another process holds.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lab.errors import LabError
from lab.progress import say
from lab.settings import REPO, LabSettings

START_TIMEOUT_S = 30


@dataclass(frozen=True)
class Daemon:
    name: str
    argv: list[str]
    host: str
    port: int
    url: str
    port_key: str  # the inventory variable that moves it
    signature: str  # an argument of its command line that tells our process from another one on the port
    # Called just before a start: writes what the daemon reads and returns its extra environment.
    prepare: Callable[[], dict[str, str]] = field(default=dict)


def write_secret(path: Path, value: str) -> None:
    """Root-only file, written under a temporary name first so a reader never sees half a secret."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    os.replace(tmp, path)


def secret(settings: LabSettings, name: str) -> str:
    """A lab credential: random on first use, then stable for the life of the lab."""
    path = settings.secrets_dir / name
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(24))
    return path.read_text()


def fakepve(settings: LabSettings) -> Daemon:
    state = settings.lab_dir / "fakepve" / "guests.json"

    def prepare() -> dict[str, str]:
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"guests": []}) + "\n")  # fakepve keeps its state in memory only
        # The password travels in the environment, never on a command line (ps shows those).
        return {
            "PVE_USER": "root@pam",
            "PVE_PASS": secret(settings, "pve_password"),
            "PYTHONPATH": str(REPO),
        }

    return Daemon(
        name="fakepve",
        # lab/fakepve_daemon.py: fakepve with uploads the size of the CT image allowed.
        argv=[
            sys.executable,
            "-m",
            "lab.fakepve_daemon",
            str(state),
            "--host",
            settings.fakepve_host,
            "--port",
            str(settings.fakepve_port),
            # Tasks take time as on a host (lab/fakepve_daemon.py LAB_TIME_SCALE): a 120 s create takes 6 s.
            "--time-scale",
            "0.05",
        ],
        host=settings.fakepve_host,
        port=settings.fakepve_port,
        url=f"https://{settings.fakepve_host}:{settings.fakepve_port}/api2/json/version",
        port_key="lab_fakepve_port",
        signature="lab.fakepve_daemon",
        prepare=prepare,
    )


def s3(settings: LabSettings) -> Daemon:
    bindir = Path(sys.executable).parent
    return Daemon(
        name="s3",
        argv=[str(bindir / "moto_server"), "-H", settings.s3_host, "-p", str(settings.s3_port)],
        host=settings.s3_host,
        port=settings.s3_port,
        url=f"http://{settings.s3_host}:{settings.s3_port}/",
        port_key="lab_s3_port",
        signature="moto_server",
    )


def webhook(settings: LabSettings) -> Daemon:
    """The training alerts' endpoint (lab/webhook_receiver.py): the lab CT shares this machine's network."""
    from lab import webhook_receiver as wr

    return Daemon(
        name="webhook",
        argv=[
            sys.executable,
            "-m",
            "lab.webhook_receiver",
            str(webhook_log(settings)),
            "--host",
            wr.HOST,
            "--port",
            str(wr.PORT),
        ],
        host=wr.HOST,
        port=wr.PORT,
        url=f"http://{wr.HOST}:{wr.PORT}/",
        port_key="trainer_alerts_webhook_url",
        signature="lab.webhook_receiver",
        prepare=lambda: {"PYTHONPATH": str(REPO)},
    )


def prometheus(settings: LabSettings) -> Daemon:
    """Debian's Prometheus scraping the lab CT's node_exporter (lab/prometheus.py)."""
    from lab import prometheus as pm

    return Daemon(
        name="prometheus",
        argv=pm.argv(settings),
        host=pm.HOST,
        port=pm.PORT,
        url=f"http://{pm.HOST}:{pm.PORT}/-/ready",
        port_key="lab/prometheus.py PORT",
        signature="/usr/bin/prometheus",
        prepare=lambda: pm.prepare(settings),
    )


def webhook_log(settings: LabSettings) -> Path:
    return settings.lab_dir / "webhook" / "received.jsonl"


def daemons(settings: LabSettings) -> list[Daemon]:
    return [fakepve(settings), s3(settings), webhook(settings), prometheus(settings)]


def pidfile(settings: LabSettings, name: str) -> Path:
    return settings.run_dir / f"{name}.pid"


def pid_of(settings: LabSettings, name: str, signature: str) -> int | None:
    """The PID in NAME's pid file while that process runs with signature in its command line."""
    try:
        pid = int(pidfile(settings, name).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    return pid if any(arg.endswith(signature.encode()) for arg in cmdline) else None


def our_pid(settings: LabSettings, d: Daemon) -> int | None:
    return pid_of(settings, d.name, d.signature)


def answering(d: Daemon) -> bool:
    ctx = ssl._create_unverified_context()  # fakepve's certificate is self-signed
    try:
        urllib.request.urlopen(d.url, timeout=3, context=ctx)
    except urllib.error.HTTPError:
        return True  # an HTTP status (401 without a ticket) is an answer
    except (urllib.error.URLError, OSError):
        return False
    return True


def port_owner(host: str, port: int) -> str | None:
    """'PID (name)' of whatever listens on host:port, 'unknown' when something does but ss cannot say."""
    with socket.socket() as sock:
        sock.settimeout(1)
        if sock.connect_ex((host, port)) != 0:
            return None
    out = subprocess.run(
        ["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=False
    ).stdout
    for part in out.split("users:((")[1:]:
        name, pid = part.split(",")[0].strip('"'), part.split("pid=")[1].split(",")[0]
        return f"PID {pid} ({name})"
    return "an unknown process"


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.3)
    return False


def ensure_daemon(settings: LabSettings, d: Daemon) -> bool:
    pid = our_pid(settings, d)
    if pid is not None and answering(d):
        return False
    if pid is not None:
        say(f"lab: {d.name} (PID {pid}) is not answering on {d.url}; restarting it")
        stop_daemon(settings, d)
    owner = port_owner(d.host, d.port)
    if owner is not None:
        raise LabError(
            f"{d.name}: {d.host}:{d.port} is already taken by {owner}; stop it or set {d.port_key} "
            f"in {settings.inventory}"
        )
    proc = spawn(settings, d.name, d.argv, d.prepare())
    came_up = wait_until(lambda: proc.poll() is not None or answering(d), START_TIMEOUT_S)
    if not came_up or proc.poll() is not None:
        stop_daemon(settings, d)
        raise LabError(
            f"{d.name}: did not come up on {d.url} within {START_TIMEOUT_S} s; {log_tail(settings, d.name)}"
        )
    return True


def spawn(settings: LabSettings, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Starts NAME in its own session (so its whole group can be ended), logging to lab_dir/log/NAME.log,
    with its pid file."""
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    with open(settings.log_dir / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    pidfile(settings, name).write_text(f"{proc.pid}\n")
    return proc


def log_tail(settings: LabSettings, name: str) -> str:
    """'PATH: its last line', for an error about NAME."""
    path = settings.log_dir / f"{name}.log"
    tail = path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
    return f"{path}: {tail[0]}"


def end(settings: LabSettings, name: str, pid: int | None) -> bool:
    """Ends NAME's process group (SIGTERM, SIGKILL after 10 s) and drops its pid file; False when none ran."""
    pidfile(settings, name).unlink(missing_ok=True)
    if pid is None:
        return False
    os.killpg(pid, signal.SIGTERM)
    if not wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10):
        os.killpg(pid, signal.SIGKILL)
    return True


def stop_daemon(settings: LabSettings, d: Daemon) -> bool:
    return end(settings, d.name, our_pid(settings, d))
