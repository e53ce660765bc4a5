"""The real workload: the frozen target on target ranks, the DFlash drafter step (DDP) on drafter ranks.

Built either from a training TOML (data from the shards) or from a bench size (random weights of a given
shape, random tokens), so `bench_pipeline.py` measures exactly the code that trains.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.config import (
    DataConfig,
    DrafterConfig,
    LoopConfig,
    ModelConfig,
    OptimConfig,
    TargetInfo,
    TrainConfig,
    load_config,
    validate,
)
from dflash_trainer.data.batch import Batch, collate
from dflash_trainer.data.shards import DataError, ShardReader
from dflash_trainer.distributed.topology import Role, Topology
from dflash_trainer.distributed.transport import TargetBatch, WireFormat

log = logging.getLogger("dflash_trainer.distributed")

# Bench sizes. qwen3-8b: the Qwen3-8B shape DESIGN.md's speeds were measured on, with a reference-shaped
# drafter (5 layers, 4 sliding + 1 full, block 16, 512 anchors, 3072 tokens).
BENCH = {
    "tiny": {
        "target": dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        ),
        "drafter": dict(num_layers=2, block_size=4, gamma=4.0, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"]),
        "data": dict(seq_len=64, max_anchors=8),
        "dtype": "float32",
    },
    "qwen3-8b": {
        "target": dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        ),
        "drafter": dict(num_layers=5, block_size=16, sliding_window=2048,
                        layer_types=["sliding_attention"] * 4 + ["full_attention"]),
        "data": dict(seq_len=3072, max_anchors=512),
        "dtype": "bfloat16",
    },
}  # fmt: skip


@dataclass
class Setup:
    """What both roles need to agree on, and how each builds its half."""

    cfg: TrainConfig
    dtype: torch.dtype
    make_target: Callable[[list[int]], Any]  # layer_ids -> TargetModel
    rows: Callable[[int], Batch]  # item -> its rows (collated, on the host)
    num_rows: int | None  # training rows (None: endless random data)
    stream: _ItemStream | None = None  # the shard reader behind `rows` (None: random data)

    def data_state(self, item: int) -> dict[str, int] | None:
        """The data position of `item` as ShardReader.state_dict (saved so a resume is checked and exact)."""
        return None if self.stream is None else self.stream.reader.state_at(item * self.cfg.optim.batch)

    @property
    def wire(self) -> WireFormat:
        d = self.cfg.drafter
        return WireFormat(
            self.cfg.optim.batch, self.cfg.data.seq_len, len(d.target_layer_ids) * d.hidden_size, self.dtype
        )


def _dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" and cfg.train.dtype == "bfloat16" else torch.float32


def from_config(path: Path, device: torch.device) -> Setup:
    from dflash_trainer.data.shards import list_shards, split_held_out
    from dflash_trainer.model.target import load_target

    cfg = load_config(path)
    train_segments, _ = split_held_out(list_shards(cfg.data.shards), cfg.data.held_out)
    reader = ShardReader(train_segments, seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window)
    stream = _ItemStream(reader, cfg.optim.batch, cfg.data.seq_len)
    dtype = _dtype(cfg, device)

    def make_target(layer_ids: list[int]) -> Any:
        return load_target(cfg.model.target_path, device=device, dtype=dtype, layer_ids=layer_ids)

    return Setup(cfg, dtype, make_target, stream.item, reader.num_rows, stream)


class _ItemStream:
    """Item i is rows [i*B, (i+1)*B) of the one global data order; a target skips the other targets' items."""

    def __init__(self, reader: ShardReader, batch: int, seq_len: int) -> None:
        self.reader, self.batch, self.seq_len, self.next_item = reader, batch, seq_len, 0
        self._rows: Iterator[Any] = iter(reader)

    def start_at(self, item: int, state: dict[str, int] | None) -> None:
        """Continue from `item`, at the position a checkpoint saved (validated: same seed, same data)."""
        expected = self.reader.state_at(item * self.batch)
        self.reader.load_state_dict(state or expected)  # refuses another seed or changed data, by name
        if self.reader.state_dict() != expected:
            raise DataError(f"the checkpoint's data position {state} is not that of item {item} ({expected})")
        self._rows, self.next_item = iter(self.reader), item

    def item(self, item: int) -> Batch:
        if item < self.next_item:
            raise ValueError(f"item {item} requested after item {self.next_item - 1}: items go forward only")
        for _ in range((item - self.next_item) * self.batch):
            next(self._rows)
        self.next_item = item + 1
        return collate([next(self._rows) for _ in range(self.batch)], self.seq_len)


def bench_config(size: str, steps: int) -> tuple[TrainConfig, dict[str, Any]]:
    b = BENCH[size]
    t = b["target"]
    cfg = TrainConfig(
        model=ModelConfig(Path("/nonexistent")),
        data=DataConfig(shards=Path("/nonexistent"), held_out=0, **b["data"]),
        drafter=DrafterConfig(mask_token_id=t["vocab_size"] - 1, **b["drafter"]),
        optim=OptimConfig(batch=1),
        train=LoopConfig(max_steps=steps, eval_every=0, dtype=b["dtype"]),
    )
    info = TargetInfo(
        t["num_hidden_layers"], t["hidden_size"], t["intermediate_size"], t["vocab_size"],
        t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"],
    )  # fmt: skip
    return validate(cfg, target=info), t


def random_target(
    target_kwargs: dict[str, Any], layer_ids: list[int], device: torch.device, dtype: torch.dtype
):
    """A Qwen3 target of the given shape with random weights, truncated after its last captured layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_trainer.model.target import TargetModel

    full = Qwen3Config(**target_kwargs, tie_word_embeddings=False)
    short = copy.deepcopy(full)
    short.num_hidden_layers = max(layer_ids) + 1
    short.layer_types = short.layer_types[: short.num_hidden_layers]
    torch.manual_seed(0)  # every target rank the same model
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(short, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return TargetModel(model, full, layer_ids)


def random_rows(cfg: TrainConfig, vocab: int) -> Callable[[int], Batch]:
    def rows(item: int) -> Batch:
        g = torch.Generator().manual_seed(item)
        shape = (cfg.optim.batch, cfg.data.seq_len)
        ids = torch.randint(0, vocab - 1, shape, generator=g)  # the last id is the mask token
        loss_mask = torch.ones(shape, dtype=torch.bool)
        loss_mask[:, : cfg.data.seq_len // 4] = False  # a prompt, then the supervised response
        return Batch(ids, torch.ones(shape, dtype=torch.long), loss_mask)

    return rows


def from_bench(size: str, device: torch.device, steps: int) -> Setup:
    cfg, target_kwargs = bench_config(size, steps)
    dtype = _dtype(cfg, device)

    def make_target(layer_ids: list[int]) -> Any:
        return random_target(target_kwargs, layer_ids, device, dtype)

    return Setup(cfg, dtype, make_target, random_rows(cfg, target_kwargs["vocab_size"]), None)


# ---- the two halves ----


class TargetProducer:
    def __init__(self, setup: Setup, device: torch.device) -> None:
        from dflash_trainer.train.trainer import autocast

        self.setup, self.device = setup, device
        self.target = setup.make_target(setup.cfg.drafter.target_layer_ids)
        self._autocast = lambda: autocast(setup.cfg, device)

    def start_at(self, item: int, data_state: dict[str, int] | None) -> None:
        if self.setup.stream is not None:
            self.setup.stream.start_at(item, data_state)

    def load(self, item: int) -> Batch:
        return self.setup.rows(item).to(self.device)

    def forward(self, batch: Batch) -> TargetBatch:
        with self._autocast():
            out = self.target.capture(batch.input_ids, batch.attention_mask, batch.loss_mask)
        return TargetBatch(out.input_ids, out.loss_mask, out.context.to(self.setup.dtype))


class _DdpForward(nn.Module):
    """What DDP wraps: the drafter's own forward, called as a class function (see DrafterConsumer)."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, *args: Any) -> torch.Tensor:
        return type(self.drafter).forward(self.drafter, *args)


class DrafterConsumer:
    """DrafterTrainer on this rank; gradients averaged over the drafter ranks by DDP.

    The objective calls `drafter.forward_blocks`, which calls `self.forward`; DDP must see that call to
    synchronise gradients, so the drafter's instance `forward` is pointed at the DDP wrapper, whose module
    runs the class's forward. Parameter names, checkpoints and the export stay those of the plain drafter.
    """

    def __init__(
        self,
        setup: Setup,
        device: torch.device,
        group: dist.ProcessGroup | None,  # None: a lone drafter (plan, bench)
        index: int,
        num_drafters: int,
        total_steps: int,
        *,
        save: bool,
    ) -> None:
        from dflash_trainer.ema import CpuEma
        from dflash_trainer.model.drafter import DFlashDrafter
        from dflash_trainer.train.loop import drafter_spec, seed_everything
        from dflash_trainer.train.trainer import DrafterTrainer, prepare_drafter

        cfg = self.cfg = setup.cfg
        self.leader = index == 0
        self.save_enabled = save and self.leader  # one writer; the others wait at the next all-reduce
        self.num_drafters = num_drafters
        # Layer 0 only: the drafter needs the target's frozen embedding, head and config, not its stack.
        head = setup.make_target([0])
        head.model.model.layers = nn.ModuleList()
        self.spec = drafter_spec(cfg, head)
        seed_everything(cfg.data.seed)  # identical initial weights on every drafter rank
        self.drafter = prepare_drafter(DFlashDrafter(self.spec).to(device), cfg)
        if group is not None and dist.get_world_size(group) > 1:
            ddp = nn.parallel.DistributedDataParallel(
                _DdpForward(self.drafter),
                process_group=group,
                device_ids=[device] if device.type == "cuda" else None,
            )
            # A plain instance attribute (nn.Module.__setattr__ would register DDP as a child of the drafter,
            # a cycle): forward_blocks' `self.forward` now goes through DDP.
            self.drafter.__dict__["forward"] = ddp
        self.trainer = DrafterTrainer(
            self.drafter, head.embed_tokens, head.lm_head, cfg, total_steps=total_steps
        )
        self.ema = (
            CpuEma(self.drafter, decay=cfg.train.ema_decay, every=cfg.train.ema_every)
            if self.leader
            else None
        )
        self.last: Any = None
        self.data_state = setup.data_state

    def step(self, step: int, item: int, batch: TargetBatch) -> str:
        # Anchors from the item number: any drafter, any restart draws the same ones (exact resume).
        self.trainer.generator.manual_seed(anchor_seed(self.cfg.data.seed, item))
        m = self.trainer.step(batch)  # type: ignore[arg-type]  # transport.TargetBatch, same fields
        if self.ema is not None:
            self.ema.update(self.drafter, m.step)
        self.last = m
        if self.save_enabled and m.step % self.cfg.train.checkpoint_every == 0:
            self.save(step + 1)
        return f"loss {m.loss:.4f} accept {m.acceptance_length:.2f} lr {m.lr:.2e}"

    def save(self, next_step: int) -> Path:
        from dflash_trainer.checkpoint import rng_state, save_checkpoint

        assert self.ema is not None
        state = {
            "trainer": self.trainer.state_dict(),
            # The data position of a pipeline run is the next item of the global schedule.
            "pipeline": {"next_item": next_step * self.num_drafters, "drafters": self.num_drafters},
            "data": self.data_state(next_step * self.num_drafters) or {},
            "rng": rng_state(self.trainer.generator),
            "spec": self.spec.config_dict(),
            "config": self.cfg.to_dict(),
        }
        t = self.cfg.train
        path = save_checkpoint(
            t.checkpoint_dir, self.trainer.step_count, state, self.ema.state_dict(), keep_last=t.keep_last
        )
        log.info("saved %s", path)
        return path

    def resume(self, path: Path) -> tuple[int, dict[str, int] | None]:
        """Loads a pipeline checkpoint (every drafter: the DDP replicas must start equal); returns its next
        item and data position."""
        from dflash_trainer.checkpoint import load_checkpoint, set_rng_state

        state, ema_state = load_checkpoint(path, ema=self.ema is not None)
        saved = state.get("pipeline", {}).get("drafters")
        if saved != self.num_drafters:
            raise ValueError(
                f"{path} was written by {saved} drafter rank(s), this run has {self.num_drafters}"
            )
        self.trainer.load_state_dict(state["trainer"])
        set_rng_state(state["rng"], self.trainer.generator)
        if self.ema is not None:
            self.ema.load_state_dict(ema_state)
        next_item = state["pipeline"]["next_item"]
        if self.trainer.step_count * self.num_drafters != next_item:
            raise ValueError(f"{path}: step {self.trainer.step_count} is not item {next_item}")
        log.info("resumed from %s (step %d)", path, self.trainer.step_count)
        return next_item, state.get("data") or None

    def finish(self, step: int) -> dict[str, Any]:
        if self.last is None:
            return {}
        if self.save_enabled and self.last.step % self.cfg.train.checkpoint_every:
            self.save(step)
        params = torch.cat([p.detach().flatten().double().cpu() for p in self.drafter.parameters()])
        return {
            "loss": self.last.loss,
            "acceptance_length": self.last.acceptance_length,
            "steps": step,
            "param_sum": float(params.sum()),
        }


def anchor_seed(seed: int, item: int) -> int:
    return (seed * 1_000_003 + item) % (1 << 63)


def pipeline_horizon(cfg: TrainConfig, num_rows: int | None, num_drafters: int) -> int:
    """Drafter steps of the run: train.max_steps, else optim.epochs over the rows, M items per step."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    if num_rows is None:
        raise ValueError("endless data needs train.max_steps or --steps")
    return math.ceil(cfg.optim.epochs * num_rows / (cfg.optim.batch * num_drafters))


def build_dflash(args: Any, role: Role, device: torch.device, drafters: dist.ProcessGroup, topo: Topology):
    """(producer or consumer, wire format, stop step, start step) for `launch`."""
    if args.bench:
        setup = from_bench(args.bench, device, args.steps or 20)
    else:
        setup = from_config(args.config, device)
    horizon = args.steps or pipeline_horizon(setup.cfg, setup.num_rows, topo.num_drafters)
    stop = min(horizon, args.max_steps or horizon)  # --max-steps stops early; the LR schedule keeps horizon
    if role is Role.TARGET:
        return TargetProducer(setup, device), setup.wire, stop, 0
    index = topo.index(dist.get_rank())
    consumer = DrafterConsumer(
        setup, device, drafters, index, topo.num_drafters, horizon, save=not args.bench
    )
    return consumer, setup.wire, stop, 0


def agree_on_start(
    work: TargetProducer | DrafterConsumer, topo: Topology, control: dist.ProcessGroup, rank: int
) -> int:
    """Resume: the drafter leader loads the newest checkpoint and tells every rank where it is (the checkpoint
    directory must be visible to every drafter); the other drafters load the same one, targets move their
    reader to its data position. Returns the step to continue from (0: no checkpoint)."""
    from dflash_trainer.checkpoint import latest_checkpoint

    leader = topo.drafter_ranks[0]
    box: list[Any] = [None]
    if rank == leader:
        assert isinstance(work, DrafterConsumer)
        path = latest_checkpoint(work.cfg.train.checkpoint_dir)
        if path is not None:
            box[0] = (str(path), *work.resume(path))
    dist.broadcast_object_list(box, src=leader, group=control)
    if box[0] is None:
        return 0
    path, next_item, data_state = box[0]
    if isinstance(work, DrafterConsumer) and rank != leader:
        work.resume(Path(path))
    elif isinstance(work, TargetProducer):
        work.start_at(next_item, data_state)
        log.info("resuming at item %d (%s)", next_item, path)
    return next_item // topo.num_drafters
