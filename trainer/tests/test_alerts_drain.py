"""The drain and the webhook (alerts/drain.py, webhook.py): events to messages, posted to a real HTTP server
on loopback; an unreachable endpoint costs bounded retries and one warning; the URL never reaches a log."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
from pathlib import Path

import pytest
from test_alerts_classify import OOM_RANK1

from dflash_trainer.alerts import spool
from dflash_trainer.alerts.drain import drain, handle
from dflash_trainer.alerts.settings import Settings, SettingsError, load
from dflash_trainer.alerts.state import State
from dflash_trainer.alerts.webhook import Poster, WebhookError, read_url


class Receiver(http.server.ThreadingHTTPServer):
    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append((dict(self.headers), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/SECRET-TOKEN"


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.shutdown()


def entries(lines: list[str], invocation: str) -> list[dict[str, str]]:
    return [{"MESSAGE": line, "_SYSTEMD_INVOCATION_ID": invocation} for line in lines]


def settings(tmp_path: Path, **kw) -> Settings:
    from test_config import write_config

    (tmp_path / "ckpt" / "step-00000020").mkdir(parents=True)
    # A relative checkpoint_dir: resolved against the TOML's directory, as the trainer resolves it.
    config = write_config(tmp_path, {"train": {"checkpoint_dir": "ckpt", "max_steps": 100}})
    return Settings(
        host="pve1", ct="200 (ct200)", train_config=config, spool_dir=tmp_path / "spool",
        state_dir=tmp_path / "state", **kw,
    )  # fmt: skip


def props(values: dict[str, str]):
    return lambda _unit, prop: values.get(prop, "")


def test_a_failure_then_its_recovery_then_a_gave_up(tmp_path: Path) -> None:
    s, st, sent = settings(tmp_path), State(tmp_path / "state"), []
    fail = {"hook": "stop", "unit": s.unit, "invocation": "inv1", "result": "exit-code", "exit_status": "1"}
    msg = handle(fail, s, st, lambda m: sent.append(m) or True, lambda _u: entries(OOM_RANK1, "inv1"),
                 props({"NRestarts": "0", "StartLimitBurst": "5"}))  # fmt: skip
    assert msg is not None and msg["event"] == "failed" and msg["severity"] == "critical"
    assert msg["cause"]["kind"] == "cuda_oom" and msg["cause"]["rank"] == 1 and msg["cause"]["gpu"] == 0
    assert msg["step"] == 20 and msg["max_steps"] == 100 and msg["checkpoint"]["step"] == 20
    assert "CUDA out of memory on rank 1 (drafter) on GPU 0" in msg["text"] and "pve1" in msg["text"]
    # The same stop again (an OnFailure= between restarts on a newer systemd): not sent twice.
    again = fail | {"hook": "failure", "active_state": "activating"}
    assert handle(again, s, st, sent.append, lambda _u: [], props({})) is None

    start = {"hook": "start", "unit": s.unit, "invocation": "inv2"}
    msg = handle(start, s, st, sent.append, lambda _u: [], props({"NRestarts": "1"}))
    assert msg is not None and msg["event"] == "recovered" and "CUDA out of memory" in msg["text"]
    assert handle(start | {"invocation": "inv3"}, s, st, sent.append, lambda _u: [], props({})) is None

    # systemd 252: the OnFailure= unit runs once the start limit is hit, with the last failure's result.
    gave = {
        "hook": "failure",
        "unit": s.unit,
        "invocation": "inv4",
        "result": "exit-code",
        "active_state": "failed",
    }
    msg = handle(gave, s, st, sent.append, lambda _u: entries(OOM_RANK1, "inv4"),
                 props({"StartLimitBurst": "5", "StartLimitIntervalUSec": "1h"}))  # fmt: skip
    assert msg is not None and msg["event"] == "gave_up" and msg["cause"]["kind"] == "start_limit"
    assert "failed 5 times within 1h; the last failure: CUDA out of memory on rank 1" in msg["text"]
    assert State(tmp_path / "state").data["last_failure"]["kind"] == "start_limit"


def test_each_watch_event_makes_a_warning_with_what_the_watch_saw(tmp_path: Path) -> None:
    from dflash_trainer.alerts.watch import WATCH_EVENTS

    s, st = settings(tmp_path), State(tmp_path / "state")
    for n, kind in enumerate(WATCH_EVENTS):
        what = f"what the watch saw of {kind}"
        event = {"hook": "watch", "unit": s.unit, "event": kind, "what": what, "step": 7, "time": n}
        msg = handle(event, s, st, lambda _m: True, lambda _u: [], props({}))
        assert msg is not None and msg["event"] == kind and msg["severity"] == "warning", msg
        assert what in msg["text"] and msg["checkpoint"]["step"] == 20
    unknown = {"hook": "watch", "unit": s.unit, "event": "no_such_event", "what": "x", "time": 99}
    assert handle(unknown, s, st, lambda _m: True, lambda _u: [], props({})) is None


@pytest.mark.parametrize("fmt", ["generic", "slack", "ntfy"])
def test_drain_posts_each_spooled_event_in_the_format(
    tmp_path: Path, receiver: Receiver, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = settings(tmp_path, webhook_format=fmt)
    spool.put(s.spool_dir, {"hook": "stop", "unit": s.unit, "invocation": "i9", "result": "success"})
    post = Poster(receiver.url, fmt, attempts=1)
    lines = ["rank 1 drafter: stopped at step 23; checkpoint x", "launcher: all 2 rank(s) stopped cleanly"]
    monkeypatch.setattr("dflash_trainer.alerts.journal.entries", lambda _u, **_k: entries(lines, "i9"))
    monkeypatch.setattr("dflash_trainer.alerts.drain.unit_property", props({}))
    assert drain(s, post.post) == 1
    assert spool.pending(s.spool_dir) == []
    ((headers, body),) = receiver.got
    if fmt == "generic":
        data = json.loads(body)
        assert (
            data["event"] == "stopped"
            and data["cause"]["summary"] == "stopped cleanly at step 23, checkpoint saved"
        )
    elif fmt == "slack":
        assert set(json.loads(body)) == {"text"} and "stopped cleanly at step 23" in json.loads(body)["text"]
    else:
        assert headers["Title"].startswith("dflash-train stopped cleanly on 200 (ct200) on pve1")
        assert headers["Priority"] == "default" and b"stopped cleanly at step 23" in body


def test_an_unreachable_endpoint_costs_bounded_retries_and_one_warning(caplog) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    slept: list[float] = []
    post = Poster(f"http://127.0.0.1:{port}/secret-path?token=SECRET", attempts=3, backoff_s=0.5,
                  sleep=slept.append)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert post.post({"title": "t", "text": "x", "severity": "info"}) is False
    assert slept == [0.5, 1.0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "after 3 attempt(s)" in warnings[0] and "ConnectionRefused" in warnings[0]
    assert "SECRET" not in warnings[0] and "secret-path" not in warnings[0]


def test_the_url_file_and_settings_are_checked_naming_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(WebhookError, match="no-such: No such file"):
        read_url(tmp_path / "no-such")
    (tmp_path / "u").write_text("ftp://x/SECRET\n")
    with pytest.raises(WebhookError, match="not an http") as e:
        read_url(tmp_path / "u")
    assert "SECRET" not in str(e.value)
    (tmp_path / "s.json").write_text(json.dumps({"webhook_format": "teams"}))
    with pytest.raises(SettingsError, match="webhook_format 'teams'"):
        load(tmp_path / "s.json")
    (tmp_path / "s.json").write_text(json.dumps({"colour": 1}))
    with pytest.raises(SettingsError, match="unknown key"):
        load(tmp_path / "s.json")
    (tmp_path / "s.json").write_text(json.dumps({"attempts": "3"}))
    with pytest.raises(SettingsError, match="attempts must be a number"):
        load(tmp_path / "s.json")
