"""preflight's checkpoint-dir check: a file created and removed in train.checkpoint_dir (or the parent it will
be made in), and one line naming the directory, its owner and the trainer's uid when that fails.

The tests run as root, and root writes anywhere on a plain directory; what stops the trainer on a real host is
(1) a shared storage bound into an unprivileged CT, whose root is host uid 100000 (pve-container
src/PVE/LXC.pm: `lxc.idmap = u 0 100000 65536`), so host root's directory belongs to nobody inside; and (2) a
read-only mount. Both are made here for real: a forked child in a user namespace with the CT's id map, and a
read-only bind mount in a private mount namespace (`unshare -m`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_trainer.service import preflight

CLONE_NEWUSER = 0x10000000
CT_ROOT = 100000  # pve-container's default map: the CT's uid 0 is host uid 100000


def context(checkpoint_dir: Path) -> preflight.Context:
    ctx = preflight.Context(Path("train.toml"), 1)
    ctx.cfg = SimpleNamespace(train=SimpleNamespace(checkpoint_dir=checkpoint_dir))  # type: ignore[assignment]
    return ctx


def outcome(checkpoint_dir: Path) -> dict[str, str]:
    """The check's result as a dict: {"ok": line} or {"detail": ..., "fix": ...}."""
    try:
        return {"ok": preflight.check_checkpoint_dir(context(checkpoint_dir))}
    except preflight.Failed as e:
        return {"detail": e.detail, "fix": e.fix}


def as_unprivileged_ct_root(fn: Callable[[], dict[str, str]]) -> dict[str, str]:
    """fn() in a forked child that is root of a user namespace mapped as an unprivileged CT (0 -> 100000,
    65536 ids): its root's capabilities reach only files whose owner the map covers, as in the CT."""
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a new user namespace, mapped by the parent, then uid 0 in it
        try:
            if libc.unshare(CLONE_NEWUSER) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
            os.write(ready_w, b"1")
            os.read(go_r, 1)
            os.setgroups([])
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            result = fn()
        except BaseException as e:  # reported to the parent, never raised in a forked pytest
            result = {"error": repr(e)}
        os.write(out_w, json.dumps(result).encode())
        os._exit(0)
    os.close(ready_w)
    os.close(out_w)
    try:
        assert os.read(ready_r, 1) == b"1", "the child could not make a user namespace"
        for kind in ("uid_map", "gid_map"):
            Path(f"/proc/{pid}/{kind}").write_text(f"0 {CT_ROOT} 65536\n")
        os.write(go_w, b"1")
        os.waitpid(pid, 0)
        data = b""
        while chunk := os.read(out_r, 65536):
            data += chunk
    finally:
        for fd in (ready_r, go_r, go_w, out_r):
            os.close(fd)
    result = json.loads(data)
    assert "error" not in result, result["error"]
    return result


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory host root made, as on a fresh NFS/CephFS storage, where the CT's root can reach it
    (pytest's tmp_path lies under a 0700 directory that the CT's root could not enter)."""
    base = Path(tempfile.mkdtemp(prefix="dflash-ckpt-", dir="/tmp"))
    base.chmod(0o755)
    directory = base / "dflash-shared"
    directory.mkdir(mode=0o755)
    yield directory
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.system  # root's powers: a user namespace with an id map, chown, mount
def test_host_roots_directory_is_refused_for_the_unprivileged_cts_root(shared: Path) -> None:
    result = as_unprivileged_ct_root(lambda: outcome(shared / "checkpoints"))
    assert "detail" in result, f"the CT's root wrote into host root's directory: {result}"
    line = result["detail"]
    assert line.startswith(f"train.checkpoint_dir {shared / 'checkpoints'}: cannot create a file in {shared}")
    assert "(Permission denied)" in line
    assert "owner uid 65534 (an owner this CT does not map" in line  # host uid 0, seen from the CT
    assert line.endswith("the trainer runs as uid 0"), line
    assert "ct_uid: 0 in ct_mount_points" in result["fix"]
    assert list(shared.iterdir()) == []


@pytest.mark.system  # root's powers: a user namespace with an id map, chown, mount
def test_the_directory_chowned_to_the_cts_root_passes_and_keeps_nothing(shared: Path) -> None:
    os.chown(shared, CT_ROOT, CT_ROOT)  # what roles/pve_container does for a mount point with ct_uid: 0
    result = as_unprivileged_ct_root(lambda: outcome(shared / "checkpoints"))
    assert result == {"ok": f"{shared}: uid 0 created and removed a file there"}, result
    assert list(shared.iterdir()) == []


READ_ONLY_PROBE = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from dflash_trainer.service import preflight
ctx = preflight.Context(Path("train.toml"), 1)
ctx.cfg = SimpleNamespace(train=SimpleNamespace(checkpoint_dir=Path(sys.argv[1])))
try:
    print(json.dumps({"ok": preflight.check_checkpoint_dir(ctx)}))
except preflight.Failed as e:
    print(json.dumps({"detail": e.detail, "fix": e.fix}))
"""


@pytest.mark.system  # root's powers: a user namespace with an id map, chown, mount
def test_a_read_only_mount_is_refused_even_for_root(shared: Path) -> None:
    remount = f"mount --bind {shared} {shared} && mount -o remount,ro,bind {shared}"
    namespace = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{remount} && exec "$0" "$@"']
    proc = subprocess.run(
        [*namespace, sys.executable, "-c", READ_ONLY_PROBE, str(shared)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "detail" in result, f"root wrote into a read-only mount: {result}"
    assert f"cannot create a file in {shared} (Read-only file system): owner uid 0," in result["detail"]
    assert list(shared.iterdir()) == []


def test_a_failed_write_leaves_the_disk_check_to_it(shared: Path) -> None:
    """One failure line, not two: the disk check steps aside when the directory cannot be written."""
    ctx = context(shared)
    ctx.facts.update(checkpoint_dir_writable=False, target=object())
    with pytest.raises(preflight.Skipped, match="checkpoint-dir"):
        preflight.check_disk(ctx)
