"""Several hosts, one job: torch.distributed elastic's agent and c10d rendezvous under the unit's launcher.

`dflash-train launch --nnodes K --rdzv-endpoint HOST:PORT --rdzv-id ID --nproc-per-node N -- serve CONFIG` on
every node (one `dflash-train.service` per CT). The field's engine does the multi-node part: the c10d
rendezvous (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py) forms the job and numbers the nodes
(group ranks, in the sorted order of the nodes' addresses), and `LocalElasticAgent`
(torch/distributed/elastic/agent/server/local_elastic_agent.py) starts this node's ranks with torchrun's
environment (RANK = group rank * N + local rank, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT of the
store the group-rank-0 agent hosts), monitors them and waits for the other nodes at the exit barrier.

What this thin supervisor adds, for the unit's contracts (as service/supervisor.py does on one host):
- the agent runs in a thread, so torch's signal handlers are not installed (PContext.start installs them on
  the main thread only) and SIGTERM is ours: forwarded to this node's ranks, which agree on a stop step with
  every other node through the job's store, the drafter leader saves, every rank exits 0, every agent passes
  the exit barrier and every launcher exits 0. torchrun as the main process would exit 1 after a SIGTERM
  (SignalException) and SIGKILL ranks still saving after --shutdown-timeout;
- a failure stop SIGKILLs this node's ranks at once (`_Agent._shutdown`): they would hang in their next
  collective, and a save now would mix steps;
- `NodeWatch`: every launcher beats a counter in the job's store; a node silent for `node_dead_after_s` (its
  unit killed, its host crashed) or gone with the store it hosted is named in the log, this node's ranks are
  killed and the launcher exits 1 (Restart=on-failure starts it again; the job resumes when the nodes meet
  again in the rendezvous);
- a node whose host shuts down or reboots (systemd stopping, so the unit's SIGTERM is the host's, not an
  operator's `systemctl stop`) says so in the store: the job stops gracefully with one checkpoint as for any
  stop, that node's unit ends as success, and every other node's launcher exits EXIT_NODE_LEFT naming it, so
  that systemd restarts those units and they wait in the rendezvous until the node is back;
- ranks get DFLASH_LAUNCHER_PID and set PR_SET_PDEATHSIG themselves (service/process.py): the agent's Popen
  has no hook for it, and no rank may outlive a launcher killed by the watchdog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger("dflash_trainer.launch")

EXIT_PEER = 3  # distributed/failure.py: a rank that stopped because a peer failed or vanished
EXIT_NODE_LEFT = 75  # EX_TEMPFAIL: the job stopped cleanly because a node's host went down; restart and wait


@dataclass(frozen=True)
class JobOptions:
    nnodes: int
    nproc_per_node: int
    endpoint: str  # HOST:PORT of the c10d rendezvous (the first node of the job hosts it)
    run_id: str = "dflash"
    local_addr: str | None = None  # this node's address on the job's network (default: its FQDN)
    node_dead_after_s: float = 5.0  # a node silent this long is lost
    node_heartbeat_s: float = 1.0
    join_timeout_s: float = 900.0  # how long the rendezvous waits for every node
    monitor_interval_s: float = 0.5
    exit_barrier_s: float = 120.0  # a node that finished waits this long for the others


def describe_exit(code: int) -> str:
    """A rank's exit status in words (the launchers' error lines)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-code).name
            hint = " (the kernel's or systemd's OOM killer, or kill -9)" if -code == signal.SIGKILL else ""
            return f"killed by {name}{hint}"
    if code == EXIT_PEER:
        return "stopped because a peer failed or vanished (exit 3)"
    return f"exited with status {code}"


def node_name(group_rank: int, host: str, first_rank: int, nproc: int) -> str:
    ranks = f"rank {first_rank}" if nproc == 1 else f"ranks {first_rank}-{first_rank + nproc - 1}"
    return f"node {group_rank} ({host}, {ranks})"


class NodeWatch:
    """The launchers' heartbeats in the job's store (counters: no common clock needed).

    `lost` becomes a sentence naming the node once a peer node stops beating for `dead_after` seconds of this
    node's clock, never beats at all within that time, reports that its ranks failed, or the store (hosted by
    node 0's agent) goes away.
    """

    def __init__(
        self,
        addr: str,
        port: int,
        prefix: str,
        node: int,
        nodes: int,
        name: str,
        *,
        interval: float,
        dead_after: float,
    ) -> None:
        from torch import distributed as dist

        self.node, self.nodes, self.interval, self.dead_after = node, nodes, interval, dead_after
        self.addr = f"{addr}:{port}"
        timeout = timedelta(seconds=max(2.0, dead_after))
        self.store = dist.PrefixStore(prefix, dist.TCPStore(addr, port, is_master=False, timeout=timeout))
        self.store.set(f"name/{node}", name)
        self.names: dict[int, str] = {node: name}
        self.lost: str | None = None
        self.left: str | None = None  # a peer that announced its host's shutdown (announce_leaving)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def _name(self, g: int) -> str:
        if g not in self.names:
            with contextlib.suppress(Exception):
                if self.store.check([f"name/{g}"]):
                    self.names[g] = self.store.get(f"name/{g}").decode()
        return self.names.get(g, f"node {g}")

    def _run(self) -> None:
        peers = [g for g in range(self.nodes) if g != self.node]
        start = time.monotonic()
        seen: dict[int, tuple[int, float]] = {g: (0, start) for g in peers}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb/{self.node}", 1)
                now = time.monotonic()
                for g in peers:
                    self._name(g)
                    self._check_left(g)
                    if self.store.add(f"done/{g}", 0):
                        continue  # its ranks finished cleanly; it may leave before us
                    if self.store.check([f"failed/{g}"]):
                        cause = self.store.get(f"failed/{g}").decode()
                        self.lost = f"{self._name(g)} failed: {cause}"
                        return
                    beats = self.store.add(f"hb/{g}", 0)
                    if beats != seen[g][0]:
                        seen[g] = (beats, now)
                    elif now - seen[g][1] > self.dead_after:
                        never = " (never joined the heartbeat)" if beats == 0 else ""
                        self.lost = (
                            f"{self._name(g)} lost: no heartbeat for {now - seen[g][1]:.0f} s{never} "
                            "(its unit killed, its host rebooted or its network gone)"
                        )
                        return
            except Exception as e:
                if self._stop.is_set():
                    return
                self.lost = (
                    f"{self._name(0)} lost: the job's store at {self.addr}, hosted by node 0's launcher, "
                    f"is gone ({type(e).__name__})"
                )
                return

    def _check_left(self, g: int) -> None:
        if self.left is None and self.store.check([f"leaving/{g}"]):
            self.left = f"{self._name(g)} left: {self.store.get(f'leaving/{g}').decode()}"

    def refresh_left(self) -> str | None:
        """`left`, read from the store now (the job may have drained between two beats)."""
        for g in range(self.nodes):
            if g != self.node:
                with contextlib.suppress(Exception):
                    self._check_left(g)
        return self.left

    def announce_leaving(self, reason: str) -> None:
        """This node goes away on purpose (its host shuts down): the other nodes restart and wait for it."""
        with contextlib.suppress(Exception):
            self.store.set(f"leaving/{self.node}", reason)

    def report_failure(self, cause: str) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"failed/{self.node}", cause)

    def finish(self) -> None:
        """This node's ranks are done (all exited 0): stop beating without being taken for lost."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.add(f"done/{self.node}", 1)

    def stop(self) -> None:
        self._stop.set()


def host_shutting_down() -> bool:
    """Whether this machine's (or CT's) systemd is shutting down or rebooting: `systemctl is-system-running`
    prints "stopping" then (systemctl(1)); anything else, or no systemd, is an ordinary stop."""
    try:
        out = subprocess.run(
            ["systemctl", "is-system-running"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.stdout.strip() == "stopping"


def _agent_class() -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class _Agent(LocalElasticAgent):
        """torch's agent; any stop it makes itself (a failed rank, an error) is SIGKILL at once: a graceful
        stop is the supervisor's SIGTERM, which the ranks answer by exiting 0 on their own."""

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            super()._shutdown(signal.SIGKILL, timeout)

    return _Agent


def _pids(agent: Any) -> dict[int, int]:
    ctx = getattr(agent, "_pcontext", None)
    if ctx is None:
        return {}
    with contextlib.suppress(Exception):
        return dict(ctx.pids())
    return {}


def run_job(opts: JobOptions, command: list[str], launched: float) -> int:
    """This node's part of the job; 0 when every rank of this node exited 0, else 1."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    host = socket.gethostname()
    os.environ.update(
        {
            "DFLASH_NPROC": str(opts.nproc_per_node),
            "DFLASH_LAUNCH_T0": str(launched),
            "DFLASH_LAUNCHER_PID": str(os.getpid()),
        }
    )
    params = RendezvousParameters(
        backend="c10d",
        endpoint=opts.endpoint,
        run_id=opts.run_id,
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        local_addr=opts.local_addr,
        join_timeout=opts.join_timeout_s,
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    spec = WorkerSpec(
        role="dflash",
        local_world_size=opts.nproc_per_node,
        entrypoint=sys.executable,
        args=("-m", "dflash_trainer.service", *command),
        rdzv_handler=handler,
        max_restarts=0,  # restarts belong to systemd, which resumes from the newest checkpoint
        monitor_interval=opts.monitor_interval_s,
        local_addr=opts.local_addr,
    )
    agent = _agent_class()(
        spec=spec,
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),  # ranks write to the unit's journal directly
        start_method="spawn",
        exit_barrier_timeout=opts.exit_barrier_s,
    )
    box: dict[str, Any] = {}

    def run_agent() -> None:
        try:
            box["result"] = agent.run()
        except BaseException as e:  # the rendezvous failed, the store vanished
            box["error"] = e
        finally:
            with contextlib.suppress(Exception):
                handler.shutdown()  # closes this rendezvous round, as launch_agent does

    stopping = threading.Event()
    leaving: list[str] = []  # set by the signal handler, told to the other nodes by the main loop

    def forward(signum: int, _frame: object) -> None:
        pids = _pids(agent)
        if not pids:  # still forming the job: nothing trained, nothing to save
            log.info("%s before this node's ranks started: exiting", signal.Signals(signum).name)
            os._exit(0)
        if not stopping.is_set():
            log.info("%s: asking %d rank(s) to save and exit", signal.Signals(signum).name, len(pids))
            if signum == signal.SIGTERM and host_shutting_down():
                leaving.append(f"its host {host} is shutting down or rebooting")
        stopping.set()
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log.info(
        "joining job %s at %s: %d node(s) of %d rank(s)",
        opts.run_id,
        opts.endpoint,
        opts.nnodes,
        opts.nproc_per_node,
    )
    # Expected here, and wrong for us: the supervisor's main thread handles the signals (see the docstring).
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda r: "Failed to register signal handlers" not in r.getMessage()
    )
    thread = threading.Thread(target=run_agent, name="elastic-agent", daemon=True)
    thread.start()

    watch: NodeWatch | None = None
    me = "this node"
    while thread.is_alive():
        thread.join(0.2)
        group = agent._worker_group
        if watch is None and group.state == WorkerState.HEALTHY and _pids(agent):
            g, nodes = group.group_rank, group.group_world_size
            os.environ["GROUP_RANK"], os.environ["GROUP_WORLD_SIZE"] = str(g), str(nodes)
            me = node_name(g, host, g * opts.nproc_per_node, opts.nproc_per_node)
            pids = " ".join(f"{g * opts.nproc_per_node + r}=pid {p}" for r, p in sorted(_pids(agent).items()))
            store = f"{group.master_addr}:{group.master_port}"
            log.info("%s of %d: started %s (the job's store: %s)", me, nodes, pids, store)
            try:
                watch = NodeWatch(
                    group.master_addr,
                    group.master_port,
                    f"dflash-nodes/{opts.run_id}/",
                    g,
                    nodes,
                    me,
                    interval=opts.node_heartbeat_s,
                    dead_after=opts.node_dead_after_s,
                ).start()
            except Exception as e:
                log.error("%s: cannot reach the job's store to watch the other nodes: %s", me, e)
                _kill(agent)
                thread.join(30)
                return 1
        if watch is not None and leaving:
            log.info("%s: telling the other nodes that %s", me, leaving[0])
            watch.announce_leaving(leaving.pop())
        if watch is not None and watch.lost and not _finished(agent):
            log.error("%s; stopping this node's ranks", watch.lost)
            _kill(agent)
            thread.join(30)
            return 1

    result = box.get("result")
    if result is not None and not result.is_failed():
        if watch is not None:
            watch.finish()
        how = "stopped" if stopping.is_set() else "finished"
        log.info("%s: all %d rank(s) %s cleanly", me, opts.nproc_per_node, how)
        if watch is not None and not stopping.is_set() and watch.refresh_left():
            log.error(
                "%s; the job stopped with its checkpoint: exiting %d so that systemd starts this unit again, "
                "to wait in the rendezvous until that node is back",
                watch.left,
                EXIT_NODE_LEFT,
            )
            return EXIT_NODE_LEFT
        return 0
    if result is None:
        error = box.get("error")
        causes, ours = f"the elastic agent failed: {type(error).__name__}: {error}", False
    else:
        failures = sorted(result.failures.items())
        causes = "; ".join(f"rank {r} {describe_exit(f.exitcode)}" for r, f in failures)
        ours = not all(f.exitcode == EXIT_PEER for _, f in failures)
    if watch is not None:
        if ours:
            watch.report_failure(causes)
        else:  # stopped because of a peer, or the store went away: give the watch its time to name the node
            deadline = time.monotonic() + opts.node_dead_after_s + 2 * opts.node_heartbeat_s
            while watch.lost is None and time.monotonic() < deadline:
                time.sleep(0.1)
        if watch.lost:
            log.error("%s", watch.lost)
        watch.stop()
    log.error("%s: %s; this node's ranks are stopped", me, causes)
    return 1


def _finished(agent: Any) -> bool:
    from torch.distributed.elastic.agent.server.api import WorkerState

    return agent._worker_group.state == WorkerState.SUCCEEDED


def _kill(agent: Any) -> None:
    for pid in _pids(agent).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
