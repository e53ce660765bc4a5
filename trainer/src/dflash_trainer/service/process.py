"""Process helpers shared by the launcher (service/supervisor.py) and its ranks (service/serve.py): when a
process started, and a child that dies with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2)


def process_started(pid: int | str = "self") -> float:
    """Epoch seconds this process started (from /proc: the interpreter's start-up and imports count)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exits at once if `parent` is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def die_with_launcher() -> None:
    """Under the multi-node launcher (distributed/elastic.py, whose agent's Popen has no hook for it): no
    rank outlives the launcher ($DFLASH_LAUNCHER_PID), even one stopped or hung."""
    pid = os.environ.get("DFLASH_LAUNCHER_PID")
    if pid:
        die_with_parent(int(pid))
