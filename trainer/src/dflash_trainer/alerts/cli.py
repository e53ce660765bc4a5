"""`python -m dflash_trainer.alerts hook|drain|test|classify`: the notifier's commands.

hook start|stop|failure   from the unit (ExecStartPost=, ExecStopPost=, the OnFailure= unit): spools the
                          event and returns at once; it never fails the unit
drain                     dflash-alert.service: every spooled event to the webhook
test                      one test message through the configured webhook (checks the URL and the format)
classify                  the cause of the unit's last stop, as the drain would tell it
follow                    dflash-alert-watch.service: stall/slowdown/stale-checkpoint alerts, metrics textfile
status                    the unit on one screen (make status)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_trainer.alerts import journal, message, spool
from dflash_trainer.alerts.classify import classify
from dflash_trainer.alerts.settings import DEFAULT_PATH, Settings, SettingsError, load
from dflash_trainer.alerts.webhook import Poster, WebhookError, read_url

log = logging.getLogger("dflash_trainer.alerts")


def poster(settings: Settings) -> Poster | None:
    try:
        url = read_url(settings.webhook_url_file)
    except WebhookError as e:
        log.warning("%s: alerts are written to this journal only", e)
        return None
    return Poster(url, settings.webhook_format, settings.attempts, settings.timeout_s, settings.backoff_s)


def _send(settings: Settings):
    post = poster(settings)

    def send(msg: dict) -> bool:
        log.info("alert: %s", msg["text"].replace("\n", " | "))
        return post.post(msg) if post is not None else False

    return send


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_trainer.alerts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--settings", type=Path, default=DEFAULT_PATH)
    sub = parser.add_subparsers(dest="command", required=True)
    hook = sub.add_parser("hook", help="spool an event from the unit")
    hook.add_argument("hook", choices=("start", "stop", "failure"))
    hook.add_argument("--unit", default="", help="the unit (default: the settings' unit)")
    sub.add_parser("drain", help="send every spooled event")
    sub.add_parser("test", help="send a test message")
    sub.add_parser("classify", help="print the cause of the unit's last stop")
    sub.add_parser("follow", help="follow the journal: stall/slowdown alerts and the metrics textfile")
    sub.add_parser("status", help="the unit on one screen")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    # The hook never fails the unit and never waits: the event is a file, the rest is the drain's.
    if args.command == "hook":
        try:
            settings = load(args.settings)
            env = dict(os.environ)
            unit = env.get("MONITOR_UNIT") or args.unit or settings.unit
            if args.hook == "failure":
                from dflash_trainer.alerts.drain import unit_property

                env["DFLASH_ALERT_ACTIVE_STATE"] = unit_property(unit, "ActiveState")
            event = spool.hook_event(args.hook, env, unit)
            spool.put(settings.spool_dir, event)
        except Exception as e:
            print(f"dflash-alert hook {args.hook}: event not spooled: {e}", file=sys.stderr)
        return 0
    try:
        settings = load(args.settings)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "drain":
        from dflash_trainer.alerts.drain import drain

        drain(settings, _send(settings))
        return 0
    if args.command == "follow":
        from dflash_trainer.alerts.follow import follow

        follow(settings, every_s=max(1.0, min(15.0, settings.slow_minutes * 60 / 5)))
        return 1  # journalctl ended: systemd restarts the watch
    if args.command == "status":
        from dflash_trainer.alerts.status import report

        print(report(settings))
        return 0
    if args.command == "test":
        post = poster(settings)
        if post is None:
            return 1
        msg = message.build(
            "test", unit=settings.unit, host=settings.host, ct=settings.ct, cause=None, step=None,
            max_steps=None, checkpoint=None, restarts=None, note="a test of the training alerts",
        )  # fmt: skip
        ok = post.post(msg)
        print("delivered" if ok else "not delivered (see the warning above)")
        return 0 if ok else 1
    from dflash_trainer.alerts.drain import unit_property

    invocation = unit_property(settings.unit, "InvocationID")
    result = unit_property(settings.unit, "Result")
    lines = journal.invocation_lines(journal.entries(settings.unit), invocation)
    cause = classify(lines, result)
    print(f"{cause.title}: {cause.summary}")
    return 0
