"""Configuration: keys, types, ranges, combinations and agreement with the target's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_run import toml_text

from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.data.synth import write_shard

TARGET = {
    "num_hidden_layers": 64,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "vocab_size": 248320,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
}


def write_config(tmp_path: Path, sections: dict[str, dict], target: dict | None = None) -> Path:
    """A config with a fake target (config.json only) and one shard; `sections` override keys."""
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text(json.dumps({"text_config": target or TARGET}))
    (tmp_path / "shards").mkdir(exist_ok=True)
    write_shard(tmp_path / "shards" / "a.arrow", [([1, 2, 3], [0, 1, 1])])
    base = {
        "model": {"target_path": "target"},
        "drafter": {"mask_token_id": 248070},
        "data": {"shards": "shards"},
    }
    for name, table in sections.items():
        base.setdefault(name, {}).update(table)
    path = tmp_path / "train.toml"
    path.write_text(toml_text(base))
    return path


def error_of(tmp_path: Path, sections: dict, target: dict | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, sections, target))
    return str(e.value)


def test_defaults_resolve_against_the_target(tmp_path):
    cfg = load_config(write_config(tmp_path, {}))
    assert cfg.drafter.target_layer_ids == [1, 16, 31, 46, 61]
    assert cfg.drafter.gamma == 7.0
    assert cfg.drafter.hidden_size == 5120
    assert cfg.drafter.intermediate_size == 17408
    assert cfg.drafter.layer_types == ["full_attention"] * 5
    assert cfg.data.shards == (tmp_path / "shards").resolve()  # relative to the TOML file
    assert cfg.optim.lr == 6e-4 and cfg.data.max_anchors == 512 and cfg.optim.epochs == 6


@pytest.mark.parametrize(
    "sections", [{}, {"train": {"keep_last": 2}}], ids=["no [train]", "[train] without it"]
)
def test_the_default_checkpoint_dir_resolves_against_the_toml_not_the_cwd(tmp_path, monkeypatch, sections):
    """An unset train.checkpoint_dir is "checkpoints" beside the TOML, as a relative value would be: a unit's
    working directory (or a shell's) must not decide where the run's checkpoints go."""
    (tmp_path / "run").mkdir()
    config = write_config(tmp_path / "run", sections)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config(config).train.checkpoint_dir == (tmp_path / "run" / "checkpoints").resolve()


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"drafter": {"block_size": 1}}, "drafter.block_size: must be >= 2, got 1"),
        ({"drafter": {"blocksize": 16}}, "drafter.blocksize: unknown key"),
        ({"trainer": {"x": 1}}, "trainer: unknown section"),
        ({"drafter": {"block_size": "16"}}, "drafter.block_size: must be an integer, got '16'"),
        ({"drafter": {"block_size": True}}, "drafter.block_size: must be an integer"),
        ({"optim": {"lr": "fast"}}, "optim.lr: must be a number"),
        ({"train": {"compile": 1}}, "train.compile: must be true or false"),
        ({"train": {"dtype": "fp16"}}, 'train.dtype: must be "bfloat16" or "float32"'),
        ({"topology": {"targets": "many"}}, 'topology.targets: must be an integer or "auto"'),
        ({"topology": {"drafters": 0}}, "topology.drafters: must be >= 1"),
        ({"drafter": {"layer_types": ["full_attention", "global"]}}, "drafter.layer_types[1]: must be"),
        ({"drafter": {"hidden_size": 4096}}, "drafter.hidden_size: must equal the target's hidden size 5120"),
        ({"drafter": {"target_layer_ids": [1, 30, 64]}}, "drafter.target_layer_ids: layer 64 does not exist"),
        ({"drafter": {"target_layer_ids": [5, 3]}}, "drafter.target_layer_ids: must be strictly increasing"),
        ({"drafter": {"mask_token_id": 248320}}, "drafter.mask_token_id: must be a token id in [0, 248320)"),
        ({"drafter": {"block_size": 12}}, "drafter.gamma: no reference gamma for block_size 12"),
        (
            {"drafter": {"num_layers": 2, "layer_types": ["full_attention"]}},
            "drafter.layer_types: needs one entry",
        ),
        (
            {"drafter": {"num_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}},
            "drafter.sliding_window: required",
        ),
        ({"drafter": {"sliding_window": 2048}}, "drafter.sliding_window: set, but no entry"),
        (
            {"drafter": {"num_attention_heads": 32, "num_key_value_heads": 5}},
            "drafter.num_key_value_heads: must",
        ),
        (
            {"drafter": {"num_key_value_heads": 5}},
            "drafter.num_key_value_heads: must divide the 24 query heads",
        ),
        ({"data": {"seq_len": 16}}, "data.seq_len: must be >= 17"),
        ({"data": {"held_out": 0}}, "data.held_out: must be > 0 when train.eval_every is set"),
        ({"optim": {"warmup_ratio": 1.0}}, "optim.warmup_ratio: must be in [0, 1)"),
        ({"optim": {"betas": [0.9]}}, "optim.betas: must be two numbers"),
        ({"train": {"ema_decay": 1.0}}, "train.ema_decay: must be in (0, 1)"),
        ({"data": {"shards": "nowhere"}}, "data.shards: no such directory"),
        ({"model": {"target_path": "nowhere"}}, "model.target_path: no config.json in"),
    ],
)
def test_errors_name_the_key(tmp_path, sections, expected):
    assert expected in error_of(tmp_path, sections)


def test_required_keys(tmp_path):
    path = write_config(tmp_path, {})
    path.write_text(path.read_text().replace("mask_token_id = 248070\n", ""))
    with pytest.raises(ConfigError, match=r"^drafter.mask_token_id: required$"):
        load_config(path)


def test_more_context_layers_than_a_shallow_target_has(tmp_path):
    shallow = {**TARGET, "num_hidden_layers": 6}
    assert "drafter.num_layers: 5 context layers spread over a 6-layer target repeat layers" in error_of(
        tmp_path, {}, shallow
    )
    assert "drafter.target_layer_ids: 7 layers, more than the target's 6" in error_of(
        tmp_path, {"drafter": {"target_layer_ids": [0, 1, 2, 3, 4, 5, 6]}}, shallow
    )


def test_check_paths_false_reads_neither_target_nor_shards(tmp_path):
    cfg = load_config(write_config(tmp_path, {"model": {"target_path": "/nonexistent"}}), check_paths=False)
    assert cfg.drafter.target_layer_ids is None and cfg.drafter.gamma == 7.0


def test_shipped_configs_parse():
    configs = Path(__file__).parents[1] / "configs"
    for name in ("lab.toml", "reference.toml"):
        cfg = load_config(configs / name, check_paths=False)
        assert cfg.to_dict()["drafter"]["block_size"] >= 2
