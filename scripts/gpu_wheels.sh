#!/usr/bin/env bash
# Fills .whl/ with the wheels a lent GPU machine lacks (its own Python has torch, transformers and triton):
# the trainer lock's flash-linear-attention, fla-core and tomli-w, at the lock's versions and hashes.
# Carry .whl to the machine; scripts/gpu_env.sh installs what it finds there.
#   bash scripts/gpu_wheels.sh [PYTHON]      (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
lock=trainer/requirements.lock
wanted=(flash-linear-attention fla-core tomli-w)
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
for name in "${wanted[@]}"; do
  # The pin and its hash lines, as the lock writes them (NAME==VERSION \ then --hash=... lines).
  awk -v name="$name" '
    $0 ~ "^" name "==" { keep = 1 }
    keep && /^[a-z0-9]/ && $0 !~ "^" name "==" { keep = 0 }
    keep { print }
  ' "$lock" >>"$reqs"
  grep -q "^$name==" "$reqs" || { echo "gpu_wheels: $name is not pinned in $lock" >&2; exit 1; }
done
mkdir -p .whl
"$python" -m pip download -q --no-deps --require-hashes --only-binary=:all: -d .whl -r "$reqs"
ls .whl
