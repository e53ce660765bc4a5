"""Why the training unit stopped, from its journal lines and systemd's result: a pure function.

The lines are the ones the trainer prints (service/logs.py prefixes each with `rank R ROLE: ` or
`launcher: `; several nodes put `node G ` first), systemd's own lines about the unit, and the C++ lines of
NCCL/gloo on stderr. `result` is systemd's service result ($SERVICE_RESULT, $MONITOR_SERVICE_RESULT:
success, exit-code, signal, core-dump, watchdog, oom-kill, timeout, start-limit-hit, ...).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# The causes, in the words of a message's first line.
KINDS = {
    "finished": "finished",
    "stopped": "stopped cleanly",
    "cuda_oom": "CUDA out of memory",
    "oom_killer": "killed by the OOM killer",
    "collective_timeout": "NCCL or collective timeout",
    "watchdog": "watchdog timeout (a hung step)",
    "preflight": "preflight failed",
    "node_left": "a node left the job",
    "rank_exit": "a rank exited",
    "start_limit": "gave up (start limit hit)",
    "failed": "failed",
}

_PREFIX = r"(?:node (?P<node>\d+) )?(?:rank (?P<rank>\d+) (?P<role>[\w-]+)|launcher): "
_RANK_LINE = re.compile(_PREFIX + r"(?P<level>critical: |error: |warning: )?(?P<text>.*)$")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
_GPU = re.compile(r"\bGPU (\d+) has a total capacity|\bcuda:(\d+)")
_IDENTITY = re.compile(r"\brank (\d+) \((\w+), ([\w:]+) on [^)]*\)")
_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|Timed out waiting \d+ ?ms for \w+ operation"
    r"|collective operation timeout|NCCL (?:error|WARN).*[Tt]imeout|Some NCCL operations have failed or timed"
)
_TIMEOUT_RANK = re.compile(r"\[Rank (\d+)\]|\[rank(\d+)\]")
_LAUNCHER_EXIT = re.compile(r"\brank (\d+) (exited with status (\d+)|killed by (SIG\w+)[^;]*)")
_PREFLIGHT = re.compile(r"^FAIL (?P<check>[\w-]+): (?P<detail>.*?)(?: -- fix: (?P<fix>.*))?$")
_NODE_LEFT = re.compile(r"(node \d+ \([^)]*\) (?:left|lost)[^;]*)")
_STOPPED = re.compile(r"\b(stopped|finished) at step (\d+)|all \d+ rank\(s\) (stopped|finished) cleanly")
_STEP = re.compile(r"\bstep (\d+)\b")
# systemd: "A process of this unit has been killed by the OOM killer."
_OOM_KILLER = "killed by the OOM killer"


@dataclass(frozen=True)
class Cause:
    kind: str  # a key of KINDS
    summary: str  # one line for a human: what happened, to whom
    rank: int | None = None
    gpu: int | None = None
    role: str | None = None
    check: str | None = None  # the preflight check that failed
    exit_status: int | None = None
    detail: str = ""  # the journal line it was read from

    @property
    def title(self) -> str:
        return KINDS[self.kind]


def _gpu(text: str) -> int | None:
    m = _GPU.search(text)
    if m is None:
        return None
    return int(m.group(1) or m.group(2))


def _split(line: str) -> tuple[int | None, str | None, str, str]:
    """(rank, role, level, text) of a trainer line; (None, None, '', line) for any other."""
    m = _RANK_LINE.match(line)
    if m is None:
        return None, None, "", line
    rank = int(m.group("rank")) if m.group("rank") else None
    return rank, m.group("role"), (m.group("level") or "").rstrip(": "), m.group("text")


def last_step(lines: Sequence[str]) -> int | None:
    """The newest training step the journal names (step lines, STATUS echoes, the stop's line)."""
    for line in reversed(lines):
        _, _, _, text = _split(line)
        if text.startswith(("step ", "stopped at step", "finished at step", "resumed", "checkpoint")):
            m = _STEP.search(text)
            if m:
                return int(m.group(1))
    return None


def _oom(lines: Sequence[str]) -> Cause | None:
    for line in lines:
        rank, role, level, text = _split(line)
        if not _OOM.search(text) or (rank is None and "OutOfMemoryError" not in text):
            continue
        if level not in ("critical", "") or text.startswith("stopping: peer failed"):
            continue  # a peer's consequence names the cause too; the failing rank's own line comes first
        ident = _IDENTITY.search(text)
        if ident is not None:  # "training failed" of one process, or a published failure
            rank, role = int(ident.group(1)), ident.group(2)
        gpu = _gpu(text)
        where = f"rank {rank}" if rank is not None else "a rank"
        if role:
            where += f" ({role})"
        where += f" on GPU {gpu}" if gpu is not None else ""
        ask = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
        return Cause(
            "cuda_oom",
            f"CUDA out of memory on {where}" + (f" (tried to allocate {ask.group(1)})" if ask else ""),
            rank=rank,
            gpu=gpu,
            role=role,
            detail=line,
        )
    return None


def _timeout(lines: Sequence[str]) -> Cause | None:
    for line in lines:
        if not _TIMEOUT.search(line):
            continue
        rank, role, _, _ = _split(line)
        m = _TIMEOUT_RANK.search(line)
        if rank is None and m is not None:
            rank = int(m.group(1) or m.group(2))
        op = re.search(r"OpType=(\w+)", line)
        what = f"collective {op.group(1)}" if op else "collective/transfer"
        who = f"rank {rank}" if rank is not None else "a rank"
        return Cause(
            "collective_timeout",
            f"NCCL/collective timeout on {who}: {what} timed out",
            rank=rank,
            role=role,
            detail=line,
        )
    return None


def _preflight(lines: Sequence[str]) -> Cause | None:
    if any(line.startswith("launcher: started") for line in lines):
        return None  # preflight passed: the launcher ran
    for line in lines:
        m = _PREFLIGHT.match(line.strip())
        if m:
            check, detail = m.group("check"), m.group("detail")
            return Cause(
                "preflight",
                f"preflight check {check} failed: {detail}"[:300],
                check=check,
                detail=line,
            )
    return None


def _rank_exit(lines: Sequence[str]) -> Cause | None:
    """The launcher's line: `rank R exited with status S` / `rank R killed by SIGNAL (...)`."""
    for line in lines:
        if "launcher: " not in line and not re.search(r"\bnode \d+ \(", line):
            continue
        m = _LAUNCHER_EXIT.search(line)
        if m is None or "stopped because a peer failed" in line:
            continue
        rank = int(m.group(1))
        status = int(m.group(3)) if m.group(3) else None
        # The rank's own last words, when it had any (an exception): the first critical line of that rank.
        said = next(
            (t for ln in lines if (s := _split(ln))[0] == rank and s[2] == "critical" for t in [s[3]]),
            "",
        )
        role = next((s[1] for ln in lines if (s := _split(ln))[0] == rank and s[1]), None)
        who = f"rank {rank}" + (f" ({role})" if role else "")
        summary = f"{who} {m.group(2).strip()}"
        if said:
            summary += f": {said.splitlines()[0][:200]}"
        return Cause("rank_exit", summary, rank=rank, role=role, exit_status=status, detail=line)
    return None


def classify(lines: Sequence[str], result: str, *, exit_code: str = "", exit_status: str = "") -> Cause:
    """The cause of one stop of the unit, from the journal lines of that invocation (oldest first)."""
    lines = [line.rstrip("\n") for line in lines]
    if result == "start-limit-hit":
        return Cause("start_limit", "the unit failed too often in its start-limit interval and stays failed")
    if result == "success":
        found = [(m, line) for line in lines if (m := _STOPPED.search(line))]
        with_step = [f for f in found if f[0].group(2)]
        if found:
            m, line = (with_step or found)[-1]
            how = m.group(1) or m.group(3)
            at = f" at step {m.group(2)}" if m.group(2) else ""
            if how == "finished":
                return Cause("finished", f"training finished{at}", detail=line)
            return Cause("stopped", f"stopped cleanly{at}, checkpoint saved", detail=line)
        return Cause("stopped", "stopped cleanly (exit 0)")
    cause = _preflight(lines)
    if cause is not None:
        return cause
    oom_killed = result == "oom-kill" or any(_OOM_KILLER in line for line in lines)
    if not oom_killed:
        for found in (_oom(lines), _timeout(lines)):
            if found is not None:
                return found
    exited = _rank_exit(lines)
    if oom_killed:
        rank = exited.rank if exited is not None and exited.exit_status is None else None
        who = "a process of the unit"
        if rank is not None:
            who = f"rank {rank}" + (f" ({exited.role})" if exited and exited.role else "")
        return Cause(
            "oom_killer",
            f"{who} killed by the kernel's OOM killer (host or CT memory exhausted)",
            rank=rank,
            role=exited.role if exited and rank is not None else None,
        )
    if result == "watchdog":
        where = next((ln for ln in lines if "Watchdog timeout" in ln), "")
        return Cause(
            "watchdog",
            "watchdog timeout: no step finished within WatchdogSec (a hung step, collective or rank); "
            "the job was killed",
            detail=where,
        )
    for line in lines:
        m = _NODE_LEFT.search(line)
        if m:
            return Cause("node_left", m.group(1)[:300], detail=line)
    if exited is not None:
        return exited
    for line in lines:  # one process, or a failure before the launcher: the critical line
        rank, role, level, text = _split(line)
        if level == "critical" or text.startswith("configuration: "):
            return Cause("failed", text.splitlines()[0][:300], rank=rank, role=role, detail=line)
    status = f"{exit_code or 'exited'} {exit_status}".strip()
    return Cause("failed", f"the unit failed: result {result or 'unknown'} ({status})")
