"""bench_load's record of the host memory it ran beside (a contended host is visible in its output)."""

from pathlib import Path

BENCH_SCRIPT = "bench_load"  # the conftest's `bench` fixture


def test_host_memory_reports_what_competes_with_the_reads(bench, tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       131917360 kB\nMemAvailable:   56203264 kB\nShmem:          63543296 kB\n"
        "Dirty:           2097152 kB\nWriteback:         1048576 kB\n"
    )
    assert bench.host_memory(str(meminfo)) == (
        "host memory: MemAvailable 53.6 GiB, Shmem 60.6 GiB, Dirty 2.0 GiB, Writeback 1.0 GiB"
    )
    assert bench.host_memory(str(tmp_path / "none")) == "host memory: unknown (no /proc/meminfo)"
