#!/usr/bin/env bash
# What the operator waits for on a lent GPU machine, each figure beside its previous value in one run, with the
# service's own entry points. Detached, so that it outlives the device tool's 10-minute limit per command:
#   device run (carry .whl and .old):  bash scripts/gpu_seconds.sh start [SECTION...]   # returns at once
#   device run (no carry):             bash scripts/gpu_seconds.sh poll [SECONDS]       # until the end or SECONDS
# .whl: the wheels the machine lacks (bash scripts/gpu_wheels.sh). .old/trainer/src: the trainer's source before the change
# (`git archive REV trainer/src | tar -x -C .old`), the "before" column of preflight's figures.
# Sections, in this order (default: all):
#   walk       the decode walk at the reference shape: ms per verify step, graph/recorded against dynamic/recorded
#              (WALK_VARIANTS: bench_walk's --variants, e.g. "graph/recorded graph/recorded+kept")
#   gputests   every GPU-marked test (scripts/gpu_bench.sh gputests)
#   preflight  `dflash-train preflight` cold, warm and with a failing cheap check, before and after
#   autotune   the FLA probe's autotuning cold and the speed of the kernels it picked, per arm TIMING@LENGTH:
#              Triton's default timing or a brief one (5/25 ms), the probe at LENGTH tokens
#              (trainer/bench/bench_autotune_timing.py; AUTOTUNE_ARMS, AUTOTUNE_RUNS: its --arms, --runs)
#   rehearsal  scripts/gpu_rehearsal.sh --steps 30 --stop-at 15 --unit-start: preflight, launch, restart,
#              evaluation's share, then the unit's first start after that smoke run (the real configuration)
#              (PREFLIGHT_LAYERS=8 on an 80 GB card: the cut target, its figures labelled as such;
#              PROFILE_START=1: each phase's start sampled to its first step, PHASE-start-profile.txt;
#              UNIT_START_COLD=1: the unit start on empty caches; UNIT_START_BEFORE=.old/trainer/src: first
#              the unit start with the trainer before the change, side by side; UNIT_START_ONLY=1: no smoke
#              run, a first unit start on empty caches, then those two on its caches)
#   target     the target forward of the 8-layer slice: the trainer's compiled path with and without CUDA graphs
#              (TARGET_VARIANTS: bench_target's --variant; TARGET_BEFORE=1: the trainer at .old/trainer/src and this
#              one, alternating, TARGET_ROUNDS times)
#   load       fast_load's GB/s with the 27B target staged in /dev/shm beside it (the production situation),
#              then with it removed (an idle host)
# Results: $OUT/*.log and *.json (walk.json, preflight.json, target.json, session.log).
set -u
STATE=${STATE:-/var/tmp/dflash-seconds}
LOG=$STATE/session.log
case ${1:-} in
start)
  shift
  rm -rf "$STATE"
  mkdir -p "$STATE/out"
  # The session runs from its own copy: the device tool replaces or removes the working tree's ignored paths at
  # the next call (a poll), which left an earlier session without its files halfway.
  cp -a . "$STATE/tree"
  cd "$STATE/tree" || exit 1
  export STATE  # the detached shell writes its figures under it
  # shellcheck disable=SC2016  # expanded by the detached shell
  setsid nohup bash -c '
    source scripts/gpu_env.sh || { echo "session exit: gpu_env failed ($(date -u +%T))"; exit 1; }
    sections=${*:-walk gputests preflight autotune rehearsal target load}
    want() { [[ " $sections " == *" $1 "* ]]; }
    free -g | sed "s/^/host memory: /"
    if want walk; then
      echo "=== decode walk: CUDA graph over a static cache against the eager dynamic cache ($(date -u +%T))"
      timeout 420 python3 trainer/bench/bench_walk.py --target /dev/shm/dflash/model --prompts "${WALK_PROMPTS:-1}" \
        --new-tokens "${WALK_TOKENS:-64}" --profile 8 --out "$STATE/out/walk.json" ${WALK_VARIANTS:+--variants $WALK_VARIANTS} \
        2>&1 | grep -v "^Loading weights"
    fi
    if want gputests; then
      echo "=== GPU tests ($(date -u +%T))"
      OUT=$STATE/out bash scripts/gpu_bench.sh gputests 2>&1 | tail -n 40
    fi
    if want preflight; then
      echo "=== preflight: before and after, cold, warm, failing ($(date -u +%T))"
      before=(); [ -d .old/trainer/src ] && before=(--before .old/trainer/src)
      # PREFLIGHT_LAYERS=8 on an 80 GB GPU: the target cut, the probes shaped as at 64 layers.
      [ -n "${PREFLIGHT_LAYERS:-}" ] && before+=(--layers "$PREFLIGHT_LAYERS")
      # One 54 GB target in /dev/shm for preflight and the walk; a cut one in a directory of its own.
      timeout 480 python3 trainer/bench/bench_preflight.py --target /dev/shm/dflash/model${PREFLIGHT_LAYERS:+-$PREFLIGHT_LAYERS} "${before[@]}" \
        --state "$STATE/preflight" --out "$STATE/out/preflight.json" 2>&1
    fi
    if want autotune; then
      echo "=== autotune: the picks of the probe per arm (${AUTOTUNE_ARMS:-the default arms of the bench}), cold, alternating ($(date -u +%T))"
      # shellcheck disable=SC2086  # the arms are words
      timeout 540 python3 trainer/bench/bench_autotune_timing.py --out "$STATE/out/autotune.json" \
        ${AUTOTUNE_ARMS:+--arms $AUTOTUNE_ARMS} ${AUTOTUNE_RUNS:+--runs $AUTOTUNE_RUNS} 2>&1 | tail -n 16
    fi
    if want rehearsal; then
      echo "=== rehearsal: the service path, 30 steps with a restart at 15 ($(date -u +%T))"
      # PREFLIGHT_LAYERS=8 on an 80 GB GPU: the 27B target and the drafter training do not fit one card, so the
      # cut target of preflight (rehearse puts the context layers of the drafter inside it; figures labelled).
      cut=()
      [ -n "${PREFLIGHT_LAYERS:-}" ] && cut=(--layers "$PREFLIGHT_LAYERS" --target-dir "/dev/shm/dflash/model-$PREFLIGHT_LAYERS")
      [ "${PROFILE_START:-0}" = 1 ] && export DFLASH_PROFILE_START=$STATE/rehearsal/profile
      OUT=$STATE/out STATE=$STATE/rehearsal SKIP_GPU_TESTS=1 timeout 900 bash scripts/gpu_rehearsal.sh --steps 30 \
        --stop-at 15 --unit-start ${UNIT_START_COLD:+--unit-start-cold} ${UNIT_START_ONLY:+--unit-start-only} \
        ${UNIT_START_BEFORE:+--unit-start-before "$UNIT_START_BEFORE"} "${cut[@]}" 2>&1 | grep -v "^Loading weights" | tail -n 60
      grep -hE "evaluation at step|compile caches|preflight (passed|FAILED)|ok   (triton|caches)|torch.compile" "$STATE"/rehearsal/run/*.log 2>/dev/null | head -n 20
    fi
    if want target; then
      # TARGET_BEFORE=1: the trainer before the change (.old/trainer/src) and this one, alternating, TARGET_ROUNDS
      # times (target-before-R.json, target-R.json); else this trainer once (target.json).
      read -r -a variants <<<"${TARGET_VARIANTS:-trainer-compiled trainer-graphed trainer-graphed-plain graph-layers-fused}"
      arms=(this); [ "${TARGET_BEFORE:-0}" = 1 ] && [ -d .old/trainer/src ] && arms=(before this)
      rounds=${TARGET_ROUNDS:-1}
      for round in $(seq "$rounds"); do
        for arm in "${arms[@]}"; do
          name=target; [ "$arm" = before ] && name=target-before
          [ "${#arms[@]}" -gt 1 ] || [ "$rounds" -gt 1 ] && name=$name-$round
          echo "=== target forward, 8-layer slice, $name ($(date -u +%T))"
          src=$PWD/trainer/src; [ "$arm" = before ] && src=$PWD/.old/trainer/src
          PYTHONPATH=$src:$PYTHONPATH timeout 420 python3 trainer/bench/bench_target.py --device cuda --layers 8 --dir /var/tmp \
            --out "$STATE/out/$name.json" --variant "${variants[@]}" 2>&1 | grep -v "^Loading weights" | tail -n 30
        done
      done
    fi
    if want load; then
      echo "=== fast_load beside the staged target: $(du -sh /dev/shm 2>/dev/null | cut -f1) in /dev/shm ($(date -u +%T))"
      free -g | sed "s/^/host memory: /"
      timeout 180 python3 trainer/bench/bench_load.py --size-gb 8 --device cuda --repeat 7 2>&1 | tail -n 20
      rm -rf /dev/shm/dflash
      echo "=== fast_load on an idle host: $(du -sh /dev/shm 2>/dev/null | cut -f1) in /dev/shm ($(date -u +%T))"
      timeout 180 python3 trainer/bench/bench_load.py --size-gb 8 --device cuda --repeat 7 2>&1 | tail -n 20
    fi
    rm -rf /dev/shm/dflash "$STATE/rehearsal" "$STATE/tree"
    echo "session exit ($(date -u +%T))"' session "$@" >"$LOG" 2>&1 </dev/null &
  echo "gpu seconds: started (pid $!); log $LOG"
  ;;
poll)
  deadline=$(($(date +%s) + ${2:-540}))
  # Copied as it goes: a call cut off by the device time left still brings back what was done.
  copy_out() { [ -z "${OUT:-}" ] || cp "$LOG" "$STATE"/out/*.json "$STATE"/out/*.txt "$STATE"/out/*.log "$OUT"/ 2>/dev/null; }
  while ! grep -q "^session exit" "$LOG" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do copy_out; sleep 5; done
  copy_out
  tail -n 150 "$LOG"
  grep -q "^session exit" "$LOG" || echo "gpu seconds: still running"
  ;;
*)
  echo "usage: $0 start [SECTION...] | poll [SECONDS]" >&2
  exit 2
  ;;
esac
