"""The notifier's memory across events (root-only JSON): what was sent, the last failure and its cause."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

KEEP = 200  # sent keys remembered


class State:
    def __init__(self, directory: Path) -> None:
        self.path = directory / "state.json"
        try:
            self.data: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.data.setdefault("sent", [])

    def seen(self, key: str) -> bool:
        return key in self.data["sent"]

    def mark(self, key: str) -> None:
        self.data["sent"] = [*self.data["sent"], key][-KEEP:]

    def save(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # no secret: `make status` reads it
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)
