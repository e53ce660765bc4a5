"""dflash_trainer.service without systemd: sd_notify datagrams, the self-disabling tracker, API checks."""

from __future__ import annotations

import faulthandler
import logging
import socket

from dflash_trainer.service import trackers
from dflash_trainer.service.notify import Heartbeat, Notifier


def test_notify_is_a_no_op_without_a_socket():
    n = Notifier({})
    assert not n.enabled and not n.ready() and not n.watchdog(force=True)


def test_notify_sends_ready_status_and_watchdog(tmp_path):
    path = str(tmp_path / "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(2)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000"})
    assert n.watchdog_s == 20.0
    n.ready(status="loaded")
    assert server.recv(4096) == b"READY=1\nSTATUS=loaded"
    n.status("step 5 loss 1.0")
    assert server.recv(4096) == b"STATUS=step 5 loss 1.0"
    assert n.watchdog(force=True) and server.recv(4096) == b"WATCHDOG=1"
    assert not n.watchdog()  # rate-limited within a tenth of the interval
    server.close()


def test_a_heartbeat_feeds_the_watchdog_as_work_advances_and_says_what_it_does(tmp_path, caplog):
    path = str(tmp_path / "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(2)
    beat = Heartbeat(Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000"}), every_s=0.0)
    with caplog.at_level(logging.INFO, logger="dflash_trainer.service"):
        beat("evaluation at step 1000: decode walk prompt 3 of 8: 57 of 128 tokens")
    assert server.recv(4096) == b"WATCHDOG=1"
    assert server.recv(4096) == b"STATUS=evaluation at step 1000: decode walk prompt 3 of 8: 57 of 128 tokens"
    assert "decode walk prompt 3 of 8" in caplog.text
    quiet = Heartbeat(Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000"}), every_s=3600)
    quiet("again")  # WATCHDOG=1 each time the work moves; STATUS and the journal at most every every_s
    assert server.recv(4096) == b"WATCHDOG=1"
    server.settimeout(0.2)
    try:
        extra = server.recv(4096)
    except TimeoutError:
        extra = None
    assert extra is None
    server.close()
    faulthandler.cancel_dump_traceback_later()  # the beats armed the stack dump (16 s): not for the test run


class Boom:
    name = "boom"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, step, values) -> None:
        self.calls += 1
        raise OSError("server unreachable")

    def close(self) -> None:
        raise OSError("server unreachable")


def test_a_failing_tracker_warns_once_and_turns_itself_off(caplog):
    inner = Boom()
    t = trackers.SafeTracker(inner)
    with caplog.at_level(logging.WARNING):
        for step in range(5):
            t.log(step, {"loss": 1.0})
        t.close()
    assert inner.calls == 1 and t.failed
    assert len([r for r in caplog.records if "tracker boom failed" in r.getMessage()]) == 1


def test_api_check_names_a_missing_parameter():
    def init(project=None, name=None):  # an older signature
        return None

    import types

    fake = types.ModuleType("fake_tracker_mod")
    fake.init = init
    import sys

    sys.modules["fake_tracker_mod"] = fake
    try:
        problems = trackers.check_api((trackers.ApiNeed("fake_tracker_mod.init", ("project", "mode")),))
    finally:
        del sys.modules["fake_tracker_mod"]
    assert problems and "takes no mode" in problems[0]


def test_installed_trackers_match_the_api_the_code_calls():
    assert trackers.check_api(trackers.WANDB_NEEDS) == []
    assert trackers.check_api(trackers.TENSORBOARD_NEEDS) == []


def test_process_start_time_counts_from_the_process_start():
    """The "ready" line counts from the rank's process start (interpreter and imports included), not from
    when the service code began timing."""
    import subprocess
    import time

    from dflash_trainer.service.process import process_started

    before = time.time()
    child = subprocess.Popen(["sleep", "5"])
    try:
        time.sleep(1.5)
        started = process_started(child.pid)
        assert before - 1.5 <= started <= before + 1.0, (before, started)  # btime: whole seconds
    finally:
        child.kill()
        child.wait()
    assert process_started() < before  # this test process started earlier still
