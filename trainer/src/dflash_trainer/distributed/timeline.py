"""A per-rank timeline picture: one row per rank, busy/data/waiting as coloured bars, idle left blank."""

from __future__ import annotations

from pathlib import Path

from dflash_trainer.distributed.metrics import RankSummary

COLOURS = {"busy": "#2e7d32", "data": "#81c784", "wait_send": "#ef6c00", "wait_recv": "#c62828"}


def plot_timeline(
    summaries: list[RankSummary], path: str | Path, *, title: str = "pipeline timeline"
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a training host
    import matplotlib.pyplot as plt

    ordered = sorted(summaries, key=lambda s: s.rank)
    starts = [iv[0] for s in ordered for iv in s.intervals]
    t0 = min(starts) if starts else 0.0
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(ordered) + 1.5))
    for row, s in enumerate(ordered):
        for state, colour in COLOURS.items():
            bars = [(b - t0, e - b) for b, e, st in s.intervals if st == state]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, label=state if row == 0 else None)
    ax.set_yticks(range(len(ordered)))
    ax.set_yticklabels([f"{s.rank} {s.role} {s.device} ({s.idle:.0%} idle)" for s in ordered])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (blank: idle)")
    ax.set_title(title, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=4, fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
