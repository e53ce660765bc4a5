"""The fused loss's Triton kernel (method.ce_rows) against the torch path it replaces.

On CPU the kernel runs in Triton's interpreter, which triton picks at import (TRITON_INTERPRET=1): the CPU
test runs this file and the loss tests in a child pytest with that variable, so that the "fused" loss goes
through the kernel there; on a GPU machine the same checks run on CUDA (`-m gpu`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_trainer.method.ce_rows import ce_rows_, runs_here

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HERE = Path(__file__).parent


def torch_rows(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
    """What method.loss's torch path computes for one chunk, in fp32."""
    x = logits.float()
    rows = torch.arange(x.shape[0])
    lse = torch.logsumexp(x, -1)
    grad = torch.softmax(x, -1)
    grad[rows, y] -= 1.0
    return (lse - x[rows, y]) * w, x.argmax(-1), (grad * w[:, None]).to(logits.dtype)


def check_against_torch(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    # A vocabulary that is not a multiple of the block, rows of several blocks (the CPU block is the whole
    # row below 32768), ties for the maximum (torch.argmax takes the first), a weight of 0 (ignored rows).
    for n, vocab in ((6, 1000), (3, 40000)):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(n, vocab, generator=gen) * 4).to(dtype)
            logits[1, [7, 600]] = 60.0
            logits[2, [vocab - 1, 5]] = 70.0  # the tie's later copy in the last block, the first in the first
            y = torch.randint(0, vocab, (n,), generator=gen)
            w = torch.rand(n, generator=gen)
            w[0] = 0.0
            want_loss, want_arg, want_grad = torch_rows(logits, y, w)
            got = logits.to(device)
            loss, arg = ce_rows_(got, y.to(device), w.to(device))
            torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-5, atol=1e-4)
            assert torch.equal(arg.cpu(), want_arg), (arg, want_arg)
            assert arg[1] == 7 and arg[2] == 5
            # Written over the logits, in their dtype: equal to the torch path within one rounding of it.
            assert got.dtype == dtype
            tol = {"rtol": 1.6e-2, "atol": 4e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(got.cpu(), want_grad, **tol)
            assert torch.all(got[0] == 0)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"row-major \[n, V\]"):
        ce_rows_(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), torch.zeros(2))
    with pytest.raises(ValueError, match=r"labels .* for 2 rows"):
        ce_rows_(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), torch.zeros(2))


def test_the_kernel_equals_the_torch_path_in_tritons_interpreter() -> None:
    if INTERPRETED:  # the child: the kernel on CPU tensors
        assert runs_here(torch.zeros(1))
        check_against_torch("cpu")
        return
    # The parent: this file and the loss's exactness tests, with the "fused" loss through the kernel.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = [str(HERE / "test_ce_rows.py"), str(HERE / "test_method_loss.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", "not gpu"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_equals_the_torch_path_on_cuda() -> None:
    check_against_torch("cuda")
