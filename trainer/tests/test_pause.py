"""`serve --pause-at`: the operator harness's pause (service/pause.py), outside the production step hook."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_trainer.service.notify import Notifier
from dflash_trainer.service.pause import PAUSED, PauseAt
from dflash_trainer.service.serve import ServiceHooks

CFG = SimpleNamespace(
    service=SimpleNamespace(status_every=5), train=SimpleNamespace(log_every=5, device="cpu")
)


def _metrics(step: int) -> SimpleNamespace:
    return SimpleNamespace(step=step, loss=5.0, lr=1e-3, grad_norm=1.0, anchor_accept=1.5, seq_tokens=64,
                           tokens_per_s=640.0, eval={})  # fmt: skip


def _listen(tmp_path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    return server, path


def _until(server: socket.socket, text: str) -> list[str]:
    """Every datagram field up to and including the first that contains `text`."""
    seen: list[str] = []
    while not any(text in f for f in seen):
        seen += server.recv(4096).decode().split("\n")
    return seen


def test_the_production_hook_never_pauses() -> None:
    hooks = ServiceHooks(CFG, Notifier({}), [])
    done = threading.Thread(target=lambda: [hooks(_metrics(s)) for s in range(1, 8)], daemon=True)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive() and hooks.last.step == 7


def test_the_pause_waits_at_its_step_after_the_hook_reported_it_until_the_stop(tmp_path) -> None:
    server, path = _listen(tmp_path)
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "800000"})  # a ping every 0.2 s while paused
    stop = threading.Event()
    hooks = ServiceHooks(CFG, notifier, [])
    pause = PauseAt(hooks, 3, notifier, stop)
    for step in (1, 2):
        pause(_metrics(step))  # returns: not the pause step
    assert hooks.last.step == 2
    paused = threading.Thread(target=pause, args=(_metrics(3),), daemon=True)
    paused.start()
    _until(server, f"STATUS=step 3: {PAUSED}")  # the text dflash-smoke and rehearse.py wait for
    assert hooks.last.step == 3  # the step was reported (STATUS, trackers, summary) before the wait
    assert _until(server, "WATCHDOG=1")  # the watchdog is fed while paused
    assert paused.is_alive()
    stop.set()  # SIGTERM's handler in serve.py
    paused.join(timeout=5)
    assert not paused.is_alive(), "the stop did not end the pause"
    server.close()


def test_the_leader_relay_ends_the_pause_through_control_on_relay() -> None:
    """Several nodes: rank.py hands the drafter leader's hook the relay's beat and the job's stop-asked check
    through Control.on_relay; a stop asked on another node ends the pause."""
    pause = PauseAt(ServiceHooks(CFG, Notifier({}), []), 3, Notifier({}), threading.Event())
    beats: list[int] = []
    pause.attach_relay(lambda: beats.append(1), lambda: len(beats) >= 2)
    done = threading.Thread(target=pause, args=(_metrics(3),), daemon=True)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive(), "the pause did not end on the stop asked elsewhere"
    assert len(beats) == 2  # the leader beat while paused, until the stop was asked


@pytest.mark.parametrize("paused", [False, True])
def test_serve_pipeline_hands_the_rank_the_pause_only_when_asked(monkeypatch, paused: bool) -> None:
    from dflash_trainer.distributed import rank as rank_module
    from dflash_trainer.service.serve import serve_pipeline

    seen = []
    final = Path("step-00000003")

    def run_rank(cfg, options, control, topo) -> Path:
        seen.append(control)
        return final

    monkeypatch.setattr(rank_module, "run_rank", run_rank)
    stop = threading.Event()
    hooks = ServiceHooks(CFG, Notifier({}), [])
    pause = PauseAt(hooks, 3, hooks.notifier, stop) if paused else None
    topo = SimpleNamespace(drafter_ranks=[1])
    assert serve_pipeline(CFG, topo, hooks, stop, max_steps=None, pause=pause) is final  # for the end's log
    (control,) = seen
    if paused:
        assert control.on_step is pause and control.on_relay == pause.attach_relay
    else:
        assert control.on_step is hooks and control.on_relay is None
