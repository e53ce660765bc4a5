"""The GPU probes' verdicts, kept between starts so that a restart does not wait for them again.

A probe (service.gpu_probe) compiles and runs the trainer's Triton and FLA kernels: up to a minute and a
half on a cold cache, and the unit runs preflight before every start. Its verdict depends only on what the
key holds: the GPU model, the driver, Python, torch and its CUDA, Triton, flash-linear-attention, the probe's
shape and the probe code itself. A passed probe is stored with its key; a later preflight whose key is equal
reuses the verdict and says so, any difference re-probes and names what changed. A failure is never stored,
and `preflight --full` always probes.

The file lives in the unit's cache directory (CacheDirectory=, via XDG_CACHE_HOME), beside the Triton and
inductor caches whose warmth it reports; $DFLASH_PROBE_CACHE names another file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CACHE_FILE = Path("dflash-preflight") / "probe-verdicts.json"
# The probe's own code: a change to what it runs is a change of verdict.
_PROBE_SOURCES = ("service/gpu_probe.py", "model/kernels.py")


def cache_path() -> Path:
    """$DFLASH_PROBE_CACHE, else CACHE_FILE under $XDG_CACHE_HOME (the unit's cache directory) or ~/.cache."""
    explicit = os.environ.get("DFLASH_PROBE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_FILE


def driver_version() -> str:
    """The NVIDIA kernel module's version (as nvidia-smi prints it), or the CUDA driver API's."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        words = first.split()
        return next(w for w in words if w[:1].isdigit() and "." in w)
    except (OSError, IndexError, StopIteration):
        pass
    try:
        import torch

        return f"cuda-driver-api {torch._C._cuda_getDriverVersion()}"
    except Exception:
        return "unknown"


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def probe_code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _PROBE_SOURCES:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


def environment_key() -> dict[str, str]:
    """What every probe's verdict depends on, on this machine now (imports torch; CUDA must be there)."""
    import torch
    import triton

    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return {
        "gpu": ", ".join(names),
        "driver": driver_version(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "flash-linear-attention": _package_version("flash-linear-attention"),
        "probe code": probe_code_digest(),
    }


def probe_key(environment: dict[str, str], shape: dict[str, int] | None) -> dict[str, str]:
    """One probe's key: the environment and the probe's shape ("-" for a probe without one)."""
    shown = ", ".join(f"{k} {v}" for k, v in sorted((shape or {}).items())) or "-"
    return {**environment, "shape": shown}


def changed(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What differs between two keys, as `name old -> new`."""
    return [
        f"{name} {old.get(name, 'absent')} -> {new.get(name, 'absent')}"
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    ]


@dataclass(frozen=True)
class Lookup:
    verdict: str | None  # the stored verdict when the key is equal
    why: str  # "hit (probed <when>)", or why the probe runs


class VerdictCache:
    """One file of {probe name: {"key", "verdict", "at"}}; a file that cannot be read is a cold cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problem = ""
        self.entries: dict[str, dict] = {}
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            self.entries = {k: v for k, v in raw.items() if isinstance(v, dict)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            self.problem = f"{path} unreadable ({type(e).__name__}: {e}); probing again"

    def lookup(self, name: str, key: dict[str, str]) -> Lookup:
        entry = self.entries.get(name)
        if entry is None:
            return Lookup(None, self.problem or "no verdict kept")
        if entry.get("key") != key:
            return Lookup(None, "changed: " + "; ".join(changed(entry.get("key") or {}, key)))
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(entry.get("at", 0))))
        return Lookup(str(entry.get("verdict", "ok")), f"kept from {when}")

    def store(self, name: str, key: dict[str, str], verdict: str) -> str:
        """Keeps a passed probe's verdict; returns "" or why it could not be kept (never raises)."""
        self.entries[name] = {"key": key, "verdict": verdict, "at": time.time()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".probe-verdicts-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # whole or not at all: a reader never sees half a file
        except OSError as e:
            with contextlib.suppress(NameError, OSError):
                os.unlink(tmp)
            return f"verdict not kept: {self.path.parent}: {e.strerror}"
        return ""
