"""Test data of the L4 layer in a bucket of its own (dflash-l4-test) on the lab's moto S3.

Deterministic small shards and a tiny safetensors model, each prefix with its MANIFEST.json in the format of
`dflash-train manifest DIR`. `python -m tests.l4_data.s3data seed` makes or repairs them (prints `changed` or
`ok`); the molecule scenario l4-data and tests/l4_data use them, so neither depends on the lab bucket's seed.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from pathlib import Path

from lab.seed import aws
from lab.settings import REPO, load_settings

BUCKET = "dflash-l4-test"
SEED_DIR = Path("/var/tmp/dflash-l4-test/seed")
SHARD_SIZES = [3 << 20, 2 << 20, (1 << 20) + 12345, 777]  # odd sizes on purpose
SETTINGS = load_settings(REPO / "inventory" / "lab")


def manifest_of(directory: Path) -> dict:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    return {
        "version": 1,
        "files": [
            {
                "path": p.relative_to(directory).as_posix(),
                "size": p.stat().st_size,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
            for p in files
        ],
    }


def sha256_of(data: bytes) -> str:
    """A manifest's pin: the sha256 of the file's bytes, as shard_sync_manifest_sha256 holds it."""
    return hashlib.sha256(data).hexdigest()


def write_with_manifest(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = directory / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
    text = json.dumps(manifest_of(directory), indent=1) + "\n"
    manifest = directory / "MANIFEST.json"
    if not manifest.exists() or manifest.read_text() != text:
        manifest.write_text(text)


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A safetensors file by its spec: u64 header length, JSON header, then the raw little-endian data."""
    header, data, offset = {}, b"", 0
    for name, (dtype, shape, raw) in sorted(tensors.items()):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data


def shard_files(seed: int = 8) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"shard-{i:05d}.arrow": rng.randbytes(n) for i, n in enumerate(SHARD_SIZES)}


def model_files(seed: int = 8) -> dict[str, bytes]:
    rng = random.Random(seed + 1)
    tensors = {
        "embed_tokens.weight": ("BF16", [64, 32], rng.randbytes(64 * 32 * 2)),
        "layers.0.mlp.up_proj.weight": ("F32", [48, 32], rng.randbytes(48 * 32 * 4)),
        "norm.weight": ("F32", [32], rng.randbytes(32 * 4)),
    }
    return {
        "config.json": json.dumps({"model_type": "l4-test", "hidden_size": 32}).encode() + b"\n",
        "model.safetensors": safetensors_bytes(tensors),
    }


def ensure_bucket() -> bool:
    changed = False
    if aws(SETTINGS, "s3api", "head-bucket", "--bucket", BUCKET, check=False).returncode != 0:
        aws(SETTINGS, "s3api", "create-bucket", "--bucket", BUCKET)
        changed = True
    return changed


def upload(local: Path, prefix: str) -> bool:
    out = aws(
        SETTINGS, "s3", "sync", "--no-progress", "--delete", str(local), f"s3://{BUCKET}/{prefix}"
    ).stdout
    return bool(out.strip())


def put(prefix: str, name: str, data: bytes) -> None:
    tmp = SEED_DIR.parent / "put.tmp"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    aws(SETTINGS, "s3", "cp", "--no-progress", str(tmp), f"s3://{BUCKET}/{prefix}{name}")
    tmp.unlink()


def seed() -> bool:
    changed = ensure_bucket()
    write_with_manifest(SEED_DIR / "shards", shard_files())
    write_with_manifest(SEED_DIR / "model", model_files())
    changed = upload(SEED_DIR / "shards", "shards/") or changed
    return upload(SEED_DIR / "model", "model/") or changed


if __name__ == "__main__":
    if sys.argv[1:] != ["seed"]:
        sys.exit("usage: python -m tests.l4_data.s3data seed")
    print("changed" if seed() else "ok")
