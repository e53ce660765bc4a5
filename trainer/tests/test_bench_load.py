"""bench_load's record of the host memory it ran beside (a contended host is visible in its output)."""

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_host_memory_reports_what_competes_with_the_reads(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        bench_load = importlib.import_module("bench_load")
    finally:
        sys.path.remove(str(BENCH))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       131917360 kB\nMemAvailable:   56203264 kB\nShmem:          63543296 kB\n"
        "Dirty:           2097152 kB\nWriteback:         1048576 kB\n"
    )
    assert bench_load.host_memory(str(meminfo)) == (
        "host memory: MemAvailable 53.6 GiB, Shmem 60.6 GiB, Dirty 2.0 GiB, Writeback 1.0 GiB"
    )
    assert bench_load.host_memory(str(tmp_path / "none")) == "host memory: unknown (no /proc/meminfo)"
