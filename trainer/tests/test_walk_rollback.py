"""The decode walk's rollback of a hybrid target: the recorded states (no second forward) against running
the accepted tokens again; both lossless, the recorded one a forward cheaper per rejection."""

from __future__ import annotations

import pytest
import torch
from test_walk import TRAINED_NEW, _fit, _greedy

from dflash_trainer.evaluation.target_cache import TargetCache, recorder
from dflash_trainer.evaluation.walk import WalkSettings, decode_walk


@pytest.fixture(scope="module")
def hybrid(tiny_target):
    return _fit("qwen3_5", tiny_target("qwen3_5"))


def _walk_counting_forwards(t, monkeypatch, rollback: str, cache: str = "static"):
    """The walk, and the target forwards it ran: (verify steps, forwards that re-ran accepted tokens)."""
    verifies: list[int] = []
    reruns: list[int] = []
    plain_verify, plain_forward = TargetCache.verify, TargetCache.forward

    def verify(self, block):
        verifies.append(block.shape[1])
        return plain_verify(self, block)

    def forward(self, ids, *, features: bool = True, **kwargs):
        if not features:  # the rollback's forward of the kept tokens (the prefill's and verify's keep them)
            reruns.append(ids.shape[1])
        return plain_forward(self, ids, features=features, **kwargs)

    monkeypatch.setattr(TargetCache, "verify", verify)
    monkeypatch.setattr(TargetCache, "forward", forward)
    settings = WalkSettings(max_new_tokens=TRAINED_NEW, rollback=rollback, cache=cache)  # type: ignore[arg-type]
    result = decode_walk(t.target.model, t.drafter, t.prompts, settings)
    monkeypatch.setattr(TargetCache, "verify", plain_verify)
    monkeypatch.setattr(TargetCache, "forward", plain_forward)
    return result, verifies, reruns


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("rollback", ["recorded", "rerun"])
def test_both_rollbacks_are_lossless(hybrid, monkeypatch, rollback: str, cache: str) -> None:
    result, verifies, reruns = _walk_counting_forwards(hybrid, monkeypatch, rollback, cache)
    with torch.no_grad():
        expected = [_greedy(hybrid.target.model, p, TRAINED_NEW) for p in hybrid.prompts]
    for walk, want in zip(result.walks, expected, strict=True):
        assert torch.equal(walk.output_ids, want), rollback
    assert result.rejections >= 10, result
    assert len(verifies) == result.steps
    if rollback == "recorded":  # one forward per verify step, none to roll back
        assert reruns == []
    else:  # a rejection that is not a prompt's last step costs a forward of the kept tokens
        assert len(reruns) >= result.rejections - len(hybrid.prompts)


def test_recorded_states_equal_the_states_of_running_the_tokens_again(hybrid) -> None:
    """After one rejected verify: the conv and recurrent states the recording gives against a forward of the
    kept tokens from the restored states."""
    model = hybrid.target.model
    prompt = hybrid.prompts[2].reshape(1, -1)
    block = torch.randint(0, 400, (1, 4), generator=torch.Generator().manual_seed(5))
    states = {}
    for mode in ("recorded", "rerun"):
        cache = TargetCache(model, mode)  # type: ignore[arg-type]
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), recorder.installed():
            cache.forward(prompt, logits_to_keep=1)
            cache.verify(block)
            cache.rollback(prompt.shape[1], 2, block)
        assert cache.length == prompt.shape[1] + 2
        states[mode] = [(lay.conv_states[0].clone(), lay.recurrent_states[0].clone()) for lay in cache.linear]
    assert states["recorded"]
    for (conv_a, rec_a), (conv_b, rec_b) in zip(states["recorded"], states["rerun"], strict=True):
        # The kept inputs come out of a GEMM over the whole block, the rerun's over the kept tokens alone.
        torch.testing.assert_close(conv_a, conv_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec_a, rec_b, rtol=1e-5, atol=1e-5)


def test_a_graph_that_fails_to_capture_leaves_the_walk_static(hybrid, monkeypatch, caplog) -> None:
    """A capture error (a CUDA call that is not allowed while capturing) costs the walk its graphs, not its
    figures: it goes on over the static cache, lossless, and says so once."""
    plain_init = TargetCache.__init__

    def as_on_cuda(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        self.kind = "graph"  # what CUDA would have chosen

    def failing_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(TargetCache, "__init__", as_on_cuda)
    monkeypatch.setattr("dflash_trainer.evaluation.cuda_graph.capture", failing_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with caplog.at_level("WARNING"):
        result = decode_walk(hybrid.target.model, hybrid.drafter, hybrid.prompts, WalkSettings(TRAINED_NEW))
    assert result.cache == "static"
    with torch.no_grad():
        for walk, prompt in zip(result.walks, hybrid.prompts, strict=True):
            assert torch.equal(walk.output_ids, _greedy(hybrid.target.model, prompt, TRAINED_NEW))
    failures = [r for r in caplog.records if "failed to capture" in r.getMessage()]
    assert len(failures) == 1, failures
