"""Fast loading of safetensors files (the target staged in /dev/shm) onto a device.

`safetensors.torch.load_file(path, device="cuda")` moves a 52 GB target at 3.4-4.4 GB/s: it copies tensor by
tensor from pageable memory. Here a file's data section goes to the device as one allocation, in large chunks,
through a ring of pinned host buffers: reader threads fill the buffers from the file with pread (the GIL is
released; /dev/shm reads are memory copies, so several run at once), and each full buffer is copied to the
device on a dedicated CUDA stream while the next ones are being read (double/multi-buffering). A buffer is
reused only after the event recorded behind its copy completed. The tensors of the state dict are views into
that one device allocation, at the offsets of the file's header (a copy where an offset is misaligned).

    state = load_file("/dev/shm/dflash/model/model.safetensors", device="cuda:0")
    states = load_on_devices(paths, ["cuda:0", "cuda:1"])   # one loader per device, in parallel

The result equals `safetensors.torch.load_file` (same names, dtypes, shapes and values); on the CPU the data
is read straight into the destination, so the same code runs in CI. `method="register"` (CUDA only,
experimental) registers the memory-mapped file with cudaHostRegister and copies from it directly, skipping the
host-side copy; it needs a driver that can register read-only shared mappings.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAX_HEADER_BYTES = 100 << 20

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
    }.items()
    if hasattr(torch, attr)
}


class FastLoadError(ValueError):
    """A file that is not a well-formed safetensors file; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # byte offset of the data section in the file
    data_bytes: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None


def read_header(path: str | os.PathLike) -> Header:
    """Parses and checks the header: each tensor inside the data section, its byte size matching its shape."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise FastLoadError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise FastLoadError(f"{path}: header length {n} is impossible for a file of {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FastLoadError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FastLoadError(f"{path}: header is not an object")
    metadata = header.pop("__metadata__", None)
    data_start, data_bytes = 8 + n, size - 8 - n
    tensors = []
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise FastLoadError(f"{path}: tensor {name!r}: bad header entry {info!r} ({e})") from None
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= begin <= end <= data_bytes or end - begin != numel * dtype.itemsize:
            raise FastLoadError(
                f"{path}: tensor {name!r}: offsets [{begin}, {end}) do not fit {info['dtype']}{list(shape)} "
                f"inside a data section of {data_bytes} bytes"
            )
        tensors.append(TensorInfo(name, dtype, shape, begin, end))
    return Header(path, data_start, data_bytes, tuple(tensors), metadata)


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fills `out` (uint8, contiguous) from the file at `offset`; short reads are continued."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise FastLoadError(f"file descriptor {fd}: unexpected end of file at byte {offset + done}")
        done += n


def _views(header: Header, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state dict as views of the flat uint8 data section (a copy where an offset is misaligned)."""
    out = {}
    for t in header.tensors:
        raw = flat[t.begin : t.end]
        if t.begin % t.dtype.itemsize:
            raw = raw.clone()
        out[t.name] = raw.view(t.dtype).reshape(t.shape)
    return out


class Loader:
    """One device's loader: its pinned buffer ring, its copy stream and its reader threads (reused across
    files, so loading the shards of one checkpoint allocates the pinned memory once)."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        # bench_load.py on H200 hosts: 16 MiB x 12 (30.8 GB/s against 18.0 with 64 MiB x 6); 8 MiB x 12
        # buffers, 12 readers: 45.4 GB/s median against 39.3 with 16 MiB in the same run (--grid). Figures:
        # docs/journal.md; the current one: docs/benchmarks.md. Readers are capped by the CPUs there are.
        chunk_mb: int = 8,
        num_buffers: int = 12,
        readers: int = min(12, os.cpu_count() or 1),
        method: str = "pinned",
    ) -> None:
        if method not in ("pinned", "register"):
            raise ValueError(f"method {method!r}: must be 'pinned' or 'register'")
        if chunk_mb < 1 or num_buffers < 2 or readers < 1:
            raise ValueError("chunk_mb >= 1, num_buffers >= 2 and readers >= 1 are needed")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.chunk = chunk_mb << 20
        self.method = method if self.cuda else "pinned"
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix=f"fast_load-{self.device}")
        self.buffers: list[torch.Tensor] = []
        self.host_views: list[np.ndarray] = []
        if self.cuda and self.method == "pinned":
            with torch.cuda.device(self.device):
                self.stream = torch.cuda.Stream(self.device)
                self.buffers = [
                    torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)
                ]
            self.host_views = [b.numpy() for b in self.buffers]
        elif self.cuda:
            self.stream = torch.cuda.Stream(self.device)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.buffers, self.host_views = [], []

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one file -----------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike) -> dict[str, torch.Tensor]:
        header = read_header(path)
        if header.data_bytes == 0:
            return _views(header, torch.empty(0, dtype=torch.uint8, device=self.device))
        fd = os.open(header.path, os.O_RDONLY)
        try:
            if not self.cuda:
                flat = self._load_cpu(fd, header)
            elif self.method == "register":
                flat = self._load_registered(header)
            else:
                flat = self._load_pinned(fd, header)
        finally:
            os.close(fd)
        return _views(header, flat)

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(o, min(self.chunk, nbytes - o)) for o in range(0, nbytes, self.chunk)]

    def _load_cpu(self, fd: int, header: Header) -> torch.Tensor:
        flat = torch.empty(header.data_bytes, dtype=torch.uint8)
        view = flat.numpy()
        jobs = [
            self.pool.submit(_pread_into, fd, view[o : o + n], header.data_start + o)
            for o, n in self._chunks(header.data_bytes)
        ]
        for job in jobs:
            job.result()
        return flat

    def _load_pinned(self, fd: int, header: Header) -> torch.Tensor:
        chunks = self._chunks(header.data_bytes)
        ring = len(self.buffers)
        with torch.cuda.device(self.device):
            flat = torch.empty(header.data_bytes, dtype=torch.uint8, device=self.device)
            # the copy stream writes `flat`, which the caller's stream allocated and will read
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

            def read(i: int, wait_for: torch.cuda.Event | None) -> None:
                if wait_for is not None:
                    wait_for.synchronize()  # the copy out of this buffer has finished; releases the GIL
                o, n = chunks[i]
                _pread_into(fd, self.host_views[i % ring][:n], header.data_start + o)

            pending = {i: self.pool.submit(read, i, None) for i in range(min(ring, len(chunks)))}
            try:
                with torch.cuda.stream(self.stream):
                    for i, (o, n) in enumerate(chunks):
                        pending.pop(i).result()
                        flat[o : o + n].copy_(self.buffers[i % ring][:n], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self.stream)
                        if i + ring < len(chunks):
                            pending[i + ring] = self.pool.submit(read, i + ring, done)
            finally:
                for job in pending.values():
                    job.exception()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            flat.record_stream(self.stream)
            self.stream.synchronize()  # the pinned ring is reused by the next file
        return flat

    def _load_registered(self, header: Header) -> torch.Tensor:
        cudart = torch.cuda.cudart()
        with header.path.open("rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            with warnings.catch_warnings():  # the mapping is read-only on purpose: nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                host = torch.frombuffer(mapping, dtype=torch.uint8)
            ptr, size = host.data_ptr(), host.numel()
            read_only = 8  # cudaHostRegisterReadOnly
            err = cudart.cudaHostRegister(ptr, size, read_only)
            if int(err) != 0:
                raise RuntimeError(f"{header.path}: cudaHostRegister failed ({err}); use method='pinned'")
            try:
                with torch.cuda.device(self.device):
                    flat = torch.empty(header.data_bytes, dtype=torch.uint8, device=self.device)
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(self.stream):
                        for o, n in self._chunks(header.data_bytes):
                            s = header.data_start + o
                            flat[o : o + n].copy_(host[s : s + n], non_blocking=True)
                    self.stream.synchronize()
            finally:
                cudart.cudaHostUnregister(ptr)
            del host
        finally:
            mapping.close()
        return flat

    def load_files(self, paths: Iterable[str | os.PathLike]) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for path in paths:
            part = self.load(path)
            clash = state.keys() & part.keys()
            if clash:
                raise FastLoadError(f"{path}: tensor {sorted(clash)[0]!r} is also in an earlier file")
            state.update(part)
        return state


def safetensors_files(directory: str | os.PathLike) -> list[Path]:
    """The *.safetensors files of a model directory, in name order (model-00001-of-00011, ...)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FastLoadError(f"{directory}: no *.safetensors files")
    return files


def load_file(
    path: str | os.PathLike, device: str | torch.device = "cpu", **options
) -> dict[str, torch.Tensor]:
    """Drop-in for safetensors.torch.load_file(path, device=...)."""
    with Loader(device, **options) as loader:
        return loader.load(path)


def load_files(
    paths: Sequence[str | os.PathLike], device: str | torch.device = "cpu", **options
) -> dict[str, torch.Tensor]:
    """All tensors of several files (the shards of one checkpoint) on one device."""
    with Loader(device, **options) as loader:
        return loader.load_files(paths)


def load_on_devices(
    paths: Sequence[str | os.PathLike], devices: Sequence[str | torch.device], **options
) -> list[dict[str, torch.Tensor]]:
    """The same files onto every device, one loader per device, all at once (one state dict per device)."""
    results: list[dict[str, torch.Tensor] | None] = [None] * len(devices)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = load_files(paths, devices[i], **options)
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [
        threading.Thread(target=one, args=(i,), name=f"load-{devices[i]}") for i in range(len(devices))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
