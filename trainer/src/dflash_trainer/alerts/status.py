"""`python -m dflash_trainer.alerts status`: the training unit on one screen (what `make status` prints).

Unit state, step / max_steps, tokens/s, ETA, loss, walk_tau, the newest checkpoint and its age, restarts
since boot, and the last failure with its cause (the notifier's state, else the journal)."""

from __future__ import annotations

import subprocess
import time

from dflash_trainer.alerts import journal
from dflash_trainer.alerts.classify import classify
from dflash_trainer.alerts.figures import Figures
from dflash_trainer.alerts.run_state import duration, train_settings
from dflash_trainer.alerts.settings import Settings
from dflash_trainer.alerts.state import State

PROPS = (
    "ActiveState",
    "SubState",
    "Result",
    "NRestarts",
    "StatusText",
    "InvocationID",
    "ActiveEnterTimestamp",
)


def show(unit: str) -> dict[str, str]:
    out = subprocess.run(
        ["systemctl", "show", *(f"-p{p}" for p in PROPS), unit], capture_output=True, text=True, check=False
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def restarts_since_boot(unit: str) -> int:
    out = subprocess.run(
        ["journalctl", "-b", "-u", unit, "-o", "cat", "--no-pager", "--grep", "Scheduled restart job"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return sum(1 for line in out.splitlines() if "Scheduled restart job" in line)


def report(settings: Settings, now: float | None = None) -> str:
    now = time.time() if now is None else now
    unit = settings.unit
    p = show(unit)
    entries = journal.entries(unit, lines=20000)
    f = Figures()
    for e in entries:
        at = int(e.get("__REALTIME_TIMESTAMP", now * 1e6)) / 1e6
        f.feed(e["MESSAGE"], at, e.get("_SYSTEMD_INVOCATION_ID", ""))
    train = train_settings(settings.train_config)
    max_steps = train.max_steps
    ckpt = train.newest_checkpoint()
    state = f"{p.get('ActiveState', '?')} ({p.get('SubState', '?')})"
    if p.get("ActiveState") == "failed":
        state += f", result {p.get('Result')}"
    rows = [("unit", f"{unit}: {state}")]
    if p.get("StatusText"):
        rows.append(("status", p["StatusText"]))
    step = "?" if f.step is None else str(f.step)
    if max_steps:
        step += f" / {max_steps}"
        if f.step is not None:
            step += f" ({f.step / max_steps:.1%})"
    if f.step_at is not None:
        step += f", logged {duration(now - f.step_at)} ago"
    rows.append(("step", step))
    rate = f.pipeline_tokens_per_s() if f.ranks else None
    median = f.median_tokens_per_s()
    rows.append((
        "tokens/s",
        "?" if rate is None else f"{rate:.0f} (run median {median:.0f})" if median else f"{rate:.0f}",
    ))  # fmt: skip
    step_s = f.median_step_s()
    if max_steps and f.step is not None and step_s and p.get("ActiveState") == "active":
        left = (max_steps - f.step) * step_s
        rows.append(
            ("ETA", f"{duration(left)} ({time.strftime('%Y-%m-%d %H:%M', time.localtime(now + left))})")
        )
    else:
        rows.append(("ETA", "?" if p.get("ActiveState") == "active" else "- (not training)"))
    rows.append(("loss", "?" if f.loss is None else f"{f.loss:.4f}"))
    rows.append(("walk_tau", "?" if f.walk_tau is None else f"{f.walk_tau:.2f} (step {f.walk_tau_step})"))
    rows.append((
        "checkpoint",
        "none" if ckpt is None else f"step {ckpt.step}, {duration(ckpt.age_s(now))} ago ({ckpt.path})",
    ))  # fmt: skip
    rows.append(
        (
            "restarts",
            f"{restarts_since_boot(unit)} since boot ({p.get('NRestarts', '?')} since the last manual start)",
        )
    )
    st = State(settings.state_dir).data
    last = st.get("last_failure")
    if last:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"]))
        rows.append(("last failure", f"{when}: {last['summary']}"))
    elif p.get("Result") not in ("", "success"):
        cause = classify(journal.invocation_lines(entries, p.get("InvocationID", "")), p.get("Result", ""))
        rows.append(("last failure", cause.summary))
    else:
        rows.append(("last failure", "none recorded"))
    if st.get("last_message"):
        m = st["last_message"]
        rows.append(("last alert", f"{time.strftime('%H:%M:%S', time.localtime(m['time']))} {m['title']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
