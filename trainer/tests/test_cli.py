"""`dflash-train`: subcommands, one-line user errors, manifest, export wiring."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
from test_config import write_config

from dflash_trainer import __version__
from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dflash-train {__version__}"


def test_config_show_prints_the_effective_config_in_both_formats(tmp_path, capsys):
    path = write_config(tmp_path, {"optim": {"lr": 1e-3}})
    code, out, _ = run(capsys, "config", "show", str(path))
    assert code == 0
    shown = tomllib.loads(out)
    assert shown == load_config(path).to_dict()
    assert shown["drafter"]["target_layer_ids"] == [1, 16, 31, 46, 61] and shown["optim"]["lr"] == 1e-3
    code, out, _ = run(capsys, "config", "show", str(path), "--format", "json")
    assert code == 0 and json.loads(out) == shown


def test_user_errors_are_one_line(tmp_path, capsys):
    path = write_config(tmp_path, {"drafter": {"block_size": 1}})
    code, out, err = run(capsys, "config", "show", str(path))
    assert code == 1 and out == ""
    assert err == "dflash-train config: drafter.block_size: must be >= 2, got 1\n"
    code, _, err = run(capsys, "train", str(tmp_path / "missing.toml"))
    assert code == 1 and err.count("\n") == 1 and "missing.toml: no such file" in err
    code, _, err = run(capsys, "export", str(tmp_path), str(tmp_path / "out"))
    assert code == 1 and "neither a checkpoint nor a directory holding checkpoints" in err


def test_preflight_passes_its_arguments_through(capsys, tmp_path):
    missing = tmp_path / "nope.toml"
    code, out, err = run(capsys, "preflight", str(missing))
    assert code == 1
    assert f"FAIL config: {missing}: no such file" in out + err


def test_plan_needs_a_gpu_count(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan"])
    assert e.value.code == 2
    assert "the following arguments are required: gpus" in capsys.readouterr().err


def test_manifest_write_and_check(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(b"abc")
    (data / "sub" / "b.bin").write_bytes(b"defg")
    assert run(capsys, "manifest", str(data))[0] == 0
    entries = json.loads((data / "MANIFEST.json").read_text())["files"]
    assert [(e["path"], e["size"]) for e in entries] == [("a.bin", 3), ("sub/b.bin", 4)]
    assert run(capsys, "manifest", str(data), "--check")[0] == 0
    (data / "a.bin").write_bytes(b"xyz")  # same size: only --full sees it
    assert run(capsys, "manifest", str(data), "--check")[0] == 0
    code, _, err = run(capsys, "manifest", str(data), "--check", "--full")
    assert code == 1 and "a.bin: sha256 differs" in err
    (data / "sub" / "b.bin").unlink()
    code, _, err = run(capsys, "manifest", str(data), "--check")
    assert code == 1 and "sub/b.bin: missing" in err


def test_tiny_synth_train_export(tmp_path, capsys):
    target, shards = tmp_path / "target", tmp_path / "shards"
    assert run(capsys, "model", "tiny", str(target), "--seed", "1")[0] == 0
    synth = ["data", "synth", "--target", str(target), "--out", str(shards), "--shards", "1", "--rows", "6"]
    code, out, _ = run(capsys, *synth, "--seq-len", "20", "--vocab-size", str(TINY_MASK_TOKEN_ID))
    assert code == 0 and "wrote 1 shards of 6 rows" in out
    (tmp_path / "train.toml").write_text(f"""
[model]
target_path = "target"
[drafter]
num_layers = 1
block_size = 4
gamma = 4.0
mask_token_id = {TINY_MASK_TOKEN_ID}
[data]
shards = "shards"
seq_len = 20
max_anchors = 2
held_out = 2
[optim]
batch = 2
[train]
checkpoint_dir = "ckpt"
eval_every = 0
device = "cpu"
""")
    code, out, _ = run(capsys, "train", str(tmp_path / "train.toml"), "--max-steps", "2")
    assert code == 0 and "step 2; checkpoint" in out and "(stopped)" not in out
    for source in ("ema", "weights"):
        out_dir = tmp_path / f"export-{source}"
        code, out, _ = run(capsys, "export", str(tmp_path / "ckpt"), str(out_dir), "--from", source)
        assert code == 0 and f"({source})" in out
        diff = float(out.rsplit(" ", 1)[1])
        assert diff < 0.1  # bf16 rounding only
    code, out, _ = run(
        capsys, "export", "--check", str(tmp_path / "export-ema"), "--against", str(tmp_path / "ckpt")
    )
    assert code == 0 and "loads as a 1-layer DFlash drafter" in out
    weights = torch.load(tmp_path / "ckpt" / "step-00000002" / "state.pt", weights_only=True)["trainer"][
        "drafter"
    ]
    assert "fc.weight" in weights
    code, _, err = run(capsys, "export", "--check", str(tmp_path / "ckpt"))
    assert code == 1 and "not a loadable draft model" in err
