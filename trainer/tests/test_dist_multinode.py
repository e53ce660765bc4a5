"""Two hosts, shown on one: two torchrun launches joined by a c10d rendezvous over loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trainer.distributed.local import free_port

pytestmark = pytest.mark.system


def test_two_nodes_over_c10d_rendezvous(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=dflash-test"]
    cmd += ["--monitor-interval=0.5", "-m", "dflash_trainer.distributed.rank", "--synthetic"]
    cmd += ["--targets", "1", "--drafters", "1", "--steps", "10", "--metrics-out", str(out)]
    nodes = [
        subprocess.Popen(cmd, env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ]
    nodes.append(
        subprocess.Popen(cmd, env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    )
    logs = [node.communicate(timeout=120)[0] for node in nodes]

    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    ranks = sorted(json.loads(out.read_text())["ranks"], key=lambda r: r["rank"])
    assert [(r["role"], r["items"]) for r in ranks] == [("target", 10), ("drafter", 10)]
    assert ranks[1]["extra"]["checked"] == 10
    table = next(log for log in logs if "pipeline:" in log)  # printed by the node that got rank 0
    assert "drafter" in table and "target" in table
