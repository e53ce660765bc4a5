"""The pipeline's graceful stop and resume position: the pure parts, then SIGTERM-like stops of real gloo
topologies (model-free workload) on any one rank or all, which must end every rank cleanly at one step."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from test_data import first_tokens, make_shards

from dflash_trainer.data.shards import ShardReader, split_held_out
from dflash_trainer.distributed.stopping import StopSignal, drain_end
from dflash_trainer.train.schedule import anchor_seed


def test_drain_end_bounds_what_is_in_flight() -> None:
    # 1:1, depth 2, stop at 5 of 100: receives posted below step 6, a target at most 2 sends past that.
    assert drain_end(5, 100, 2, 1, 1) == 8
    # 5:3: posted below step 6 (18 items), each target up to 2 sends (10 items) past.
    assert drain_end(5, 100, 2, 5, 3) == 28
    # Near the end of the run nothing goes past its last item.
    assert drain_end(99, 100, 2, 5, 3) == 300
    assert drain_end(100, 100, 2, 1, 1) == 100


def test_stop_signal_any_rank_asks_the_leader_decides() -> None:
    store = dist.HashStore()
    target_flag, leader_flag, drafter_flag = threading.Event(), threading.Event(), threading.Event()
    target, leader, drafter = (
        StopSignal(store, target_flag),
        StopSignal(store, leader_flag),
        StopSignal(store, drafter_flag),
    )
    assert target.poll() is None and leader.decide(3) is None and drafter.poll() is None
    target_flag.set()  # SIGTERM on a target only
    assert target.poll() is None  # asked; the leader has not decided yet
    assert leader.decide(4) == 5  # train step 4 (the other drafters may be in it), stop before 5
    assert drafter.poll() == 5 and target.poll() == 5
    assert leader.decide(5) == 5  # decided once


def test_a_lone_drafter_stops_before_the_step_it_is_at() -> None:
    store, flag = dist.HashStore(), threading.Event()
    leader = StopSignal(store, flag)
    flag.set()
    assert leader.decide(7, alone=True) == 7  # no other drafter can be inside step 7


def test_state_at_is_where_iteration_gets(tmp_path: Path) -> None:
    train, _ = split_held_out(make_shards(tmp_path / "d"), held_out=2)
    straight = first_tokens(itertools.islice(ShardReader(train, seed=5, shuffle_window=3), 60))
    for rows in (0, 4, 5, 18, 19, 23, 40):  # inside a shard, at its end, at an epoch's end, in epoch 2
        reader = ShardReader(train, seed=5, shuffle_window=3)
        reader.load_state_dict(reader.state_at(rows))
        assert first_tokens(itertools.islice(reader, 60 - rows)) == straight[rows:], rows


def test_anchor_seed_depends_on_the_item_only() -> None:
    assert anchor_seed(0, 7) == anchor_seed(0, 7) != anchor_seed(0, 8) != anchor_seed(1, 7)


# ---- real topologies: a stop on one rank or on all, at a random moment ----


def _stop_worker(local_rank: int, argv: list[str], world: int, port: int, stop_ranks: list[int]) -> None:
    import os

    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import logging

    from dflash_trainer.distributed.rank import (
        Control,
        build_parser,
        command_line_topology,
        options_from_args,
        run_rank,
    )

    logging.basicConfig(level=logging.INFO, format=f"rank {local_rank}: %(message)s")
    stop = threading.Event()

    def on_ready() -> None:
        if local_rank in stop_ranks:  # "SIGTERM" a moment into the run
            threading.Timer(0.5 + 0.1 * local_rank, stop.set).start()

    args = build_parser().parse_args(argv)
    control = Control(stop=stop, on_ready=on_ready, on_step=None)
    run_rank(None, options_from_args(args), control, topo=command_line_topology(args, None, world))  # raises


@pytest.mark.system
@pytest.mark.parametrize(
    ("n", "m", "stop_ranks"), [(1, 1, [0, 1]), (2, 1, [1]), (3, 2, [0, 1, 2, 3, 4]), (1, 3, [3])]
)
def test_a_stop_ends_every_rank_at_one_step(tmp_path: Path, n: int, m: int, stop_ranks: list[int]) -> None:
    import multiprocessing

    import torch.multiprocessing as mp

    from dflash_trainer.distributed.local import PRELOAD, free_port

    steps = 400  # 4+ s of drafter steps: the stop lands well inside
    out = tmp_path / "metrics.json"
    argv = ["--synthetic", "--targets", str(n), "--drafters", str(m), "--steps", str(steps)]
    argv += ["--drafter-s", "0.01", "--log-every", "1000", "--metrics-out", str(out), "--timeout-s", "30"]
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _stop_worker, args=(argv, n + m, free_port(), stop_ranks), nprocs=n + m, start_method="forkserver"
    )

    ranks = {r["rank"]: r for r in json.loads(out.read_text())["ranks"]}
    drafters = [ranks[r]["extra"] for r in range(n, n + m)]
    stopped = {d["steps"] for d in drafters}
    assert len(stopped) == 1 and 0 < stopped.pop() < steps, drafters
    assert all(d["stopped"] for d in drafters)
    assert [d["checked"] for d in drafters] == [drafters[0]["steps"]] * m  # every trained item was real
    assert len({d["param_sum"] for d in drafters}) == 1
