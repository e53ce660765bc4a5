"""A fresh start's EMA copy beside the first step: how long the training thread's host syncs wait for it.

The average starts at the weights before the first optimizer step: 6.8 GB of fp32 at the reference drafter.
Three ways of copying them, side by side in one process, on drafter-sized tensors:
  blocking   in the training thread (the trainer before the change): the step waits for the whole copy;
  pageable   in a worker, device to pageable memory on a stream of its own;
  bounce     in a worker through two small pinned buffers (ema.host_copies, what CpuEma.begin runs).
While a worker copies, the training thread does what a step does: a small kernel and `.item()` every 20 ms.
Printed per variant: when begin returned, when the copy was done, and the syncs' waits (first, longest, sum).

  python3 trainer/bench/bench_ema_begin.py --device cuda [--gb 6.8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_trainer.ema import host_copies


def blocking(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.to("cpu", torch.float32, copy=True) for name, p in params.items()}


def pageable(params: dict[str, torch.Tensor], ready: torch.cuda.Event) -> dict[str, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        return {name: p.to("cpu", torch.float32, copy=True) for name, p in params.items()}


def measure(name: str, params: dict[str, torch.Tensor], copy: Callable[..., object] | None) -> dict:
    """`copy` None: the blocking variant, in this thread; else `copy(params, ready)` in a worker."""
    probe = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = threading.Event()
    if copy is None:
        blocking(params)
        done.set()
    else:
        ready = torch.cuda.Event()
        ready.record()

        def work() -> None:
            copy(params, ready)
            done.set()

        threading.Thread(target=work, daemon=True).start()
    returned = time.perf_counter() - start
    waits: list[float] = []
    while not done.is_set() or not waits:
        t = time.perf_counter()
        (probe * 2).sum().item()  # a step's host sync
        waits.append(time.perf_counter() - t)
        time.sleep(0.02)
    done.wait()
    finished = time.perf_counter() - start
    row = {
        "variant": name,
        "begin_returned_s": round(returned, 3),
        "copy_done_s": round(finished, 3),
        "first_sync_wait_s": round(waits[0], 4),
        "longest_sync_wait_s": round(max(waits), 4),
        "sync_waits_total_s": round(sum(waits), 3),
        "syncs": len(waits),
    }
    print(
        f"{name:9s} begin returned {returned:6.2f} s, copy done {finished:6.2f} s; the step's syncs: first "
        f"waited {waits[0]:.3f} s, longest {max(waits):.3f} s, {sum(waits):.2f} s in {len(waits)}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gb", type=float, default=6.8, help="fp32 weights to copy (6.8: the reference)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit("bench_ema_begin: needs a CUDA device (the contention is the CUDA driver's)")
    per_tensor = 131_072_000  # the reference drafter's largest matrices: 25600 x 5120
    count = max(1, round(args.gb * 1e9 / 4 / per_tensor))
    params = {f"w{i}": torch.randn(per_tensor, device="cuda") for i in range(count)}
    print(f"{count} fp32 tensors of {per_tensor * 4 / 1e9:.2f} GB on {torch.cuda.get_device_name()}")
    measure("warm-up", {"w0": params["w0"][: 1 << 20]}, host_copies)  # the pinned allocator and streams
    rows = [
        measure("blocking", params, None),
        measure("pageable", params, pageable),
        measure("bounce", params, host_copies),
    ]
    if args.out:
        figures = {"device": torch.cuda.get_device_name(), "rows": rows}
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
