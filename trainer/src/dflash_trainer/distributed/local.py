"""Run the pipeline's ranks as local processes without torchrun (tests, the bench): the same `rank.main`,
started from a forkserver that imported torch once, so K ranks do not each pay the import on a small machine.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Sequence

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "dflash_trainer.distributed.rank", "dflash_trainer.train.loop"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(local_rank: int, argv: list[str], world: int, port: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" in env:  # torch was imported by the forkserver, before this environment
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from dflash_trainer.distributed.rank import main

    code = main(argv)
    if code:
        raise SystemExit(code)


def spawn_local(
    argv: Sequence[str], nprocs: int, *, env: dict[str, str] | None = None, preload: Sequence[str] = ()
) -> None:
    """Runs `rank.main(argv)` on ranks 0..nprocs-1; raises if any rank fails (the others are terminated)."""
    multiprocessing.set_forkserver_preload([*PRELOAD, *preload])
    mp.start_processes(
        _worker,
        args=(list(argv), nprocs, free_port(), dict(env or {})),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )
