"""The GPU kernels the trainer swaps in and the preflight probes that run them.

CPU: the conv adapter against transformers' torch conv, through a stand-in with FLA's documented
channels-last contract (fla/modules/causal_conv1d/ops.py `causal_conv1d`: x [B, T, D], weight [D, W] ->
(y [B, T, D], final_state)); the probe module defines its Triton kernels from a file, and a probe passed as
`python -c` does not (the failure every GPU saw). GPU: the real FLA conv and a hybrid target forward.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash_trainer.model import kernels
from dflash_trainer.service import preflight


def _fla_contract(x, weight, bias=None, activation=None, **_):
    """FLA's causal_conv1d on [B, T, D] (channels last), computed plainly."""
    d, w = weight.shape
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=w - 1, groups=d)[..., : x.shape[1]]
    y = F.silu(y) if activation in ("silu", "swish") else y
    return y.transpose(1, 2), None


def test_conv_adapter_matches_transformers_torch_conv(monkeypatch):
    import fla.modules.causal_conv1d as fla_conv
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setattr(fla_conv, "causal_conv1d", _fla_contract)
    kernels.install_device_dispatch()
    torch_conv = modeling_qwen3_5.causal_conv1d_fn.torch_impl
    x = torch.randn(2, 40, 17)  # [B, D, T], as the Gated DeltaNet layer passes it (a transposed view)
    w = torch.randn(40, 4)
    got = kernels.fla_causal_conv1d_fn(x, w, None, activation="silu")
    want = torch_conv(x, w, None, activation="silu")
    assert got.shape == want.shape == (2, 40, 17)
    torch.testing.assert_close(got, want)


def test_hybrid_modules_dispatch_the_conv_by_device():
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next

    kernels.install_device_dispatch()
    kernels.install_device_dispatch()  # idempotent
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        assert kernels.conv_backend(module) == "flash-linear-attention (Triton)"
        x, w = torch.randn(1, 8, 5), torch.randn(8, 4)
        # CPU tensors take transformers' torch conv: equal to the plain conv
        want = F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=3, groups=8)[..., :5])
        torch.testing.assert_close(module.causal_conv1d_fn(x, w, None, activation="silu"), want)


def test_triton_probe_defines_its_kernel_from_a_file():
    probe = preflight.probe_command("triton", define_only=True)
    assert "-c" not in probe, "a probe handed to Python as a string cannot define @triton.jit kernels"
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok: triton kernels defined")


def test_a_probe_passed_as_a_string_fails_as_on_every_gpu():
    """The check above can tell: the old way (`python -c`) fails at the kernel's definition, GPU or not."""
    src = "import triton\n@triton.jit\ndef k(x):\n    pass\n"
    proc = subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode != 0
    assert "should be defined in a Python file" in proc.stderr


def test_fla_probe_defines_its_kernels_and_profiles_its_imports(tmp_path):
    """Preflight's environment passes DFLASH_PROFILE_START on to the probe: its report names the imports'
    seconds, and preflight still reads the `ok:` line (the report's path goes to stderr)."""
    proc = subprocess.run(
        preflight.probe_command("fla", define_only=True),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=os.environ | {"DFLASH_PROFILE_START": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok: fla kernels defined (not launched)"
    report = (tmp_path / "probe-fla-profile.txt").read_text()
    assert report.startswith("== probe fla: imports: ") and "fla/__init__.py:<module>" in report
    assert f"probe profile: {tmp_path / 'probe-fla-profile.txt'}" in proc.stderr


@pytest.mark.parametrize(
    ("line", "fix"),
    [
        ("ValueError: @jit functions should be defined in a Python file", "a bug in the probe"),
        ("RuntimeError: Failed to find C compiler. Please specify via CC environment variable.", "gcc"),
        (
            "CalledProcessError: Command '['/usr/bin/gcc', ...]' returned non-zero exit status 1.",
            "python3-dev",
        ),
        ("RuntimeError: CUDA driver version is insufficient for CUDA runtime version", "driver"),
        ("ModuleNotFoundError: No module named 'fla'", "trainer lock"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "nvidia-smi"),
        ("RuntimeError: PTX .version 9.0 does not support .target sm_120", "Triton"),
        ("AssertionError: FLA's causal conv differs from the torch conv by 0.3", "report"),
    ],
)
def test_probe_failures_name_a_fix_that_matches_the_cause(line, fix):
    assert fix in preflight.probe_fix(line)


@pytest.mark.gpu
def test_fla_conv_equals_torch_conv_on_gpu():
    x = torch.randn(2, 10240, 300, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(10240, 4, device="cuda", dtype=torch.bfloat16) / 4
    got = kernels.fla_causal_conv1d_fn(x, w, None, activation="silu")
    want = F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=3, groups=10240)[..., :300])
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_hybrid_target_forward_with_fla_conv_equals_torch_conv(tiny_target, monkeypatch):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash_trainer.model.target import load_target

    target = load_target(tiny_target("qwen3_5"), device="cuda", dtype=torch.bfloat16, layer_ids=[1, 5])
    ids = torch.randint(0, 500, (2, 96), device="cuda")
    fast = target.capture(ids).context.float()
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", modeling_qwen3_5.causal_conv1d_fn.torch_impl)
    slow = target.capture(ids).context.float()
    torch.testing.assert_close(fast, slow, atol=5e-2, rtol=5e-2)


# ---- bad inputs for the GPU path: one line naming the thing at fault, before any model loads ----


def _hybrid_ctx(tmp_path, text: dict, **facts):
    import json
    from pathlib import Path
    from types import SimpleNamespace

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    cfg = SimpleNamespace(model=SimpleNamespace(target_path=Path(tmp_path)))
    ctx = preflight.Context(tmp_path / "train.toml", 1, cfg=cfg)  # type: ignore[arg-type]
    ctx.facts.update(hybrid=True, **facts)
    return ctx


def test_a_hybrid_target_without_its_gated_deltanet_shape_is_named(tmp_path):
    ctx = _hybrid_ctx(tmp_path, {"linear_num_key_heads": 16, "linear_key_head_dim": 128}, device="cuda")
    with pytest.raises(preflight.Failed, match=r"config\.json: hybrid .*no linear_num_value_heads"):
        preflight.hybrid_shape(ctx.cfg.model.target_path)


def test_fla_missing_for_a_hybrid_target_fails_on_cuda_only(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a)
    )
    with pytest.raises(preflight.Failed, match="flash-linear-attention is not installed") as e:
        preflight.check_fla(_hybrid_ctx(tmp_path, {}, device="cuda"))
    assert "layer L3" in e.value.fix
    with pytest.raises(preflight.Skipped, match="torch kernels"):
        preflight.check_fla(_hybrid_ctx(tmp_path, {}, device="cpu"))


def test_a_gpu_too_small_for_target_and_drafter_is_named(monkeypatch, tmp_path):
    """One rank on a 96 GB GPU holding the 51 GiB target and the 1.7B reference drafter: refused, naming the
    GPU, what is free and what a rank needs."""
    from dflash_trainer.config import load_config

    GiB = 1 << 30
    cfg = load_config(preflight_config_path(), check_paths=False)
    from dflash_trainer.config import TargetInfo, validate

    validate(cfg, target=TargetInfo(64, 5120, 17408, 248320, 24, 4, 256))
    cfg.topology.targets = cfg.topology.drafters = "auto"  # one process: target and drafter on one GPU
    ctx = preflight.Context(tmp_path / "x.toml", 1, cfg=cfg)
    ctx.facts.update(model_bytes=51 * GiB, target=object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (94 * GiB, 95 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "RTX PRO 6000")
    cfg.train.device = "cuda"
    with pytest.raises(
        preflight.Failed, match=r"GPU 0: 94.0 of 95.0 GiB free; a rank needs about 9\d\.\d GiB"
    ):
        preflight.check_devices(ctx)


def test_host_memory_counts_the_checkpoint_snapshot_where_the_gpu_has_no_room_for_it(monkeypatch, tmp_path):
    """The reference drafter's CPU side (EMA 6.9 GB + fp32 pinned staging 6.9 GB) always; its 20 GB checkpoint
    snapshot in host RAM only when the GPU cannot hold it (beside the 51 GB target in /dev/shm, that snapshot
    got a rank OOM-killed on a 128 GB host; docs/gpu-rehearsal.md)."""
    from dflash_trainer.config import TargetInfo, load_config, validate

    GiB = 1 << 30
    cfg = load_config(preflight_config_path(), check_paths=False)
    validate(cfg, target=TargetInfo(64, 5120, 17408, 248320, 24, 4, 256))
    ctx = preflight.Context(tmp_path / "x.toml", 1, cfg=cfg)
    ctx.facts.update(device="cuda", target=object(), gpu_room=40 * GiB)
    available = {"bytes": 12 * GiB}
    monkeypatch.setattr(preflight, "_mem_available", lambda: available["bytes"])
    with pytest.raises(
        preflight.Failed, match=r"12.0 GiB of host RAM .* about 1\d\.\d GiB.*snapshot on the GPU"
    ):
        preflight.check_host_memory(ctx)
    available["bytes"] = 20 * GiB
    assert "snapshot on the GPU" in preflight.check_host_memory(ctx)
    ctx.facts["gpu_room"] = 10 * GiB  # less than the 20 GB snapshot and its margin
    with pytest.raises(preflight.Failed, match=r"snapshot in host memory \(19\.\d GiB\)") as e:
        preflight.check_host_memory(ctx)
    assert "ct_memory_mb" in e.value.fix
    ctx.facts["device"] = "cpu"
    with pytest.raises(preflight.Skipped):
        preflight.check_host_memory(ctx)


def preflight_config_path():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "configs" / "reference.toml"


# ---- grouped query/key heads handed to the delta rule (skip_qk_head_repeat) ----


def test_skipping_the_qk_head_repeat_leaves_the_hybrid_forward_bit_exact(tiny_target):
    """CPU: the torch delta rule gets the heads repeated by the dispatch instead of the layer: same bits."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash_trainer.model.target import load_target

    path = tiny_target("qwen3_5")
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    repeated = load_target(path, layer_ids=[1, 5], skip_repeat=False)
    grouped = load_target(path, layer_ids=[1, 5])
    layers = [m for m in grouped.model.modules() if isinstance(m, modeling_qwen3_5.Qwen3_5GatedDeltaNet)]
    assert layers and all(m.num_k_heads == m.num_v_heads for m in layers), "the repeat was not skipped"
    assert all(
        m.num_k_heads < m.num_v_heads
        for m in repeated.model.modules()
        if isinstance(m, modeling_qwen3_5.Qwen3_5GatedDeltaNet)
    )
    assert torch.equal(grouped.capture(ids).context, repeated.capture(ids).context)


def test_the_delta_rule_dispatch_repeats_grouped_heads_for_the_torch_path_only():
    seen = []

    def fla(q, k, v, *a, **kw):
        seen.append(("fla", q.shape[2], k.shape[2]))
        return v

    def torch_impl(q, k, v, *a, **kw):
        seen.append(("torch", q.shape[2], k.shape[2]))
        assert torch.equal(q[:, :, 0], q[:, :, 1]) and torch.equal(q[:, :, 2], q[:, :, 3]), "not interleaved"
        return v

    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 4, 8)
    kernels._delta_rule_dispatcher(fla, torch_impl, kernel_takes_groups=True)(q, k, v)
    kernels._delta_rule_dispatcher(fla, torch_impl, kernel_takes_groups=False)(q, k, v)
    assert seen == [("torch", 4, 4), ("torch", 4, 4)]  # CPU tensors: the torch path, repeated, either way


@pytest.mark.gpu
def test_grouped_heads_through_fla_equal_the_repeated_ones_on_gpu(tiny_target):
    from dflash_trainer.model.target import load_target

    path = tiny_target("qwen3_5")
    ids = torch.randint(0, 500, (2, 96), device="cuda")
    grouped = load_target(path, device="cuda", dtype=torch.bfloat16, layer_ids=[1, 5]).capture(ids).context
    repeated = load_target(path, device="cuda", dtype=torch.bfloat16, layer_ids=[1, 5], skip_repeat=False)
    torch.testing.assert_close(grouped.float(), repeated.capture(ids).context.float(), atol=2e-2, rtol=2e-2)


def test_the_graphs_l2norm_is_transformers_in_fp32():
    """The compiled layers L2-normalise query and key themselves (model.kernel_ops) and hand FLA normalised
    ones: the same formula as transformers' l2norm (and FLA's, in fp32), in the input's dtype."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

    from dflash_trainer.model import kernel_ops

    x = torch.randn(2, 7, 3, 16, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(kernel_ops.l2norm(x), l2norm(x, dim=-1, eps=1e-6), rtol=0, atol=0)
    half = x.bfloat16()
    assert kernel_ops.l2norm(half).dtype == torch.bfloat16
    torch.testing.assert_close(kernel_ops.l2norm(half), l2norm(half.float(), dim=-1, eps=1e-6).bfloat16())


@pytest.mark.gpu
def test_the_graphs_l2norm_equals_flas_on_gpu():
    pytest.importorskip("fla")
    from fla.modules.norm.l2norm import l2norm_fwd

    from dflash_trainer.model import kernel_ops

    x = torch.randn(1, 3072, 16, 128, device="cuda", dtype=torch.bfloat16)
    theirs, _rstd = l2norm_fwd(x)
    torch.testing.assert_close(kernel_ops.l2norm(x), theirs, rtol=0, atol=2**-8)
