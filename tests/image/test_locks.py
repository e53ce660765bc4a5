"""The two trainer locks agree: requirements-cuda.lock is requirements.lock plus the CUDA libraries of torch's
CUDA build and nothing else (scripts/cuda_lock.py refuses a resolution that moves a base pin, such as the
triton that torch's CUDA build requires exactly)."""

from __future__ import annotations

import re

from lab.image import LOCKS

# What torch's CUDA build pulls in that its CPU build does not (torch 2.13.0: cuda-toolkit, cuda-bindings,
# cuda-pathfinder and the nvidia-* wheels).
CUDA_ONLY = re.compile(r"^(nvidia-|cuda-)")


def pins(lock: str) -> dict[str, str]:
    found = {}
    for line in LOCKS[lock].read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def test_every_base_pin_is_in_the_cuda_lock_unchanged() -> None:
    base, cuda = pins("cpu"), pins("cuda")
    moved = {name: (version, cuda.get(name)) for name, version in base.items() if cuda.get(name) != version}
    assert not moved, f"requirements-cuda.lock differs from requirements.lock (base, cuda): {moved}"


def test_the_cuda_lock_adds_only_cuda_libraries() -> None:
    added = sorted(set(pins("cuda")) - set(pins("cpu")))
    assert added, "requirements-cuda.lock adds nothing: it cannot install torch's CUDA build offline"
    other = [name for name in added if not CUDA_ONLY.match(name)]
    assert not other, f"requirements-cuda.lock adds packages that are not CUDA libraries: {other}"


def test_both_locks_pin_torch_and_triton() -> None:
    for lock in ("cpu", "cuda"):
        assert {"torch", "triton"} <= set(pins(lock)), f"{LOCKS[lock]} does not pin torch and triton"
