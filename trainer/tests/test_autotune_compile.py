"""configs_compiled_at_once and tallied around Triton's own Autotuner and AsyncCompileMode. No GPU here:
the kernel stands in for a JITFunction the way Triton's `_do_compile` treats one under AsyncCompileMode (it
submits the compile to the mode's executor and hands back a FutureKernel that the mode finalizes at its
exit), and the autotuner's timing (triton.testing.do_bench) is a stand-in that calls the kernel as do_bench
does. The kernel is launched as FLA launches its kernels, with keyword arguments
(`kernel[grid](q=q, ...)`)."""

from __future__ import annotations

import os
import threading
import time

import pytest

triton = pytest.importorskip("triton")
from triton import Config  # noqa: E402
from triton.runtime import _async_compile  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from dflash_trainer.service.autotune_compile import (  # noqa: E402
    AutotuneTally,
    configs_compiled_at_once,
    for_this_rank,
    rank_workers,
    tallied,
    workers_from_env,
)


def _kernel_body(x, n, B):  # the base function Autotuner looks for under `.fn`
    pass


class StandInKernel:
    """JITFunction.run's compile step as Triton runs it: its arguments bound by position or keyword, a missing
    one a TypeError (the binder runtime/jit.py builds from the kernel's signature); under an active
    AsyncCompileMode the compile goes to the mode's executor (`_do_compile`); without one it compiles in the
    caller's thread."""

    fn = staticmethod(_kernel_body)
    arg_names = ("x", "n")

    def __init__(self, fail: frozenset[int] = frozenset(), compile_s: float = 0.0) -> None:
        self.compiled: dict[tuple, str] = {}  # config -> thread that compiled it
        self.finalized: list[tuple] = []
        self.runs: list[dict] = []
        self.fail = fail
        self.compile_s = compile_s

    def run(self, *args, grid, warmup, **kwargs):
        bound = {*self.arg_names[: len(args)], *(name for name in self.arg_names if name in kwargs)}
        if bound != set(self.arg_names):
            raise TypeError(f"dynamic_func() missing arguments: {sorted(set(self.arg_names) - bound)}")
        key = (kwargs["B"], kwargs.get("num_warps"))
        self.runs.append({"warmup": warmup, **kwargs})
        if kwargs["B"] in self.fail:  # as ptxas reports a config past the shared memory
            raise OutOfResources(300000, 232448, "shared memory")
        if key in self.compiled:
            return key
        mode = _async_compile.active_mode.get()

        def compile_():
            time.sleep(self.compile_s)
            self.compiled[key] = threading.current_thread().name
            return key

        if mode is None:
            return compile_()
        return mode.submit(key, compile_, self.finalized.append)


TIMING_S = 0.01


def stand_in_do_bench(kernel_call, quantiles):
    """triton.testing.do_bench's calls of the kernel, without a device: a few runs, then the timing."""
    for _ in range(3):
        kernel_call()
    time.sleep(TIMING_S)
    return [1.0, 1.0, 1.0]


def _autotuner(kernel: StandInKernel) -> Autotuner:
    configs = [Config({"B": b}, num_warps=w) for b in (16, 32) for w in (4, 8)]
    return Autotuner(kernel, ["x", "n"], configs, ["n"], None, None, do_bench=stand_in_do_bench)


def _launch(tuner: Autotuner) -> None:
    """A launch as FLA writes it, `kernel[grid](x=x, n=n)`: every argument a keyword."""
    tuner.run(grid=(1,), warmup=False, x="tensor", n=128)


def test_every_candidate_is_compiled_on_the_pool_before_the_timing() -> None:
    kernel = StandInKernel()
    tally = AutotuneTally()
    with configs_compiled_at_once(4, tally):
        _launch(_autotuner(kernel))
    assert len(kernel.compiled) == 4 and sorted(kernel.finalized) == sorted(kernel.compiled)
    assert all(name.startswith("triton-compile") for name in kernel.compiled.values())
    warmups = [run["warmup"] for run in kernel.runs]
    assert warmups[:4] == [True] * 4 and not any(warmups[4:])  # compiled first, launched after
    assert tally.compiled_ahead == 4
    assert "prune_and_compile" not in Autotuner.prune_configs.__name__


def _disk_cache(kept: dict[tuple, Config]):
    """Autotuner.check_disk_cache as Triton 3.x has it (triton/runtime/autotuner.py), its file a dict: a kept
    result is taken without timing anything; a miss times the candidates (bench_fn), then keeps the best."""

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        if tuning_key in kept:
            self.cache[tuning_key] = kept[tuning_key]
            return True
        bench_fn()
        kept[tuning_key] = self.cache[tuning_key]
        return False

    return check_disk_cache


def test_with_autotune_results_on_disk_only_a_miss_compiles_ahead(monkeypatch) -> None:
    # The unit keeps autotune results (TRITON_CACHE_AUTOTUNING=1). Triton prunes before it reads that cache,
    # so the compiles must wait for the miss: a warm restart compiles (loads) only the kernel it runs.
    kept: dict[tuple, Config] = {}
    monkeypatch.setattr(Autotuner, "check_disk_cache", _disk_cache(kept))
    cold, warm = StandInKernel(), StandInKernel()
    tally = AutotuneTally()
    with configs_compiled_at_once(4, tally):
        for kernel in (cold, warm):
            tuner = _autotuner(kernel)
            tuner.cache_results = True
            _launch(tuner)
    assert len(cold.compiled) == 4 and all(n.startswith("triton-compile") for n in cold.compiled.values())
    assert [run["warmup"] for run in cold.runs][:4] == [True] * 4
    assert tally.compiled_ahead == 4  # the cold one's; the warm one started none
    assert not any(run["warmup"] for run in warm.runs) and len(warm.compiled) == 1
    assert Autotuner.check_disk_cache.__name__ == "check_disk_cache"


def test_positional_arguments_are_compiled_ahead_too() -> None:
    kernel = StandInKernel()
    with configs_compiled_at_once(2):
        _autotuner(kernel).run("tensor", 128, grid=(1,), warmup=False)
    assert all(name.startswith("triton-compile") for name in kernel.compiled.values())
    assert len(kernel.compiled) == 4


def test_below_two_workers_nothing_changes() -> None:
    kernel = StandInKernel()
    with configs_compiled_at_once(1):
        _launch(_autotuner(kernel))
    assert not any(run["warmup"] for run in kernel.runs)
    assert all(not name.startswith("triton-compile") for name in kernel.compiled.values())


def test_a_config_that_fails_ahead_is_left_to_the_timing() -> None:
    kernel = StandInKernel(fail={32})
    tuner = _autotuner(kernel)
    with configs_compiled_at_once(2):
        _launch(tuner)
    assert sorted(kernel.compiled) == [(16, 4), (16, 8)]
    assert tuner.best_config.kwargs["B"] == 16  # the timing found the failing ones out of resources


def test_the_tally_splits_first_calls_from_the_timing() -> None:
    kernel = StandInKernel(compile_s=0.02)
    tally = AutotuneTally()
    synced: list[int] = []
    original = Autotuner.__dict__["do_bench"]
    with tallied(tally, lambda: synced.append(1)):
        _launch(_autotuner(kernel))
    assert Autotuner.__dict__["do_bench"] is original
    assert tally.candidates == 4 and len(synced) == 4
    assert tally.first_call_s >= 4 * 0.02  # each candidate's compile, in its first call
    assert tally.timing_s >= 4 * TIMING_S
    assert tally.summary().startswith("autotune: 4 candidates, their first calls ")


def test_the_tally_counts_a_candidate_that_fails_to_compile() -> None:
    kernel = StandInKernel(fail={32})
    tally = AutotuneTally()
    tuner = _autotuner(kernel)
    with tallied(tally, lambda: None):
        _launch(tuner)
    assert tally.candidates == 4
    assert tuner.best_config.kwargs["B"] == 16


def test_the_summary_says_the_compiles_started_ahead() -> None:
    tally = AutotuneTally(candidates=90, compiled_ahead=88, first_call_s=3.25, timing_s=11.0)
    assert tally.summary() == (
        "autotune: 90 candidates, 88 compiles started ahead on threads, their first calls 3.2 s, "
        "timing 11.0 s"
    )


@pytest.mark.parametrize(("value", "workers"), [("0", 0), ("1", 1), ("8", 8), (" 16 ", 16)])
def test_workers_from_env(value: str, workers: int) -> None:
    assert workers_from_env({"DFLASH_COMPILE_WORKERS": value}) == workers


@pytest.mark.parametrize("env", [{}, {"DFLASH_COMPILE_WORKERS": " "}])
def test_unset_the_probe_compiles_ahead_on_the_cpus_it_may_use(monkeypatch, env: dict[str, str]) -> None:
    # A CT limited to 7 of the host's CPUs (its cpuset) compiles on 7 threads, not on the host's count.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7, 9, 11, 12, 13}, raising=False)
    assert workers_from_env(env) == 7
    assert workers_from_env(env, ranks_here=2) == 3  # two ranks of a node share its CPUs
    assert workers_from_env({"DFLASH_COMPILE_WORKERS": "5"}, ranks_here=2) == 5  # asked for: per process


def test_a_bad_worker_count_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"DFLASH_COMPILE_WORKERS='many': must be a whole number"):
        workers_from_env({"DFLASH_COMPILE_WORKERS": "many"})


def test_the_probe_names_a_bad_worker_count_in_its_last_line(monkeypatch, capsys) -> None:
    from dflash_trainer.service import gpu_probe

    monkeypatch.setenv("DFLASH_COMPILE_WORKERS", "many")
    assert gpu_probe.main(["fla"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("error: ValueError: DFLASH_COMPILE_WORKERS='many'"), last


def test_a_triton_without_the_property_is_said_not_tallied(monkeypatch) -> None:
    monkeypatch.delattr(Autotuner, "do_bench")
    tally = AutotuneTally()
    with tallied(tally, lambda: None):
        pass
    assert tally.summary() == "autotune not tallied (this Triton's Autotuner has no do_bench property)"


def test_a_gpu_rank_compiles_ahead_on_its_share_of_the_cpus(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    kernel, tally = StandInKernel(), AutotuneTally()
    workers = rank_workers({"LOCAL_WORLD_SIZE": "4"})  # 8 CPUs, 4 ranks: 2 threads each
    assert workers == 2 and rank_workers({}) == 8
    with for_this_rank("cuda", workers, tally):
        _launch(_autotuner(kernel))
    assert tally.compiled_ahead == 4
    assert {name.rsplit("_", 1)[0] for name in kernel.compiled.values()} == {"triton-compile"}
    assert len(set(kernel.compiled.values())) <= 2


def test_a_cpu_run_leaves_the_autotuner_as_it_is() -> None:
    kernel, tally = StandInKernel(), AutotuneTally()
    with for_this_rank("cpu", 8, tally):
        _launch(_autotuner(kernel))
    assert tally.compiled_ahead == 0 and not any(run["warmup"] for run in kernel.runs)


def test_a_gpu_rank_without_triton_runs_as_it_is(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", None)  # an import of it fails
    with for_this_rank("cuda", 4, AutotuneTally()):
        pass


def test_serve_names_a_bad_worker_count_before_loading(tiny_target, tmp_path) -> None:
    import subprocess
    import sys

    from tiny_run import tiny_run_config

    from dflash_trainer.fixtures.synth import synth_shards
    from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID

    target, shards = tiny_target("qwen3_5"), tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=1, rows=8, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    config = tiny_run_config(tmp_path / "train.toml", target, shards, train={"device": "cuda"})
    env = os.environ | {"DFLASH_COMPILE_WORKERS": "many", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_trainer.service", "serve", str(config)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "configuration: DFLASH_COMPILE_WORKERS='many': must be a whole number" in proc.stderr + proc.stdout
