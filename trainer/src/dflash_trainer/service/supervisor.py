"""`dflash-train launch --nproc-per-node N -- serve CONFIG`: the unit's main process, watching the ranks.

Why not torchrun as the main process: after SIGTERM its agent raises SignalException and exits 1 even when
every rank saved and exited 0 (the unit would end `failed` on every `systemctl stop`), and it SIGKILLs
ranks still saving after its shutdown timeout. This launcher gives each rank torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, so `init_process_group("env://")` works
unchanged) and:
- forwards SIGTERM/SIGINT to every rank and waits for them without a timeout of its own (TimeoutStopSec is the
  limit); exits 0 when every rank exited 0;
- when a rank dies (exception, OOM kill, kill -9) logs its rank and cause, SIGKILLs the others (they would
  hang in their next collective, and a save now would mix steps across ranks) and exits 1, so
  Restart=on-failure restarts the job, which resumes from the newest checkpoint;
- ranks carry PR_SET_PDEATHSIG=SIGKILL: when the launcher is killed (the watchdog's signal, KillMode=mixed
  sends it to the main process alone) no rank outlives it, even a stopped one.

With --rdzv-endpoint (several nodes, `--nnodes K`) the same contracts hold over torch elastic's agent and c10d
rendezvous: distributed/elastic.py. Without it this one-host path runs, unchanged.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from dflash_trainer.distributed.elastic import EXIT_PEER, JobOptions, describe_exit, run_job
from dflash_trainer.logs import setup_logging
from dflash_trainer.service.process import die_with_parent, process_started

log = logging.getLogger("dflash_trainer.launch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-train launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=1)
    # Several nodes (distributed/elastic.py): torch elastic's agent and c10d rendezvous join the units.
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the job (each runs this launcher)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (the job's first node)")
    parser.add_argument("--rdzv-id", default="dflash", help="the job's id; the same on every node")
    parser.add_argument("--local-addr", help="this node's address on the job's network (default: FQDN)")
    parser.add_argument(
        "--node-dead-after-s", type=float, default=5.0, help="a node silent this long ends the job"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- serve CONFIG [options]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the rank command after --, e.g. -- serve /etc/dflash/train.toml")
    if args.nnodes < 1 or args.nproc_per_node < 1:
        parser.error("--nnodes and --nproc-per-node must be at least 1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        parser.error(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the job's first node)")
    setup_logging(role="launcher")
    n = args.nproc_per_node
    launched = process_started()  # the ranks' "ready" line counts from here
    if args.rdzv_endpoint:  # several nodes (or one node through the same rendezvous)
        job = JobOptions(
            nnodes=args.nnodes,
            nproc_per_node=n,
            endpoint=args.rdzv_endpoint,
            run_id=args.rdzv_id,
            local_addr=args.local_addr,
            node_dead_after_s=args.node_dead_after_s,
        )
        code = run_job(job, command, launched)
        # Leave past torch's daemon threads (agent, store clients): an interpreter teardown under them aborts.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    port = _free_port()
    me = os.getpid()
    procs: dict[int, subprocess.Popen] = {}
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:
            log.info("%s: asking %d rank(s) to save and exit", signal.Signals(signum).name, len(procs))
        stopping = True
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    base = {k: v for k, v in os.environ.items() if k != "RANK"}
    for r in range(n):
        env = base | {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # Every rank on this host: gloo on loopback, instead of its "Unable to resolve hostname"
            # warning in every rank's journal (a CT's hostname need not resolve) before the same fallback.
            "GLOO_SOCKET_IFNAME": base.get("GLOO_SOCKET_IFNAME", "lo"),
            "DFLASH_NPROC": str(n),
            "DFLASH_LAUNCH_T0": str(launched),
        }
        cmd = [sys.executable, "-m", "dflash_trainer.service", *command]
        procs[r] = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(me))
    log.info("started %d rank(s): %s", n, " ".join(f"{r}=pid {p.pid}" for r, p in procs.items()))

    failed: tuple[int, int] | None = None
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        bad = [(r, c) for r, c in codes.items() if c not in (None, 0)]
        if bad and failed is None:
            # A rank that stopped because a peer failed (EXIT_PEER) is the consequence; name the cause. The
            # peer it lost is normally dead already; give it a moment to be seen.
            deadline = time.monotonic() + 1.0
            while all(c == EXIT_PEER for _, c in bad) and time.monotonic() < deadline:
                time.sleep(0.05)
                bad = [(r, c) for r, p in procs.items() if (c := p.poll()) not in (None, 0)]
            failed = next(((r, c) for r, c in bad if c != EXIT_PEER), bad[0])
            log.error("rank %d %s; stopping the other ranks", failed[0], describe_exit(failed[1]))
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            for p in procs.values():
                p.wait()
            return 1
        if all(c is not None for c in codes.values()):
            break
        time.sleep(0.1)
    how = "stopped" if stopping else "finished"
    log.info("all %d rank(s) %s cleanly", n, how)
    return 0
