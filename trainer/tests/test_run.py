"""The training run in one process (the 1:1 pipeline in-process) on a tiny target on CPU: flag combinations,
exact resume, stop, EMA, evaluation, and the background checkpoint (atomic, its stall logged, finished before
the run returns, a disk-full error named in one line)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_config

from dflash_trainer.checkpoint import list_checkpoints, load_checkpoint
from dflash_trainer.config import TrainConfig, load_config
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID
from dflash_trainer.train.loop import Run, train
from dflash_trainer.train.schedule import lr_factor


@pytest.fixture(scope="module")
def shards(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    synth_shards(
        tiny_target("qwen3_5"), out, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID
    )
    return out


def make_config(tmp_path: Path, target: Path, shards: Path, **train: object) -> TrainConfig:
    keys = {"max_steps": 20, "checkpoint_every": 10, "ema_every": 3, "keep_last": 2} | train
    path = tiny_run_config(
        tmp_path / "train.toml",
        target,
        shards,
        data={"held_out": 4, "shuffle_window": 5},
        optim={"lr": 3e-3},
        train={"checkpoint_dir": tmp_path / "ckpt", **keys},
    )
    return load_config(path)


def same_weights_and_ema(path_a: Path, path_b: Path) -> tuple[dict, dict]:
    """Asserts two checkpoints hold equal drafter weights and EMA shadows; returns their states."""
    a, a_ema = load_checkpoint(path_a)
    b, b_ema = load_checkpoint(path_b)
    for name, tensor in a["trainer"]["drafter"].items():
        assert torch.equal(tensor, b["trainer"]["drafter"][name]), name
    for name, tensor in a_ema["shadow"].items():
        assert torch.equal(tensor, b_ema["shadow"][name]), name
    return a, b


def test_lr_schedule_warms_up_then_decays():
    f = [lr_factor(s, total=100, warmup=4, schedule="cosine", min_ratio=0.1) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(f[4:])) and f[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize(
    ("checkpointing", "compile_"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_flag_combinations_train(tmp_path, tiny_target, shards, checkpointing, compile_):
    # aot_eager: the same Dynamo capture and AOT autograd (where checkpointing and compile meet) without
    # inductor's C++ build, which costs ~35 s on 2 cores; inductor runs on the GPU machine.
    cfg = make_config(
        tmp_path,
        tiny_target("qwen3_5"),
        shards,
        max_steps=2,
        gradient_checkpointing=checkpointing,
        compile=compile_,
        compile_backend="aot_eager",
    )
    seen = []
    result = train(cfg, hooks=[seen.append], on_ready=lambda: seen.append("ready"))
    assert seen[0] == "ready" and [m.step for m in seen[1:]] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m.loss)) and m.grad_norm > 0 for m in seen[1:])
    assert result.checkpoint is not None and result.checkpoint.name == "step-00000002"


def test_target_compile_trains_as_the_eager_target_does(tmp_path, tiny_target, shards):
    """train.target_compile: the compiled target's features train the drafter as the eager target's do (same
    losses and held-out figures; the walk and the figures run the eager layers)."""
    runs, graphs = {}, {}
    torch._dynamo.reset()
    for on in (False, True):
        seen: list = []
        cfg = make_config(
            tmp_path / str(on), tiny_target("qwen3_5"), shards, max_steps=3, eval_every=3,
            target_compile=on, compile_backend="aot_eager",
        )  # fmt: skip
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # a count over the whole process
        train(cfg, hooks=[seen.append])
        runs[on] = seen
        graphs[on] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    assert graphs[False] == 0 and graphs[True] > 0  # only the target's layers compile, and only when asked
    assert [m.loss for m in runs[True]] == pytest.approx([m.loss for m in runs[False]], rel=1e-4)
    figures = ("loss", "anchor_accept", "acc_1", "acc_2", "acc_3")
    assert [runs[True][-1].eval[k] for k in figures] == pytest.approx(
        [runs[False][-1].eval[k] for k in figures], rel=1e-4
    )


def test_resume_is_exact(tmp_path, tiny_target, shards):
    target = tiny_target("qwen3_5")
    straight = train(make_config(tmp_path / "a", target, shards))
    assert straight.step == 20

    cfg = make_config(tmp_path / "b", target, shards)
    assert train(cfg, max_steps=10).step == 10
    # Fresh objects, as a new process builds them; they find the step-10 checkpoint and go on.
    resumed = train(cfg)
    assert resumed.step == 20

    a, b = same_weights_and_ema(straight.checkpoint, resumed.checkpoint)
    assert a["data"] == b["data"]
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "ckpt")] == ["step-00000010", "step-00000020"]


def test_stop_event_saves_and_returns(tmp_path, tiny_target, shards):
    stop = threading.Event()

    def stop_at_3(m):
        if m.step == 3:
            stop.set()

    result = train(make_config(tmp_path, tiny_target("qwen3_5"), shards), hooks=[stop_at_3], stop=stop)
    assert result.stopped and result.step == 3 and result.checkpoint.name == "step-00000003"


def test_ema_follows_the_weights_on_the_cpu(tmp_path, tiny_target, shards):
    run = Run(make_config(tmp_path, tiny_target("qwen3_5"), shards, ema_decay=0.5))
    ema = run.drafter.ema
    start = {k: v.clone() for k, v in ema.weights().items()}
    run.train(stop_at=3)
    shadow = ema.weights()
    name = "fc.weight"
    live = dict(run.drafter.drafter.named_parameters())[name].detach()
    assert shadow[name].device.type == "cpu" and shadow[name].dtype == torch.float32
    # One update at step 3 with decay 0.5: halfway between the start and the weights of step 3.
    assert torch.allclose(shadow[name], 0.5 * start[name] + 0.5 * live)
    assert ema.num_updates == 1


def test_evaluation_reports_acceptance(tmp_path, tiny_target, shards):
    run = Run(make_config(tmp_path, tiny_target("qwen3_5"), shards, eval_walk_prompts=2))
    said: list[str] = []
    run.target.progress = said.append  # the service's heartbeat: WATCHDOG=1 and STATUS while the walk moves
    figures = run.evaluate()
    # One word per verify step, naming the evaluation, the prompt and how far it is.
    assert len(said) == figures["walk_steps"], said
    assert said[0].startswith("evaluation at step 0: decode walk prompt 1 of 2: "), said[0]
    assert said[-1].startswith("evaluation at step 0: decode walk prompt 2 of 2: "), said[-1]
    assert said[-1].endswith(" of 8 tokens"), said[-1]
    timed = {"walk_tok_s", "walk_s"}
    keep = run.target.kept_walk
    assert keep is not None and keep._parts is not None  # the walk's cache and runner (their graphs on CUDA)
    kept = keep._parts
    again = run.evaluate()
    assert keep._parts is kept
    # fixed anchors and prompts: the same blocks and the same walk each time
    assert {k: v for k, v in figures.items() if k not in timed} == {
        k: v for k, v in again.items() if k not in timed
    }
    assert 1.0 <= figures["anchor_accept"] <= 4.0 and 1.0 <= figures["walk_tau"] <= 4.0
    assert figures["walk_steps"] >= 2 * 8 / 4 and figures["walk_s"] > 0
    walk = {"walk_tau", "walk_tau_pooled", "walk_steps"} | timed
    assert set(figures) == {"loss", "anchor_accept", "acc_1", "acc_2", "acc_3"} | walk


def test_a_first_evaluation_says_its_share_is_not_the_steady_one(tmp_path, tiny_target, shards, caplog):
    target = tiny_target("qwen3_5")
    cfg = make_config(tmp_path, target, shards, eval_every=2, eval_walk_prompts=1, max_steps=4)
    with caplog.at_level("INFO", logger="dflash_trainer.train"):
        Run(cfg).train(stop_at=4)
    said = [r.getMessage() for r in caplog.records]
    took = [line for line in said if re.match(r"evaluation at step \d+ took ", line)]
    assert len(took) == 2, took
    assert "since training began (the first evaluation of this process" in took[0], took[0]
    assert took[1].endswith(" since the last"), took[1]


WALK = ["walk_s", "walk_steps", "walk_tau", "walk_tau_pooled", "walk_tok_s"]


def test_without_eval_walk_keep_each_walk_releases_what_it_built(tmp_path, tiny_target, shards, monkeypatch):
    from dflash_trainer.evaluation import hooks

    keeps: list[object] = []
    decode_walk = hooks.decode_walk

    def seen(*args, **kwargs):
        keeps.append(args[4] if len(args) > 4 else kwargs.get("keep"))
        return decode_walk(*args, **kwargs)

    monkeypatch.setattr(hooks, "decode_walk", seen)
    cfg = make_config(tmp_path, tiny_target("qwen3_5"), shards, eval_walk_prompts=1, eval_walk_keep=False)
    run = Run(cfg)
    assert run.target.kept_walk is None
    run.evaluate()
    assert keeps == [None]


def test_evaluation_runs_every_eval_every_steps_with_extra_hooks(tmp_path, tiny_target, shards, monkeypatch):
    from dflash_trainer.evaluation import hooks

    seen = []

    def decode_walk(ctx):  # what a further evaluation gets: the target, the drafter, the held-out rows
        seen.append((ctx.step, ctx.target is not None, len(ctx.held_out), ctx.drafter.training))
        return {"walk": 1.5}

    monkeypatch.setattr(hooks, "EVAL_HOOKS", [*hooks.EVAL_HOOKS, decode_walk])
    steps = []
    train(
        make_config(tmp_path, tiny_target("qwen3_5"), shards, max_steps=4, eval_every=2), hooks=[steps.append]
    )
    assert [(m.step, sorted(m.eval)) for m in steps if m.eval] == [
        (s, ["acc_1", "acc_2", "acc_3", "anchor_accept", "loss", "walk", *WALK]) for s in (2, 4)
    ]
    assert seen == [(2, True, 2, False), (4, True, 2, False)]


# ---- the background checkpoint ----


def writes_finish_within_their_step(run: Run):
    """A hook joining the checkpoint writer (without raising) after each step: on a slow machine one save's
    write can outlast the steps to the next save, which is then deferred (step-00000005 for 4 on a loaded CI
    machine); tests of what is saved when must not hang on the machine's speed."""

    def join(_metrics) -> None:
        thread = run.drafter.checkpointer._thread
        if thread is not None:
            thread.join()

    return join


def test_save_is_in_the_background_and_finished_when_the_run_returns(tmp_path, tiny_target, shards, caplog):
    caplog.set_level("INFO", logger="dflash_trainer.checkpoint")
    cfg = make_config(tmp_path, tiny_target("qwen3_5"), shards, max_steps=7, checkpoint_every=3)
    run = Run(cfg)
    run.resume()
    result = run.train(hooks=[writes_finish_within_their_step(run)])
    assert result.checkpoint.name == "step-00000007"
    assert sorted(p.name for p in result.checkpoint.iterdir()) == ["ema.pt", "state.pt"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint step-")]
    assert [line.split(":")[0] for line in lines] == [f"checkpoint step-0000000{i}" for i in (3, 6, 7)]
    # Periodic saves say how long training waited; the run's last one is not a stall (training is over).
    assert all(re.search(r": stall \d+\.\d\d s.*; written in ", line) for line in lines[:2]), lines
    assert lines[2].startswith("checkpoint step-00000007: final; written in "), lines[2]


def test_resume_after_background_saves_is_exact(tmp_path, tiny_target, shards, monkeypatch):
    """A save whose write is slow (still in flight while training goes on) holds the state of its step."""
    import dflash_trainer.checkpoint as ck

    target = tiny_target("qwen3_5")
    straight = train(make_config(tmp_path / "a", target, shards, max_steps=8, checkpoint_every=4))
    real = ck.save_checkpoint

    def slow(*args, **kwargs):
        threading.Event().wait(1.0)  # training runs ahead meanwhile and changes weights and moments
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "save_checkpoint", slow)
    cfg = make_config(tmp_path / "b", target, shards, max_steps=8, checkpoint_every=2)
    train(cfg, max_steps=5)
    monkeypatch.setattr(ck, "save_checkpoint", real)
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "ckpt")][-1] == "step-00000005"
    resumed = train(cfg)
    a, _ = load_checkpoint(straight.checkpoint)
    b, _ = load_checkpoint(resumed.checkpoint)
    for name, tensor in a["trainer"]["drafter"].items():
        assert torch.equal(tensor, b["trainer"]["drafter"][name]), name


def test_a_save_due_during_the_previous_write_is_deferred_not_waited_for(
    tmp_path, tiny_target, shards, monkeypatch, caplog
):
    """Saves more frequent than the disk can write (the smoke run's on a slow disk: 25 s of stall;
    docs/gpu-rehearsal.md): the save is deferred to the first step that finds the write done, so no periodic
    save stalls training for the rest of a write; the run's final save still lands, and waits."""
    import dflash_trainer.checkpoint as ck

    caplog.set_level("INFO")
    real = ck.save_checkpoint
    gate = threading.Event()

    def held(*args, **kwargs):
        gate.wait(30)  # the first write (step 2) holds until step 4 has finished
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "save_checkpoint", held)
    cfg = make_config(tmp_path, tiny_target("qwen3_5"), shards, max_steps=8, checkpoint_every=2)
    run = Run(cfg)
    run.resume()

    def release_at_step_4(m) -> None:
        if m.step == 4:  # step 4's save was due while step 2's write ran: deferred
            gate.set()
        if m.step >= 4:  # from here on every write is done before the next step looks
            run.drafter.checkpointer.wait()

    result = run.train(hooks=[release_at_step_4])
    messages = [r.getMessage() for r in caplog.records]
    deferred = [m for m in messages if "deferred" in m]
    assert deferred == [
        "checkpoint at step 4 deferred: the previous write is still running; "
        "saved after the first step that finds it done"
    ], deferred
    saved = [m.split(":")[0] for m in messages if m.startswith("checkpoint step-")]
    # 2; 4's save made at 5, the first step that found the write done; then 6 and 8 at their turn.
    assert saved == [f"checkpoint step-0000000{i}" for i in (2, 5, 6, 8)], saved
    # Waiting for the held write would stall up to the gate's 30 s; 10 s of slack for a loaded machine.
    assert max(run.drafter.checkpointer.stalls) < 10.0, run.drafter.checkpointer.stalls
    assert result.checkpoint is not None and result.checkpoint.name == "step-00000008"


def torch_enospc(real_save, obj) -> RuntimeError:
    """The error torch.save raises on a full disk: RuntimeError "[enforce fail at inline_container.cc:...]
    unexpected pos", the OSError only its __context__ (made for real on /dev/full)."""
    full = Path("/dev/full").open("wb")  # noqa: SIM115  # its close re-raises ENOSPC: suppressed below
    try:
        real_save(obj, full)
    except RuntimeError as e:
        return e
    finally:
        with contextlib.suppress(OSError):
            full.close()
    raise AssertionError("torch.save to /dev/full did not fail")


def test_a_failed_write_leaves_the_previous_checkpoint_the_newest(tmp_path, tiny_target, shards, monkeypatch):
    import dflash_trainer.checkpoint as ck

    real_save = ck.torch.save
    calls = []

    def dies_on_the_second_checkpoint(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # state.pt of the second checkpoint: written partly, then the disk is full
            f.write(b"partial")
            raise torch_enospc(real_save, obj)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", dies_on_the_second_checkpoint)
    cfg = make_config(tmp_path, tiny_target("qwen3_5"), shards, max_steps=8, checkpoint_every=2)
    run = Run(cfg)
    run.resume()
    with pytest.raises(ck.CheckpointError) as err:
        run.train(hooks=[writes_finish_within_their_step(run)])
    ckpt = tmp_path / "ckpt"
    assert str(err.value) == (
        f"checkpoint step-00000004 in {ckpt}: OSError: [Errno 28] No space left on device"
    )
    assert [p.name for p in ckpt.iterdir()] == ["step-00000002"]  # the half-written one is gone
    assert load_checkpoint(ck.latest_checkpoint(ckpt))[0]["trainer"]["step"] == 2


def test_disk_full_is_one_line_naming_the_cause_and_path(tmp_path, monkeypatch):
    """A real ENOSPC: /dev/full as the file torch.save writes to."""
    import dflash_trainer.checkpoint as ck

    f = Path("/dev/full").open("wb")  # noqa: SIM115  # closed below: its close re-raises ENOSPC
    try:
        with pytest.raises(RuntimeError) as raw:
            torch.save({"x": torch.ones(1000)}, f)
    finally:
        with contextlib.suppress(OSError):
            f.close()
    assert "unexpected pos" in str(raw.value)  # what torch says
    cause = ck.root_cause(raw.value)
    assert isinstance(cause, OSError) and cause.errno == 28  # what it means

    real = ck._save
    monkeypatch.setattr(ck, "_save", lambda obj, _path: real(obj, Path("/dev/full")))
    with pytest.raises(ck.CheckpointError, match=r"^checkpoint step-00000050 in .*: OSError: \[Errno 28\]"):
        ck.save_checkpoint(tmp_path / "x", 50, {"a": torch.ones(3)}, {}, keep_last=2)
    assert list((tmp_path / "x").iterdir()) == []


def test_a_failing_evaluation_is_logged_and_training_goes_on(
    tmp_path, tiny_target, shards, caplog, monkeypatch
):
    """An evaluation bug (a walk crashing on a new target kind, say) ends neither the step nor the run: one
    ERROR line names the evaluation and its cause, and the figures carry `<name>_failed`, which fails the
    smoke report."""
    from dflash_trainer.evaluation import hooks

    def walk_figures(ctx):
        raise RuntimeError("the walk's cache rollback broke")

    monkeypatch.setattr(hooks, "EVAL_HOOKS", [hooks.held_out_figures, walk_figures])
    cfg = load_config(tiny_run_config(tmp_path / "run.toml", tiny_target("qwen3_5"), shards))
    run = Run(cfg)
    with caplog.at_level("ERROR"):
        figures = run.evaluate()
    assert figures["walk_figures_failed"] == 1.0 and "loss" in figures
    assert (
        "evaluation walk_figures at step 0 failed: RuntimeError: the walk's cache rollback broke"
        in caplog.text
    )


def test_the_drafter_compiled_ahead_leaves_the_run_as_it_was_and_its_first_step_compiles_nothing_new(
    tmp_path, tiny_target, shards, monkeypatch, caplog
):
    """train.loop's compile ahead (while a cold start's GPU probes run): the first step then finds every
    graph compiled, and the run's losses, weights, EMA and random streams are those of a run without it."""
    from torch._dynamo.utils import counters

    from dflash_trainer.train.drafter_side import DrafterSide

    caplog.set_level(logging.INFO, "dflash_trainer.train")
    graphs: dict[str, int] = {}
    ahead = DrafterSide.compile_ahead

    def counted(self, batch, item):
        ahead(self, batch, item)
        graphs["ahead"] = counters["stats"]["unique_graphs"]

    monkeypatch.setattr(DrafterSide, "compile_ahead", counted)

    def first_step(m):
        graphs.setdefault("first step", counters["stats"]["unique_graphs"])

    results, asked = {}, []
    for on in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = make_config(tmp_path / str(on), tiny_target("qwen3_5"), shards, max_steps=3, compile=True,
                          compile_backend="aot_eager")  # fmt: skip
        torch.manual_seed(5)
        seen: list = []

        def ask(on=on) -> bool:
            asked.append(on)
            return on

        result = train(cfg, hooks=[seen.append, first_step] if on else [seen.append], compile_ahead=ask)
        results[on] = (seen, result, torch.rand(3))  # the global stream after the run
    assert asked == [False, True], "compile_ahead is asked once, before the first target forward"
    assert graphs["ahead"] > 0 and graphs["first step"] == graphs["ahead"], graphs
    [line] = [r.getMessage() for r in caplog.records if "compiled ahead" in r.getMessage()]
    assert line.startswith("drafter step compiled ahead in ") and line.endswith(
        " s, before the target's first kernel launch"
    )
    (plain, plain_result, plain_rand), (ahead_seen, ahead_result, ahead_rand) = results[False], results[True]
    assert [(m.loss, m.grad_norm) for m in ahead_seen] == [(m.loss, m.grad_norm) for m in plain]
    assert torch.equal(ahead_rand, plain_rand)
    a, b = same_weights_and_ema(plain_result.checkpoint, ahead_result.checkpoint)
    assert a["trainer"]["optimizer"]["state"].keys() == b["trainer"]["optimizer"]["state"].keys()
    for stream in ("anchors", "torch"):
        assert torch.equal(a["rng"][stream], b["rng"][stream]), stream
