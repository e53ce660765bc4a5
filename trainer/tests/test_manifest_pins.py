"""The pin of a manifest (its sha256, from the inventory, written by L4 into the pins directory) is checked by
preflight: a model or shards directory whose manifest is not the pinned one fails in one line naming both
digests, even when the manifest matches its data (someone who could write the bucket rewrote both)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_operator_checks import manifested_config

from dflash_trainer.manifest import verify_manifest
from dflash_trainer.service import preflight


def pin(pins: Path, name: str, directory: Path) -> str:
    digest = hashlib.sha256((directory / "MANIFEST.json").read_bytes()).hexdigest()
    pins.mkdir(exist_ok=True)
    entry = {"directory": str(directory), "manifest": "MANIFEST.json", "sha256": digest}
    (pins / f"{name}.json").write_text(json.dumps(entry, indent=1) + "\n")
    return digest


def context(config: Path, pins: Path) -> preflight.Context:
    ctx = preflight.Context(config, 1, pins_dir=pins)
    preflight.check_config(ctx)
    return ctx


def rewrite_consistently(directory: Path) -> Path:
    """A data file swapped and the manifest rewritten to match it: the manifest alone cannot tell."""
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    entry = manifest["files"][0]
    data = bytearray((directory / entry["path"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (directory / entry["path"]).write_bytes(bytes(data))
    entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (directory / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return directory / "MANIFEST.json"


def test_pinned_manifests_pass_and_say_so(tmp_path: Path) -> None:
    config = manifested_config(tmp_path)
    pins = tmp_path / "pins"
    pin(pins, "model", tmp_path / "target")
    pin(pins, "shards", tmp_path / "shards")
    ctx = context(config, pins)
    assert preflight.check_model(ctx).endswith("; manifest sha256 as pinned")
    assert preflight.check_shards(ctx).endswith("; manifest sha256 as pinned")
    unpinned = context(config, tmp_path / "no-pins")
    assert preflight.check_shards(unpinned).endswith(
        f"manifest not pinned (no pin in {tmp_path / 'no-pins'})"
    )


@pytest.mark.parametrize(
    ("what", "directory", "check"), [("shards", "shards", "check_shards"), ("model", "target", "check_model")]
)
def test_a_manifest_that_is_not_the_pinned_one_fails(
    tmp_path: Path, what: str, directory: str, check: str
) -> None:
    config = manifested_config(tmp_path)
    pins = tmp_path / "pins"
    pinned = pin(pins, what, tmp_path / directory)
    manifest = rewrite_consistently(tmp_path / directory)
    actual = hashlib.sha256(manifest.read_bytes()).hexdigest()
    ctx = context(config, pins)
    assert verify_manifest(tmp_path / directory, full=True).ok  # the manifest alone vouches for the swap
    with pytest.raises(preflight.Failed) as e:
        getattr(preflight, check)(ctx)
    assert e.value.detail == (
        f"{what} {tmp_path / directory}: {manifest} sha256 {actual} is not the pinned {pinned} "
        f"({pins / (what + '.json')})"
    )
    assert e.value.fix.startswith("make provision TAGS=l4")


def test_the_cli_fails_on_a_pin_mismatch(tmp_path: Path, capsys, monkeypatch) -> None:
    config = manifested_config(tmp_path)
    pins = tmp_path / "pins"
    pin(pins, "shards", tmp_path / "shards")
    rewrite_consistently(tmp_path / "shards")
    monkeypatch.setenv("DFLASH_MANIFEST_PINS_DIR", str(pins))
    preflight.main([str(config)])
    err = capsys.readouterr().err
    assert "FAIL shards: shards " in err and "is not the pinned" in err
