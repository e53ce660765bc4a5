"""Exponential moving average of the drafter's weights, kept in host memory in fp32.

A second copy of a 1.7B-parameter drafter on the GPU is what once ran a training job out of memory, so the
average lives on the CPU only. Every `every` steps the weights are copied device-to-host without blocking into
pinned staging buffers (on the training stream, so the copy sees exactly this step's weights and the next
optimizer step waits for it); the fp32 fold runs in a worker thread after the copy's event, overlapping the
next steps. Folding is deferred, never skipped: `state_dict` and the next update wait for it.

A background checkpoint writes the average without copying it (6.8 GB at the reference): `freeze` hands out
the live state and holds the fold back until the writer calls `thaw`, so the file holds exactly the average
of the step it was saved at; a fold due meanwhile waits for the write of ema.pt only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

BOUNCE_BYTES = 64 << 20  # each of host_copies' two pinned buffers


def host_copies(
    params: dict[str, torch.Tensor], ready: torch.cuda.Event | None, *, bounce_bytes: int = BOUNCE_BYTES
) -> dict[str, torch.Tensor]:
    """fp32 host copies of `params`, made after `ready` (an event of the stream that wrote them).

    CUDA tensors go through two small pinned buffers on a stream of this call's own, chunk by chunk: each
    driver call is short, so another thread's host syncs (the training step's) are not held up. A plain
    device-to-pageable copy holds the driver for the whole tensor, and the training thread's first
    `.item()` waited 4.1 s behind it on an H100 (docs/benchmarks.md, row `#first-start`); pinning a
    destination of 6.8 GB would hold it for seconds as well.
    """
    out = {name: torch.empty(p.shape, dtype=torch.float32, device="cpu") for name, p in params.items()}
    cuda = [name for name, p in params.items() if p.is_cuda]
    for name in params.keys() - set(cuda):
        out[name].copy_(params[name])
    if not cuda:
        return out
    stream = torch.cuda.Stream(params[cuda[0]].device)
    if ready is not None:
        stream.wait_event(ready)
    elements = max(1, bounce_bytes // 4)
    buffers = [torch.empty(elements, dtype=torch.float32, pin_memory=True) for _ in range(2)]
    in_flight: list[tuple[torch.cuda.Event, torch.Tensor, int] | None] = [None, None]

    def drain(slot: int) -> None:
        pending = in_flight[slot]
        if pending is not None:
            event, destination, n = pending
            event.synchronize()  # waits without holding the driver
            destination.copy_(buffers[slot][:n])
            in_flight[slot] = None

    slot = 0
    for name in cuda:
        source, destination = params[name].reshape(-1), out[name].reshape(-1)
        for start in range(0, source.numel(), elements):
            n = min(elements, source.numel() - start)
            drain(slot)
            with torch.cuda.stream(stream):
                buffers[slot][:n].copy_(source[start : start + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            in_flight[slot] = (event, destination[start : start + n], n)
            slot = 1 - slot
    drain(slot)
    drain(1 - slot)
    return out


class CpuEma:
    def __init__(self, module: nn.Module, *, decay: float, every: int) -> None:
        self.decay = decay
        self.every = every
        self.num_updates = 0
        self._module = module
        params = dict(module.named_parameters())
        self._names = list(params)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema")
        # Held by a checkpoint writer while it serialises the shadow (released from the writer's thread).
        self._frozen = threading.Lock()
        self.shadow: dict[str, torch.Tensor] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._started = False
        self._pending: Future | None = None
        self._prepared = False
        self._copying: Future | None = None  # a fresh start's copy of the weights (begin)

    def _submit(self, task: Callable[..., None], *args: object) -> None:
        """Queues `task` behind the worker's previous one, whose failure it passes on (a resume queues
        its copy without waiting for the pinning; `wait` in the training thread sees either failure)."""
        previous = self._pending

        def run() -> None:
            if previous is not None:
                previous.result()
            task(*args)

        self._pending = self._worker.submit(run)

    def prepare(self) -> None:
        """Queues the pinned staging buffers' allocation in the worker, once (later calls are no-ops).

        Pinning 6.9 GB at the reference takes about 5 s and holds the CUDA driver while it runs: beside a
        resume's host-to-device copies it makes them 2.9 s slower (docs/gpu-rehearsal.md). So nothing pins at
        construction: the trainer calls this after its first optimizer step is queued, and the first fold
        (`every` steps later) finds the buffers made.
        """
        if self._prepared:
            return
        self._prepared = True
        params = dict(self._module.named_parameters())
        pin = torch.cuda.is_available() and any(p.is_cuda for p in params.values())
        shapes = {name: (p.shape, p.dtype) for name, p in params.items()}
        self._submit(self._allocate, shapes, pin)

    def _allocate(self, shapes: dict[str, tuple[torch.Size, torch.dtype]], pin: bool) -> None:
        self._staging = {
            name: torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
            for name, (shape, dtype) in shapes.items()
        }

    def begin(self) -> None:
        """Starts the average at the module's weights of now, once; a no-op after `load_state_dict`.

        The trainer calls it before its first step's forward, so a resume never copies weights that the
        checkpoint's average replaces. A fresh start copies them to fp32 host tensors in the worker
        (`host_copies`) while the first step's forward and backward run: blocking, that copy cost the first
        step 5-7 s on an H100, and the staging buffers' pinning it used to queue behind it held the
        CUDA driver for 5-7 s more, stalling the forward's first host sync (docs/benchmarks.md, row
        `#first-start`). The weights must not change before the copy is done: the trainer calls
        `before_weights_change` before its optimizer step. The staging buffers are pinned later (`prepare`).
        """
        if self._started:
            return
        self._started = True
        self.wait()
        params = {name: p.detach() for name, p in self._module.named_parameters()}
        cuda = next((p.device for p in params.values() if p.is_cuda), None)
        ready = None
        if cuda is not None:  # the copy sees the weights as of now: after their queued initialisation
            ready = torch.cuda.Event()
            ready.record()

        def copy() -> None:
            shadow = host_copies(params, ready)
            with self._frozen:
                self.shadow = shadow

        self._submit(copy)
        self._copying = self._pending

    def before_weights_change(self) -> None:
        """Waits for a fresh start's copy of the weights (`begin`), if one is under way."""
        if self._copying is not None:
            self._copying.result()
            self._copying = None

    def _stage(self, module: nn.Module) -> torch.cuda.Event | None:
        """Copies the weights into the staging buffers without blocking; the event marks their arrival."""
        for name, p in module.named_parameters():
            self._staging[name].copy_(p.detach(), non_blocking=True)
        if not any(p.is_cuda for p in module.parameters()):
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def update(self, module: nn.Module, step: int) -> None:
        """Called after each optimizer step; folds the weights in every `every` steps."""
        if step % self.every:
            return
        self.begin()
        self.prepare()
        self.wait()  # the staging buffers exist, the previous fold is done
        self._submit(self._fold, self._stage(module))

    def _fold(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()
        with self._frozen:
            for name, shadow in self.shadow.items():
                shadow.lerp_(self._staging[name].float(), 1.0 - self.decay)
            self.num_updates += 1

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a failure of the fold here, in the training thread
            self._pending = None

    def state_dict(self) -> dict:
        self.begin()
        self.wait()
        return {
            "decay": self.decay,
            "every": self.every,
            "num_updates": self.num_updates,
            "shadow": self.shadow,
        }

    def freeze(self) -> dict:
        """The live state (no copy), unchanged until `thaw`: folds wait. Call from the training thread."""
        self.begin()
        self.wait()
        self._frozen.acquire()
        return self.state_dict()

    def thaw(self) -> None:
        """Lets folds go on; any thread may call it (the checkpoint writer does)."""
        self._frozen.release()

    def load_state_dict(self, state: dict) -> None:
        """Checks the names now; copies the values in the worker, queued behind any fold
        (6.8 GB read from a memory-mapped checkpoint at the reference: seconds a restart need not wait for
        before its first step). The next update, `weights` and `state_dict` wait for it."""
        if state["shadow"].keys() != set(self._names):
            raise ValueError("EMA state does not match the drafter's parameters")
        self._started = True

        def copy() -> None:
            with self._frozen:
                self.shadow = {
                    name: tensor.to(torch.float32, copy=True) for name, tensor in state["shadow"].items()
                }
                self.num_updates = state["num_updates"]

        self._submit(copy)

    def weights(self) -> dict[str, torch.Tensor]:
        """The averaged parameters (fp32, CPU), by parameter name."""
        self.begin()
        self.wait()
        return self.shadow
