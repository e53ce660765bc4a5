"""GPU diagnosis (one call): does FLA's causal conv read a padded, strided view as it reads a contiguous copy,
and how far do the compiled layers at fixed shapes drift from eager in fp32, with and without inductor's
padding? Prints one line per comparison."""

import tempfile
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from dflash_trainer.fixtures.tiny import tiny_token_ids, write_tiny_target
from dflash_trainer.model.target import compile_layers, load_target


def conv_strided_vs_contiguous() -> None:
    from fla.modules.causal_conv1d import causal_conv1d

    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randn(1, 3072, 16512, device="cuda", dtype=dtype, generator=g)
        x = full[:, :, :10240]
        w = torch.randn(10240, 4, device="cuda", dtype=dtype, generator=g)
        a, _ = causal_conv1d(x, w, None, activation="silu")
        b, _ = causal_conv1d(x.contiguous(), w, None, activation="silu")
        diff = (a - b).abs().max().item()
        print(f"fla conv {dtype}: strided vs contiguous max diff {diff:.3g}", flush=True)


def compiled_drift(path: Path, ids: torch.Tensor, threshold: int | None, fuse: bool) -> torch.Tensor:
    target = load_target(path, layer_ids=[1, 3, 5], device="cuda", dtype=torch.float32)
    expected = target.capture(ids).context
    torch._dynamo.reset()
    patch = {"force_disable_caches": True}
    if threshold is not None:
        patch["padding_stride_threshold"] = threshold
    with torch._inductor.config.patch(patch):
        compile_layers(target, "layers-opaque", fuse=fuse)
        out, code = run_and_get_code(lambda: target.capture(ids).context)
    torch._dynamo.reset()
    text = "\n".join(code)
    conv = [ln.strip()[:160] for ln in text.splitlines() if "dflash.causal_conv1d.default(" in ln]
    drift = (out - expected).abs().max().item()
    print(
        f"compiled layers ids {tuple(ids.shape)} threshold {threshold} fuse {fuse}: max |compiled - eager| "
        f"{drift:.3g}, mean |eager| {expected.abs().mean().item():.3g}; conv: {conv}",
        flush=True,
    )
    return out


def main() -> None:
    conv_strided_vs_contiguous()
    path = write_tiny_target(Path(tempfile.mkdtemp()), kind="qwen3_5", seed=0)
    for shape in ((1, 64), (2, 24)):
        ids = tiny_token_ids(0, shape).cuda()
        outs = {(t, f): compiled_drift(path, ids, t, f) for t in (None, 0) for f in (False, True)}
        base = outs[(None, False)]
        for key, out in outs.items():
            print(f"  vs unpadded unfused compiled: {key} {(out - base).abs().max().item():.3g}", flush=True)


if __name__ == "__main__":
    main()
