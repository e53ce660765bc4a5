"""Every rank of the pipeline: `torchrun ... -m dflash_trainer.distributed.rank CONFIG [options]`, or
`run_rank(cfg, options, control, topo=...)` from `dflash-train serve` (service/serve.py), with the
configuration object that rank already loaded and validated and its [topology] resolved for the world: both
once per rank, never rebuilt from argv.

Sets up the process groups, takes the rank's role, builds its side of the run (TargetSide of
train/target_side.py on target ranks, DrafterSide of train/drafter_side.py on drafter ranks), agrees on where
to resume, runs its loop (roles.py), and at the end gathers every rank's metrics to rank 0, which prints the
summary table and draws the timeline. Any failure is logged as `rank R (role, device on host): cause` and ends
the job (see failure.py)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from dflash_trainer.distributed.metrics import RankMeter, RankSummary, summary_table, write_metrics
from dflash_trainer.distributed.roles import RunSpan, run_drafter, run_target
from dflash_trainer.distributed.stopping import REQUESTED, StopSignal
from dflash_trainer.distributed.topology import (
    Count,
    Role,
    Topology,
    node_layout,
    resolve_topology,
)

if TYPE_CHECKING:
    from dflash_trainer.config import TrainConfig

log = logging.getLogger("dflash_trainer.distributed")


def _count(text: str) -> Count:
    return "auto" if text == "auto" else int(text)


@dataclass
class RankOptions:
    """How a rank runs, beside the training configuration (the service sets these from the config)."""

    synthetic: bool = False  # the model-free stand-in workload (CI)
    bench: str | None = None  # random models of a bench size
    steps: int | None = None  # the horizon in drafter steps (bench, synthetic; default: the config's)
    max_steps: int | None = None  # stop (and save) at this optimizer step; the schedule keeps its horizon
    resume: bool = False
    depth: int = 2
    log_every: int = 10
    warmup_items: int = 0
    timeline: Path | None = None
    metrics_out: Path | None = None
    timeout_s: float = 300.0
    startup_timeout_s: float = 1800.0
    heartbeat_s: float = 1.0
    dead_after_s: float = 15.0
    cpu: bool = False
    # synthetic workload knobs
    seq_len: int = 32
    rows: int = 2
    features: int = 16
    target_s: float = 0.0
    drafter_s: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash_trainer.distributed.rank", description=__doc__)
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


def options_from_args(args: argparse.Namespace) -> RankOptions:
    names = {f.name for f in dataclasses.fields(RankOptions)}
    return RankOptions(**{k: v for k, v in vars(args).items() if k in names})


@dataclass
class Control:
    """What `dflash-train serve` adds to a rank (service/serve.py); plain torchrun launches pass none."""

    stop: threading.Event  # set on SIGTERM: the ranks agree on a stop step (stopping.py), save, return 0
    on_ready: Callable[[], None]  # every rank, once all ranks have loaded (and resumed)
    on_step: Callable[[Any], None] | None  # the drafter leader, after each step, with its StepMetrics
    # Several nodes: a node's speaker other than the leader hears each step the leader finished (its unit's
    # WATCHDOG=1 then stops with the leader's, wherever the job hangs).
    on_progress: Callable[[int], None] | None = None
    # Several nodes, the drafter leader: given the relay's beat (the other nodes' units hear the leader is
    # alive) and the job's stop-asked check, for a hook that waits inside a step (the smoke run's pause).
    on_relay: Callable[[Callable[[], None], Callable[[], bool]], None] | None = None
    # Target rank 0: what a long evaluation is doing, said as it goes (the service's systemd heartbeat).
    progress: Callable[[str], None] | None = None


def nodes() -> int:
    """Nodes of the job (torch elastic's GROUP_WORLD_SIZE; 1 under the one-host launcher)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


PROGRESS = "progress/step"  # the leader's last finished step
BEATS = "progress/beats"  # +1 with each step, and while the leader waits alive (the smoke run's pause)


class Progress:
    """The drafter leader's side of the relay: what the other nodes' units hear from it."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def step(self, step: int) -> None:
        self.store.set(PROGRESS, str(step))
        self.store.add(BEATS, 1)

    def beat(self) -> None:
        self.store.add(BEATS, 1)


def _tell_stop_on_signal(store: Any) -> None:
    """Several nodes: a SIGTERM reaches the job's store even while this rank's main thread waits inside a
    transfer (a target held by back-pressure behind a paused leader on another node): Python runs the signal
    handler only when that wait returns, but the signal's byte arrives on the wakeup fd at once, and a thread
    adds the stop request the leader reads (stopping.py)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    wanted = {int(signal.SIGTERM), int(signal.SIGINT)}

    def run() -> None:
        while data := os.read(r, 64):
            if wanted & set(data):
                with contextlib.suppress(Exception):  # the store gone: the peer monitor ends this rank
                    store.add(REQUESTED, 1)
                return

    threading.Thread(target=run, name="stop-teller", daemon=True).start()


def _relay(store: Any, on_progress: Callable[[int], None], stop: threading.Event, every: float) -> None:
    """A node speaker's thread: passes the leader's beats on (its step with each), as they move."""
    last = 0
    while not stop.wait(every):
        try:
            beats = store.add(BEATS, 0)
            if beats != last and store.check([PROGRESS]):
                last = beats
                on_progress(int(store.get(PROGRESS)))
        except Exception:  # the store is gone: the peer monitor ends this rank
            return


class _Observed:
    """The drafter leader's side, reporting each step's metrics (tokens/s of the whole pipeline)."""

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


@dataclass
class Built:
    work: Any  # the rank's side: a Producer (target) or a Consumer (drafter)
    wire: Any  # transport.WireFormat
    start: int  # first pipeline step
    stop: int  # end pipeline step (exclusive)
    between: Callable[[int | None], None] | None = None  # target rank 0: evaluations before an item


def _build_synthetic(opts: RankOptions, role: Role, device: torch.device, drafters: Any) -> Built:
    from dflash_trainer.distributed.work_synthetic import SyntheticConsumer, SyntheticProducer, SyntheticSpec

    spec = SyntheticSpec(
        opts.rows, opts.seq_len, opts.features, target_s=opts.target_s, drafter_s=opts.drafter_s
    )
    work = (
        SyntheticProducer(spec, device) if role is Role.TARGET else SyntheticConsumer(spec, device, drafters)
    )
    return Built(work, spec.wire, 0, opts.steps or 20)


def _build_dflash(
    cfg: TrainConfig | None,
    opts: RankOptions,
    rank: int,
    topo: Topology,
    device: torch.device,
    groups: dict[str, Any],
    stopper_box: list[Any],
    progress: Callable[[str], None] | None = None,
) -> Built:
    """This rank's side of the run, resumed where the drafter leader's newest checkpoint says."""
    from dflash_trainer.distributed.transport import WireFormat
    from dflash_trainer.fixtures.bench import setup_from_bench
    from dflash_trainer.train.drafter_side import DrafterSide
    from dflash_trainer.train.schedule import Horizon, Position, horizon
    from dflash_trainer.train.setup import head_only, setup_from_config
    from dflash_trainer.train.target_side import EvalExchange, TargetSide, eval_replica

    if opts.bench:
        setup = setup_from_bench(opts.bench, device, opts.steps or 20)
        cfg = setup.cfg  # the bench size's own configuration
    else:
        assert cfg is not None
        setup = setup_from_config(cfg, device)
    hz = Horizon(opts.steps, "steps") if opts.steps else horizon(cfg, setup.num_rows)
    role, index, m = topo.role(rank), topo.index(rank), topo.num_drafters
    leader = topo.drafter_ranks[0]
    if role is Role.TARGET:
        work: Any = TargetSide(setup, evaluates=index == 0 and not opts.bench)
        if work.evaluates and progress is not None:  # minutes of decode walk: said as it goes
            work.progress = progress
    else:
        work = DrafterSide(
            cfg, head_only(setup), hz, device=device, index=index, num_drafters=m,
            group=groups["drafters"], save=not opts.bench, data_state=setup.data_state,
        )  # fmt: skip
    wire = WireFormat(cfg.optim.batch, cfg.data.seq_len, setup.wire_features, setup.dtype)

    if nodes() > 1 and not opts.bench:  # the leader's checkpoints must reach a leader on any node
        from dflash_trainer.distributed.shared_dir import check_shared

        key = "train.checkpoint_dir"
        check_shared(cfg.train.checkpoint_dir, key, rank, leader, groups["gloo"], groups["me"])

    # Resume: the drafter leader finds the newest checkpoint and tells every rank where the run is.
    box: list[Any] = [None]
    if opts.resume and not opts.bench and rank == leader:
        found = work.resume_newest()
        if found is not None:
            box[0] = (str(found[0]), found[1])
    dist.broadcast_object_list(box, src=leader, group=groups["gloo"])
    position = Position()
    if box[0] is not None:
        path, position = box[0]
        if role is Role.DRAFTER and rank != leader:
            work.resume(Path(path))
    first, end, offset = position.span(hz, m, opts.max_steps)
    if role is Role.TARGET:
        work.start_at(first * m, position.data)
        if position.step:
            log.info("resuming at item %d (%s)", first * m, box[0][0])
    else:
        work.offset = offset
    built = Built(work, wire, first, end)

    if "eval" in groups:  # _run_role made the evaluation's group: this run evaluates
        exchange = EvalExchange(groups["store"](), groups["eval"], leader, offset, cfg.train.eval_every, m)
        if rank == leader:
            work.exchange = exchange
        elif rank == topo.target_ranks[0]:
            replica = eval_replica(work)
            due = [p for p in range(first, end) if exchange.due(p)]

            def stop_step() -> int | None:
                return stopper_box[0].poll() if stopper_box and stopper_box[0] is not None else None

            def between(item: int | None) -> None:
                """Before making `item` (None: at the end), the evaluations of every earlier step."""
                bound = end if item is None else min(end, item // m)
                while due and due[0] < bound:
                    p = due.pop(0)
                    exchange.receive_and_evaluate(p, work, replica, stop_step)

            built.between = between
    return built


def _report(summaries: list[RankSummary], opts: RankOptions) -> None:
    print(summary_table(summaries), flush=True)
    if opts.metrics_out:
        write_metrics(summaries, opts.metrics_out)
    if opts.timeline:
        from dflash_trainer.distributed.timeline import plot_timeline

        log.info("timeline: %s", plot_timeline(summaries, opts.timeline))


def run_rank(
    cfg: TrainConfig | None, opts: RankOptions, control: Control | None, topo: Topology
) -> Path | None:
    """This rank of the job, under torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    Returns the checkpoint the drafter leader's final save left (None on every other rank, and when nothing
    was saved); a failure raises.

    control: the service's (None: a plain torchrun launch). topo: [topology] resolved for this world once, by
    whoever started the rank (the service, to find its leader; `main`, with the command line's overrides)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, backend = _device(opts.cpu)
    if topo.world_size != world:
        raise ValueError(f"the topology given has {topo.world_size} ranks, the launched world {world}")
    role = topo.role(rank)
    host = socket.gethostname()
    if nodes() > 1:
        host += f" node {os.environ.get('GROUP_RANK', '?')}"
    me = Identity(rank, role.value, str(device), host)
    if control is None:
        _setup_logging(me)
    else:  # the service's journal format; the line prefix (and the rank's summary) take the role now
        from dflash_trainer.logs import set_role

        set_role(role.value)
        os.environ["DFLASH_ROLE"] = role.value
    dist.init_process_group(backend, timeout=timedelta(seconds=opts.startup_timeout_s))
    monitor = PeerMonitor(me, world, interval=opts.heartbeat_s, dead_after=opts.dead_after_s).start()
    install_excepthooks(me, device, monitor)
    try:
        return _run_role(cfg, opts, rank, topo, role, me, device, backend, monitor, control)
    except BaseException as exc:
        handle_failure(me, exc, device, monitor)
        raise  # to torchrun's @record: the error file it reports as the root cause
    finally:
        monitor.done()


def _run_role(
    cfg,
    opts: RankOptions,
    rank,
    topo,
    role,
    me,
    device,
    backend,
    monitor: PeerMonitor,
    control: Control | None,
) -> Path | None:
    running = timedelta(seconds=opts.timeout_s)
    # Every rank creates every group, in the same order (torch.distributed requires it).
    groups: dict[str, Any] = {
        "gloo": dist.new_group(backend="gloo", timeout=timedelta(seconds=opts.startup_timeout_s)),
        "pipe": dist.new_group(timeout=running, backend=backend),
        "drafters": dist.new_group(topo.drafter_ranks, timeout=running, backend=backend),
        "store": monitor.job_store,
        "me": str(me),
    }
    evaluating = cfg is not None and cfg.train.eval_every and not (opts.synthetic or opts.bench)
    if evaluating:  # drafter weights from the leader to target rank 0 at evaluation steps
        # The first evaluation waits on target 0 loading: the startup timeout, not the running one.
        eval_ranks = [topo.target_ranks[0], topo.drafter_ranks[0]]
        groups["eval"] = dist.new_group(
            eval_ranks, timeout=timedelta(seconds=opts.startup_timeout_s), backend=backend
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size))
    if nodes() > 1 and rank == 0:
        log.info("placement over %d nodes: %s", nodes(), "; ".join(node_layout(topo, per_node)))
    log.info(
        "pid %d, local rank %s: %s %d of %d:%d; loading",
        os.getpid(),
        os.environ.get("LOCAL_RANK", "?"),
        role.value,
        topo.index(rank),
        topo.num_targets,
        topo.num_drafters,
    )
    stopper_box: list[Any] = [None]
    if opts.synthetic:
        built = _build_synthetic(opts, role, device, groups["drafters"])
    else:
        progress = control.progress if control is not None else None
        built = _build_dflash(cfg, opts, rank, topo, device, groups, stopper_box, progress)
    wires: list[Any] = [None] * topo.world_size
    dist.all_gather_object(wires, (str(me), dataclasses.astuple(built.wire)), group=groups["gloo"])
    if len({w[1] for w in wires}) != 1:
        raise RuntimeError("ranks disagree on the wire format: " + "; ".join(f"{n}: {w}" for n, w in wires))
    dist.barrier(group=groups["gloo"])  # everyone loaded: the running timeout applies from here
    work, stopper = built.work, None
    relay_stop = threading.Event()
    if control is not None:
        control.on_ready()
        stopper = stopper_box[0] = StopSignal(monitor.job_store(), control.stop)
        if nodes() > 1:
            _tell_stop_on_signal(monitor.job_store())
        if control.on_step is not None and rank == topo.drafter_ranks[0]:
            on_step = control.on_step
            if nodes() > 1:  # the other nodes' speakers relay the leader's progress to their units
                progress = Progress(monitor.job_store())
                if control.on_relay is not None:
                    control.on_relay(progress.beat, stopper.asked)

                def on_step(m: Any, inner: Callable[[Any], None] = control.on_step) -> None:
                    progress.step(m.step)  # first: the hook may pause here (the smoke run)
                    inner(m)

            work = _Observed(work, on_step, topo.num_drafters)
        elif control.on_progress is not None:
            threading.Thread(
                target=_relay,
                args=(monitor.job_store(), control.on_progress, relay_stop, opts.heartbeat_s),
                name="progress-relay",
                daemon=True,
            ).start()
    meter = RankMeter(rank, role.value, str(device), me.host, warmup_items=opts.warmup_items)
    span = RunSpan(built.start, built.stop, opts.depth, opts.log_every)
    fault = fault_from_env()

    def say(text: str) -> None:
        log.info("%s", text)

    extra: dict[str, Any] = {}
    if role is Role.TARGET:
        run_target(
            rank,
            topo,
            work,
            built.wire,
            groups["pipe"],
            span,
            meter,
            device,
            fault,
            say,
            stopper,
            built.between,
        )
    else:
        extra = run_drafter(
            rank, topo, work, built.wire, groups["pipe"], span, meter, device, fault, say, stopper
        )
    relay_stop.set()
    summary = meter.summary(**extra)
    gathered: list[Any] | None = [None] * topo.world_size if rank == 0 else None
    dist.gather_object(summary, gathered, dst=0, group=groups["gloo"])
    if rank == 0:
        _report(list(gathered), opts)
    monitor.done()  # before the last barrier: rank 0 may host the store and exit first
    dist.barrier(group=groups["gloo"])
    dist.destroy_process_group()
    checkpoint = extra.get("checkpoint")  # DrafterSide.finish's final save
    return Path(checkpoint) if checkpoint else None


def command_line_topology(args: argparse.Namespace, cfg: TrainConfig | None, world: int) -> Topology:
    """[topology] for this world: --targets and --drafters over the config's ("auto" without either)."""
    targets: Count = args.targets or (cfg.topology.targets if cfg is not None else "auto")
    drafters: Count = args.drafters or (cfg.topology.drafters if cfg is not None else "auto")
    return resolve_topology(world, targets, drafters)


@record
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is None and not (args.synthetic or args.bench):
        raise SystemExit("give a training config, --synthetic or --bench")
    cfg = None
    if args.config is not None and not (args.synthetic or args.bench):
        from dflash_trainer.config import load_config

        cfg = load_config(args.config)  # once; every part of this rank gets the object
    topo = command_line_topology(args, cfg, int(os.environ["WORLD_SIZE"]))
    run_rank(cfg, options_from_args(args), None, topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
