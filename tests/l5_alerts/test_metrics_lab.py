"""The training's series in the lab's Prometheus (Debian's, lab/prometheus.py), scraped from node_exporter in
the lab CT (roles/trainer_metrics), which serves what dflash-alert-watch.service writes: they exist, with
plausible values, while the lab's two-rank job trains."""

from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request

import pytest

from lab import prometheus

API = f"http://{prometheus.HOST}:{prometheus.PORT}/api/v1/query"


def query(expr: str) -> dict[tuple[tuple[str, str], ...], float]:
    with urllib.request.urlopen(f"{API}?{urllib.parse.urlencode({'query': expr})}", timeout=5) as reply:
        data = json.load(reply)["data"]["result"]
    return {
        tuple(sorted((k, v) for k, v in r["metric"].items() if k in ("rank", "role", "state"))): float(
            r["value"][1]
        )
        for r in data
    }


def one(expr: str) -> float:
    got = query(expr)
    assert len(got) == 1, (expr, got)
    return next(iter(got.values()))


@pytest.fixture
def prom():
    try:
        urllib.request.urlopen(f"http://{prometheus.HOST}:{prometheus.PORT}/-/ready", timeout=3)
    except OSError:
        pytest.skip("the lab's Prometheus is not answering (make lab)")


def test_the_series_exist_with_plausible_values(fresh, prom):
    ct = fresh
    t0 = time.time()
    ct.sh("systemctl start --no-block dflash-train")
    ct.wait_for(lambda: (ct.status_step() or 0) >= 30, 240, "STATUS at step 30")

    def scraped() -> bool:  # the watch writes every 15 s at most, Prometheus scrapes every 5 s
        return (
            bool(query("dflash_train_up == 1"))
            and one("dflash_train_step") >= 20
            and bool(query("dflash_train_preflight_seconds"))
            and one("dflash_train_last_step_timestamp_seconds") > t0
        )

    ct.wait_for(scraped, 60, "the job's figures in Prometheus", interval=2)
    step = one("dflash_train_step")
    assert 20 <= step <= (ct.status_step() or 0) + 1
    loss = one("dflash_train_loss")
    assert math.isfinite(loss) and 0 < loss < 20  # the tiny target's vocabulary of 512: ln 512 = 6.2
    rates = query("dflash_train_rank_tokens_per_second")
    assert {dict(k)["role"] for k in rates} == {"target", "drafter"} and all(v > 0 for v in rates.values()), (
        rates
    )
    assert one("dflash_train_pipeline_tokens_per_second") > 0
    shares = query("dflash_train_rank_time_share")
    for rank in ("0", "1"):
        total = sum(v for k, v in shares.items() if dict(k)["rank"] == rank)
        assert abs(total - 1.0) < 0.02, (rank, shares)
    assert one("dflash_train_checkpoint_step") >= 10  # checkpoint_every 10 in the lab
    assert 0 <= one("dflash_train_checkpoint_age_seconds") < 120
    assert 1 <= one("dflash_train_checkpoints_on_disk") <= 3  # lab.toml's keep_last 2, one more mid-prune
    assert one("dflash_train_restarts") == 0
    assert 0 < one("dflash_train_preflight_seconds") < 120
    assert 0 < one("dflash_train_start_seconds") < 240
    assert one("node_textfile_scrape_error") == 0  # node_exporter read the file
    print(f"\nPrometheus: step {step:.0f}, loss {loss:.3f}, ranks {rates}")
