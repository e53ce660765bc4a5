"""Entry point of every rank: `torchrun ... -m dflash_trainer.distributed.launch CONFIG [options]`.

Sets up the process groups, takes the rank's role, runs its loop, and at the end gathers every rank's
metrics to rank 0, which prints the summary table and draws the timeline. Any failure is logged as
`rank R (role, device on host): cause` and ends the job (see failure.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from dflash_trainer.distributed.failure import (
    Identity,
    PeerMonitor,
    fault_from_env,
    handle_failure,
    install_excepthooks,
)
from dflash_trainer.distributed.metrics import RankMeter, RankSummary, pipeline_tokens_per_s, summary_table
from dflash_trainer.distributed.roles import RunSpan, run_drafter, run_target
from dflash_trainer.distributed.stopping import StopSignal
from dflash_trainer.distributed.topology import Role, resolve_topology

log = logging.getLogger("dflash_trainer.distributed")


def _count(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash_trainer.distributed.launch", description=__doc__)
    p.add_argument("config", nargs="?", type=Path, help="training TOML (omit with --synthetic or --bench)")
    p.add_argument("--synthetic", action="store_true", help="model-free stand-in workload (CI)")
    p.add_argument("--bench", choices=("tiny", "qwen3-8b"), help="random models of a bench size")
    p.add_argument("--targets", type=_count, help="override topology.targets (int or auto)")
    p.add_argument("--drafters", type=_count, help="override topology.drafters (int or auto)")
    p.add_argument("--steps", type=int, help="drafter steps to run (default: the config's horizon)")
    p.add_argument(
        "--max-steps", type=int, help="stop (and save) at this step; the LR schedule keeps its horizon"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, if any")
    p.add_argument("--depth", type=int, default=2, help="items in flight per rank (back-pressure bound)")
    p.add_argument("--log-every", type=int, default=10, help="per-rank metrics line every N items/steps")
    p.add_argument(
        "--warmup-items", type=int, default=0, help="items before the steady-state throughput is measured"
    )
    p.add_argument("--timeline", type=Path, help="rank 0 writes the per-rank timeline PNG here")
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes every rank's summary as JSON here")
    p.add_argument("--timeout-s", type=float, default=300.0, help="p2p/collective timeout once running")
    p.add_argument("--startup-timeout-s", type=float, default=1800.0, help="timeout while models load")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--dead-after-s", type=float, default=15.0, help="a silent peer is dead after this")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA exists")
    # Synthetic workload knobs (tests, bench of the transport alone).
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--target-s", type=float, default=0.0, help="synthetic: seconds per target item")
    p.add_argument("--drafter-s", type=float, default=0.0, help="synthetic: seconds per drafter step")
    return p


@dataclass
class Control:
    """What `dflash-train serve` adds to a rank (service/pipeline.py); plain torchrun launches pass none."""

    stop: threading.Event  # set on SIGTERM: the ranks agree on a stop step (stopping.py), save, return 0
    on_ready: Callable[[], None]  # every rank, once all ranks have loaded (and resumed)
    on_step: Callable[[Any], None] | None  # the drafter leader, after each step, with its StepMetrics


class _Observed:
    """The drafter leader's consumer, reporting each step's metrics (tokens/s of the whole pipeline)."""

    def __init__(self, inner: Any, on_step: Callable[[Any], None], num_drafters: int) -> None:
        self.inner, self.on_step, self.num_drafters = inner, on_step, num_drafters
        self._last: float | None = None

    def step(self, step: int, item: int, batch: Any) -> str:
        note = self.inner.step(step, item, batch)
        now, m = time.perf_counter(), self.inner.last
        # Wall time between step ends: what the pipeline delivers, waits on targets included.
        elapsed = now - self._last if self._last is not None else m.step_s
        m.tokens_per_s = m.seq_tokens * self.num_drafters / elapsed if elapsed > 0 else 0.0
        self._last = now
        self.on_step(m)
        return note

    def finish(self, step: int) -> dict[str, Any]:
        return self.inner.finish(step)


def _device(cpu: bool) -> tuple[torch.device, str]:
    if torch.cuda.is_available() and not cpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def _setup_logging(me: Identity) -> None:
    fmt = f"%(asctime)s %(levelname)s {me}: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr, force=True)


def _build(
    args: argparse.Namespace, role: Role, device: torch.device, drafters: dist.ProcessGroup, topo: Any
):
    """(producer or consumer, wire format, steps, start step) for this rank's role."""
    if args.synthetic:
        from dflash_trainer.distributed.work_synthetic import (
            SyntheticConsumer,
            SyntheticProducer,
            SyntheticSpec,
        )

        spec = SyntheticSpec(
            args.rows, args.seq_len, args.features, target_s=args.target_s, drafter_s=args.drafter_s
        )
        work = (
            SyntheticProducer(spec, device)
            if role is Role.TARGET
            else SyntheticConsumer(spec, device, drafters)
        )
        return work, spec.wire, args.steps or 20, 0
    from dflash_trainer.distributed.work_dflash import build_dflash

    return build_dflash(args, role, device, drafters, topo)


def _topology_counts(args: argparse.Namespace) -> tuple[Any, Any]:
    targets, drafters = "auto", "auto"
    if args.config is not None:
        from dflash_trainer.config import load_config

        cfg = load_config(args.config, check_paths=False)
        targets, drafters = cfg.topology.targets, cfg.topology.drafters
    return (args.targets or targets), (args.drafters or drafters)


def _report(summaries: list[RankSummary], args: argparse.Namespace) -> None:
    print(summary_table(summaries), flush=True)
    if args.timeline:
        from dflash_trainer.distributed.timeline import plot_timeline

        log.info("timeline: %s", plot_timeline(summaries, args.timeline))
    if args.metrics_out:
        data = {
            "pipeline_tokens_per_s": pipeline_tokens_per_s(summaries),
            "ranks": [
                {k: v for k, v in dataclasses.asdict(s).items() if k != "intervals"} for s in summaries
            ],
        }
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_out.write_text(json.dumps(data, indent=1))


def run(args: argparse.Namespace, control: Control | None = None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, backend = _device(args.cpu)
    targets, drafters = _topology_counts(args)
    topo = resolve_topology(world, targets, drafters)
    role = topo.role(rank)
    me = Identity(rank, role.value, str(device), socket.gethostname())
    if control is None:
        _setup_logging(me)
    else:  # the service's journal format; the line prefix takes the role now
        from dflash_trainer.service.logs import set_role

        set_role(role.value)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.startup_timeout_s))
    monitor = PeerMonitor(me, world, interval=args.heartbeat_s, dead_after=args.dead_after_s).start()
    install_excepthooks(me, device, monitor)
    try:
        return _run_role(args, rank, topo, role, me, device, backend, monitor, control)
    except BaseException as exc:
        handle_failure(me, exc, device, monitor)
        raise  # to torchrun's @record: the error file it reports as the root cause
    finally:
        monitor.done()


def _run_role(
    args, rank, topo, role, me, device, backend, monitor: PeerMonitor, control: Control | None
) -> int:
    running = timedelta(seconds=args.timeout_s)
    # Every rank creates every group, in the same order (torch.distributed requires it).
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.startup_timeout_s))
    pipe = dist.new_group(timeout=running, backend=backend)
    drafters = dist.new_group(topo.drafter_ranks, timeout=running, backend=backend)
    log.info(
        "pid %d, local rank %s: %s %d of %d:%d; loading",
        os.getpid(),
        os.environ.get("LOCAL_RANK", "?"),
        role.value,
        topo.index(rank),
        topo.num_targets,
        topo.num_drafters,
    )
    work, wire, steps, start = _build(args, role, device, drafters, topo)
    wires: list[Any] = [None] * topo.world_size
    dist.all_gather_object(wires, (str(me), dataclasses.astuple(wire)), group=gloo)
    if len({w[1] for w in wires}) != 1:
        raise RuntimeError("ranks disagree on the wire format: " + "; ".join(f"{n}: {w}" for n, w in wires))
    if args.resume and not (args.synthetic or args.bench):
        from dflash_trainer.distributed.work_dflash import agree_on_start

        start = agree_on_start(work, topo, gloo, rank)
    dist.barrier(group=gloo)  # everyone loaded: the running timeout applies from here
    stopper = None
    if control is not None:
        control.on_ready()
        stopper = StopSignal(monitor.job_store(), control.stop)
        if control.on_step is not None and rank == topo.drafter_ranks[0]:
            work = _Observed(work, control.on_step, topo.num_drafters)
    meter = RankMeter(rank, role.value, str(device), me.host, warmup_items=args.warmup_items)
    span = RunSpan(start, steps, args.depth, args.log_every)
    fault = fault_from_env()

    def say(text: str) -> None:
        log.info("%s", text)

    extra: dict[str, Any] = {}
    if role is Role.TARGET:
        run_target(rank, topo, work, wire, pipe, span, meter, device, fault, say, stopper)
    else:
        extra = run_drafter(rank, topo, work, wire, pipe, span, meter, device, fault, say, stopper)
    summary = meter.summary(**extra)
    gathered: list[Any] | None = [None] * topo.world_size if rank == 0 else None
    dist.gather_object(summary, gathered, dst=0, group=gloo)
    if rank == 0:
        _report(list(gathered), args)
    monitor.done()  # before the last barrier: rank 0 may host the store and exit first
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


@record
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is None and not (args.synthetic or args.bench):
        raise SystemExit("give a training config, --synthetic or --bench")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
