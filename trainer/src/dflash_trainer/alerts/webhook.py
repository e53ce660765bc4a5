"""Posting a message to the configured webhook: generic JSON, Slack-compatible, ntfy-style.

- generic: the message as JSON (event, host, ct, unit, step, checkpoint, cause, text).
- slack: `{"text": ...}`, what Slack's, Mattermost's and Rocket.Chat's incoming webhooks take.
- ntfy: the text as the body, with ntfy's `Title`, `Priority` and `Tags` headers (docs.ntfy.sh/publish).

The URL is a secret: it is read from a root-only file and never printed; an error names the host only.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("dflash_trainer.alerts")

FORMATS = ("generic", "slack", "ntfy")
NTFY_PRIORITY = {"critical": "urgent", "warning": "high", "info": "default"}
NTFY_TAGS = {"critical": "rotating_light", "warning": "warning"}


class WebhookError(ValueError):
    pass


def read_url(path: Path) -> str:
    """The webhook URL from its file (first line); an error names the file, never its content."""
    try:
        url = path.read_text().strip().splitlines()[0].strip() if path.read_text().strip() else ""
    except OSError as e:
        raise WebhookError(f"webhook URL file {path}: {e.strerror}") from None
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookError(f"webhook URL file {path}: not an http(s) URL")
    return url


def redacted(url: str) -> str:
    """What a log line may say about the URL: scheme, host and port (the path or a query is the token)."""
    p = urllib.parse.urlsplit(url)
    return f"{p.scheme}://{p.hostname}{':' + str(p.port) if p.port else ''}/..."


def request_for(fmt: str, url: str, message: dict[str, Any]) -> urllib.request.Request:
    if fmt == "generic":
        body, headers = json.dumps(message).encode(), {"Content-Type": "application/json"}
    elif fmt == "slack":
        body, headers = json.dumps({"text": message["text"]}).encode(), {"Content-Type": "application/json"}
    elif fmt == "ntfy":
        body = message["text"].encode()
        headers = {
            "Content-Type": "text/plain; charset=utf-8",
            "Title": message["title"].encode("ascii", "replace").decode(),
            "Priority": NTFY_PRIORITY.get(message["severity"], "default"),
            "Tags": NTFY_TAGS.get(message["severity"], "information_source"),
        }
    else:
        raise WebhookError(f"webhook format {fmt!r}: want one of {', '.join(FORMATS)}")
    return urllib.request.Request(url, data=body, headers=headers, method="POST")


@dataclass
class Poster:
    url: str
    fmt: str = "generic"
    attempts: int = 4
    timeout_s: float = 5.0
    backoff_s: float = 1.0  # doubled after each failed attempt
    sleep: Callable[[float], None] = time.sleep

    def post(self, message: dict[str, Any]) -> bool:
        """True once the endpoint answered 2xx; after `attempts` failures one warning and False."""
        request = request_for(self.fmt, self.url, message)
        error = ""
        for attempt in range(self.attempts):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    if 200 <= reply.status < 300:
                        return True
                    error = f"HTTP {reply.status}"
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}"
                if 400 <= e.code < 500 and e.code not in (408, 429):
                    break  # the request is wrong (a bad token, a bad format): retrying will not help
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                error = f"{type(reason).__name__}: {getattr(reason, 'strerror', None) or reason}"
            if attempt + 1 < self.attempts:
                self.sleep(self.backoff_s * 2**attempt)
        log.warning(
            "alert %r not delivered to %s after %d attempt(s): %s (training is not affected)",
            message.get("title"),
            redacted(self.url),
            attempt + 1,
            error,
        )
        return False
