"""`dflash-train smoke prepare|report`: the trainer's half of `make smoke-train`.

`prepare CONFIG --out DIR` writes DIR/smoke.toml: the real configuration with its checkpoints, tensorboard and
step horizon moved into DIR (wandb left out: a smoke run writes to no team dashboard). The script then runs
`serve` twice as a transient unit (steps 1..STOP, SIGTERM, then a resume to STEPS), and `report DIR` checks
what those runs left and prints the summary and one PASS or FAIL line.

A smoke run cleans up after itself (a reference-sized checkpoint is tens of GB): `report` removes DIR after a
PASS (DFLASH_SMOKE_KEEP=1 keeps it), and `prepare` removes what earlier runs left beside DIR (the work
directories of failed runs, kept for a look until the next run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_trainer.config import (
    ConfigError,
    TrackersConfig,
    check_tables,
    overlay,
    path_tables,
    read_toml,
    to_toml,
)


def prepare(config: Path, out: Path, *, steps: int, stop_at: int, keep_last: int | None = None) -> Path:
    tables = read_toml(config)
    cfg = check_tables(tables, base=config.resolve().parent)  # the values below are the loader's
    out.mkdir(parents=True, exist_ok=True)
    for old in earlier_runs(out):
        shutil.rmtree(old, ignore_errors=True)
        print(f"smoke: removed {old} (an earlier run's work directory)", file=sys.stderr)
    t = cfg.train
    train: dict[str, Any] = {
        "checkpoint_dir": str(out / "checkpoints"),
        "max_steps": steps,
        "checkpoint_every": max(1, stop_at * 3 // 5),  # a periodic save before the stop's own save
        # Every checkpoint of the run stays for the report, unless the caller counts disk (a GPU rehearsal).
        "keep_last": keep_last if keep_last is not None else max(t.keep_last, 5),
        "log_every": min(t.log_every, 10),
        "ema_every": min(t.ema_every, 10),
    }
    if t.eval_every > steps:
        train["eval_every"] = steps
    if t.eval_walk_prompts > 0:
        # One short walk proves the walk and its figure's way to the summary; the reference's 8 x 128 tokens
        # take 375 s on an H200 with a 27B-shaped target, too long for a smoke run
        # (docs/acceptance.md#what-it-costs).
        train["eval_walk_prompts"] = 1
        train["eval_walk_new_tokens"] = min(t.eval_walk_new_tokens, 32)
    # Only the tensorboard directory among the trackers (wandb left out: no team dashboard).
    trackers: dict[str, Any] = {f.name: None for f in dataclasses.fields(TrackersConfig)}
    trackers["tensorboard"] = str(out / "tensorboard")
    smoke = {
        "train": train,
        "trackers": trackers,
        "service": {"status_every": min(cfg.service.status_every, 10)},
    }
    # Relative paths become the absolute ones they resolved to beside the original file.
    tables = overlay(tables, path_tables(cfg), smoke)
    path = out / "smoke.toml"
    path.write_text(f"# Written by `dflash-train smoke prepare {config}`.\n" + to_toml(tables))
    return path


def earlier_runs(out: Path) -> list[Path]:
    """Work directories of earlier smoke runs beside OUT: same name stem (dflash-smoke.XXXXXX), each holding
    a smoke.toml (so nothing else of that name is touched)."""
    stem = out.name.split(".")[0]
    if not stem or stem == out.name:
        return []
    return sorted(
        p
        for p in out.parent.glob(f"{stem}.*")
        if p != out and p.is_dir() and not p.is_symlink() and (p / "smoke.toml").is_file()
    )


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def report(out: Path, *, steps: int, stop_at: int, t0: float | None) -> int:
    import torch

    from dflash_trainer.checkpoint import list_checkpoints

    problems: list[str] = []
    lines: list[str] = []
    phases = []
    for phase in ("phase1", "phase2"):
        found = sorted((out / phase).glob("summary-rank*.json"))
        if not found:
            problems.append(f"{phase}: no rank wrote a summary (see the journal above)")
        phases.append([json.loads(p.read_text()) for p in found])
    p1, p2 = phases
    for phase, summaries in (("phase1", p1), ("phase2", p2)):
        for s in summaries:
            if s.get("exit_code") != 0:
                problems.append(f"{phase}: rank {s['rank']} exited with {s.get('exit_code')}")
            if s.get("trackers_failed"):
                problems.append(f"{phase}: rank {s['rank']} trackers failed: {s['trackers_failed']}")
    ckpts = [p.name for p in list_checkpoints(out / "checkpoints")]
    # Steps are the drafter leader's (the rank that speaks to systemd); target ranks report none.
    all1, all2 = p1, p2
    p1 = [s for s in p1 if s.get("last_step") is not None] if p1 else p1
    p2 = [s for s in p2 if s.get("first_step") is not None] if p2 else p2
    for phase, every, stepped in (("phase 1", all1, p1), ("phase 2", all2, p2)):
        if every and not stepped:
            problems.append(f"{phase}: no rank trained a step")
    if p1 and any(s.get("last_step") != stop_at for s in p1):
        problems.append(
            f"phase 1 ended at step {[s.get('last_step') for s in p1]}, not at the stop step {stop_at}"
        )
    if p2:
        firsts = {s.get("first_step") for s in p2}
        if firsts != {stop_at + 1}:
            problems.append(f"phase 2 began at step {sorted(map(str, firsts))}, not {stop_at + 1}: no resume")
        if any(s.get("last_step") != steps for s in p2):
            problems.append(f"phase 2 ended at step {[s.get('last_step') for s in p2]}, not {steps}")
    final = out / "checkpoints" / f"step-{steps:08d}"
    if final.is_dir():
        ema = torch.load(final / "ema.pt", map_location="cpu", weights_only=True)
        if not ema.get("num_updates"):
            problems.append("the EMA was never updated")
        else:
            lines.append(f"EMA updates: {ema['num_updates']}")
    else:
        problems.append(f"no final checkpoint {final.name}")
    events = [p for p in (out / "tensorboard").rglob("events.out.tfevents.*") if p.stat().st_size > 0]
    if not events:
        problems.append(f"no tensorboard events under {out / 'tensorboard'}")
    else:
        lines.append(
            f"tensorboard: {len(events)} event file(s), {sum(p.stat().st_size for p in events)} bytes"
        )
    if p1 and p2:
        lines.insert(
            0,
            f"steps: 1-{stop_at}, SIGTERM, resumed {stop_at + 1}-{steps}; checkpoints now {', '.join(ckpts)}",
        )
        first = (
            min(s["first_step_at"] for s in p1 if s.get("first_step_at"))
            if any(s.get("first_step_at") for s in p1)
            else None
        )
        start = t0 if t0 is not None else min(s["started"] for s in all1)
        label = "since `make smoke-train`" if t0 is not None else "since the unit started"
        if first is not None:
            lines.append(f"time to first step: {first - start:.1f} s {label}")
        for s in sorted(all2, key=lambda s: s["rank"]):
            rate = s.get("tokens_per_s")
            lines.append(
                f"rank {s['rank']} {s['role']}: {rate:.0f} tokens/s"
                if rate
                else f"rank {s['rank']} {s['role']}: no step rate (a target's is in the pipeline table above)"
            )
            for dev, n in s["peak_memory_bytes"].items():
                lines.append(f"  peak memory {dev}: {_gib(n)}")
    for s in [*all1, *all2]:
        failed = sorted(k for k in (s.get("eval") or {}) if k.endswith("_failed"))
        if failed:
            problems.append(f"rank {s['rank']}: evaluation failed ({', '.join(failed)}; see its ERROR line)")
    evaluated = [s for s in [*all1, *all2] if s.get("eval")]
    if evaluated:  # the drafter leader's newest evaluation (figures come from target rank 0)
        s = max(evaluated, key=lambda s: s.get("eval_step") or 0)
        e = s["eval"]
        line = (
            f"evaluation at step {s.get('eval_step')}: held-out anchor_accept {e.get('anchor_accept', 0):.2f}"
        )
        if "walk_tau" in e:
            line += (
                f", walk tau {e['walk_tau']:.2f} ({e['walk_steps']:.0f} verify steps, {e['walk_s']:.1f} s)"
            )
        lines.append(line)
    if t0 is not None:
        lines.append(f"total: {time.time() - t0:.0f} s since `make smoke-train`")
    keep = os.environ.get("DFLASH_SMOKE_KEEP", "0") not in ("", "0")
    if problems or keep:
        why = "DFLASH_SMOKE_KEEP is set" if keep else "kept for a look; the next smoke run removes it"
        lines.append(f"work directory {out} ({why})")
    else:
        shutil.rmtree(out, ignore_errors=True)
        lines.append(f"work directory {out} removed (DFLASH_SMOKE_KEEP=1 keeps it)")
    print("---- smoke summary")
    for line in lines:
        print(line)
    for p in problems:
        print(f"problem: {p}")
    print("PASS" if not problems else f"FAIL ({len(problems)} problem(s))")
    return 0 if not problems else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-train smoke", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="write OUT/smoke.toml from the real configuration")
    p.add_argument("config", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep-last", type=int, default=None, help="checkpoints kept (default: at least 5)")
    r = sub.add_parser("report", help="check what the two phases left; print the summary and PASS or FAIL")
    r.add_argument("out", type=Path)
    r.add_argument("--t0", type=float, default=None, help="epoch seconds `make smoke-train` started")
    for q in (p, r):
        q.add_argument("--steps", type=int, default=100)
        q.add_argument("--stop-at", type=int, default=50)
    args = parser.parse_args(argv)
    if not 0 < args.stop_at < args.steps:
        parser.error("--stop-at must lie between 0 and --steps")
    if args.action == "prepare":
        try:
            path = prepare(
                args.config, args.out, steps=args.steps, stop_at=args.stop_at, keep_last=args.keep_last
            )
        except ConfigError as e:
            print(f"dflash-train smoke prepare: {e}", file=sys.stderr)
            return 1
        print(path)
        return 0
    return report(args.out, steps=args.steps, stop_at=args.stop_at, t0=args.t0)


if __name__ == "__main__":
    sys.exit(main())
