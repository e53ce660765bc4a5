"""Kernel-candidate timing in turns between processes (service.timing_turns): a real flock between two real
processes, and the timing methods of Triton's and inductor's autotuners held to it while inside."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from triton.runtime.autotuner import Autotuner

from dflash_trainer.service import timing_turns


def note(log: str | Path, line: str) -> None:
    with Path(log).open("a") as f:
        f.write(line + "\n")


def _hold_a_turn(path: str, log: str, holding, release) -> None:
    with timing_turns.in_turns(Path(path)) as turns:
        assert turns is not None
        with turns.turn():
            note(log, "other starts")
            holding.set()
            release.wait(30)
            time.sleep(0.3)  # still in its turn: a process that did not wait for it would write first
            note(log, "other ends")


def held_elsewhere(path: Path) -> bool:
    """True if another open file description holds the lock (a flock of our own one would be granted)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_turn_waits_for_another_processs_turn(tmp_path) -> None:
    path, log = tmp_path / "gpu-timing.lock", tmp_path / "order"
    ctx = multiprocessing.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_a_turn, args=(str(path), str(log), holding, release))
    other.start()
    try:
        assert holding.wait(60), "the other process never took its turn"
        with timing_turns.in_turns(path) as turns:
            assert turns is not None
            release.set()  # the other ends its turn only now: ours must wait for it
            with turns.turn():
                note(log, "ours starts")
        other.join(30)
    finally:
        release.set()
        other.join(5)
    assert other.exitcode == 0
    assert log.read_text().splitlines() == ["other starts", "other ends", "ours starts"]
    assert turns.turns == 1 and turns.waited_s > 0


@pytest.mark.parametrize(
    ("cls", "name"), [(Autotuner, "_bench"), (CachingAutotuner, "benchmark_all_configs")]
)
def test_each_autotuners_timing_holds_the_lock_inside_and_is_itself_again_after(
    tmp_path, monkeypatch, cls, name
) -> None:
    path = tmp_path / "gpu-timing.lock"
    seen: list[bool] = []

    def timing(self, *args, **kwargs):
        seen.append(held_elsewhere(path))
        return "timings"

    monkeypatch.setattr(cls, name, timing)
    with timing_turns.in_turns(path) as turns:
        assert turns is not None
        assert getattr(cls, name)(object(), 1, config="c") == "timings"
        assert not held_elsewhere(path), "the lock was kept after the timing"
        with turns.turn(), turns.turn():  # re-entrant: a timing inside a turn of this process
            assert held_elsewhere(path)
        assert not held_elsewhere(path)
    assert seen == [True]
    assert cls.__dict__[name] is timing
    assert turns.turns == 2


def test_a_lock_that_cannot_be_opened_leaves_the_timings_as_they_were(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, "dflash_trainer.service.timing_turns")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bench = Autotuner.__dict__["_bench"]
    with timing_turns.in_turns(blocker / "gpu-timing.lock") as turns:
        assert turns is None
        assert Autotuner.__dict__["_bench"] is bench
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("kernel timings do not take turns with other processes: ")
    assert str(blocker) in warning


def test_the_lock_lies_beside_the_probes_verdicts(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DFLASH_PROBE_CACHE", str(tmp_path / "state" / "probe-verdicts.json"))
    assert timing_turns.lock_path() == tmp_path / "state" / "gpu-timing.lock"
