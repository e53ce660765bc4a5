"""bench_autotune_timing's arms: TIMING@LENGTH, and a bad one named (the bench itself needs a GPU)."""

import argparse

import pytest

BENCH_SCRIPT = "bench_autotune_timing"  # the conftest's `bench` fixture


def test_an_arm_is_a_timing_and_the_probe_length(bench) -> None:
    assert bench.parse_arm("default@256") == ("default", 256)
    assert bench.parse_arm("brief@3072") == ("brief", 3072)


@pytest.mark.parametrize("text", ["default", "fast@256", "default@", "default@32", "default@1e3"])
def test_a_bad_arm_is_named(bench, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"arm '{text}'"):
        bench.parse_arm(text)
