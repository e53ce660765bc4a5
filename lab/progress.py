"""Progress of the lab's long phases: a plain line at least every 10 s while one runs, saying what it does.

`make lab` and the first `make smoke-train` spend minutes in a few subprocesses (mmdebstrap, the CT image
build, seeding); a quiet terminal for minutes reads as a hang.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

EVERY_S = 10.0
_OUTPUT = threading.Lock()


def say(line: str) -> None:
    """Prints one whole line at once: the lab's threads (containers, image, seeding, heartbeats) print side by
    side, and print() writes the text and its newline separately, so two lines could run into one."""
    with _OUTPUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@contextmanager
def heartbeat(what: str, every: float = EVERY_S) -> Iterator[None]:
    """While the block runs, prints 'lab: WHAT: still running (N s)' every `every` seconds; then the total."""
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            say(f"lab: {what}: still running ({time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=beat, name="lab-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    elapsed = time.monotonic() - start
    if elapsed >= every:
        say(f"lab: {what}: done in {elapsed:.0f} s")
