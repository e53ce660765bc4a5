"""The start profile: where a start's seconds went, from a sampler of the main thread's stack."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest
from tiny_run import run_cli

from dflash_trainer.stack_sampler import (
    ENV,
    StackSampler,
    Window,
    by_own_frame,
    inclusive,
    summarize,
    write_report,
)


def test_a_function_counts_once_per_sample_that_holds_it_recursion_included() -> None:
    stacks = Counter({("a", "b", "a"): 3, ("a", "c"): 1})
    assert inclusive(stacks) == Counter({"a": 4, "b": 3, "c": 1})


def test_the_summary_gives_each_function_its_share_of_the_window_in_seconds() -> None:
    window = Window("load", started=10.0, ended=12.0, stacks=Counter({("main", "load"): 3, ("main", "x"): 1}))
    lines = summarize(window).splitlines()
    assert lines[0] == "== load: 2.0 s, 4 samples"
    assert lines[1].split() == ["2.00", "s", "100.0", "%", "main"]
    assert lines[2].split() == ["1.50", "s", "75.0", "%", "load"]
    assert lines[3].split() == ["0.50", "s", "25.0", "%", "x"]
    assert lines[4] == "-- by the trainer's deepest frame"


def test_the_trainer_s_deepest_frame_names_the_call_it_handed_its_seconds_to() -> None:
    own, sync = "dflash_trainer/method/anchors.py:sample_anchors", "dflash_trainer/train/loop.py:train"
    stacks = Counter({(sync, own): 3, (sync, own, "torch/_tensor.py:backward", "x.py:y"): 2, ("a", "b"): 1})
    expected = {f"{own} -> (itself)": 3, f"{own} -> torch/_tensor.py:backward": 2}
    assert by_own_frame(stacks) == Counter(expected)


def spin_in_first(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def sleep_in_second(seconds: float) -> None:
    time.sleep(seconds)


def samples_in(window: Window, function: str) -> int:
    return inclusive(window.stacks)[f"tests/test_stack_sampler.py:{function}"]  # not the trainer's: 2 parts


def test_the_sampler_names_the_function_each_window_spent_its_time_in() -> None:
    sampler = StackSampler("first", interval=0.005).start()
    spin_in_first(0.4)
    sampler.mark("second")
    sleep_in_second(0.3)
    sampler.stop()
    first, second = sampler.windows
    assert first.samples > 10 and second.samples > 10
    assert samples_in(first, "spin_in_first") >= 0.8 * first.samples
    assert samples_in(first, "sleep_in_second") == 0
    assert samples_in(second, "sleep_in_second") >= 0.8 * second.samples
    report = sampler.report()
    # Each window's seconds: at least what it spun or slept (more on a loaded machine, never less).
    seconds = dict(re.findall(r"^== (first|second): ([0-9.]+) s, ", report, re.M))
    assert float(seconds["first"]) >= 0.4 and float(seconds["second"]) >= 0.3, seconds
    assert "first;" in report and "second;" in report  # the collapsed stacks, by window


def test_an_interval_that_never_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="interval 0: must be > 0"):
        StackSampler("x", interval=0)


def test_serve_writes_the_start_profile_at_its_first_step(tiny_job, tmp_path) -> None:
    profile = tmp_path / "profile"
    code, out = run_cli(["serve", str(tiny_job())], env={"DFLASH_PROFILE_START": str(profile)})
    assert code == 0, out
    path = profile / "start-profile-rank0.txt"
    assert f"start profile: {path}" in out
    text = path.read_text()
    starting, to_first_step = (line for line in text.splitlines() if line.startswith("== ") and "s," in line)
    assert starting.startswith("== serve's start -> READY (the process started ")
    assert to_first_step.startswith("== READY -> first step: ")
    # The imports and the loading happened before READY; no training step did (the first is after it, and
    # on this CPU lasts too few milliseconds to be sure of a sample).
    stacks = text.split("== collapsed stacks\n", 1)[1].splitlines()
    before = [line for line in stacks if line.startswith("serve's_start_->_READY")]
    own = "dflash_trainer/service/serve.py:main;dflash_trainer/train/loop.py:<module>;"
    assert any(own in line for line in before)
    assert not any("dflash_trainer/train/drafter_side.py:step;" in line for line in before)
    assert all(line.startswith(("serve's_start_->_READY", "READY_->_first_step;")) for line in stacks)
    assert not any("<frozen " in line for line in stacks)


def test_serve_writes_its_first_evaluation_s_profile_a_window_per_evaluation(tiny_job, tmp_path) -> None:
    profile = tmp_path / "profile"
    job = tiny_job(train={"eval_every": 2, "eval_walk_prompts": 1})
    code, out = run_cli(["serve", str(job)], env={"DFLASH_PROFILE_START": str(profile)})
    assert code == 0, out
    path = profile / "eval-profile-rank0.txt"
    assert out.count("evaluation profile: ") == 1 and f"evaluation profile: {path}" in out  # the first only
    text = path.read_text()
    heads = [line for line in text.splitlines() if line.startswith("== evaluation")]
    assert [line.split(":", 2)[1].strip() for line in heads] == ["held_out_figures", "walk_figures"], heads
    stacks = text.split("== collapsed stacks\n", 1)[1].splitlines()
    walked = [line for line in stacks if "walk_figures" in line]
    assert any("dflash_trainer/evaluation/walk.py:decode_walk;" in line for line in walked)


def test_a_profile_that_cannot_be_written_says_why_and_raises_nothing(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(ENV, str(blocker / "profile"))  # a directory under a file: mkdir fails
    sampler = StackSampler("x").start()
    said = write_report(sampler, "start-profile-rank0.txt")
    assert said.startswith(f"{blocker / 'profile' / 'start-profile-rank0.txt'} not written ({ENV}: "), said
