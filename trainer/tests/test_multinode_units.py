"""Several nodes, the fast parts: preflight's rank count per node, the launcher's arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_run import tiny_run_config


def test_preflight_counts_the_ranks_of_every_node(tmp_path: Path, tiny_target) -> None:
    from dflash_trainer.service.preflight import run_checks

    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    config = tiny_run_config(tmp_path / "t.toml", target, shards, topology={"targets": 1, "drafters": 1})
    two_nodes = {c.name: c for c in run_checks(config, nproc=1, nnodes=2)}
    assert two_nodes["devices"].ok and "cpu: 1 ranks" in two_nodes["devices"].detail, two_nodes["devices"]
    defaulted = {c.name: c for c in run_checks(config, nnodes=2)}  # no --nproc: [topology]'s share per node
    assert defaulted["devices"].ok and "cpu: 1 ranks" in defaulted["devices"].detail
    wrong = {c.name: c for c in run_checks(config, nproc=2, nnodes=2)}["devices"]
    assert not wrong.ok
    assert "= 2, the launch starts 2 on each of 2 nodes" in wrong.detail, wrong
    uneven = tiny_run_config(tmp_path / "u.toml", target, shards, topology={"targets": 1, "drafters": 2})
    split = {c.name: c for c in run_checks(uneven, nnodes=2)}["devices"]  # no --nproc: 3 ranks over 2 nodes
    assert not split.ok and "= 3, the launch starts 1 on each of 2 nodes" in split.detail, split


def test_the_launcher_refuses_several_nodes_without_an_endpoint(capsys) -> None:
    from dflash_trainer.service.supervisor import main

    with pytest.raises(SystemExit) as e:
        main(["--nnodes", "2", "--", "serve", "x.toml"])
    assert e.value.code == 2
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in capsys.readouterr().err
