"""The run's figures from the trainer's journal lines (alerts/figures.py), the stall/slowdown/stale-checkpoint
decisions (alerts/watch.py) and the Prometheus textfile (alerts/metrics.py).

The step, item, ready and preflight lines were captured from the lab CT's two-rank dflash-train.service;
the one-process line is train/loop.py log_line's format."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_trainer.alerts.figures import Figures
from dflash_trainer.alerts.metrics import render
from dflash_trainer.alerts.run_state import TrainSettings
from dflash_trainer.alerts.watch import Alerting, Thresholds, check

READY = (
    "rank 1 drafter: ready: target, drafter, data and the newest checkpoint loaded on every rank; 22.8 s "
    "after this rank's process started (interpreter, imports included), 23.0 s after the launcher started"
)


def drafter(step: int, tok: int, loss: float = 6.3069) -> str:
    return (
        f"rank 1 drafter: step {step}: loss {loss} anchor_accept 1.00 lr 2.67e-04 | busy 62% data 0% "
        f"wait_send 0% wait_recv 36% in-flight 1.0 tok/s {tok}"
    )


TARGET = "rank 0 target: item 29: busy 94% data 1% wait_send 0% wait_recv 0% in-flight 1.9 tok/s 1434"


def run(rates: list[int], *, every_s: float = 10.0, t0: float = 1000.0) -> Figures:
    f = Figures()
    f.feed("preflight passed in 2.7 s", t0 - 30, "inv")
    f.feed(READY, t0, "inv")
    for i, tok in enumerate(rates):
        f.feed(TARGET, t0 + every_s * (i + 1) - 1, "inv")
        f.feed(drafter(10 * (i + 1), tok), t0 + every_s * (i + 1), "inv")
    return f


def test_the_journal_lines_give_step_loss_rates_and_shares() -> None:
    f = run([650, 1230])
    assert (f.step, f.loss, f.preflight_s, f.start_s) == (20, 6.3069, 2.7, 23.0)
    assert f.ranks[1].role == "drafter" and f.ranks[1].tokens_per_s == 1230
    assert f.ranks[0].shares == {"busy": 0.94, "data": 0.01, "wait_send": 0.0, "wait_recv": 0.0, "idle": 0.05}
    assert f.pipeline_tokens_per_s() == 1230  # the drafters' sum, not the target's items
    assert f.median_step_s() == 1.0  # 10 steps every 10 s
    f.feed(
        "rank 0 target: evaluation at step 50: loss 6.1666 anchor_accept 1.0000 walk_tau 1.0357 "
        "walk_tau_pooled 1.0345 walk_tok_s 44.7794 walk_steps 29.0000 walk_s 0.7146",
        1050,
        "inv",
    )
    assert (f.walk_tau, f.walk_tau_step) == (1.0357, 50)
    f.feed("rank 1 drafter: stopped at step 23; checkpoint /x/step-00000023", 1100, "inv")
    assert f.step == 23
    one = Figures()
    one.feed(
        "rank 0 trainer: step 40 loss 5.1000 lr 5.00e-04 grad 1.20 anchor_accept 0.31 tok/s 812 | held-out "
        "loss 5.3000 anchor_accept 0.30 walk tau 2.41 (12 verify steps, 3.1 s)",
        5.0,
        "one",
    )
    assert (one.step, one.loss, one.walk_tau, one.walk_tau_step, one.pipeline_tokens_per_s()) == (
        40,
        5.1,
        2.41,
        40,
        812,
    )


def test_slow_for_the_window_alerts_once_and_rearms() -> None:
    t = Thresholds(share=0.5, minutes=1.0)
    f = run([1000] * 12 + [300] * 7)  # 12 steps lines at speed, then 70 s at 30 %
    a = Alerting()
    now = 1000 + 10 * 19
    events = check(f, t, now, active=True, checkpoint_at=None, alerting=a)
    assert [e for e, _ in events] == ["slow"], events
    assert "below 50% of the run's median 1000 tokens/s" in events[0][1]
    assert check(f, t, now + 5, active=True, checkpoint_at=None, alerting=a) == []  # once per episode
    for i in range(8):
        f.feed(drafter(200 + 10 * i, 1000), now + 10 * (i + 1), "inv")
    assert check(f, t, now + 80, active=True, checkpoint_at=None, alerting=a) == []
    assert "slow" not in a.raised  # back to speed: re-armed


def test_a_short_dip_or_a_fresh_start_is_not_slow() -> None:
    t = Thresholds(share=0.5, minutes=1.0)
    dip = run([1000] * 12 + [1000, 300, 300, 1000, 300, 300, 300])
    assert check(dip, t, 1000 + 190, active=True, checkpoint_at=None, alerting=Alerting()) == []
    young = run([300] * 4)  # 40 s of a start: less than the window
    assert check(young, t, 1040, active=True, checkpoint_at=None, alerting=Alerting()) == []


def test_no_step_for_the_window_while_active_is_a_stall() -> None:
    t = Thresholds(minutes=1.0)
    f = run([1000] * 3)  # the last step line at 1030
    assert check(f, t, 1080, active=True, checkpoint_at=None, alerting=Alerting()) == []
    events = check(f, t, 1095, active=True, checkpoint_at=None, alerting=Alerting())
    assert [e for e, _ in events] == ["stalled"] and "(step 30)" in events[0][1]
    assert check(f, t, 1095, active=False, checkpoint_at=None, alerting=Alerting()) == []  # stopped: no stall


def test_no_checkpoint_for_two_intervals_alerts() -> None:
    t = Thresholds(minutes=100, intervals=2.0, checkpoint_every=50)  # 50 steps x 1 s: stale after 100 s
    f = run([1000] * 3)
    assert check(f, t, 1120, active=True, checkpoint_at=1025.0, alerting=Alerting()) == []
    events = check(f, t, 1126, active=True, checkpoint_at=1025.0, alerting=Alerting())
    assert [e for e, _ in events] == ["no_checkpoint"], events
    assert "no checkpoint for 101 s: more than 2 x checkpoint_every (50 steps x 1.00 s)" in events[0][1]
    short = Thresholds(minutes=100, intervals=2.0, checkpoint_every=5)  # 10 s: held to the 60 s floor
    assert check(f, short, 1080, active=True, checkpoint_at=1025.0, alerting=Alerting()) == []


def test_checkpoints_left_past_keep_last_plus_one_alert_once(tmp_path: Path) -> None:
    """A save removes the oldest after writing the newest; one that will not go (held open on NFS) is retried
    at the next save: keep_last + 1 on disk is normal, more means the removal keeps failing."""
    train = TrainSettings(checkpoint_dir=tmp_path, keep_last=2)
    for step in (10, 20, 30):
        (tmp_path / f"step-{step:08d}").mkdir()
    (tmp_path / ".tmp-step-00000040-77").mkdir()  # a write in progress: not a checkpoint yet
    t, f, alerting = Thresholds(minutes=100, keep_last=2), run([1000] * 3), Alerting()

    def events() -> list[tuple[str, str]]:
        on_disk = train.checkpoints()[1]
        return check(f, t, 1040, active=True, checkpoint_at=None, alerting=alerting,
                     checkpoints_on_disk=on_disk)  # fmt: skip

    assert train.checkpoints()[1] == 3 and events() == []
    (tmp_path / "step-00000040").mkdir()  # half removed (its state.pt gone, ema.pt held): still on disk
    ((kind, what),) = check(f, t, 1040, active=True, checkpoint_at=None, alerting=Alerting(),
                            checkpoints_on_disk=train.checkpoints()[1])  # fmt: skip
    assert kind == "old_checkpoints" and "4 checkpoints on disk, train.keep_last is 2" in what, what
    assert [e for e, _ in events()] == ["old_checkpoints"]
    assert events() == []  # once per episode
    (tmp_path / "step-00000010").rmdir()  # the reader closed; the next save's retry removed it
    assert events() == []
    (tmp_path / "step-00000050").mkdir()
    assert [e for e, _ in events()] == ["old_checkpoints"]  # re-armed
    assert TrainSettings().checkpoints() == (None, None)
    assert TrainSettings(checkpoint_dir=tmp_path / "none").checkpoints() == (None, 0)


def test_the_textfile_is_prometheus_text_with_every_series() -> None:
    f = run([650, 1230])
    f.walk_tau = 2.5
    text = render(f, unit="dflash-train.service", active=True, restarts=2, max_steps=100, checkpoint_step=20,
                  checkpoint_age_s=12.5, checkpoints_on_disk=3)  # fmt: skip
    sample = re.compile(r'^[a-z_]+(\{([a-z_]+="[^"]*",?)*\})? -?[\d.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    u = 'unit="dflash-train.service"'
    for want in (
        f"dflash_train_step{{{u}}} 20",
        f"dflash_train_max_steps{{{u}}} 100",
        f"dflash_train_loss{{{u}}} 6.3069",
        f"dflash_train_last_step_timestamp_seconds{{{u}}} 1020.0",
        f'dflash_train_rank_tokens_per_second{{{u},rank="1",role="drafter"}} 1230.0',
        f'dflash_train_rank_time_share{{{u},rank="0",role="target",state="busy"}} 0.94',
        f"dflash_train_walk_tau{{{u}}} 2.5",
        f"dflash_train_checkpoint_age_seconds{{{u}}} 12.5",
        f"dflash_train_checkpoints_on_disk{{{u}}} 3",
        f"dflash_train_restarts{{{u}}} 2",
        f"dflash_train_preflight_seconds{{{u}}} 2.7",
        f"dflash_train_start_seconds{{{u}}} 23.0",
        f"dflash_train_up{{{u}}} 1",
    ):
        assert want in text.splitlines(), want
    assert "# TYPE dflash_train_step gauge" in text
