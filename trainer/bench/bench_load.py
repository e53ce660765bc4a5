"""Benchmark: loading a safetensors model from /dev/shm onto a device, three ways, in one run.

    python trainer/bench/bench_load.py --size-gb 8 --device cuda            # one GPU
    python trainer/bench/bench_load.py --size-gb 8 --devices cuda:0,cuda:1  # + one loader per device at once
    python trainer/bench/bench_load.py --size-gb 0.2 --device cpu           # smoke run anywhere

Writes a model of --size-gb (bf16 tensors of --tensor-mb each) into --dir (default /dev/shm), then prints GB/s
(10^9 bytes per second) of:
  pinned copy     the raw pinned host-to-device copy rate (the ceiling; on a CPU: a plain memory copy)
  load_file       safetensors.torch.load_file(path, device=...) (measured elsewhere: 3.4-4.4 GB/s on an H200)
  fast_load       dflash_trainer.model.fast_load (goal: >= 25 GB/s per device)
  fast_load/reg   fast_load with method="register" (CUDA only, experimental; n/a where the driver refuses)
  N devices       fast_load.load_on_devices onto every --devices at once: aggregate and per device
  fastsafetensors the field's loaders on the same file where installed (a device run carries their wheels):
  runai streamer  fastsafetensors' fastsafe_open (nogds: no GPUDirect Storage in a CT) and the Run:ai
                  model streamer (to host memory, then to the device, as vLLM uses it)
  --diagnose      fast_load's two halves apart, with its options (CUDA): its readers filling the pinned ring
                  from the file with no device copy (the host side's rate), and the ring's chunked copies to
                  the device with no reads (the copy side's rate, against the one 4 GB pinned copy); the
                  slower half bounds fast_load, and both far above it point at their overlap
  --grid          fast_load over every --grid-readers x --grid-chunk-mb x --grid-buffers (per reader)
Each figure is the best of --repeat runs; fast_load's result is compared byte for byte with load_file's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dflash_trainer.model import fast_load

GB = 1e9


def write_model(path: Path, size_bytes: int, tensor_mb: int) -> int:
    """A safetensors file of bf16 tensors [rows, 4096], written as a stream; returns its data bytes."""
    cols = 4096
    rows = max(1, min(tensor_mb << 20, size_bytes // 4) // (cols * 2))
    per = rows * cols * 2
    count = max(1, size_bytes // per)
    header, offset = {}, 0
    for i in range(count):
        header[f"layers.{i}.weight"] = {
            "dtype": "BF16",
            "shape": [rows, cols],
            "data_offsets": [offset, offset + per],
        }
        offset += per
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    base = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = base.view(torch.uint8).reshape(-1).numpy()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i in range(count):
            raw[:8] = list(i.to_bytes(8, "little"))  # every tensor differs
            f.write(raw.tobytes())
    return offset


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(repeat: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        result = None
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def pinned_copy_rate(device: torch.device, nbytes: int, repeat: int) -> float:
    nbytes = min(nbytes, 4 << 30)
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    else:
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        sync(device)

    copy()  # warm-up
    seconds, _ = best_of(repeat, copy)
    return nbytes / seconds / GB


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8).reshape(-1), b[k].view(torch.uint8).reshape(-1)) for k in a
    )


def peer_loaders(path: Path, device: torch.device) -> dict[str, object]:
    """The field's loaders on the same file: name -> a loader returning {name: tensor on device}, or
    the reason it is not measured (not installed here)."""
    peers: dict[str, object] = {}
    try:
        import fastsafetensors
        from fastsafetensors import fastsafe_open
    except ImportError as e:
        peers["fastsafetensors"] = f"not installed ({e})"
    else:

        def fst() -> dict[str, torch.Tensor]:
            with fastsafe_open(str(path), device=str(device), nogds=True) as f:
                # fastsafe_open has keys(), not __iter__
                out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            sync(device)
            return out

        peers[f"fastsafetensors {getattr(fastsafetensors, '__version__', '?')}"] = fst
    try:
        from importlib.metadata import version

        from runai_model_streamer import SafetensorsStreamer
    except ImportError as e:
        peers["runai streamer"] = f"not installed ({e})"
    else:

        def runai() -> dict[str, torch.Tensor]:
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(str(path))
                out = {k: t.to(device) for k, t in streamer.get_tensors()}
            sync(device)
            return out

        peers[f"runai streamer {version('runai-model-streamer')}"] = runai
    return peers


def _ring_reads(loader: fast_load.Loader, path: Path) -> None:
    """The loader's readers fill its pinned ring with the whole file, chunk by chunk; no device copy."""
    header = fast_load.read_header(path)
    ring = loader.host_views
    fd = os.open(path, os.O_RDONLY)
    try:
        jobs = [
            loader.pool.submit(fast_load._pread_into, fd, ring[i % len(ring)][:n], header.data_start + o)
            for i, (o, n) in enumerate(loader._chunks(header.data_bytes))
        ]
        for job in jobs:
            job.result()
    finally:
        os.close(fd)


def _ring_copies(loader: fast_load.Loader, flat: torch.Tensor) -> None:
    """The pinned ring copied into `flat` on the loader's stream in its chunks, as a load does; no reads."""
    ring = loader.buffers
    with torch.cuda.stream(loader.stream):
        for i, (o, n) in enumerate(loader._chunks(flat.numel())):
            flat[o : o + n].copy_(ring[i % len(ring)][:n], non_blocking=True)
    loader.stream.synchronize()


def diagnose(path: Path, nbytes: int, device: torch.device, options: dict[str, int], repeat: int) -> None:
    """fast_load's host side (reads into pinned memory) and device side (chunked copies) measured apart."""
    with fast_load.Loader(device, **options) as loader:
        _ring_reads(loader, path)  # warm-up
        seconds, _ = best_of(repeat, lambda: _ring_reads(loader, path))
        print(f"  readers only  {nbytes / seconds / GB:7.2f} GB/s   file -> pinned ring, no device copy")
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _ring_copies(loader, flat)
        seconds, _ = best_of(repeat, lambda: _ring_copies(loader, flat))
        print(
            f"  copies only   {nbytes / seconds / GB:7.2f} GB/s   pinned ring -> device in chunks, no reads"
        )


def grid(path: Path, nbytes: int, device: torch.device, args: argparse.Namespace) -> None:
    """fast_load's rate over readers x chunk size x buffers per reader: best and median of --repeat."""
    for readers in args.grid_readers:
        for chunk in args.grid_chunk_mb:
            for per in args.grid_buffers:
                opts = {"chunk_mb": chunk, "num_buffers": max(2, per * readers), "readers": readers}
                times = []
                with fast_load.Loader(device, **opts) as loader:
                    loader.load(path)
                    sync(device)
                    for _ in range(args.repeat):
                        start = time.perf_counter()
                        loader.load(path)
                        sync(device)
                        times.append(time.perf_counter() - start)
                best, median = nbytes / min(times) / GB, nbytes / sorted(times)[len(times) // 2] / GB
                print(f"  grid {opts}: best {best:6.2f} GB/s, median {median:6.2f}")


HOST_MEMORY_KEYS = ("MemAvailable", "Shmem", "Dirty", "Writeback")


def host_memory(meminfo: str = "/proc/meminfo") -> str:
    """The host's memory as the loader finds it: reads from /dev/shm compete with whatever else moves host
    memory (after a rehearsal that left 60 GB in /dev/shm and had just written ~100 GB of checkpoints,
    fast_load fell from 45 to 15-21 GB/s while the pinned copy alone stayed at 55; docs/journal.md)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
    except OSError:
        return "host memory: unknown (no /proc/meminfo)"
    gib = {k: int(fields[k].split()[0]) / 2**20 for k in HOST_MEMORY_KEYS if k in fields}
    return "host memory: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in gib.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=8.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--devices", default="", help="comma-separated, e.g. cuda:0,cuda:1: parallel loaders")
    parser.add_argument("--dir", default="/dev/shm", help="where the model is written (a tmpfs)")
    parser.add_argument("--tensor-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=8)
    parser.add_argument("--buffers", type=int, default=12)
    parser.add_argument("--readers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--sweep", action="store_true", help="also try a few reader/chunk settings")
    parser.add_argument("--diagnose", action="store_true", help="fast_load's reads and copies apart (CUDA)")
    parser.add_argument("--grid", action="store_true", help="fast_load over the --grid-* settings")
    parser.add_argument("--grid-readers", type=int, nargs="+", default=[12, 16])
    parser.add_argument("--grid-chunk-mb", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument(
        "--grid-buffers", type=int, nargs="+", default=[1, 2], help="pinned buffers per reader"
    )
    parser.add_argument("--keep", action="store_true", help="keep the model file afterwards")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    work = Path(args.dir) / f"dflash-bench-load-{os.getpid()}"
    work.mkdir(parents=True)
    path = work / "model.safetensors"
    try:
        need = int(args.size_gb * GB)
        free = shutil.disk_usage(args.dir).free
        if need * 1.05 > free:
            print(f"bench_load: {args.dir} has {free / GB:.1f} GB free, the model needs {need / GB:.1f} GB")
            return 1
        start = time.perf_counter()
        nbytes = write_model(path, need, args.tensor_mb)
        print(
            f"model: {nbytes / GB:.2f} GB of bf16 in {path} (written in {time.perf_counter() - start:.1f} s)"
        )
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"device: {device} ({name}), torch {torch.__version__}, {os.cpu_count()} CPUs")
        print(host_memory(), "(before)")
        options = {"chunk_mb": args.chunk_mb, "num_buffers": args.buffers, "readers": args.readers}
        print(f"fast_load options: {options}")

        rate = pinned_copy_rate(device, nbytes, args.repeat)
        what = "pinned host-to-device" if device.type == "cuda" else "memory"
        print(f"pinned copy     {rate:7.2f} GB/s   raw {what} copy")

        def st() -> dict[str, torch.Tensor]:
            out = load_file(str(path), device=str(device))
            sync(device)
            return out

        seconds, reference = best_of(args.repeat, st)
        note = " (on a CPU it memory-maps: nothing is copied)" if device.type == "cpu" else ""
        print(f"load_file       {nbytes / seconds / GB:7.2f} GB/s   safetensors load_file({device}){note}")

        with fast_load.Loader(device, **options) as loader:

            def fl() -> dict[str, torch.Tensor]:
                out = loader.load(path)
                sync(device)
                return out

            fl()  # warm-up: the allocator's first large block
            seconds, ours = best_of(args.repeat, fl)
        equal = same_bytes(ours, reference)
        del ours
        print(f"fast_load       {nbytes / seconds / GB:7.2f} GB/s   equal to load_file: {equal}; goal >= 25")
        if device.type == "cuda":
            try:
                with fast_load.Loader(device, method="register", chunk_mb=args.chunk_mb) as loader:
                    seconds, ours = best_of(args.repeat, lambda: (loader.load(path), sync(device))[0])
                equal = same_bytes(ours, reference)
                print(f"fast_load/reg   {nbytes / seconds / GB:7.2f} GB/s   equal to load_file: {equal}")
                del ours
            except RuntimeError as e:
                print(f"fast_load/reg       n/a     {str(e).splitlines()[0][:120]}")
        for label, loader in peer_loaders(path, device).items():
            if isinstance(loader, str):
                print(f"{label:<15}     n/a     {loader[:120]}")
                continue
            try:
                loader()  # warm-up, as fast_load had
                seconds, theirs = best_of(args.repeat, loader)
            except Exception as e:  # a peer that fails here is a finding, not the end of the benchmark
                print(f"{label:<15}     failed  {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            equal = same_bytes(theirs, reference)
            del theirs
            print(f"{label:<15} {nbytes / seconds / GB:7.2f} GB/s   equal to load_file: {equal}")
        del reference

        if args.diagnose and device.type == "cuda":
            diagnose(path, nbytes, device, options, args.repeat)
        if args.grid:
            grid(path, nbytes, device, args)
        if args.sweep:
            for readers in (2, 4, 8, 12):
                for chunk in (16, 64, 256):
                    opts = {"chunk_mb": chunk, "num_buffers": max(4, readers), "readers": readers}
                    with fast_load.Loader(device, **opts) as loader:
                        loader.load(path)
                        seconds, _ = best_of(
                            args.repeat, lambda loader=loader: (loader.load(path), sync(device))
                        )
                    print(f"  sweep {opts}: {nbytes / seconds / GB:7.2f} GB/s")

        devices = [d for d in args.devices.split(",") if d]
        if len(devices) > 1:
            fast_load.load_on_devices([path], devices, **options)  # warm-up
            # each loader waits for its own copies before returning, so the time covers every device
            seconds, _ = best_of(args.repeat, lambda: fast_load.load_on_devices([path], devices, **options))
            total = nbytes * len(devices)
            print(
                f"{len(devices)} devices     {total / seconds / GB:7.2f} GB/s aggregate, "
                f"{nbytes / seconds / GB:.2f} GB/s per device (all loading the same file at once)"
            )
        print(host_memory(), "(after)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
