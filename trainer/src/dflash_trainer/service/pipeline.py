"""`dflash-train serve` for an N:M topology: this rank's pipeline role with the service's behaviour.

The drafter leader is the one voice to systemd (it waits on every target through its receives and on every
drafter through DDP, so a hang anywhere stops its WATCHDOG=1): READY=1 once every rank has loaded and
resumed, STATUS= and WATCHDOG=1 from its step loop, tracker scalars. Other ranks send nothing. Every start
resumes from the newest checkpoint; SIGTERM on any rank -> the ranks agree on a stop step
(distributed/stopping.py), the leader saves, every rank exits 0.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from dflash_trainer.config import TopologyConfig, TrainConfig

log = logging.getLogger("dflash_trainer.service")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def named_ranks(topology: TopologyConfig) -> int:
    return sum(n for n in (topology.targets, topology.drafters) if isinstance(n, int))


def wants_pipeline(topology: TopologyConfig, world: int) -> bool:
    """The launched world decides. A configuration that names more ranks than one, launched as one rank, runs
    the single-process loop as before (with a warning): configs/lab.toml names 1:1 and the lab unit starts
    one rank (trainer_service_nproc 1)."""
    return world > 1


def leader_rank(cfg: TrainConfig, world: int) -> int:
    """The rank that speaks to systemd: the first drafter of a pipeline, else rank 0."""
    if not wants_pipeline(cfg.topology, world):
        return 0
    from dflash_trainer.distributed.topology import resolve_topology

    return resolve_topology(world, cfg.topology.targets, cfg.topology.drafters).drafter_ranks[0]


def launch_args(config: Path, cfg: TrainConfig, max_steps: int | None) -> list[str]:
    """The pipeline entry's arguments for a service rank: resume always, the config's logging cadence."""
    argv = [str(config), "--resume", "--log-every", str(cfg.train.log_every)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    if cfg.train.device == "cpu":
        argv.append("--cpu")
    return argv


def serve_pipeline(
    config: Path, cfg: TrainConfig, hooks, stop: threading.Event, *, max_steps: int | None
) -> None:
    """This rank's role to the horizon or an agreed stop; raises on failure (the launcher ends the job)."""
    from dflash_trainer.distributed.launch import Control, build_parser, run

    args = build_parser().parse_args(launch_args(config, cfg, max_steps))
    run(args, Control(stop=stop, on_ready=hooks.on_ready, on_step=hooks))
