"""GPU memory per rank: the window line carries it (distributed/metrics.py), the alerts' figures read it and
the textfile exports it; the one-process step line likewise; a line without it (CPU ranks, older trainers)
still parses."""

from __future__ import annotations

from dflash_trainer.alerts.figures import Figures
from dflash_trainer.alerts.metrics import render
from dflash_trainer.device_memory import gpu_memory

WINDOW = "busy 94% data 1% wait_send 0% wait_recv 0% in-flight 1.9 tok/s 1434"


def test_the_window_lines_memory_reaches_the_textfile() -> None:
    f = Figures()
    f.feed(f"rank 0 target: item 29: {WINDOW} gpu_mem 61.25/70.50 GiB", 10.0, "inv")
    f.feed(f"rank 1 drafter: step 10: loss 6.3 anchor_accept 1.00 lr 2.67e-04 | {WINDOW}", 11.0, "inv")
    assert (f.ranks[0].gpu_allocated_gib, f.ranks[0].gpu_reserved_gib) == (61.25, 70.5)
    assert f.ranks[1].gpu_allocated_gib is None and f.ranks[1].tokens_per_s == 1434
    text = render(f, unit="u", active=True, restarts=0, max_steps=None, checkpoint_step=None,
                  checkpoint_age_s=None)  # fmt: skip
    lines = text.splitlines()
    labels = 'unit="u",rank="0",role="target",kind="allocated"'
    assert f"dflash_train_rank_gpu_memory_bytes{{{labels}}} {61.25 * 2**30}" in lines
    assert not any('rank="1"' in line and "gpu_memory" in line for line in lines)


def test_no_cuda_no_memory_in_the_line() -> None:
    assert gpu_memory() == ""  # this machine's ranks run on the CPU


def test_the_one_process_step_line_carries_it_too() -> None:
    f = Figures()
    line = (
        "rank 0 trainer: step 40 loss 5.1000 lr 5.00e-04 grad 1.20 anchor_accept 0.31 tok/s 812 "
        "gpu_mem 96.10/99.00 GiB"
    )
    f.feed(line, 5.0, "one")
    assert (f.step, f.ranks[0].tokens_per_s, f.ranks[0].gpu_allocated_gib) == (40, 812, 96.1)
