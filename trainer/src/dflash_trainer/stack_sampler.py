"""Where a start's seconds go between the phases it names: a sampling profiler of one thread.

The READY line times the loading by phase (startup.py) and the first-step line says what torch.compile spent
(compile_caches.py), but a cold first step on a GPU spends tens of seconds outside both (docs/benchmarks.md,
row `#first-start`). cProfile traces every call, dynamo's tracing included, and would change the figure it
measures; a thread that reads the main thread's stack every 10 ms (`sys._current_frames`) holds the GIL only
while it copies one stack, and names the functions the seconds went to, imports included. It reads the main
thread only: work on other threads (autograd's backward, a worker's copy) shows as the main thread's wait.

`DFLASH_PROFILE_START=DIR` (serve): samples from the rank's start to its first step, in windows split at
READY, and writes DIR/start-profile-rank<R>.txt: per window its seconds, the functions that held the most
samples (inclusive: a function counts in every sample whose stack holds it) and the trainer's deepest frames
with the call each was in, then the collapsed stacks (`window;outer;...;inner count`, flamegraph.pl's input).
Preflight's GPU probes (service.gpu_probe), its children, inherit the variable and write
DIR/probe-<name>-profile.txt alike, in windows split where their imports end and where each kernel has run;
a rank's first evaluation (train.target_side) writes DIR/eval-profile-rank<R>.txt, a window per evaluation.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ENV = "DFLASH_PROFILE_START"
OWN = "dflash_trainer/"  # the trainer's own frames: named from the package down


def frame_key(frame: FrameType) -> str:
    """`package/module.py:function`: the file's last two parts name it without this machine's paths; the
    trainer's own files from the package down (`dflash_trainer/method/anchors.py:sample_anchors`)."""
    code = frame.f_code
    parts = Path(code.co_filename).parts
    if "dflash_trainer" in parts:
        parts = parts[len(parts) - 1 - parts[::-1].index("dflash_trainer") :]
        return f"{'/'.join(parts)}:{code.co_name}"
    return f"{'/'.join(parts[-2:])}:{code.co_name}"


def stack_of(frame: FrameType | None) -> tuple[str, ...]:
    """The stack from its outermost frame to `frame`, without the import system's and runpy's own frames
    (`<frozen ...>`: an import shows as the importing module's `<module>` over the imported one's)."""
    keys: list[str] = []
    while frame is not None:
        if not frame.f_code.co_filename.startswith("<frozen "):
            keys.append(frame_key(frame))
        frame = frame.f_back
    return tuple(reversed(keys))


@dataclass
class Window:
    label: str
    started: float
    ended: float | None = None
    stacks: Counter[tuple[str, ...]] = field(default_factory=Counter)

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())


def inclusive(stacks: Counter[tuple[str, ...]]) -> Counter[str]:
    """Samples per function, each counted once per sample that holds it (recursion counts once)."""
    counts: Counter[str] = Counter()
    for stack, n in stacks.items():
        for key in set(stack):
            counts[key] += n
    return counts


def by_own_frame(stacks: Counter[tuple[str, ...]]) -> Counter[str]:
    """Samples per the trainer's deepest frame and the call it was in (`... -> torch/_tensor.py:backward`;
    `(itself)`: its own line, a host sync included): where the trainer's code handed its seconds to."""
    counts: Counter[str] = Counter()
    for stack, n in stacks.items():
        own = [i for i, key in enumerate(stack) if key.startswith(OWN)]
        if own:
            i = own[-1]
            counts[f"{stack[i]} -> {stack[i + 1] if i + 1 < len(stack) else '(itself)'}"] += n
    return counts


def summarize(window: Window, *, top: int = 40) -> str:
    """The window's seconds, its `top` functions by inclusive share and by the trainer's deepest frame, each
    as seconds of the window."""
    ended = window.ended if window.ended is not None else time.perf_counter()
    seconds = ended - window.started
    total = window.samples
    lines = [f"== {window.label}: {seconds:.1f} s, {total} samples"]
    if not total:
        return "\n".join(lines)
    per_sample = seconds / total
    for key, n in inclusive(window.stacks).most_common(top):
        lines.append(f"{n * per_sample:8.2f} s {100 * n / total:5.1f} %  {key}")
    lines.append("-- by the trainer's deepest frame")
    for key, n in by_own_frame(window.stacks).most_common(top // 2):
        lines.append(f"{n * per_sample:8.2f} s {100 * n / total:5.1f} %  {key}")
    return "\n".join(lines)


def collapsed(window: Window) -> list[str]:
    label = window.label.replace(" ", "_").replace(";", ",")
    return [f"{label};{';'.join(stack)} {n}" for stack, n in window.stacks.most_common()]


class StackSampler:
    """Samples `thread_id`'s stack (by default the calling thread's) every `interval` s, into windows."""

    def __init__(self, label: str, *, interval: float = 0.01, thread_id: int | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"interval {interval}: must be > 0")
        self.interval = interval
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.windows = [Window(label, time.perf_counter())]
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:  # the thread ended
                return
            stack = stack_of(frame)
            del frame
            with self._lock:
                self.windows[-1].stacks[stack] += 1

    def mark(self, label: str) -> None:
        """Ends the current window and starts `label`'s."""
        now = time.perf_counter()
        with self._lock:
            self.windows[-1].ended = now
            self.windows.append(Window(label, now))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        with self._lock:
            if self.windows[-1].ended is None:
                self.windows[-1].ended = time.perf_counter()

    def report(self, *, top: int = 40) -> str:
        with self._lock:
            windows = list(self.windows)
        summaries = [summarize(w, top=top) for w in windows]
        stacks = [line for w in windows for line in collapsed(w)]
        return "\n\n".join([*summaries, "== collapsed stacks\n" + "\n".join(stacks)]) + "\n"


def from_environment(label: str) -> StackSampler | None:
    """A started sampler of this thread when $DFLASH_PROFILE_START names a directory, else None."""
    return StackSampler(label).start() if os.environ.get(ENV) else None


def write_report(sampler: StackSampler, file_name: str) -> str:
    """Stops `sampler` and writes its report to $DFLASH_PROFILE_START/`file_name`; returns the path, or why it
    was not written (a diagnosis must not end the run or the probe it watched)."""
    sampler.stop()
    path = Path(os.environ[ENV]) / file_name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(sampler.report())
        tmp.replace(path)
    except OSError as e:
        return f"{path} not written ({ENV}: {e.strerror or e})"
    return str(path)
