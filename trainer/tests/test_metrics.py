"""The job's end-of-run figures (distributed/metrics.py): the pipeline's rate and the --metrics-out JSON."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trainer.distributed.metrics import RankSummary, pipeline_tokens_per_s, write_metrics


def summary(rank: int, role: str, tokens: int, steady_wall_s: float) -> RankSummary:
    return RankSummary(
        rank, role, "cpu", "h", wall_s=10.0, items=4, tokens=tokens, seconds={"busy": 5.0}, inflight_mean=1.0,
        intervals=[(0.0, 1.0, "busy")], steady_wall_s=steady_wall_s, steady_tokens=tokens,
    )  # fmt: skip


def test_the_pipeline_rate_is_the_drafters_tokens_over_the_longest_drafter_steady_wall() -> None:
    target = summary(0, "target", 9000, 1.0)
    ranks = [target, summary(1, "drafter", 300, 2.0), summary(2, "drafter", 500, 4.0)]
    assert pipeline_tokens_per_s(ranks) == 200.0  # (300 + 500) / 4, the target's tokens not counted
    assert pipeline_tokens_per_s([target]) == 0.0  # no drafter: no rate


def test_the_metrics_file_holds_the_rate_and_each_rank_without_its_intervals(tmp_path: Path) -> None:
    path = tmp_path / "new" / "metrics.json"  # its directory made
    write_metrics([summary(1, "drafter", 300, 2.0)], path)
    data = json.loads(path.read_text())
    assert data["pipeline_tokens_per_s"] == 150.0
    assert [r["rank"] for r in data["ranks"]] == [1]
    assert "intervals" not in data["ranks"][0] and data["ranks"][0]["tokens"] == 300
