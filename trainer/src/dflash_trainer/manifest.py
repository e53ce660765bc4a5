"""File manifests: each file's relative path, size and sha256, as JSON; used to check staged data and models.

`check` compares sizes only unless full=True: a size check of 45 shards is instant, hashing 52 GB is not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST_NAME = "MANIFEST.json"
_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(directory: Path) -> dict:
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return {
        "version": 1,
        "files": [
            {"path": p.relative_to(directory).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in files
        ],
    }


def write_manifest(directory: Path, out: Path | None = None) -> Path:
    """Writes the manifest of `directory` (default: DIR/MANIFEST.json) atomically; returns its path."""
    out = Path(out) if out else Path(directory) / MANIFEST_NAME
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(build_manifest(directory), indent=1) + "\n")
    tmp.replace(out)
    return out


def check_manifest(directory: Path, manifest: Path | None = None, *, full: bool = False) -> list[str]:
    """Problems found (empty: the directory matches). Files not in the manifest are ignored."""
    directory = Path(directory)
    manifest = Path(manifest) if manifest else directory / MANIFEST_NAME
    try:
        entries = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return [f"{manifest}: no manifest"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{manifest}: not a manifest ({e})"]
    problems = []
    for entry in entries:
        path = directory / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{entry['path']}: size {path.stat().st_size}, manifest says {entry['size']}")
        elif full and sha256_file(path) != entry["sha256"]:
            problems.append(f"{entry['path']}: sha256 differs from the manifest")
    return problems
