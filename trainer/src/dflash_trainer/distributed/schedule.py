"""The global deterministic schedule: which target makes which sample and which drafter trains on it.

Samples ("items", one optimizer micro-batch of optim.batch sequences each) are numbered 0, 1, 2, ... over the
whole run. Item i is made by target i mod N and consumed by drafter i mod M at drafter step i // M. Over a
cycle of lcm(N, M) items every target makes lcm/N items and every drafter gets lcm/M, whatever N and M are:
5 targets and 3 drafters give each drafter 5 of every 15 items, where per-drafter queues fed round-robin by
target gave 2, 2 and 1 targets per drafter. The order of data is fixed by the item number alone, not by
timing, so a run is reproducible and its position is one integer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    item: int
    target: int  # index among the target ranks
    drafter: int  # index among the drafter ranks
    step: int  # the drafter step that trains on the item


def source(item: int, num_targets: int) -> int:
    return item % num_targets


def dest(item: int, num_drafters: int) -> int:
    return item % num_drafters


def step_of(item: int, num_drafters: int) -> int:
    return item // num_drafters


def drafter_item(drafter: int, num_drafters: int, step: int) -> int:
    """The item drafter `drafter` trains on at `step` (all drafters step together under DDP)."""
    return step * num_drafters + drafter


def target_items(target: int, num_targets: int, start: int = 0, stop: int | None = None) -> Iterator[int]:
    """The items target `target` makes, in order, from the first one >= start (stop: exclusive bound)."""
    first = start + (target - start) % num_targets
    item = first
    while stop is None or item < stop:
        yield item
        item += num_targets


def cycle_length(num_targets: int, num_drafters: int) -> int:
    """Items after which every target and every drafter has had its equal share."""
    return math.lcm(num_targets, num_drafters)


def schedule(num_targets: int, num_drafters: int, steps: int, start_step: int = 0) -> list[Transfer]:
    """Every transfer of drafter steps [start_step, start_step + steps), in item order."""
    first = start_step * num_drafters
    return [
        Transfer(i, source(i, num_targets), dest(i, num_drafters), step_of(i, num_drafters))
        for i in range(first, first + steps * num_drafters)
    ]


@dataclass(frozen=True)
class Shares:
    per_target: dict[int, int]
    per_drafter: dict[int, int]
    per_pair: dict[tuple[int, int], int]


def shares(transfers: list[Transfer]) -> Shares:
    return Shares(
        per_target=dict(Counter(t.target for t in transfers)),
        per_drafter=dict(Counter(t.drafter for t in transfers)),
        per_pair=dict(Counter((t.target, t.drafter) for t in transfers)),
    )


def static_queue_shares(num_targets: int, num_drafters: int) -> dict[int, int]:
    """The old scheme, for contrast: one queue per drafter, target t feeding queue t mod M only."""
    return dict(Counter(t % num_drafters for t in range(num_targets)))


@dataclass(frozen=True)
class Simulation:
    total_s: float
    items: int
    target_busy: list[float]  # fraction of total_s each target computes
    drafter_busy: list[float]

    @property
    def items_per_s(self) -> float:
        return self.items / self.total_s


def simulate(
    num_targets: int, num_drafters: int, target_s: float, drafter_s: float, *, depth: int, steps: int
) -> Simulation:
    """Event times of the schedule with `depth` outstanding sends per target and `depth` posted receives per
    drafter (transfers take no time). Used to check that the schedule plus back-pressure neither starves a
    drafter nor stalls a target beyond what the N:M throughput ratio forces.
    """
    n, m = num_targets, num_drafters
    items = steps * m
    issued: list[float] = [0.0] * items  # when the target issued the isend (product ready, slot free)
    arrival: list[float] = [0.0] * items  # when the drafter holds the item
    end: list[float] = []  # end of each drafter step
    target_free = [0.0] * n  # when each target may start its next item
    for j in range(items):
        t, s = source(j, n), step_of(j, m)
        produced = target_free[t] + target_s
        oldest = j - depth * n  # this target's item `depth` sends back must have landed first
        issued[j] = max(produced, arrival[oldest]) if oldest >= 0 else produced
        target_free[t] = issued[j]
        posted = end[s - depth] if s - depth >= 0 else 0.0  # the drafter's receive window
        arrival[j] = max(issued[j], posted)
        if dest(j, m) == m - 1:  # the step's last item: the step can be timed
            begin = max(end[-1] if end else 0.0, *(arrival[drafter_item(d, m, s)] for d in range(m)))
            end.append(begin + drafter_s)
    total = end[-1]
    made = Counter(source(j, n) for j in range(items))
    return Simulation(
        total_s=total,
        items=items,
        target_busy=[made[t] * target_s / total for t in range(n)],
        drafter_busy=[steps * drafter_s / total] * m,
    )
