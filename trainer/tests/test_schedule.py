"""The global schedule as pure functions: equal shares for any N:M, order, and no starvation in simulation."""

from __future__ import annotations

import pytest

from dflash_trainer.distributed.schedule import (
    cycle_length,
    drafter_item,
    schedule,
    shares,
    simulate,
    static_queue_shares,
    target_items,
)
from dflash_trainer.distributed.topology import Role, resolve_topology


@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 1), (3, 2), (5, 3), (7, 1), (4, 6)])
def test_every_drafter_gets_the_same_share_each_cycle(n: int, m: int) -> None:
    cycle = cycle_length(n, m)
    transfers = schedule(n, m, steps=3 * cycle // m)
    s = shares(transfers)
    assert set(s.per_drafter.values()) == {3 * cycle // m}, s.per_drafter
    assert set(s.per_target.values()) == {3 * cycle // n}, s.per_target
    assert len(s.per_drafter) == m and len(s.per_target) == n


def test_five_three_balanced_where_queues_starved_one() -> None:
    assert sorted(static_queue_shares(5, 3).values()) == [1, 2, 2]  # the old run: one drafter idled
    s = shares(schedule(5, 3, steps=5))  # one cycle of 15 items
    assert s.per_drafter == {0: 5, 1: 5, 2: 5}
    assert s.per_pair == {(t, d): 1 for t in range(5) for d in range(3)}  # each pair once per cycle


def test_items_are_consumed_in_order_and_produced_in_order() -> None:
    transfers = schedule(3, 2, steps=6)
    assert [t.item for t in transfers] == list(range(12))
    for d in range(2):
        mine = [t.item for t in transfers if t.drafter == d]
        assert mine == [drafter_item(d, 2, s) for s in range(6)]
    assert list(target_items(1, 3, start=0, stop=12)) == [t.item for t in transfers if t.target == 1]
    assert list(target_items(2, 3, start=7, stop=15)) == [8, 11, 14]  # resume mid-run


@pytest.mark.parametrize(("n", "m"), [(5, 3), (3, 2), (7, 1), (1, 4)])
def test_simulation_balanced_pairs_keep_everyone_busy(n: int, m: int) -> None:
    # Per-device speeds matched to the split (N/target_s == M/drafter_s): nobody should wait in steady state.
    sim = simulate(n, m, target_s=float(n), drafter_s=float(m), depth=2, steps=200)
    # Ideal rate is one item per second; only the pipeline fill (one target item + one drafter step) is lost.
    assert sim.total_s <= sim.items + target_s_fill(n, m)
    assert min(sim.drafter_busy) > 0.95 and min(sim.target_busy) > 0.94


def target_s_fill(n: int, m: int) -> float:
    return float(n + m)


def test_simulation_slow_drafters_throttle_targets_not_memory() -> None:
    sim = simulate(2, 1, target_s=1.0, drafter_s=1.0, depth=2, steps=100)  # targets twice as fast as needed
    assert sim.drafter_busy[0] > 0.97  # the bottleneck never waits
    assert max(sim.target_busy) == pytest.approx(0.5, abs=0.03)  # back-pressure holds the targets


def test_depth_one_still_makes_progress() -> None:
    sim = simulate(3, 2, target_s=1.0, drafter_s=1.0, depth=1, steps=30)
    assert sim.items == 60 and sim.total_s < 60


def test_topology_roles_and_auto() -> None:
    topo = resolve_topology(5, 3, "auto")
    assert (topo.num_targets, topo.num_drafters) == (3, 2)
    assert [topo.role(r) for r in range(5)] == [Role.TARGET] * 3 + [Role.DRAFTER] * 2
    assert topo.index(4) == 1 and topo.drafter_rank(1) == 4
    assert resolve_topology(8, "auto", "auto").num_drafters == 4
    with pytest.raises(ValueError, match="does not fit 4 ranks"):
        resolve_topology(4, 3, 3)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        resolve_topology(1, "auto", "auto")


def test_plan_candidates_pick_the_balanced_split() -> None:
    from dflash_trainer.distributed.plan import candidates, efficiency

    # A target makes 3000 tokens/s, a drafter trains 2000: on 5 devices 2:3 gives 6000 = 2*3000 = 3*2000.
    best = candidates(5, 3000.0, 2000.0)[0]
    assert (best.targets, best.drafters, best.tokens_per_s, best.efficiency) == (2, 3, 6000.0, 1.0)
    assert efficiency(4, 1, 3000.0, 2000.0) == pytest.approx(2000 / 12000)
    assert [c.targets + c.drafters for c in candidates(8, 1.0, 1.0)] == [8] * 7


def test_plan_from_measured_h200_figures_picks_four_four(capsys) -> None:
    """One H200 target: 8.8K tokens/s, one drafter: 10.3K (docs/journal.md): 4:4 beats the seeds' 5:3."""
    from dflash_trainer.cli import main

    assert main(["plan", "8", "--figures", "8800", "10300"]) == 0
    out = capsys.readouterr().out
    assert "set [topology] targets = 4, drafters = 4" in out
    best, _second = (line for line in out.splitlines() if line.strip().startswith(("4:4", "5:3")))
    assert "<- best" in best and best.strip().startswith("4:4")


def test_node_layout_packs_drafters_on_the_last_nodes() -> None:
    """The multi-node placement rule (docs/pipeline.md): targets first, drafters packed on the last nodes."""
    from dflash_trainer.distributed.topology import Topology, node_layout

    assert node_layout(Topology(8, 8), 8) == ["node 0: targets 0-7", "node 1: drafters 8-15"]
    assert node_layout(Topology(12, 4), 8) == ["node 0: targets 0-7", "node 1: targets 8-11, drafters 12-15"]
    assert node_layout(Topology(1, 1), 1) == ["node 0: target 0", "node 1: drafter 1"]
    assert node_layout(Topology(6, 10), 8) == ["node 0: targets 0-5, drafters 6-7", "node 1: drafters 8-15"]
    with pytest.raises(ValueError, match="do not fill nodes of 3"):
        node_layout(Topology(4, 4), 3)
