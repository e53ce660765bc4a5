"""The permission rules of the lab's NFS stand-in (lab/nfs_standin.py), as knfsd applies them: the caller's
uid and groups against the mode bits, no capabilities but those of an unsquashed uid 0."""

from __future__ import annotations

import os
import stat

from lab.nfs_standin import (
    NOBODY,
    READ,
    SEARCH,
    WRITE,
    allowed,
    caller_on_server,
    may_change_owner,
    may_remove,
)

DIR = stat.S_IFDIR
CT_ROOT, DFLASH = 100000, 102000  # an unprivileged CT's root and its trainer (uid 2000), as host uids


def who(uid: int, gid: int | None = None, *groups: int, squash: bool = False):
    return caller_on_server(uid, uid if gid is None else gid, frozenset(groups), root_squash=squash)


def test_the_cts_root_is_a_plain_user_on_the_trainers_directory() -> None:
    mode = DIR | 0o750
    assert not allowed(who(CT_ROOT), mode, DFLASH, DFLASH, WRITE | SEARCH)
    assert not allowed(who(CT_ROOT), mode, DFLASH, DFLASH, SEARCH)
    assert allowed(who(DFLASH), mode, DFLASH, DFLASH, READ | WRITE | SEARCH)
    assert allowed(who(0), mode, DFLASH, DFLASH, READ | WRITE | SEARCH)  # host root, no_root_squash


def test_the_class_of_the_caller_picks_the_bits_and_never_falls_through() -> None:
    # The owner with ---rwxrwx is refused what group and other may do (generic_permission checks one class).
    assert not allowed(who(DFLASH), DIR | 0o077, DFLASH, DFLASH, WRITE)
    assert allowed(who(CT_ROOT, 100000, DFLASH), DIR | 0o770, 0, DFLASH, WRITE | SEARCH)  # a group member
    assert not allowed(who(CT_ROOT), DIR | 0o770, 0, DFLASH, SEARCH)


def test_root_squash_makes_host_root_nobody() -> None:
    squashed = who(0, squash=True)
    assert (squashed.uid, squashed.gid) == (NOBODY, NOBODY)
    assert not allowed(squashed, DIR | 0o755, DFLASH, DFLASH, WRITE)
    assert allowed(squashed, DIR | 0o755, DFLASH, DFLASH, READ | SEARCH)


def test_root_executes_only_what_someone_may() -> None:
    assert not allowed(who(0), stat.S_IFREG | 0o644, DFLASH, DFLASH, SEARCH)
    assert allowed(who(0), stat.S_IFREG | 0o744, DFLASH, DFLASH, SEARCH)


def test_only_root_gives_a_file_away_and_the_owner_may_change_its_group_to_its_own() -> None:
    assert not may_change_owner(who(CT_ROOT), DFLASH, DFLASH, CT_ROOT, -1)
    assert not may_change_owner(who(DFLASH), DFLASH, DFLASH, CT_ROOT, -1)
    assert may_change_owner(who(DFLASH), DFLASH, DFLASH, DFLASH, -1)  # to its own owner: a no-op
    assert may_change_owner(who(DFLASH, DFLASH, 5000), DFLASH, DFLASH, -1, 5000)
    assert not may_change_owner(who(DFLASH), DFLASH, DFLASH, -1, 5000)
    assert may_change_owner(who(0), DFLASH, DFLASH, CT_ROOT, CT_ROOT)


def test_removing_in_a_sticky_directory_needs_the_entrys_or_the_directorys_owner() -> None:
    def st(mode: int, uid: int) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, uid, uid, 0, 0, 0, 0))

    shared = st(DIR | 0o1777, 0)
    assert may_remove(who(DFLASH), shared, st(stat.S_IFREG | 0o644, DFLASH))
    assert not may_remove(who(DFLASH), shared, st(stat.S_IFREG | 0o666, CT_ROOT))
    assert not may_remove(who(DFLASH), st(DIR | 0o755, CT_ROOT), st(stat.S_IFREG | 0o666, DFLASH))
