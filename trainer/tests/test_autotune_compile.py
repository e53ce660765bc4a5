"""configs_compiled_at_once around Triton's own Autotuner and AsyncCompileMode. No GPU here: the kernel stands
in for a JITFunction the way Triton's `_do_compile` treats one under AsyncCompileMode (it submits the compile
to the mode's executor and hands back a FutureKernel that the mode finalizes at its exit)."""

from __future__ import annotations

import threading

import pytest

triton = pytest.importorskip("triton")
from triton import Config  # noqa: E402
from triton.runtime import _async_compile  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from dflash_trainer.service.autotune_compile import configs_compiled_at_once, workers_from_env  # noqa: E402


def _kernel_body(x, n, B):  # the base function Autotuner looks for under `.fn`
    pass


class StandInKernel:
    """JITFunction.run's compile step as Triton runs it: under an active AsyncCompileMode the compile goes to
    the mode's executor (runtime/jit.py `_do_compile`); without one it compiles in the caller's thread."""

    fn = staticmethod(_kernel_body)
    arg_names = ("x", "n")

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.compiled: dict[tuple, str] = {}  # config -> thread that compiled it
        self.finalized: list[tuple] = []
        self.runs: list[dict] = []
        self.fail = fail

    def run(self, *args, grid, warmup, **kwargs):
        key = (kwargs["B"], kwargs.get("num_warps"))
        self.runs.append({"warmup": warmup, **kwargs})
        if kwargs["B"] in self.fail:
            raise ValueError("cannot specialize")
        if key in self.compiled:
            return key
        mode = _async_compile.active_mode.get()

        def compile_():
            self.compiled[key] = threading.current_thread().name
            return key

        if mode is None:
            return compile_()
        return mode.submit(key, compile_, self.finalized.append)


def _autotuner(kernel: StandInKernel) -> Autotuner:
    configs = [Config({"B": b}, num_warps=w) for b in (16, 32) for w in (4, 8)]
    tuner = Autotuner(kernel, ["x", "n"], configs, ["n"], None, None)
    tuner.nargs = {"x": "tensor", "n": 128}  # what Autotuner.run sets before it prunes
    return tuner


def test_every_candidate_is_compiled_on_the_pool_before_the_timing() -> None:
    kernel = StandInKernel()
    tuner = _autotuner(kernel)
    with configs_compiled_at_once(4):
        configs = tuner.prune_configs({"grid": (1,), "warmup": False})
        assert len(configs) == 4
        # Done by the time prune returns: the mode's exit finalized every future.
        assert sorted(kernel.finalized) == sorted(kernel.compiled) and len(kernel.compiled) == 4
    assert all(name.startswith("triton-compile") for name in kernel.compiled.values())
    assert all(run["warmup"] is True for run in kernel.runs)  # compiled, never launched
    assert Autotuner.prune_configs is not None and "prune_and_compile" not in Autotuner.prune_configs.__name__


def test_below_two_workers_nothing_changes() -> None:
    kernel = StandInKernel()
    tuner = _autotuner(kernel)
    with configs_compiled_at_once(1):
        assert len(tuner.prune_configs({"grid": (1,), "warmup": False})) == 4
    assert kernel.runs == []


def test_a_config_that_fails_ahead_is_left_to_the_timing() -> None:
    kernel = StandInKernel(fail={32})
    tuner = _autotuner(kernel)
    with configs_compiled_at_once(2):
        assert len(tuner.prune_configs({"grid": (1,), "warmup": False})) == 4
    assert sorted(kernel.compiled) == [(16, 4), (16, 8)]


@pytest.mark.parametrize(("value", "workers"), [("", 0), ("0", 0), ("8", 8), (" 16 ", 16)])
def test_workers_from_env(value: str, workers: int) -> None:
    assert workers_from_env({"DFLASH_PROBE_COMPILE_WORKERS": value}) == workers
    assert workers_from_env({}) == 0


def test_a_bad_worker_count_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"DFLASH_PROBE_COMPILE_WORKERS='many': must be a whole number"):
        workers_from_env({"DFLASH_PROBE_COMPILE_WORKERS": "many"})


def test_the_probe_names_a_bad_worker_count_in_its_last_line(monkeypatch, capsys) -> None:
    from dflash_trainer.service import gpu_probe

    monkeypatch.setenv("DFLASH_PROBE_COMPILE_WORKERS", "many")
    assert gpu_probe.main(["fla"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("error: ValueError: DFLASH_PROBE_COMPILE_WORKERS='many'"), last
