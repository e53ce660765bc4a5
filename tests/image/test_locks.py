"""The locks carry hashes and agree with each other and with what they install.

requirements-cuda.lock is requirements.lock plus the CUDA libraries of torch's CUDA build and nothing else
(scripts/cuda_lock.py refuses a resolution that moves a base pin, such as the triton that torch's CUDA build
requires exactly). Every pin of every lock carries the sha256 of each file it may install
(scripts/hash_lock.py): bootstrap, the CT image and L3 install them with `pip install --require-hashes`."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab.image import LOCKS
from lab.settings import REPO
from tests.image.lockfile import locks

# What torch's CUDA build pulls in that its CPU build does not (torch 2.13.0: cuda-toolkit, cuda-bindings,
# cuda-pathfinder and the nvidia-* wheels).
CUDA_ONLY = re.compile(r"^(nvidia-|cuda-)")
ALL_LOCKS = [
    LOCKS["cpu"],
    LOCKS["cuda"],
    *sorted((REPO / "requirements").glob("*.lock")),
]


def pins(lock: str) -> dict[str, str]:
    return {locks.canonical(p.name): p.version for p in locks.read_lock(LOCKS[lock]).pins}


def hashes(lock: str) -> dict[str, set[str]]:
    return {locks.canonical(p.name): set(p.hashes) for p in locks.read_lock(LOCKS[lock]).pins}


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


@pytest.mark.parametrize("lock", ALL_LOCKS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_pin_carries_a_hash(lock: Path) -> None:
    parsed = locks.read_lock(lock)
    assert parsed.pins, f"{lock} pins nothing"
    bare = [p.name for p in parsed.pins if not p.hashes]
    assert not bare, f"{lock}: pins without --hash (pip --require-hashes refuses the lock): {bare}"


def test_the_locks_accept_the_same_files_except_torchs_build() -> None:
    """Both take PyPI's files (the local index mirrors them) for every shared pin but torch: the cpu lock
    takes the CPU build of pip's find-links, and only it: with PyPI's hash listed too, pip would rank PyPI's
    CUDA build (an index URL carrying an allowed hash) above the find-links file and install it."""
    cpu, cuda = hashes("cpu"), hashes("cuda")
    differ = {name: (sorted(cpu[name]), sorted(cuda[name])) for name in cpu if cpu[name] != cuda[name]}
    assert set(differ) == {"torch"}, (
        f"requirements.lock and requirements-cuda.lock differ in hashes: {differ}"
    )
    assert not cpu["torch"] & cuda["torch"], "the locks accept the same torch file"


def find_links() -> list[Path]:
    """The folders pip's configuration here offers as find-links (`pip config list`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    )
    found = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += [Path(v) for v in value.strip("'\"").split()]
    return found


def test_the_cpu_lock_accepts_the_cpu_torch_of_pips_find_links_and_the_cuda_lock_does_not() -> None:
    version = pins("cpu")["torch"]
    wheels = [w for d in find_links() for w in sorted(d.glob(f"torch-{version}+cpu-*.whl"))]
    if not wheels:
        pytest.skip(f"pip's configuration here offers no CPU build of torch {version} (pip config list)")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    assert hashes("cpu")["torch"] == {digest}, f"requirements.lock must accept exactly {wheels[0]} ({digest})"
    assert digest not in hashes("cuda")["torch"], f"requirements-cuda.lock accepts the CPU build {wheels[0]}"


def test_a_lock_line_that_is_not_a_pin_is_named(tmp_path: Path) -> None:
    lock = tmp_path / "bad.lock"
    lock.write_text("# header\nmdurl==0.1.2 \\\n    --hash=md5:abc\n")
    with pytest.raises(locks.LockError, match=r"bad\.lock:2: mdurl: expected --hash=sha256:HEX"):
        locks.read_lock(lock)


def test_a_lock_written_and_read_back_is_the_same(tmp_path: Path) -> None:
    parsed = locks.read_lock(LOCKS["cpu"])
    out = tmp_path / "again.lock"
    locks.write_lock(parsed, out)
    assert out.read_text() == LOCKS["cpu"].read_text()
