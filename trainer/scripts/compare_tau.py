"""The decode walk's tau against the method authors' client (dflash 0.1.0) on the same drafter and prompts.

The learn-demo recipe (learn_demo.py) on a tiny Qwen3 target: train, export the EMA with `export_draft` (what
`dflash-train export --dtype float32` writes), then decode the same held-out prompts twice, greedily:

- the trainer's decode walk (dflash_trainer.evaluation.walk) on the exported drafter, as training runs it;
- dflash's `dflash_generate` with its `DFlashDraftModel.from_pretrained` of the export and a fresh
  `Qwen3ForCausalLM`, tau as its benchmark prints it (mean over prompts of the per-prompt mean).

It also prints the per-anchor figure (`anchor_accept`) and the untrained drafter (step 0) for a baseline, and
the walk's cost next to the training step's. CPU only; a few minutes on 2 cores.

    python trainer/scripts/compare_tau.py [--steps 600] [--prompts 32] [--new-tokens 64] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from learn_demo import CONFIG  # the recipe itself, not a copy

from dflash_trainer.config import load_config
from dflash_trainer.evaluation.held_out import evaluate, walk_prompts
from dflash_trainer.evaluation.walk import WalkResult, WalkSettings, decode_walk
from dflash_trainer.export import export_draft, load_draft
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID, write_tiny_target
from dflash_trainer.runtime import objective_config
from dflash_trainer.train.loop import Run


def dflash_tau(export_dir: Path, target_dir: Path, prompts: list[torch.Tensor], new_tokens: int) -> float:
    """dflash 0.1.0's benchmark figure: statistics.mean(statistics.mean(x) for x in per_request)."""
    from dflash import model as dflash_model
    from transformers import Qwen3ForCausalLM

    # return_stats times with torch.cuda.synchronize(); on CPU a plain clock does.
    dflash_model._cuda_time = time.perf_counter
    target = Qwen3ForCausalLM.from_pretrained(str(target_dir), local_files_only=True).eval()
    draft = dflash_model.DFlashDraftModel.from_pretrained(str(export_dir)).eval()
    per_request = []
    for p in prompts:
        out = dflash_model.dflash_generate(draft, target, p[None], new_tokens, None, return_stats=True)
        per_request.append(out.acceptance_lengths)
    return statistics.mean(statistics.mean(x) for x in per_request if x)


def compare(label: str, run: Run, state: dict, work: Path, prompts: list[torch.Tensor], new: int) -> float:
    out = work / f"export-{label}"
    target, live = run.target.target, run.drafter.drafter
    export_draft(state, live.spec, out, dtype=torch.float32)
    drafter = load_draft(out)
    walk: WalkResult = decode_walk(target.model, drafter, prompts, WalkSettings(max_new_tokens=new))
    theirs = dflash_tau(out, run.cfg.model.target_path, prompts, new)
    live.load_state_dict(state, strict=True)
    anchor = evaluate(live, target, run.target.held_out, objective_config(run.cfg)).anchor_accept
    diff = 100 * (walk.tau - theirs) / theirs
    print(
        f"{label:>10}: walk tau {walk.tau:.3f} (pooled {walk.tau_pooled:.3f}, {walk.steps} steps, "
        f"{walk.seconds:.1f} s, {walk.tokens_per_s:.0f} tok/s) | dflash_generate tau {theirs:.3f} | "
        f"difference {diff:+.2f} % | per-anchor anchor_accept {anchor:.3f}"
    )
    return walk.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    torch.set_num_threads(1)  # 2 cores shared with other work: a second thread only spins
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-tau-"))
    work.mkdir(parents=True, exist_ok=True)

    if not (work / "shards" / "shard-00003.arrow").is_file():  # a rerun in the same --workdir reuses them
        write_tiny_target(work / "target", kind="qwen3", seed=0)
        synth_shards(
            work / "target",
            work / "shards",
            num_shards=4,
            rows=96,
            seq_len=96,
            seed=0,
            vocab_size=TINY_MASK_TOKEN_ID,
        )
    config = CONFIG.format(mask=TINY_MASK_TOKEN_ID, steps=args.steps)
    config = re.sub(r"eval_walk_prompts = \d+", f"eval_walk_prompts = {args.prompts}", config)
    (work / "train.toml").write_text(config)
    run = Run(load_config(work / "train.toml"))
    prompts = walk_prompts(run.target.held_out, args.prompts, 10_000)
    n, length = len(prompts), len(prompts[0])
    print(f"tiny qwen3 target; {n} held-out prompts of {length} tokens, {args.new_tokens} new tokens each")

    start = {k: v.clone() for k, v in run.drafter.drafter.state_dict().items()}
    compare("step 0", run, start, work, prompts, args.new_tokens)
    t0 = time.perf_counter()
    run.train(stop_at=args.steps)
    step_s = (time.perf_counter() - t0) / args.steps
    print(f"{args.steps} training steps, {step_s * 1000:.0f} ms each")
    walk_s = compare(f"step {args.steps}", run, run.drafter.ema.weights(), work, prompts, args.new_tokens)
    for every in (100, 500):
        share = 100 * walk_s / (walk_s + every * step_s)
        print(f"a walk every {every} steps: {share:.1f} % of training time")


if __name__ == "__main__":
    main()
