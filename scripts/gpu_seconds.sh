#!/usr/bin/env bash
# What the operator waits for on a lent GPU machine, measured with the service's own entry points:
#   device run (carry .whl: flash-linear-attention + fla-core wheels):  bash scripts/gpu_seconds.sh [SECTION...]
#   sections: probe (the preflight's GPU probes cold, then warm with their verdict and autotune caches),
#             walk (the decode walk at the reference shape: ms per verify step, its phases, a profile)
# Results: $OUT/*.log and *.json. The random target stays in /dev/shm/dflash/model (the rehearsal's place).
set -u
OUT=${OUT:-/tmp/gpu-seconds}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
sections=${*:-probe walk}
want() { [[ " $sections " == *" $1 "* ]]; }

if want probe; then
  cache=$(mktemp -d /var/tmp/dflash-probe-cache.XXXXXX)
  shape=(--key-heads 16 --value-heads 48 --key-dim 128 --value-dim 128 --conv 4)
  for run in cold warm; do
    for probe in triton fla; do
      start=$(date +%s.%N)
      args=(); [ "$probe" = fla ] && args=("${shape[@]}")
      TRITON_CACHE_DIR=$cache/triton TRITON_CACHE_AUTOTUNING=1 XDG_CACHE_HOME=$cache \
        timeout 300 python3 -m dflash_trainer.service.gpu_probe "$probe" "${args[@]}" 2>&1 | tail -n 1
      echo "probe $probe $run: $(echo "$(date +%s.%N) - $start" | bc) s"
    done
  done 2>&1 | tee "$OUT/probe.log"
  rm -rf "$cache"
fi
if want walk; then
  timeout 540 python3 trainer/bench/bench_walk.py --target /dev/shm/dflash/model --prompts "${WALK_PROMPTS:-2}" \
    --new-tokens "${WALK_TOKENS:-32}" --profile "${WALK_PROFILE:-3}" --out "$OUT/walk.json" 2>&1 |
    grep -v "^Loading weights" | tee "$OUT/walk.log" | tail -n 120
fi
