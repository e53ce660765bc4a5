"""Several nodes: the checkpoint directory must be one directory that every node sees.

The drafter leader writes every checkpoint; after a restart the leader may sit on another node (the rendezvous
numbers nodes afresh), and every drafter loads the file the leader names. A per-node directory would silently
start a fresh run on one node while another holds the checkpoints. So at every multi-node start the leader
writes a marker file there and every rank of every node must see it; otherwise one error line names the key,
the path and the ranks (with their nodes) that cannot.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist


class NotSharedError(RuntimeError):
    one_line = True  # failure.py logs the message alone: it says everything


def check_shared(path: Path, key: str, rank: int, leader: int, group: Any, me: str) -> None:
    """Collective over `group` (every rank). Raises NotSharedError on every rank when any rank misses it."""
    box: list[Any] = [None]
    marker: Path | None = None
    if rank == leader:
        path.mkdir(parents=True, exist_ok=True)
        marker = path / f".shared-check-{uuid.uuid4().hex}"
        with marker.open("w") as f:
            f.write(me + "\n")
            f.flush()
            os.fsync(f.fileno())
        box[0] = (marker.name, me)
    dist.broadcast_object_list(box, src=leader, group=group)
    name, writer = box[0]
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (me, (path / name).is_file()), group=group)
    if marker is not None:
        marker.unlink(missing_ok=True)
    missing = [who for who, ok in seen if not ok]
    if missing:
        raise NotSharedError(
            f"{key} {path} is not one directory for the whole job: {'; '.join(missing)} cannot see the file "
            f"{writer} wrote there. Every node must mount the same shared storage at this path (an NFS or "
            "CephFS mount bound into each CT: training_job_checkpoint_dir, docs/pipeline.md)"
        )
