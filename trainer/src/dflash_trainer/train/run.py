"""The training run: the one path every topology takes, from a single process to N target + M drafter ranks.

- `TargetSide` (a target rank, or the target half of a single process): the frozen target, the data stream
  (item i of the one global data order is rows [i*B, (i+1)*B)), the capture that makes a TargetBatch, and the
  evaluation, which runs where the target lives (`eval_hooks` takes further evaluations, e.g. a decode walk).
- `DrafterSide` (a drafter rank, or the drafter half of a single process): the drafter, AdamW with warmup +
  cosine, gradient clipping, DDP over the drafter ranks, the CPU EMA, the checkpoint (saved in the
  background, atomic) and the resume.
- `Horizon` and `Position`: where the schedule ends and where a run continues, in terms that do not depend
  on the topology, so a checkpoint of 1 process, 1:1, 5:3 or 4:4 resumes under any other.
- `train(cfg)`: a single process, i.e. the 1:1 pipeline with target and drafter in one process: the same
  sides, the transport replaced by a call. distributed/launch.py runs the sides on their own ranks.

Anchors are drawn from a generator seeded by the item number, so whichever drafter trains an item, before or
after a restart, draws the same anchors: a resume under the same topology is bit-exact.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from dflash_trainer import startup
from dflash_trainer.checkpoint import (
    AsyncCheckpointer,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    set_rng_state,
)
from dflash_trainer.config import (
    DataConfig,
    DrafterConfig,
    LoopConfig,
    ModelConfig,
    OptimConfig,
    TargetInfo,
    TrainConfig,
    validate,
)
from dflash_trainer.data.batch import Batch, TargetBatch, collate
from dflash_trainer.data.shards import ShardReader
from dflash_trainer.evaluate import evaluate, walk_prompts
from dflash_trainer.method.objective import ObjectiveConfig, dflash_loss
from dflash_trainer.walk import WalkSettings, decode_walk, stop_token_ids

log = logging.getLogger("dflash_trainer.train")

# ---------------------------------------------------------------- precision, schedule, positions


@dataclass
class StepMetrics:
    step: int  # optimizer steps done, this one included
    loss: float
    lr: float
    grad_norm: float
    num_tokens: int  # supervised block positions
    seq_tokens: int  # target tokens of the batch (B*T)
    anchor_accept: float  # per-anchor (accepted run + 1) of this batch: a trend, not serving's tau
    per_position_acc: list[float]
    step_s: float  # the drafter step alone
    tokens_per_s: float = 0.0  # tokens of the whole pipeline per second of wall time; set by the loop
    eval: dict[str, float] = field(default_factory=dict)  # held-out figures that arrived with this step


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda, but no CUDA device is visible")
    return torch.device(cfg.train.device)


def run_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The target's weights and the wire's features: bf16 on CUDA when train.dtype says so, else fp32."""
    return torch.bfloat16 if device.type == "cuda" and cfg.train.dtype == "bfloat16" else torch.float32


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when train.dtype says so; fp32 elsewhere (CPU runs are tests and the lab)."""
    if device.type == "cuda" and cfg.train.dtype == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def training_capture(target: Any, cfg: TrainConfig) -> Callable[..., TargetBatch]:
    """The target forward of a training step: `target.capture`, or with train.target_compile its compiled
    layers (model.target.CompiledCapture), on CUDA replayed from a CUDA graph per row-length bucket
    (model.target.GraphedCapture); the walk and the held-out figures call `target.capture` itself."""
    if not cfg.train.target_compile:
        return target.capture
    from dflash_trainer.model.target import CompiledCapture, GraphedCapture

    compiled = CompiledCapture(target, backend=cfg.train.compile_backend)
    return GraphedCapture(compiled) if target.device.type == "cuda" else compiled


def objective_config(cfg: TrainConfig) -> ObjectiveConfig:
    d = cfg.drafter
    return ObjectiveConfig(
        block_size=d.block_size,
        mask_token_id=d.mask_token_id,
        max_anchors=cfg.data.max_anchors,
        gamma=d.gamma,
        loss_chunk_size=cfg.train.loss_chunk,
    )


def lr_factor(done: int, *, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup over `warmup` units, then cosine from 1 down to min_ratio at `total` (or constant)."""
    if done < warmup:
        return (done + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (done - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def anchor_seed(seed: int, item: int) -> int:
    return (seed * 1_000_003 + item) % (1 << 63)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class Horizon:
    """The schedule's length: train.max_steps optimizer steps, else optim.epochs over the data in items.

    In items, M drafters consume M items a step, so a run resumed under another topology keeps its place in
    the schedule and ends after the same data; in steps (smoke runs, tests) the step count is the position.
    """

    total: int
    unit: Literal["steps", "items"]

    def done(self, step: int, items: int) -> int:
        return step if self.unit == "steps" else items

    def lr_factor(self, step: int, items: int, optim: OptimConfig) -> float:
        return lr_factor(
            self.done(step, items),
            total=self.total,
            warmup=max(1, round(optim.warmup_ratio * self.total)) if optim.warmup_ratio else 0,
            schedule=optim.schedule,
            min_ratio=optim.min_lr_ratio,
        )


def horizon(cfg: TrainConfig, num_rows: int | None) -> Horizon:
    if cfg.train.max_steps is not None:
        return Horizon(cfg.train.max_steps, "steps")
    if num_rows is None:
        raise ValueError("endless data needs train.max_steps")
    return Horizon(math.ceil(cfg.optim.epochs * num_rows / cfg.optim.batch), "items")


@dataclass(frozen=True)
class Position:
    """Where a run continues: optimizer steps done, and the first item of the global order not trained."""

    step: int = 0
    next_item: int = 0
    data: dict[str, int] | None = field(default=None, compare=False)  # the saved reader position, checked

    def span(self, hz: Horizon, num_drafters: int, stop_at: int | None) -> tuple[int, int, int]:
        """(first pipeline step, end pipeline step, optimizer step minus pipeline step)

        Pipeline step p trains items [p*M, (p+1)*M). Under a topology whose M does not divide next_item,
        the run starts at the next multiple (skipping fewer than M items of the epoch). `stop_at` stops the
        run at that optimizer step without changing the schedule."""
        m = num_drafters
        first = -(-self.next_item // m)
        # In steps the optimizer step count ends the run; in items, the last item of the data.
        end = first + max(0, hz.total - self.step) if hz.unit == "steps" else max(first, -(-hz.total // m))
        if stop_at is not None:
            end = min(end, first + max(0, stop_at - self.step))
        return first, end, self.step - first


# ---------------------------------------------------------------- data and models of a run


# Bench sizes (plan, bench_pipeline): random weights of a given shape, random tokens. qwen3-8b is the shape
# docs/design.md's speeds were measured on, with a reference-shaped drafter.
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


def setup_from_bench(size: str, device: torch.device, steps: int) -> Setup:
    cfg, target_kwargs = bench_config(size, steps)
    dtype = run_dtype(cfg, device)

    def make_target(layer_ids: list[int]) -> Any:
        return random_target(target_kwargs, layer_ids, device, dtype)

    rows = random_rows(cfg, target_kwargs["vocab_size"])
    return Setup(cfg, device, dtype, make_target, lambda: rows, None, list, lambda _item: None)


def drafter_spec(cfg: TrainConfig, target_config: Any):
    import dataclasses

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


def new_drafter(cfg: TrainConfig, spec: Any, device: torch.device) -> nn.Module:
    """The drafter, seeded (identical initial weights on every drafter rank), prepared."""
    from dflash_trainer.model.drafter import DFlashDrafter

    seed_everything(cfg.data.seed)
    # Built where it trains: initialising the 1.7B reference drafter on the CPU took 26 s of every start on
    # 2 cores (seconds on a GPU host's CPUs too), then a host-to-device copy. fp32 master weights; autocast
    # does bf16. The seed makes every drafter rank's initial weights equal (DDP also broadcasts rank 0's).
    with torch.device(device):
        drafter = DFlashDrafter(spec)
    return prepare_drafter(drafter.to(device), cfg)


# ---------------------------------------------------------------- evaluation (where the target lives)


@dataclass
class EvalContext:
    """What an evaluation gets: the frozen target, the drafter at `step` (read only), the held-out rows."""

    step: int
    cfg: TrainConfig
    target: Any  # model.target.TargetModel
    drafter: nn.Module
    held_out: list[Batch]
    device: torch.device
    # What a long evaluation is doing, said as it goes (TargetSide.progress: the service's heartbeat).
    progress: Callable[[str], None] = lambda _text: None


EvalHook = Callable[[EvalContext], dict[str, float]]


def held_out_figures(ctx: EvalContext) -> dict[str, float]:
    """Token-weighted held-out loss, per-anchor acceptance (`anchor_accept`) and per-position accuracy."""
    with autocast(ctx.cfg, ctx.device):  # the drafter is in eval mode (TargetSide.evaluate)
        result = evaluate(ctx.drafter, ctx.target, ctx.held_out, objective_config(ctx.cfg))
    return result.as_dict()


def walk_figures(ctx: EvalContext) -> dict[str, float]:
    """The decode walk (dflash_trainer.walk): `walk_tau`, the acceptance length serving reports."""
    t = ctx.cfg.train
    prompts = walk_prompts(ctx.held_out, t.eval_walk_prompts, t.eval_walk_prompt_len)
    if not prompts:
        return {}
    model = ctx.target.model
    settings = WalkSettings(
        max_new_tokens=t.eval_walk_new_tokens, stop_token_ids=stop_token_ids(model), progress=ctx.progress
    )
    with autocast(ctx.cfg, ctx.device):
        return decode_walk(model, ctx.drafter, prompts, settings).as_dict()


def walks(cfg: TrainConfig) -> bool:
    """Whether evaluations walk: the target is then loaded whole (the walk needs its logits)."""
    return cfg.train.eval_walk_prompts > 0 and cfg.data.held_out > 0


def eval_share(seconds: float, trained_s: float) -> str:
    """An evaluation's cost as the operator weighs it: its seconds and its share of the time since the last
    one (training and evaluation together)."""
    if trained_s <= 0:
        return f"{seconds:.1f} s"
    total = seconds + trained_s
    return f"{seconds:.1f} s, {100 * seconds / total:.1f} % of the {total:.0f} s since the last"


# Every evaluation a TargetSide runs, in order; each returns figures (merged, logged, sent to the trackers as
# eval/<name>). Append a hook here to add one (it runs on target rank 0, or in the single process).
EVAL_HOOKS: list[EvalHook] = [held_out_figures, walk_figures]


# ---------------------------------------------------------------- the target side


class TargetSide:
    """A target rank's work (roles.Producer), and the evaluation: `evaluate(step, drafter)` runs the
    held-out figures and every hook of `eval_hooks` here, where the target is loaded."""

    def __init__(self, setup: Setup, *, evaluates: bool) -> None:
        self.setup, self.cfg, self.device = setup, setup.cfg, setup.device
        with startup.phase("target"):
            self.target = setup.make_target(self.cfg.drafter.target_layer_ids)
            self.capture = training_capture(self.target, self.cfg)
        with startup.phase("data stream"):
            self.rows = setup.make_rows()
        # Held-out rows are loaded wherever evaluation may run; train.eval_every says when it does.
        self.evaluates = evaluates and self.cfg.data.held_out > 0
        with startup.phase("held-out rows"):
            self.held_out = setup.held_out() if self.evaluates else []
        self.eval_hooks: list[EvalHook] = list(EVAL_HOOKS) if self.evaluates else []
        # Told what an evaluation is doing while it runs (minutes on a 27B target); the service sets it.
        self.progress: Callable[[str], None] = lambda _text: None
        # Training time since the first forward or the last evaluation: an evaluation's share of the run.
        self._trained_since: float | None = None

    def start_at(self, item: int, data_state: dict[str, int] | None) -> None:
        stream = getattr(self.rows, "__self__", None)
        if isinstance(stream, ItemStream):
            stream.start_at(item, data_state)

    def load(self, item: int) -> Batch:
        return self.rows(item).to(self.device)

    def forward(self, batch: Batch) -> TargetBatch:
        if self._trained_since is None:
            self._trained_since = time.perf_counter()
        with autocast(self.cfg, self.device):
            out = self.capture(batch.input_ids, batch.attention_mask, batch.loss_mask)
        return TargetBatch(out.input_ids, out.loss_mask, out.context.to(self.setup.dtype))

    def evaluate(self, step: int, drafter: nn.Module) -> dict[str, float]:
        ctx = EvalContext(
            step, self.cfg, self.target, drafter, self.held_out, self.device,
            progress=lambda text: self.progress(f"evaluation at step {step}: {text}"),
        )  # fmt: skip
        figures: dict[str, float] = {}
        started = time.perf_counter()
        was_training = drafter.training
        drafter.eval()  # every hook sees the drafter as it serves
        try:
            for hook in self.eval_hooks:
                try:
                    figures |= hook(ctx)
                except (
                    Exception
                ) as e:  # an evaluation bug must not end a days-long run; the smoke fails on it
                    log.error("evaluation %s at step %d failed: %s: %s (training goes on)",
                              hook.__name__, step, type(e).__name__, e, exc_info=True)  # fmt: skip
                    figures[f"{hook.__name__}_failed"] = 1.0
        finally:
            drafter.train(was_training)
        seconds = time.perf_counter() - started
        trained = started - self._trained_since if self._trained_since is not None else 0.0
        self._trained_since = time.perf_counter()
        if figures:
            shown = " ".join(f"{k} {v:.4f}" for k, v in figures.items() if not k.startswith("acc_"))
            log.info("evaluation at step %d: %s", step, shown)
            log.info("evaluation at step %d took %s", step, eval_share(seconds, trained))
        return figures


class EvalExchange:
    """Evaluation in the pipeline: after each evaluation step the drafter leader hands its weights to target
    rank 0 (a broadcast in a two-rank group), which evaluates them against its own target and publishes the
    figures in the job's store; the leader attaches them to the metrics of a later step (trackers, log).

    The store orders it: the leader marks `eval/ready/P` before the broadcast, and target rank 0 only enters
    the broadcast once that mark is there, or leaves the evaluation out when the agreed stop step says the
    leader will never train pipeline step P. Target 0 does this before making its first item of a later
    step; its items up to P are all sent by then, so the leader, which needs them to finish step P, is never
    waiting on it."""

    def __init__(self, store: Any, group: Any, leader: int, offset: int, cfg: TrainConfig, num_drafters: int):
        self.store, self.group, self.leader, self.offset = store, group, leader, offset
        self.cfg, self.num_drafters = cfg, num_drafters
        self._pending: list[int] = []  # optimizer steps whose figures the leader waits for

    def due(self, pipeline_step: int) -> bool:
        return eval_due(pipeline_step + 1 + self.offset, self.cfg)

    # the drafter leader
    def send(self, pipeline_step: int, drafter: nn.Module) -> None:
        self.store.set(f"eval/ready/{pipeline_step}", "1")
        for p in drafter.parameters():
            torch.distributed.broadcast(p.data, src=self.leader, group=self.group)
        self._pending.append(pipeline_step + 1 + self.offset)

    def collect(self, wait_s: float = 0.0) -> dict[str, float]:
        """Figures that have arrived since the last call; waits up to `wait_s` for the outstanding ones."""
        figures: dict[str, float] = {}
        deadline = time.monotonic() + wait_s
        while self._pending:
            if self.store.check([f"eval/figures/{self._pending[0]}"]):
                figures = json.loads(self.store.get(f"eval/figures/{self._pending.pop(0)}"))
            elif time.monotonic() < deadline:
                time.sleep(0.05)
            else:
                break
        return figures

    # target rank 0
    def receive_and_evaluate(
        self, pipeline_step: int, side: TargetSide, replica: nn.Module, stop_step: Callable[[], int | None]
    ) -> None:
        key = f"eval/ready/{pipeline_step}"
        while not self.store.check([key]):
            stop = stop_step()
            if stop is not None and pipeline_step >= stop:
                return  # the leader stops before this step: no weights will come
            time.sleep(0.01)
        for p in replica.parameters():
            torch.distributed.broadcast(p.data, src=self.leader, group=self.group)
        step = pipeline_step + 1 + self.offset
        figures = side.evaluate(step, replica)
        self.store.set(f"eval/figures/{step}", json.dumps(figures))


def eval_replica(side: TargetSide) -> nn.Module:
    """Target rank 0's copy of the drafter for evaluation: no optimizer, weights from the leader."""
    replica = new_drafter(side.cfg, drafter_spec(side.cfg, side.target.config), side.device)
    return replica.requires_grad_(False)


# ---------------------------------------------------------------- the drafter side


class _DdpForward(nn.Module):
    """What DDP wraps: the drafter's own forward, called as a class function (see DrafterSide)."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, *args: Any) -> torch.Tensor:
        return type(self.drafter).forward(self.drafter, *args)


class DrafterSide:
    """A drafter rank's work (roles.Consumer): the optimizer step, the EMA, the checkpoint and the resume.

    Gradients are averaged over the drafter ranks by DDP. The objective calls `drafter.forward_blocks`, which
    calls `self.forward`; DDP must see that call, so the drafter's instance `forward` is pointed at the DDP
    wrapper, whose module runs the class's forward. Parameter names, checkpoints and the export stay those of
    the plain drafter. The leader (drafter 0) keeps the EMA and writes the checkpoints.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        head: Any,  # a TargetModel: its embedding, head and config (the stack may be absent)
        hz: Horizon,
        *,
        device: torch.device,
        index: int = 0,
        num_drafters: int = 1,
        group: Any = None,  # the drafter ranks' process group (None: a lone drafter)
        save: bool = True,
        data_state: Callable[[int], dict[str, int] | None] = lambda _item: None,
        drafter: nn.Module | None = None,  # a prepared drafter (benchmarks); default: new_drafter
    ) -> None:
        from dflash_trainer.ema import CpuEma

        self.cfg, self.device, self.horizon, self.data_state = cfg, device, hz, data_state
        self.leader = index == 0
        self.num_drafters = num_drafters
        self.embed_tokens, self.lm_head = head.embed_tokens, head.lm_head
        self.spec = drafter.spec if drafter is not None else drafter_spec(cfg, head.config)
        start = time.perf_counter()
        with startup.phase("drafter"):
            self.drafter = drafter if drafter is not None else new_drafter(cfg, self.spec, device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            ddp = nn.parallel.DistributedDataParallel(
                _DdpForward(self.drafter),
                process_group=group,
                device_ids=[self.device] if self.device.type == "cuda" else None,
            )
            # A plain instance attribute (nn.Module.__setattr__ would register DDP as a child, a cycle).
            self.drafter.__dict__["forward"] = ddp
        o = cfg.optim
        params = list(self.drafter.parameters())
        with startup.phase("optimizer"):
            self.optimizer = torch.optim.AdamW(
                [
                    {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norm scales
                ],
                lr=o.lr,
                betas=(o.betas[0], o.betas[1]),
                fused=self.device.type == "cuda",
            )
        self.objective = objective_config(cfg)
        self.generator = torch.Generator()  # anchors, drawn on the CPU: the same on any device
        self.step_count = 0
        self.offset = 0  # optimizer step minus pipeline step (see Position.span)
        with startup.phase("EMA"):
            self.ema = (
                CpuEma(self.drafter, decay=cfg.train.ema_decay, every=cfg.train.ema_every)
                if self.leader
                else None
            )
        if self.leader:  # where a start's seconds go (the warm restart's goal is its first step in < 30 s)
            log.info(
                "drafter: %d layers, %.2fB parameters on %s, with its optimizer and EMA, in %.1f s",
                cfg.drafter.num_layers, sum(p.numel() for p in params) / 1e9, device,
                time.perf_counter() - start,
            )  # fmt: skip
        t = cfg.train
        self.checkpointer = (
            AsyncCheckpointer(t.checkpoint_dir, keep_last=t.keep_last) if save and self.leader else None
        )
        self.last: StepMetrics | None = None
        self.exchange: EvalExchange | None = None  # the leader's evaluation hand-off in a pipeline
        self.stopped = False
        self.save_due = False  # a periodic save deferred while the previous write runs
        self.saved_step: int | None = None  # the optimizer step of the newest save started

    # -- the step

    def step(self, step: int, item: int, batch: TargetBatch) -> str:
        """Pipeline step `step` on `item`: one optimizer step. Returns a short log fragment."""
        if self.checkpointer is not None:
            self.checkpointer.check()  # a background write that failed ends the run here
        start = time.perf_counter()
        items_before = step * self.num_drafters
        lr = self.cfg.optim.lr * self.horizon.lr_factor(self.step_count, items_before, self.cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.generator.manual_seed(anchor_seed(self.cfg.data.seed, item))
        if self.ema is not None:
            self.ema.begin()  # the average starts at the weights before the first step (a resume: loaded)
        self.drafter.train()
        with autocast(self.cfg, self.device):
            out = dflash_loss(
                self.drafter, batch, self.embed_tokens, self.lm_head, self.objective, self.generator
            )
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        if self.ema is not None:
            self.ema.prepare()  # its pinning, off a resume's start: behind the first step's queued kernels
        loss = float(out.loss.detach())  # the one host sync of the step
        if self.ema is not None:
            self.ema.update(self.drafter, self.step_count)
        m = StepMetrics(
            step=self.step_count,
            loss=loss,
            lr=lr,
            grad_norm=float(grad_norm),
            num_tokens=out.num_tokens,
            seq_tokens=batch.input_ids.numel(),
            anchor_accept=out.anchor_accept,
            per_position_acc=out.per_position_acc.tolist(),
            step_s=time.perf_counter() - start,
        )
        self.last = m
        if self.exchange is not None:
            if self.exchange.due(step):
                self.exchange.send(step, self.drafter)
            m.eval = self.exchange.collect()
        if self.checkpointer is not None and (m.step % self.cfg.train.checkpoint_every == 0 or self.save_due):
            if not self.checkpointer.busy():
                self.save(step + 1)
            elif not self.save_due:  # waiting would stall training for the rest of the previous write
                self.save_due = True
                log.info("checkpoint at step %d deferred: the previous write is still running; "
                         "saved after the first step that finds it done", m.step)  # fmt: skip
        return f"loss {m.loss:.4f} anchor_accept {m.anchor_accept:.2f} lr {m.lr:.2e}"

    # -- checkpoints

    def state_dict(self, next_step: int) -> dict[str, Any]:
        next_item = next_step * self.num_drafters
        return {
            "trainer": {
                "drafter": self.drafter.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step_count,
            },
            # Topology-free: the optimizer step and the next item of the global data order (in rows too, so
            # a different optim.batch still finds its place); `drafters` only says who wrote it.
            "position": {
                "step": self.step_count,
                "next_item": next_item,
                "rows": next_item * self.cfg.optim.batch,
                "drafters": self.num_drafters,
                "horizon": [self.horizon.total, self.horizon.unit],
            },
            "data": self.data_state(next_item) or {},
            "rng": rng_state(self.generator),
            "spec": self.spec.config_dict(),
            "config": self.cfg.to_dict(),
        }

    def save(self, next_step: int, *, final: bool = False) -> Path:
        """Snapshots the state and writes it in the background (leader only)."""
        assert self.checkpointer is not None and self.ema is not None
        ema = self.ema
        self.save_due, self.saved_step = False, self.step_count
        # The EMA is written live (frozen, not copied: 6.8 GB of host memory and a CPU copy in the stall).
        return self.checkpointer.save(
            self.step_count, self.state_dict(next_step), ema.freeze, release=ema.thaw, final=final
        )

    def resume(self, path: Path) -> Position:
        """Loads a checkpoint of any topology (every drafter: the DDP replicas must start equal)."""
        start = time.perf_counter()
        with startup.phase("checkpoint read"):
            state, ema_state = load_checkpoint(path, ema=self.ema is not None)
        if "position" not in state:
            raise ValueError(
                f"{path}: a checkpoint of an older trainer (no position); start afresh or export it"
            )
        trainer = state["trainer"]
        with startup.phase("checkpoint onto the drafter"):  # device copies of weights and moments; EMA queued
            self.drafter.load_state_dict(trainer["drafter"])
            self.optimizer.load_state_dict(trainer["optimizer"])
            if self.ema is not None and ema_state is not None:
                self.ema.load_state_dict(ema_state)
        self.step_count = trainer["step"]
        set_rng_state(state["rng"], self.generator)
        pos = state["position"]
        next_item = -(-pos["rows"] // self.cfg.optim.batch)
        if self.leader:
            seconds = time.perf_counter() - start
            log.info("checkpoint loaded in %.1f s; resumed from %s (step %d)", seconds, path, self.step_count)
            if pos["drafters"] != self.num_drafters:
                log.info(
                    "%s was written by %d drafter rank(s), this run has %d: continuing at item %d",
                    path.name,
                    pos["drafters"],
                    self.num_drafters,
                    -(-next_item // self.num_drafters) * self.num_drafters,
                )
        return Position(self.step_count, next_item, state.get("data") or None)

    def finish(self, step: int) -> dict[str, Any]:
        """End of the run (or of an agreed stop) at pipeline step `step`: the final save, finished before
        this returns, so SIGTERM's checkpoint is on disk before the process exits."""
        path = None
        if self.checkpointer is not None:
            if self.last is not None and self.saved_step != self.last.step:
                self.save(step, final=True)
            path = self.checkpointer.wait()
        if self.last is None:
            return {"checkpoint": str(path) if path else None}
        # Summed on the device: a host copy in float64 (13.6 GB at the reference, twice over while
        # concatenated) got the rank OOM-killed after its final save in the GPU rehearsal.
        param_sum = torch.stack(
            [p.detach().sum(dtype=torch.float64) for p in self.drafter.parameters()]
        ).sum()
        # The last evaluation's figures (target rank 0 evaluates after the leader's hand-off).
        figures = self.exchange.collect(wait_s=300.0) if self.exchange is not None else {}
        self.last.eval = figures or self.last.eval
        return {
            "eval": self.last.eval,
            "loss": self.last.loss,
            "anchor_accept": self.last.anchor_accept,
            "steps": step,
            "param_sum": float(param_sum),
            "checkpoint": str(path) if path else None,
        }


def head_only(setup: Setup) -> Any:
    """The target's embedding, head and config without its stack (what a drafter rank needs of it)."""
    head = setup.make_target([0])
    head.model.model.layers = nn.ModuleList()
    return head


def find_resume(cfg: TrainConfig) -> Path | None:
    return latest_checkpoint(cfg.train.checkpoint_dir)


def eval_due(optimizer_step: int, cfg: TrainConfig) -> bool:
    return bool(cfg.train.eval_every) and optimizer_step > 0 and optimizer_step % cfg.train.eval_every == 0


# ---------------------------------------------------------------- one process: the 1:1 pipeline in-process


Hook = Callable[[StepMetrics], None]


@dataclass
class TrainResult:
    step: int
    checkpoint: Path | None
    last: StepMetrics | None
    stopped: bool  # ended by the stop event, not by reaching the step limit


def log_line(m: StepMetrics) -> str:
    line = (
        f"step {m.step} loss {m.loss:.4f} lr {m.lr:.2e} grad {m.grad_norm:.2f} "
        f"anchor_accept {m.anchor_accept:.2f} tok/s {m.tokens_per_s:.0f}"
    )
    if m.eval:
        e = m.eval
        line += f" | held-out loss {e['loss']:.4f} anchor_accept {e['anchor_accept']:.2f}"
        if "walk_tau" in e:
            line += f" walk tau {e['walk_tau']:.2f} ({e['walk_steps']:.0f} verify steps, {e['walk_s']:.1f} s)"
    return line


class Run:
    """Target and drafter in one process: the 1:1 pipeline with the transport replaced by a call."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device or resolve_device(cfg)
        with startup.phase("data index"):
            self.setup = setup_from_config(cfg, self.device)
        self.target = TargetSide(self.setup, evaluates=True)
        self.horizon = horizon(cfg, self.setup.num_rows)
        self.drafter = DrafterSide(
            cfg, self.target.target, self.horizon, device=self.device, data_state=self.setup.data_state
        )
        self.position = Position()

    def resume(self) -> Path | None:
        path = find_resume(self.cfg)
        if path is not None:
            self.position = self.drafter.resume(path)
        return path

    def evaluate(self) -> dict[str, float]:
        return self.target.evaluate(self.drafter.step_count, self.drafter.drafter)

    def train(
        self, *, stop_at: int | None = None, hooks: Sequence[Hook] = (), stop: threading.Event | None = None
    ) -> TrainResult:
        first, end, offset = self.position.span(self.horizon, 1, stop_at)
        self.target.start_at(first, self.position.data)
        log.info(
            "training a %d-layer drafter on %s in one process (1:1): step %d, to step %d",
            self.cfg.drafter.num_layers, self.device, first + offset, end + offset,
        )  # fmt: skip
        p = first
        last = time.perf_counter()
        while p < end and not (stop is not None and stop.is_set()):
            batch = self.target.forward(self.target.load(p))
            self.drafter.step(p, p, batch)
            m = self.drafter.last
            assert m is not None
            if eval_due(m.step, self.cfg):
                m.eval = self.evaluate()
            now = time.perf_counter()
            m.tokens_per_s = m.seq_tokens / (now - last) if now > last else 0.0
            last = now
            if m.step % self.cfg.train.log_every == 0 or m.eval:
                log.info("%s", log_line(m))
            for hook in hooks:
                hook(m)
            p += 1
        extra = self.drafter.finish(p)
        ckpt = extra.get("checkpoint")
        return TrainResult(
            step=self.drafter.step_count,
            checkpoint=Path(ckpt) if ckpt else None,
            last=self.drafter.last,
            stopped=p < end,
        )


def train(
    cfg: TrainConfig,
    *,
    max_steps: int | None = None,
    hooks: Sequence[Hook] = (),
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainResult:
    """One process: trains until the horizon, or `max_steps` (a stop, not a new horizon), or `stop` is set.
    Resumes from the newest checkpoint; `on_ready` is called once models, data and checkpoint are loaded;
    `progress` hears what a long evaluation is doing while it runs."""
    run = Run(cfg)
    if progress is not None:
        run.target.progress = progress
    run.resume()
    if on_ready is not None:
        on_ready()
    return run.train(stop_at=max_steps, hooks=hooks, stop=stop)
