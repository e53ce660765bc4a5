"""Synthetic shards never contain the drafter's mask token, in prompts or in the target's continuations."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from dflash_trainer.fixtures.synth import synth_shards


def _tokens(out) -> list[int]:
    ids: list[int] = []
    for path in sorted(out.glob("*.arrow")):
        with pa.memory_map(str(path)) as f:
            for row in pa.ipc.open_file(f).read_all().column("input_ids").to_pylist():
                ids += row
    return ids


def test_mask_token_is_never_written(tiny_target, tmp_path) -> None:
    target = tiny_target("qwen3")
    common = dict(num_shards=1, rows=8, seq_len=32, seed=0, prompt_len=4)
    synth_shards(target, tmp_path / "a", **common)
    first = _tokens(tmp_path / "a")
    assert 511 not in first  # the default: the vocabulary's last id, the tiny targets' mask token
    # The token the target continues with most often, made the mask: gone from prompts and continuations.
    frequent = Counter(first[4:]).most_common(1)[0][0]
    synth_shards(target, tmp_path / "b", **common, mask_token_id=frequent)
    assert frequent not in _tokens(tmp_path / "b")


def test_bad_mask_token_id_is_refused(tiny_target, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"mask_token_id must be a token id in \[0, 512\), got 512"):
        synth_shards(
            tiny_target("qwen3"), tmp_path, num_shards=1, rows=1, seq_len=8, seed=0, mask_token_id=512
        )
