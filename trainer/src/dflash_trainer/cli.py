"""`dflash-train` command line.

User errors (a bad config key, a missing file, a malformed shard) are one line on stderr naming the file or
key and a non-zero exit, never a traceback; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from dflash_trainer import __version__
from dflash_trainer.config import ConfigError, load_config, to_toml
from dflash_trainer.data.shards import DataError


class UserError(Exception):
    """Raised for a mistake in the invocation; printed as one line."""


# ---- config show ----


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, check_paths=not args.no_paths)
    print(json.dumps(cfg.to_dict(), indent=2) if args.format == "json" else to_toml(cfg.to_dict()), end="\n")
    return 0


# ---- train ----


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)  # before torch and FLA load (seconds): a bad config fails at once
    from dflash_trainer.train.loop import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    if cfg.service.save_on_stop:
        # systemd stops with SIGTERM: finish the step, save, exit 0 (TimeoutStopSec covers a save).
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    result = train(cfg, max_steps=args.max_steps, stop=stop)
    print(f"step {result.step}; checkpoint {result.checkpoint}" + (" (stopped)" if result.stopped else ""))
    return 0


# ---- data, model, manifest ----


def cmd_data_synth(args: argparse.Namespace) -> int:
    from dflash_trainer.fixtures.synth import synth_shards

    if not (args.target / "config.json").is_file():
        raise UserError(f"{args.target}: no config.json (not a target directory)")
    try:
        paths = synth_shards(
            args.target,
            args.out,
            num_shards=args.shards,
            rows=args.rows,
            seq_len=args.seq_len,
            seed=args.seed,
            prompt_len=args.prompt_len,
            vocab_size=args.vocab_size,
            mask_token_id=args.mask_token_id,
        )
    except ValueError as e:  # a bad --mask-token-id, --vocab-size or --prompt-len
        raise UserError(str(e)) from None
    print(f"wrote {len(paths)} shards of {args.rows} rows to {args.out}")
    return 0


def cmd_model_tiny(args: argparse.Namespace) -> int:
    from dflash_trainer.fixtures.tiny import TINY_KINDS, write_tiny_target

    if args.kind not in TINY_KINDS:
        raise UserError(f"--kind {args.kind!r}: choose from {', '.join(TINY_KINDS)}")
    print(write_tiny_target(args.out, kind=args.kind, seed=args.seed))
    return 0


def cmd_model_random(args: argparse.Namespace) -> int:
    from dflash_trainer.fixtures.shapes import write_random_target

    try:
        out = write_random_target(
            args.out, args.shape, layers=args.layers, device=args.device, seed=args.seed, progress=print
        )
    except (ValueError, FileExistsError) as e:
        raise UserError(str(e)) from None
    print(out)
    return 0


def cmd_manifest(args: argparse.Namespace) -> int:
    from dflash_trainer.manifest import check_manifest, write_manifest

    if not args.dir.is_dir():
        raise UserError(f"{args.dir}: no such directory")
    if not args.check:
        print(write_manifest(args.dir, args.manifest))
        return 0
    problems = check_manifest(args.dir, args.manifest, full=args.full)
    for problem in problems:
        print(f"{args.dir}: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{args.dir}: matches its manifest ({'sha256' if args.full else 'sizes'})")
    return 0


# ---- export ----


def _checkpoint_dir(path: Path) -> Path:
    from dflash_trainer.checkpoint import latest_checkpoint

    if (path / "state.pt").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise UserError(f"{path}: neither a checkpoint nor a directory holding checkpoints")
    return latest


def _drafter_from_checkpoint(path: Path, source: str):
    import torch

    from dflash_trainer.checkpoint import load_checkpoint
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec

    state, ema = load_checkpoint(path, ema=source == "ema")
    spec = DrafterSpec.from_config_dict(state["spec"])
    weights = ema["shadow"] if source == "ema" else state["trainer"]["drafter"]
    drafter = DFlashDrafter(spec).to(torch.float32)
    drafter.load_state_dict(weights, strict=True)
    return drafter


def cmd_export(args: argparse.Namespace) -> int:
    from dflash_trainer.export import DTYPES, check_export, export_draft, load_draft

    if args.check:
        if args.out is not None:
            raise UserError("export --check takes one directory: export --check OUT [--against CKPT]")
        out = args.path
        try:
            drafter = load_draft(out)
        except (FileNotFoundError, KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{out}: not a loadable draft model ({e})") from None
        print(
            f"{out}: loads as a {drafter.spec.num_layers}-layer DFlash drafter, "
            f"block size {drafter.spec.block_size}"
        )
        if args.against is not None:
            reference = _drafter_from_checkpoint(_checkpoint_dir(args.against), args.source)
            print(f"max |difference| to {args.against} ({args.source}): {check_export(out, reference):.3g}")
        return 0
    if args.out is None:
        raise UserError("export needs CKPT and OUT (or --check OUT)")
    if args.untrained:
        from dflash_trainer.export import untrained_drafter

        drafter, what = untrained_drafter(load_config(args.path)), f"the untrained drafter of {args.path}"
    else:
        ckpt = _checkpoint_dir(args.path)
        drafter, what = _drafter_from_checkpoint(ckpt, args.source), f"{ckpt} ({args.source})"
    export_draft(drafter.state_dict(), drafter.spec, args.out, dtype=DTYPES[args.dtype])
    print(
        f"exported {what} to {args.out} as {args.dtype}; "
        f"max |difference| {check_export(args.out, drafter):.3g}"
    )
    return 0


# ---- parser ----


def build_parser(*, with_plan: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description="Train DFlash drafters.")
    parser.add_argument("--version", action="version", version=f"dflash-train {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = sub.add_parser("config", help="inspect a configuration").add_subparsers(
        dest="action", required=True
    )
    show = config.add_parser("show", help="print the effective configuration (defaults resolved)")
    show.add_argument("config", type=Path)
    show.add_argument("--format", choices=("toml", "json"), default="toml")
    show.add_argument(
        "--no-paths", action="store_true", help="do not read the target's config.json or the shards"
    )
    show.set_defaults(func=cmd_config_show)

    train = sub.add_parser("train", help="train (resumes from the newest checkpoint)")
    train.add_argument("config", type=Path)
    train.add_argument("--max-steps", type=int, help="stop after this step; the schedule is unchanged")
    train.set_defaults(func=cmd_train)

    data = sub.add_parser("data", help="training data").add_subparsers(dest="action", required=True)
    synth = data.add_parser("synth", help="write target-regenerated synthetic shards")
    synth.add_argument("--target", type=Path, required=True)
    synth.add_argument("--out", type=Path, required=True)
    synth.add_argument("--shards", type=int, default=2)
    synth.add_argument("--rows", type=int, default=64, help="rows per shard")
    synth.add_argument("--seq-len", type=int, default=128)
    synth.add_argument("--prompt-len", type=int, help="default: a quarter of --seq-len")
    synth.add_argument("--vocab-size", type=int, help="draw prompt tokens below this id")
    synth.add_argument(
        "--mask-token-id",
        type=int,
        help="the drafter's mask token, never written (default: the vocabulary's last id, the tiny targets')",
    )
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(func=cmd_data_synth)

    model = sub.add_parser("model", help="models").add_subparsers(dest="action", required=True)
    tiny = model.add_parser("tiny", help="write a tiny random target (config.json + model.safetensors)")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--kind", default="qwen3_5")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_model_tiny)
    rand = model.add_parser(
        "random", help="write a random target of a published shape, in its published layout (rehearsals)"
    )
    rand.add_argument("out", type=Path)
    rand.add_argument("--shape", required=True, help="qwen3.6-27b, or qwen3.6-mini (same structure, tiny)")
    rand.add_argument("--layers", type=int, help="keep the first N layers (default: all)")
    rand.add_argument("--device", help="where weights are made (default: cuda when there is one, else cpu)")
    rand.add_argument("--seed", type=int, default=0)
    rand.set_defaults(func=cmd_model_random)

    manifest = sub.add_parser("manifest", help="write or check DIR's manifest (path, size, sha256 per file)")
    manifest.add_argument("dir", type=Path)
    manifest.add_argument(
        "--check", action="store_true", help="verify instead of write (sizes unless --full)"
    )
    manifest.add_argument("--full", action="store_true", help="with --check: hash every file")
    manifest.add_argument("--manifest", type=Path, help="manifest file (default: DIR/MANIFEST.json)")
    manifest.set_defaults(func=cmd_manifest)

    export = sub.add_parser("export", help="write the published draft-model format from a checkpoint")
    export.add_argument(
        "path",
        type=Path,
        metavar="CKPT",
        help="a checkpoint, or a directory of them (newest); with --untrained, a training config",
    )
    export.add_argument("out", type=Path, nargs="?", metavar="OUT")
    export.add_argument("--from", dest="source", choices=("ema", "weights"), default="ema")
    export.add_argument(
        "--untrained",
        action="store_true",
        help="export the drafter a run of config CKPT starts from (step 0): a baseline to serve",
    )
    export.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="weights' dtype"
    )
    export.add_argument(
        "--check", action="store_true", help="check an exported directory: export --check OUT"
    )
    export.add_argument(
        "--against", type=Path, metavar="CKPT", help="with --check: compare with a checkpoint"
    )
    export.set_defaults(func=cmd_export)

    plan = sub.add_parser("plan", help="measure target and drafter throughput; print the split of GPUS")
    if with_plan:  # its module imports torch (seconds): only for `plan` itself
        from dflash_trainer.distributed.plan import add_plan_arguments, plan_main

        add_plan_arguments(plan)
        plan.set_defaults(func=plan_main)

    for name, (_, text) in PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False)  # listed here, dispatched by main()
    return parser


# The service's entry points parse their own arguments (their --help too): everything after the name passes.
PASSTHROUGH: dict[str, tuple[str, str]] = {
    "preflight": ("preflight_main", "check the machine, models, data and trackers, in seconds"),
    "smoke": ("smoke_main", "smoke prepare|report (used by make smoke-train)"),
    "serve": ("service_main", "one rank of dflash-train.service"),
    "launch": ("launch_main", "the unit's main process: starts and watches the ranks"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        from dflash_trainer import service

        return getattr(service, PASSTHROUGH[argv[0]][0])(argv[1:])
    parser = build_parser(with_plan="plan" in argv[:1])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ConfigError, DataError, UserError) as e:
        print(f"dflash-train {args.command}: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"dflash-train {args.command}: {e.filename}: no such file or directory", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
