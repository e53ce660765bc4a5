"""bench_autotune_timing's arms: TIMING@LENGTH, and a bad one named (the bench itself needs a GPU)."""

import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_autotune_timing")
    finally:
        sys.path.remove(str(BENCH))


def test_an_arm_is_a_timing_and_the_probe_length(bench) -> None:
    assert bench.parse_arm("default@256") == ("default", 256)
    assert bench.parse_arm("brief@3072") == ("brief", 3072)


@pytest.mark.parametrize("text", ["default", "fast@256", "default@", "default@32", "default@1e3"])
def test_a_bad_arm_is_named(bench, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"arm '{text}'"):
        bench.parse_arm(text)
