"""The decode walk's rollback of a hybrid target: the recorded states (no second forward) against running
the accepted tokens again; both lossless, the recorded one a forward cheaper per rejection."""

from __future__ import annotations

import pytest
import torch
from test_walk import TRAINED_NEW, _fit, _greedy

from dflash_trainer.evaluation.walk import WalkSettings, _TargetCache, decode_walk


@pytest.fixture(scope="module")
def hybrid(tiny_target):
    return _fit("qwen3_5", tiny_target("qwen3_5"))


def _walk_counting_forwards(t, monkeypatch, rollback: str):
    forwards: list[int] = []
    plain = _TargetCache.forward

    def counted(self, ids, **kwargs):
        forwards.append(ids.shape[1])
        return plain(self, ids, **kwargs)

    monkeypatch.setattr(_TargetCache, "forward", counted)
    settings = WalkSettings(max_new_tokens=TRAINED_NEW, rollback=rollback)  # type: ignore[arg-type]
    result = decode_walk(t.target.model, t.drafter, t.prompts, settings)
    monkeypatch.setattr(_TargetCache, "forward", plain)
    return result, forwards


@pytest.mark.parametrize("rollback", ["recorded", "rerun"])
def test_both_rollbacks_are_lossless(hybrid, monkeypatch, rollback: str) -> None:
    result, forwards = _walk_counting_forwards(hybrid, monkeypatch, rollback)
    with torch.no_grad():
        expected = [_greedy(hybrid.target.model, p, TRAINED_NEW) for p in hybrid.prompts]
    for walk, want in zip(result.walks, expected, strict=True):
        assert torch.equal(walk.output_ids, want), rollback
    assert result.rejections >= 10, result
    prefills = len(hybrid.prompts)
    if rollback == "recorded":  # one forward per verify step, none to roll back
        assert len(forwards) == prefills + result.steps
    else:  # a rejection that is not the walk's last step costs a forward of the kept tokens
        assert len(forwards) > prefills + result.steps


def test_recorded_states_equal_the_states_of_running_the_tokens_again(hybrid) -> None:
    """After one rejected verify: the conv and recurrent states the recording gives against a forward of the
    kept tokens from the restored states."""
    model = hybrid.target.model
    prompt = hybrid.prompts[2].reshape(1, -1)
    block = torch.randint(0, 400, (1, 4), generator=torch.Generator().manual_seed(5))
    states = {}
    for mode in ("recorded", "rerun"):
        cache = _TargetCache(model, mode)  # type: ignore[arg-type]
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            from dflash_trainer.evaluation.walk import _recorder

            with _recorder.installed():
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
