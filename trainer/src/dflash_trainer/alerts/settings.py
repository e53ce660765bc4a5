"""The notifier's settings: one JSON file written by roles/trainer_alerts (/etc/dflash/alerts.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from dflash_trainer.alerts.webhook import FORMATS

DEFAULT_PATH = Path("/etc/dflash/alerts.json")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    unit: str = "dflash-train.service"
    host: str = ""  # the Proxmox host the CT lives on
    ct: str = ""  # the CT (its VMID and name)
    train_config: Path = Path("/etc/dflash/train.toml")
    webhook_url_file: Path = Path("/etc/dflash/alerts-webhook.url")
    webhook_format: str = "generic"
    attempts: int = 4
    timeout_s: float = 5.0
    backoff_s: float = 1.0
    spool_dir: Path = Path("/run/dflash-alerts")
    state_dir: Path = Path("/var/lib/dflash-alerts")
    # Stall and slowdown (watch.py): tokens/s below this share of the run's median for this long.
    slow_share: float = 0.5
    slow_minutes: float = 10.0
    # No checkpoint for more than this many checkpoint intervals' worth of time.
    checkpoint_intervals: float = 2.0
    # Prometheus textfile (metrics.py): node_exporter's textfile collector directory; "" for none.
    textfile_dir: str = ""


def load(path: Path = DEFAULT_PATH) -> Settings:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise SettingsError(f"alert settings {path}: {e.strerror}") from None
    except ValueError as e:
        raise SettingsError(f"alert settings {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"alert settings {path}: want a JSON object")
    known = {f.name: f for f in fields(Settings)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SettingsError(f"alert settings {path}: unknown key(s) {', '.join(unknown)}")
    values = {}
    for key, value in data.items():
        kind = known[key].type
        if kind in ("Path",):
            value = Path(value)
        elif kind in ("int", "float") and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise SettingsError(f"alert settings {path}: {key} must be a number, got {value!r}")
        elif kind == "str" and not isinstance(value, str):
            raise SettingsError(f"alert settings {path}: {key} must be a string, got {value!r}")
        values[key] = value
    s = Settings(**values)
    if s.webhook_format not in FORMATS:
        raise SettingsError(
            f"alert settings {path}: webhook_format {s.webhook_format!r}: want one of {', '.join(FORMATS)}"
        )
    if s.attempts < 1 or s.timeout_s <= 0 or not 0 < s.slow_share < 1:
        raise SettingsError(f"alert settings {path}: attempts >= 1, timeout_s > 0, 0 < slow_share < 1")
    return s
