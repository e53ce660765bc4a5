"""config.py owns the configuration on both sides of the seam: the rank count, overlays, the one TOML writer
and the keys typed as paths. The Ansible filter that renders the deployed train.toml loads the same file and
reports the trainer's own ConfigError; the operator harnesses (smoke, rehearse) read values through the
loader, so a relative path resolves against the TOML file's directory, as in a run."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from test_config import write_config

from dflash_trainer import config as trainer_config
from dflash_trainer.config import (
    ConfigError,
    TopologyConfig,
    TrainConfig,
    check_tables,
    load_config,
    overlay,
    parse_config,
    path_keys,
    read_toml,
    to_toml,
)

REPO = Path(__file__).resolve().parents[2]
FILTER = REPO / "roles/trainer_service/filter_plugins/dflash_train_config.py"
REFERENCE = REPO / "trainer/configs/reference.toml"


def load_filter() -> Any:
    spec = importlib.util.spec_from_file_location("dflash_train_config_under_test", FILTER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the rank count ----


def test_the_rank_count_is_the_sum_of_named_sides_and_unknown_while_one_is_auto() -> None:
    assert TopologyConfig(4, 4).ranks == 8
    assert TopologyConfig(5, 3).ranks == 8
    assert TopologyConfig("auto", 4).ranks is None and TopologyConfig().ranks is None
    assert load_config(REFERENCE, check_paths=False).topology.ranks == 8


# ---- the one writer ----


@pytest.mark.parametrize("path", sorted((REPO / "trainer/configs").glob("*.toml")), ids=lambda p: p.name)
def test_the_writer_round_trips_every_shipped_config(path: Path) -> None:
    tables = read_toml(path)
    assert tomllib.loads(to_toml(tables)) == tables
    assert load_filter().to_toml(tables) == to_toml(tables)  # the deployed train.toml: the same writer


def test_the_command_line_and_the_filter_use_the_config_modules_writer() -> None:
    from dflash_trainer import cli

    assert cli.to_toml is trainer_config.to_toml
    assert load_filter().config.to_toml.__code__.co_filename == trainer_config.__file__


# ---- overlays ----


def test_an_overlay_replaces_keys_table_by_key_and_none_removes_one() -> None:
    base = {"drafter": {"num_layers": 5, "head_dim": 128}, "train": {"keep_last": 3}}
    out = overlay(base, {"drafter": {"num_layers": 2, "head_dim": None}}, None, {"topology": {"targets": 1}})
    assert out == {"drafter": {"num_layers": 2}, "train": {"keep_last": 3}, "topology": {"targets": 1}}
    assert base["drafter"] == {"num_layers": 5, "head_dim": 128}  # the input is left as it was
    with pytest.raises(ConfigError, match=r"^drafter: an overlay gives a table of keys, got 3$"):
        overlay(base, {"drafter": 3})


# ---- the keys typed as paths ----


def _keys_that_become_paths() -> set[str]:
    """Every key whose relative string value the parser turns into a path: found by trying each field."""
    found = set()
    required = {"model": {"target_path": "/t"}, "drafter": {"mask_token_id": 1}, "data": {"shards": "/s"}}
    for section in dataclasses.fields(TrainConfig):
        cls = typing.get_type_hints(TrainConfig)[section.name]
        for f in dataclasses.fields(cls):
            table = overlay(required, {section.name: {f.name: "relative/x"}})
            try:
                cfg = parse_config(table, base=Path("/base"))
            except ConfigError:
                continue
            if getattr(getattr(cfg, section.name), f.name) == Path("/base/relative/x"):
                found.add(f"{section.name}.{f.name}")
    return found


def test_path_keys_are_every_field_the_loader_resolves_as_a_path() -> None:
    assert set(path_keys()) == _keys_that_become_paths()
    assert {"model.target_path", "data.shards", "train.checkpoint_dir", "trackers.tensorboard"} <= set(
        path_keys()
    )


# ---- the filter reports the trainer's ConfigError ----


@pytest.mark.parametrize(
    "override",
    [
        {"topology": {"targets": 0}},
        {"drafter": {"num_layer": 2}},
        {"optim": {"lr": "fast"}},
        {"nonsense": {"k": 1}},
    ],
    ids=["targets-0", "unknown-key", "wrong-type", "unknown-section"],
)
def test_the_filter_reports_the_trainers_own_error_naming_the_key(override: dict) -> None:
    render = load_filter()
    tables = render.merge(REFERENCE.read_text(), override)
    with pytest.raises(ConfigError) as trainer_error:
        check_tables(tables, base=REFERENCE.parent)
    [problem] = render.rank_problems(tables, list(range(8)))
    assert (
        problem
        == f"train.toml (trainer/configs/reference.toml + trainer_service_config): {trainer_error.value}"
    )
    with pytest.raises(ValueError, match=str(trainer_error.value).replace("(", r"\(").replace(")", r"\)")):
        render.ranks(tables)


def test_the_filter_refuses_a_relative_path_in_a_deployed_configuration() -> None:
    render = load_filter()
    tables = render.merge(REFERENCE.read_text(), {"trackers": {"tensorboard": "tb"}})
    [problem] = render.rank_problems(tables, list(range(8)))
    assert problem.endswith(
        "trackers.tensorboard: 'tb' is relative: a deployed configuration names absolute paths"
    )


def test_the_filter_loads_on_a_controller_without_the_trainer_package_or_torch(tmp_path: Path) -> None:
    """What Ansible's venv has: the standard library and tomli-w (no torch, no dflash_trainer on sys.path)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('f', {str(FILTER)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(m.ranks(m.merge(open({str(REFERENCE)!r}).read())))\n"
        "assert 'torch' not in sys.modules and 'dflash_trainer' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "8"


# ---- the harnesses read through the loader ----


def test_rehearse_finds_checkpoints_of_a_relative_checkpoint_dir_beside_its_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_trainer.service.rehearse import _newest_checkpoint_step

    config = write_config(tmp_path, {"train": {"checkpoint_dir": "ckpts"}})
    (tmp_path / "ckpts" / "step-00000007").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the loader resolves against the TOML's directory, not the working one
    assert _newest_checkpoint_step(config) == 7


def test_smoke_prepare_takes_the_loaders_values_and_absolute_paths(tmp_path: Path) -> None:
    from dflash_trainer.service.smoke import prepare

    # No eval_walk_prompts: the trainer's default (8 prompts) applies, and the smoke run shortens it as well.
    config = write_config(tmp_path, {"trackers": {"wandb_project": "team"}})
    smoke = tomllib.loads(prepare(config, tmp_path / "dflash-smoke.abc", steps=20, stop_at=10).read_text())
    assert smoke["model"]["target_path"] == str((tmp_path / "target").resolve())
    assert smoke["data"]["shards"] == str((tmp_path / "shards").resolve())
    assert smoke["train"]["eval_walk_prompts"] == 1 and smoke["train"]["eval_every"] == 20
    assert smoke["trackers"] == {"tensorboard": str(tmp_path / "dflash-smoke.abc" / "tensorboard")}
    load_config(tmp_path / "dflash-smoke.abc" / "smoke.toml")  # what serve will read


def test_smoke_prepare_refuses_a_bad_config_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from dflash_trainer.service.smoke import main

    config = write_config(tmp_path, {"topology": {"targets": 0}})
    assert main(["prepare", str(config), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == "dflash-train smoke prepare: topology.targets: must be >= 1, got 0\n"


def test_rehearse_writes_its_config_with_the_overlay_and_the_writer(tmp_path: Path) -> None:
    from dflash_trainer.service.rehearse import write_config as rehearsal_config

    path = rehearsal_config(
        REFERENCE,
        tmp_path,
        target=tmp_path / "t",
        shards=tmp_path / "s",
        world=1,
        overrides={"train.keep_last": 1, "optim.lr": 1e-3},
    )
    tables = tomllib.loads(path.read_text())
    assert tables["topology"] == {} and tables["train"]["keep_last"] == 1 and tables["optim"]["lr"] == 1e-3
    assert tables["data"]["held_out"] == 8 and tables["model"]["target_path"] == str(tmp_path / "t")
    assert load_config(path, check_paths=False).topology.ranks is None  # one rank: both sides "auto"


def test_a_rank_refuses_a_topology_for_another_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_trainer.distributed.rank import RankOptions, run_rank
    from dflash_trainer.distributed.topology import Topology

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="the topology given has 3 ranks, the launched world 2"):
        run_rank(None, RankOptions(cpu=True), None, Topology(2, 1))
