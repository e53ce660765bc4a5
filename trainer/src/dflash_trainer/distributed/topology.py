"""Which rank does what: ranks [0, N) run the target, ranks [N, N+M) train the drafter."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class Role(StrEnum):
    TARGET = "target"
    DRAFTER = "drafter"


@dataclass(frozen=True)
class Topology:
    num_targets: int
    num_drafters: int

    @property
    def world_size(self) -> int:
        return self.num_targets + self.num_drafters

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.num_targets))

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_targets, self.world_size))

    def role(self, rank: int) -> Role:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return Role.TARGET if rank < self.num_targets else Role.DRAFTER

    def index(self, rank: int) -> int:
        """Position of the rank among the ranks of its role (target t, drafter d)."""
        return rank if rank < self.num_targets else rank - self.num_targets

    def target_rank(self, t: int) -> int:
        return t

    def drafter_rank(self, d: int) -> int:
        return self.num_targets + d


Count = int | Literal["auto"]


def resolve_topology(world_size: int, targets: Count, drafters: Count) -> Topology:
    """[topology] targets/drafters against the launched world size.

    One side "auto": the rest of the world. Both "auto": half and half, the extra rank to the target (for the
    reference pair a target forward and a drafter step cost about the same; `dflash-train plan` measures it).
    """
    if world_size < 2:
        raise ValueError(
            f"the pipeline needs at least 2 ranks (1 target + 1 drafter), got world size {world_size}"
        )
    if targets == "auto" and drafters == "auto":
        n = (world_size + 1) // 2
        m = world_size - n
    elif targets == "auto":
        m = int(drafters)
        n = world_size - m
    elif drafters == "auto":
        n = int(targets)
        m = world_size - n
    else:
        n, m = int(targets), int(drafters)
    if n < 1 or m < 1 or n + m != world_size:
        raise ValueError(
            f"topology.targets={targets}, topology.drafters={drafters} does not fit {world_size} ranks "
            f"(need targets >= 1, drafters >= 1, targets + drafters == world size)"
        )
    return Topology(n, m)


def node_layout(topo: Topology, per_node: int) -> list[str]:
    """Where the roles land when the job spans nodes of `per_node` ranks each (torch elastic numbers ranks
    node by node: rank = node * per_node + local rank).

    The placement rule: targets take the first ranks, drafters the last, so the drafters are packed on the
    last node(s). A drafter step all-reduces every gradient of the drafter (fp32: 4 bytes per parameter, 6.8
    GB for the reference's 1.7B, each step) while a target sends one item's features to one drafter (157 MB
    per 3072-token sequence): the all-reduce belongs inside a node (NVLink, PCIe); the features cross hosts.
    As the last rank ends a node, the M drafters always span exactly ceil(M / per_node) nodes: with M up to a
    node's size, DDP never leaves its node.
    """
    if per_node < 1 or topo.world_size % per_node:
        raise ValueError(f"{topo.world_size} ranks do not fill nodes of {per_node}")
    lines = []
    for node in range(topo.world_size // per_node):
        ranks = range(node * per_node, (node + 1) * per_node)
        parts = []
        for role in (Role.TARGET, Role.DRAFTER):
            mine = [r for r in ranks if topo.role(r) is role]
            if mine:
                name = f"{role.value}{'s' if len(mine) > 1 else ''}"
                span = str(mine[0]) if len(mine) == 1 else f"{mine[0]}-{mine[-1]}"
                parts.append(f"{name} {span}")
        lines.append(f"node {node}: " + ", ".join(parts))
    return lines
