"""`python -m dflash_trainer.service.gpu_probe triton|fla [...]`: the GPU kernels the trainer runs, run small.

Preflight starts this module in a child process (a crashed or hung kernel cannot take preflight with it) and
reads its last line. The kernels live in this file on purpose: Triton's `@jit` reads a kernel's source from
its file (`inspect.getsource`), so a probe handed to Python as a `-c` string fails on every GPU with "@jit
functions should be defined in a Python file" before it tests anything.

Exit 0 with `ok: ...` as the last line, or exit 1 with `error: TYPE: MESSAGE` (the exception's own last line).
`--define-only` imports and defines the kernels without launching them (what a machine with no GPU can check).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

import triton
import triton.language as tl

from dflash_trainer import stack_sampler
from dflash_trainer.service.process import die_with_parent


@triton.jit
def _add_kernel(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)


def probe_triton() -> str:
    import torch

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    _add_kernel[(4,)](x, x, out, 1000, BLOCK=256)
    torch.cuda.synchronize()
    if not torch.equal(out, 2 * x):
        raise AssertionError("the Triton add kernel returned a wrong result")
    return (
        f"a Triton kernel compiled and ran on {torch.cuda.get_device_name(0)} (triton {triton.__version__})"
    )


def heads_form(model_type: str) -> str:
    """How the target's layers hand query/key heads to the delta rule: "grouped" for Qwen3.5 where
    model.kernels.skip_qk_head_repeat applies, else "repeated" to the value heads (Qwen3-Next, as
    transformers does). Each form autotunes apart (seconds each): only the one the trainer runs is probed."""
    from dflash_trainer.model.kernels import grouped_heads_available, install_device_dispatch

    install_device_dispatch()
    return "grouped" if model_type.startswith("qwen3_5") and grouped_heads_available() else "repeated"


def probe_fla(
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    conv: int,
    tokens: int,
    forms: Sequence[str],
    mark: Callable[[str], None] = lambda _label: None,
) -> str:
    """The target's Gated DeltaNet kernels on its own head shapes, forward and backward-free, in bf16.

    The calls the target's layers make: the chunked gated delta rule with in-kernel L2 norm on q and k, in
    each of `forms` ("grouped", "repeated": `heads_form`), and the depthwise causal conv over q|k|v channels
    (dflash_trainer.model.kernels swaps FLA's Triton conv in for transformers' torch fallback). `mark(label)`
    is called where each of them starts (a start profile's windows: stack_sampler).
    """
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from dflash_trainer.model.kernels import fla_causal_conv1d_fn

    mark("causal conv: CUDA context, inputs, compile, run")
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    x = torch.randn(1, channels, tokens, device=dev, dtype=bf16, generator=g)
    w = torch.randn(channels, conv, device=dev, dtype=bf16, generator=g) / conv
    got = fla_causal_conv1d_fn(x, w, None, activation="silu")
    want = F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=conv - 1, groups=channels)[:, :, :tokens])
    err = (got.float() - want.float()).abs().max().item()
    if not err < 0.05:
        raise AssertionError(f"FLA's causal conv differs from the torch conv by {err:.3g} (bf16 allows 0.05)")

    q, k = (torch.randn(1, tokens, key_heads, key_dim, device=dev, dtype=bf16, generator=g) for _ in range(2))
    v = torch.randn(1, tokens, value_heads, value_dim, device=dev, dtype=bf16, generator=g)
    gate = -torch.rand(1, tokens, value_heads, device=dev, dtype=torch.float32, generator=g)
    beta = torch.rand(1, tokens, value_heads, device=dev, dtype=bf16, generator=g)
    rep = value_heads // key_heads
    for form in forms:
        mark(f"gated delta rule, {form} q/k heads: compile, autotune, run")
        qs, ks = (q, k) if form == "grouped" else (q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2))
        out, _ = chunk_gated_delta_rule(qs, ks, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        if not torch.isfinite(out.float()).all():
            raise AssertionError(
                f"the FLA gated-delta-rule kernel returned non-finite values ({form} q/k heads)"
            )
    return (
        f"FLA gated delta rule ({key_heads} key / {value_heads} value heads of {key_dim}/{value_dim}, "
        f"q/k {' and '.join(forms)}) and causal conv (width {conv}, {channels} channels, "
        f"max error {err:.2g}) ran, {tokens} tokens"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_trainer.service.gpu_probe")
    parser.add_argument("probe", choices=("triton", "fla"))
    parser.add_argument("--define-only", action="store_true", help="import and define the kernels; no GPU")
    for name, default in (("key-heads", 16), ("value-heads", 48), ("key-dim", 128), ("value-dim", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--conv", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--model-type", default="", help="the target's model_type: probe only the q/k head form it runs"
    )
    args = parser.parse_args(argv)
    # A rank that runs the probes beside its start (service.probes_beside) may exit before they finish.
    die_with_parent(os.getppid())
    profile = stack_sampler.from_environment(f"probe {args.probe}: imports")
    try:
        if args.define_only:
            if args.probe == "fla":
                import fla.ops.gated_delta_rule  # noqa: F401  (defines its @jit kernels at import)

                from dflash_trainer.model import kernels  # noqa: F401
            print(f"ok: {args.probe} kernels defined (not launched)")
            return 0
        if args.probe == "triton":
            print(f"ok: {probe_triton()}")
        else:
            import torch

            from dflash_trainer.service import autotune_compile as autotune
            from dflash_trainer.service import timing_turns

            shape = (args.key_heads, args.value_heads, args.key_dim, args.value_dim, args.conv, args.tokens)
            forms = [heads_form(args.model_type)] if args.model_type else ["grouped", "repeated"]
            tally = autotune.AutotuneTally()
            at_once = autotune.configs_compiled_at_once(autotune.workers_from_env(), tally)
            mark = profile.mark if profile is not None else (lambda _label: None)
            # Its candidates timed in turns with a rank that compiles beside it (service.timing_turns).
            with autotune.tallied(tally, torch.cuda.synchronize), at_once, timing_turns.in_turns() as turns:
                ran = probe_fla(*shape, forms, mark)
            waited = f"; {turns.summary()}" if turns is not None and turns.waited_s >= 0.1 else ""
            print(f"ok: {ran}; {tally.summary()}{waited}")
    except BaseException as e:  # any failure is the probe's finding, reported as one line
        traceback.print_exc()
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {last}", flush=True)
        return 1
    finally:
        if profile is not None:  # on stderr: preflight reads the `ok:`/`error:` line
            print(
                f"probe profile: {stack_sampler.write_report(profile, f'probe-{args.probe}-profile.txt')}",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
