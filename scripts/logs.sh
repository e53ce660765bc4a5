#!/usr/bin/env bash
# `make logs`: follows the dflash-train journal (every rank) in the inventory's container. UNIT=dflash-smoke for
# the smoke run; LINES=N for more history (default 100).
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"
# ct_exec: the prefix that runs a command in the CT (ssh with -t: journalctl follows until Ctrl-C).
target=$("$VENV/bin/python" scripts/ct_target.py --tty "$INVENTORY")
eval "$target"
exec "${ct_exec[@]}" journalctl -f -n "${LINES:-100}" -u "${UNIT:-dflash-train}" --no-hostname -o short-iso
