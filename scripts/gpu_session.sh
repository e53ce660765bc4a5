#!/usr/bin/env bash
# One lent GPU session's work, detached so that it outlives the device tool's 10-minute limit per command:
#   device run (carry .whl):  bash scripts/gpu_session.sh start [REHEARSE ARGS]   # returns at once
#   device run:               bash scripts/gpu_session.sh poll [SECONDS]          # until the end or SECONDS
# `start` runs, in the background: every GPU-marked trainer test (kernels, the checkpoint's snapshot paths, the
# decode walk and the fast target load on CUDA; GPU_TESTS="FILE ..." runs those files' only), fast_load against
# the peers and over a grid of its settings, the target forward's benchmark (fp32, eager, compiled layers in a CUDA
# graph with and without fused projections, their plain forwards, the trainer's compiled forward with and without
# them; traces kept), scripts/gpu_rehearsal.sh,
# then the drafter benchmark (flex against dense, then a profile of its step) and our step against SpecForge's
# (carry its wheel, specforge-0.2.0, in .whl: gpu_env.sh installs every carried wheel without
# dependencies). SESSION_BENCHES names the benchmarks to run (default "drafter target load specforge"; 0: none);
# TARGET_VARIANTS the target forward's variants (default: all those named above).
# `poll` waits, then copies the session log, the rehearsal's phase logs, rehearsal.json and the benchmarks' JSON
# and traces into $OUT (what the device tool brings back).
set -u
export STATE=${STATE:-/var/tmp/dflash-rehearsal}
LOG=$STATE/session.log
case ${1:-} in
start)
  shift
  mkdir -p "$STATE/out"
  # shellcheck disable=SC2016  # expanded by the detached shell
  setsid nohup bash -c '
    source scripts/gpu_env.sh || { echo "session exit 1: gpu_env failed ($(date -u +%T))"; exit 1; }
    lscpu | grep -E "^(Model name|Socket|Core|Thread|L3|NUMA node\(s\))" | sed "s/^/host: /"
    bench_on() { [[ " ${SESSION_BENCHES:-drafter target load specforge} " == *" $1 "* ]]; }
    echo "=== GPU tests ($(date -u +%T))"
    timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-trainer/tests} 2>&1 | tail -n 30
    # the loader first, on an idle host: after a rehearsal (60 GB left in /dev/shm, ~100 GB of checkpoints
    # just written) it gives 15-21 GB/s against 45 (docs/journal.md)
    if bench_on load; then
      sync
      echo "=== loading the staged model: fast_load against the peers, then its readers x chunks, best and median of 7 ($(date -u +%T))"
      timeout 240 python3 trainer/bench/bench_load.py --size-gb 8 --device cuda --repeat 7 --grid \
        --grid-readers 8 10 12 14 --grid-chunk-mb 8 12 --grid-buffers 1 2>&1 | tail -n 20
    fi
    # the target forward next, on a cool GPU: after a rehearsal the same GEMMs take 24.4 or 27.3 ms
    # (docs/journal.md)
    if bench_on target; then
      echo "=== target forward with capture: eager, compiled layers in a CUDA graph with and without fused projections, train.target_compile ($(date -u +%T))"
      timeout 480 python3 trainer/bench/bench_target.py --device cuda --layers 8 --dir /var/tmp --trace 2 \
        --trace-dir "$STATE/out/target-traces" --variant ${TARGET_VARIANTS:-fp32-reference eager eager-plain \
        graph-layers-opaque graph-plain-layers-opaque graph-layers-fused graph-plain-layers-fused \
        trainer-compiled-unfused trainer-compiled} --out "$STATE/out/target.json" 2>&1 |
        grep -v "^Loading weights" | tail -n 16
      tar czf "$STATE/out/target-traces.tgz" -C "$STATE/out" target-traces 2>/dev/null
    fi
    echo "=== rehearsal ($(date -u +%T))"
    OUT=$STATE/out SKIP_GPU_TESTS=1 bash scripts/gpu_rehearsal.sh "$@"
    rc=$?
    if bench_on drafter; then
      echo "=== drafter step: flex against dense first, then timed and profiled ($(date -u +%T))"
      timeout 360 python3 trainer/bench/bench_drafter.py --device cuda --hidden 5120 --layers 5 --no-extras \
        --profile 3 --out "$STATE/out/drafter.json" 2>&1 | tail -n 6
    fi
    if bench_on specforge; then
      echo "=== our drafter step against SpecForge 0.2.0 ($(date -u +%T))"
      timeout 420 python3 trainer/bench/bench_specforge.py --device cuda --out "$STATE/out/specforge.json" 2>&1 |
        tail -n 4
    fi
    echo "session exit $rc ($(date -u +%T))"' session "$@" >"$LOG" 2>&1 </dev/null &
  echo "gpu session: started (pid $!); log $LOG"
  ;;
poll)
  deadline=$(($(date +%s) + ${2:-540}))
  while ! grep -q "^session exit" "$LOG" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  if [ -n "${OUT:-}" ]; then
    cp "$LOG" "$OUT"/ 2>/dev/null
    cp "$STATE"/run/*.log "$STATE"/run/rehearsal.json "$STATE"/out/drafter.json "$STATE"/out/specforge.json \
      "$STATE"/out/target.json "$STATE"/out/target-traces.tgz "$OUT"/ 2>/dev/null
  fi
  free -g | sed 's/^/host memory: /'
  tail -n 80 "$LOG"
  grep -q "^session exit" "$LOG" || echo "gpu session: still running"
  ;;
*)
  echo "usage: $0 start [REHEARSE ARGS] | poll [SECONDS]" >&2
  exit 2
  ;;
esac
