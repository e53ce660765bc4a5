"""The training shards' Arrow format and its writer: one file of (input_ids, loss_mask) rows, written
atomically. The target-regenerated synthetic shards are fixtures.synth (they load a target)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])


def write_shard(path: Path, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Path:
    """Writes (input_ids, loss_mask) rows as one Arrow IPC file, atomically."""
    path = Path(path)
    table = pa.table(
        {
            "input_ids": pa.array(
                [np.asarray(ids, dtype=np.int32) for ids, _ in rows], type=SCHEMA.field(0).type
            ),
            "loss_mask": pa.array([np.asarray(m, dtype=np.int8) for _, m in rows], type=SCHEMA.field(1).type),
        },
        schema=SCHEMA,
    )
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_table(table)
    tmp.replace(path)
    return path
