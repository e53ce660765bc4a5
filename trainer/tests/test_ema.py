"""CPU EMA: fp32 host copies, folded every N steps, state round trip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_trainer.ema import CpuEma


def test_folds_every_n_steps_in_fp32_on_the_host():
    module = nn.Linear(3, 2).to(torch.bfloat16)
    ema = CpuEma(module, decay=0.75, every=2)
    start = {k: v.clone() for k, v in ema.weights().items()}
    with torch.no_grad():
        module.weight.add_(1.0)
    ema.update(module, step=1)  # not an update step
    assert torch.equal(ema.weights()["weight"], start["weight"])
    ema.update(module, step=2)
    shadow = ema.weights()["weight"]
    assert shadow.dtype == torch.float32 and shadow.device.type == "cpu"
    expected = 0.75 * start["weight"] + 0.25 * module.weight.detach().float()
    assert torch.allclose(shadow, expected) and ema.num_updates == 1


def test_state_round_trip_and_mismatch():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    ema_a, ema_b = CpuEma(a, decay=0.5, every=1), CpuEma(b, decay=0.5, every=1)
    ema_a.update(a, step=1)
    ema_b.load_state_dict(ema_a.state_dict())
    assert all(torch.equal(ema_a.weights()[k], ema_b.weights()[k]) for k in ema_a.weights())
    with pytest.raises(ValueError, match="does not match"):
        CpuEma(nn.Linear(3, 3, bias=False), decay=0.5, every=1).load_state_dict(ema_a.state_dict())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_second_copy_on_the_gpu():
    module = nn.Linear(1024, 1024, device="cuda")
    before = torch.cuda.memory_allocated()
    ema = CpuEma(module, decay=0.9, every=1)
    for step in range(1, 4):
        ema.update(module, step)
    ema.wait()
    assert torch.cuda.memory_allocated() == before
    assert all(t.device.type == "cpu" for t in ema.weights().values())
    assert all(t.is_pinned() for t in ema._staging.values())
