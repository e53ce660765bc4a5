"""Shared fixtures: one thread (2 shared CPU cores), tiny targets written once per session, a tiny spec, the
benchmark scripts as modules."""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

torch.set_num_threads(1)

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The trainer/bench script the test module names in BENCH_SCRIPT, imported with its directory on sys.path
    while the module's tests run (a bench imports its siblings, some lazily)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        yield importlib.import_module(request.module.BENCH_SCRIPT)
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_target(kind) -> directory of a seed-0 tiny target of that kind, written on first use."""
    from dflash_trainer.fixtures.tiny import write_tiny_target

    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = write_tiny_target(tmp_path_factory.mktemp(f"tiny_{kind}"), kind=kind, seed=0)
        return cache[kind]

    return get


@pytest.fixture
def tiny_job(tiny_target, tmp_path: Path) -> Callable[..., Path]:
    """tiny_job(trackers={...}) -> the TOML of a TINY_JOB_STEPS-step single-rank CPU run on manifested tiny
    data (tiny_run.run_cli runs it)."""
    from tiny_run import TINY_JOB_STEPS, tiny_run_config

    from dflash_trainer.fixtures.synth import synth_shards
    from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID
    from dflash_trainer.manifest import write_manifest

    target = tmp_path / "target"
    shutil.copytree(tiny_target("qwen3_5"), target)
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=1, rows=8, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    write_manifest(target)
    write_manifest(shards)

    def make(**overrides: dict) -> Path:
        train = {
            "max_steps": TINY_JOB_STEPS,
            "checkpoint_dir": tmp_path / "ckpt",
            "log_every": 1,
            "keep_last": 1,
        } | overrides.pop("train", {})
        return tiny_run_config(tmp_path / "train.toml", target, shards, train=train, **overrides)

    return make


@pytest.fixture
def small_spec():
    """2-layer drafter for an 8-layer target; its sliding window (6) is shorter than the test contexts."""
    from dflash_trainer.model.drafter import DrafterSpec

    return DrafterSpec(
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        num_target_layers=8,
        target_layer_ids=[1, 5],
        block_size=4,
        mask_token_id=511,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
