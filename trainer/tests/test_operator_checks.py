"""What the operator reads: preflight says what it compared (sizes or sha256) and --full finds a flipped byte,
the disk check prints figures in units that show them, a tensorboard directory that cannot be created warns,
a tracker that cannot reach its server does not hold the run back, and `train` rejects a bad config before
torch loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
from test_config import write_config

from dflash_trainer.manifest import human_bytes, verify_manifest, write_manifest
from dflash_trainer.service import preflight, trackers


def flip_byte(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def manifested_config(tmp_path: Path, sections: dict | None = None) -> Path:
    path = write_config(tmp_path, sections or {})
    write_manifest(tmp_path / "target")
    write_manifest(tmp_path / "shards")
    return path


def context(path: Path, *, full: bool = False) -> preflight.Context:
    ctx = preflight.Context(path, 1, full=full)
    preflight.check_config(ctx)
    return ctx


def test_manifest_check_says_what_it_compared(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 3000)
    write_manifest(tmp_path)
    flip_byte(tmp_path / "a.bin", 1500)
    sizes = verify_manifest(tmp_path)
    assert sizes.ok and not sizes.hashed
    assert sizes.compared == "sizes of 1 files, contents not hashed (--full hashes them)"
    full = verify_manifest(tmp_path, full=True)
    assert full.problems == ["a.bin: sha256 differs from the manifest"]
    assert full.compared.startswith("sha256 of 1 files, 2.9 KiB in ")


def test_preflight_names_sizes_and_full_hashes_a_flipped_shard(tmp_path):
    path = manifested_config(tmp_path)
    shard = tmp_path / "shards" / "a.arrow"
    flip_byte(shard, shard.stat().st_size // 2)  # inside the data: the Arrow footer still opens

    ctx = context(path)
    assert "; manifest matched: sizes of 1 files, contents not hashed" in preflight.check_model(ctx)
    detail = preflight.check_shards(ctx)
    assert detail.startswith(f"{tmp_path / 'shards'}: 1 shards open; manifest matched: sizes of 1 files")

    ctx = context(path, full=True)
    assert "; manifest matched: sha256 of 1 files, " in preflight.check_model(ctx)
    with pytest.raises(preflight.Failed) as e:
        preflight.check_shards(ctx)
    assert e.value.detail == (
        f"shards {tmp_path / 'shards'}: a.arrow: sha256 differs from the manifest (sha256 and sizes compared)"
    )
    assert "make provision TAGS=l4" in e.value.fix


def test_preflight_cli_takes_full(tmp_path, capsys):
    path = manifested_config(tmp_path)
    flip_byte(tmp_path / "shards" / "a.arrow", (tmp_path / "shards" / "a.arrow").stat().st_size // 2)
    preflight.main([str(path)])
    out = capsys.readouterr()
    assert "ok   shards:" in out.out and "manifest matched: sizes of 1 files" in out.out
    assert preflight.main([str(path), "--full"]) == 1
    out = capsys.readouterr()
    assert "FAIL shards:" in out.err and "a.arrow: sha256 differs from the manifest" in out.err


def test_disk_full_prints_figures_not_zeros(tmp_path, monkeypatch):
    path = manifested_config(tmp_path, {"train": {"checkpoint_dir": str(tmp_path / "ckpt"), "keep_last": 3}})
    (tmp_path / "ckpt" / "step-00000010").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-00000010" / "state.pt").write_bytes(b"x" * 700_000)
    ctx = context(path)
    preflight.check_model(ctx)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _p: Usage(10 << 30, 10 << 30, 12_000))
    with pytest.raises(preflight.Failed) as e:
        preflight.check_disk(ctx)
    per = preflight.drafter_param_count(ctx.need_cfg()) * 16
    detail = e.value.detail
    assert "0.0 GiB" not in detail and "0.00 GiB" not in detail
    assert f"{human_bytes(12_000)} free on " in detail and human_bytes(12_000) == "11.7 KiB"
    assert f"4 checkpoints of about {human_bytes(per)} need {human_bytes(4 * per)}" in detail
    assert "the checkpoints already there hold 683.6 KiB" in detail
    assert e.value.fix.startswith(f"free {human_bytes(4 * per - 12_000)} or more on ")
    assert "train.keep_last" in e.value.fix


def test_tensorboard_directory_that_cannot_be_created_warns(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    path = manifested_config(tmp_path, {"trackers": {"tensorboard": str(blocker / "tb")}})
    ctx = context(path)
    with pytest.raises(preflight.Warned) as e:  # a tracker never stops training
        preflight.check_trackers(ctx)
    assert e.value.detail.startswith(f"tracker tensorboard: trackers.tensorboard {blocker / 'tb'}: cannot be")
    ok_dir = tmp_path / "new" / "tb"
    path = manifested_config(tmp_path, {"trackers": {"tensorboard": str(ok_dir)}})
    assert "tensorboard: import, API and an offline start OK" in preflight.check_trackers(context(path))
    assert not (tmp_path / "new").exists()  # the probe removed what it made


class SlowTracker:
    name = "slow"

    def __init__(self, gate) -> None:
        gate.wait(30)
        self.logged: list[tuple[int, dict]] = []

    def log(self, step, values) -> None:
        self.logged.append((step, dict(values)))

    def close(self) -> None:
        pass


def test_a_slow_tracker_starts_in_the_background_and_catches_up():
    import threading

    gate = threading.Event()
    started = time.monotonic()
    safe = trackers.SafeTracker.starting("slow", lambda: SlowTracker(gate))
    # Blocking would take the gate's 30 s; 10 s of slack for a loaded CI machine, not a speed goal.
    assert not safe.wait(0.2) and time.monotonic() - started < 10
    safe.log(1, {"loss": 2.0})
    safe.log(2, {"loss": 1.5})
    gate.set()
    assert safe.wait(5)
    safe.log(3, {"loss": 1.0})
    assert [s for s, _ in safe.tracker.logged] == [1, 2, 3] and safe.failed is None


@pytest.mark.system
def test_unreachable_wandb_does_not_hold_the_start_and_prints_nothing(tmp_path):
    """wandb online against a closed port: start_trackers returns within its bounded wait, and wandb itself
    writes nothing to stdout or stderr (only our own log lines)."""
    script = f"""
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="OURS %(message)s")
from dflash_trainer.config import parse_config
from dflash_trainer.service import trackers
cfg = parse_config({{"model": {{"target_path": "/x"}}, "drafter": {{"mask_token_id": 1}},
    "data": {{"shards": "/y"}}, "train": {{"checkpoint_dir": "{tmp_path}/ckpt"}},
    "trackers": {{"wandb_project": "p"}}}}, base=Path("/"))
t0 = time.monotonic()
ts = trackers.start_trackers(cfg)
print("OURS returned", round(time.monotonic() - t0, 1), flush=True)
ts[0].log(1, {{"x": 1.0}})
"""
    env = {
        **os.environ,
        "WANDB_API_KEY": "a" * 40,
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    returned = [float(line.split()[-1]) for line in lines if line.startswith("OURS returned")]
    assert returned and returned[0] <= trackers.START_WAIT_S + 1, lines
    assert all(line.startswith("OURS ") for line in lines), lines


def test_train_rejects_a_bad_config_before_torch_loads(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\ntarget_path = "/x"\n[bogus]\na = 1\n')
    code = "import sys; from dflash_trainer.cli import main; rc = main(sys.argv[1:]); "
    code += "print('torch' in sys.modules, 'fla' in sys.modules); sys.exit(rc)"
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "dflash-train train: bogus: unknown section "
        "(known: model, drafter, data, optim, train, topology, trackers, service)"
    )
    assert proc.stdout.strip() == "False False"


def test_missing_config_fix_names_no_key(tmp_path):
    ctx = preflight.Context(tmp_path / "nope.toml", 1)
    with pytest.raises(preflight.Failed) as e:
        preflight.check_config(ctx)
    assert e.value.detail == f"{tmp_path / 'nope.toml'}: no such file"
    assert "the key named" not in e.value.fix and "trainer_service_config_path" in e.value.fix


def test_fla_cpu_warning_is_silenced_without_a_gpu():
    if any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("an NVIDIA device is present: there the warning applies and stays")
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import dflash_trainer, fla"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Triton is not supported" not in proc.stderr


def test_smoke_prepare_removes_earlier_runs_only(tmp_path):
    from dflash_trainer.service import smoke

    (tmp_path / "cfg").mkdir()
    config = manifested_config(tmp_path / "cfg")
    base = tmp_path / "var-tmp"
    old = base / "dflash-smoke.aaaaaa"
    (old / "checkpoints" / "step-00000030").mkdir(parents=True)
    (old / "smoke.toml").write_text("# an earlier run\n")
    stranger = base / "dflash-smoke.notours"  # no smoke.toml: not a smoke run's work directory
    stranger.mkdir(parents=True)
    out = base / "dflash-smoke.bbbbbb"
    out.mkdir()
    smoke.prepare(config, out, steps=10, stop_at=5)
    assert not old.exists() and stranger.is_dir() and (out / "smoke.toml").is_file()


def test_synthetic_data_never_holds_the_mask_token(tmp_path):
    """The lab seeds with vocab_size = the mask id: prompts AND the target's greedy continuation stay below it
    (unsuppressed, the continuation picks the mask id 11 times in 8192 tokens of the lab's seed)."""
    import numpy as np
    import pyarrow as pa

    from dflash_trainer.fixtures.synth import synth_shards
    from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID, write_tiny_target

    # The lab's target (seed 1234): its greedy continuation of these prompts picks the mask id if let.
    target = write_tiny_target(tmp_path / "target", kind="qwen3_5", seed=1234)
    (path,) = synth_shards(
        target,
        tmp_path / "shards",
        num_shards=1,
        rows=64,
        seq_len=24,
        prompt_len=8,
        seed=1234,
        batch=64,
        vocab_size=TINY_MASK_TOKEN_ID,
    )
    table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    ids = np.concatenate([np.asarray(row) for row in table.column("input_ids").to_pylist()])
    assert ids.size == 64 * 24 and ids.max() < TINY_MASK_TOKEN_ID


def caches_check(tmp_path: Path, monkeypatch, env: dict[str, str], *, compile: bool = True) -> str:
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "DFLASH_PROBE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    ctx = context(write_config(tmp_path, {"train": {"compile": compile}}))
    return preflight.check_caches(ctx)


def test_caches_check_says_warm_or_empty_and_names_each_directory(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    env = {
        "XDG_CACHE_HOME": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }
    empty = caches_check(tmp_path, monkeypatch, env)
    assert empty == (
        f"empty: this start compiles every kernel (a minute or more on a GPU): inductor {cache}/inductor "
        f"(0 files), triton {cache}/triton (0 files); probe verdicts "
        f"{cache}/dflash-preflight/probe-verdicts.json (none kept)"
    )
    for name, count in (("triton", 3), ("inductor", 2)):
        (cache / name / "sub").mkdir(parents=True)
        for i in range(count):
            (cache / name / "sub" / f"k{i}").write_text("x")
    (cache / "dflash-preflight").mkdir()
    (cache / "dflash-preflight" / "probe-verdicts.json").write_text("{}")
    warm = caches_check(tmp_path, monkeypatch, env)
    assert warm.startswith(f"warm: inductor {cache}/inductor (2 files), triton {cache}/triton (3 files); ")
    assert warm.endswith("probe-verdicts.json (kept)")
    shutil.rmtree(cache / "inductor")
    assert caches_check(tmp_path, monkeypatch, env).startswith("partly warm: inductor")


def test_caches_unset_warn_where_a_start_compiles_and_skip_where_nothing_does(tmp_path, monkeypatch):
    with pytest.raises(preflight.Warned) as warned:
        caches_check(tmp_path, monkeypatch, {})
    assert "TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR unset" in warned.value.detail
    assert "dflash-smoke" in warned.value.fix
    with pytest.raises(preflight.Skipped, match=r"nothing is compiled on CPU without train\.compile"):
        caches_check(tmp_path, monkeypatch, {}, compile=False)
    cache = tmp_path / "c"
    with pytest.raises(preflight.Skipped, match=f"triton {cache}/t \\(0 files\\)"):
        caches_check(tmp_path, monkeypatch, {"TRITON_CACHE_DIR": str(cache / "t")}, compile=False)
