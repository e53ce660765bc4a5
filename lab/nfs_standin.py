"""The lab's shared storage: a directory of this machine served through FUSE with the permission rules of an
NFS export (AUTH_SYS), mounted where the lab's host and CTs bind it (lab/settings.py shared_storage_dir).

Why not a plain directory: in an unprivileged CT, root (host uid 100000) holds CAP_DAC_OVERRIDE and
CAP_CHOWN in its user namespace, and the kernel honours them on a local file system for every file of a
mapped owner. An NFS server never sees those capabilities, only the caller's uid and gids, so on a real host
the CT's root can neither write into the trainer's directory nor give a file away. The lab must refuse the
same (a stand-in kinder than the host hides bugs).

What is imitated, from Linux's knfsd (upstream fs/nfsd):
- auth.c nfsd_setuser: the request runs with the client's uid, gid and groups; uid 0 is mapped to the
  anonymous uid 65534 under root_squash (the export's default), and every capability but those of uid 0 with
  no_root_squash is dropped (cap_drop_nfsd_set).
- vfs.c nfsd_permission -> inode_permission: mode bits against that uid and those groups, owner first, then
  group, then other; search (x) on each directory of a lookup (nfsd_lookup), write and search on the parent
  to create, remove or rename (nfsd_create, nfsd_unlink, nfsd_rename), the sticky bit's owner rule.
- vfs.c nfsd_setattr -> notify_change -> setattr_prepare: chown to another uid needs CAP_CHOWN (uid 0 only);
  chgrp by the owner to one of the caller's groups; chmod and explicit times by the owner only.
- New files belong to the caller's uid and gid (the parent's gid under a setgid directory).

The caller's uid and gid come from FUSE's request header (fuse_get_context), as host ids: the kernel maps a
CT's ids through its user namespace, as an NFS client sends them. Its supplementary groups are read from
/proc/PID/status (AUTH_SYS carries up to 16). Without the mount option default_permissions the kernel leaves
every check to this daemon, as an NFS client leaves them to the server (Documentation/filesystems/fuse.rst).

Run as root: `python -m lab.nfs_standin EXPORT_DIR MOUNTPOINT [--root-squash]`; unmount with `umount`.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FSTYPE = "fuse.labnfs"  # what findmnt prints for the mount (roles/training_job checks it is shared)
NOBODY = 65534  # knfsd's default anonuid/anongid
READ, WRITE, SEARCH = 4, 2, 1


@dataclass(frozen=True)
class Caller:
    """The credential a request runs with on the server."""

    uid: int
    gid: int
    groups: frozenset[int]

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def caller_on_server(uid: int, gid: int, groups: frozenset[int], root_squash: bool) -> Caller:
    """nfsd_setuser: root becomes nobody under root_squash; groups travel with the request."""
    if root_squash and uid == 0:
        return Caller(NOBODY, NOBODY, frozenset())
    return Caller(uid, gid, groups | {gid})


def allowed(caller: Caller, st_mode: int, st_uid: int, st_gid: int, want: int) -> bool:
    """generic_permission with the server's credential: the class of the caller picks the bits (owner, group,
    other, in that order, never the next class on a miss). Only uid 0 (not squashed) passes everything, and
    searches or executes a file only where some x bit is set."""
    if caller.is_root:
        return not (want & SEARCH) or stat.S_ISDIR(st_mode) or bool(st_mode & 0o111)
    if caller.uid == st_uid:
        bits = (st_mode >> 6) & 7
    elif st_gid in caller.groups:
        bits = (st_mode >> 3) & 7
    else:
        bits = st_mode & 7
    return bits & want == want


def may_change_owner(caller: Caller, st_uid: int, st_gid: int, uid: int, gid: int) -> bool:
    """setattr_prepare's chown_ok and chgrp_ok with the server's credential (-1: unchanged)."""
    if caller.is_root:
        return True
    if uid not in (-1, st_uid):
        return False
    return gid in (-1, st_gid) or (caller.uid == st_uid and gid in caller.groups)


def may_remove(caller: Caller, parent: os.stat_result, victim: os.stat_result) -> bool:
    """Removing or replacing an entry: write and search on the parent; in a sticky directory only the owner of
    the entry or of the directory (check_sticky)."""
    if not allowed(caller, parent.st_mode, parent.st_uid, parent.st_gid, WRITE | SEARCH):
        return False
    sticky = parent.st_mode & stat.S_ISVTX
    return not sticky or caller.is_root or caller.uid in (victim.st_uid, parent.st_uid)


def groups_of(pid: int) -> frozenset[int]:
    """The calling process's supplementary groups (host ids), empty once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def _deny(code: int = errno.EACCES) -> OSError:
    return OSError(code, os.strerror(code))


class NfsExport:
    """mfusepy Operations over the export directory; each call checks as knfsd would, then acts as root."""

    use_ns = True

    def __init__(self, export: Path, root_squash: bool) -> None:
        self.export = export
        self.root_squash = root_squash
        self._lock = threading.Lock()  # the chown after a create must not race another create's

    # --- the credential and the checks ---------------------------------------------------------------------
    def caller(self) -> Caller:
        import mfusepy  # type: ignore[import-untyped]  # loads libfuse: imported where it is used

        uid, gid, pid = mfusepy.fuse_get_context()
        return caller_on_server(uid, gid, groups_of(pid), self.root_squash)

    def real(self, path: str) -> str:
        return str(self.export) + path

    def looked_up(self, caller: Caller, path: str) -> None:
        """nfsd_lookup: search permission on every directory from the export's root to the entry's parent."""
        current = str(self.export)
        for part in (p for p in path.split("/") if p):  # each directory searched: the root, ..., the parent
            st = os.lstat(current)
            if not allowed(caller, st.st_mode, st.st_uid, st.st_gid, SEARCH):
                raise _deny()
            current = os.path.join(current, part)

    def check(self, caller: Caller, path: str, want: int) -> os.stat_result:
        self.looked_up(caller, path)
        st = os.lstat(self.real(path))
        if not allowed(caller, st.st_mode, st.st_uid, st.st_gid, want):
            raise _deny()
        return st

    def parent_writable(self, caller: Caller, path: str) -> os.stat_result:
        return self.check(caller, os.path.dirname(path) or "/", WRITE | SEARCH)

    def give_to_caller(self, caller: Caller, path: str, parent: os.stat_result) -> None:
        gid = parent.st_gid if parent.st_mode & stat.S_ISGID else caller.gid
        os.lchown(self.real(path), caller.uid, gid)

    # --- attributes ----------------------------------------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if fh is None:
            self.looked_up(self.caller(), path)
            st = os.lstat(self.real(path))
        else:
            st = os.fstat(fh)
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev", "st_blocks")
        attrs: dict[str, Any] = {k: getattr(st, k) for k in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def access(self, path: str, amode: int) -> int:
        self.check(self.caller(), path, amode & 7)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        caller = self.caller()
        st = self.check(caller, path, 0)
        if not caller.is_root and caller.uid != st.st_uid:
            raise _deny(errno.EPERM)
        os.chmod(self.real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        caller = self.caller()
        st = self.check(caller, path, 0)
        if not may_change_owner(caller, st.st_uid, st.st_gid, uid, gid):
            raise _deny(errno.EPERM)
        os.lchown(self.real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        caller = self.caller()
        st = self.check(caller, path, 0)
        owner = caller.is_root or caller.uid == st.st_uid
        if not owner and (times is not None or not allowed(caller, st.st_mode, st.st_uid, st.st_gid, WRITE)):
            raise _deny(errno.EPERM if times is not None else errno.EACCES)
        if times is None:
            os.utime(self.real(path))
        else:
            os.utime(self.real(path), ns=times, follow_symlinks=False)
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            self.check(self.caller(), path, WRITE)
            os.truncate(self.real(path), length)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self.real(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_frsize")
        return {k: getattr(sv, k) for k in keys} | {"f_namemax": sv.f_namemax}

    # --- directories ---------------------------------------------------------------------------------------
    def readdir(self, path: str, fh: int) -> list[str]:
        self.check(self.caller(), path, READ)
        return [".", "..", *os.listdir(self.real(path))]

    def mkdir(self, path: str, mode: int) -> int:
        caller = self.caller()
        parent = self.parent_writable(caller, path)
        with self._lock:
            os.mkdir(self.real(path), mode)
            self.give_to_caller(caller, path, parent)
        if parent.st_mode & stat.S_ISGID:
            os.chmod(self.real(path), stat.S_IMODE(os.lstat(self.real(path)).st_mode) | stat.S_ISGID)
        return 0

    def removable(self, caller: Caller, path: str) -> None:
        self.looked_up(caller, path)
        if not may_remove(caller, os.lstat(self.real(os.path.dirname(path))), os.lstat(self.real(path))):
            raise _deny()

    def rmdir(self, path: str) -> int:
        self.removable(self.caller(), path)
        os.rmdir(self.real(path))
        return 0

    def unlink(self, path: str) -> int:
        self.removable(self.caller(), path)
        os.unlink(self.real(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        caller = self.caller()
        self.removable(caller, old)
        target_parent = self.parent_writable(caller, new)
        replaced = os.path.lexists(self.real(new))
        if replaced and not may_remove(caller, target_parent, os.lstat(self.real(new))):
            raise _deny()
        os.rename(self.real(old), self.real(new))
        return 0

    def symlink(self, target: str, source: str) -> int:
        caller = self.caller()
        parent = self.parent_writable(caller, target)
        os.symlink(source, self.real(target))
        self.give_to_caller(caller, target, parent)
        return 0

    def readlink(self, path: str) -> str:
        self.looked_up(self.caller(), path)
        return os.readlink(self.real(path))

    def link(self, target: str, source: str) -> int:
        caller = self.caller()
        self.parent_writable(caller, target)
        self.looked_up(caller, source)
        os.link(self.real(source), self.real(target))
        return 0

    # --- files ---------------------------------------------------------------------------------------------
    def open(self, path: str, flags: int) -> int:
        accmode = flags & os.O_ACCMODE
        want = {os.O_RDONLY: READ, os.O_WRONLY: WRITE, os.O_RDWR: READ | WRITE}[accmode]
        if flags & os.O_TRUNC:
            want |= WRITE
        self.check(self.caller(), path, want)
        return os.open(self.real(path), flags & ~(os.O_CREAT | os.O_EXCL))

    def create(self, path: str, mode: int, flags: int) -> int:
        caller = self.caller()
        parent = self.parent_writable(caller, path)
        with self._lock:
            fd = os.open(self.real(path), flags | os.O_CREAT | os.O_EXCL, mode)
            self.give_to_caller(caller, path, parent)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.nfs_standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="the directory the export serves")
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--root-squash", action="store_true", help="map uid 0 to 65534 (an export's default)")
    args = parser.parse_args(argv)
    if not args.export.is_dir() or not args.mountpoint.is_dir():
        sys.exit(f"nfs_standin: {args.export} and {args.mountpoint} must be directories")
    import mfusepy

    os.umask(0)  # the client applied its umask to the modes it sends; the server keeps them as they come
    ops = NfsExport(args.export.resolve(), args.root_squash)
    # allow_other: the CTs' uids are not the mounter's. No default_permissions: the checks are the server's.
    mountpoint = str(args.mountpoint)
    # hard_remove: an unlink removes at once. Without it libfuse hides a file it still counts open
    # (.fuse_hidden*), and the kernel's RELEASE of a closed file comes asynchronously, so a directory emptied
    # right after its files were closed could refuse its rmdir (ENOTEMPTY, seen in the two-CT lab's checkpoint
    # pruning). An NFS client silly-renames only what it really has open.
    options = {"allow_other": True, "fsname": "labnfs", "subtype": "labnfs", "hard_remove": True}
    mfusepy.FUSE(ops, mountpoint, foreground=True, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
