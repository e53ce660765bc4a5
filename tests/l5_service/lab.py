"""The lab container for the service tests: a trainer environment and data of their own, and the L5 role.

Until layer L3 (the trainer venv) and L4 (model, shards) are in every lab, the tests stage their own copies,
so that removing a model file or truncating a shard never touches another layer's data:
- /opt/dflash-svc-test/venv: a hard-linked copy of the repository's .venv-trainer on Debian's python3.11
  (same ABI), with /opt/dflash-svc-test/src (trainer/src, copied each session) on its path;
- /var/lib/dflash-svc-test/{model,shards}: the tiny target and synthetic shards with their manifests.
Then ansible/l5_service.yml converges roles/trainer_service with tests/l5_service/lab_vars.yml.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CT = os.environ.get("DFLASH_SVC_CT", "lab-ct200")
ROOTFS = Path(f"/var/lib/lxc/{CT}/rootfs")
BASE = "/opt/dflash-svc-test"
DATA = "/var/lib/dflash-svc-test"
HOST_CACHE = Path("/var/tmp/dflash-svc-test-data")
TRAINER_PY = REPO / ".venv-trainer" / "bin" / "python"
OPS = REPO / ".venv" / "bin"


def sh(
    cmd: str, *, check: bool = True, timeout: float = 120, ct: str = CT, user: str | None = None
) -> subprocess.CompletedProcess[str]:
    """A shell command inside the container (CT, or another lab container), as root or as user (on shared
    storage the trainer's user: NFS knows the CT's root as a plain user)."""
    if user is not None:
        cmd = f"runuser -u {user} -- /bin/sh -c {shlex.quote(cmd)}"
    proc = subprocess.run(
        ["lxc-attach", "-n", ct, "--", "/bin/sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"in {ct}: `{cmd}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def stage_venv() -> None:
    venv = ROOTFS / BASE.lstrip("/") / "venv"
    if venv.is_symlink():  # a copied worktree .venv-trainer symlink: writing through it edits the original
        venv.unlink()
    if not (venv / ".staged").exists():
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        # The real directory: a worktree's .venv-trainer is a symlink to the main checkout's, and `cp -a` of a
        # symlink copies the link, through which the edits below would rewrite the shared venv.
        source = (REPO / ".venv-trainer").resolve()
        subprocess.run(["cp", "-al", f"{source}/.", str(venv)], check=True)
        if venv.is_symlink() or not (venv / "bin").is_dir() or (venv / "bin").is_symlink():
            raise AssertionError(f"{venv} is not a copy of {source}")
        for name in ("python3", "python"):  # replace the links (never write through a hard link)
            (venv / "bin" / name).unlink()
        (venv / "bin" / "python3").symlink_to("/usr/bin/python3.11")
        (venv / "bin" / "python").symlink_to("python3")
        (venv / "pyvenv.cfg").unlink()
        (venv / "pyvenv.cfg").write_text(
            "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n"
        )
        pth = venv / "lib/python3.11/site-packages/__editable__.dflash_trainer-0.1.0.pth"
        pth.unlink()
        pth.write_text(f"{BASE}/src\n")
        (venv / ".staged").write_text("hard-linked copy of .venv-trainer\n")
    src = ROOTFS / BASE.lstrip("/") / "src"
    src.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "rsync",
            "-a",
            "--delete",
            "--exclude",
            "__pycache__",
            "--exclude",
            "*.egg-info",
            f"{REPO}/trainer/src/",
            f"{src}/",
        ],
        check=True,
    )


def host_data() -> Path:
    """The tiny target and shards, made once on this machine with the trainer's own API."""
    if (HOST_CACHE / ".done").exists():
        return HOST_CACHE
    shutil.rmtree(HOST_CACHE, ignore_errors=True)
    code = f"""
import torch; torch.set_num_threads(1)
from pathlib import Path
from dflash_trainer.fixtures.tiny import write_tiny_target, TINY_MASK_TOKEN_ID
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.manifest import write_manifest
out = Path("{HOST_CACHE}")
m = write_tiny_target(out / "model", kind="qwen3_5", seed=1234)
synth_shards(m, out / "shards", num_shards=2, rows=96, seq_len=32, seed=1234, vocab_size=TINY_MASK_TOKEN_ID)
write_manifest(m); write_manifest(out / "shards")
"""
    subprocess.run([str(TRAINER_PY), "-c", code], check=True, capture_output=True, timeout=600)
    (HOST_CACHE / ".done").write_text("ok\n")
    return HOST_CACHE


def ct_root_ids(ct: str = CT) -> tuple[int, int]:
    """The ids of the CT's root on this machine: 0 for a privileged CT, 100000 for an unprivileged one
    (the first line of its init's uid_map and gid_map)."""
    pid = subprocess.run(
        ["lxc-info", "-n", ct, "-p", "-H"], capture_output=True, text=True, check=True
    ).stdout.strip()
    uid, gid = (int(Path(f"/proc/{pid}/{kind}").read_text().split()[1]) for kind in ("uid_map", "gid_map"))
    return uid, gid


def stage_data() -> None:
    """A fresh copy of the data in the container (tests damage it on purpose), owned by the CT's root as a
    copy made inside it would be (an unprivileged CT's root owns nothing of this machine's root)."""
    src = host_data()
    dest = ROOTFS / DATA.lstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    for part in ("model", "shards"):
        subprocess.run(["rsync", "-a", "--delete", f"{src / part}/", f"{dest / part}/"], check=True)
    uid, gid = ct_root_ids()
    os.chown(dest, uid, gid)  # not -R: the trainer's state directory beside them is the trainer user's
    parts = [str(dest / "model"), str(dest / "shards")]
    subprocess.run(["chown", "-R", f"{uid}:{gid}", *parts], check=True)
    # Readable by the trainer's user, as L4 leaves the staged model and the shards (0644).
    subprocess.run(["chmod", "-R", "a+rX", *parts], check=True)


def playbook(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """ansible/NAME against the lab's inventory, as `make provision` runs it."""
    env = os.environ | {
        "PATH": f"{OPS}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"),
    }
    argv = [str(OPS / "ansible-playbook"), "-i", str(REPO / "inventory/lab"), str(REPO / "ansible" / name)]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, env=env, timeout=600, check=False)


def converge(*extra: str) -> None:
    proc = playbook("l5_service.yml", "-l", CT, "-e", f"@{REPO / 'tests/l5_service/lab_vars.yml'}", *extra)
    if proc.returncode != 0:
        raise AssertionError(f"converge failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")


def prepare() -> None:
    stage_venv()
    stage_data()
    sh(
        "systemctl stop dflash-train dflash-smoke 2>/dev/null; "
        "systemctl reset-failed dflash-train 2>/dev/null; rm -rf /var/lib/dflash-svc-test/train",
        check=False,
    )
    converge()


# ---- reading the unit


def show(prop: str, unit: str = "dflash-train", ct: str = CT) -> str:
    return sh(f"systemctl show -p {prop} --value {unit}", ct=ct).stdout.strip()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def status_step() -> int | None:
    text = show("StatusText")
    if text.startswith("step "):
        return int(text.split()[1])
    return None


def is_leader_status(text: str) -> bool:
    """The drafter leader's STATUS carries the loss ("step N loss ..."); the other ranks' name the leader."""
    return re.match(r"step \d+ loss ", text) is not None


def journal(since_cursor: str | None = None, unit: str = "dflash-train", ct: str = CT) -> str:
    cmd = f"journalctl -u {unit} -o cat --no-pager"
    if since_cursor:
        cmd += f" --after-cursor='{since_cursor}'"
    return sh(cmd, ct=ct).stdout


def cursor(ct: str = CT) -> str:
    out = sh("journalctl -n 1 -o export --no-pager | sed -n 's/^__CURSOR=//p'", ct=ct).stdout.strip()
    return out


def checkpoints(
    directory: str = f"{DATA}/train/checkpoints", ct: str = CT, user: str | None = None
) -> list[int]:
    """The steps of the complete checkpoints in `directory` (in CT, or another lab container), listed as
    root or as user."""
    out = sh(f"ls {directory} 2>/dev/null || true", ct=ct, user=user).stdout.split()
    return sorted(int(n.split("-")[1]) for n in out if n.startswith("step-"))
