"""The GPU probes beside a rank's start (service.probes_beside), when the unit's preflight deferred them: a
passed verdict is kept as preflight keeps it, a failed one stops the rank with preflight's line and fix, the
other local ranks wait for the verdict file, and the first FLA kernel launch waits for the verdict. The probe
children are real processes answering by gpu_probe's output contract (`ok: ...`, or `error: TYPE: MESSAGE`
and exit 1); the GPU is what is not here."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_run import TINY_JOB_STEPS as STEPS
from tiny_run import run_cli as run

from dflash_trainer.model import kernels
from dflash_trainer.service import preflight, probe_cache
from dflash_trainer.service.probes_beside import ProbeFailed, ProbesBeside

OK = "import time; time.sleep(1); print('ok: a Triton kernel compiled and ran')"
# Triton's launcher build failing, as gpu_probe reports it (its exception's last line).
FAILS = "import sys; print('error: CalledProcessError: returned non-zero exit status 1'); sys.exit(1)"
KEY = {"gpu": "NVIDIA H200", "shape": "-"}


def plan(cache: Path, answer: str) -> preflight.ProbePlan:
    return preflight.ProbePlan(
        commands={"triton": ([sys.executable, "-c", answer], 60)},
        keys={"triton": dict(KEY)},
        cache=probe_cache.VerdictCache(cache),
    )


def test_a_passed_probe_is_kept_and_the_wait_returns_once_it_has(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, "dflash_trainer.service")
    probes = ProbesBeside(plan(tmp_path / "verdicts.json", OK), runs=True)
    assert probes.running(), "the probe should still be running (it sleeps a second)"
    probes.wait("the first FLA kernel launch")
    assert not probes.running()
    probes.wait("the first step's end")
    kept = json.loads((tmp_path / "verdicts.json").read_text())["triton"]
    assert kept["verdict"] == "a Triton kernel compiled and ran" and kept["key"] == KEY
    lines = [r.getMessage() for r in caplog.records]
    assert any(ln.startswith("the first FLA kernel launch waits for the GPU probes") for ln in lines), lines
    [passed] = [ln for ln in lines if ln.startswith("GPU probes beside the start passed in ")]
    assert "(this rank waited " in passed and "): a Triton kernel compiled and ran [probes ran in " in passed
    assert probes.after_failure(0) is None


def test_a_failed_probe_stops_the_rank_with_preflights_line_and_is_not_kept(tmp_path) -> None:
    probes = ProbesBeside(plan(tmp_path / "verdicts.json", FAILS), runs=True)
    with pytest.raises(ProbeFailed) as failed:
        probes.wait("the first FLA kernel launch")
    line = str(failed.value)
    assert line.startswith("FAIL triton: a small Triton kernel did not compile and run: CalledProcessError")
    assert "-- fix: Triton could not build its launcher: install gcc and python3-dev" in line
    assert probes.after_failure(0) == line
    assert not (tmp_path / "verdicts.json").exists(), "a failed verdict was kept"


def test_another_local_rank_waits_for_local_rank_0s_verdict(tmp_path) -> None:
    cache = tmp_path / "verdicts.json"
    waiting = ProbesBeside(plan(cache, "raise SystemExit('not run: this rank does not probe')"), runs=False)
    probing = ProbesBeside(plan(cache, OK), runs=True)
    waiting.wait("the first FLA kernel launch")
    assert probing.done.is_set(), "the waiting rank went on before local rank 0's probe had passed"
    assert waiting.line == "a Triton kernel compiled and ran [kept by local rank 0's probes]"


def test_another_local_rank_that_sees_no_verdict_names_the_file(tmp_path) -> None:
    cache = tmp_path / "verdicts.json"
    probes = ProbesBeside(plan(cache, OK), runs=False, timeout_s=1)
    with pytest.raises(ProbeFailed, match=f"no verdict of the triton probe.s. appeared in {cache} in 1 s"):
        probes.wait("the first FLA kernel launch")


class Launches:
    """A dispatch of model.kernels over a stand-in kernel; `first` says it is on CUDA as a tensor would."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.dispatch = kernels._dispatcher(lambda *_a, **_k: self.ran.append("kernel"), lambda *_a: None)

    def __call__(self) -> None:
        self.dispatch(SimpleNamespace(is_cuda=True))


def test_the_first_kernel_launch_waits_for_the_verdict_and_a_failure_holds_every_launch(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_BEFORE_FIRST_LAUNCH", [])
    launches = Launches()
    verdicts = iter([ProbeFailed("FAIL triton: ..."), None])

    def wait() -> None:
        launches.ran.append("wait")
        verdict = next(verdicts)
        if verdict is not None:
            raise verdict

    kernels.hold_first_launch(wait)
    with pytest.raises(ProbeFailed):
        launches()
    assert launches.ran == ["wait"], "a kernel launched before the probes' verdict"
    launches()
    launches()
    assert launches.ran == ["wait", "wait", "kernel", "kernel"], (
        "the wait is asked until it passes, then never"
    )
    launches.dispatch(SimpleNamespace(is_cuda=False))  # a CPU tensor takes the torch path, held or not
    assert launches.ran[-1] == "kernel"


# The rank under `serve` with its probes beside the start: the plan's one probe answers as ARGV[1] says (the
# GPU is not here, so the CPU run reaches the wait at its first step's end instead of at an FLA launch).
PROBED_SERVE = """
import sys
from pathlib import Path
from dflash_trainer.service import preflight, probe_cache, probes_beside
answer, cache = sys.argv[1], Path(sys.argv[2])
def start(cfg, device):
    commands = {"triton": ([sys.executable, "-c", answer], 60)}
    plan = preflight.ProbePlan(commands, {"triton": {"shape": "-"}}, probe_cache.VerdictCache(cache))
    return probes_beside.ProbesBeside(plan, runs=True)
probes_beside.start = start
from dflash_trainer.service.serve import main
sys.exit(main(sys.argv[3:]))
"""


def test_serve_trains_once_its_probes_passed_and_stops_with_the_probes_line_when_one_failed(
    tiny_job, tmp_path
) -> None:
    config = tiny_job()
    code, out = run([FAILS, str(tmp_path / "verdicts.json"), str(config)], code=PROBED_SERVE)
    assert code == 1, out
    assert (
        "training failed: a GPU probe beside the start failed: FAIL triton: a small Triton kernel did not "
        "compile and run: CalledProcessError"
    ) in out, out
    assert "finished at step" not in out

    code, out = run([OK, str(tmp_path / "verdicts.json"), str(config)], code=PROBED_SERVE)
    assert code == 0, out
    [passed] = [ln for ln in out.splitlines() if "GPU probes beside the start passed in " in ln]
    assert "s for them): a Triton kernel compiled and ran [probes ran in " in passed, passed
    assert f"finished at step {STEPS}" in out, out
