#!/usr/bin/python3
"""dflash-stage-model: stage the target model from persistent storage into /dev/shm, checked by manifest.

SOURCE is a directory on disk holding the model and MANIFEST.json ({"version": 1, "files": [{"path", "size",
"sha256"}, ...]}, the format of `dflash-train manifest DIR`). DEST (in /dev/shm) ends up holding exactly those
files plus the manifest. Run by dflash-stage-model.service after every boot, since /dev/shm starts empty.

- Nothing to do when DEST already holds the same manifest and every file has its size (--verify size, the
  default, instant) or its size and sha256 (--verify full, reads everything).
- Otherwise it refuses before copying anything when the file system of DEST is too small (sizes in the
  message), copies into DEST.staging-PID next to DEST while hashing every byte, compares with the manifest,
  and only then replaces DEST by a rename: a reader never sees a half-staged model.
- --check only says whether DEST is valid (exit 0) or not (exit 1); it changes nothing.
- --config FILE reads the same settings from a JSON object ({"source", "dest", "manifest", "verify",
  "workers"}; flags given as well win): the file roles/model_stage writes beside the unit, so the trainer
  unit's ExecStartPre (a /dev/shm emptied without a reboot is restaged before the trainer loads) and L4's
  content check run exactly the staging of the unit.
- While it copies or hashes, a line every 10 s says how far it is.

Standard library only (it runs before any venv matters), and dflash_manifest.py installed beside it: the
manifest format's one module (trainer/src/dflash_trainer/manifest.py). Exit status: 0 done, 1 error (one
line), 2 usage.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import dflash_manifest as manifest

PROG = "dflash-stage-model"
PROGRESS_S = float(os.environ.get("DFLASH_STAGE_PROGRESS_S", "10"))  # a progress line at least this often
CONFIG_KEYS = {"source": str, "dest": str, "manifest": str, "verify": str, "workers": int}


class Progress:
    """Bytes done so far (added from worker threads), printed every PROGRESS_S seconds while work runs."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n

    def _beat(self) -> None:
        while not self.stop.wait(PROGRESS_S):
            say(
                f"{self.what}: {human(self.done)} of {human(self.total)} "
                f"({time.monotonic() - self.started:.0f} s)"
            )

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


class StageError(Exception):
    """One line naming the thing at fault."""


def say(msg: str) -> None:
    print(f"{PROG}: {msg}", flush=True)


human = manifest.human_bytes


def copy_hashing(src: Path, dst: Path, progress: Progress | None = None) -> tuple[int, str]:
    """Copies src to dst; returns (bytes, sha256 of the bytes read), so the copy is checked with one read."""
    h = hashlib.sha256()
    buf = bytearray(manifest.CHUNK)
    view = memoryview(buf)
    size = 0
    make_dirs(dst.parent)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while n := fin.readinto(buf):
            h.update(view[:n])
            fout.write(view[:n])
            size += n
            if progress is not None:
                progress.add(n)
    os.chmod(dst, 0o644)
    return size, h.hexdigest()


def make_dirs(path: Path) -> None:
    """mkdir -p with 0755 whatever the caller's umask (an ansible or lxc-attach shell's 077 would leave the
    model readable by root only, and the trainer runs as its own user)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for p in missing:
        os.chmod(p, 0o755)


def tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def mountpoint(path: Path) -> Path:
    path = path.resolve()
    while path.parent != path and path.parent.stat().st_dev == path.stat().st_dev:
        path = path.parent
    return path


class Stager:
    def __init__(self, args: argparse.Namespace) -> None:
        self.source = Path(args.source)
        self.dest = Path(args.dest)
        self.manifest_name = args.manifest
        self.full = args.verify == "full"
        self.workers = max(1, min(args.workers, os.cpu_count() or 1))

    def problems(self, directory: Path, entries: list[dict], *, full: bool, limit: int = 3) -> list[str]:
        out = []
        for e in entries:
            p = directory / e["path"]
            if not p.is_file():
                out.append(f"{p}: missing")
            elif p.stat().st_size != e["size"]:
                out.append(f"{p}: size {p.stat().st_size}, the manifest says {e['size']}")
            if len(out) >= limit:
                return out
        if full and not out:
            total = sum(e["size"] for e in entries)
            with (
                Progress(f"hashing {directory}", total) as progress,
                concurrent.futures.ThreadPoolExecutor(self.workers) as pool,
            ):
                digests = pool.map(
                    lambda e: manifest.sha256_file(directory / e["path"], progress.add), entries
                )
                for e, d in zip(entries, digests, strict=True):
                    if d != e["sha256"]:
                        out.append(f"{directory / e['path']}: sha256 differs from the manifest")
        return out[:limit]

    def staged_is_valid(self, entries: list[dict], manifest_bytes: bytes) -> list[str]:
        staged_manifest = self.dest / self.manifest_name
        if not self.dest.is_dir():
            return [f"{self.dest}: not staged"]
        try:
            if staged_manifest.read_bytes() != manifest_bytes:
                return [f"{staged_manifest}: differs from the source's manifest (a new model)"]
        except OSError:
            return [f"{staged_manifest}: missing (staging was interrupted)"]
        return self.problems(self.dest, entries, full=self.full)

    def strays(self) -> list[Path]:
        return sorted(self.dest.parent.glob(f"{self.dest.name}.staging-*"))

    def run(self, check_only: bool) -> int:
        manifest_path = self.source / self.manifest_name
        entries = manifest.read_manifest(manifest_path)
        manifest_bytes = manifest_path.read_bytes()  # copied byte for byte: its sha256 is pinned
        need = sum(e["size"] for e in entries)
        mode = "size and sha256 checked" if self.full else "size checked"
        bad = self.staged_is_valid(entries, manifest_bytes)
        if not bad:
            say(f"{self.dest}: already staged: {len(entries)} files, {human(need)}, {mode}; nothing to do")
            return 0
        if check_only:
            say(f"{self.dest}: not valid: {'; '.join(bad)}")
            return 1
        say(f"{self.dest}: staging needed: {'; '.join(bad)}")
        missing = self.problems(self.source, entries, full=False)
        if missing:
            raise StageError(
                f"model store {self.source} does not match {manifest_path}: {'; '.join(missing)}"
            )
        parent = self.dest.parent
        if not parent.is_dir() and not parent.parent.is_dir():
            raise StageError(f"{parent.parent}: no such directory (is /dev/shm mounted?)")
        fs = os.statvfs(parent if parent.is_dir() else parent.parent)
        free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        reclaim = tree_bytes(self.dest) + sum(tree_bytes(p) for p in self.strays())
        if need > free + reclaim:
            mount = mountpoint(parent if parent.is_dir() else parent.parent)
            old = f", {human(reclaim)} more once the old copy is removed" if reclaim else ""
            raise StageError(
                f"{mount} is too small for {self.dest}: the model needs {human(need)} ({need} bytes), "
                f"{mount} has {human(free)} ({free} bytes) free of {human(size)}{old}; nothing was copied: "
                f"raise the container's /dev/shm size (ct_shm_size_mb) or free space in it"
            )
        for p in [*self.strays(), self.dest]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        make_dirs(parent)
        tmp = parent / f"{self.dest.name}.staging-{os.getpid()}"
        tmp.mkdir()
        os.chmod(tmp, 0o755)
        started = time.monotonic()
        try:
            self.copy_all(entries, tmp, manifest_path)
            (tmp / self.manifest_name).write_bytes(manifest_bytes)
            os.chmod(tmp / self.manifest_name, 0o644)
            os.rename(tmp, self.dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        elapsed = time.monotonic() - started
        say(
            f"{self.dest}: staged {len(entries)} files ({human(need)}) from {self.source} in {elapsed:.1f} s "
            f"({need / max(elapsed, 1e-6) / 1e9:.2f} GB/s), every file's sha256 checked"
        )
        return 0

    def copy_all(self, entries: list[dict], tmp: Path, manifest_path: Path) -> None:
        total = sum(e["size"] for e in entries)
        with Progress(f"copying {self.source} to {self.dest}", total) as progress:
            self._copy_all(entries, tmp, manifest_path, progress)

    def _copy_all(self, entries: list[dict], tmp: Path, manifest_path: Path, progress: Progress) -> None:
        def one(e: dict) -> tuple[dict, int, str]:
            return (e, *copy_hashing(self.source / e["path"], tmp / e["path"], progress))

        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            for e, size, digest in pool.map(one, sorted(entries, key=lambda e: -e["size"])):
                if size != e["size"]:
                    raise StageError(
                        f"{self.source / e['path']}: read {size} bytes, {manifest_path} says {e['size']}"
                    )
                if digest != e["sha256"]:
                    raise StageError(
                        f"{self.source / e['path']}: sha256 differs from {manifest_path} "
                        f"(the store is corrupt or the manifest is wrong); nothing was staged"
                    )
                if e["size"] >= 256 << 20:
                    say(f"copied {e['path']} ({human(size)})")


def apply_config(args: argparse.Namespace) -> None:
    """Fills unset flags from --config, then the defaults; StageError naming the file and key otherwise."""
    settings: dict = {}
    if args.config:
        path = Path(args.config)
        try:
            settings = json.loads(path.read_text())
        except FileNotFoundError:
            raise StageError(f"{path}: no such file (written by roles/model_stage, layer L4)") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StageError(f"{path}: not a JSON settings file ({e})") from None
        if not isinstance(settings, dict):
            raise StageError(f"{path}: not a JSON object")
        for key, value in settings.items():
            kind = CONFIG_KEYS.get(key)
            if kind is None:
                raise StageError(f"{path}: unknown key {key!r} (known: {', '.join(CONFIG_KEYS)})")
            if not isinstance(value, kind) or isinstance(value, bool):
                raise StageError(f"{path}: {key} must be a {kind.__name__}, got {value!r}")
    defaults = {"manifest": "MANIFEST.json", "verify": "size", "workers": 4}
    for key in CONFIG_KEYS:
        if getattr(args, key) is None:
            setattr(args, key, settings.get(key, defaults.get(key)))
    for key in ("source", "dest"):
        if getattr(args, key) is None:
            raise StageError(f"--{key} is needed (or --config with {key!r})")
    if args.verify not in ("size", "full"):
        raise StageError(f"verify {args.verify!r}: choose size or full")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="JSON file with the settings below (flags given as well win)")
    parser.add_argument("--source", help="model directory on persistent storage")
    parser.add_argument("--dest", help="staged copy, e.g. /dev/shm/dflash/model")
    parser.add_argument("--manifest", default=None, help="manifest name in SOURCE (default MANIFEST.json)")
    parser.add_argument(
        "--verify", choices=["size", "full"], default=None, help="check of an existing copy (default size)"
    )
    parser.add_argument(
        "--full", dest="verify", action="store_const", const="full", help="same as --verify full"
    )
    parser.add_argument("--check", action="store_true", help="only say whether DEST is valid; change nothing")
    parser.add_argument("--workers", type=int, default=None, help="files copied and hashed at once (4)")
    args = parser.parse_args(argv)
    try:
        apply_config(args)
        if not os.path.isabs(args.dest) or len(Path(args.dest).parts) < 3:
            raise StageError(f"dest {args.dest!r}: must be an absolute path at least two levels deep")
        if not os.path.isabs(args.source):
            raise StageError(f"source {args.source!r}: must be an absolute path")
        return Stager(args).run(args.check)
    except (StageError, manifest.ManifestError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
