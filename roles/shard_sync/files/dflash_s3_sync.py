#!/usr/bin/python3
"""dflash-s3-sync: mirror an S3 prefix into a directory with the real awscli, checked against a manifest.

The prefix holds MANIFEST.json: {"version": 1, "files": [{"path": str, "size": int, "sha256": str}, ...]}
(the format of `dflash-train manifest DIR`). Its own sha256 is pinned (--manifest-sha256, from the inventory):
any other manifest is refused before anything local changes, since a manifest from the bucket it checks only
catches corruption, not someone who can write the bucket. The directory ends up holding exactly the files the
manifest lists, each with its size and sha256, plus the manifest byte for byte, written last (so a directory
with MANIFEST.json is complete), and the tool's own dot files (.dflash-sync.json: what was verified; a lock).

- A file that is missing, truncated or corrupt is fetched again; one that matches is never downloaded,
  so a second run transfers the manifest only.
- A sync that was interrupted resumes: complete files are kept, awscli's half-written temporaries and any
  file the manifest does not list are removed.
- A file whose size and mtime are unchanged since it was last hashed is not hashed again unless --full.
- One line per file as it lands, and a progress line every --progress-s seconds on long transfers.

Credentials come from AWS_SHARED_CREDENTIALS_FILE (a root-only file), never from the command line; every
S3 request, the manifest's GET included, goes through awscli and its signer.
Standard library only: it runs on a bare Debian python3, with dflash_manifest.py installed beside it (the
manifest format's one module, trainer/src/dflash_trainer/manifest.py). Exit status: 0 done, 1 error (one
line), 2 usage.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import dflash_manifest as manifest

PROG = "dflash-s3-sync"
# Its own files in the directory: names the manifest format reserves (manifest.RESERVED).
STATE_NAME = manifest.RESERVED + ".json"
LOCK_NAME = manifest.RESERVED + ".lock"
HEX64 = manifest.HEX64
FETCH_ATTEMPTS = 2


class SyncError(Exception):
    """One line naming the thing at fault."""


def say(msg: str) -> None:
    print(f"{PROG}: {msg}", flush=True)


human = manifest.human_bytes
sha256_file = manifest.sha256_file


class Aws:
    def __init__(self, exe: str, endpoint_url: str | None, region: str | None) -> None:
        self.exe, self.endpoint_url, self.region = exe, endpoint_url, region
        if not Path(exe).is_file() or not os.access(exe, os.X_OK):
            raise SyncError(f"awscli {exe}: not installed (set --aws or install awscli)")
        creds = os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
        if creds:
            try:
                mode = os.stat(creds).st_mode
            except OSError as e:
                raise SyncError(f"credentials file {creds}: {e.strerror}") from None
            if mode & 0o077:
                raise SyncError(
                    f"credentials file {creds}: mode {oct(mode & 0o777)} is readable by others; make it 0600"
                )

    def argv(self, *args: str) -> list[str]:
        out = [self.exe]
        if self.endpoint_url:
            out += ["--endpoint-url", self.endpoint_url]
        if self.region:
            out += ["--region", self.region]
        return out + list(args)

    def read(self, uri: str) -> bytes:
        """The object's bytes through `aws s3 cp URI -`; SyncError naming the URI and the cause otherwise."""
        try:
            proc = subprocess.run(
                self.argv("s3", "cp", "--no-progress", uri, "-"),
                capture_output=True,
                check=False,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            raise SyncError(
                f"{uri}: cannot read it: no answer in 300 s from {self.endpoint_url or 'S3'}"
            ) from None
        if proc.returncode != 0:
            raise SyncError(f"{uri}: cannot read it: {self.explain(proc.stderr or proc.stdout)}")
        return proc.stdout

    def explain(self, output: bytes) -> str:
        """awscli's last error line, or what it means when it is one of the usual three."""
        lines = output.decode(errors="replace").strip().splitlines()
        detail = lines[-1].strip() if lines else "awscli failed without a message"
        if re.search(r"\b404\b|Not Found|NoSuchKey|NoSuchBucket", detail):
            return "no such object (is the bucket seeded, the prefix right?)"
        if re.search(r"\b403\b|Forbidden|InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied", detail):
            return f"access denied: check s3_access_key_id / s3_secret_access_key ({detail})"
        if "Could not connect to the endpoint URL" in detail or "Connect timeout" in detail:
            return f"endpoint {self.endpoint_url or 'S3'} unreachable ({detail})"
        return detail


def glob_escape(name: str) -> str:
    """awscli's --include patterns are fnmatch globs: make a literal name match only itself."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


def load_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
        return (
            state if isinstance(state, dict) and isinstance(state.get("verified"), dict) else {"verified": {}}
        )
    except (OSError, json.JSONDecodeError):
        return {"verified": {}}


def write_atomic(path: Path, content: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(content, bytes):
        tmp.write_bytes(content)
    else:
        tmp.write_text(content)
    os.replace(tmp, path)


def check_pin(raw: bytes, uri: str, pinned: str) -> None:
    """The manifest's own sha256 must be the pinned one (from the inventory, not from the bucket): a manifest
    checks the data, the pin checks the manifest, so a writer of the bucket cannot swap both."""
    actual = hashlib.sha256(raw).hexdigest()
    if actual != pinned:
        raise SyncError(
            f"{uri}: sha256 {actual} is not the pinned {pinned}; refusing it and leaving the local copy "
            f"as it is (re-pin the inventory's manifest_sha256 only if this manifest is yours)"
        )


class Syncer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.source = args.source if args.source.endswith("/") else args.source + "/"
        self.dest = Path(args.dest)
        self.manifest_uri = self.source + args.manifest
        self.aws = Aws(args.aws, args.endpoint_url, args.region)
        self.state_path = self.dest / STATE_NAME
        self.workers = max(1, min(8, os.cpu_count() or 1))

    # -- local checks ---------------------------------------------------------------------------------------
    def local_files(self) -> list[Path]:
        return sorted(p for p in self.dest.rglob("*") if p.is_file() or p.is_symlink())

    def remove_strays(self, entries: list[dict]) -> int:
        listed = {e["path"] for e in entries}
        keep = {STATE_NAME, LOCK_NAME, self.args.manifest}
        removed = 0
        for p in self.local_files():
            rel = p.relative_to(self.dest).as_posix()
            if rel in listed or rel in keep:
                continue
            kind = (
                "a half-written download" if re.search(r"\.[0-9A-Fa-f]{8}$", rel) else "not in the manifest"
            )
            say(f"removing {rel} ({kind})")
            p.unlink()
            removed += 1
        for d in sorted((p for p in self.dest.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()  # only empty ones
        return removed

    def check_one(self, entry: dict, verified: dict) -> tuple[str, str | None, list | None]:
        """(path, problem or None, verified record or None)."""
        path = self.dest / entry["path"]
        try:
            st = path.stat()
        except FileNotFoundError:
            return entry["path"], "missing", None
        if not path.is_file():
            return entry["path"], "not a regular file", None
        if st.st_size != entry["size"]:
            return (
                entry["path"],
                f"size {st.st_size}, manifest says {entry['size']} (truncated or changed)",
                None,
            )
        record = verified.get(entry["path"])
        if not self.args.full and record == [st.st_size, st.st_mtime_ns, entry["sha256"]]:
            return entry["path"], None, record
        if sha256_file(path) != entry["sha256"]:
            return entry["path"], "sha256 differs from the manifest (corrupt)", None
        return entry["path"], None, [st.st_size, st.st_mtime_ns, entry["sha256"]]

    def check_all(self, entries: list[dict], verified: dict) -> tuple[list[dict], dict]:
        bad, good = [], {}
        by_path = {e["path"]: e for e in entries}
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            for path, problem, record in pool.map(lambda e: self.check_one(e, verified), entries):
                if problem:
                    bad.append(by_path[path])
                    if problem != "missing" or self.dest_had_manifest:
                        say(f"{path}: {problem}; fetching it again")
                else:
                    good[path] = record
        return bad, good

    # -- fetch ----------------------------------------------------------------------------------------------
    def fetch(self, wanted: list[dict]) -> dict:
        """Runs `aws s3 sync` for the wanted files, verifying each as it lands; returns their records.
        Only the listed files are included, so an object the manifest does not list is never downloaded."""
        by_path = {e["path"]: e for e in wanted}
        argv = ["s3", "sync", "--no-progress", "--exclude", "*"]
        for e in wanted:
            argv += ["--include", glob_escape(e["path"])]
        argv += [self.source, str(self.dest)]
        for e in wanted:  # a stale copy must go: sync compares size and time, not content
            with contextlib.suppress(FileNotFoundError):
                (self.dest / e["path"]).unlink()
        total = sum(e["size"] for e in wanted)
        started = time.monotonic()
        landed: dict[str, concurrent.futures.Future] = {}
        stop = threading.Event()

        def progress() -> None:
            while not stop.wait(self.args.progress_s):
                done = 0
                for p in self.dest.rglob("*"):
                    with contextlib.suppress(OSError):
                        if p.is_file() and p.name not in (STATE_NAME, LOCK_NAME):
                            done += p.stat().st_size
                say(
                    f"... {human(min(done, total))} of {human(total)} on disk, "
                    f"{len(landed)}/{len(wanted)} files done, {time.monotonic() - started:.0f} s"
                )

        ticker = threading.Thread(target=progress, daemon=True)
        ticker.start()
        stderr_lines: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            proc = subprocess.Popen(
                self.aws.argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            err_thread = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
            err_thread.start()
            for line in proc.stdout:
                m = re.match(r"^download: (s3://\S+) to ", line)
                if not m or not m.group(1).startswith(self.source):
                    continue
                rel = m.group(1)[len(self.source) :]
                entry = by_path.get(rel)
                if entry is None:
                    continue
                landed[rel] = pool.submit(self.check_one, entry, {})
                say(
                    f"fetched {rel} ({human(entry['size'])}, {len(landed)}/{len(wanted)}, "
                    f"{time.monotonic() - started:.1f} s)"
                )
            rc = proc.wait()
            err_thread.join()
            stop.set()
            results = {rel: fut.result() for rel, fut in landed.items()}
        if rc != 0:
            errors = [ln.strip() for ln in stderr_lines if ln.strip()]
            raise SyncError(
                f"aws s3 sync {self.source} failed (exit {rc}): {errors[-1] if errors else 'no message'}"
            )
        records = {}
        for e in wanted:
            rel = e["path"]
            if rel not in results:
                _, problem, record = self.check_one(
                    e, {}
                )  # sync may say nothing when the object is unchanged
                if problem == "missing":
                    raise SyncError(
                        f"{self.source}{rel}: listed in {self.manifest_uri} but not in the bucket"
                    )
            else:
                _, problem, record = results[rel]
            if problem:
                raise SyncError(
                    f"{rel}: fetched from {self.source}{rel} but {problem.split(' (')[0]} "
                    f"({self.manifest_uri} is wrong or the object is corrupt)"
                )
            records[rel] = record
        elapsed = time.monotonic() - started
        rate = total / max(elapsed, 1e-6) / 1e6
        say(f"transferred {len(wanted)} files ({human(total)}) in {elapsed:.1f} s ({rate:.0f} MB/s)")
        return records

    # -- main -----------------------------------------------------------------------------------------------
    def run(self) -> int:
        raw = self.aws.read(self.manifest_uri)
        check_pin(raw, self.manifest_uri, self.args.manifest_sha256)
        entries = manifest.parse_manifest(raw, self.manifest_uri, name=self.args.manifest)
        manifest_bytes = raw  # kept verbatim: the trainer's preflight checks its sha256 against the pin again
        total = sum(e["size"] for e in entries)
        if self.args.dry_run and not self.dest.exists():
            say(f"{self.dest}: would fetch all {len(entries)} files ({human(total)}); fetched 0 (dry run)")
            return 0
        self.dest.mkdir(parents=True, exist_ok=True)
        lock = open(self.dest / LOCK_NAME, "a")  # noqa: SIM115 - held for the whole run
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SyncError(f"{self.dest}: another {PROG} is running on it") from None
        others = [p for p in self.dest.iterdir() if p.name not in (LOCK_NAME,)]
        if others and not self.state_path.exists() and not (self.dest / self.args.manifest).exists():
            raise SyncError(
                f"{self.dest}: not empty and not made by {PROG} (no {STATE_NAME}); refusing to "
                f"delete anything in it: empty it or choose another directory"
            )
        self.dest_had_manifest = (self.dest / self.args.manifest).exists()
        state = load_state(self.state_path)
        if not self.args.dry_run:
            self.remove_strays(entries)
        bad, good = self.check_all(entries, state["verified"])
        if self.args.dry_run:
            say(
                f"{self.dest}: would fetch {len(bad)} of {len(entries)} files "
                f"({human(sum(e['size'] for e in bad))}); fetched 0 (dry run)"
            )
            return 0
        if bad:
            with contextlib.suppress(FileNotFoundError):
                (self.dest / self.args.manifest).unlink()  # not complete until everything checks again
            write_atomic(
                self.state_path, json.dumps({"manifest": self.manifest_uri, "verified": good}) + "\n"
            )
            for attempt in range(1, FETCH_ATTEMPTS + 1):
                try:
                    good.update(self.fetch(bad))
                    break
                except SyncError as e:
                    if attempt == FETCH_ATTEMPTS or "failed (exit" in str(e) or "not in the bucket" in str(e):
                        raise
                    say(f"{e}; fetching it once more")
        write_atomic(self.state_path, json.dumps({"manifest": self.manifest_uri, "verified": good}) + "\n")
        old = (
            (self.dest / self.args.manifest).read_bytes()
            if (self.dest / self.args.manifest).exists()
            else b""
        )
        if old != manifest_bytes:
            write_atomic(self.dest / self.args.manifest, manifest_bytes)
        say(
            f"{self.dest}: all {len(entries)} files ({human(total)}) match {self.manifest_uri}"
            f"{' (sha256 checked)' if self.args.full else ''}; fetched {len(bad)} files"
        )
        return 0


def load_config(args: argparse.Namespace) -> argparse.Namespace:
    if not args.config:
        return args
    try:
        conf = json.loads(Path(args.config).read_text())
    except OSError as e:
        raise SyncError(f"config {args.config}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SyncError(f"config {args.config}: not JSON ({e})") from None
    known = {
        "source",
        "dest",
        "endpoint_url",
        "region",
        "manifest",
        "manifest_sha256",
        "aws",
        "credentials_file",
        "config_file",
    }
    for key, value in conf.items():
        if key not in known:
            raise SyncError(f"config {args.config}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        if key == "credentials_file":
            os.environ["AWS_SHARED_CREDENTIALS_FILE"] = value
        elif key == "config_file":
            os.environ["AWS_CONFIG_FILE"] = value
        elif getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="JSON file with the keys below (command-line options win)")
    parser.add_argument("--source", help="s3://bucket/prefix/ holding the files and MANIFEST.json")
    parser.add_argument("--dest", help="local directory to mirror into")
    parser.add_argument("--endpoint-url", dest="endpoint_url")
    parser.add_argument("--region")
    parser.add_argument("--manifest", help="manifest name in the prefix (default MANIFEST.json)")
    parser.add_argument(
        "--manifest-sha256",
        dest="manifest_sha256",
        help="sha256 of the manifest file itself, pinned in the inventory; any other manifest is refused",
    )
    parser.add_argument("--aws", help="awscli executable (default /usr/bin/aws)")
    parser.add_argument("--full", action="store_true", help="hash every local file, even unchanged ones")
    parser.add_argument("--dry-run", action="store_true", help="say what would be fetched; change nothing")
    parser.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    try:
        args = load_config(args)
        args.manifest = args.manifest or "MANIFEST.json"
        args.aws = args.aws or "/usr/bin/aws"
        if not args.source or not args.source.startswith("s3://") or len(args.source) <= 5:
            raise SyncError(f"source {args.source!r}: must be an s3://bucket/prefix/ URI")
        if not args.dest or not os.path.isabs(args.dest) or len(Path(args.dest).parts) < 3:
            raise SyncError(f"dest {args.dest!r}: must be an absolute path at least two levels deep")
        if not isinstance(args.manifest_sha256, str) or not HEX64.match(args.manifest_sha256):
            raise SyncError(
                f"manifest_sha256 {args.manifest_sha256!r}: must be the 64 lowercase hex digits of the "
                f"manifest's sha256, pinned in the inventory (sha256sum MANIFEST.json)"
            )
        return Syncer(args).run()
    except (SyncError, manifest.ManifestError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run it again to resume", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
