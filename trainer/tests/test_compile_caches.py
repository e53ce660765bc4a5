"""The first step's line on the compile caches: warm, cold, or partly, from the files each cache gained."""

from __future__ import annotations

from dflash_trainer.service import compile_caches


def _env(tmp_path):
    for name in ("triton", "inductor"):
        (tmp_path / name).mkdir(exist_ok=True)
    return {
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }


def test_an_empty_cache_that_gains_kernels_is_cold(tmp_path):
    env = _env(tmp_path)
    before = compile_caches.snapshot(env)
    (tmp_path / "triton" / "abc").mkdir()
    (tmp_path / "triton" / "abc" / "k.cubin").write_bytes(b"x")
    (tmp_path / "triton" / "abc" / "k.autotune.json").write_text("{}")
    line = compile_caches.report(before, compile_caches.snapshot(env), autotune_kept=True)
    assert "cold" in line and "triton +2 files (2 kept)" in line and "inductor +0 files" in line


def test_a_cache_that_gains_nothing_is_warm(tmp_path):
    env = _env(tmp_path)
    (tmp_path / "inductor" / "graph").write_text("g")
    before = compile_caches.snapshot(env)
    line = compile_caches.report(before, compile_caches.snapshot(env), autotune_kept=True)
    assert "warm: every kernel and graph came from the cache" in line and "inductor +0 files (1 kept)" in line


def test_a_kept_cache_that_still_compiles_is_partly_warm_and_unkept_autotuning_is_said(tmp_path):
    env = _env(tmp_path)
    (tmp_path / "inductor" / "graph").write_text("g")
    before = compile_caches.snapshot(env)
    (tmp_path / "triton" / "new.cubin").write_bytes(b"x")
    line = compile_caches.report(before, compile_caches.snapshot(env), autotune_kept=False)
    assert "partly warm" in line and "TRITON_CACHE_AUTOTUNING unset" in line


def test_graph_cache_misses_alone_are_not_warm():
    before = compile_caches.CacheCounts({"triton": 1, "inductor": 0}, 0, 0)
    after = compile_caches.CacheCounts({"triton": 1, "inductor": 0}, 3, 2)
    line = compile_caches.report(before, after, autotune_kept=True)
    assert "partly warm" in line and "3 hits, 2 misses" in line


def test_no_cache_directories_are_said(tmp_path):
    empty = compile_caches.snapshot({})
    assert "none configured" in compile_caches.report(empty, empty, autotune_kept=False)


def test_the_line_says_what_torch_compile_spent_since_the_snapshot(tmp_path):
    import torch

    env = _env(tmp_path)
    before = compile_caches.snapshot(env)
    step = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")  # no codegen: a second on CPU
    step(torch.randn(8))
    after = compile_caches.snapshot(env)
    assert after.frames == before.frames + 1 and after.compile_s > before.compile_s
    line = compile_caches.report(before, after, autotune_kept=True)
    assert "; torch.compile " in line and " s in 1 frames, inductor 0.0 s of it" in line, line
    assert "; torch.compile " not in compile_caches.report(after, after, autotune_kept=True)


def test_a_first_step_that_compiled_nothing_is_not_called_warm():
    empty = compile_caches.CacheCounts({"triton": 0, "inductor": 0}, 0, 0)
    line = compile_caches.report(empty, empty, autotune_kept=True)
    assert "nothing compiled: the first step ran no torch.compile graph" in line and "warm" not in line
