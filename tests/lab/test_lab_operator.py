"""What an operator sees of the lab: `make lab-status` names PIDs, long phases print progress, the seed is
deterministic from lab_seed, holds no mask token, and is made in well under a minute."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from lab import cli, progress, seed
from lab.settings import REPO, load_settings

SETTINGS = load_settings(REPO / "inventory" / "lab")
TRAINER_PY = REPO / ".venv-trainer" / "bin" / "python"


def test_heartbeat_prints_while_a_phase_runs() -> None:
    out = io.StringIO()
    with redirect_stdout(out), progress.heartbeat("building a thing", every=0.2):
        time.sleep(0.7)
    lines = out.getvalue().splitlines()
    assert lines[0] == "lab: building a thing: still running (0 s)"
    assert len([line for line in lines if "still running" in line]) >= 2
    assert lines[-1] == "lab: building a thing: done in 1 s"


class _YieldingStdout(io.StringIO):
    """A stdout that lets other threads run inside every write, as a pipe's flush does."""

    def write(self, text: str) -> int:
        n = super().write(text)
        time.sleep(0)
        return n


def test_lines_printed_side_by_side_stay_whole() -> None:
    """The image build, mmdebstrap, the seeding and their heartbeats print from parallel threads; a first
    `make smoke-train` showed "...cpu.loglab: building the bookworm root filesystem" (print() writes the text
    and its newline apart)."""
    out = _YieldingStdout()
    lines = {f"lab: thread {t} line {i}" for t in range(3) for i in range(100)}

    def speak(t: int) -> None:
        for i in range(100):
            progress.say(f"lab: thread {t} line {i}")

    with redirect_stdout(out):
        threads = [threading.Thread(target=speak, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(out.getvalue().splitlines()) == sorted(lines)


def test_status_shows_pids() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lab", "status"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    rows = {line.split()[0] + " " + line.split()[1]: line for line in proc.stdout.splitlines()}
    for spec in SETTINGS.containers:
        assert "init PID " in rows[f"container {spec.name}"], proc.stdout
    for name in ("fakepve", "s3"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        pid = int(row.rsplit("PID ", 1)[1].split()[0])
        assert Path(f"/proc/{pid}").exists(), row


@pytest.mark.parametrize("inventory", ["lab", "lab-multinode"])
def test_status_names_each_file_the_inventory_reads_that_the_lab_has_not_written(tmp_path, inventory) -> None:
    """A lab that stopped halfway (`make lab` failed before writing its secrets) is said down by name, not
    by Ansible's "file not found" when provisioning reads the variable (lab-multinode's group_vars are
    symlinks to lab's)."""
    settings = dataclasses.replace(load_settings(REPO / "inventory" / inventory), lab_dir=tmp_path)
    wanted = [str(path.relative_to(tmp_path)) for path in cli.inventory_files(settings)]
    assert sorted(wanted) == [
        "digests/model_manifest_sha256",
        "digests/shards_manifest_sha256",
        "secrets/pve_password",
        "secrets/s3_access_key_id",
        "secrets/s3_secret_access_key",
    ]
    for rel in wanted[:-1]:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x")
    name, up, detail = cli.inventory_files_row(settings)
    assert (name, up) == ("inventory's files", False)
    assert detail == f"missing under {tmp_path}: {wanted[-1]} (make lab writes them)"
    (tmp_path / wanted[-1]).write_text("x")
    assert cli.inventory_files_row(settings)[1:] == (True, f"5 files under {tmp_path} (secrets, digests)")


@pytest.fixture(scope="module")
def scratch_seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, str]:
    """The lab's seed made again in a scratch directory as `make lab` makes it: (dir, seconds, output)."""
    out = tmp_path_factory.mktemp("seed")
    start = time.monotonic()
    proc = subprocess.run(
        [
            str(TRAINER_PY),
            "-m",
            "lab.seed_trainer",
            str(out / "model"),
            str(out / "shards"),
            str(SETTINGS.seed),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO / "trainer" / "src"),
        },
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, time.monotonic() - start, proc.stdout


def test_seed_is_deterministic_from_lab_seed(scratch_seed) -> None:
    """The scratch seed is byte for byte the lab's (the same manifest: sizes and sha256 of every file)."""
    out, _, _ = scratch_seed
    model, shards = seed.seed_dirs(SETTINGS)
    if not shards.exists():
        pytest.skip(f"{shards} does not exist (run make lab)")
    for mine, labs in ((out / "model", model), (out / "shards", shards)):
        assert json.loads((mine / "MANIFEST.json").read_text()) == json.loads(
            (labs / "MANIFEST.json").read_text()
        )


def test_seed_holds_no_mask_token_and_says_how_far_it_is(scratch_seed) -> None:
    out, seconds, stdout = scratch_seed
    code = (
        "import sys, glob, pyarrow as pa, numpy as np\n"
        "ids = np.concatenate([np.asarray(r) for f in sorted(glob.glob(sys.argv[1] + '/*.arrow'))\n"
        "    for r in pa.ipc.open_file(pa.memory_map(f, 'r')).read_all().column('input_ids').to_pylist()])\n"
        "print(ids.size, int(ids.max()))\n"
    )
    proc = subprocess.run(
        [str(TRAINER_PY), "-c", code, str(out / "shards")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "trainer" / "src")},
    )
    size, top = map(int, proc.stdout.split())
    # The tiny target's mask token is its last id (dflash_trainer.fixtures.tiny.TINY_MASK_TOKEN_ID).
    mask = json.loads((out / "model" / "config.json").read_text())["vocab_size"] - 1
    assert size == seed.NUM_SHARDS * 64 * 64
    assert top < mask
    assert [line for line in stdout.splitlines() if "shard 4/4 written" in line]
    # About 15 s on 2 cores under load; the bound leaves room for a loaded machine and fails a seed that
    # takes minutes.
    assert seconds < 120, f"seeding took {seconds:.0f} s"


def test_multinode_lab_binds_one_shared_storage_into_the_host_and_both_cts() -> None:
    """inventory/lab-multinode: lab-host mounts the lab's shared storage where PVE mounts a storage, and each
    CT's ct_mount_points entry (what roles/pve_container sets as mp0) is bound from that one directory."""
    settings = load_settings(REPO / "inventory" / "lab-multinode")
    storage = settings.shared_storage_dir
    binds = {spec.name: spec.binds for spec in settings.containers}
    assert binds["lab-host"] == ((storage, "/mnt/pve/dflash-shared"),)
    assert binds["lab-ct201"] == binds["lab-ct202"] == ((storage, "/mnt/dflash-shared"),)
    assert all(spec.binds == () or spec.role == "host" for spec in SETTINGS.containers)


@pytest.mark.parametrize(
    "entry",
    [
        {"host_path": "/srv/elsewhere", "path": "/mnt/x"},
        {"host_path": "/mnt/pve/dflash-shared/../x", "path": "/mnt/x"},
        {"host_path": "/mnt/pve/dflash-shared", "path": "mnt/x"},
        {"path": "/mnt/x"},
    ],
)
def test_a_mount_point_the_lab_cannot_bind_is_named(entry: dict) -> None:
    from lab.errors import LabError
    from lab.settings import mount_point_binds

    with pytest.raises(LabError, match=r"lab-ct9: ct_mount_points entry .* lab_shared_storage_host_path"):
        mount_point_binds("lab-ct9", [entry], Path("/x"), "/mnt/pve/dflash-shared", Path("inv"))
