"""The cause of a stop, read from the journal lines the trainer and systemd print (alerts/classify.py).

The OOM and kill journals were captured from the lab CT's dflash-train.service (systemd 252, two ranks, faults
injected with DFLASH_FAULT); tracebacks and C++ frames are shortened. The other lines are the
trainer's format strings (the file named beside each) and systemd's own (src/core/service.c, unit.c)."""

from __future__ import annotations

import pytest

from dflash_trainer.alerts.classify import classify, last_step

OOM_RANK1 = """\
preflight passed in 1.7 s
launcher: started 2 rank(s): 0=pid 853 1=pid 854
rank 0 target: pid 853, local rank 0: target 0 of 1:1; loading
rank 1 drafter: pid 854, local rank 1: drafter 0 of 1:1; loading
Started dflash-train.service - DFlash drafter training (2 rank(s)).
rank 1 drafter: step 20: loss 6.1234 anchor_accept 0.01 lr 5.00e-04 | busy 40% data 0% wait_send 0% \
wait_recv 55% in-flight 1.0 tok/s 310
rank 1 drafter: warning: rank 1: injecting fault oom at step 3
rank 1 drafter: critical: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 \
has a total capacity of 94.97 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this \
process has 93.84 GiB memory in use. (injected by DFLASH_FAULT)
rank 1 drafter: critical: (no CUDA allocator on cpu: memory summary not available)
rank 1 drafter: critical: Traceback (most recent call last):
rank 1 drafter: critical: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. \
GPU 0 has a total capacity of 94.97 GiB of which 1.12 GiB is free. (injected by DFLASH_FAULT)
rank 0 target: error: stopping: peer failed: rank 1 (drafter, cpu on lab-ct200): OutOfMemoryError: \
CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 94.97 GiB of which \
1.12 GiB is free.
launcher: error: rank 0 stopped because a peer failed or vanished (exit 3); stopping the other ranks
dflash-train.service: Main process exited, code=exited, status=1/FAILURE
dflash-train.service: Failed with result 'exit-code'.
""".splitlines()

KILL_RANK0 = """\
launcher: started 2 rank(s): 0=pid 1001 1=pid 1002
rank 0 target: warning: rank 0: injecting fault kill at step 3
[rank1]:[W1205 10:11:48.742280142 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=31, \
addr=[::ffff:127.0.0.1]:46514, remote=[::ffff:127.0.0.1]:43365): Connection reset by peer
frame #5: c10d::TCPStore::incrementValueBy(...) + 0x8a (0x7f72b35415ba in libtorch_cpu.so)
launcher: error: rank 0 killed by SIGKILL (the kernel's or systemd's OOM killer, or kill -9); \
stopping the other ranks
dflash-train.service: Main process exited, code=exited, status=1/FAILURE
dflash-train.service: Failed with result 'exit-code'.
""".splitlines()


def test_an_injected_cuda_oom_names_the_failing_rank_and_its_gpu_not_the_peer() -> None:
    cause = classify(OOM_RANK1, "exit-code", exit_code="exited", exit_status="1")
    assert cause.kind == "cuda_oom"
    assert (cause.rank, cause.gpu, cause.role) == (1, 0, "drafter")
    assert cause.summary.startswith("CUDA out of memory on rank 1 (drafter) on GPU 0"), cause.summary
    assert "2.50 GiB" in cause.summary


def test_a_killed_rank_is_named_with_its_signal() -> None:
    cause = classify(KILL_RANK0, "exit-code")
    assert cause.kind == "rank_exit" and cause.rank == 0 and cause.role == "target"
    assert "rank 0 (target) killed by SIGKILL" in cause.summary


def test_a_rank_that_raised_is_named_with_its_status_and_its_last_words() -> None:
    lines = [
        "rank 1 drafter: critical: RuntimeError: injected failure at step 3 (DFLASH_FAULT)",
        "launcher: error: rank 1 exited with status 1; stopping the other ranks",  # service/supervisor.py
    ]
    cause = classify(lines, "exit-code")
    assert (cause.kind, cause.rank, cause.exit_status) == ("rank_exit", 1, 1)
    assert cause.summary == (
        "rank 1 (drafter) exited with status 1: RuntimeError: injected failure at step 3 (DFLASH_FAULT)"
    )


def test_the_oom_killer_wins_over_the_sigkill_it_caused() -> None:
    lines = [*KILL_RANK0, "dflash-train.service: A process of this unit has been killed by the OOM killer."]
    cause = classify(lines, "oom-kill")
    assert cause.kind == "oom_killer" and cause.rank == 0
    assert "OOM killer" in cause.summary
    assert classify(KILL_RANK0, "oom-kill").kind == "oom_killer"  # the result alone says it


@pytest.mark.parametrize(
    ("line", "rank"),
    [
        # torch ProcessGroupNCCL.cpp (torch 2.x): the C++ line on the rank's stderr.
        (
            "[rank3]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 3] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=131072000, NumelOut=131072000, "
            "Timeout(ms)=300000) ran for 300081 milliseconds before timing out.",
            3,
        ),
        # gloo (third_party/gloo/gloo/transport/tcp/unbound_buffer.cc), raised into the rank's failure line.
        (
            "rank 2 drafter: critical: DistBackendError: [../third_party/gloo/gloo/transport/tcp/"
            "unbound_buffer.cc:81] Timed out waiting 300000ms for recv operation to complete",
            2,
        ),
    ],
    ids=["nccl", "gloo"],
)
def test_a_collective_timeout_is_named_with_its_rank(line: str, rank: int) -> None:
    lines = [line, "launcher: error: rank 5 exited with status 1; stopping the other ranks"]
    cause = classify(lines, "exit-code")
    assert cause.kind == "collective_timeout" and cause.rank == rank, cause


def test_the_watchdog_result_is_a_hung_step() -> None:
    lines = [
        "dflash-train.service: Watchdog timeout (limit 20s)!",
        "dflash-train.service: Killing process 5 (python)",
    ]
    cause = classify(lines, "watchdog", exit_code="killed", exit_status="ABRT")
    assert cause.kind == "watchdog" and "WatchdogSec" in cause.summary


def test_a_preflight_failure_names_the_check() -> None:
    lines = [
        "ok   config: /etc/dflash/train.toml valid",
        "FAIL model: /var/lib/dflash/model: model.safetensors: missing -- fix: make provision TAGS=l4",
        "preflight FAILED (model) in 1.2 s",
        "dflash-train.service: Control process exited, code=exited, status=1/FAILURE",
    ]
    cause = classify(lines, "exit-code")
    assert cause.kind == "preflight" and cause.check == "model"
    assert cause.summary == "preflight check model failed: /var/lib/dflash/model: model.safetensors: missing"


def test_a_node_that_left_is_named() -> None:
    # distributed/elastic.py NodeWatch.lost, then run_job's error line.
    lines = [
        "launcher: error: node 1 (ct201, ranks 2-3) lost: no heartbeat for 6 s (its unit killed, its host "
        "rebooted or its network gone); stopping this node's ranks",
    ]
    cause = classify(lines, "exit-code")
    assert cause.kind == "node_left" and cause.summary.startswith("node 1 (ct201, ranks 2-3) lost")


@pytest.mark.parametrize(
    ("lines", "kind", "summary"),
    [
        (  # service/serve.py and service/supervisor.py after SIGTERM
            [
                "rank 1 drafter: SIGTERM: saving a checkpoint after this step, then exiting",
                "rank 1 drafter: stopped at step 23; checkpoint /var/lib/dflash/train/ckpt/step-00000023",
                "launcher: all 2 rank(s) stopped cleanly",
            ],
            "stopped",
            "stopped cleanly at step 23, checkpoint saved",
        ),
        (
            [
                "rank 1 drafter: finished at step 1512; checkpoint /var/lib/dflash/train/ckpt/step-00001512",
                "launcher: all 2 rank(s) finished cleanly",
            ],
            "finished",
            "training finished at step 1512",
        ),
    ],
    ids=["stopped", "finished"],
)
def test_a_clean_end_says_stopped_or_finished(lines: list[str], kind: str, summary: str) -> None:
    cause = classify(lines, "success")
    assert (cause.kind, cause.summary) == (kind, summary)


def test_the_last_step_is_read_from_the_step_lines() -> None:
    assert last_step(OOM_RANK1) == 20
    assert last_step(["rank 1 drafter: stopped at step 23; checkpoint x"]) == 23
    assert last_step(["launcher: started 2 rank(s)"]) is None


def test_an_unknown_failure_still_says_what_systemd_saw() -> None:
    cause = classify(["something else"], "timeout", exit_code="killed", exit_status="KILL")
    assert cause.kind == "failed" and "timeout" in cause.summary and "KILL" in cause.summary
