"""The launchers' NodeWatch over a real TCPStore on loopback: a node that announces its host's shutdown is
named as left by the others (their units then restart and wait for it), and the host's shutdown is told
from an ordinary stop by systemd's own state."""

from __future__ import annotations

import os
import stat
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch import distributed as dist

from dflash_trainer.distributed.elastic import NodeWatch, host_shutting_down


def watches(store: dist.TCPStore) -> tuple[NodeWatch, NodeWatch]:
    names = ("node 0 (ct-a, rank 0)", "node 1 (ct-b, rank 1)")
    return tuple(
        NodeWatch("127.0.0.1", store.port, "dflash-nodes/t/", g, 2, names[g], interval=0.1, dead_after=5.0)
        for g in (0, 1)
    )


def test_a_node_leaving_for_its_hosts_shutdown_is_named_by_the_others() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    a, b = watches(store)
    a.start(), b.start()
    try:
        time.sleep(0.3)
        assert a.left is None and b.left is None and a.lost is None
        b.announce_leaving("its host ct-b is shutting down or rebooting")
        deadline = time.monotonic() + 5
        while a.left is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.left == "node 1 (ct-b, rank 1) left: its host ct-b is shutting down or rebooting"
        assert b.refresh_left() is None  # a node never takes itself for left
        b.finish()
        time.sleep(0.3)
        assert a.lost is None  # finished, not lost
    finally:
        a.stop(), b.stop()


@pytest.mark.parametrize(
    ("state", "shutting_down"), [("stopping", True), ("running", False), ("degraded", False)]
)
def test_host_shutdown_is_systemds_stopping_state(
    tmp_path: Path, monkeypatch, state: str, shutting_down: bool
) -> None:
    # systemctl(1): is-system-running prints the manager's state; it exits non-zero for any but "running".
    fake = tmp_path / "systemctl"
    fake.write_text(f"#!/bin/sh\necho {state}\n[ {state} = running ]\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert host_shutting_down() is shutting_down


def test_no_systemd_is_no_shutdown(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert host_shutting_down() is False
