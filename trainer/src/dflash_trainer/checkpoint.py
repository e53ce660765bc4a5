"""Training checkpoints: one directory per step, written atomically, the last K kept, saved in the background.

A checkpoint is `DIR/step-00001234/` holding `state.pt` (drafter weights, optimizer, step, schedule and data
position, RNG states, config) and `ema.pt` (the CPU EMA). It is written into a temporary sibling, fsynced and
renamed, so a crash mid-save leaves the previous checkpoints intact and no half-written one that looks
complete. Everything is saved as tensors and plain containers so loading uses torch.load(weights_only=True).

`AsyncCheckpointer` keeps training running while a checkpoint is written (a synchronous save of the reference
drafter, ~27 GB with AdamW and the EMA, stopped training for 46 s): the training thread only snapshots the
state, and a writer thread does the rest. Where the GPU has room for a second copy of the state (20 GB at the
reference: weights and AdamW moments in fp32), the snapshot is a device-to-device copy (milliseconds) and
the writer streams it to disk tensor by tensor on a side stream (torch.save copies one storage at a time to
the host), so no host memory is held for it; otherwise it goes into host buffers (pinned, non-blocking copies,
reused from save to save). The host path stalls a save for 7-15 s on one H200 (pinning 20 GB on the first
save; docs/gpu-rehearsal.md). At most one save is in flight: the next one first waits for the previous
write, and says how long it waited.
A write error (disk full) is raised in the training thread at its next step, as one line naming the
checkpoint, the directory and the real OSError (torch.save hides it behind "enforce fail ... unexpected pos").
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("dflash_trainer.checkpoint")

_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written; the message names it, its directory and the cause."""

    one_line = True  # logged without a traceback: the message is the whole story


def rng_state(anchor_generator: torch.Generator) -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "anchors": anchor_generator.get_state(),
    }


def set_rng_state(state: dict[str, Any], anchor_generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    anchor_generator.set_state(state["anchors"])


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of_name(name: str) -> int:
    """The step of a checkpoint's directory name (`step_name`'s inverse)."""
    if not (m := _STEP_DIR.match(name)):
        raise ValueError(f"{name!r} is not a checkpoint name (step-NNNNNNNN)")
    return int(m.group(1))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def root_cause(exc: BaseException) -> BaseException:
    """The OSError behind a torch.save failure, if there is one in the exception's chain; else `exc`.

    Writing to a file object, torch.save's C++ writer turns the file's OSError (ENOSPC, EIO) into
    "RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos N vs M", with the OSError as
    its __context__."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return exc


def _save(obj: Any, path: Path) -> None:
    # A file object, not a path: only then does the OSError reach Python (root_cause finds it).
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory: Path,
    step: int,
    state: dict[str, Any],
    ema: dict[str, Any],
    *,
    keep_last: int,
    ema_written: Callable[[], None] | None = None,
) -> Path:
    """Writes step `step` and returns its directory; removes all but the last `keep_last` checkpoints.

    Raises CheckpointError naming the checkpoint, the directory and the real cause; what it had written is
    removed, and the previous checkpoints stay as they were. `ema_written` is called once ema.pt is written
    (or failed), before state.pt."""
    directory = Path(directory)
    final = directory / step_name(step)
    tmp = directory / f".tmp-{step_name(step)}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:  # the EMA first: a frozen (live) EMA is let go as soon as its file is written
            _save(ema, tmp / "ema.pt")
        finally:
            if ema_written is not None:
                ema_written()
        _save(state, tmp / "state.pt")
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
            # Moved aside, not removed: on NFS a file of it may still be open (see _prune); the aside goes
            # with the stale temporaries below, now or after a later save.
            aside = directory / f".tmp-{step_name(step)}-{os.getpid()}-replaced"
            shutil.rmtree(aside, ignore_errors=True)
            final.rename(aside)
        tmp.rename(final)
        _fsync_dir(directory)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs for the next try
        cause = root_cause(e)
        raise CheckpointError(
            f"checkpoint {final.name} in {directory}: {type(cause).__name__}: {cause}"
        ) from None
    for old in list_checkpoints(directory)[:-keep_last]:
        _prune(old)
    for stale in directory.glob(".tmp-step-*"):  # left by a process that died mid-save
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _prune(old: Path) -> None:
    """Removes an old checkpoint; one that will not go is left for the next save's prune. The new checkpoint
    is on disk by then, so this must not end the run: on NFS a file still open on the same client (an
    export reading it) is renamed `.nfs*` instead of removed, and its directory stays until it is closed."""
    try:
        shutil.rmtree(old)
    except OSError as e:
        log.warning("checkpoint %s not removed yet (%s: %s); tried again after the next save", old.name,
                    type(e).__name__, e)  # fmt: skip


def load_checkpoint(path: Path, *, ema: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state, ema state or None), on the CPU.

    Memory-mapped: tensors are read from the file as they are used (the optimizer moments as they are copied
    to the device, none of them when `export` needs only the spec and the EMA), not read whole first.
    """
    path = Path(path)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True, mmap=True)
    ema_state = torch.load(path / "ema.pt", map_location="cpu", weights_only=True, mmap=True) if ema else None
    return state, ema_state


# ---- saving in the background ----


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested state (dicts, lists, tuples), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict | list | tuple):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(value)


def state_bytes(obj: Any) -> int:
    """Bytes of the CUDA tensors in a nested state (what a device snapshot of it needs)."""
    return sum(t.numel() * t.element_size() for t in _tensors(obj) if t.is_cuda)


def device_room(device: torch.device, need: int, *, margin: int = 4 << 30) -> bool:
    """True when `need` more bytes fit on `device` beside training's own peak (its high-water mark since the
    process started, above what it holds now between steps) with `margin` to spare."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    transient = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return need + transient + margin <= free + cached


def device_snapshot(obj: Any) -> Any:
    """A copy of a nested state whose CUDA tensors are copied on their device (the rest is shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.is_cuda else obj
    if isinstance(obj, dict):
        return {k: device_snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(device_snapshot(v) for v in obj)
    return obj


def _cuda_device(obj: Any) -> torch.device | None:
    return next((t.device for t in _tensors(obj) if t.is_cuda), None)


class _HostBuffers:
    """Host copies of a nested state, in buffers kept from one save to the next (same keys, same shapes)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.cuda = False

    def copy(self, obj: Any, key: str = "") -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.is_cuda  # pinned memory makes the device-to-host copy asynchronous
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._buffers[key] = buf
            buf.copy_(t, non_blocking=t.is_cuda)
            self.cuda = self.cuda or t.is_cuda
            return buf
        if isinstance(obj, dict):
            return {k: self.copy(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.copy(v, f"{key}/{i}") for i, v in enumerate(obj))
        return obj


class AsyncCheckpointer:
    """Snapshot now, write in a background thread; one save in flight at a time.

    `save` returns the directory the checkpoint will have once written; `wait` blocks until it is (and
    raises its error); `check` raises a failed background write's error without waiting (every step).
    """

    def __init__(self, directory: Path, *, keep_last: int) -> None:
        self.directory, self.keep_last = Path(directory), keep_last
        self._state_buffers, self._ema_buffers = _HostBuffers(), _HostBuffers()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream: Any = None  # the writer's CUDA stream (device snapshots)
        self.last_path: Path | None = None  # the newest checkpoint written completely
        self.stalls: list[float] = []  # seconds training waited, per periodic save

    def save(
        self,
        step: int,
        state: dict[str, Any],
        ema: Callable[[], dict[str, Any]],
        *,
        release: Callable[[], None] | None = None,
        final: bool = False,
    ) -> Path:
        """Snapshots `state` and `ema()` (called here, in the training thread) and starts the write.

        With `release`, `ema()` hands out a live state that stays unchanged until `release()` (CpuEma's
        freeze and thaw): it is written as it is, not copied, and released once ema.pt is on disk.
        `final`: the run's last save (its caller waits for it), logged without a stall: training is over.
        """
        start = time.perf_counter()
        previous = self.busy()
        self.wait()  # the previous write must be done: its buffers are about to be refilled
        waited = time.perf_counter() - start if previous else 0.0
        device = _cuda_device(state)
        on_device = device is not None and device_room(device, state_bytes(state))
        host_state = device_snapshot(state) if on_device else self._state_buffers.copy(state, "state")
        live = ema()
        try:
            host_ema = live if release is not None else self._ema_buffers.copy(live, "ema")
        except BaseException:
            if release is not None:
                release()
            raise
        event = None
        if device is not None or self._ema_buffers.cuda:
            event = torch.cuda.Event()
            event.record()
        stall = time.perf_counter() - start
        if not final:
            self.stalls.append(stall)
        how = ("final" if final else f"stall {stall:.2f} s") + (
            f", {waited:.1f} s of it waiting for the previous write" if waited >= 0.05 else ""
        )
        how += ", snapshot on the device" if on_device else ", snapshot in host memory" if device else ""
        self._thread = threading.Thread(
            target=self._write,
            args=(step, host_state, host_ema, event, device, how, release),
            name="checkpoint",
            daemon=True,
        )
        self._thread.start()
        return self.directory / step_name(step)

    def _write(
        self,
        step: int,
        state: dict,
        ema: dict,
        event: Any,
        device: torch.device | None,
        how: str,
        release: Callable[[], None] | None,
    ) -> None:
        start = time.perf_counter()
        released = False

        def release_once() -> None:
            nonlocal released
            if release is not None and not released:
                released = True
                release()

        try:
            if event is not None:
                event.synchronize()  # the snapshot's copies (device-to-device or to pinned memory) are done
                # torch.save copies a device snapshot to the host one storage at a time, on this stream: off
                # the training stream, so the copies do not queue between training's kernels.
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=device)
                stream_ctx: Any = torch.cuda.stream(self._stream)
            else:
                stream_ctx = contextlib.nullcontext()
            with stream_ctx:
                path = save_checkpoint(
                    self.directory, step, state, ema, keep_last=self.keep_last, ema_written=release_once
                )
        except BaseException as e:  # handed to the training thread
            self._error = e
            return
        finally:
            release_once()  # a write that failed before ema.pt must not hold the EMA back for ever
        self.last_path = path
        log.info(
            "checkpoint %s: %s; written in %.1f s (%s)", path.name, how, time.perf_counter() - start, path
        )

    def busy(self) -> bool:
        """A write is in flight (a save now would wait for it)."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait(self) -> Path | None:
        """Blocks until the save in flight is written; raises its error. Returns the newest checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
        return self.last_path
