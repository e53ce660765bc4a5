"""The two loops of the pipeline; what a target makes and what a drafter does with it are the workload's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dflash_trainer.distributed.failure import Fault, maybe_inject
from dflash_trainer.distributed.metrics import RankMeter
from dflash_trainer.distributed.schedule import dest, drafter_item, source, target_items
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
) -> None:
    t, m = topo.index(rank), topo.num_drafters
    sender = Sender(wire, group, span.depth, meter)
    items = target_items(t, topo.num_targets, span.start_step * m, span.stop_step * m)
    for count, item in enumerate(items):
        maybe_inject(fault, rank, count)
        with meter.span("data"):
            batch = producer.load(item)
        with meter.span("busy"):
            captured = producer.forward(batch)
            _sync(device)
        sender.send(item, captured, topo.drafter_rank(dest(item, m)))
        meter.count(captured.input_ids.numel())
        if (count + 1) % span.log_every == 0:
            say(f"item {item}: {meter.window()}")
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
) -> dict[str, Any]:
    d, n, m = topo.index(rank), topo.num_targets, topo.num_drafters

    def plan(step: int) -> tuple[int, int]:
        item = drafter_item(d, m, step)
        return item, topo.target_rank(source(item, n))

    receiver = Receiver(wire, group, span.depth, device, meter, plan, span.stop_step)
    for step in range(span.start_step, span.stop_step):
        maybe_inject(fault, rank, step - span.start_step)
        item, batch = receiver.get(step)
        with meter.span("busy"):
            note = consumer.step(step, item, batch)
        meter.count(batch.input_ids.numel())
        if (step + 1) % span.log_every == 0:
            say(f"step {step + 1}: {note} | {meter.window()}")
    return consumer.finish(span.stop_step)
