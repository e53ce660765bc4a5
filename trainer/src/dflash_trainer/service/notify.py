"""sd_notify(3) over $NOTIFY_SOCKET with the stdlib socket module; every call is a no-op when it is unset.

READY=1 once models and data are loaded, STATUS= lines that `systemctl status` shows, WATCHDOG=1 from the
training loop itself, STOPPING=1 on a graceful stop, EXTEND_TIMEOUT_USEC= while a long load or save runs.
Under the launcher the ranks are children of the unit's main process, so the unit needs NotifyAccess=all;
$WATCHDOG_PID names the launcher and is deliberately not checked here.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("dflash_trainer.service")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if path.startswith("@"):  # abstract namespace
            self.address = "\0" + path[1:]
        elif path.startswith("/"):
            self.address = path
        usec = env.get("WATCHDOG_USEC", "")
        self.watchdog_s: float | None = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 else None
        self._sock: socket.socket | None = None
        self._failed = False
        self._last_ping = 0.0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Sends newline-separated `KEY=VALUE` fields; False when there is no socket or the send failed."""
        if self.address is None:
            return False
        message = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self.address)
            return True
        except OSError as e:
            if not self._failed:  # one line, not one per step
                log.warning(
                    "sd_notify to %s failed: %s (systemd will not see READY/STATUS/WATCHDOG)", self.address, e
                )
                self._failed = True
            return False

    def ready(self, status: str | None = None) -> bool:
        # Never MAINPID=: the launcher stays the unit's main process (KillMode=mixed signals it alone).
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def watchdog(self, *, force: bool = False) -> bool:
        """WATCHDOG=1, at most ten times per watchdog interval (steps of a few ms need not each ping)."""
        if self.watchdog_s is None or self.address is None:
            return False
        now = time.monotonic()
        if not force and now - self._last_ping < self.watchdog_s / 10:
            return False
        self._last_ping = now
        return self.send("WATCHDOG=1")

    def alive(self) -> bool:
        """Work advanced: WATCHDOG=1 (rate-limited), and the stack dump re-armed for 80 % of the watchdog
        interval, so that a hang prints every thread's stack into the journal before systemd's watchdog
        fires."""
        if self.watchdog_s:
            faulthandler.dump_traceback_later(self.watchdog_s * 0.8, exit=False)
        return self.watchdog()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Heartbeat:
    """What a long phase between two steps is doing (an evaluation's decode walk: 375 s on the reference
    target, past the unit's WatchdogSec=300), said as the work advances: WATCHDOG=1 (the phase is alive: it is
    called only when a piece of work finished), STATUS= and a journal line every `every_s` seconds, and the
    stack dump re-armed for 80 % of the watchdog interval, so a phase that stops moving is still caught.

    Any rank may hold one (NotifyAccess=all): in a pipeline the evaluating target rank is not the rank that
    speaks for the steps, and its drafter leader may be waiting on it meanwhile."""

    def __init__(self, notifier: Notifier, *, every_s: float = 10.0) -> None:
        self.notifier, self.every_s = notifier, every_s
        self._said = time.monotonic()

    def __call__(self, text: str) -> None:
        self.notifier.alive()
        now = time.monotonic()
        if now - self._said >= self.every_s:
            self._said = now
            self.notifier.status(text[:200])
            log.info("%s", text)
