"""Streaming, seed-deterministic, resumable reading of Arrow IPC shards.

A shard is an Arrow IPC file (also what feather v2 writes) with columns input_ids (list<int32>) and
loss_mask (list<int8 or bool>), one row per sequence. Shards are taken in sorted name order; the first
`held_out` rows of that order are kept for evaluation. Training rows are read shard by shard, the shard
order shuffled per epoch and the rows of each shard shuffled inside windows, both from (seed, epoch), so
the position (epoch, shard, row) alone says where a run is, and resume continues exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

SHARD_SUFFIXES = (".arrow", ".feather", ".ipc")


class DataError(ValueError):
    """A shard that cannot be read as training data; the message names the file."""


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]


def list_shards(directory: Path) -> list[Path]:
    paths = sorted(p for p in Path(directory).iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
    if not paths:
        raise DataError(f"{directory}: no shards ({', '.join(SHARD_SUFFIXES)} files)")
    return paths


class Shard:
    """One shard, memory-mapped; rows are numpy views of its flat columns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not an Arrow IPC file ({e})") from None
        self._ids_offsets, self._ids = self._flat(table, "input_ids")
        mask_offsets, mask = self._flat(table, "loss_mask")
        if not np.array_equal(self._ids_offsets - self._ids_offsets[0], mask_offsets - mask_offsets[0]):
            raise DataError(f"{path}: input_ids and loss_mask differ in length on some row")
        self._mask_offsets, self._mask = mask_offsets, mask.astype(bool, copy=False)
        self.num_rows = table.num_rows

    def _flat(self, table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in table.column_names:
            raise DataError(f"{self.path}: no column {name!r} (has {table.column_names})")
        column = table.column(name).combine_chunks()
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise DataError(f"{self.path}: column {name!r} must be a list, is {column.type}")
        if column.null_count:
            raise DataError(f"{self.path}: column {name!r} has null rows")
        return column.offsets.to_numpy(), column.values.to_numpy(zero_copy_only=False)

    def row(self, i: int) -> Sample:
        a, b = self._ids_offsets[i], self._ids_offsets[i + 1]
        c = self._mask_offsets[i]
        return Sample(self._ids[a:b].astype(np.int64), self._mask[c : c + (b - a)])


def count_rows(path: Path) -> int:
    """Rows of a shard from its footer and batch headers, without reading the columns."""
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of one shard."""

    path: Path
    start: int
    stop: int


def split_held_out(paths: Sequence[Path], held_out: int) -> tuple[list[Segment], list[Segment]]:
    """(training segments, held-out segments): the first `held_out` rows in shard order are held out."""
    train, held = [], []
    left = held_out
    for path in paths:
        n = count_rows(path)
        take = min(left, n)
        left -= take
        if take:
            held.append(Segment(path, 0, take))
        if take < n:
            train.append(Segment(path, take, n))
    if left:
        raise DataError(f"data.held_out={held_out} is more rows than all shards hold ({held_out - left})")
    if not train:
        raise DataError("no training rows left after data.held_out")
    return train, held


class ShardReader:
    """Endless iterator over training rows, epoch after epoch; `state_dict` is where the next row is."""

    def __init__(self, segments: Sequence[Segment], *, seed: int, shuffle_window: int) -> None:
        self.segments = list(segments)
        self.seed = seed
        self.shuffle_window = shuffle_window
        self.num_rows = sum(s.stop - s.start for s in self.segments)
        self.epoch, self.shard, self.row = 0, 0, 0  # row: index into the shard's shuffled order

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "shard": self.shard,
            "row": self.row,
            "seed": self.seed,
            "num_shards": len(self.segments),
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """A position is only meaningful over the same rows in the same order: anything else is refused."""
        if state["seed"] != self.seed:
            raise DataError(
                f"resuming with data.seed={self.seed}, the checkpoint was made with {state['seed']}"
            )
        if (state["num_shards"], state["num_rows"]) != (len(self.segments), self.num_rows):
            raise DataError(
                f"the training data changed since the checkpoint: {state['num_shards']} shards and "
                f"{state['num_rows']} rows then, {len(self.segments)} and {self.num_rows} now"
            )
        self.epoch, self.shard, self.row = state["epoch"], state["shard"], state["row"]

    def state_at(self, rows: int) -> dict[str, int]:
        """The state after `rows` rows from the start of epoch 0, computed, not read: the pipeline's data
        position is an item number (item i is rows [i*B, (i+1)*B)), and this turns it into a position."""
        if rows < 0:
            raise ValueError(f"row position {rows} < 0")
        epoch, left = divmod(rows, self.num_rows)
        shard = 0
        for shard, index in enumerate(self._shard_order(epoch)):  # noqa: B007  # `shard` is the answer
            seg = self.segments[int(index)]
            if left < seg.stop - seg.start:
                break
            left -= seg.stop - seg.start
        return self.state_dict() | {"epoch": epoch, "shard": shard, "row": left}

    def _shard_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.segments))

    def _row_order(self, epoch: int, shard: int) -> np.ndarray:
        seg = self.segments[shard]
        rng = np.random.default_rng([self.seed, epoch, shard])
        order = np.arange(seg.start, seg.stop)
        # Windows keep reads near-sequential on a large shard while still mixing neighbouring rows.
        for w in range(0, len(order), self.shuffle_window):
            rng.shuffle(order[w : w + self.shuffle_window])
        return order

    def __iter__(self) -> Iterator[Sample]:
        while True:
            order = self._shard_order(self.epoch)
            while self.shard < len(order):
                index = int(order[self.shard])
                shard = Shard(self.segments[index].path)
                rows = self._row_order(self.epoch, index)
                while self.row < len(rows):
                    sample = shard.row(int(rows[self.row]))
                    self.row += 1
                    yield sample
                self.shard, self.row = self.shard + 1, 0
            self.epoch, self.shard = self.epoch + 1, 0


def read_segments(segments: Sequence[Segment]) -> list[Sample]:
    """All rows of some segments in order (the held-out set is small)."""
    out = []
    for seg in segments:
        shard = Shard(seg.path)
        out.extend(shard.row(i) for i in range(seg.start, seg.stop))
    return out
