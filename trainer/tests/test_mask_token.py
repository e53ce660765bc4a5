"""Preflight's mask-token check against the target's own tokenizer files (service/mask_token.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from dflash_trainer.service.mask_token import MaskTokenError, check_mask_token_id


def qwen_like(tmp_path: Path) -> Path:
    """The layout of a Qwen3.x checkpoint's tokenizer files, shrunk: BPE vocabulary, added special tokens
    (one a reserved mask), an added non-special one (<think>), vocab_size padded past the tokenizer."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 16}))
    added = [
        {"id": 10, "content": "<|endoftext|>", "special": True},
        {"id": 11, "content": "<think>", "special": False},
        {"id": 12, "content": "<|mask|>", "special": True},
    ]
    vocab = {t: i for i, t in enumerate("abcdefghij")}
    (target / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": added}))
    decoder = {str(a["id"]): {"content": a["content"], "special": a["special"]} for a in added}
    (target / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return target


def test_a_reserved_special_token_or_an_unused_id_passes(tmp_path: Path) -> None:
    target = qwen_like(tmp_path)
    assert "'<|mask|>', a special token" in check_mask_token_id(target, 12, 16)
    assert "an unused id" in check_mask_token_id(target, 14, 16)  # embedding padding past the tokenizer


@pytest.mark.parametrize(
    ("mask_id", "names"),
    [(3, ["3 is the ordinary token 'd'", "tokenizer.json"]), (11, ["11 is the ordinary token '<think>'"])],
)
def test_an_ordinary_token_is_refused_naming_both(tmp_path: Path, mask_id: int, names: list[str]) -> None:
    with pytest.raises(MaskTokenError) as err:
        check_mask_token_id(qwen_like(tmp_path), mask_id, 16)
    assert all(n in str(err.value) for n in names), err.value


def test_an_id_outside_the_vocabulary_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(MaskTokenError, match=r"mask_token_id 16 is outside the target's vocabulary of 16 \("):
        check_mask_token_id(qwen_like(tmp_path), 16, 16)


def test_preflight_runs_it_on_the_tiny_target(tmp_path: Path, tiny_target) -> None:
    from dflash_trainer.service.preflight import run_checks

    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    config = tiny_run_config(tmp_path / "t.toml", target, shards)
    [mask] = [c for c in run_checks(config) if c.name == "mask"]
    assert mask.ok and "no tokenizer files" in mask.detail, mask  # the tiny target has none: said so
