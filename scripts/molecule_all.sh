#!/usr/bin/env bash
# Runs every molecule scenario over the lab (converge, idempotence, verify), or the slow ones with --slow.
# A scenario is slow when its directory holds a file named SLOW (its first line says why); `make test-slow` runs those.
set -euo pipefail
cd "$(dirname "$0")/.."
want_slow=false; [ "${1:-}" = "--slow" ] && want_slow=true
ran=0
for file in molecule/*/molecule.yml; do
  dir=$(dirname "$file"); scenario=$(basename "$dir")
  is_slow=false; [ -f "$dir/SLOW" ] && is_slow=true
  [ "$is_slow" = "$want_slow" ] || continue
  echo "== molecule test -s $scenario"
  molecule test -s "$scenario"
  ran=$((ran + 1))
done
echo "molecule: $ran scenario(s) passed"
