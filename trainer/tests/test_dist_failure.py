"""Faults injected into a target rank and into a drafter rank under torchrun: the job ends, non-zero, fast,
and the log names the rank, its role, its device and the cause."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time

import pytest

from dflash_trainer.distributed.failure import Fault

pytestmark = pytest.mark.system

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*injecting fault", re.M)


def torchrun(nproc: int, *args: str, env: dict[str, str], timeout: float = 120) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["--monitor-interval=0.5", "-m", "dflash_trainer.distributed.rank", *args]
    proc = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.time()


def test_fault_spec_parses_and_rejects() -> None:
    assert Fault.parse("rank=1,step=3,kind=oom") == Fault(1, 3, "oom")
    with pytest.raises(ValueError, match="kind must be"):
        Fault.parse("rank=1,step=3,kind=segv")
    with pytest.raises(ValueError, match="want rank=R"):
        Fault.parse("rank=1")


@pytest.mark.parametrize("kind", ["raise", "oom", "kill"])
@pytest.mark.parametrize(("rank", "role"), [(0, "target"), (1, "drafter")])
def test_fault_ends_the_job_loudly(rank: int, role: str, kind: str) -> None:
    args = ["--synthetic", "--targets", "1", "--drafters", "1", "--steps", "400", "--drafter-s", "0.05"]
    args += ["--dead-after-s", "8", "--log-every", "1000"]
    code, log, ended = torchrun(2, *args, env={"DFLASH_FAULT": f"rank={rank},step=3,kind={kind}"})

    assert code != 0, log
    if kind != "kill":  # the root cause stands alone: peers say they stopped because of it
        assert set(re.findall(r"CRITICAL (rank \d+) \(", log)) == {f"rank {rank}"}, log
    injected = dt.datetime.strptime(STAMP.search(log).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert ended - injected < 30, f"job took {ended - injected:.0f} s to end after the fault\n{log}"
    me = rf"rank {rank} \({role}, cpu on [^)]+\)"
    if kind == "raise":
        assert re.search(rf"CRITICAL {me}: RuntimeError: injected failure at step 3", log), log
    elif kind == "oom":
        assert re.search(rf"CRITICAL {me}: OutOfMemoryError: CUDA out of memory\. Tried to allocate", log), (
            log
        )
        assert "no CUDA allocator on cpu" in log  # on a GPU: torch.cuda.memory_summary(abbreviated=True)
    else:
        # The killed rank says nothing; torchrun names the signal and the pid, which the rank's start line
        # ties to its role and device.
        pid = re.search(rf"INFO {me}: pid (\d+)", log).group(1)
        assert re.search(rf"Signal 9 \(SIGKILL\) received by PID {pid}", log), log


def test_another_threads_failure_is_logged_and_the_rank_goes_on(caplog) -> None:
    """A tracker's writer thread that fails (tensorboard on a full disk) must not end the rank."""
    import logging
    import sys
    import threading

    from dflash_trainer.distributed.failure import Identity, install_excepthooks

    saved = sys.excepthook, threading.excepthook
    try:
        install_excepthooks(Identity(1, "drafter", "cpu", "host"), "cpu", None)
        with caplog.at_level(logging.ERROR):

            def writer() -> None:
                raise OSError(28, "No space left on device")

            t = threading.Thread(target=writer, name="EventFileWriter")
            t.start()
            t.join()
    finally:
        sys.excepthook, threading.excepthook = saved
    [line] = [r.getMessage() for r in caplog.records if "thread EventFileWriter failed" in r.getMessage()]
    assert "training goes on" in line and "No space left on device" in line
