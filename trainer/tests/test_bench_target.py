"""bench_target's device-timeline accounting and a CPU smoke run of the benchmark."""

import json

import pytest

BENCH_SCRIPT = "bench_target"  # the conftest's `bench` fixture


def test_timeline_counts_overlap_once_and_finds_the_gaps(bench) -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 100},
            {"ph": "X", "cat": "kernel", "name": "chunk_delta_rule", "ts": 50, "dur": 100},  # overlap
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 200, "dur": 10},  # 50 us gap before
            {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": 215, "dur": 5},  # 5 us gap
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host: not counted
        ]
    }
    t = bench.timeline(bench.device_intervals(trace))
    assert t["events"] == 4
    assert t["busy_ms"] == pytest.approx(0.165)  # 0-150, 200-210, 215-220
    assert t["span_ms"] == pytest.approx(0.220)
    assert t["idle_ms"] == pytest.approx(0.055)
    assert t["gaps_over_20us"] == 1
    assert t["gaps"][0] == [50.0, "chunk_delta_rule", "Memcpy DtoD"]
    assert t["kinds_ms"]["gemm"] == pytest.approx(0.1)
    assert t["kinds_ms"]["linear attention (FLA)"] == pytest.approx(0.1)
    assert bench.timeline([])["busy_ms"] == 0.0


def test_cpu_smoke_run(bench, tmp_path) -> None:
    out = tmp_path / "target.json"
    argv = ["--device", "cpu", "--shape", "qwen3.6-mini", "--seq-len", "32", "--warmup", "1", "--steps", "2"]
    argv += ["--variant", "eager", "eager-plain", "graph", "--trace", "1", "--trace-dir", str(tmp_path)]
    assert bench.main([*argv, "--dir", str(tmp_path), "--out", str(out)]) == 1  # graph needs CUDA
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eager"]["max_abs_diff"] == 0.0 and "timeline" in rows["eager"]
    assert "CUDA" in rows["graph"]["error"] and "graph_features" in rows["graph"]["error"]  # says where
    assert (tmp_path / "eager.trace.json.gz").is_file()
    assert "eager / eager-plain" in json.loads(out.read_text())["capture_overhead"]
