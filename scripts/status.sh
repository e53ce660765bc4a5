#!/usr/bin/env bash
# `make status`: the training unit of the inventory's CT on one screen (python -m dflash_trainer.alerts status, run
# in the CT over the inventory's connection: lxc-attach in the lab, ssh to the CT, or ssh to the Proxmox host and
# `pct exec`). TRAINER_PYTHON overrides the CT's python (default: the inventory's ct_venv_dir/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"
# ct_kind, ct_address, ct_vmid, ct_user, ct_venv and ct_exec (the prefix that runs a command in the CT).
target=$("$VENV/bin/python" scripts/ct_target.py "$INVENTORY")
eval "$target"
exec "${ct_exec[@]}" "${TRAINER_PYTHON:-$ct_venv/bin/python}" -m dflash_trainer.alerts status
