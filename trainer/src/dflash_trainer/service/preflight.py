"""`dflash-train preflight CONFIG [--json] [--full]`: what a run needs, checked before any model loads.

One line per check; each failure is ONE line that names the fix. Exit 1 on any failure (2 on bad usage).
A tracker that cannot start is a warning, never a failure: training goes on without it.
The unit runs it as ExecStartPre, so a broken machine fails the start in seconds, with the reason in the
journal, instead of after the target has spent a minute loading. The model and the shards are compared with
their manifests by size; `--full` reads and hashes every file (sha256, several files at once) as well. A
manifest itself must have the sha256 that L4 pinned from the inventory (PINS_DIR): the manifest checks the
data, the pin checks the manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trainer.config import ConfigError, TrainConfig, load_config, read_target_info, validate
from dflash_trainer.manifest import human_bytes
from dflash_trainer.service import probe_cache

GiB = 1 << 30
PROVISION_L4 = "make provision TAGS=l4 (restages the model and re-syncs the shards)"
# One JSON file per pinned directory ({"directory", "manifest", "sha256"}), written by L4 (roles/shard_sync
# tasks/pin.yml) from the inventory's shard_sync_manifest_sha256 and model_stage_manifest_sha256.
PINS_DIR = Path("/etc/dflash/manifest-pins")


def pins_dir() -> Path:
    """PINS_DIR, or $DFLASH_MANIFEST_PINS_DIR (tests, a trainer run outside the service)."""
    return Path(os.environ.get("DFLASH_MANIFEST_PINS_DIR") or PINS_DIR)


class Failed(Exception):
    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail, self.fix = detail, fix


class Skipped(Exception):
    """Not applicable here (the reason is shown)."""


class Warned(Exception):
    """Something optional does not work (a tracker): shown as a warning, the run goes on without it."""

    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail, self.fix = detail, fix


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False
    warned: bool = False
    seconds: float = 0.0


@dataclass
class Context:
    config_path: Path
    nproc: int | None  # None: [topology]'s targets + drafters (the unit's rank count), else 1
    cfg: TrainConfig | None = None
    facts: dict = field(default_factory=dict)
    full: bool = False  # hash the model and the shards against their manifests, not only their sizes
    nnodes: int = 1  # several nodes (docs/pipeline.md): nproc is this node's share of [topology]'s ranks
    pins_dir: Path = field(default_factory=pins_dir)
    defer_probes: bool = False  # a probe without a kept verdict runs beside the ranks' start, not here

    def need_cfg(self) -> TrainConfig:
        if self.cfg is None:
            raise Skipped("the configuration did not load")
        return self.cfg


# ---------------------------------------------------------------- the checks


def check_config(ctx: Context) -> str:
    if not ctx.config_path.is_file():
        what = "is a directory" if ctx.config_path.is_dir() else "no such file"
        raise Failed(
            f"{ctx.config_path}: {what}",
            "pass the path of the training TOML (the unit's is trainer_service_config_path, written by L5: "
            "make provision TAGS=l5)",
        )
    try:
        ctx.cfg = load_config(ctx.config_path, check_paths=False)
    except ConfigError as e:
        ctx.nproc = ctx.nproc or 1
        raise Failed(str(e), f"edit {ctx.config_path} (the key named)") from None
    if ctx.nproc is None:  # the unit starts [topology]'s rank count (roles/trainer_service derives it alike)
        ranks = ctx.cfg.topology.ranks
        ctx.nproc = ranks // ctx.nnodes if ranks is not None else 1
    return f"{ctx.config_path} valid"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _require_manifested_dir(ctx: Context, path: Path, key: str, what: str):
    """The directory exists and matches its manifest (sizes; sha256 too with --full); else one failure naming
    the first problem. Returns the manifest.CheckResult, which says what was compared."""
    from dflash_trainer.manifest import MANIFEST_NAME, verify_manifest

    if not path.is_dir():
        raise Failed(f"{key} {path}: no such directory", PROVISION_L4)
    _require_pinned_manifest(ctx, path, what)
    result = verify_manifest(path, full=ctx.full)
    if result.problems:
        problems = result.problems
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        manifest = path / MANIFEST_NAME
        fix = PROVISION_L4 if manifest.exists() else f"write {manifest}: {PROVISION_L4}"
        checked = "sha256 and sizes" if result.hashed else "sizes"
        raise Failed(f"{what} {path}: {problems[0]}{more} ({checked} compared)", fix)
    return result


def load_pins(pins_dir: Path) -> dict[Path, tuple[str, str, Path]]:
    """Pinned directory -> (manifest name, sha256, pin file); Failed naming a pin file that is not one."""
    pins: dict[Path, tuple[str, str, Path]] = {}
    for pin_file in sorted(pins_dir.glob("*.json")) if pins_dir.is_dir() else []:
        try:
            pin = json.loads(pin_file.read_text())
            directory, name, digest = Path(pin["directory"]), str(pin["manifest"]), str(pin["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise Failed(f"{pin_file}: not a manifest pin ({type(e).__name__}: {e})", PROVISION_L4) from None
        pins[directory.resolve()] = (name, digest, pin_file)
    return pins


def _require_pinned_manifest(ctx: Context, path: Path, what: str) -> None:
    """A directory L4 pinned must hold the manifest with the pinned sha256 (else one failure naming both);
    one it did not pin (a run outside the service) is said so in ctx.facts, not refused."""
    from dflash_trainer.manifest import sha256_file

    pin = load_pins(ctx.pins_dir).get(path.resolve())
    if pin is None:
        ctx.facts.setdefault("unpinned", []).append(what)
        return
    name, pinned, pin_file = pin
    manifest = path / name
    actual = sha256_file(manifest) if manifest.is_file() else "missing"
    if actual != pinned:
        raise Failed(
            f"{what} {path}: {manifest} sha256 {actual} is not the pinned {pinned} ({pin_file})",
            f"{PROVISION_L4}; re-pin the inventory's manifest_sha256 only if this manifest is yours",
        )


def _pinned(ctx: Context, what: str) -> str:
    if what in ctx.facts.get("unpinned", []):
        return f"manifest not pinned (no pin in {ctx.pins_dir})"
    return "manifest sha256 as pinned"


def target_is_hybrid(target_path: Path) -> bool:
    """Whether the target has linear-attention (Gated DeltaNet) layers: the text config of a wrapper."""
    raw = json.loads((target_path / "config.json").read_text())
    return "linear_attention" in (raw.get("text_config", raw).get("layer_types") or [])


def check_model(ctx: Context) -> str:
    cfg = ctx.need_cfg()
    path = cfg.model.target_path
    checked = _require_manifested_dir(ctx, path, "model.target_path", "model")
    try:
        info = read_target_info(path)
        validate(cfg, target=info)
    except ConfigError as e:
        raise Failed(str(e), f"edit {ctx.config_path} or stage the intended target") from None
    ctx.facts["model_bytes"] = _dir_bytes(path)
    ctx.facts["hybrid"] = target_is_hybrid(path)
    ctx.facts["target"] = info
    return (
        f"{path}: {info.num_layers} layers, hidden {info.hidden_size}, "
        f"{human_bytes(ctx.facts['model_bytes'])}"
        + (", hybrid (linear attention)" if ctx.facts["hybrid"] else "")
        + f"; manifest matched: {checked.compared}; {_pinned(ctx, 'model')}"
    )


def check_shards(ctx: Context) -> str:
    import pyarrow as pa

    from dflash_trainer.data.shards import DataError, list_shards

    cfg = ctx.need_cfg()
    path = cfg.data.shards
    checked = _require_manifested_dir(ctx, path, "data.shards", "shards")
    try:
        shards = list_shards(path)
    except DataError as e:
        raise Failed(str(e), PROVISION_L4) from None
    for shard in shards:  # the footer only: a truncated or foreign file fails here
        try:
            pa.ipc.open_file(pa.memory_map(str(shard), "r"))
        except (pa.ArrowInvalid, OSError) as e:
            raise Failed(f"shard {shard}: not a complete Arrow IPC file ({e})", PROVISION_L4) from None
    return (
        f"{path}: {len(shards)} shards open; manifest matched: {checked.compared}; {_pinned(ctx, 'shards')}"
    )


def drafter_param_count(cfg: TrainConfig) -> int:
    d = cfg.drafter
    h = d.hidden_size or 0
    inter = d.intermediate_size or 0
    heads, kv, hd = d.num_attention_heads or 0, d.num_key_value_heads or 0, d.head_dim or 0
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h + 2 * hd
    k = len(d.target_layer_ids or [])
    return d.num_layers * per_layer + k * h * h + 2 * h


# The uid a file system shows for an owner the process's user namespace does not map: host root's directory
# seen from an unprivileged CT (whose own root is host uid 100000).
OVERFLOW_UID = 65534


def _nearest_existing(directory: Path) -> Path:
    """The directory, or the parent the trainer will make it in."""
    return directory if directory.exists() else next((p for p in directory.parents if p.exists()), Path("/"))


def check_checkpoint_dir(ctx: Context) -> str:
    """Create and remove a file where the checkpoints go. Only a write tells: on a shared storage bound into
    an unprivileged CT, host root's directory is nobody's inside, and a read-only mount refuses even root."""
    directory = ctx.need_cfg().train.checkpoint_dir
    where = _nearest_existing(directory)
    uid = os.geteuid()
    try:
        fd, name = tempfile.mkstemp(prefix=".dflash-preflight-", dir=where)
    except OSError as e:
        ctx.facts["checkpoint_dir_writable"] = False
        st = where.stat()
        owner = f"owner uid {st.st_uid}"
        if st.st_uid == OVERFLOW_UID:
            owner += " (an owner this CT does not map, e.g. host root's directory in an unprivileged CT)"
        mode = f"gid {st.st_gid}, mode {st.st_mode & 0o7777:04o}"
        raise Failed(
            f"train.checkpoint_dir {directory}: cannot create a file in {where} ({e.strerror}): {owner}, "
            f"{mode}; the trainer runs as uid {uid}",
            f"make {where} writable for uid {uid}: for a mount point of an unprivileged CT give it "
            f"ct_uid: {uid} in ct_mount_points (L2 chowns the host side to 100000 + that uid; "
            "docs/multi-host.md) or chown it on the host or NFS server; a read-only mount must be made rw",
        ) from None
    os.close(fd)
    os.unlink(name)
    ctx.facts["checkpoint_dir_writable"] = True
    return f"{where}: uid {uid} created and removed a file there"


def check_disk(ctx: Context) -> str:
    cfg = ctx.need_cfg()
    directory = cfg.train.checkpoint_dir
    if "target" not in ctx.facts:
        raise Skipped("needs the model check")
    if not ctx.facts.get("checkpoint_dir_writable", True):
        raise Skipped("needs a writable checkpoint directory (checkpoint-dir)")
    params = drafter_param_count(cfg)
    # fp32 weights + two AdamW moments (state.pt) + the fp32 EMA (ema.pt); keep_last + 1 exist during a save.
    per_ckpt = params * 16
    need = per_ckpt * (cfg.train.keep_last + 1)
    probe = _nearest_existing(directory)
    free = shutil.disk_usage(probe).free
    ctx.facts["checkpoint_bytes"] = per_ckpt
    count = cfg.train.keep_last + 1
    if free < need:
        mount = _mountpoint(probe)
        held = _checkpoints_bytes(directory)
        where = f"; the checkpoints already there hold {human_bytes(held)}" if held else ""
        raise Failed(
            f"train.checkpoint_dir {directory}: {human_bytes(free)} free on {mount}, "
            f"{count} checkpoints of about {human_bytes(per_ckpt)} need {human_bytes(need)}{where}",
            f"free {human_bytes(need - free)} or more on {mount} "
            f"(`du -xsh {str(mount).rstrip('/')}/* | sort -h` finds what fills it), or lower "
            "train.keep_last, or move train.checkpoint_dir to a larger file system",
        )
    return f"{directory}: {human_bytes(free)} free for {count} x {human_bytes(per_ckpt)}"


def _mountpoint(path: Path) -> Path:
    path = path.resolve()
    while path.parent != path and path.parent.stat().st_dev == path.stat().st_dev:
        path = path.parent
    return path


def _checkpoints_bytes(directory: Path) -> int:
    try:
        return _dir_bytes(directory) if directory.is_dir() else 0
    except OSError:
        return 0


def check_shm(ctx: Context) -> str:
    if "model_bytes" not in ctx.facts:
        raise Skipped("needs the model check")
    shm = Path("/dev/shm")
    if not shm.is_dir():
        raise Failed("/dev/shm does not exist", "mount a tmpfs on /dev/shm (the CT's shm entry, layer L2)")
    usage = shutil.disk_usage(shm)
    model = ctx.facts["model_bytes"]
    staged = str(ctx.need_cfg().model.target_path).startswith("/dev/shm/")
    # NCCL and the data loaders take shared memory per rank; keep 64 MiB each beyond the model.
    need = model + ctx.nproc * (64 << 20)
    if usage.total < need:
        raise Failed(
            f"/dev/shm is {human_bytes(usage.total)}, the model ({human_bytes(model)}) and "
            f"{ctx.nproc} ranks need {human_bytes(need)}",
            "raise ct_shm_size_mb (layer L2) and the CT memory limit with it",
        )
    where = "staged there" if staged else "not staged there"
    return f"/dev/shm {human_bytes(usage.total)}, model {human_bytes(model)} ({where})"


def check_memlock(ctx: Context) -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    text = f"{soft // 1024} KiB"
    if ctx.facts.get("device") == "cuda":
        raise Failed(
            f"memlock limit is {text}: pinned host buffers (EMA copies, hidden-state transfers) fail",
            "LimitMEMLOCK=infinity in the unit and lxc.prlimit.memlock: unlimited on the CT (layer L2)",
        )
    return f"{text} (enough on CPU; CUDA runs need LimitMEMLOCK=infinity)"


def device_kind(cfg: TrainConfig) -> str:
    import torch

    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


def check_devices(ctx: Context) -> str:
    import torch

    cfg = ctx.need_cfg()
    kind = device_kind(cfg)
    ctx.facts["device"] = kind
    topo = cfg.topology
    wanted = topo.ranks
    # Not a re-read of check_config's count: nproc is what the launch starts (--nproc, or the unit's
    # $DFLASH_NPROC, written at provisioning), else ranks // nnodes, short where nnodes does not divide ranks.
    if wanted is not None and wanted != ctx.nproc * ctx.nnodes:
        nodes = f" on each of {ctx.nnodes} nodes" if ctx.nnodes > 1 else ""
        raise Failed(
            f"topology has {topo.targets} target + {topo.drafters} drafter ranks = {wanted}, "
            f"the launch starts {ctx.nproc}{nodes}",
            "the unit starts [topology]'s targets + drafters ranks: re-run make provision after changing it",
        )
    model = ctx.facts.get("model_bytes", 0)
    # A drafter rank holds fp32 weights, gradients and two AdamW moments (16 bytes a parameter) plus
    # activations and the chunked head; 1.7x the states matches the reference's measured 45.7 GiB peak.
    drafter = int(drafter_param_count(cfg) * 16 * 1.7) if "target" in ctx.facts else 0
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise Failed(
                "train.device is cuda but no CUDA device is visible",
                "check the GPU passthrough (L2) and driver (L1)",
            )
        count = torch.cuda.device_count()
        if count < ctx.nproc:
            raise Failed(
                f"{ctx.nproc} ranks, {count} GPUs visible", "pass all GPUs to the CT (ct_gpus, layer L2)"
            )
        # One rank runs target and drafter together; in a pipeline a rank holds one of them.
        need = (model + drafter if ctx.nproc == 1 else max(model, drafter)) + (2 * GiB)
        short = []
        room = []
        for i in range(ctx.nproc):
            free, total = torch.cuda.mem_get_info(i)
            room.append(free - need)
            if free < need:
                short.append(f"GPU {i}: {free / GiB:.1f} of {total / GiB:.1f} GiB free")
        ctx.facts["gpu_room"] = min(room)  # what is left beside a rank (a checkpoint snapshot's place)
        if short:
            raise Failed(
                f"{'; '.join(short)}; a rank needs about {need / GiB:.1f} GiB",
                "stop what else holds the GPUs (nvidia-smi), or split target and drafter over more GPUs "
                "([topology]), or shrink the drafter or data.max_anchors",
            )
        name = torch.cuda.get_device_name(0)
        return f"{count} x {name}; {ctx.nproc} ranks; about {need / GiB:.1f} GiB needed per rank"
    available = _mem_available()
    need = model * max(1, ctx.nproc) + drafter
    if available is not None and available < need:
        raise Failed(
            f"{available / GiB:.1f} GiB RAM available, {ctx.nproc} ranks need about {need / GiB:.1f} GiB",
            "raise the CT memory limit (ct_memory_mb, layer L2) or run fewer ranks",
        )
    cores = os.cpu_count() or 1
    return f"cpu: {ctx.nproc} ranks on {cores} cores, {(available or 0) / GiB:.1f} GiB RAM available"


def check_host_memory(ctx: Context) -> str:
    """Host RAM for the drafter leader's CPU side: the fp32 EMA, its pinned staging, and the checkpoint
    snapshot (fp32 weights and AdamW moments) when the GPU has no room to hold it. A rank killed by the OOM
    killer in host RAM (a target staged in /dev/shm takes tens of GB beside it: docs/gpu-rehearsal.md
    "Runs") says nothing useful; this says it before anything loads. MemAvailable already leaves out
    /dev/shm's files."""
    if ctx.facts.get("device") != "cuda" or "target" not in ctx.facts:
        raise Skipped("CUDA runs only (on the CPU the devices check counts host memory)")
    params = drafter_param_count(ctx.need_cfg())
    snapshot = params * 12
    on_gpu = ctx.facts.get("gpu_room", 0) >= snapshot + 4 * GiB
    # The fp32 EMA and its pinned staging buffers (the weights' dtype: fp32 master weights), 8 bytes a
    # parameter; 3 GiB a rank: the CUDA context, torch's libraries, the data loader.
    need = params * 8 + ctx.nproc * 3 * GiB + (0 if on_gpu else snapshot)
    available = _mem_available()
    where = "on the GPU" if on_gpu else f"in host memory ({snapshot / GiB:.1f} GiB)"
    if available is not None and available < need:
        raise Failed(
            f"{available / GiB:.1f} GiB of host RAM available (beside /dev/shm's files), the ranks need "
            f"about {need / GiB:.1f} GiB: the EMA and its staging ({params * 8 / GiB:.1f} GiB), the "
            f"checkpoint snapshot {where}, 3 GiB a rank",
            "raise the CT memory limit (ct_memory_mb, layer L2), or free /dev/shm of what the run does not "
            "use, or move the drafter to a GPU with room for its snapshot ([topology])",
        )
    have = "unknown" if available is None else f"{available / GiB:.1f} GiB available"
    return f"about {need / GiB:.1f} GiB needed ({have}); checkpoint snapshot {where}"


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_compiler(ctx: Context) -> str:
    cfg = ctx.need_cfg()
    needed = ctx.facts.get("device") == "cuda" or cfg.train.compile
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [
        m
        for m, ok in (("a C compiler (cc/gcc)", cc), (f"Python headers ({header})", header.exists()))
        if not ok
    ]
    if missing:
        if not needed:
            raise Skipped(f"{' and '.join(missing)} missing, not needed on CPU without train.compile")
        raise Failed(
            f"{' and '.join(missing)} missing: Triton builds its launcher with them",
            "apt-get install gcc python3-dev (layer L3: make provision TAGS=l3)",
        )
    return f"{cc}, {header}"


# One probe module run as `python -m`: Triton reads its kernels' source from the file (gpu_probe.py).
PROBE_MODULE = "dflash_trainer.service.gpu_probe"
L3 = "make provision TAGS=l3"

# (what the probe's last line contains, the fix that matches that cause); the first match wins.
_PROBE_FIXES: list[tuple[tuple[str, ...], str]] = [
    (
        ("should be defined in a python file",),
        "a bug in the probe itself (it must run from its module file): report it",
    ),
    (
        ("failed to find c compiler", "no such file or directory: 'cc'", "no such file or directory: 'gcc'"),
        f"install gcc (apt-get install gcc; layer L3: {L3})",
    ),
    (
        ("python.h", "calledprocesserror", "returned non-zero exit status"),
        f"Triton could not build its launcher: install gcc and python3-dev (layer L3: {L3})",
    ),
    (
        (
            "driver version is insufficient",
            "no cuda-capable device",
            "cuinit",
            "cuda_error_no_device",
            "nvidia driver on your system is too old",
            "found no nvidia driver",
        ),
        "the NVIDIA driver: the host module (layer L1) and the CT's userspace (layer L3) must match "
        "and be new enough for the lock's CUDA; nvidia-smi in the CT shows both",
    ),
    (
        ("no module named", "importerror", "cannot import name"),
        f"reinstall the trainer lock (flash-linear-attention, triton; layer L3: {L3})",
    ),
    (("out of memory",), "another process holds the GPU's memory: nvidia-smi names it; stop it"),
    (
        ("ptx", "sm_", "unsupported gpu architecture", "ptxas"),
        "the pinned Triton does not support this GPU: upgrade triton and torch in the lock (make lock)",
    ),
    (("timed out",), "the kernel hung: check the GPU (nvidia-smi -q for Xid errors, layer L1)"),
]


def probe_fix(last_line: str) -> str:
    """The fix that matches a probe failure's cause (its exception's last line)."""
    text = last_line.lower()
    for needles, fix in _PROBE_FIXES:
        if any(n in text for n in needles):
            return fix
    return "report it with the probe's traceback (run the probe's command by hand to see it)"


def probe_command(probe: str, *, define_only: bool = False, shape: dict[str, int] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", PROBE_MODULE, probe]
    for key, value in (shape or {}).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd + (["--define-only"] if define_only else [])


def _probe(cmd: list[str], timeout: float) -> str:
    """Runs a probe; returns its `ok:` line, raises RuntimeError with the cause's one line."""
    import subprocess

    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    lines = [ln for ln in (proc.stdout + "\n" + proc.stderr).splitlines() if ln.strip()]
    if proc.returncode == 0:
        return next((ln[4:] for ln in reversed(lines) if ln.startswith("ok: ")), "ok")
    cause = next((ln[7:] for ln in reversed(lines) if ln.startswith("error: ")), None)
    if cause is None:  # died before its own handler (an import at module level, a signal)
        cause = lines[-1] if lines else f"exit status {proc.returncode}"
    raise RuntimeError(cause.strip())


def hybrid_shape(target_path: Path) -> dict[str, int]:
    """The Gated DeltaNet shape of a hybrid target, from its config.json (the text config of a wrapper)."""
    raw = json.loads((target_path / "config.json").read_text())
    text = raw.get("text_config", raw)
    try:
        return {
            "key_heads": int(text["linear_num_key_heads"]),
            "value_heads": int(text["linear_num_value_heads"]),
            "key_dim": int(text["linear_key_head_dim"]),
            "value_dim": int(text["linear_value_head_dim"]),
            "conv": int(text.get("linear_conv_kernel_dim", 4)),
        }
    except KeyError as e:
        raise Failed(
            f"model.target_path {target_path}/config.json: hybrid (linear_attention layers), no {e.args[0]}",
            "stage a complete target (its published config.json)",
        ) from None


def check_fla(ctx: Context) -> str:
    """A hybrid target needs flash-linear-attention on CUDA; said before any model loads."""
    if not ctx.facts.get("hybrid"):
        raise Skipped("the target has no linear-attention layers")
    try:
        import importlib.util

        found = importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        if ctx.facts.get("device") != "cuda":
            raise Skipped("flash-linear-attention missing; the CPU path uses transformers' torch kernels")
        raise Failed(
            "the target is hybrid (Gated DeltaNet layers) and flash-linear-attention is not installed: "
            "transformers would fall back to its slow torch kernels",
            f"reinstall the trainer lock (flash-linear-attention; layer L3: {L3})",
        )
    from importlib.metadata import version

    return f"flash-linear-attention {version('flash-linear-attention')} for the Gated DeltaNet layers"


def _target_model_type(target_path: Path) -> str:
    raw = json.loads((target_path / "config.json").read_text())
    return str(raw.get("model_type", ""))


def _run_probes(probes: dict[str, tuple[list[str], float]]) -> dict[str, str | RuntimeError]:
    """Runs the probes at once (each a child process: compiling is on the CPU, the kernels are small);
    returns each one's `ok:` line or its RuntimeError."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item: tuple[list[str], float]) -> str | RuntimeError:
        try:
            return _probe(*item)
        except RuntimeError as e:
            return e

    with ThreadPoolExecutor(max_workers=max(1, len(probes))) as pool:
        return dict(zip(probes, pool.map(one, probes.values()), strict=True))


@dataclass
class ProbePlan:
    """The GPU probes a run needs (name -> command, timeout), their keys, and the verdicts kept for them."""

    commands: dict[str, tuple[list[str], float]]
    keys: dict[str, dict[str, str]]
    cache: probe_cache.VerdictCache
    verdicts: dict[str, str] = field(default_factory=dict)  # kept, or passed in this run
    notes: list[str] = field(default_factory=list)  # per probe: its kept verdict's date, or why it runs

    @property
    def missing(self) -> list[str]:
        return [name for name in self.commands if name not in self.verdicts]


def plan_probes(hybrid_target: Path | None, *, full: bool) -> ProbePlan:
    """A Triton kernel's probe, and the FLA kernels' on the Gated DeltaNet shape of `hybrid_target` (None: not
    hybrid); a verdict kept from an earlier passed probe with an equal key is reused unless `full`."""
    wanted: dict[str, tuple[list[str], float, dict[str, int] | None]] = {
        "triton": (probe_command("triton"), 120, None)
    }
    if hybrid_target is not None:
        shape = hybrid_shape(hybrid_target)
        cmd = [*probe_command("fla", shape=shape), "--model-type", _target_model_type(hybrid_target)]
        wanted["fla"] = (cmd, 300, shape)
    environment = probe_cache.environment_key()
    plan = ProbePlan(
        commands={name: (cmd, timeout) for name, (cmd, timeout, _shape) in wanted.items()},
        keys={name: probe_cache.probe_key(environment, shape) for name, (_c, _t, shape) in wanted.items()},
        cache=probe_cache.VerdictCache(probe_cache.cache_path()),
    )
    for name, key in plan.keys.items():
        found = plan.cache.lookup(name, key) if not full else probe_cache.Lookup(None, "--full")
        if found.verdict is not None:
            plan.verdicts[name] = found.verdict
            plan.notes.append(f"{name} verdict {found.why}")
        else:
            plan.notes.append(f"{name} probed ({found.why})")
    return plan


def run_probes(plan: ProbePlan) -> str:
    """Runs the plan's missing probes at once and keeps each passed verdict; returns the check's line, or
    raises Failed naming the probe that failed and its fix."""
    start = time.perf_counter()
    results = _run_probes({name: plan.commands[name] for name in plan.missing})
    for name, result in results.items():
        if isinstance(result, RuntimeError):
            what = (
                "a small Triton kernel did not compile and run"
                if name == "triton"
                else "the FLA kernels on the target's Gated DeltaNet shape failed"
            )
            raise Failed(f"{what}: {result}", probe_fix(str(result)))
        plan.verdicts[name] = result
        problem = plan.cache.store(name, plan.keys[name], result)
        if problem:
            plan.notes.append(problem)
    ran = f"probes ran in {time.perf_counter() - start:.1f} s" if results else "no probe ran"
    return f"{'; '.join(plan.verdicts[n] for n in plan.commands)} [{ran}: {'; '.join(plan.notes)}]"


def check_triton(ctx: Context) -> str:
    """The GPU probes (service.gpu_probe): a Triton kernel, and a hybrid target's FLA kernels on its shape.
    A verdict kept from an earlier passed probe with an equal key is reused (service.probe_cache); --full
    always probes. With --defer-probes (the unit's) a probe without a kept verdict is left to the ranks, which
    run it beside their start (service.probes_beside)."""
    if ctx.facts.get("device") != "cuda":
        raise Skipped("no GPU: Triton kernels run on the GPU machine")
    hybrid = ctx.need_cfg().model.target_path if ctx.facts.get("hybrid") else None
    plan = plan_probes(hybrid, full=ctx.full)
    ctx.facts["probe_cache_hit"] = not plan.missing
    if plan.missing and ctx.defer_probes:
        kept = "".join(f"{plan.verdicts[n]}; " for n in plan.commands if n in plan.verdicts)
        return (
            f"{kept}{' and '.join(plan.missing)} deferred to the ranks: probed beside their start, before "
            f"their first kernel launch [{'; '.join(plan.notes)}]"
        )
    return run_probes(plan)


def check_trackers(ctx: Context) -> str:
    """Each configured tracker imports, has the API the code calls and starts offline; a tracker that does not
    is a warning (Warned), never a failure: at run time it warns once and training goes on without it."""
    cfg = ctx.need_cfg()
    from dflash_trainer.service import trackers

    names = trackers.configured(cfg)
    if not names:
        return "none configured"
    problems: list[tuple[str, str]] = []
    settings = trackers.wandb_settings_problems(cfg, os.environ)
    if settings:
        problems.append((settings[0], f"edit {ctx.config_path} [trackers] or /etc/dflash/secrets.env"))
    done = []
    for name in names:
        if name == "wandb" and settings:
            continue
        problem = _tracker_problem(ctx, cfg, name)
        if problem is None:
            done.append(name)
        else:
            problems.append(problem)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        off = ", ".join(n for n in names if n not in done)
        raise Warned(f"{problems[0][0]}{more}; training goes on without {off}", problems[0][1])
    return f"{', '.join(done)}: import, API and an offline start OK"


def _tracker_problem(ctx: Context, cfg: TrainConfig, name: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) of one tracker, or None when it imports, matches and starts offline."""
    from dflash_trainer.service import trackers

    try:
        __import__("wandb" if name == "wandb" else "torch.utils.tensorboard")
    except ImportError as e:
        return (
            f"tracker {name} does not import: {e}",
            "reinstall the trainer lock (L3), or remove it from [trackers]",
        )
    api = trackers.check_api(trackers.WANDB_NEEDS if name == "wandb" else trackers.TENSORBOARD_NEEDS)
    if api:
        return f"tracker {name} API mismatch: {api[0]}", "pin the tracker version the trainer lock names (L3)"
    with tempfile.TemporaryDirectory(prefix=f"preflight-{name}-") as scratch:
        try:
            trackers.try_offline(cfg, name, Path(scratch))
        except trackers.TrackerError as e:
            return (
                f"tracker {name}: {e}",
                f"make that directory creatable, or change it in {ctx.config_path} [trackers]",
            )
        except Exception as e:
            return (
                f"tracker {name} did not start offline: {type(e).__name__}: {e}",
                f"fix [trackers] in {ctx.config_path}",
            )
    return None


def check_caches(ctx: Context) -> str:
    """The compile caches this start reads (the unit's CacheDirectory=, service.compile_caches): a warm start
    compiles little, a cold one compiles every kernel in its first step. Said before the probes add to them.
    """
    from dflash_trainer.service import compile_caches

    cfg = ctx.need_cfg()
    compiles = ctx.facts.get("device") == "cuda" or cfg.train.compile
    found = compile_caches.directories()
    if not found:
        unset = " and ".join(compile_caches.CACHE_VARIABLES.values())
        if not compiles:
            raise Skipped(f"{unset} unset; nothing is compiled on CPU without train.compile")
        raise Warned(
            f"{unset} unset: this start compiles every kernel into a temporary cache (a minute or more on a "
            "GPU), and so does the next",
            "start it through dflash-train.service or dflash-smoke: their environment points both at the "
            "unit's CacheDirectory=",
        )
    files = compile_caches.file_counts()
    held = ", ".join(f"{name} {found[name]} ({files[name]} files)" for name in sorted(found))
    verdicts = probe_cache.cache_path()
    held += f"; probe verdicts {verdicts} ({'kept' if verdicts.exists() else 'none kept'})"
    if all(files.values()):
        state = "warm"
    elif any(files.values()):
        state = "partly warm"
    else:
        state = "empty: this start compiles every kernel (a minute or more on a GPU)"
    if not compiles:
        raise Skipped(f"{held}; nothing is compiled on CPU without train.compile")
    return f"{state}: {held}"


def _mask_token_check(ctx: Context) -> str:
    from dflash_trainer.service.mask_token import preflight_check

    return preflight_check(ctx)


# Cheapest first: files and figures (milliseconds), then what imports torch and asks the GPUs (seconds),
# then the GPU probes (up to a minute and a half cold), which run only when everything before them passed.
CHECKS: list[tuple[str, Callable[[Context], str]]] = [
    ("config", check_config),
    ("model", check_model),
    ("mask", _mask_token_check),
    ("shards", check_shards),
    ("checkpoint-dir", check_checkpoint_dir),
    ("disk", check_disk),
    ("shm", check_shm),
    ("compiler", check_compiler),
    ("devices", check_devices),
    ("host-memory", check_host_memory),
    ("memlock", check_memlock),
    ("caches", check_caches),
    ("fla", check_fla),
    ("triton", check_triton),
    ("trackers", check_trackers),
]
PROBES = frozenset({"triton"})


def run_checks(
    config_path: Path,
    *,
    nproc: int | None = None,
    full: bool = False,
    nnodes: int = 1,
    defer_probes: bool = False,
) -> list[Check]:
    ctx = Context(Path(config_path), nproc, full=full, nnodes=nnodes, defer_probes=defer_probes)
    results: list[Check] = []
    for name, fn in CHECKS:
        failed = [c.name for c in results if not c.ok]
        if name in PROBES and failed:  # the failure is reported now, not after the probes
            results.append(Check(name, True, f"not run: {', '.join(failed)} failed first", skipped=True))
            continue
        start = time.perf_counter()
        try:
            check = Check(name, True, fn(ctx))
        except Failed as e:
            check = Check(name, False, e.detail, e.fix)
        except Skipped as e:
            check = Check(name, True, str(e), skipped=True)
        except Warned as e:
            check = Check(name, True, e.detail, e.fix, warned=True)
        except Exception as e:
            check = Check(name, False, f"{type(e).__name__}: {e}", "report this preflight crash")
        check.seconds = time.perf_counter() - start
        results.append(check)
    return results


def format_line(c: Check) -> str:
    if not c.ok:
        return f"FAIL {c.name}: {c.detail} -- fix: {c.fix}"
    if c.warned:
        return f"warn {c.name}: {c.detail} -- fix: {c.fix}"
    return f"{'skip' if c.skipped else 'ok  '} {c.name}: {c.detail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-train preflight", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument(
        "--nproc",
        type=int,
        default=int(os.environ["DFLASH_NPROC"]) if os.environ.get("DFLASH_NPROC") else None,
        help="ranks the launch will start (default $DFLASH_NPROC, else [topology]'s targets + drafters)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=int(os.environ.get("DFLASH_NNODES") or 1),
        help="nodes of the job, each starting --nproc ranks (default $DFLASH_NNODES, else 1)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="hash the model and the shards (sha256) against their manifests, not only compare sizes",
    )
    parser.add_argument(
        "--defer-probes",
        action="store_true",
        help="the unit's: leave a GPU probe without a kept verdict to the ranks, which run it beside their "
        "start and stop before their first kernel launch if it fails (service/probes_beside.py)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    checks = run_checks(
        args.config, nproc=args.nproc, full=args.full, nnodes=args.nnodes, defer_probes=args.defer_probes
    )
    elapsed = time.perf_counter() - start
    ok = all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "seconds": round(elapsed, 3), "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            print(format_line(c), file=sys.stdout if c.ok else sys.stderr, flush=True)
        failed = [c.name for c in checks if not c.ok]
        warned = [c.name for c in checks if c.warned]
        verdict = "passed" if ok else "FAILED (" + ", ".join(failed) + ")"
        if warned:
            verdict += f" with warnings ({', '.join(warned)})"
        summary = f"preflight {verdict} in {elapsed:.1f} s"
        print(summary, file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1
