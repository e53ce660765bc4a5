"""Log lines for the journal: `rank R ROLE: message`, plus the journal's priority prefix.

journald reads a leading `<N>` as the line's syslog priority (SyslogLevelPrefix=yes, the default), so warnings
and errors are coloured and filterable with `journalctl -p warning` while every line still names its rank.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class RankFormatter(logging.Formatter):
    def __init__(self, role: str, *, journal: bool) -> None:
        super().__init__()
        self.role = role
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        prefix = "launcher: " if self.role == "launcher" else f"rank {rank()} {self.role}: "
        if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":  # several nodes: every line names its node
            prefix = f"node {os.environ.get('GROUP_RANK', '?')} {prefix}"
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        lines = [prefix + level + line for line in message.splitlines() or [""]]
        if self.journal:
            prio = _PRIORITY.get(record.levelno, 6)
            lines = [f"<{prio}>{line}" for line in lines]
        return "\n".join(lines)


_formatter: RankFormatter | None = None


def setup_logging(role: str | None = None, *, level: int = logging.INFO) -> None:
    """Root logging to stderr, each line prefixed; uncaught exceptions (any thread) logged alike."""
    global _formatter
    role = role or os.environ.get("DFLASH_ROLE", "trainer")
    _formatter = RankFormatter(role, journal=bool(os.environ.get("JOURNAL_STREAM")))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)

    def excepthook(tp, value, tb) -> None:
        logging.getLogger("dflash_trainer").critical(
            "uncaught %s: %s", tp.__name__, value, exc_info=(tp, value, tb)
        )

    sys.excepthook = excepthook
    threading.excepthook = lambda a: excepthook(a.exc_type, a.exc_value, a.exc_traceback)


def set_role(role: str) -> None:
    """The pipeline assigns roles (target, drafter) after start-up; later lines carry the new one."""
    if _formatter is not None:
        _formatter.role = role
