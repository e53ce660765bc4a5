"""The two loops of the pipeline; what a target makes and what a drafter does with it are the sides' of
train/target_side.py and train/drafter_side.py (TargetSide, DrafterSide), or the synthetic workload's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dflash_trainer.distributed.failure import Fault, maybe_inject
from dflash_trainer.distributed.metrics import RankMeter
from dflash_trainer.distributed.schedule import dest, drafter_item, source, step_of, target_items
from dflash_trainer.distributed.stopping import StopSignal, drain_end
from dflash_trainer.distributed.topology import Topology
from dflash_trainer.distributed.transport import Receiver, Sender, TargetBatch, WireFormat

log = logging.getLogger("dflash_trainer.distributed")


class Producer(Protocol):
    """A target rank's work: rows of an item, then the frozen target's features of them."""

    def load(self, item: int) -> Any: ...
    def forward(self, batch: Any) -> TargetBatch: ...


class Consumer(Protocol):
    """A drafter rank's work: one optimizer step (DDP over the drafter ranks) on one item."""

    def step(self, step: int, item: int, batch: TargetBatch) -> str: ...  # returns a short log fragment
    def finish(self, step: int) -> dict[str, Any]: ...  # end of run (save); returns summary extras


@dataclass(frozen=True)
class RunSpan:
    start_step: int  # drafter steps [start_step, stop_step); items [start_step*M, stop_step*M)
    stop_step: int
    depth: int  # items in flight per rank
    log_every: int


def _sync(device: torch.device) -> None:
    # Host timing of GPU work needs the work done; the send waits for it anyway.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_target(
    rank: int,
    topo: Topology,
    producer: Producer,
    wire: WireFormat,
    group: dist.ProcessGroup,
    span: RunSpan,
    meter: RankMeter,
    device: torch.device,
    fault: Fault | None,
    say: Callable[[str], None],
    stopper: StopSignal | None = None,
    between: Callable[[int | None], None] | None = None,
) -> None:
    """`between(item)` runs before each item is made and `between(None)` at the end (target rank 0's
    evaluations, train/target_side.py EvalExchange)."""
    t, m = topo.index(rank), topo.num_drafters
    sender = Sender(wire, group, span.depth, meter, device)
    items = target_items(t, topo.num_targets, span.start_step * m, span.stop_step * m)
    stop: tuple[int, int] | None = None  # (stop step, drain end) once the drafter leader has decided

    def poll() -> tuple[int, int] | None:
        if stopper is None or stop is not None or (at := stopper.poll()) is None:
            return stop
        end = drain_end(at, span.stop_step, span.depth, topo.num_targets, m)
        say(f"stopping: the drafters stop at step {at}; empty items up to item {end}")
        return at, end

    for count, item in enumerate(items):
        if between is not None:
            between(item)
        stop = poll()
        captured = None
        if stop is None or step_of(item, m) < stop[0]:
            maybe_inject(fault, rank, count)
            with meter.span("data"):
                batch = producer.load(item)
            with meter.span("busy"):
                captured = producer.forward(batch)
                _sync(device)
        sender.make_room()
        # Asked again after the back-pressure wait: that wait may have ended in the drafters' drain, after
        # which only items below the drain's end may go (stopping.py).
        stop = poll()
        dst = topo.drafter_rank(dest(item, m))
        if stop is not None and item >= stop[1]:
            break
        if stop is not None and step_of(item, m) >= stop[0]:
            sender.send_empty(item, dst)
            continue
        assert captured is not None
        sender.send(item, captured, dst)
        meter.count(captured.input_ids.numel())
        if (count + 1) % span.log_every == 0:
            say(f"item {item}: {meter.window()}")
    if between is not None:
        between(None)
    sender.flush()


def run_drafter(
    rank: int,
    topo: Topology,
    consumer: Consumer,
    wire: WireFormat,
    group: dist.ProcessGroup,
    span: RunSpan,
    meter: RankMeter,
    device: torch.device,
    fault: Fault | None,
    say: Callable[[str], None],
    stopper: StopSignal | None = None,
) -> dict[str, Any]:
    d, n, m = topo.index(rank), topo.num_targets, topo.num_drafters
    stop: int | None = None

    def plan(step: int) -> tuple[int, int]:
        item = drafter_item(d, m, step)
        return item, topo.target_rank(source(item, n))

    receiver = Receiver(wire, group, span.depth, device, meter, plan, span.stop_step)
    step = span.start_step
    while step < span.stop_step:
        if stopper is not None:
            stop = stopper.decide(step, alone=m == 1) if d == 0 else stopper.poll()
            if stop is not None and step >= stop:
                break
        maybe_inject(fault, rank, step - span.start_step)
        item, batch = receiver.get(step)
        with meter.span("busy"):
            note = consumer.step(step, item, batch)
        meter.count(batch.input_ids.numel())
        if (step + 1) % span.log_every == 0:
            say(f"step {step + 1}: {note} | {meter.window()}")
        step += 1
    if stop is not None:
        end = drain_end(stop, span.stop_step, span.depth, n, m)
        discarded = receiver.drain(end)
        say(f"drained after the stop before pipeline step {step}: {discarded} item(s), up to item {end}")
    return consumer.finish(step) | {"stopped": stop is not None and step < span.stop_step}
