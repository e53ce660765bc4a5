"""Shards: schema checks, held-out split, seed-deterministic order and exact resume; batching; synthesis."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest
import torch

from dflash_trainer.data.batch import batches, collate
from dflash_trainer.data.shards import (
    DataError,
    Shard,
    ShardReader,
    list_shards,
    read_segments,
    split_held_out,
)
from dflash_trainer.data.synth import write_shard


def make_shards(directory, num_shards=3, rows=7):
    """Row r of shard s is [s*100 + r] * (r % 4 + 2): the first token identifies the row."""
    directory.mkdir(exist_ok=True)
    for s in range(num_shards):
        rows_ = [([s * 100 + r] * (r % 4 + 2), [0] + [1] * (r % 4 + 1)) for r in range(rows)]
        write_shard(directory / f"shard-{s:03d}.arrow", rows_)
    return list_shards(directory)


def first_tokens(samples):
    return [int(s.input_ids[0]) for s in samples]


def test_held_out_rows_come_first_and_never_train(tmp_path):
    train, held = split_held_out(make_shards(tmp_path / "d"), held_out=9)
    assert first_tokens(read_segments(held)) == [*range(7), 100, 101]
    reader = ShardReader(train, seed=0, shuffle_window=4)
    epoch = first_tokens(itertools.islice(reader, reader.num_rows))
    assert sorted(epoch) == [*range(102, 107), *range(200, 207)]
    with pytest.raises(DataError, match="more rows than all shards hold"):
        split_held_out(list_shards(tmp_path / "d"), held_out=22)


def test_order_depends_on_seed_and_epoch_only(tmp_path):
    train, _ = split_held_out(make_shards(tmp_path / "d"), held_out=0)

    def two_epochs(seed):
        return first_tokens(itertools.islice(ShardReader(train, seed=seed, shuffle_window=4), 42))

    a = two_epochs(1)
    assert a == two_epochs(1)
    assert a != two_epochs(2)
    assert a[:21] != a[21:] and sorted(a[:21]) == sorted(a[21:])  # each epoch: every row once, new order


def test_resume_continues_exactly(tmp_path):
    train, _ = split_held_out(make_shards(tmp_path / "d"), held_out=2)
    straight = first_tokens(itertools.islice(ShardReader(train, seed=5, shuffle_window=3), 50))
    for cut in (0, 5, 19, 23):  # inside a shard, at a shard boundary, across an epoch
        reader = ShardReader(train, seed=5, shuffle_window=3)
        head = first_tokens(itertools.islice(reader, cut))
        resumed = ShardReader(train, seed=5, shuffle_window=3)
        resumed.load_state_dict(reader.state_dict())
        assert head + first_tokens(itertools.islice(resumed, 50 - cut)) == straight
    other = ShardReader(train, seed=6, shuffle_window=3)
    with pytest.raises(DataError, match=r"data\.seed=6"):
        other.load_state_dict(reader.state_dict())
    fewer = ShardReader(train[1:], seed=5, shuffle_window=3)
    with pytest.raises(DataError, match="the training data changed since the checkpoint: 3 shards"):
        fewer.load_state_dict(reader.state_dict())


def test_bad_shards_name_the_file(tmp_path):
    bad = tmp_path / "bad.arrow"
    table = pa.table({"input_ids": [[1, 2]], "loss_mask": [[1]]})
    with pa.OSFile(str(bad), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"bad.arrow: input_ids and loss_mask differ"):
        Shard(bad)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=r"junk.arrow: not an Arrow IPC file"):
        Shard(tmp_path / "junk.arrow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: no shards"):
        list_shards(tmp_path / "empty")


def test_bool_loss_mask_and_feather_are_read(tmp_path):
    import pyarrow.feather as feather

    table = pa.table(
        {"input_ids": pa.array([[5, 6, 7]], pa.list_(pa.int32())), "loss_mask": [[False, True, True]]}
    )
    feather.write_feather(table, tmp_path / "a.feather")
    row = Shard(tmp_path / "a.feather").row(0)
    assert row.input_ids.tolist() == [5, 6, 7] and row.loss_mask.tolist() == [False, True, True]


def test_collate_truncates_and_pads(tmp_path):
    samples = read_segments(split_held_out(make_shards(tmp_path / "d", 1, 5), held_out=4)[1])
    batch = collate(samples[1:4], seq_len=4)  # lengths 3, 4, 5 -> 3, 4, 4
    assert batch.input_ids.tolist() == [[1, 1, 1, 0], [2, 2, 2, 2], [3, 3, 3, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [
        [False, True, True, False],
        [False, True, True, True],
        [False] + [True] * 3,
    ]
    assert batch.input_ids.dtype == torch.long
    assert [b.input_ids.shape[0] for b in batches(samples, 3, 8)] == [3, 1]


def test_write_shard_round_trip(tmp_path):
    rows = [(np.arange(5), [0, 0, 1, 1, 1]), ([9, 8], [1, 1])]
    shard = Shard(write_shard(tmp_path / "x.arrow", rows))
    assert shard.num_rows == 2 and shard.row(1).input_ids.tolist() == [9, 8]
    assert shard.row(0).loss_mask.tolist() == [False, False, True, True, True]
