"""`python -m dflash_trainer.service.rehearse`: `make smoke-train`'s sequence on a machine without systemd.

A GPU machine rehearses a real run in one command (scripts/gpu_rehearsal.sh wraps it): a random target of
a published shape staged in /dev/shm with its manifest, random-token shards, then the entry points the unit
runs, in its order: `preflight`, `launch -- serve` with --pause-at (phase 1: READY, steps, a periodic
checkpoint, the pause of service/pause.py, SIGTERM there: a checkpoint and exit 0), `launch -- serve` again
(phase 2: resumes at that step, runs to the end), `export` and `export --check`, then `smoke report` (the
smoke summary, PASS or FAIL).
This process plays systemd's part: it owns the $NOTIFY_SOCKET the ranks send READY/STATUS/WATCHDOG to, sends
SIGTERM to the launcher as `systemctl stop` would, and times every phase. Figures go to OUT/rehearsal.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trainer import stack_sampler
from dflash_trainer.service.pause import PAUSED

REPO_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "reference.toml"
CLI = [sys.executable, "-m", "dflash_trainer.service"]
# The preflight of a trainer source tree (--unit-start-before): whether its unit deferred the GPU probes.
PREFLIGHT_SOURCE = Path("dflash_trainer") / "service" / "preflight.py"
MAIN_CLI = [sys.executable, "-m", "dflash_trainer.cli"]


def say(text: str) -> None:
    print(f"rehearse: {text}", flush=True)


class NotifyListener:
    """The $NOTIFY_SOCKET end systemd would hold: records each message with its arrival time."""

    def __init__(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.time()
            self.messages.extend((now, f) for f in data.decode(errors="replace").splitlines())

    def first(self, prefix: str, since: float = 0.0) -> float | None:
        return next((t for t, m in list(self.messages) if t >= since and m.startswith(prefix)), None)

    def status_with(self, text: str, since: float) -> bool:
        return any(t >= since and m.startswith("STATUS=") and text in m for t, m in list(self.messages))

    def count(self, prefix: str, since: float) -> int:
        return sum(1 for t, m in list(self.messages) if t >= since and m.startswith(prefix))

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self.path.unlink(missing_ok=True)


def meminfo() -> dict[str, float]:
    """/proc/meminfo's MemTotal, MemAvailable and Shmem (tmpfs: the staged target), in GiB."""
    found: dict[str, float] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "Shmem"):
            found[key] = int(rest.split()[0]) / (1 << 20)
    return found


class HostMemory:
    """Samples host memory twice a second: the lowest MemAvailable of a phase shows how close the ranks came
    to the OOM killer in host RAM, where a rank dies without a word (docs/gpu-rehearsal.md "Runs": the
    /dev/shm target, the pinned snapshot and the EMA share it)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append((time.time(), meminfo()))

    def lowest(self, since: float) -> dict[str, float] | None:
        window = [m for t, m in self.samples if t >= since and "MemAvailable" in m]
        return min(window, key=lambda m: m["MemAvailable"]) if window else None

    def close(self) -> None:
        self._stop.set()


@dataclass
class Phase:
    name: str
    exit_code: int | None = None
    launched_at: float = 0.0
    ready_s: float | None = None  # launch -> READY=1
    first_step_s: float | None = None  # launch -> the first finished step (the rank's summary)
    paused_s: float | None = None  # launch -> the pause's STATUS (--pause-at; after that step finished)
    term_to_exit_s: float | None = None  # SIGTERM -> the launcher's exit (phase 1: includes the final save)
    watchdog_pings: int = 0
    wall_s: float = 0.0
    checkpoint_stalls_s: list[float] = field(default_factory=list)
    host_memory_low_gib: dict[str, float] | None = None  # /proc/meminfo when MemAvailable was lowest
    start_breakdown: list[str] = field(default_factory=list)  # each speaking rank's "start: ..." line
    summaries: list[dict] = field(default_factory=list)


def _pump(proc: subprocess.Popen, log_path: Path, echo: re.Pattern) -> threading.Thread:
    """Copies the launcher's output to a file, echoing the lines an operator reads in the journal."""

    def run() -> None:
        with log_path.open("a") as log:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()  # the fault scenario reads the log while the job runs
                if echo.search(line):
                    print(line, end="", flush=True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


ECHO = re.compile(
    r"ready|start: |resumed|saved|checkpoint|step \d+ |error|critical|warning|traceback|stopp|finished", re.I
)
START = re.compile(r"(?<![a-z])start: (.*)")  # not "restart: "
STALL = re.compile(r"stall(?:ed)?[^0-9]{0,20}([0-9.]+) ?s")


def profiled_env(env: dict[str, str], name: str) -> dict[str, str]:
    """`env` with phase `name`'s profiles (its preflight's probes, its ranks) in a directory of its own."""
    if not env.get(stack_sampler.ENV):
        return env
    return env | {stack_sampler.ENV: str(Path(env[stack_sampler.ENV]) / name)}


def run_phase(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    out: Path,
    notify: NotifyListener,
    *,
    pause_at: int | None,
    timeout: float,
    memory: HostMemory | None = None,
    stop: signal.Signals = signal.SIGTERM,
) -> Phase:
    phase = Phase(name)
    log_path = out / f"{name}.log"
    env = profiled_env(env, name)
    phase.launched_at = start = time.time()
    say(f"{name}: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pump = _pump(proc, log_path, ECHO)
    deadline = start + timeout
    if pause_at is not None:
        while proc.poll() is None and not notify.status_with(PAUSED, start) and time.time() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            term = time.time()
            paused = term < deadline
            if paused:
                phase.paused_s = term - start
            sent = stop if paused else signal.SIGTERM
            say(f"{name}: {f'paused at step {pause_at}' if paused else 'TIMEOUT'}; {sent.name}")
            proc.send_signal(sent)
            try:
                proc.wait(timeout=max(60.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
            phase.term_to_exit_s = time.time() - term
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        say(f"{name}: TIMEOUT after {timeout:.0f} s; SIGTERM, then SIGKILL")
        proc.send_signal(signal.SIGTERM)
        _wait_or_kill(proc, 120)
    pump.join(timeout=5)
    phase.exit_code = proc.returncode
    phase.wall_s = time.time() - start
    ready = notify.first("READY=1", start)
    phase.ready_s = None if ready is None else ready - start
    phase.watchdog_pings = notify.count("WATCHDOG=1", start)
    text = log_path.read_text()
    phase.checkpoint_stalls_s = [float(m.group(1)) for m in STALL.finditer(text)]
    phase.start_breakdown = [m.group(1) for m in START.finditer(text)]
    if memory is not None and (low := memory.lowest(start)):
        phase.host_memory_low_gib = {k: round(v, 1) for k, v in low.items()}
    for path in sorted((out / name).glob("summary-rank*.json")):
        summary = json.loads(path.read_text())
        phase.summaries.append(summary)
        if summary.get("first_step_at") and phase.first_step_s is None:
            phase.first_step_s = summary["first_step_at"] - start
    say(
        f"{name}: exit {phase.exit_code} after {phase.wall_s:.1f} s; READY after {phase.ready_s} s; "
        f"first step after {phase.first_step_s} s; paused after {phase.paused_s} s; "
        f"{phase.watchdog_pings} watchdog pings; "
        f"host memory at its lowest (GiB): {phase.host_memory_low_gib}"
    )
    return phase


STARTED = re.compile(r"started \d+ rank\(s\): (.*)")
SAVED = re.compile(r"checkpoint (step-\d+): stall")


def _newest_checkpoint_step(config: Path) -> int | None:
    from dflash_trainer.checkpoint import latest_checkpoint, step_of_name
    from dflash_trainer.config import load_config

    latest = latest_checkpoint(load_config(config, check_paths=False).train.checkpoint_dir)
    return step_of_name(latest.name) if latest else None


def run_fault(config: Path, out: Path, env: dict[str, str], notify: NotifyListener, *, world: int, rank: int,
              steps: int, timeout: float) -> dict:  # fmt: skip
    """One rank killed mid-run (SIGKILL, as the OOM killer does): the launcher must end the job within seconds
    naming that rank, and a restart must resume at the newest checkpoint. Its own short run under OUT/."""
    from dflash_trainer.checkpoint import step_of_name

    fault = {"rank": rank}
    launch = [*CLI, "launch", "--nproc-per-node", str(world), "--", "serve", str(config)]
    log_path = out / "fault-run1.log"
    start = time.time()
    proc = subprocess.Popen([*launch, "--summary", str(out / "run1")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    pump = _pump(proc, log_path, ECHO)
    pids: dict[int, int] = {}
    saved = None
    while proc.poll() is None and time.time() - start < timeout:
        text = log_path.read_text() if log_path.exists() else ""
        if m := STARTED.search(text):
            pids = {int(r): int(p) for r, p in re.findall(r"(\d+)=pid (\d+)", m.group(1))}
        found = SAVED.findall(text)
        if found and pids:
            saved = found[-1]
            break
        time.sleep(0.2)
    if saved is None or rank not in pids:
        proc.kill()
        fault["error"] = f"no checkpoint or no pid of rank {rank} within {timeout:.0f} s"
        return fault
    if step_of_name(saved) >= steps:  # on a host fast for the log's polling: no step left to resume
        _wait_or_kill(proc, 120)
        fault["error"] = f"the first checkpoint seen ({saved}) was the run's last: raise --fault-steps"
        return fault
    killed = time.time()
    try:
        os.kill(pids[rank], signal.SIGKILL)
    except ProcessLookupError:
        proc.wait()
        fault["error"] = f"rank {rank} had ended before the kill (the run was too short)"
        return fault
    say(f"fault: SIGKILL to rank {rank} (pid {pids[rank]}) after {saved}")
    _wait_or_kill(proc, 120)
    pump.join(timeout=5)
    fault["job_ended_s"] = time.time() - killed
    fault["exit_code"] = proc.returncode
    text = log_path.read_text()
    fault["named"] = f"rank {rank} killed by SIGKILL" in text
    # What the restart must resume from: the newest complete checkpoint on disk now that the job has ended.
    # Not the newest the log printed: a save can land between the rank's rename and its log line.
    newest = _newest_checkpoint_step(config)
    if newest is not None and newest >= steps:  # nothing left for a restart to resume
        fault["error"] = f"the killed run had saved its last step ({newest}) already: raise --fault-steps"
        return fault
    phase = run_phase("fault-run2", [*launch, "--summary", str(out / "fault-run2")], env, out, notify,
                      pause_at=None, timeout=timeout)  # fmt: skip
    firsts = [s["first_step"] for s in phase.summaries if s.get("first_step")]
    fault.update(
        resumed_at=firsts[0] if firsts else None, checkpoint_step=newest, restart_exit=phase.exit_code
    )
    fault["ok"] = bool(
        fault["exit_code"] not in (0, None) and fault["named"] and fault["job_ended_s"] < 30
        and phase.exit_code == 0 and firsts and newest is not None and firsts[0] == newest + 1
    )  # fmt: skip
    say(f"fault: {fault}")
    return fault


_RATES = re.compile(r"one target: ([0-9.]+) tokens/s, one drafter: ([0-9.]+) tokens/s")


def pipeline_efficiency(config: Path, world: int, env: dict[str, str], summaries: list[dict]) -> dict:
    """Measured pipeline tokens/s (the drafter leader's, phase 2) over min(N*t, M*d) from `plan`'s standalone
    figures measured in the same run on this machine."""
    from dflash_trainer.config import load_config
    from dflash_trainer.distributed.topology import resolve_topology

    topology = load_config(config, check_paths=False).topology
    topo = resolve_topology(max(2, world), topology.targets, topology.drafters)
    n, m = topo.num_targets, topo.num_drafters
    proc = subprocess.run([*MAIN_CLI, "plan", str(max(2, world)), str(config)], env=env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    found = _RATES.search(proc.stdout)
    rates = [s["tokens_per_s"] for s in summaries if s.get("tokens_per_s")]
    if not found or not rates:
        return {"error": (proc.stderr or proc.stdout)[-500:] or "no rate in the summaries"}
    t, d = float(found.group(1)), float(found.group(2))
    bound = min(n * t, m * d)
    return {"pipeline_tokens_per_s": rates[0], "target_tokens_per_s": t, "drafter_tokens_per_s": d,
            "split": f"{n}:{m}", "efficiency": rates[0] / bound}  # fmt: skip


# ---- what the run trains on ----


def stage_target(path: Path, shape: str, layers: int | None) -> float:
    """Writes the random target into `path` unless a complete one (its manifest matches) is there."""
    from dflash_trainer.manifest import check_manifest

    if path.is_dir() and (path / "MANIFEST.json").is_file() and not check_manifest(path):
        say(f"target: {path} already staged (its manifest matches)")
        return 0.0
    start = time.time()
    cmd = [*MAIN_CLI, "model", "random", "--shape", shape, str(path)]
    subprocess.run(cmd + (["--layers", str(layers)] if layers else []), check=True)
    return time.time() - start


def cut_context_layers(layers: int) -> list[int]:
    """The drafter's context layers inside a target cut to its first `layers` (the reference's 1, 16, 31, 46,
    61 are not): every other layer from 1, at most five."""
    return list(range(1, layers, 2))[:5]


def config_overrides(given: Sequence[tuple[str, object]], layers: int | None) -> dict[str, object]:
    """--set's overrides, and for a target cut by --layers its context layers, unless --set names them."""
    overrides = dict(given)
    if layers:
        overrides.setdefault("drafter.target_layer_ids", cut_context_layers(layers))
    return overrides


def write_shards(path: Path, *, vocab: int, mask_id: int, seq_len: int, rows: int, shards: int) -> None:
    """Random-token rows (a quarter prompt, the rest supervised) below the mask id, with a manifest."""
    import numpy as np

    from dflash_trainer.data.synth import write_shard
    from dflash_trainer.manifest import write_manifest

    if (path / "MANIFEST.json").is_file():
        return
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    bound = mask_id if mask_id < vocab else vocab
    for i in range(shards):
        ids = rng.integers(0, bound, size=(rows, seq_len))
        mask = np.zeros((rows, seq_len), dtype=np.int8)
        mask[:, seq_len // 4 :] = 1
        write_shard(path / f"shard-{i:05d}.arrow", [(r, m) for r, m in zip(ids, mask, strict=True)])
    write_manifest(path)


def write_config(base: Path, out: Path, *, target: Path, shards: Path, world: int, overrides: dict) -> Path:
    """The reference configuration pointed at the rehearsal's target, shards and state directory, with the
    --set overrides ({"SECTION.KEY": value}) over it."""
    from dflash_trainer.config import check_tables, overlay, read_toml, to_toml

    tables = read_toml(base)
    held_out = check_tables(tables, base=base.resolve().parent).data.held_out
    # One rank: both removed ("auto"), the whole run in one process.
    targets, drafters = (None, None) if world == 1 else (world // 2, world - world // 2)
    rehearsal = {
        "model": {"target_path": str(target)},
        "data": {"shards": str(shards), "held_out": min(held_out, 8)},
        # Not the smoke run's (OUT/checkpoints): the unit's first start (--unit-start) finds none.
        "train": {"checkpoint_dir": str(out / "unit" / "checkpoints")},
        "trackers": {"tensorboard": str(out / "tensorboard")},
        "topology": {"targets": targets, "drafters": drafters},
    }
    named: dict[str, dict[str, object]] = {}
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        named.setdefault(section, {})[key] = value
    path = out / "rehearsal.toml"
    path.write_text(
        "# Written by dflash_trainer.service.rehearse.\n" + to_toml(overlay(tables, rehearsal, named))
    )
    return path


def cache_env(root: Path) -> dict[str, str]:
    """The compile caches and probe verdicts under `root`, where L3 keeps them in CT 200 (its CacheDirectory):
    a restart finds the kernels compiled and autotuned."""
    return {
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_AUTOTUNING": "1",
        "XDG_CACHE_HOME": str(root),  # preflight's probe verdicts, beside them as in the unit
    }


def run_unit_start(
    config: Path,
    out: Path,
    env: dict[str, str],
    notify: NotifyListener,
    *,
    world: int,
    timeout: float,
    name: str = "unit-start",
    defer_probes: bool = True,
) -> dict:
    """The unit's first start after `make smoke-train` on a new CT: preflight, then `launch -- serve` of the
    real configuration (no checkpoint yet) to its first step, with the caches `env` names (the smoke run's,
    or empty ones: a new CT's first start without a smoke run). Killed at the pause after step 1 (SIGKILL):
    the rest is phase 1's again, and its save would write a checkpoint. Its log: OUT/NAME.log."""
    start = time.time()
    deferred = ["--defer-probes"] if defer_probes else []  # as the unit runs it
    pre = subprocess.run(
        [*CLI, "preflight", *deferred, "--nproc", str(world), str(config)],
        env=profiled_env(env, name), check=False, capture_output=True, text=True,
    )  # fmt: skip
    figures: dict = {"preflight_s": round(time.time() - start, 2), "preflight_exit": pre.returncode}
    print(pre.stdout + pre.stderr, end="", flush=True)
    if pre.returncode != 0:
        return figures | {"ok": False}
    cmd = [*CLI, "launch", "--nproc-per-node", str(world), "--", "serve", str(config), "--pause-at", "1"]
    phase = run_phase(name, cmd, env, out, notify, pause_at=1, timeout=timeout, stop=signal.SIGKILL)
    text = (out / f"{name}.log").read_text()
    first_step_s = phase.paused_s  # killed at the pause after step 1: no summary, the pause tells
    figures |= {
        "ready_s": phase.ready_s,
        "first_step_s": first_step_s,
        "to_first_step_s": None if first_step_s is None else round(figures["preflight_s"] + first_step_s, 2),
        "caches_line": next((line for line in text.splitlines() if "compile caches after" in line), None),
        "caches_preflight": next((line for line in pre.stdout.splitlines() if " caches: " in line), None),
        # The probes preflight deferred: how long the rank waited for them, and their verdict.
        "probes_beside": [
            line for line in text.splitlines() if "gpu probes beside the start" in line.lower()
        ],
        # What the rank did meanwhile: its drafter's step compiled ahead.
        "meanwhile": [line for line in text.splitlines() if "compiled ahead in" in line],
        "ok": first_step_s is not None,
    }
    return figures


def run_unit_starts(
    args: argparse.Namespace,
    config: Path,
    out: Path,
    env: dict[str, str],
    notify: NotifyListener,
    world: int,
    figures: dict,
) -> bool:
    """The unit starts of --unit-start, into `figures` by name: with --unit-start-only first one on the
    empty caches (a new CT's first start, no smoke run before it), whose caches the others then find; with
    --unit-start-before SRC the start with the trainer at SRC; then this trainer's. True if each reached its
    first step."""
    starts = [("unit-start-first", None)] if args.unit_start_only else []
    if args.unit_start_before:
        starts.append(("unit-start-before", args.unit_start_before))
    ok = True
    for name, source in [*starts, ("unit-start", None)]:
        run_env = env | (cache_env(out / f"cache-{name}") if args.unit_start_cold else {})
        if source is not None:  # its trainer ahead of this one on the path
            run_env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), env.get("PYTHONPATH", "")])
        key = name.replace("-", "_")
        # As the unit of each trainer's time ran preflight: a trainer before --defer-probes probed in it.
        defer = source is None or "--defer-probes" in (source / PREFLIGHT_SOURCE).read_text()
        figures[key] = run_unit_start(
            config,
            out,
            run_env,
            notify,
            world=world,
            timeout=args.phase_timeout,
            name=name,
            defer_probes=defer,
        )
        say(f"{name}: {figures[key]}")
        ok = ok and figures[key]["ok"]
    return ok


def _parse_override(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if "." not in key or not value:
        raise argparse.ArgumentTypeError(f"--set {text!r}: use SECTION.KEY=VALUE (a TOML value)")
    return key, tomllib.loads(f"v = {value}")["v"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_trainer.service.rehearse", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="state: config, checkpoints, logs, figures")
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument(
        "--layers", type=int, help="target layers to keep (default: all); the drafter's context layers follow"
    )
    parser.add_argument("--target-dir", type=Path, default=Path("/dev/shm/dflash/model"))
    parser.add_argument("--shards-dir", type=Path, default=None, help="default: OUT/shards")
    parser.add_argument("--config", type=Path, default=REPO_CONFIG, help="the configuration to rehearse")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stop-at", type=int, default=50)
    parser.add_argument(
        "--keep-last", type=int, default=1, help="checkpoints kept (each ~27 GB at the reference)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        type=_parse_override,
        action="append",
        default=[],
        help="SECTION.KEY=VALUE over the configuration (repeatable)",
    )
    parser.add_argument("--phase-timeout", type=float, default=900)
    parser.add_argument(
        "--unit-start",
        action="store_true",
        help="afterwards: the unit's first start after the smoke run (real configuration) to its first step",
    )
    parser.add_argument(
        "--unit-start-cold",
        action="store_true",
        help="the unit start on empty compile caches (a new CT's first start without a smoke run)",
    )
    parser.add_argument(
        "--unit-start-only",
        action="store_true",
        help="no smoke run: the unit start on empty caches, then --unit-start-before's and this one's",
    )
    parser.add_argument(
        "--unit-start-before",
        type=Path,
        help="first the unit start with the trainer's source at this directory (side by side: before)",
    )
    parser.add_argument("--fault-rank", type=int, help="afterwards: SIGKILL this rank mid-run, then restart")
    parser.add_argument("--fault-steps", type=int, default=30, help="steps of the fault scenario's own run")
    parser.add_argument(
        "--efficiency",
        action="store_true",
        help="afterwards: pipeline tokens/s over `plan`'s standalone bound",
    )
    args = parser.parse_args(argv)

    import torch

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    world = args.nproc or max(1, gpus)
    figures: dict = {"gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else "cpu", "world": world}
    figures["versions"] = {m: __import__(m).__version__ for m in ("torch", "transformers", "triton")}
    t0 = time.time()

    figures["target_write_s"] = stage_target(args.target_dir, args.shape, args.layers)
    shards = (args.shards_dir or out / "shards").resolve()
    overrides = config_overrides(args.overrides, args.layers)
    # The real configuration's own keep_last would not fit a lent machine's disk (preflight's disk check).
    overrides.setdefault("train.keep_last", args.keep_last)
    config = write_config(
        args.config, out, target=args.target_dir, shards=shards, world=world, overrides=overrides
    )
    from dflash_trainer.config import load_config, read_target_info

    cfg = load_config(config, check_paths=False)
    vocab = read_target_info(cfg.model.target_path).vocab_size
    write_shards(shards, vocab=vocab, mask_id=cfg.drafter.mask_token_id, seq_len=cfg.data.seq_len, rows=64,
                 shards=4)  # fmt: skip
    if not args.unit_start_only:  # the smoke run's configuration; --unit-start-only runs none
        subprocess.run(
            [*CLI, "smoke", "prepare", str(config), "--out", str(out), "--steps", str(args.steps),
             "--stop-at", str(args.stop_at), "--keep-last", str(args.keep_last)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    smoke_toml = out / "smoke.toml"

    env = (
        os.environ
        | {
            "PYTHONUNBUFFERED": "1",
            "DFLASH_NPROC": str(world),
            "NOTIFY_SOCKET": str(out / "notify.sock"),
            "WATCHDOG_USEC": str(300 * 10**6),
        }
        | cache_env(out / "cache")
    )
    notify = NotifyListener(out / "notify.sock")
    if args.unit_start_only:  # a new CT's first start and the starts after it, nothing else
        try:
            ok = run_unit_starts(args, config, out, env, notify, world, figures)
        finally:
            notify.close()
        figures["total_s"] = time.time() - t0
        (out / "rehearsal.json").write_text(json.dumps(figures, indent=1) + "\n")
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    memory = HostMemory()
    ok = True
    try:
        start = time.time()
        pre = subprocess.run(
            [*CLI, "preflight", "--nproc", str(world), str(smoke_toml)],
            env=profiled_env(env, "phase1"),
            check=False,
        )
        figures["preflight_s"] = time.time() - start
        if pre.returncode != 0:
            say("preflight FAILED (the lines above name each fix)")
            print("FAIL")
            return 1
        launch = [*CLI, "launch", "--nproc-per-node", str(world), "--", "serve", str(smoke_toml)]
        p1 = run_phase("phase1", [*launch, "--pause-at", str(args.stop_at), "--summary", str(out / "phase1")],
                       env, out, notify, pause_at=args.stop_at, timeout=args.phase_timeout,
                       memory=memory)  # fmt: skip
        p2 = run_phase("phase2", [*launch, "--summary", str(out / "phase2")], env, out, notify,
                       pause_at=None, timeout=args.phase_timeout, memory=memory)  # fmt: skip
        figures["phases"] = [asdict(p1), asdict(p2)]
        ok = p1.exit_code == 0 and p2.exit_code == 0 and p1.ready_s is not None and p2.ready_s is not None
        start = time.time()
        export = subprocess.run(
            [*MAIN_CLI, "export", str(out / "checkpoints"), str(out / "export")], check=False
        )
        figures["export_s"] = time.time() - start
        check = subprocess.run(
            [*MAIN_CLI, "export", "--check", str(out / "export"), "--against", str(out / "checkpoints")],
            check=False,
        )
        ok = ok and export.returncode == 0 and check.returncode == 0
        report = subprocess.run(
            [*CLI, "smoke", "report", str(out), "--steps", str(args.steps), "--stop-at", str(args.stop_at),
             "--t0", str(t0)], check=False, env=os.environ | {"DFLASH_SMOKE_KEEP": "1"},  # OUT keeps figures
        )  # fmt: skip
        if args.unit_start:
            # Its report read them: room on a lent machine's disk for the checkpoints preflight counts.
            shutil.rmtree(out / "checkpoints")
            ok = run_unit_starts(args, config, out, env, notify, world, figures) and ok
        if args.efficiency:
            figures["efficiency"] = pipeline_efficiency(smoke_toml, world, env, p2.summaries)
            say(f"efficiency: {figures['efficiency']}")
        if args.fault_rank is not None:
            fault_dir = out / "fault"
            subprocess.run(
                [*CLI, "smoke", "prepare", str(config), "--out", str(fault_dir), "--steps",
                 str(args.fault_steps), "--stop-at", "10", "--keep-last", "1"],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            figures["fault"] = run_fault(fault_dir / "smoke.toml", fault_dir, env, notify, world=world,
                                         rank=args.fault_rank, steps=args.fault_steps,
                                         timeout=args.phase_timeout)  # fmt: skip
            if "error" in figures["fault"]:  # a scenario that could not run says why, not only in the JSON
                say(f"fault: {figures['fault']['error']}")
            ok = ok and bool(figures["fault"].get("ok"))
    finally:
        notify.close()
        memory.close()
    figures["total_s"] = time.time() - t0
    (out / "rehearsal.json").write_text(json.dumps(figures, indent=1) + "\n")
    for p in (p1, p2):
        ready, first = (None if v is None else round(v, 1) for v in (p.ready_s, p.first_step_s))
        say(
            f"{p.name}: READY {ready} s, first step {first} s after launch; "
            f"checkpoint stalls {p.checkpoint_stalls_s} s"
            + (f"; SIGTERM to exit {p.term_to_exit_s:.1f} s" if p.term_to_exit_s is not None else "")
        )
    say(
        f"export {figures['export_s']:.1f} s; total {figures['total_s']:.0f} s; figures: {out}/rehearsal.json"
    )
    passed = ok and report.returncode == 0
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
