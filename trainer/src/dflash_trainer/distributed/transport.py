"""Target -> drafter transfer of captured batches over torch.distributed point-to-point, with back-pressure.

Every message has the same shapes (rows padded to optim.batch, tokens to data.seq_len) so a drafter can post
its receives before the data exists; a small header says which item it is and how much of it is real. Two
tensors per item: `meta` (int64: header, token ids, loss mask) and `context` (features, in the wire dtype).
Both sides hold at most `depth` items in flight per rank: a target waits for its oldest send to land before
issuing another, a drafter posts receives for its next `depth` steps only. Padding costs bytes, not compute:
for the reference (3072 x 5 x 5120 bf16 = 157 MB per sequence) it is milliseconds of a link against a
target forward of a few hundred.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_trainer.data.batch import TargetBatch
from dflash_trainer.distributed.metrics import RankMeter

HEADER = 4  # item, rows, length, magic
MAGIC = 0x0DF1A5


class TransportError(RuntimeError):
    pass


@dataclass(frozen=True)
class WireFormat:
    rows: int  # optim.batch
    seq_len: int  # data.seq_len
    features: int  # K * hidden
    dtype: torch.dtype

    def empty(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        meta = torch.empty(HEADER + 2 * self.rows * self.seq_len, dtype=torch.long, device=device)
        context = torch.empty(self.rows, self.seq_len, self.features, dtype=self.dtype, device=device)
        return meta, context

    def pack(self, item: int, batch: TargetBatch) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = batch.input_ids.shape
        if rows > self.rows or length > self.seq_len or batch.context.shape[-1] != self.features:
            raise TransportError(
                f"item {item}: batch {tuple(batch.context.shape)} does not fit the wire format "
                f"[{self.rows}, {self.seq_len}, {self.features}]"
            )
        device = batch.input_ids.device
        meta = torch.zeros(HEADER + 2 * self.rows * self.seq_len, dtype=torch.long, device=device)
        meta[:HEADER] = torch.tensor([item, rows, length, MAGIC], dtype=torch.long)
        body = meta[HEADER:].view(2, self.rows, self.seq_len)
        body[0, :rows, :length] = batch.input_ids
        body[1, :rows, :length] = batch.loss_mask.long()
        if (rows, length) == (self.rows, self.seq_len) and batch.context.dtype == self.dtype:
            context = batch.context.contiguous()
        else:
            context = torch.zeros(self.rows, self.seq_len, self.features, dtype=self.dtype, device=device)
            context[:rows, :length] = batch.context
        return meta, context

    def unpack(self, meta: torch.Tensor, context: torch.Tensor, expected_item: int) -> TargetBatch:
        item, rows, length, magic = meta[:HEADER].tolist()
        if magic != MAGIC or item != expected_item:
            raise TransportError(f"expected item {expected_item}, received item {item} (magic {magic:#x})")
        body = meta[HEADER:].view(2, self.rows, self.seq_len)
        return TargetBatch(
            input_ids=body[0, :rows, :length],
            loss_mask=body[1, :rows, :length].bool(),
            context=context[:rows, :length],
        )


class Sender:
    """A target rank's outgoing items; at most `depth` isends outstanding."""

    def __init__(
        self,
        wire: WireFormat,
        group: dist.ProcessGroup,
        depth: int,
        meter: RankMeter,
        device: torch.device | None = None,
    ) -> None:
        self.wire, self.group, self.depth, self.meter = wire, group, depth, meter
        self._device = device if device is not None else torch.device("cpu")
        self._zeros: torch.Tensor | None = None
        self._inflight: deque[tuple[int, list[dist.Work], tuple[torch.Tensor, ...]]] = deque()

    def _wait_oldest(self) -> None:
        _item, works, _keep = self._inflight.popleft()  # _keep holds the tensors alive until sent
        with self.meter.span("wait_send"):
            for work in works:
                work.wait()

    def make_room(self) -> None:
        """Back-pressure: waits until fewer than `depth` sends are outstanding."""
        while len(self._inflight) >= self.depth:
            self._wait_oldest()

    def send(self, item: int, batch: TargetBatch, dst: int) -> None:
        self.make_room()
        meta, context = self.wire.pack(item, batch)
        works = [dist.isend(meta, dst, group=self.group), dist.isend(context, dst, group=self.group)]
        self._inflight.append((item, works, (meta, context)))
        self.meter.inflight(len(self._inflight))

    def send_empty(self, item: int, dst: int) -> None:
        """A header-only stand-in for an item past a stop: it meets a receive the drafter has posted."""
        if self._zeros is None:  # one zero context for every stand-in (sends only read it)
            self._zeros = torch.zeros_like(self.wire.empty(self._device)[1])
        self.make_room()
        meta = torch.zeros_like(self.wire.empty(self._device)[0])
        meta[:HEADER] = torch.tensor([item, 0, 0, MAGIC], dtype=torch.long)
        works = [dist.isend(meta, dst, group=self.group), dist.isend(self._zeros, dst, group=self.group)]
        self._inflight.append((item, works, (meta,)))

    def flush(self) -> None:
        while self._inflight:
            self._wait_oldest()


class Receiver:
    """A drafter rank's incoming items, one per step; receives posted `depth` steps ahead."""

    def __init__(
        self,
        wire: WireFormat,
        group: dist.ProcessGroup,
        depth: int,
        device: torch.device,
        meter: RankMeter,
        plan: Callable[[int], tuple[int, int]],  # step -> (item, source rank)
        stop_step: int,
    ) -> None:
        self.wire, self.group, self.depth, self.device, self.meter = wire, group, depth, device, meter
        self.plan, self.stop_step = plan, stop_step
        self._posted: deque[tuple[int, int, list[dist.Work], torch.Tensor, torch.Tensor]] = deque()
        self._next_post: int | None = None

    def _post(self, step: int) -> None:
        item, src = self.plan(step)
        meta, context = self.wire.empty(self.device)
        works = [dist.irecv(meta, src, group=self.group), dist.irecv(context, src, group=self.group)]
        self._posted.append((step, item, works, meta, context))

    def get(self, step: int) -> tuple[int, TargetBatch]:
        if self._next_post is None:
            self._next_post = step
        # Post the window first so the next transfers run while this step computes.
        while self._next_post < min(step + self.depth, self.stop_step):
            self._post(self._next_post)
            self._next_post += 1
        posted_step, item, works, meta, context = self._posted.popleft()
        if posted_step != step:
            raise TransportError(f"receiver asked for step {step}, next posted is {posted_step}")
        self.meter.inflight(sum(all(w.is_completed() for w in p[2]) for p in self._posted) + 1)
        with self.meter.span("wait_recv"):
            for work in works:
                work.wait()
        return item, self.wire.unpack(meta, context, item)

    def drain(self, end_item: int) -> int:
        """After a stop: completes every posted receive, and posts and completes this rank's receives of the
        items below `end_item` (see stopping.py), discarding them all. Returns how many it discarded."""
        discarded = 0
        step = 0 if self._next_post is None else self._next_post
        while True:
            if len(self._posted) < self.depth and self.plan(step)[0] < end_item:
                self._post(step)
                step += 1
                continue
            if not self._posted:
                break
            _step, item, works, meta, context = self._posted.popleft()
            for work in works:
                work.wait()
            self.wire.unpack(meta, context, item)  # checks the header: the schedule held to the end
            discarded += 1
        self._next_post = step
        return discarded
