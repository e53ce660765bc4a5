"""Two nodes, one job, shown on one machine: two `dflash-train launch --nnodes 2 --rdzv-endpoint ...` (the
unit's main process on two CTs) joined by torch elastic's c10d rendezvous on 127.0.0.1, one rank each over
gloo, the tiny target, one shared checkpoint directory. Each node has its own fake NOTIFY_SOCKET, as each CT's
systemd.

Start (READY on both units, STATUS with the loss from the leader's, WATCHDOG on both), a graceful stop from
the leader's node (one checkpoint, both exit 0), resume, a node SIGKILLed (the other ends within seconds
naming it; the killed node's rank dies with its launcher), the node hosting the job's store killed, and a last
start that resumes from the newest checkpoint and finishes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from dflash_trainer.checkpoint import latest_checkpoint, load_checkpoint
from dflash_trainer.distributed.local import free_port
from dflash_trainer.fixtures.synth import synth_shards
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID

pytestmark = pytest.mark.system

# The first stop must come well before the horizon, on an idle machine too: from seeing step 3 to the stop an
# idle CI host trains about 92 steps.
STEPS = 300


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_node_left_behind():
    """A failed assertion must not leave launchers (and their ranks, through PDEATHSIG) running."""
    yield
    for proc in STARTED:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    STARTED.clear()


class Node:
    """One node's launcher with its own notify socket (its CT's systemd), output in a file."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        config: Path,
        port: int,
        run_id: str,
        local_addr: str | None = None,
        serve: tuple[str, ...] = (),
    ) -> None:
        self.log_path = tmp / f"{name}.log"
        self.messages: list[str] = []
        sock_path = str(tmp / f"{name}.notify")
        if os.path.exists(sock_path):
            os.unlink(sock_path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.server.bind(sock_path)
        self.server.settimeout(0.5)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        cmd = [sys.executable, "-m", "dflash_trainer.service", "launch", "--nnodes", "2"]
        cmd += ["--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
        cmd += ["--local-addr", local_addr] if local_addr else []
        cmd += ["--", "serve", str(config), *serve]
        env = os.environ | {"OMP_NUM_THREADS": "1", "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "20000000"}
        self.out = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=subprocess.STDOUT, text=True)
        STARTED.append(self.proc)

    def _read(self) -> None:
        while True:
            try:
                self.messages.append(self.server.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def node(self) -> int | None:
        m = re.search(r"node (\d) launcher: node \d \(", self.log)
        return int(m.group(1)) if m else None

    def rank_pid(self) -> int:
        return int(re.search(r"started \d+=pid (\d+)", self.log).group(1))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.out.close()
        self.server.close()
        return code


def start(
    tmp: Path, config: Path, run_id: str, tag: str, addrs: tuple[str, str] | None = None, **kw: tuple
) -> list[Node]:
    """Two nodes a and b; with `addrs` their --local-addr (the rendezvous numbers nodes by address, then pid:
    without, a before b, usually)."""
    port = free_port()
    a, b = addrs or (None, None)
    nodes = [Node(tmp, f"{tag}-a", config, port, run_id, a, **kw)]
    time.sleep(0.5)
    nodes.append(Node(tmp, f"{tag}-b", config, port, run_id, b, **kw))
    return nodes


def wait_for(nodes: list[Node], pattern: str, timeout: float = 300) -> Node:
    """The node whose notify messages first match `pattern` (a regex)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for n in nodes:
            if any(re.match(pattern, m) for m in n.messages):
                return n
            if n.proc.poll() is not None:
                raise AssertionError(f"a node ended early ({n.proc.returncode}):\n" + n.log)
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(n.log for n in nodes))


def step_of(path: Path) -> int:
    return load_checkpoint(latest_checkpoint(path))[0]["trainer"]["step"]


def gone(pid: int, within: float = 10.0) -> bool:
    """The process ended (a zombie not yet reaped by PID 1 counts as ended)."""
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.2)
    return False


def kill_one(nodes: list[Node], which: int) -> tuple[Node, Node, float]:
    """SIGKILL node `which`'s launcher (as systemd's kill or a host reset does); the other ends by itself."""
    victim = next(n for n in nodes if n.node() == which)
    other = next(n for n in nodes if n is not victim)
    rank_pid = victim.rank_pid()
    victim.proc.kill()
    killed_at = time.time()
    victim.wait(30)
    assert other.wait(60) == 1, other.log
    took = time.time() - killed_at
    assert gone(rank_pid), "the killed node's rank outlived its launcher"
    return victim, other, took


def test_two_nodes_start_stop_kill_resume(tiny_target, tmp_path: Path) -> None:
    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    checkpoints = tmp_path / "shared" / "checkpoints"  # one directory both nodes see (NFS on real CTs)
    config = tiny_run_config(
        tmp_path / "train.toml",
        target,
        shards,
        data={"shuffle_window": 5},
        optim={"lr": 3e-3},
        # No periodic save inside the test's window: each phase resumes from the previous stop's own save,
        # wherever the stop fell (a periodic save at 100 raced the kills when the first stop came at 95).
        train={"max_steps": STEPS, "checkpoint_dir": checkpoints, "checkpoint_every": STEPS, "ema_every": 3},
        topology={"targets": 1, "drafters": 1},
        service={"status_every": 1},
    )

    # 1. Start: READY on both units, the leader's STATUS with the loss, WATCHDOG on both; then a graceful stop
    # from the leader's node alone.
    nodes = start(tmp_path, config, "job1", "first")
    leader = wait_for(nodes, r"STATUS=step 3 loss ")
    other = next(n for n in nodes if n is not leader)
    wait_for([other], r"STATUS=step \d+ \(the job's leader")
    leader.proc.send_signal(signal.SIGTERM)
    stop_at = time.time()
    codes = [n.wait(120) for n in nodes]
    assert codes == [0, 0], "\n".join(n.log for n in nodes)
    took = time.time() - stop_at
    for n in nodes:
        assert [m for m in n.messages if m.startswith("READY=1")] == ["READY=1\nSTATUS=loaded; training"]
        assert "WATCHDOG=1" in n.messages, n.messages
        assert any(m.startswith("STOPPING=1") for m in n.messages)
        assert re.search(r"all 1 rank\(s\) (stopped|finished) cleanly", n.log), n.log
        rank_lines = [line for line in n.log.splitlines() if re.match(r"(node \d )?rank \d", line)]
        assert rank_lines and all(line.startswith(f"node {n.node()} rank ") for line in rank_lines), n.log
    assert not any(re.match(r"STATUS=step \d+ loss ", m) for m in other.messages)  # one voice: the leader
    step = step_of(checkpoints)
    assert 3 <= step < STEPS and f"stopped at step {step}" in leader.log, leader.log
    assert "all 1 rank(s) stopped cleanly" in leader.log  # the node that got SIGTERM
    assert len(list(checkpoints.glob("step-*"))) == 1  # one checkpoint for the whole job
    print(f"graceful stop at step {step}: {took:.1f} s after SIGTERM to the leader's node")

    # 2. Resume on both, then SIGKILL node 1 (the drafter's): node 0 ends within seconds naming node 1.
    nodes = start(tmp_path, config, "job1", "second")
    wait_for(nodes, rf"STATUS=step {step + 2} loss ")
    assert any(f"resumed from {checkpoints}/step-{step:08d} (step {step})" in n.log for n in nodes)
    _, other, took = kill_one(nodes, 1)
    assert re.search(r"node 1 \(\S+, rank 1\) lost: no heartbeat", other.log), other.log
    assert took < 20, f"{took:.1f} s"
    print(f"node 1 killed: node 0 ended {took:.1f} s later")

    # 3. Again from the same (newest complete) checkpoint, beside a save that a kill interrupted (the writer's
    # temporary directory, never renamed): it does not count. This time the node hosting the job's store dies.
    partial = checkpoints / f".tmp-step-{step + 50:08d}-4242"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"\x80\x02half a pickle")
    nodes = start(tmp_path, config, "job1", "third")
    wait_for(nodes, rf"STATUS=step {step + 1} loss ")
    assert any(f"resumed from {checkpoints}/step-{step:08d} (step {step})" in n.log for n in nodes)
    _, other, took = kill_one(nodes, 0)
    assert re.search(r"node 0 \(\S+, rank 0\) lost: the job's store", other.log), other.log
    assert took < 20, f"{took:.1f} s"
    print(f"node 0 (the store's) killed: node 1 ended {took:.1f} s later")

    # 4. The smoke run's pause on the leader: the other unit's watchdog still hears the leader beat (every
    # WatchdogSec / 4 while paused); then a stop from the node that is not the leader's stops the job too.
    pause = step + 2
    nodes = start(tmp_path, config, "job1", "fourth", serve=("--pause-at", str(pause)))
    leader = wait_for(nodes, rf"STATUS=step {pause}: paused")
    other = next(n for n in nodes if n is not leader)
    wait_for([other], rf"STATUS=step {pause} \(the job's leader")
    pings = other.messages.count("WATCHDOG=1")
    time.sleep(12)  # WATCHDOG_USEC is 20 s: the paused leader beats every 5 s
    assert other.messages.count("WATCHDOG=1") >= pings + 2, other.messages[-10:]
    other.proc.send_signal(signal.SIGTERM)
    assert [n.wait(120) for n in nodes] == [0, 0], "\n".join(n.log for n in nodes)
    assert step_of(checkpoints) == pause, leader.log

    # 5. Nodes numbered by their --local-addr: b first this time, so the drafter (the last rank) runs in a's
    # launcher, the other one than before; the job resumes and runs to its horizon, both units end as success.
    nodes = start(tmp_path, config, "job1", "fifth", addrs=("127.0.0.2", "127.0.0.1"))
    codes = [n.wait(300) for n in nodes]
    assert codes == [0, 0], "\n".join(n.log for n in nodes)
    assert [n.node() for n in nodes] == [1, 0]
    assert f"resumed from {checkpoints}/step-{pause:08d} (step {pause})" in nodes[0].log, nodes[0].log
    assert "node 1 rank 1 drafter" in nodes[0].log
    assert step_of(checkpoints) == STEPS
    assert all("all 1 rank(s) finished cleanly" in n.log for n in nodes)


def test_a_checkpoint_directory_not_shared_by_the_nodes_is_refused(tiny_target, tmp_path: Path) -> None:
    """Each node with a directory of its own (a CT's local disk): a restart that moved the drafter leader
    would start afresh beside the checkpoints. Both units fail at start with one line naming the key, the
    path and the rank and node that cannot see the leader's file."""
    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    configs = [
        tiny_run_config(
            tmp_path / f"{name}.toml",
            target,
            shards,
            train={"max_steps": STEPS, "checkpoint_dir": tmp_path / name / "checkpoints"},
            topology={"targets": 1, "drafters": 1},
        )
        for name in ("a", "b")
    ]
    port = free_port()
    nodes = [Node(tmp_path, "a", configs[0], port, "job2")]
    time.sleep(0.5)
    nodes.append(Node(tmp_path, "b", configs[1], port, "job2"))
    codes = [n.wait(300) for n in nodes]
    logs = "\n".join(n.log for n in nodes)
    assert codes == [1, 1], logs
    assert re.search(
        r"critical: NotSharedError: train\.checkpoint_dir \S+ is not one directory for the whole job: "
        r"rank 0 \(target, cpu on \S+ node 0\) cannot see the file "
        r"rank 1 \(drafter, cpu on \S+ node 1\) wrote",
        logs,
    ), logs
    assert not any(n.messages for n in nodes if any(m.startswith("READY=1") for m in n.messages))


def test_a_rank_that_raises_ends_both_nodes_naming_it(tiny_target, tmp_path: Path) -> None:
    """The drafter on node 1 raises at its step 3: its launcher reports the failure in the job's store, node
    0's rank stops because of the peer and node 0's launcher names node 1 and the rank."""
    target = tiny_target("qwen3_5")
    shards = tmp_path / "shards"
    shards.mkdir()
    synth_shards(target, shards, num_shards=2, rows=12, seq_len=24, seed=0, vocab_size=TINY_MASK_TOKEN_ID)
    config = tiny_run_config(
        tmp_path / "train.toml",
        target,
        shards,
        train={"max_steps": STEPS, "checkpoint_dir": tmp_path / "shared"},
        topology={"targets": 1, "drafters": 1},
    )
    os.environ["DFLASH_FAULT"] = "rank=1,step=3,kind=raise"
    try:
        nodes = start(tmp_path, config, "job3", "fault")
    finally:
        del os.environ["DFLASH_FAULT"]
    codes = [n.wait(300) for n in nodes]
    logs = "\n".join(n.log for n in nodes)
    assert codes == [1, 1], logs
    assert re.search(r"node 1 rank 1 drafter: critical: RuntimeError: injected failure at step 3", logs), logs
    node0 = next(n for n in nodes if n.node() == 0)
    assert re.search(r"node 1 \(\S+, rank 1\) failed: rank 1 exited with status 1", node0.log), node0.log
