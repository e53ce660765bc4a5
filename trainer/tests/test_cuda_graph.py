"""`Graphed`'s sequence (eager once, captured, replayed; eager for good after a capture error) with the
capture itself stood in for: there is no CUDA here. The stand-in runs the forward's Python once at capture, as
torch.cuda.graph does (its kernels are recorded, not run), and a replay runs no Python. The GPU tests of the
walk (test_walk.py, test_draft_runner.py) run the real capture."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from dflash_trainer.evaluation import cuda_graph
from dflash_trainer.evaluation.cuda_graph import Graphed
from dflash_trainer.model.target import GraphedForward


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


def test_a_released_graph_is_dropped_and_starts_over(events) -> None:
    graphed = Graphed(_forward(events), "the forward", "it runs eagerly")
    graphed(), graphed()
    assert graphed._captured is not None
    graph = weakref.ref(graphed._captured[0])
    graphed.release()
    assert graph() is None and not graphed.captured  # gone now, not at a later collection
    assert graphed() == "out 4" and not graphed.captured  # eager again, then captured again
    graphed()
    assert graphed.captured and events[-2:] == ["capture", "run"]


@pytest.fixture
def stand_in_capture(monkeypatch):
    """torch.cuda.graph stood in: it notes whether the cyclic collector was on while it captured."""
    collector_on: list[bool] = []

    @contextlib.contextmanager
    def graph(cuda_graph, capture_error_mode):
        collector_on.append(gc.isenabled())
        yield
        collector_on.append(gc.isenabled())

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return collector_on


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_while_capturing(stand_in_capture, enabled_before) -> None:
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        graph, out = cuda_graph.capture(lambda: gc.isenabled())
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert isinstance(graph, _Graph) and out is False
    assert stand_in_capture == [False, False] and after is enabled_before


def test_the_collector_is_back_on_after_a_capture_error(stand_in_capture) -> None:
    def fails() -> None:
        raise RuntimeError("operation failed due to a previous error during capture")

    assert gc.isenabled()
    assert cuda_graph.try_capture(fails, "the forward", "it runs eagerly") is None
    assert gc.isenabled() and stand_in_capture == [False]


class _Cycle:
    """A dead graph kept by a reference cycle, as a finished walk's caches keep theirs until a collection."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.me = graph, self


def _walk_capture(run):
    captured = cuda_graph.try_capture(run, "the test", "it fails")
    assert captured is not None, "the walk's capture failed"
    return captured


def _training_capture(run):
    graphed = GraphedForward(lambda _x: run(), torch.zeros(1, device="cuda"), warmup=1)
    return graphed.graph, graphed.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("capture", [_walk_capture, _training_capture], ids=["walk", "training"])
def test_a_collection_during_a_capture_does_not_break_it(capture) -> None:
    """The real captures (the walk's, and the target's training-shape graph), with the collector set to run
    at every allocation: the dead graph it finds is not destroyed inside the capture
    (pytorch/pytorch#161037's failure)."""
    x = torch.ones(4, device="cuda")
    dead, _out = cuda_graph.capture(lambda: x * 2)
    _Cycle(dead)
    del dead, _out
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph, out = capture(lambda: [x + i for i in range(64)][-1])
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
    graph.replay()
    assert torch.equal(out, x + 63)
