"""Preflight's GPU probes: reported failures do not wait for them, passed verdicts are kept by key, both run
at once. The probe child process is the GPU part (service.gpu_probe): faked here by its output contract."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_trainer.service import preflight, probe_cache

ENV = {
    "gpu": "NVIDIA H200",
    "driver": "580.95.05",
    "python": "3.12.3",
    "torch": "2.13.0+cu130",
    "cuda": "13.0",
    "triton": "3.7.1",
    "flash-linear-attention": "0.6.0",
    "probe code": "0123456789abcdef",
}
HYBRID_CONFIG = {
    "model_type": "qwen3_5",
    "text_config": {
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
}


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """The probe child process faked: records each command and answers as gpu_probe does."""
    calls: list[list[str]] = []
    answers: dict[str, str | RuntimeError] = {}

    def fake_probe(cmd: list[str], timeout: float) -> str:
        name = cmd[3]
        calls.append(cmd)
        answer = answers.get(name, f"{name} probe ran")
        if isinstance(answer, RuntimeError):
            raise answer
        return answer

    monkeypatch.setattr(preflight, "_probe", fake_probe)
    monkeypatch.setattr(probe_cache, "environment_key", lambda: dict(ENV))
    monkeypatch.setenv("DFLASH_PROBE_CACHE", str(tmp_path / "cache" / "verdicts.json"))
    return SimpleNamespace(calls=calls, answers=answers, file=tmp_path / "cache" / "verdicts.json")


def gpu_context(
    tmp_path: Path, *, hybrid: bool = False, full: bool = False, defer: bool = False
) -> preflight.Context:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(HYBRID_CONFIG))
    ctx = preflight.Context(tmp_path / "train.toml", 1, full=full, defer_probes=defer)
    ctx.cfg = SimpleNamespace(model=SimpleNamespace(target_path=target))  # type: ignore[assignment]
    ctx.facts.update(device="cuda", hybrid=hybrid)
    return ctx


def test_a_passed_probe_is_kept_and_reused_with_an_equal_key(tmp_path, probes):
    first = preflight.check_triton(gpu_context(tmp_path))
    assert len(probes.calls) == 1 and "probes ran in" in first and "no verdict kept" in first
    assert json.loads(probes.file.read_text())["triton"]["verdict"] == "triton probe ran"

    again = preflight.check_triton(gpu_context(tmp_path))
    assert len(probes.calls) == 1, "the kept verdict was not reused"
    assert "no probe ran" in again and "triton verdict kept from" in again
    assert again.startswith("triton probe ran")


def test_the_units_preflight_leaves_a_probe_without_a_kept_verdict_to_the_ranks(tmp_path, probes) -> None:
    line = preflight.check_triton(gpu_context(tmp_path, hybrid=True, defer=True))
    assert probes.calls == [] and not probes.file.exists()
    assert line.startswith("triton and fla deferred to the ranks: probed beside their start"), line
    assert "triton probed (no verdict kept)" in line

    preflight.check_triton(gpu_context(tmp_path))  # by hand: probes, and keeps the triton verdict
    line = preflight.check_triton(gpu_context(tmp_path, hybrid=True, defer=True))
    assert len(probes.calls) == 1, "a kept verdict was probed again"
    assert line.startswith("triton probe ran; fla deferred to the ranks"), line


def test_a_changed_key_probes_again_and_names_the_change(tmp_path, probes, monkeypatch):
    preflight.check_triton(gpu_context(tmp_path))
    monkeypatch.setattr(probe_cache, "environment_key", lambda: {**ENV, "triton": "3.8.0"})
    line = preflight.check_triton(gpu_context(tmp_path))
    assert len(probes.calls) == 2
    assert "changed: triton 3.7.1 -> 3.8.0" in line


def test_full_always_probes(tmp_path, probes):
    preflight.check_triton(gpu_context(tmp_path))
    line = preflight.check_triton(gpu_context(tmp_path, full=True))
    assert len(probes.calls) == 2 and "(--full)" in line


def test_a_failed_probe_is_never_kept(tmp_path, probes):
    probes.answers["triton"] = RuntimeError("CalledProcessError: ... returned non-zero exit status 1")
    with pytest.raises(preflight.Failed, match="did not compile and run") as failed:
        preflight.check_triton(gpu_context(tmp_path))
    assert "python3-dev" in failed.value.fix
    assert not probes.file.exists()
    del probes.answers["triton"]
    preflight.check_triton(gpu_context(tmp_path))
    assert len(probes.calls) == 2


def test_an_unreadable_verdict_file_is_a_cold_cache(tmp_path, probes):
    probes.file.parent.mkdir()
    probes.file.write_text("{half a file")
    line = preflight.check_triton(gpu_context(tmp_path))
    assert len(probes.calls) == 1 and "unreadable" in line
    assert json.loads(probes.file.read_text())["triton"]["verdict"] == "triton probe ran"


def test_a_cache_directory_it_cannot_write_warns_in_the_line(tmp_path, probes, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("DFLASH_PROBE_CACHE", str(blocker / "verdicts.json"))
    line = preflight.check_triton(gpu_context(tmp_path))
    assert "verdict not kept" in line and str(blocker) in line


def test_the_fla_probe_runs_beside_the_triton_probe_on_the_targets_shape(tmp_path, probes, monkeypatch):
    barrier = threading.Barrier(2, timeout=10)
    plain = preflight._probe

    def together(cmd: list[str], timeout: float) -> str:
        barrier.wait()  # both probes must be running at once, or this breaks
        return plain(cmd, timeout)

    monkeypatch.setattr(preflight, "_probe", together)
    line = preflight.check_triton(gpu_context(tmp_path, hybrid=True))
    assert sorted(c[3] for c in probes.calls) == ["fla", "triton"]
    fla = next(c for c in probes.calls if c[3] == "fla")
    assert fla[fla.index("--value-heads") + 1] == "48" and fla[fla.index("--model-type") + 1] == "qwen3_5"
    assert "triton probe ran; fla probe ran" in line
    kept = json.loads(probes.file.read_text())
    assert "value_heads 48" in kept["fla"]["key"]["shape"] and kept["triton"]["key"]["shape"] == "-"


def test_a_failing_cheap_check_is_reported_without_waiting_for_the_probes(tmp_path, monkeypatch):
    ran: list[str] = []

    def probe_spy(ctx: preflight.Context) -> str:
        ran.append("triton")
        return "probed"

    checks = [(n, probe_spy if n == "triton" else fn) for n, fn in preflight.CHECKS]
    monkeypatch.setattr(preflight, "CHECKS", checks)
    config = tmp_path / "train.toml"
    config.write_text('[model]\ntarget_path = "/nonexistent/target"\n')
    results = {c.name: c for c in preflight.run_checks(config, nproc=1)}
    assert not results["config"].ok or not results["model"].ok
    assert ran == [], "the probes ran although a cheaper check had failed"
    assert results["triton"].skipped and "failed first" in results["triton"].detail


def test_changed_names_every_difference():
    old = {"torch": "2.12.0", "gpu": "NVIDIA H100"}
    new = {"torch": "2.13.0", "gpu": "NVIDIA H100", "triton": "3.7.1"}
    assert probe_cache.changed(old, new) == ["torch 2.12.0 -> 2.13.0", "triton absent -> 3.7.1"]
