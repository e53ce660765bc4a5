#!/usr/bin/env python3
"""Adds to each pin of a lock the sha256 of the file pip installs for it here, so that the lock installs
with `pip install --require-hashes` (scripts/locks.py describes the format). The pins themselves never
move: a pin that pip does not offer at exactly its version is an error naming it.

Source: what `pip install --dry-run --no-deps --report` picks with pip's configuration on this machine
(`pip config list`; nothing is installed): its find-links folder offers the CPU build of torch, its local
indexes mirror PyPI's files (the same files, the same hashes). Only the file pip picks here is hashed, not
every file the indexes offer: pip ranks a candidate whose index URL carries an allowed hash above a
find-links file, whose URL carries none, so a lock that also listed PyPI's (CUDA) torch would make pip take
that one over the CPU wheel. Runs on the CT image's platform (Linux x86_64, Python 3.11), where pip picks
exactly the wheels the image and the venvs install. The cuda lock's hashes are PyPI's (cuda_lock.py).

Usage: hash_lock.py LOCK [LOCK...]   (rewrites each LOCK in place, whole or not at all)
"""

from __future__ import annotations

import sys
from pathlib import Path

from locks import Lock, LockError, canonical, check_platform, pip_report, plain_pins, read_lock, write_lock


def add_hashes(lock: Lock, path: Path) -> Lock:
    found: dict[str, str] = {}
    for item in pip_report(plain_pins(lock), "--no-deps"):
        name = canonical(item.name)
        pin = lock.by_name().get(name)
        if pin is None or item.version.split("+", 1)[0] != pin.version.split("+", 1)[0]:
            raise LockError(f"pip picked {item.name}=={item.version}, which the lock does not pin")
        if item.sha256 is None:
            raise LockError(f"no sha256 for {item.name}=={item.version} from {item.url}")
        found[name] = item.sha256
    for pin in lock.pins:
        if canonical(pin.name) not in found:
            raise LockError(f"{path}: pip offers no file for {pin.name}=={pin.version}")
        pin.hashes = [found[canonical(pin.name)]]
    return lock


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    check_platform("hash_lock")
    for arg in argv:
        path = Path(arg)
        try:
            lock = add_hashes(read_lock(path), path)
        except LockError as err:
            print(f"hash_lock: {path}: {err}", file=sys.stderr)
            return 1
        write_lock(lock, path)
        print(f"lock: hashed {path} ({len(lock.pins)} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
