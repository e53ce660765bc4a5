#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool): every GPU benchmark and GPU-only test, each under its own
# time limit so a slow one cannot eat the others. Results: $OUT/*.log and *.json; figures go to docs/benchmarks.md.
#   device run:  bash scripts/gpu_bench.sh [SECTION...]   (carry .whl: bash scripts/gpu_wheels.sh)
#   sections: drafter load pipeline gputests (default: all, in that order)
#   sections run only when named (one H200): load-grid (fast_load's halves apart and a grid of its
#   settings, with the peers), target (the target forward: eager, compiled, CUDA graphs, fp32 reference, device
#   timeline from the profiler's trace; traces in $OUT/target-traces.tgz; about 7 minutes), drafter-chunks
#   (the drafter step at loss chunk 8192 and 2048, one process each; about 5 minutes)
# Budget: about 9 minutes on nvidia-h200-x2 (two GPUs: the 1:1 pipeline and two parallel loaders).
set -u
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" || exit 1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')

run() {  # run NAME SECONDS CMD...: output to $OUT/NAME.log, the tail to the terminal
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - start)) s"
}

sections=${*:-drafter load pipeline gputests}
want() { [[ " $sections " == *" $1 "* ]]; }

want drafter && run drafter 270 python3 trainer/bench/bench_drafter.py --device cuda --hidden 5120 --no-extras --out "$OUT/drafter.json"
devices=cuda:0; [ "$gpus" -ge 2 ] && devices=cuda:0,cuda:1
want load && run load 90 python3 trainer/bench/bench_load.py --size-gb 8 --device cuda --devices "$devices" --sweep
if ! want pipeline; then :
elif [ "$gpus" -ge 2 ]; then
  run pipeline 150 python3 trainer/bench/bench_pipeline.py --size qwen3-8b --targets 1 --drafters 1 --out "$OUT/pipeline.json"
else
  run pipeline 150 python3 trainer/bench/bench_pipeline.py --size qwen3-8b --out "$OUT/pipeline.json"
fi
# the sections run only when named; one call can narrow what they vary: LOAD_GRID_ARGS, TARGET_VARIANTS,
# DRAFTER_CHUNKS
if want load-grid; then
  # shellcheck disable=SC2086  # a list of arguments
  run load-grid 120 python3 trainer/bench/bench_load.py --size-gb 8 --device cuda --repeat 5 --diagnose --grid ${LOAD_GRID_ARGS:-}
fi
if want drafter-chunks; then
  for chunk in ${DRAFTER_CHUNKS:-8192 2048}; do
    run "drafter-$chunk" 240 python3 trainer/bench/bench_drafter.py --device cuda --hidden 5120 --layers 5 \
      --no-extras --no-check --loss-chunk "$chunk" --out "$OUT/drafter-$chunk.json"
  done
fi
if want target; then
  rm -rf /var/tmp/target-traces
  # shellcheck disable=SC2086  # a list of variants
  run target 420 python3 trainer/bench/bench_target.py --device cuda --layers 8 --dir /var/tmp --trace 2 \
    --trace-dir /var/tmp/target-traces --out "$OUT/target.json" --variant ${TARGET_VARIANTS:-fp32-reference \
    eager eager-plain compiled-mlp graph graph-plain graph-mlp graph-mlp-norm}
  tar czf "$OUT/target-traces.tgz" -C /var/tmp target-traces 2>/dev/null
fi
# Every GPU-marked test in one call (-v: each test's name is printed when it starts, so one that outlives the
# limit is named below). 600 s: on an H100 the 25 tests took 402 s with four of them failing early, and those
# four take 92 s when they pass (docs/benchmarks.md, GPU tests).
if want gputests; then
  # shellcheck disable=SC2086  # GPU_TESTS: a list of test paths (default: all of them)
  run gputests "${GPU_TESTS_LIMIT:-600}" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=15 ${GPU_TESTS:-trainer/tests}
  last=$(grep -E '^trainer/tests/.*::' "$OUT/gputests.log" | tail -n 1)
  if [ -n "$last" ] && ! grep -qE '(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' <<<"$last"; then
    echo "=== gputests: timed out in ${last%% *} (the limit: GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-600} s)"
  fi
fi
