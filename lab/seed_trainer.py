"""The lab's seed, made in ONE trainer process (`.venv-trainer/bin/python -m lab.seed_trainer MODEL SHARDS
SEED`): the tiny target (`dflash-train model tiny`'s code), its manifest, the target-regenerated shards
(`dflash-train data synth`'s code) and theirs. Run by lab/seed.py; imports only the trainer and the standard
library, since it runs in the trainer's venv.

Why one process and one batch per shard: seeding through four CLI calls and batches of 16 rows took about four
minutes of a fresh machine's first `make smoke-train` (each CLI call imports torch; each generate call costs
the same wall time whatever its batch on a model this small). Rows are as long as the lab trains on
(data.seq_len 64 in inventory/lab: 32 prompt tokens, 32 supervised), not twice that.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

NUM_SHARDS = 4
ROWS = 64  # per shard: 6 epochs over 252 training rows (4 held out) are the lab's 1512 steps
SEQ_LEN = 64
PROMPT_LEN = 32


def say(msg: str) -> None:
    print(f"lab: seeding: {msg}", flush=True)


def main(argv: list[str]) -> int:
    model_dir, shards_dir, seed = Path(argv[0]), Path(argv[1]), int(argv[2])
    started = time.monotonic()
    import torch

    from dflash_trainer.fixtures.synth import synth_shards
    from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID, write_tiny_target
    from dflash_trainer.manifest import write_manifest

    torch.set_num_threads(1)  # two shared cores: one thread is as fast and leaves the other to the lab
    if not model_dir.exists():
        write_tiny_target(model_dir, kind="qwen3_5", seed=seed)
        write_manifest(model_dir)
        say(f"tiny target written ({time.monotonic() - started:.0f} s)")
    shards_dir.mkdir(parents=True, exist_ok=True)
    for shard in range(NUM_SHARDS):
        # One shard per call, each from its own seed: shard N is the same whether or not the others exist.
        synth_shards(
            model_dir,
            shards_dir / f"part-{shard}",
            num_shards=1,
            rows=ROWS,
            seq_len=SEQ_LEN,
            prompt_len=PROMPT_LEN,
            seed=seed * 1000 + shard,
            batch=ROWS,
            vocab_size=TINY_MASK_TOKEN_ID,  # the mask token is the last id: it never appears in the data
        )
        (shards_dir / f"part-{shard}" / "shard-00000.arrow").rename(shards_dir / f"shard-{shard:05d}.arrow")
        (shards_dir / f"part-{shard}").rmdir()
        say(f"shard {shard + 1}/{NUM_SHARDS} written ({time.monotonic() - started:.0f} s)")
    write_manifest(shards_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
