"""The run's figures in Prometheus' text exposition format (version 0.0.4), for node_exporter's textfile
collector: written to a temporary file and renamed, as its documentation asks, so a scrape never sees half."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_trainer.alerts.figures import Figures

PREFIX = "dflash_train"


def _escape(value: object) -> str:
    """A label value: backslash, double quote and newline escaped (the exposition format's rule)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float | int) -> str:
    """An integer as such, a float in full (a timestamp keeps its seconds)."""
    return str(v) if isinstance(v, int) else repr(float(v))


def _labels(**kv: object) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in kv.items())
    return "{" + inner + "}" if inner else ""


def render(
    f: Figures,
    *,
    unit: str,
    active: bool,
    restarts: int | None,
    max_steps: int | None,
    checkpoint_step: int | None,
    checkpoint_age_s: float | None,
    checkpoints_on_disk: int | None = None,
) -> str:
    out: list[str] = []

    def gauge(name: str, doc: str, samples: list[tuple[dict[str, object], float | int | None]]) -> None:
        rows = [(labels, v) for labels, v in samples if v is not None]
        if not rows:
            return
        out.append(f"# HELP {PREFIX}_{name} {doc}")
        out.append(f"# TYPE {PREFIX}_{name} gauge")
        out.extend(f"{PREFIX}_{name}{_labels(unit=unit, **labels)} {_number(v)}" for labels, v in rows)

    gauge("up", "1 while the training unit is active", [({}, int(active))])
    gauge("step", "the newest optimizer step in the journal", [({}, f.step)])
    gauge("max_steps", "the schedule's horizon (train.max_steps)", [({}, max_steps)])
    gauge("loss", "training loss at the newest step line", [({}, f.loss)])
    gauge("walk_tau", "acceptance length of the newest decode-walk evaluation", [({}, f.walk_tau)])
    gauge("pipeline_tokens_per_second", "tokens trained per second by all drafter ranks",
          [({}, f.pipeline_tokens_per_s() if f.ranks else None)])  # fmt: skip
    gauge("median_tokens_per_second", "the run's median pipeline tokens/s", [({}, f.median_tokens_per_s())])
    gauge(
        "rank_tokens_per_second",
        "each rank's tokens per second over its last log window",
        [({"rank": r, "role": x.role}, x.tokens_per_s) for r, x in sorted(f.ranks.items())],
    )
    gauge(
        "rank_time_share",
        "share of each rank's last log window per state (busy, data, wait_send, wait_recv, idle)",
        [
            ({"rank": r, "role": x.role, "state": s}, v)
            for r, x in sorted(f.ranks.items())
            for s, v in x.shares.items()
        ],
    )
    gauge(
        "rank_gpu_memory_bytes",
        "each rank's CUDA memory at its last log window (kind: allocated, reserved)",
        [
            ({"rank": r, "role": x.role, "kind": kind}, gib * 2**30 if gib is not None else None)
            for r, x in sorted(f.ranks.items())
            for kind, gib in (("allocated", x.gpu_allocated_gib), ("reserved", x.gpu_reserved_gib))
        ],
    )
    gauge("checkpoint_step", "the newest complete checkpoint's step", [({}, checkpoint_step)])
    gauge("checkpoints_on_disk", "step directories in train.checkpoint_dir", [({}, checkpoints_on_disk)])
    gauge(
        "checkpoint_age_seconds", "seconds since the newest checkpoint was written", [({}, checkpoint_age_s)]
    )
    gauge(
        "restarts",
        "automatic restarts of the unit since it was last started by hand (NRestarts)",
        [({}, restarts)],
    )
    gauge("preflight_seconds", "the newest preflight's duration", [({}, f.preflight_s)])
    gauge(
        "start_seconds", "launcher start to READY (every rank loaded) of the newest start", [({}, f.start_s)]
    )
    gauge("last_step_timestamp_seconds", "when the newest step line was written", [({}, f.step_at)])
    return "\n".join(out) + "\n"


def write_textfile(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    tmp = directory / f".{name}.{os.getpid()}.tmp"  # node_exporter reads *.prom only
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, final)
    return final
