"""The project's lock files: exact pins, each with the sha256 of every file pip may install for it.

Format (pip's hash-checking mode, as `pip-compile --generate-hashes` writes it):

    # comments
    name==version \\
        --hash=sha256:HEX \\
        --hash=sha256:HEX

Installed with `pip install --require-hashes`: a file whose digest is none of its pin's hashes is refused,
and so is any package the lock does not pin. A pin may carry several hashes where several files are
acceptable (pip then takes any of them); the locks written here carry one each: the trainer lock's torch is
the CPU build of pip's local find-links (lab, CI), the cuda lock's is PyPI's build.

Used by scripts/hash_lock.py (writes the hashes), scripts/cuda_lock.py (the CUDA lock) and tests/image.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# The CT image's platform (Debian 12 amd64, python3 3.11): a lock lists the files pip picks there.
PLATFORM = ("Linux", "x86_64", (3, 11))
HASH = re.compile(r"^--hash=sha256:([0-9a-f]{64})$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Pin:
    name: str  # as the lock spells it
    version: str
    hashes: list[str] = field(default_factory=list)  # sha256 hex digests, in the lock's order
    comment: str = ""  # a comment that stood on the pin's own line (kept above it when written)


@dataclass
class Lock:
    header: list[str]  # the leading comment lines, verbatim
    pins: list[Pin]

    def by_name(self) -> dict[str, Pin]:
        return {canonical(p.name): p for p in self.pins}


class LockError(Exception):
    """A lock that cannot be read; the message names the file and line."""


def _logical_lines(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each logical line: backslash continuations joined, comments kept apart."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if not pending:
            start = number
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        out.append((start, " ".join(pending)))
        pending = []
    if pending:
        raise LockError(f"{path}:{start}: the file ends inside a continued line")
    return out


def read_lock(path: Path) -> Lock:
    """Every pin of PATH with its hashes; a line that is not `name==version [--hash=sha256:HEX ...]` is an
    error naming the file and line."""
    header: list[str] = []
    pins: list[Pin] = []
    seen: dict[str, int] = {}
    for number, line in _logical_lines(path):
        text, _, comment = line.partition("#")
        if not text.strip():
            if not pins and comment and line.lstrip().startswith("#"):
                header.append(line)
            continue
        words = text.split()
        name, sep, version = words[0].partition("==")
        if not sep or not name or not version:
            raise LockError(f"{path}:{number}: not an exact pin: {words[0]!r}")
        hashes = []
        for word in words[1:]:
            found = HASH.match(word)
            if not found:
                raise LockError(f"{path}:{number}: {name}: expected --hash=sha256:HEX, got {word!r}")
            hashes.append(found.group(1))
        key = canonical(name)
        if key in seen:
            raise LockError(f"{path}:{number}: {name} is pinned twice (first on line {seen[key]})")
        seen[key] = number
        pins.append(Pin(name, version, hashes, comment.strip()))
    return Lock(header, pins)


def format_lock(lock: Lock) -> str:
    lines = list(lock.header)
    for pin in lock.pins:
        if pin.comment:
            lines.append(f"# {pin.name}: {pin.comment}")
        if not pin.hashes:
            lines.append(f"{pin.name}=={pin.version}")
            continue
        lines.append(f"{pin.name}=={pin.version} \\")
        for i, digest in enumerate(pin.hashes):
            tail = " \\" if i < len(pin.hashes) - 1 else ""
            lines.append(f"    --hash=sha256:{digest}{tail}")
    return "\n".join(lines) + "\n"


def write_lock(lock: Lock, out: Path) -> None:
    """Writes OUT whole or not at all."""
    partial = out.with_name(out.name + ".partial")
    partial.write_text(format_lock(lock))
    partial.rename(out)


def plain_pins(lock: Lock) -> str:
    """The pins without hashes: input for a resolution that may add packages (hash mode would refuse them)."""
    return "".join(f"{p.name}=={p.version}\n" for p in lock.pins)


def check_platform(tool: str) -> None:
    here = (platform.system(), platform.machine(), sys.version_info[:2])
    if here != PLATFORM:
        raise SystemExit(f"{tool}: resolves for the CT image's platform {PLATFORM}; this is {here}")


@dataclass(frozen=True)
class Resolved:
    name: str  # as its metadata spells it
    version: str
    sha256: str | None  # of the file pip picked; None when the source gave none
    url: str


def pip_report(requirements: str, *pip_args: str) -> list[Resolved]:
    """What `pip install -r REQUIREMENTS PIP_ARGS` would install here, read from pip's --report of a dry run
    (nothing is installed; wheels are read or downloaded only where the index offers no separate metadata).
    Raises LockError with pip's own error when it does not resolve."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(requirements)
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--disable-pip-version-check", "--report", str(report), "--requirement", str(req), *pip_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "is ignored" not in line]
            raise LockError(f"pip {' '.join(pip_args)} does not resolve the pins:\n" + "\n".join(errors))
        installs = json.loads(report.read_text())["install"]
    found = []
    for item in installs:
        info = item.get("download_info", {})
        archive = info.get("archive_info", {})
        digest = archive.get("hashes", {}).get("sha256")
        if digest is None and archive.get("hash", "").startswith("sha256="):
            digest = archive["hash"].split("=", 1)[1]
        meta = item["metadata"]
        found.append(Resolved(meta["name"], meta["version"], digest, info.get("url", "")))
    return found
