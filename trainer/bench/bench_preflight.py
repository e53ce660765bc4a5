"""`dflash-train preflight` as the unit runs it, timed at the reference shape: cold (empty compile caches and
no kept verdicts), warm (the same caches again), with a failing cheap check (a shards directory that is
not there), and cold again in Triton's own order, one autotune candidate's compile after another
(cold-serial, DFLASH_COMPILE_WORKERS=0), beside the default that compiles them at once on threads.
`--before DIR` runs the same sequence with another copy of the trainer's source first (an earlier commit's
`trainer/src`), side by side in one run. Figures, no assertions.

    python trainer/bench/bench_preflight.py [--target /dev/shm/dflash/model] [--before .old/trainer/src]
        [--out preflight.json]

The random 27B-shaped target is written into --target when no complete one is there (the rehearsal's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash_trainer.config import load_config
from dflash_trainer.service.rehearse import (
    CLI,
    REPO_CONFIG,
    cut_context_layers,
    stage_target,
    write_config,
    write_shards,
)


def run_preflight(
    config: Path, source: Path | None, caches: Path, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    env = {
        **os.environ,
        **(extra or {}),
        "XDG_CACHE_HOME": str(caches),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_AUTOTUNING": "1",
        "DFLASH_NPROC": "1",
    }
    if source is not None:
        env["PYTHONPATH"] = f"{source}:{env.get('PYTHONPATH', '')}"
    start = time.perf_counter()
    proc = subprocess.run([*CLI, "preflight", str(config)], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"seconds": round(seconds, 2), "rc": proc.returncode, "lines": lines[-16:]}


def timed(
    label: str, run: str, config: Path, source: Path | None, caches: Path, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    figures = run_preflight(config, source, caches, extra)
    print(f"preflight {label} {run}: {figures['seconds']:.1f} s, exit {figures['rc']}")
    print("\n".join(f"  {line}" for line in figures["lines"]))
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("/dev/shm/dflash/model"))
    p.add_argument("--shape", default="qwen3.6-27b", help="qwen3.6-mini: a CPU smoke run of this script")
    p.add_argument(
        "--layers", type=int, help="the target's first N layers only (the probes' shape is the same)"
    )
    p.add_argument("--state", type=Path, default=Path("/var/tmp/dflash-preflight"))
    p.add_argument("--before", type=Path, help="another trainer/src to time first, side by side")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    stage_target(args.target, args.shape, args.layers)
    layers = {"drafter.target_layer_ids": cut_context_layers(args.layers)} if args.layers else {}
    # Two checkpoints' room, not the reference's four: a lent machine's 64 GB disk would fail the disk check
    # first, and the probes would not run (measured: 63.8 GiB free against 103.1 GiB).
    layers["train.keep_last"] = 1
    args.state.mkdir(parents=True, exist_ok=True)
    cfg = load_config(REPO_CONFIG, check_paths=False)
    shards = args.state / "shards"
    vocab = json.loads((args.target / "config.json").read_text())["text_config"]["vocab_size"]
    write_shards(shards, vocab=vocab, mask_id=cfg.drafter.mask_token_id, seq_len=cfg.data.seq_len, rows=16,
                 shards=2)  # fmt: skip
    good_dir, bad_dir = args.state / "good", args.state / "bad"
    for d in (good_dir, bad_dir):
        d.mkdir(exist_ok=True)
    good = write_config(REPO_CONFIG, good_dir, target=args.target, shards=shards, world=1, overrides=layers)
    bad = write_config(REPO_CONFIG, bad_dir, target=args.target, shards=args.state / "missing", world=1,
                       overrides=layers)  # fmt: skip
    result: dict[str, Any] = {}
    versions = [("before", args.before), ("after", None)] if args.before else [("after", None)]
    for label, source in versions:
        caches = Path(tempfile.mkdtemp(prefix=f"preflight-caches-{label}-", dir="/var/tmp"))
        for run, config in (("cold", good), ("warm", good), ("failing-shards", bad)):
            result[f"{label}/{run}"] = timed(label, run, config, source, caches)
        shutil.rmtree(caches, ignore_errors=True)
    # Cold again with fresh caches, the FLA probe's autotune candidates compiled in Triton's own order
    # (service/autotune_compile.py), beside the default "after/cold" above.
    caches = Path(tempfile.mkdtemp(prefix="preflight-caches-serial-", dir="/var/tmp"))
    serial = {"DFLASH_COMPILE_WORKERS": "0"}
    result["after/cold-serial"] = timed("after", "cold-serial", good, None, caches, serial)
    shutil.rmtree(caches, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
