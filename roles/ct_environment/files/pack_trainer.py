#!/usr/bin/env python3
"""Packs the trainer package (pyproject.toml + src/) as a reproducible sdist-shaped .tar.gz for pip.

Same sources, same bytes: members sorted, mtimes and owners fixed, no __pycache__ or egg-info. Prints the
archive's sha256; rewrites DEST (through DEST.partial and a rename) only when the bytes differ, and says so
on stderr ("changed"). Usage: pack_trainer.py TRAINER_DIR DEST.tar.gz
"""

import gzip
import hashlib
import io
import sys
import tarfile
from pathlib import Path

SKIP = ("__pycache__", ".egg-info", ".pyc")


def pack(trainer: Path) -> bytes:
    sources = (p for p in (trainer / "src").rglob("*") if p.is_file() and not any(s in str(p) for s in SKIP))
    files = [trainer / "pyproject.toml", *sorted(sources)]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(f"dflash-trainer/{path.relative_to(trainer)}")
            data = path.read_bytes()
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def main() -> int:
    trainer, dest = Path(sys.argv[1]), Path(sys.argv[2])
    if not (trainer / "pyproject.toml").is_file():
        print(f"pack_trainer: {trainer}/pyproject.toml: no such file", file=sys.stderr)
        return 1
    blob = pack(trainer)
    if not dest.exists() or dest.read_bytes() != blob:
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        partial.write_bytes(blob)
        partial.rename(dest)
        print("changed", file=sys.stderr)
    print(hashlib.sha256(blob).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
