"""Shows the drafter learning: held-out acceptance length (decode walk) before and after a short CPU run.

From a tiny random target and shards it regenerated itself, a 2-layer drafter is trained for a few hundred
steps (a minute or two on a laptop CPU). It prints figures; it asserts nothing about time.

    python trainer/scripts/learn_demo.py [--steps 600] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dflash_trainer.config import load_config
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID, write_tiny_target
from dflash_trainer.train.loop import Run

CONFIG = """
[model]
target_path = "target"
[drafter]
num_layers = 2
block_size = 8
mask_token_id = {mask}
[data]
shards = "shards"
seq_len = 96
max_anchors = 24
held_out = 32
[optim]
lr = 3e-3
warmup_ratio = 0.05
batch = 8
[train]
max_steps = {steps}
checkpoint_dir = "checkpoints"
ema_decay = 0.98
ema_every = 1
eval_every = 0
eval_walk_prompts = 8
eval_walk_new_tokens = 48
device = "cpu"
dtype = "float32"
"""


def show(label: str, figures: dict[str, float]) -> None:
    accs = " ".join(f"{figures[f'acc_{k}']:.2f}" for k in range(1, 8))
    print(
        f"{label:>22}: walk tau {figures['walk_tau']:.2f} (per-anchor {figures['anchor_accept']:.2f})  "
        f"loss {figures['loss']:.3f}"
    )
    print(f"{'':>22}  per-position accuracy (slots 1..7) {accs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-learn-"))
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    write_tiny_target(work / "target", kind="qwen3_5", seed=0)
    synth_shards(
        work / "target",
        work / "shards",
        num_shards=4,
        rows=96,
        seq_len=96,
        seed=0,
        vocab_size=TINY_MASK_TOKEN_ID,
    )
    (work / "train.toml").write_text(CONFIG.format(mask=TINY_MASK_TOKEN_ID, steps=args.steps))
    run = Run(load_config(work / "train.toml"))
    print(
        f"tiny target, {run.setup.num_rows} training and 32 held-out rows: {time.perf_counter() - t0:.0f} s"
    )

    show("untrained drafter", run.evaluate())
    t0 = time.perf_counter()

    def report(m) -> None:
        if m.step % 50 == 0:
            print(
                f"step {m.step:4d}  loss {m.loss:.3f}  lr {m.lr:.1e}  "
                f"train anchor_accept {m.anchor_accept:.2f}"
            )

    run.train(hooks=[report])
    print(f"{args.steps} steps in {time.perf_counter() - t0:.0f} s")
    show(f"after {args.steps} steps", run.evaluate())
    # The EMA (CPU, fp32) evaluated by loading it into the drafter: what an export --from ema would serve.
    run.drafter.drafter.load_state_dict(run.drafter.ema.weights(), strict=True)
    show("EMA of the weights", run.evaluate())


if __name__ == "__main__":
    main()
