"""Failing loudly: any rank's death ends the job within seconds, logged as `rank R (role, device): cause`.

- A rank that raises (OOM included) logs the cause (for a CUDA OOM with the allocator's abbreviated memory
  summary), publishes it in the job's TCP store and exits non-zero; torchrun then stops the other local ranks,
  and the peers' monitors (below) stop ranks on other hosts.
- A rank that is killed (SIGKILL, the kernel's OOM killer, an Xid that takes the process) cannot say anything:
  its local torchrun agent reports the signal and stops its siblings, and every peer's monitor sees its
  heartbeat stop and exits naming it.
- A hung collective is caught by the process groups' timeout and, under systemd, by the loop's watchdog.

Fault injection for tests: DFLASH_FAULT="rank=1,step=3,kind=raise|kill|oom".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_trainer.distributed.elastic import EXIT_PEER  # a peer failed or vanished; this rank stopped

log = logging.getLogger("dflash_trainer.distributed")

EXIT_FAILED = 1  # this rank failed

FAKE_OOM = (
    "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 94.97 GiB of which "
    "1.12 GiB is free. Including non-PyTorch memory, this process has 93.84 GiB memory in use. Of the "
    "allocated memory 88.41 GiB is allocated by PyTorch, and 3.87 GiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. (injected by DFLASH_FAULT)"
)


@dataclass(frozen=True)
class Identity:
    rank: int
    role: str
    device: str
    host: str

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.role}, {self.device} on {self.host})"


def describe(exc: BaseException, device: torch.device | str) -> str:
    """One-paragraph cause; a CUDA OOM also gets the allocator's figures."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError):
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available():
            text += "\n" + torch.cuda.memory_summary(dev, abbreviated=True)
        else:
            text += f"\n(no CUDA allocator on {dev}: memory summary not available)"
    return text


# ---- fault injection ----


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str  # raise | kill | oom

    @classmethod
    def parse(cls, text: str) -> Fault:
        fields = dict(part.split("=", 1) for part in text.split(",") if part)
        try:
            fault = cls(int(fields["rank"]), int(fields["step"]), fields["kind"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"DFLASH_FAULT={text!r}: want rank=R,step=S,kind=raise|kill|oom ({e})") from None
        if fault.kind not in ("raise", "kill", "oom"):
            raise ValueError(f"DFLASH_FAULT={text!r}: kind must be raise, kill or oom")
        return fault


def fault_from_env() -> Fault | None:
    text = os.environ.get("DFLASH_FAULT", "")
    return Fault.parse(text) if text else None


def maybe_inject(fault: Fault | None, rank: int, step: int) -> None:
    if fault is None or fault.rank != rank or fault.step != step:
        return
    log.warning("rank %d: injecting fault %s at step %d", rank, fault.kind, step)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "oom":
        raise torch.OutOfMemoryError(FAKE_OOM)
    raise RuntimeError(f"injected failure at step {step} (DFLASH_FAULT)")


# ---- the job-wide monitor ----


class PeerMonitor:
    """Heartbeats in the job's TCP store, and a thread that stops this rank when a peer fails or vanishes.

    Counters only (store.add), so hosts need no common clock: a peer whose counter has not moved for
    `dead_after` seconds of this rank's own clock is presumed dead. The keys are namespaced by torchrun's run
    id and restart count, so a restarted attempt never reads the previous attempt's failures.
    """

    def __init__(
        self, me: Identity, world_size: int, *, interval: float = 1.0, dead_after: float = 15.0
    ) -> None:
        self.me, self.world_size, self.interval, self.dead_after = me, world_size, interval, dead_after
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        prefix = f"dflash/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.store = dist.PrefixStore(prefix, self._client())
        self._prefix = prefix
        self.store.set(f"id/{me.rank}", str(me))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-monitor", daemon=True)

    def _client(self) -> dist.Store:
        timeout = timedelta(seconds=max(10.0, self.dead_after))
        return dist.TCPStore(self._addr[0], self._addr[1], is_master=False, timeout=timeout)

    def job_store(self) -> dist.Store:
        """The job's store on a connection of its own, under this attempt's prefix (the stop agreement)."""
        return dist.PrefixStore(self._prefix, self._client())

    def start(self) -> PeerMonitor:
        self._thread.start()
        return self

    def name(self, rank: int) -> str:
        key = f"id/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else f"rank {rank}"

    def publish_failure(self, cause: str) -> None:
        """From the failing rank: peers read this and stop within one interval."""
        self._stop.set()  # this rank's own monitor must not take the failure for a peer's
        try:
            store = dist.PrefixStore(self._prefix, self._client())  # not the monitor thread's connection
            store.set(f"failed/{self.me.rank}", f"{self.me}: {cause}")
            store.add("failed", 1)
        except Exception as e:  # the store may be what failed; the log line is already out
            log.error("%s: could not publish the failure to the job store: %s", self.me, e)

    def peer_failure(self) -> str | None:
        """The cause a peer published, if any (from the main thread, on its own connection)."""
        try:
            store = dist.PrefixStore(self._prefix, self._client())
            if store.add("failed", 0) == 0:
                return None
            failed = [r for r in range(self.world_size) if r != self.me.rank and store.check([f"failed/{r}"])]
            return " | ".join(store.get(f"failed/{r}").decode() for r in failed) or None
        except Exception:
            return None

    def done(self) -> None:
        """Normal end: stop beating without being taken for dead. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):  # the store's host may be gone already
            self.store.add(f"done/{self.me.rank}", 1)

    def _stop_job(self, why: str, level: int = logging.CRITICAL) -> None:
        """CRITICAL when this rank is the one to report the cause (a silent peer, the store gone); a peer's
        own published failure is already CRITICAL in its log, so stopping because of it is only an ERROR."""
        log.log(level, "stopping: %s", why)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(EXIT_PEER)  # from a thread, past a main thread stuck in a collective

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        peers = [r for r in range(self.world_size) if r != self.me.rank]
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb/{self.me.rank}", 1)
                if self.store.add("failed", 0) > 0:
                    failed = [r for r in peers if self.store.check([f"failed/{r}"])]
                    if failed and not self._stop.is_set():
                        causes = [self.store.get(f"failed/{r}").decode() for r in failed]
                        self._stop_job("peer failed: " + " | ".join(causes), logging.ERROR)
                now = time.monotonic()
                for r in peers:
                    beats = self.store.add(f"hb/{r}", 0)
                    if beats == 0 or self.store.add(f"done/{r}", 0):
                        continue  # not started yet (the startup barrier covers it) or finished cleanly
                    last = seen.get(r)
                    if last is None or last[0] != beats:
                        seen[r] = (beats, now)
                    elif now - last[1] > self.dead_after:
                        self._stop_job(
                            f"{self.name(r)} stopped heart-beating {now - last[1]:.0f} s ago "
                            "(killed: SIGKILL, the kernel OOM killer, a GPU Xid, or its host went away)"
                        )
            except Exception as e:
                if self._stop.is_set():
                    return
                self._stop_job(
                    f"lost the job's store at {self._addr[0]}:{self._addr[1]} ({e}); its host is gone"
                )


def log_failure(me: Identity, exc: BaseException, device: torch.device | str) -> str:
    """The log format puts `rank R (role, device on host): ` before the message (launch._setup_logging)."""
    cause = describe(exc, device)
    if getattr(exc, "one_line", False):  # an error whose message says it all (checkpoint.CheckpointError)
        log.critical("%s", cause)
    else:
        log.critical("%s\n%s", cause, "".join(traceback.format_exception(exc)))
    exc.__dflash_reported__ = True  # type: ignore[attr-defined]  # the excepthook need not log it again
    return cause


def handle_failure(
    me: Identity, exc: BaseException, device: torch.device | str, monitor: PeerMonitor
) -> None:
    """From the rank's main thread. A peer that failed first is the cause, and this rank's own error (a
    closed connection, a timeout) only its consequence: say so and leave, so the root cause stands alone."""
    first = monitor.peer_failure()
    if first is not None:
        log.error("stopping: peer failed: %s (here: %s: %s)", first, type(exc).__name__, str(exc)[:200])
        monitor.done()
        logging.shutdown()
        os._exit(EXIT_PEER)
    if peer_lost(exc):
        # A peer vanished (its node killed or rebooted) mid-transfer: the consequence here, not a cause. Its
        # heartbeat stops; the launchers name the node (distributed/elastic.py, service/supervisor.py).
        log.error("stopping: lost the connection to a peer: %s", str(exc).split(". This is")[0][:300])
        logging.shutdown()
        os._exit(EXIT_PEER)
    cause = log_failure(me, exc, device)
    monitor.publish_failure(cause.splitlines()[0])


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def peer_lost(exc: BaseException) -> bool:
    """gloo's and the store's words for a peer process that is gone (NCCL's arrive as DistNetworkError)."""
    return isinstance(exc, dist.DistNetworkError) or any(w in str(exc) for w in PEER_LOST)


def install_excepthooks(me: Identity, device: torch.device | str, monitor: PeerMonitor | None) -> None:
    """Uncaught exceptions of the main thread: log `rank R (role, device): cause`, tell the peers, exit.
    Other threads' are logged and training goes on (see thread_failed)."""

    def handle(exc: BaseException) -> None:
        if not getattr(exc, "__dflash_reported__", False):
            cause = log_failure(me, exc, device)
            if monitor is not None:
                monitor.publish_failure(cause.splitlines()[0])
        logging.shutdown()
        os._exit(EXIT_FAILED)

    def thread_failed(args: threading.ExceptHookArgs) -> None:
        # Another library's thread (a tracker's writer: tensorboard's on a full disk) must not end training;
        # the trainer's own threads hand their errors to the main thread (checkpoint writer, EMA fold).
        if args.exc_value is None or isinstance(args.exc_value, SystemExit):
            return
        name = args.thread.name if args.thread is not None else "?"
        log.error(
            "%s: thread %s failed, training goes on: %s",
            me,
            name,
            "".join(traceback.format_exception(args.exc_value)).rstrip(),
        )

    sys.excepthook = lambda _t, exc, _tb: handle(exc)
    threading.excepthook = thread_failed
