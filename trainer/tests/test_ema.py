"""CPU EMA: fp32 host copies, folded every N steps, state round trip."""

from __future__ import annotations

import threading

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


def test_a_frozen_ema_is_written_as_of_its_step_and_folds_wait_for_the_writer(tmp_path):
    """The background save writes the live EMA (no host copy): a fold due while ema.pt is written waits, so
    the file holds the average of the saved step; after the write the fold goes on."""
    import threading

    from dflash_trainer.checkpoint import AsyncCheckpointer, load_checkpoint

    module = torch.nn.Linear(4, 4)
    ema = CpuEma(module, decay=0.5, every=1)
    ema.update(module, 1)
    saved = {k: v.clone() for k, v in ema.weights().items()}
    ckpt = AsyncCheckpointer(tmp_path, keep_last=2)
    gate = threading.Event()
    writes = []

    import dflash_trainer.checkpoint as cp

    real_save = cp._save

    def slow_save(obj, path):
        if path.name == "ema.pt":
            gate.wait(10)  # the writer is inside ema.pt while the training thread goes on
        writes.append(path.name)
        real_save(obj, path)

    cp._save = slow_save
    try:
        ckpt.save(1, {"w": torch.zeros(2)}, ema.freeze, release=ema.thaw)
        with torch.no_grad():
            module.weight.add_(100.0)
        ema.update(module, 2)  # the fold is queued, blocked by the writer's hold
        gate.set()
        path = ckpt.wait()
        ema.wait()
    finally:
        cp._save = real_save
    assert writes == ["ema.pt", "state.pt"]
    _, on_disk = load_checkpoint(path)
    assert on_disk["num_updates"] == 1
    for name, tensor in saved.items():
        torch.testing.assert_close(on_disk["shadow"][name], tensor)
    assert ema.num_updates == 2  # the fold happened after the write
    assert not torch.equal(ema.weights()["weight"], saved["weight"])


def test_a_write_that_fails_before_the_ema_still_releases_it(tmp_path):
    from dflash_trainer.checkpoint import AsyncCheckpointer

    module = torch.nn.Linear(2, 2)
    ema = CpuEma(module, decay=0.5, every=1)
    (tmp_path / "ckpt").write_text("a file where the checkpoint directory should be")
    ckpt = AsyncCheckpointer(tmp_path / "ckpt", keep_last=1)
    ckpt.save(1, {"w": torch.zeros(1)}, ema.freeze, release=ema.thaw)
    with pytest.raises(Exception, match="checkpoint step-00000001"):
        ckpt.wait()
    ema.update(module, 2)
    ema.wait()  # would hang for ever with the hold never released
    assert ema.num_updates == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("room", [True, False], ids=["device-snapshot", "host-snapshot"])
def test_a_background_save_of_cuda_state_holds_the_saved_step_while_training_changes_it(
    tmp_path, monkeypatch, caplog, room
):
    """Both snapshot paths: on the device (the GPU has room for a second copy) and in pinned host memory.
    The state on the GPU changes right after `save` returns, as the next optimizer step would; the file holds
    the values of the saved step, loads on the CPU (memory-mapped) and names the path taken in its log."""
    import logging

    import dflash_trainer.checkpoint as cp

    monkeypatch.setattr(cp, "device_room", lambda device, need, **_: room)
    module = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(module.parameters(), fused=True)
    module(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    ema = CpuEma(module, decay=0.5, every=1)
    state = {"model": module.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    expected = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    moments = opt.state_dict()["state"][0]["exp_avg"].detach().cpu().clone()
    ckpt = cp.AsyncCheckpointer(tmp_path, keep_last=1)
    with caplog.at_level(logging.INFO, logger="dflash_trainer.checkpoint"):
        ckpt.save(1, state, ema.freeze, release=ema.thaw)
        with torch.no_grad():  # the next step, queued on the training stream behind the snapshot
            for p in module.parameters():
                p.add_(1.0)
            opt.state[module.weight]["exp_avg"].add_(1.0)
        path = ckpt.wait()
    on_disk, _ = cp.load_checkpoint(path)
    for name, tensor in expected.items():
        assert on_disk["model"][name].device.type == "cpu"
        torch.testing.assert_close(on_disk["model"][name], tensor)
    torch.testing.assert_close(on_disk["optimizer"]["state"][0]["exp_avg"], moments)
    where = "snapshot on the device" if room else "snapshot in host memory"
    assert any(where in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert len(ckpt.stalls) == 1


def test_the_average_starts_at_begin_and_a_loaded_average_is_not_overwritten():
    """The trainer calls `begin` before its first optimizer step; after `load_state_dict` (a resume) the
    weights of the start are never copied, so the loaded average is the one that goes on."""
    module = nn.Linear(3, 2)
    ema = CpuEma(module, decay=0.5, every=1)
    start = module.weight.detach().clone()
    ema.begin()
    ema.before_weights_change()
    with torch.no_grad():
        module.weight.add_(1.0)  # the first optimizer step, after begin
    ema.update(module, step=1)
    torch.testing.assert_close(ema.weights()["weight"], 0.5 * start + 0.5 * module.weight.detach())

    resumed = CpuEma(nn.Linear(3, 2), decay=0.5, every=1)
    resumed.load_state_dict(ema.state_dict())
    resumed.begin()  # a no-op: the average came from the checkpoint
    torch.testing.assert_close(resumed.weights()["weight"], ema.weights()["weight"])
    assert resumed.num_updates == 1


def test_nothing_is_staged_before_prepare_so_a_resume_copies_alone():
    """Pinning the staging buffers holds the CUDA driver for seconds at the reference: it must not run beside
    a resume's host-to-device copies. Construction and `load_state_dict` make no buffers; `prepare` (the
    trainer's call after its first optimizer step) and the first fold do."""
    module = nn.Linear(3, 2)
    ema = CpuEma(module, decay=0.5, every=2)
    ema.load_state_dict({"decay": 0.5, "every": 2, "num_updates": 4, "shadow": dict(module.state_dict())})
    ema.wait()
    assert ema._staging == {}
    ema.update(module, step=1)  # not a fold step: still nothing
    ema.wait()
    assert ema._staging == {}
    ema.prepare()
    ema.wait()
    assert set(ema._staging) == {"weight", "bias"}
    ema.update(module, step=2)
    ema.wait()
    assert ema.num_updates == 5


def test_a_fresh_start_copies_the_weights_beside_the_first_step_which_waits_before_changing_them():
    """`begin` on a fresh start returns at once: the worker copies the weights (blocking, the copy cost the
    first step 5-7 s on an H100). The optimizer step waits for it in `before_weights_change`, so the average
    still starts at the weights of `begin`. Here the worker's copy is held back by a writer holding the
    average (`freeze`'s lock), so both waits can be seen."""
    module = nn.Linear(3, 2)
    start = module.weight.detach().clone()
    ema = CpuEma(module, decay=0.5, every=1)
    ema._frozen.acquire()  # a checkpoint writer: the copy cannot hand its shadow over
    changed = threading.Event()
    try:
        began = threading.Thread(target=ema.begin, daemon=True)
        began.start()
        began.join(timeout=5)
        assert not began.is_alive()  # begin did not wait for the copy
        step = threading.Thread(target=lambda: (ema.before_weights_change(), changed.set()), daemon=True)
        step.start()
        assert not changed.wait(0.3)  # the optimizer step waits for the copy
    finally:
        ema._frozen.release()
    assert changed.wait(5)
    with torch.no_grad():
        module.weight.add_(1.0)  # the first optimizer step
    torch.testing.assert_close(ema.weights()["weight"], start)
    assert ema._staging == {}  # no pinning beside the first step: `prepare` comes after it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fresh_start_on_cuda_averages_from_the_weights_queued_before_begin():
    """The worker copies on a stream of its own: it must see the weights as the training stream left them at
    `begin` (initialisation still queued), not as they were, nor as the first optimizer step makes them."""
    module = nn.Linear(4096, 4096, device="cuda")
    with torch.no_grad():
        for _ in range(20):  # queued work ahead of begin, long enough to be still running
            module.weight.mul_(1.01).add_(0.5)
    ema = CpuEma(module, decay=0.5, every=1)
    ema.begin()
    start = module.weight.detach().cpu()  # the training stream's view at begin
    ema.before_weights_change()
    with torch.no_grad():
        module.weight.add_(1.0)  # the first optimizer step
    torch.testing.assert_close(ema.weights()["weight"], start)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_through_small_buffers_equal_plain_copies():
    """Chunks that do not divide the tensors, a bf16 tensor widened, a CPU tensor beside the CUDA ones."""
    from dflash_trainer.ema import host_copies

    params = {
        "a": torch.randn(1000, 37, device="cuda"),
        "b": torch.randn(4099, device="cuda", dtype=torch.bfloat16),
        "c": torch.randn(5, 3),
    }
    copies = host_copies(params, None, bounce_bytes=4096)
    for name, p in params.items():
        assert copies[name].dtype == torch.float32 and copies[name].device.type == "cpu"
        assert torch.equal(copies[name], p.float().cpu()), name
