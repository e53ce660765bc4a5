#!/usr/bin/env bash
# Runs every molecule scenario over the lab (converge, idempotence, verify), or the slow ones with --slow,
# or the scenarios named: scripts/molecule_all.sh [--slow | SCENARIO...].
# A scenario is slow when its directory holds a file named SLOW (its first line says why); `make test-slow` runs those.
set -euo pipefail
cd "$(dirname "$0")/.."
# Colour only on a terminal: molecule forces Ansible's colour whenever TERM says xterm, even into a log file.
if [ ! -t 1 ]; then export NO_COLOR=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 PY_COLORS=0; fi
want_slow=false; named=()
case ${1:-} in
  --slow) want_slow=true ;;
  "") ;;
  *) named=("$@") ;;
esac
ran=0
for file in molecule/*/molecule.yml; do
  dir=$(dirname "$file"); scenario=$(basename "$dir")
  if [ ${#named[@]} -gt 0 ]; then
    [[ " ${named[*]} " == *" $scenario "* ]] || continue
  else
    is_slow=false; [ -f "$dir/SLOW" ] && is_slow=true
    [ "$is_slow" = "$want_slow" ] || continue
  fi
  echo "== molecule test -s $scenario"
  molecule test -s "$scenario"
  ran=$((ran + 1))
done
if [ ${#named[@]} -gt 0 ] && [ "$ran" -ne ${#named[@]} ]; then
  echo "molecule: ran $ran of ${#named[@]} named scenario(s); no such scenario among: ${named[*]}" >&2
  exit 1
fi
echo "molecule: $ran scenario(s) passed"
