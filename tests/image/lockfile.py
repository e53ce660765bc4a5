"""scripts/locks.py (the lock format: pins with their --hash lines) for the image tests."""

from __future__ import annotations

import importlib.util
import sys

from lab.settings import REPO

_spec = importlib.util.spec_from_file_location("locks", REPO / "scripts" / "locks.py")
assert _spec and _spec.loader
locks = importlib.util.module_from_spec(_spec)
sys.modules["locks"] = locks  # dataclasses look their module up there
_spec.loader.exec_module(locks)
