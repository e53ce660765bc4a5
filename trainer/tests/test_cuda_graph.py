"""`Graphed`'s sequence (eager once, captured, replayed; eager for good after a capture error) with the
capture itself stood in for: there is no CUDA here. The stand-in runs the forward's Python once at capture, as
torch.cuda.graph does (its kernels are recorded, not run), and a replay runs no Python. The GPU tests of the
walk (test_walk.py, test_draft_runner.py) run the real capture."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dflash_trainer.evaluation import cuda_graph
from dflash_trainer.evaluation.cuda_graph import Graphed


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def events(monkeypatch):
    seen: list[str] = []

    def fake_capture(run, around=None):
        with around or contextlib.nullcontext():
            seen.append("capture")
            return _Graph(), run()

    monkeypatch.setattr(cuda_graph, "capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return seen


def _forward(seen: list[str]):
    def run() -> str:
        seen.append("run")
        return f"out {len(seen)}"

    return run


def test_first_call_eager_second_captures_then_replays(events) -> None:
    graphed = Graphed(_forward(events), "the forward", "it runs eagerly")
    assert graphed() == "out 1" and not graphed.captured
    out = graphed()  # captured: the graph's own output
    assert graphed.captured and events == ["run", "capture", "run"]
    assert graphed() is out and graphed() is out  # replays: no Python of the forward
    assert events == ["run", "capture", "run"]
    assert graphed._captured is not None and graphed._captured[0].replays == 3


def test_around_wraps_the_eager_run_and_the_capture_not_a_replay(events) -> None:
    entered: list[int] = []

    @contextlib.contextmanager
    def around():
        entered.append(len(events))
        yield

    graphed = Graphed(_forward(events), "the forward", "it runs eagerly")
    for _ in range(4):
        graphed(around)
    assert entered == [0, 1]  # the eager run, then the capture; the two replays entered nothing


def test_a_capture_error_leaves_it_eager_and_says_so_once(events, monkeypatch, caplog) -> None:
    def failing_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graph, "capture", failing_capture)
    graphed = Graphed(_forward(events), "the forward", "it runs eagerly")
    with caplog.at_level("WARNING"):
        outs = [graphed() for _ in range(4)]
    assert outs == ["out 1", "out 2", "out 3", "out 4"] and graphed.failed and not graphed.captured
    failures = [r.getMessage() for r in caplog.records if "failed to capture" in r.getMessage()]
    assert failures == [
        "decode walk: the forward's CUDA graph failed to capture (RuntimeError: operation not permitted "
        "when stream is capturing); it runs eagerly"
    ]
