"""L3 environment: compilers for Triton, the trainer venv from the lock, on GPU hosts the NVIDIA userspace.

Runs against any inventory (`make verify INVENTORY=...`); GPU checks are skipped where ct_gpus is empty.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest

from lab.image import LOCKS
from tests.image.lockfile import locks
from tests.verify.conftest import REPO

GROUP = "training_cts"


def var(hostvars: dict[str, Any], key: str, default: str) -> str:
    value = hostvars.get(key, default)
    return default if isinstance(value, str) and "{{" in value else str(value)


def venv(hostvars: dict[str, Any]) -> str:
    return var(hostvars, "ct_venv_dir", "/opt/dflash/venv")


def test_gcc_and_python_headers(host) -> None:
    assert host.run("gcc --version").rc == 0, "gcc is missing (Triton compiles its launcher with it)"
    assert host.run("test -f /usr/include/python3.11/Python.h").rc == 0, "python3-dev headers are missing"
    compile_check = host.run(
        "printf '#include <Python.h>\\nint main(void){return 0;}\\n' > /tmp/l3check.c && "
        "gcc $(python3-config --includes) -c /tmp/l3check.c -o /tmp/l3check.o && rm -f /tmp/l3check.*"
    )
    assert compile_check.rc == 0, (
        f"gcc cannot compile against Python.h: {compile_check.stderr.strip()[-200:]}"
    )


def variant_lock(hostvars: dict[str, Any]) -> str:
    """The lock of the CT's variant, as roles/ct_environment picks it (ct_variant; cuda by default)."""
    return str(LOCKS[var(hostvars, "ct_variant", "cuda")].relative_to(REPO))


def pins(text: str) -> dict[str, str]:
    """Normalised name -> version of `name==version` lines, local versions (+cpu) dropped."""
    found = {}
    for line in text.splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.split("+", 1)[0]
    return found


def test_venv_is_the_lock(host, hostvars: dict[str, Any]) -> None:
    v, lock_path = venv(hostvars), variant_lock(hostvars)
    lock = (REPO / lock_path).read_bytes()
    stamp = host.file(f"{v}/.dflash-lock.sha256")
    assert stamp.exists, f"{v} has no lock stamp: the install did not finish"
    assert stamp.content_string.strip() == hashlib.sha256(lock).hexdigest(), (
        f"{v} was built from another lock than {lock_path}"
    )
    # --all: setuptools is a pin of the lock too; pip itself is the venv's own (requirements/pip.lock).
    freeze = pins(host.check_output(f"{v}/bin/python -m pip freeze --all --disable-pip-version-check"))
    for own in ("dflash-trainer", "pip"):
        freeze.pop(own, None)
    # The lock's own reader: its pins carry `\` continuations and --hash lines (scripts/locks.py).
    want = {
        re.sub(r"[-_.]+", "-", p.name).lower(): p.version.split("+", 1)[0]
        for p in locks.read_lock(REPO / lock_path).pins
    }
    wrong = {n: (want.get(n), freeze.get(n)) for n in set(want) | set(freeze) if want.get(n) != freeze.get(n)}
    assert not wrong, f"{v} differs from {lock_path} (name: (lock, installed)): {dict(sorted(wrong.items()))}"


def test_environment_imports(host, hostvars: dict[str, Any]) -> None:
    code = "import torch, transformers, triton, fla; print(torch.__version__, transformers.__version__)"
    out = host.run(f"{venv(hostvars)}/bin/python -c '{code}'")
    assert out.rc == 0, f"imports failed: {out.stderr.strip().splitlines()[-1:]}"


# Run in the venv: which top-level packages have no bytecode, and which bytecode files of a package that no
# check imports (transformers' other models) are stale: they record a source mtime (or size) that is no longer
# the file's, so Python compiles the source again at each import it cannot write back.
BYTECODE_CHECK = r"""
import importlib.util as u, os, struct
missing = [m for m in ("torch", "transformers", "fla", "sympy", "dflash_trainer")
           if not os.path.exists(u.cache_from_source(u.find_spec(m).origin))]
stale = []
models = os.path.join(os.path.dirname(u.find_spec("transformers").origin), "models")
for root, _, files in os.walk(models):
    for name in files:
        if not name.endswith(".py"):
            continue
        src = os.path.join(root, name)
        pyc = u.cache_from_source(src)
        if not os.path.exists(pyc):
            continue
        with open(pyc, "rb") as f:
            flags, mtime, size = struct.unpack("<3I", f.read(16)[4:16])
        st = os.stat(src)
        if not flags & 1 and (mtime, size) != (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF):
            stale.append(os.path.relpath(src, models))
print(" ".join(missing))
print(len(stale), " ".join(sorted(stale)[:3]))
"""


def test_venv_holds_current_bytecode(host, hostvars: dict[str, Any]) -> None:
    """Without current .pyc files every start of the unit compiles torch, transformers and FLA from source,
    about 12 s of a warm restart (docs/container-layers.md#how-l3-works-and-when-an-l3-check-fails). Bytecode
    is stale when its sources' mtimes changed after compiling (an image packed with clamped mtimes)."""
    v = venv(hostvars)
    out = host.run(f"{v}/bin/python - <<'EOF'\n{BYTECODE_CHECK}\nEOF")
    assert out.rc == 0, f"bytecode check failed: {out.stderr.strip().splitlines()[-1:]}"
    missing, stale = out.stdout.split("\n")[:2]
    fix = f"fix: {v}/bin/python -m compileall -q --invalidation-mode checked-hash {v}/lib"
    assert not missing.strip(), (
        f"{v}: no compiled bytecode for {missing.strip()}: every start compiles them from source; was the "
        f"venv installed with PYTHONDONTWRITEBYTECODE set? ({fix})"
    )
    count, examples = stale.split(" ", 1) if " " in stale else (stale, "")
    assert count == "0", (
        f"{v}: {count} bytecode files of transformers/models are stale (their sources' mtimes changed after "
        f"compiling: an image packed with clamped mtimes?), e.g. {examples} ({fix})"
    )


def test_trainer_cli_answers(host, hostvars: dict[str, Any]) -> None:
    out = host.run(f"{venv(hostvars)}/bin/dflash-train --version")
    assert out.rc == 0, f"dflash-train --version failed: {(out.stderr or out.stdout).strip()[-200:]}"
    assert out.stdout.strip(), "dflash-train --version printed nothing"


@pytest.mark.parametrize(
    ("key", "env_name", "default"),
    [
        ("ct_triton_cache_dir", "TRITON_CACHE_DIR", "/var/cache/dflash-train/triton"),
        ("ct_inductor_cache_dir", "TORCHINDUCTOR_CACHE_DIR", "/var/cache/dflash-train/inductor"),
    ],
)
def test_compile_caches_persist(
    host, hostvars: dict[str, Any], key: str, env_name: str, default: str
) -> None:
    cache = var(hostvars, key, default)
    assert host.file(cache).is_directory, f"{cache} is missing"
    env = host.file(var(hostvars, "ct_env_file", "/etc/dflash/environment"))
    assert env.exists and f"{env_name}={cache}" in env.content_string, (
        f"{env_name} not in the environment file"
    )
    assert "TRITON_CACHE_AUTOTUNING=1" in env.content_string, (
        "TRITON_CACHE_AUTOTUNING=1 not in the environment file: FLA's autotuning would rerun at every start"
    )


def test_nvidia_userspace_matches_host_module(host, gpus: list[int]) -> None:
    module = host.run("cat /proc/driver/nvidia/version").stdout
    smi = host.run("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    assert smi.rc == 0, f"nvidia-smi failed in the CT: {smi.stderr.strip()[-200:]}"
    versions = set(smi.stdout.split())
    assert len(versions) == 1 and next(iter(versions)) in module, (
        f"userspace {versions} vs host module: {module!r}"
    )
    assert host.run("ls /lib/modules/*/kernel/drivers/video/nvidia*.ko 2>/dev/null").stdout == "", (
        "kernel module in CT"
    )


def test_every_gpu_visible(host, hostvars: dict[str, Any], gpus: list[int]) -> None:
    out = host.run(f"{venv(hostvars)}/bin/python -c 'import torch; print(torch.cuda.device_count())'")
    assert out.rc == 0, out.stderr.strip()[-200:]
    assert int(out.stdout.strip()) == len(gpus), (
        f"torch sees {out.stdout.strip()} GPUs, ct_gpus has {len(gpus)}"
    )


TRITON_KERNEL = """
import torch, triton, triton.language as tl
@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)
x = torch.arange(1000, device="cuda", dtype=torch.float32); o = torch.empty_like(x)
add[(4,)](x, x, o, 1000, BLOCK=256)
assert torch.equal(o, 2 * x); print("ok")
"""


def test_triton_kernel_compiles_and_runs(host, hostvars: dict[str, Any], gpus: list[int]) -> None:
    host.run(f"cat > /tmp/l3_triton.py <<'EOF'\n{TRITON_KERNEL}\nEOF")
    out = host.run(f"set -a; . /etc/dflash/environment; {venv(hostvars)}/bin/python /tmp/l3_triton.py")
    assert out.rc == 0 and out.stdout.strip().endswith("ok"), (
        f"Triton kernel failed: {out.stderr.strip()[-300:]}"
    )
