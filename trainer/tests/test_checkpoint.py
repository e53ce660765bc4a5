"""Checkpoints: atomic directories, keep-last-K, RNG states restored exactly, safe loading."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash_trainer.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_name,
    step_of_name,
)


def draws(generator: torch.Generator) -> tuple:
    return (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(1)),
        float(torch.rand(1, generator=generator)),
    )


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    generator = torch.Generator().manual_seed(7)
    path = save_checkpoint(tmp_path, 1, {"rng": rng_state(generator)}, {}, keep_last=1)
    expected = draws(generator)
    state, _ = load_checkpoint(path)  # weights_only=True: nothing but tensors and plain containers
    set_rng_state(state["rng"], generator)
    assert draws(generator) == expected


def test_keeps_the_last_k_and_ignores_half_written_ones(tmp_path):
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, step, {"step": step}, {"x": torch.ones(2) * step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000015", "step-00000020"]
    (tmp_path / ".tmp-step-00000025-999").mkdir()  # a save that died before its rename
    assert latest_checkpoint(tmp_path).name == "step-00000020"
    state, ema = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == {"step": 20} and torch.equal(ema["x"], torch.full((2,), 20.0))
    save_checkpoint(tmp_path, 25, {"step": 25}, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000025"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, {"v": 1}, {}, keep_last=3)
    save_checkpoint(tmp_path, 3, {"v": 2}, {}, keep_last=3)
    assert load_checkpoint(latest_checkpoint(tmp_path), ema=False) == ({"v": 2}, None)
    assert latest_checkpoint(tmp_path / "none") is None


def test_a_checkpoint_name_gives_back_its_step_and_anything_else_is_refused():
    assert step_of_name(step_name(12)) == 12
    for name in (".tmp-step-00000012-4242", "step-12", "ema.pt"):
        with pytest.raises(ValueError, match="not a checkpoint name"):
            step_of_name(name)


class NfsClient:
    """What an NFS client does to `shutil.rmtree` of a directory holding a file it still has open (an export
    or an evaluation reading an old checkpoint on the same CT), from Linux's fs/nfs: unlink of an open
    file is a silly rename (unlink.c nfs_sillyrename: the file becomes `.nfs<fileid:016x><counter:08x>`
    in its directory, removed by the client at its last close); unlink of a silly-renamed file fails with
    EBUSY (the same function, DCACHE_NFSFS_RENAMED); rmdir of a directory still holding it fails with
    ENOTEMPTY (the server's NFS3ERR_NOTEMPTY). A local file system unlinks an open file at once, so only
    NFS shows this."""

    def __init__(self) -> None:
        self.open: dict[int, Path | None] = {}  # inode of a file held open -> its silly name, once renamed
        self.counter = 0

    def hold(self, path: Path) -> int:
        inode = path.stat().st_ino
        self.open[inode] = None
        return inode

    def close(self, inode: int) -> None:
        silly = self.open.pop(inode)
        if silly is not None:
            silly.unlink()  # the last close removes the silly-renamed file

    def remove_tree(self, path: Any, ignore_errors: bool = False, **_: Any) -> None:
        try:
            for entry in sorted(Path(path).iterdir()):
                inode = entry.stat().st_ino
                if inode not in self.open:
                    entry.unlink()
                elif self.open[inode] is not None:
                    raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(entry))
                else:
                    self.counter += 1
                    self.open[inode] = entry.with_name(f".nfs{inode:016x}{self.counter:08x}")
                    entry.rename(self.open[inode])
            if any(Path(path).iterdir()):
                raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), str(path))
            Path(path).rmdir()
        except OSError:
            if not ignore_errors:
                raise


def test_a_checkpoint_held_open_on_nfs_is_pruned_later_and_the_save_stands(tmp_path, monkeypatch, caplog):
    client = NfsClient()
    monkeypatch.setattr(shutil, "rmtree", client.remove_tree)
    one = save_checkpoint(tmp_path, 1, {"step": 1}, {"x": torch.ones(2)}, keep_last=1)
    export = client.hold(one / "ema.pt")  # `dflash-train export` reading it while the run saves on
    with caplog.at_level(logging.WARNING, logger="dflash_trainer.checkpoint"):
        two = save_checkpoint(tmp_path, 2, {"step": 2}, {}, keep_last=1)
    assert latest_checkpoint(tmp_path) == two and load_checkpoint(two, ema=False) == ({"step": 2}, None)
    assert "step-00000001" in caplog.text and "Directory not empty" in caplog.text
    save_checkpoint(tmp_path, 3, {"step": 3}, {}, keep_last=1)  # step 1 still held (EBUSY), step 2 pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000003"]
    client.close(export)
    four = save_checkpoint(tmp_path, 4, {"step": 4}, {}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    reader = client.hold(four / "state.pt")
    save_checkpoint(tmp_path, 4, {"step": 4, "again": True}, {}, keep_last=1)  # a stop right after a save
    assert load_checkpoint(four, ema=False) == ({"step": 4, "again": True}, None)
    client.close(reader)  # its silly-renamed file sat in the replaced copy, moved aside
    save_checkpoint(tmp_path, 5, {"step": 5}, {}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]
