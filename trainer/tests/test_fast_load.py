"""fast_load gives exactly what safetensors.torch.load_file gives: names, dtypes, shapes, values."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

from dflash_trainer.model import fast_load


def _sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(700, 512, generator=g).to(
            torch.bfloat16
        ),  # 700 KB: spans chunks of 1 MiB
        "layers.0.w": torch.randn(300, 1000, generator=g),  # 1.2 MB float32
        "layers.0.h": torch.randn(33, 7, generator=g).to(torch.float16),
        "ids": torch.randint(-(2**40), 2**40, (513,), generator=g, dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "bytes": torch.randint(0, 255, (1001,), generator=g, dtype=torch.uint8),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].cpu(), tensor.cpu()), name


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_sample_state(), str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(("chunk_mb", "readers"), [(1, 1), (1, 3), (64, 2)])
def test_equals_safetensors_load_file_on_cpu(model_file: Path, chunk_mb: int, readers: int) -> None:
    got = fast_load.load_file(model_file, "cpu", chunk_mb=chunk_mb, readers=readers)
    _assert_same(got, st_load_file(str(model_file), device="cpu"))


def test_header_is_read_and_checked(model_file: Path) -> None:
    header = fast_load.read_header(model_file)
    assert header.metadata == {"format": "pt"}
    assert {t.name for t in header.tensors} == set(_sample_state())
    assert header.data_start + header.data_bytes == model_file.stat().st_size


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def test_misaligned_tensor_is_copied_not_viewed(tmp_path: Path) -> None:
    values = np.arange(6, dtype=np.float32)
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [3, 27]},
    }
    path = _raw_file(tmp_path / "odd.safetensors", header, b"\x01\x02\x03" + values.tobytes())
    got = fast_load.load_file(path)
    assert torch.equal(got["a"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert torch.equal(got["b"], torch.from_numpy(values).reshape(2, 3))


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, r"do not fit F32\[4\]"),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            "inside a data section of 4",
        ),
        ({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "tensor 'a': bad header entry"),
    ],
)
def test_bad_header_names_the_file_and_tensor(
    tmp_path: Path, header: dict, data: bytes, message: str
) -> None:
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(fast_load.FastLoadError, match=message) as err:
        fast_load.load_file(path)
    assert str(path) in str(err.value)


def test_truncated_file_is_refused(tmp_path: Path, model_file: Path) -> None:
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(model_file.read_bytes()[:-100])
    with pytest.raises(fast_load.FastLoadError, match=r"cut\.safetensors"):
        fast_load.load_file(cut)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x10\x00")
    with pytest.raises(fast_load.FastLoadError, match="too short"):
        fast_load.load_file(short)


def test_sharded_checkpoint_and_one_loader_per_device(tmp_path: Path) -> None:
    state = _sample_state(1)
    names = sorted(state)
    save_file({k: state[k] for k in names[:4]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[4:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    files = fast_load.safetensors_files(tmp_path)
    _assert_same(fast_load.load_files(files, "cpu", chunk_mb=1), state)
    per_device = fast_load.load_on_devices(files, ["cpu", "cpu", "cpu"], chunk_mb=1, readers=2)
    assert len(per_device) == 3
    for got in per_device:
        _assert_same(got, state)


def test_the_same_tensor_in_two_files_is_an_error(tmp_path: Path) -> None:
    save_file({"x": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(fast_load.FastLoadError, match="'x' is also in an earlier file"):
        fast_load.load_files(fast_load.safetensors_files(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["pinned", "register"])
def test_equals_safetensors_load_file_on_cuda(model_file: Path, method: str) -> None:
    try:
        got = fast_load.load_file(model_file, "cuda", chunk_mb=1, num_buffers=2, method=method)
    except RuntimeError as e:
        if method == "register":
            pytest.skip(f"cudaHostRegister of a read-only mapping is not supported here: {e}")
        raise
    assert all(t.device.type == "cuda" for t in got.values())
    _assert_same(got, st_load_file(str(model_file), device="cpu"))
