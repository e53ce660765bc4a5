"""A tracker never stops training: a tensorboard directory replaced by a file, a tracker whose every write
fails mid-run, and a wandb that cannot reach its server each give ONE warning, in preflight (a `warn` line,
exit 0) and in the run (which finishes its steps)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from tiny_run import TINY_JOB_STEPS as STEPS
from tiny_run import run_cli as run

# A stand-in for a wandb whose server cannot be reached: the API the code calls (trackers.WANDB_NEEDS), and an
# init that fails as wandb's does once its init_timeout has passed (wandb/sdk/wandb_init.py raises
# CommError "Run initialization has timed out after ... sec"), without the test waiting that minute.
WANDB_STUB = """
class Settings:
    def __init__(self, silent=None, console=None, init_timeout=None, finish_timeout=None,
                 x_graphql_retry_max=None, x_graphql_timeout_seconds=None):
        pass

class Run:
    def log(self, data=None, step=None):
        pass

    def finish(self):
        pass

class CommError(Exception):
    pass

def init(project=None, name=None, id=None, dir=None, mode=None, config=None, resume=None, settings=None):
    raise CommError("Run initialization has timed out after 60.0 sec. (http://127.0.0.1:9 unreachable)")
"""
# The run under `serve`, with tensorboard's writer failing on every write from step 3 on (ENOSPC, as on a full
# or vanished directory): what a tracker whose backend went away mid-run looks like to the trainer.
FAILING_WRITER = """
import errno, sys
from torch.utils.tensorboard import SummaryWriter
real = SummaryWriter.add_scalar
def add_scalar(self, tag=None, scalar_value=None, global_step=None, **kw):
    if global_step is not None and global_step >= 3:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, tag=tag, scalar_value=scalar_value, global_step=global_step, **kw)
SummaryWriter.add_scalar = add_scalar
from dflash_trainer.service.serve import main
sys.exit(main(sys.argv[1:]))
"""


def stub_wandb(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "stub" / "wandb").mkdir(parents=True)
    (tmp_path / "stub" / "wandb" / "__init__.py").write_text(textwrap.dedent(WANDB_STUB))
    path = os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "WANDB_MODE": "online", "WANDB_API_KEY": "a" * 40}


def warnings_of(log: str, tracker: str) -> list[str]:
    return [line for line in log.splitlines() if f"tracker {tracker} " in line and "warning" in line.lower()]


def test_tensorboard_directory_replaced_by_a_file_warns_in_preflight_and_the_run(tiny_job, tmp_path) -> None:
    board = tmp_path / "tensorboard"
    board.write_text("a file where the directory was\n")
    config = tiny_job(trackers={"tensorboard": board})

    code, out = run(["preflight", str(config)])
    assert code == 0, out
    [line] = [ln for ln in out.splitlines() if ln.startswith("warn trackers:")]
    assert line.startswith(f"warn trackers: tracker tensorboard: trackers.tensorboard {board}: cannot be")
    assert "training goes on without tensorboard -- fix: " in line
    assert "with warnings (trackers)" in out

    code, out = run(["serve", str(config)])
    assert code == 0, out
    assert len(warnings_of(out, "tensorboard")) == 1, out
    assert "did not start" in warnings_of(out, "tensorboard")[0]
    assert f"finished at step {STEPS}" in out, out


def test_a_tracker_failing_on_every_write_mid_run_warns_once_and_training_finishes(
    tiny_job, tmp_path
) -> None:
    config = tiny_job(trackers={"tensorboard": tmp_path / "tensorboard"})
    code, out = run([str(config)], code=FAILING_WRITER)
    assert code == 0, out
    [warning] = warnings_of(out, "tensorboard")  # one, not one per step
    assert "failed at step 3: OSError: [Errno 28] No space left on device" in warning, out
    assert "training goes on" in warning
    assert f"finished at step {STEPS}" in out, out


def test_unreachable_wandb_warns_once_in_preflight_and_the_run(tiny_job, tmp_path) -> None:
    config = tiny_job(trackers={"wandb_project": "drafters"})
    env = stub_wandb(tmp_path)

    code, out = run(["preflight", str(config)], env=env)
    assert code == 0, out
    [line] = [ln for ln in out.splitlines() if ln.startswith("warn trackers:")]
    assert "tracker wandb did not start offline: CommError: Run initialization has timed out" in line
    assert "training goes on without wandb" in line

    code, out = run(["serve", str(config)], env=env)
    assert code == 0, out
    [warning] = warnings_of(out, "wandb")
    assert "did not start (CommError: Run initialization has timed out" in warning
    assert f"finished at step {STEPS}" in out, out
