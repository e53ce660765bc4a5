#!/usr/bin/env bash
# The GPU rehearsal: `make smoke-train`'s sequence on a lent GPU machine (no systemd needed), in one command.
#   device run (carry .whl: bash scripts/gpu_wheels.sh):  bash scripts/gpu_rehearsal.sh [REHEARSE ARGS]
# 1. the GPU tests of the kernels the trainer swaps in (FLA's causal conv against the torch one);
# 2. python -m dflash_trainer.service.rehearse: a random Qwen3.6-27B-shaped target in /dev/shm, then preflight,
#    launch -- serve (READY, steps 1-50, SIGTERM -> checkpoint, exit 0), launch -- serve (resume, steps 51-100),
#    export, export --check, the smoke summary and PASS or FAIL. One rank per GPU (one GPU: one process).
# TARGET_COMPILE=0 or 1: the reference configuration with train.target_compile false or true (unset: the
# reference's own value, true).
# State (the target, checkpoints of ~27 GB each) stays under STATE; logs and figures are copied to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-rehearsal}
STATE=${STATE:-/var/tmp/dflash-rehearsal}
mkdir -p "$OUT" "$STATE"
source "$(dirname "$0")/gpu_env.sh" || exit 1
df -h "$STATE" /dev/shm | sed 's/^/disk: /'
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  echo "=== GPU tests of the kernels"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu trainer/tests/test_kernels.py 2>&1 | tail -n 15
fi
echo "=== rehearsal"
config=()
if [ -n "${TARGET_COMPILE:-}" ]; then  # the reference configuration with train.target_compile set
  want=false
  [ "$TARGET_COMPILE" = 1 ] && want=true
  sed -E "s/^target_compile = (true|false)$/target_compile = $want/" trainer/configs/reference.toml \
    >"$STATE/reference-target-compile.toml"
  grep -q "^target_compile = $want$" "$STATE/reference-target-compile.toml" || { echo "no target_compile key"; exit 2; }
  config=(--config "$STATE/reference-target-compile.toml")
fi
python3 -m dflash_trainer.service.rehearse --out "$STATE/run" "${config[@]}" "$@"
rc=$?
cp "$STATE"/run/phase1.log "$STATE"/run/phase2.log "$STATE"/run/unit-start*.log "$STATE"/run/rehearsal.json "$OUT"/ 2>/dev/null
# DFLASH_PROFILE_START=DIR: each phase's start profile (DIR/PHASE/start-profile-rank<R>.txt), as PHASE-start-profile.txt,
# its first evaluation's (eval-profile-rank<R>.txt), as PHASE-eval-profile.txt, and its preflight's probe profiles
# (DIR/PHASE/probe-<name>-profile.txt), as PHASE-probe-<name>-profile.txt
if [ -n "${DFLASH_PROFILE_START:-}" ]; then
  for f in "$DFLASH_PROFILE_START"/*/{start,eval}-profile-rank0.txt "$DFLASH_PROFILE_START"/*/probe-*-profile.txt; do
    [ -f "$f" ] || continue
    name=$(basename "$f"); name=${name/-rank0/}
    cp "$f" "$OUT/$(basename "$(dirname "$f")")-$name"
  done
fi
exit $rc
