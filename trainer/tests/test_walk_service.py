"""Where the decode walk's figures go: STATUS (systemd's notify socket), the trackers, the rank summary and
the smoke report."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

from dflash_trainer.service.notify import Notifier
from dflash_trainer.service.serve import ServiceHooks
from dflash_trainer.service.smoke import report
from dflash_trainer.train.drafter_side import StepMetrics

FIGURES = {
    "loss": 4.2,
    "anchor_accept": 3.4,
    "walk_tau": 2.38,
    "walk_tau_pooled": 1.69,
    "walk_tok_s": 250.0,
    "walk_steps": 1191.0,
    "walk_s": 8.2,
}


class Recorder:
    name = "recorder"
    failed = None

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        self.logged.append((step, values))


def _metrics(step: int, figures: dict[str, float] | None = None) -> StepMetrics:
    return StepMetrics(
        step=step, loss=5.0, lr=1e-3, grad_norm=1.0, num_tokens=8, seq_tokens=64, anchor_accept=1.5,
        per_position_acc=[0.5], step_s=0.1, tokens_per_s=640.0, eval=dict(figures or {}),
    )  # fmt: skip


def test_status_trackers_and_summary_carry_the_newest_walk(tmp_path, capsys) -> None:
    path = str(tmp_path / "notify")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(2)
    cfg = SimpleNamespace(
        service=SimpleNamespace(status_every=5), train=SimpleNamespace(log_every=5, device="cpu")
    )
    tracker = Recorder()
    hooks = ServiceHooks(cfg, Notifier({"NOTIFY_SOCKET": path}), [tracker])

    def statuses() -> list[str]:
        out = []
        while True:
            try:
                out += [f for f in server.recv(4096).decode().split("\n") if f.startswith("STATUS=")]
            except TimeoutError:
                return out

    hooks(_metrics(5))
    assert "walk tau" not in statuses()[-1]
    hooks(_metrics(10, FIGURES))
    server.settimeout(0.5)
    assert statuses()[-1].endswith("walk tau 2.38 @ 10")
    hooks(_metrics(15))  # later STATUS lines keep the newest evaluation's figure and its step
    assert statuses()[-1].endswith("walk tau 2.38 @ 10")
    values = next(v for s, v in tracker.logged if s == 10)
    assert values["eval/walk_tau"] == 2.38 and values["eval/anchor_accept"] == 3.4
    assert values["train/anchor_accept"] == 1.5 and "train/acceptance_length" not in values
    summary = hooks.summary()
    assert summary["eval_step"] == 10 and summary["eval"]["walk_tau"] == 2.38
    server.close()

    # The smoke report prints the drafter leader's newest evaluation (other checks fail here: no run).
    for phase, at in (("phase1", 10), ("phase2", 20)):
        (tmp_path / phase).mkdir()
        rank = summary | {"eval_step": at, "eval": FIGURES | {"walk_tau": at / 8}}
        (tmp_path / phase / "summary-rank0.json").write_text(json.dumps(rank))
    assert report(tmp_path, steps=20, stop_at=10, t0=None) == 1
    out = capsys.readouterr().out
    assert (
        "evaluation at step 20: held-out anchor_accept 3.40, walk tau 2.50 (1191 verify steps, 8.2 s)" in out
    )
