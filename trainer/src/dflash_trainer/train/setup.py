"""What every rank of a run agrees on and builds: the device, dtype and autocast, the objective's settings,
the data (`ItemStream`: item i of the one global data order is rows [i*B, (i+1)*B)), the `Setup` read from
the training config, and the drafter (its spec, seeded initialisation, compile and checkpointing)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dflash_trainer.config import TrainConfig
from dflash_trainer.data.batch import Batch, collate
from dflash_trainer.data.shards import ShardReader
from dflash_trainer.runtime import run_dtype

if TYPE_CHECKING:
    from dflash_trainer.model.drafter import DFlashDrafter


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ItemStream:
    """Item i is rows [i*B, (i+1)*B) of the one global data order; a target skips the other targets' items."""

    def __init__(self, reader: ShardReader, batch: int, seq_len: int) -> None:
        self.reader, self.batch, self.seq_len, self.next_item = reader, batch, seq_len, 0
        self._rows = iter(reader)

    def start_at(self, item: int, saved: dict[str, int] | None) -> None:
        """Continue from `item`. `saved` (a checkpoint's data position) must be of this seed and data."""
        if saved:
            self.reader.load_state_dict(saved)  # refuses another seed or changed data, naming both
        self.reader.load_state_dict(self.reader.state_at(item * self.batch))
        self._rows, self.next_item = iter(self.reader), item

    def item(self, item: int) -> Batch:
        if item < self.next_item:
            raise ValueError(f"item {item} requested after item {self.next_item - 1}: items go forward only")
        for _ in range((item - self.next_item) * self.batch):
            next(self._rows)
        self.next_item = item + 1
        return collate([next(self._rows) for _ in range(self.batch)], self.seq_len)


@dataclass
class Setup:
    """What every rank of a run agrees on, and how each builds its half: from the training config (the shards
    and the staged target) or from a bench size (random weights and tokens)."""

    cfg: TrainConfig
    device: torch.device
    dtype: torch.dtype
    make_target: Callable[[list[int]], Any]  # layer ids -> TargetModel
    make_rows: Callable[[], Callable[[int], Batch]]  # a fresh item -> rows function (a target's own reader)
    num_rows: int | None  # training rows (None: endless random data)
    held_out: Callable[[], list[Batch]]
    data_state: Callable[[int], dict[str, int] | None]  # the reader's position at an item (checkpoints)

    @property
    def wire_features(self) -> int:
        d = self.cfg.drafter
        return len(d.target_layer_ids or []) * int(d.hidden_size or 0)


def setup_from_config(cfg: TrainConfig, device: torch.device) -> Setup:
    from dflash_trainer.data.batch import batches
    from dflash_trainer.data.shards import list_shards, read_segments, split_held_out

    train_segments, held_segments = split_held_out(list_shards(cfg.data.shards), cfg.data.held_out)
    dtype = run_dtype(cfg, device)

    def reader() -> ShardReader:
        return ShardReader(train_segments, seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window)

    probe = reader()

    def make_target(layer_ids: list[int]) -> Any:
        from dflash_trainer.model.target import load_target

        return load_target(
            cfg.model.target_path, device=device, dtype=dtype, layer_ids=layer_ids, full=walks(cfg)
        )

    def make_rows() -> Callable[[int], Batch]:
        return ItemStream(reader(), cfg.optim.batch, cfg.data.seq_len).item

    def held_out() -> list[Batch]:
        return list(batches(read_segments(held_segments), cfg.optim.batch, cfg.data.seq_len))

    def data_state(item: int) -> dict[str, int]:
        return probe.state_at(item * cfg.optim.batch)

    return Setup(cfg, device, dtype, make_target, make_rows, probe.num_rows, held_out, data_state)


def drafter_spec(cfg: TrainConfig, target_config: Any):

    from dflash_trainer.model.drafter import DrafterSpec

    d = cfg.drafter
    spec = DrafterSpec.from_target_config(
        target_config,
        d.num_layers,
        d.block_size,
        d.mask_token_id,
        layer_types=d.layer_types,
        sliding_window=d.sliding_window,
        intermediate_size=d.intermediate_size,
        target_layer_ids=d.target_layer_ids,
        rope_theta=d.rope_theta,
    )
    heads = {
        k: getattr(d, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim") if getattr(d, k)
    }
    return dataclasses.replace(spec, **heads)


def prepare_drafter(drafter: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Applies train.gradient_checkpointing and train.compile. Each decoder layer is compiled in place
    (module.compile), so parameter names, and with them checkpoints and the export, stay those of the plain
    module; checkpointing wraps the compiled layer, which replays it."""
    drafter.gradient_checkpointing = cfg.train.gradient_checkpointing
    if cfg.train.compile:
        for layer in drafter.layers:
            layer.compile(backend=cfg.train.compile_backend)
    return drafter


def seeded_drafter(cfg: TrainConfig, target_config: Any, device: torch.device | None = None) -> DFlashDrafter:
    """The drafter a run of `cfg` starts from (step 0), its spec at `.spec`: seeded, so its initial weights
    are the same wherever it is built (every drafter rank, `export --untrained`)."""
    from dflash_trainer.model.drafter import DFlashDrafter

    seed_everything(cfg.data.seed)
    spec = drafter_spec(cfg, target_config)
    with torch.device(device or "cpu"):
        return DFlashDrafter(spec)


def build_drafter(cfg: TrainConfig, target_config: Any, device: torch.device) -> nn.Module:
    """The drafter for this target, seeded (identical initial weights on every drafter rank), prepared."""
    # Built where it trains: initialising the 1.7B reference drafter on the CPU took 26 s of every start on
    # 2 cores (seconds on a GPU host's CPUs too), then a host-to-device copy. fp32 master weights; autocast
    # does bf16. The seed makes every drafter rank's initial weights equal (DDP also broadcasts rank 0's).
    return prepare_drafter(seeded_drafter(cfg, target_config, device).to(device), cfg)


def walks(cfg: TrainConfig) -> bool:
    """Whether evaluations walk: the target is then loaded whole (the walk needs its logits)."""
    return cfg.train.eval_walk_prompts > 0 and cfg.data.held_out > 0


def head_only(setup: Setup) -> Any:
    """The target's embedding, head and config without its stack (what a drafter rank needs of it)."""
    head = setup.make_target([0])
    head.model.model.layers = nn.ModuleList()
    return head
