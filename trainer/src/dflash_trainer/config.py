"""The training configuration: one TOML file, checked here before anything heavy loads.

Every error is a ConfigError naming the dotted key (`drafter.block_size: must be >= 2, got 1`). Checks that
need the target read only its config.json. Relative paths resolve against the directory of the TOML file.

This module owns the configuration wherever it is read or written: the rank count (TopologyConfig.ranks),
overlays of tables (`overlay`), the one TOML writer (`to_toml`) and the keys typed as paths (`path_keys`).
Its module-level imports are the standard library and tomli-w only: the Ansible controller's venv loads this
file by path (roles/trainer_service/filter_plugins), where the trainer package and torch are not installed.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

ATTENTION_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass
class ModelConfig:
    target_path: Path


@dataclass
class DrafterConfig:
    mask_token_id: int  # the token masked block positions carry; serving must use the same
    num_layers: int = 5
    block_size: int = 16
    gamma: float | None = None  # None: the paper's value for the block size
    # None: evenly spaced from layer 1 to L-3, one per draft layer (method.layers.target_layer_ids)
    target_layer_ids: list[int] | None = None
    hidden_size: int | None = None  # must equal the target's; here so a mismatching recipe fails early
    intermediate_size: int | None = None  # None: the target's
    # Attention shape; None: the target's. The reference drafter (32 x 128) differs from its target (24 x 256)
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None  # None: the target's
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None  # None: all full
    sliding_window: int | None = None


@dataclass
class DataConfig:
    shards: Path
    seq_len: int = 3072
    max_anchors: int = 512
    seed: int = 0
    held_out: int = 64  # rows at the start of the sorted shards kept for evaluation, never trained on
    shuffle_window: int = 4096  # rows shuffled together inside a shard


@dataclass
class OptimConfig:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    epochs: int = 6
    batch: int = 1  # sequences per optimizer step


@dataclass
class LoopConfig:
    max_steps: int | None = None  # the schedule's horizon when set; else epochs over the data
    checkpoint_dir: Path = Path("checkpoints")
    checkpoint_every: int = 500
    keep_last: int = 3
    ema_decay: float = 0.999
    ema_every: int = 10
    eval_every: int = 500  # 0: never
    # Held-out rows scored per evaluation (loss, anchor_accept, acc_k): the first ones, the same every time;
    # 0: every held-out row. Each row is a target forward of up to seq_len tokens.
    eval_rows: int = 0
    # The decode walk at each evaluation (evaluation/walk.py): real speculative decoding of held-out prompts.
    eval_walk_prompts: int = 8  # up to this many held-out rows' prompts are walked; 0: no walk
    eval_walk_new_tokens: int = 128  # tokens generated per prompt
    eval_walk_prompt_len: int = 256  # a longer prompt keeps its last tokens
    # The walk's cache, drafter runner and CUDA graphs kept from one evaluation to the next (KeptWalk in
    # evaluation/walk.py): a later walk replays from its first step, for the GPU memory they hold in between
    # (on CUDA the drafter's linear weights in bf16 among them; docs/acceptance.md#what-it-costs).
    eval_walk_keep: bool = True
    log_every: int = 10
    gradient_checkpointing: bool = False
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"  # aot_eager: capture without codegen
    # The target's layers compiled for the training forward only (model.target.CompiledCapture; the walk and
    # the held-out figures stay eager), with compile_backend. Off by default (the lab keeps the target eager
    # on CPU); configs/reference.toml turns it on, and what that costs a start is in docs/trainer.md.
    target_compile: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    loss_chunk: int = 2048  # block positions per chunk of the lm_head + cross-entropy


@dataclass
class TopologyConfig:
    targets: int | Literal["auto"] = "auto"
    drafters: int | Literal["auto"] = "auto"

    @property
    def ranks(self) -> int | None:
        """targets + drafters, the ranks a unit starts; None while either is "auto" (the world decides)."""
        if isinstance(self.targets, int) and isinstance(self.drafters, int):
            return self.targets + self.drafters
        return None


@dataclass
class TrackersConfig:
    tensorboard: Path | None = None  # log directory
    wandb_project: str | None = None
    wandb_run: str | None = None


@dataclass
class ServiceConfig:
    status_every: int = 10  # steps between STATUS= lines
    watchdog: bool = True  # ping WATCHDOG=1 from the loop when systemd asks for it
    save_on_stop: bool = True  # SIGTERM saves a checkpoint, then exits 0


@dataclass
class TargetInfo:
    """What the checks read from the target's config.json."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


@dataclass
class TrainConfig:
    model: ModelConfig
    drafter: DrafterConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (paths as strings, None left out) for printing and for checkpoints."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# ---- parsing: TOML tables onto the dataclass tree, with types checked per key ----


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(json.dumps(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path"}[tp]


def _convert(key: str, value: Any, tp: Any, base: Path) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:  # `X | None`: None is a default, never written in TOML; X's own error is clearer
            return _convert(key, value, args[0], base)
        for arg in args:
            try:
                return _convert(key, value, arg, base)
            except ConfigError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_convert(f"{key}[{i}]", v, typing.get_args(tp)[0], base) for i, v in enumerate(value)]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, str) and value:
            return (base / value).resolve() if not Path(value).is_absolute() else Path(value)
    else:
        raise TypeError(f"config field type {tp!r} not handled")
    raise ConfigError(key, f"must be {_type_name(tp)}, got {value!r}")


def _build(cls: type, table: Any, prefix: str, base: Path) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(prefix, f"must be a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in table:
        if name not in fields:
            raise ConfigError(f"{prefix}.{name}", f"unknown key (known: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}"
        if name in table:
            tp = hints[name]
            if dataclasses.is_dataclass(tp):
                kwargs[name] = _build(tp, table[name], key, base)
            else:
                kwargs[name] = _convert(key, table[name], tp, base)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "required")
        elif isinstance(f.default, Path):  # a relative default resolves as a relative value would
            kwargs[name] = _convert(key, str(f.default), Path, base)
    return cls(**kwargs)


def parse_config(table: dict[str, Any], *, base: Path) -> TrainConfig:
    """Types and keys only; `validate` checks the values."""
    hints = typing.get_type_hints(TrainConfig)
    sections = [f.name for f in dataclasses.fields(TrainConfig)]
    for name in table:
        if name not in sections:
            raise ConfigError(name, f"unknown section (known: {', '.join(sections)})")
    kwargs = {}
    for name in sections:
        if name in table:
            kwargs[name] = _build(hints[name], table[name], name, base)
        elif name in ("model", "drafter", "data"):
            raise ConfigError(name, "required section missing")
        else:  # every default, resolved as in a table that sets none
            kwargs[name] = _build(hints[name], {}, name, base)
    return TrainConfig(**kwargs)


# ---- values: ranges, then combinations, then agreement with the target ----


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(key, f"must be >= {low}, got {value}")


def _validate_self(cfg: TrainConfig) -> None:
    d, data, o, t = cfg.drafter, cfg.data, cfg.optim, cfg.train
    _at_least("drafter.num_layers", d.num_layers, 1)
    _at_least("drafter.block_size", d.block_size, 2)
    if d.gamma is not None and d.gamma <= 0:
        raise ConfigError("drafter.gamma", f"must be > 0, got {d.gamma}")
    if d.layer_types is not None and len(d.layer_types) != d.num_layers:
        raise ConfigError(
            "drafter.layer_types",
            f"needs one entry per draft layer ({d.num_layers}), got {len(d.layer_types)}",
        )
    sliding = d.layer_types is not None and "sliding_attention" in d.layer_types
    if sliding and d.sliding_window is None:
        raise ConfigError("drafter.sliding_window", "required when drafter.layer_types has sliding_attention")
    if d.sliding_window is not None:
        _at_least("drafter.sliding_window", d.sliding_window, 1)
        if not sliding:
            raise ConfigError("drafter.sliding_window", "set, but no entry of drafter.layer_types is sliding")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        if getattr(d, key) is not None:
            _at_least(f"drafter.{key}", getattr(d, key), 1)
    if d.num_attention_heads and d.num_key_value_heads and d.num_attention_heads % d.num_key_value_heads:
        raise ConfigError(
            "drafter.num_key_value_heads",
            f"must divide drafter.num_attention_heads ({d.num_attention_heads}), got {d.num_key_value_heads}",
        )
    if d.rope_theta is not None and d.rope_theta <= 0:
        raise ConfigError("drafter.rope_theta", f"must be > 0, got {d.rope_theta}")
    if d.target_layer_ids is not None:
        if not d.target_layer_ids:
            raise ConfigError("drafter.target_layer_ids", "must not be empty")
        if any(b <= a for a, b in zip(d.target_layer_ids, d.target_layer_ids[1:], strict=False)):
            raise ConfigError(
                "drafter.target_layer_ids", f"must be strictly increasing, got {d.target_layer_ids}"
            )
        _at_least("drafter.target_layer_ids[0]", d.target_layer_ids[0], 0)

    _at_least("data.seq_len", data.seq_len, d.block_size + 1)
    _at_least("data.max_anchors", data.max_anchors, 1)
    _at_least("data.held_out", data.held_out, 0)
    _at_least("data.shuffle_window", data.shuffle_window, 1)

    if o.lr <= 0:
        raise ConfigError("optim.lr", f"must be > 0, got {o.lr}")
    if not 0 <= o.warmup_ratio < 1:
        raise ConfigError("optim.warmup_ratio", f"must be in [0, 1), got {o.warmup_ratio}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _at_least("optim.weight_decay", o.weight_decay, 0)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError("optim.betas", f"must be two numbers in [0, 1), got {o.betas}")
    if o.grad_clip <= 0:
        raise ConfigError("optim.grad_clip", f"must be > 0, got {o.grad_clip}")
    _at_least("optim.epochs", o.epochs, 1)
    _at_least("optim.batch", o.batch, 1)

    if t.max_steps is not None:
        _at_least("train.max_steps", t.max_steps, 1)
    _at_least("train.checkpoint_every", t.checkpoint_every, 1)
    _at_least("train.keep_last", t.keep_last, 1)
    if not 0 < t.ema_decay < 1:
        raise ConfigError("train.ema_decay", f"must be in (0, 1), got {t.ema_decay}")
    _at_least("train.ema_every", t.ema_every, 1)
    _at_least("train.eval_every", t.eval_every, 0)
    _at_least("train.log_every", t.log_every, 1)
    _at_least("train.loss_chunk", t.loss_chunk, d.block_size)
    if t.eval_every and data.held_out == 0:
        raise ConfigError("data.held_out", "must be > 0 when train.eval_every is set (evaluation needs rows)")
    _at_least("train.eval_rows", t.eval_rows, 0)
    _at_least("train.eval_walk_prompts", t.eval_walk_prompts, 0)
    _at_least("train.eval_walk_new_tokens", t.eval_walk_new_tokens, 1)
    _at_least("train.eval_walk_prompt_len", t.eval_walk_prompt_len, 1)

    for key in ("targets", "drafters"):
        value = getattr(cfg.topology, key)
        if value != "auto":
            _at_least(f"topology.{key}", value, 1)
    _at_least("service.status_every", cfg.service.status_every, 1)


def read_target_info(target_path: Path) -> TargetInfo:
    """The few numbers the checks need, from config.json alone (no weights, no transformers)."""
    path = target_path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("model.target_path", f"no config.json in {target_path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("model.target_path", f"cannot read {path}: {e}") from None
    text = raw.get("text_config", raw)  # multimodal Qwen3.5/3.6 checkpoints nest the language model
    try:
        return TargetInfo(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            vocab_size=int(text["vocab_size"]),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
        )
    except KeyError as e:
        raise ConfigError("model.target_path", f"{path} has no {e.args[0]}") from None


def _validate_against_target(cfg: TrainConfig, target: TargetInfo) -> None:
    """Checks the drafter against the target and fills the values that default to the target's."""
    from dflash_trainer.method.layers import target_layer_ids

    d = cfg.drafter
    if d.hidden_size is not None and d.hidden_size != target.hidden_size:
        raise ConfigError(
            "drafter.hidden_size",
            f"must equal the target's hidden size {target.hidden_size}, got {d.hidden_size}",
        )
    d.hidden_size = target.hidden_size
    if d.intermediate_size is None:
        d.intermediate_size = target.intermediate_size
    _at_least("drafter.intermediate_size", d.intermediate_size, 1)
    d.num_attention_heads = d.num_attention_heads or target.num_attention_heads
    d.num_key_value_heads = d.num_key_value_heads or target.num_key_value_heads
    d.head_dim = d.head_dim or target.head_dim
    if d.num_attention_heads % d.num_key_value_heads:
        raise ConfigError(
            "drafter.num_key_value_heads",
            f"must divide the {d.num_attention_heads} query heads, got {d.num_key_value_heads}",
        )

    if d.target_layer_ids is None:
        # One context layer per draft layer, spread over layers 1..L-3; a shallow target repeats layers.
        try:
            ids = target_layer_ids(target.num_layers, d.num_layers)
        except ValueError as e:
            raise ConfigError("drafter.num_layers", str(e)) from None
        if len(set(ids)) < len(ids):
            raise ConfigError(
                "drafter.num_layers",
                f"{d.num_layers} context layers spread over a {target.num_layers}-layer target repeat layers "
                f"({ids}); use fewer draft layers or set drafter.target_layer_ids",
            )
        d.target_layer_ids = ids
    if len(d.target_layer_ids) > target.num_layers:
        raise ConfigError(
            "drafter.target_layer_ids",
            f"{len(d.target_layer_ids)} layers, more than the target's {target.num_layers}",
        )
    if d.target_layer_ids[-1] >= target.num_layers:
        raise ConfigError(
            "drafter.target_layer_ids",
            f"layer {d.target_layer_ids[-1]} does not exist (target layers: 0..{target.num_layers - 1})",
        )

    if not 0 <= d.mask_token_id < target.vocab_size:
        raise ConfigError(
            "drafter.mask_token_id", f"must be a token id in [0, {target.vocab_size}), got {d.mask_token_id}"
        )


def _fill_defaults(cfg: TrainConfig) -> None:
    from dflash_trainer.method.loss import gamma_for_block_size

    d = cfg.drafter
    if d.gamma is None:
        try:
            d.gamma = gamma_for_block_size(d.block_size)
        except ValueError as e:
            raise ConfigError("drafter.gamma", str(e)) from None
    if d.layer_types is None:
        d.layer_types = ["full_attention"] * d.num_layers


def validate(cfg: TrainConfig, *, target: TargetInfo | None) -> TrainConfig:
    """Checks every value and resolves the defaults; with target=None the checks needing it are skipped."""
    _validate_self(cfg)
    if target is not None:
        _validate_against_target(cfg, target)
    _fill_defaults(cfg)
    return cfg


def _check_shards(cfg: TrainConfig) -> None:
    from dflash_trainer.data.shards import DataError, list_shards

    if not cfg.data.shards.is_dir():
        raise ConfigError("data.shards", f"no such directory: {cfg.data.shards}")
    try:
        list_shards(cfg.data.shards)
    except DataError as e:
        raise ConfigError("data.shards", str(e)) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """The file's tables as TOML gives them; a ConfigError naming the file (and the line) otherwise."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"not valid TOML: {e}") from None


def check_tables(table: dict[str, Any], *, base: Path) -> TrainConfig:
    """Keys, types and every value check that needs neither the target nor the trainer's other modules: what
    a machine without the trainer (the Ansible controller) can check. Defaults that need them stay unset."""
    cfg = parse_config(table, base=base)
    _validate_self(cfg)
    return cfg


def load_config(path: str | Path, *, check_paths: bool = True) -> TrainConfig:
    """Reads, type-checks and validates one TOML file.

    check_paths=False skips what needs the machine the run is for: the target's config.json and the shards.
    """
    path = Path(path)
    cfg = parse_config(read_toml(path), base=path.resolve().parent)
    target = read_target_info(cfg.model.target_path) if check_paths else None
    validate(cfg, target=target)
    if check_paths:
        _check_shards(cfg)
    return cfg


# ---- the configuration as tables: paths, overlays, the writer ----


def _is_path(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_path(a) for a in typing.get_args(tp))
    return tp is Path


def path_keys() -> list[str]:
    """Every dotted key typed as a path ("model.target_path", ...), read from the dataclasses' types."""
    keys = []
    for section in dataclasses.fields(TrainConfig):
        cls = typing.get_type_hints(TrainConfig)[section.name]
        hints = typing.get_type_hints(cls)
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(cls) if _is_path(hints[f.name])]
    return keys


def path_tables(cfg: TrainConfig) -> dict[str, dict[str, str]]:
    """The path keys that are set, as tables of the absolute paths the loader resolved them to."""
    tables: dict[str, dict[str, str]] = {}
    for key in path_keys():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None:
            tables.setdefault(section, {})[name] = str(value)
    return tables


def overlay(tables: dict[str, Any], *overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `tables` with each override's keys replacing theirs, table by key: a key set to None is
    removed (the trainer's default applies), and a table is never replaced whole, so a key that no override
    names keeps its value. A ConfigError names an override section that is not a table of keys."""
    out = {name: dict(table) if isinstance(table, dict) else table for name, table in tables.items()}
    for override in overrides:
        for name, keys in (override or {}).items():
            table = out.setdefault(str(name), {})
            if not isinstance(keys, dict) or not isinstance(table, dict):
                raise ConfigError(str(name), f"an overlay gives a table of keys, got {keys!r}")
            for key, value in keys.items():
                if value is None:
                    table.pop(str(key), None)
                else:
                    table[str(key)] = value
    return out


def to_toml(tables: dict[str, Any]) -> str:
    """TOML text that reads back as `tables` (tomli-w: tables at any depth, strings quoted, lists inline)."""
    return tomli_w.dumps(tables)
