#!/usr/bin/env python3
"""Adds to each pin of a lock the sha256 of every file pip would install for it, so that the lock
installs with `pip install --require-hashes` (scripts/locks.py describes the format). The pins themselves
never move: a pin that a source does not offer at exactly its version is an error naming it.

Sources, each asked with `pip install --dry-run --no-deps --report` (nothing is installed):
  local  pip's configuration on this machine (`pip config list`): its find-links folder offers the CPU
         build of torch, its local indexes mirror PyPI's files;
  pypi   PyPI alone (`pip --isolated`): what a machine without that configuration installs.
A pin gets the union of both sources' hashes: the cpu lock accepts the local CPU torch wheel and PyPI's
torch of the same version (whose CUDA libraries only requirements-cuda.lock pins), and every other file that
both offer is the same file with the same hash. Runs on the CT image's platform (Linux x86_64, Python 3.11),
where pip picks exactly the wheels the image and the venvs install.

Usage: hash_lock.py LOCK [LOCK...]   (rewrites each LOCK in place, whole or not at all)
"""

from __future__ import annotations

import sys
from pathlib import Path

from locks import Lock, LockError, canonical, check_platform, pip_report, plain_pins, read_lock, write_lock

SOURCES = {"local": (), "pypi": ("--isolated",)}


def source_hashes(lock: Lock, source: str) -> dict[str, str]:
    """canonical name -> sha256 of the file SOURCE offers for each pin."""
    found: dict[str, str] = {}
    for item in pip_report(plain_pins(lock), "--no-deps", *SOURCES[source]):
        name = canonical(item.name)
        pin = lock.by_name().get(name)
        if pin is None or item.version.split("+", 1)[0] != pin.version.split("+", 1)[0]:
            raise LockError(f"{source}: pip picked {item.name}=={item.version}, which the lock does not pin")
        if item.sha256 is None:
            raise LockError(f"{source}: no sha256 for {item.name}=={item.version} from {item.url}")
        found[name] = item.sha256
    return found


def add_hashes(lock: Lock, path: Path) -> Lock:
    per_source = {source: source_hashes(lock, source) for source in SOURCES}
    for pin in lock.pins:
        digests = [
            per_source[s][canonical(pin.name)] for s in SOURCES if canonical(pin.name) in per_source[s]
        ]
        if not digests:
            raise LockError(f"{path}: no source offers {pin.name}=={pin.version}")
        pin.hashes = list(dict.fromkeys(digests))  # union, first source first, no repeats
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
        several = sum(len(p.hashes) > 1 for p in lock.pins)
        print(f"lock: hashed {path} ({len(lock.pins)} pins, {several} with more than one accepted file)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
