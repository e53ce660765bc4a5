#!/usr/bin/env bash
# `make tensorboard`: the training curves of the inventory's CT in a browser at http://127.0.0.1:${PORT:-6006}/.
# The directory is train.toml's [trackers] tensorboard. In the lab, .venv-trainer's tensorboard on this machine
# reads it through the lab CT's root filesystem (the lab CT image has no /etc/hosts, and tensorboard resolves
# "localhost"). A CT reached over ssh runs its own (the trainer environment's) on its loopback, through
# `ssh -L`. A CT reached through `pct exec` on its host has no port of its own on the host: the script says the
# one command to run instead. TRAINER_PYTHON overrides the CT's python. The connection: scripts/ct_target.py.
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
PORT=${PORT:-6006}
export PATH="$VENV/bin:$PATH"
# ct_kind, ct_address, ct_vmid, ct_user, ct_venv (scripts/ct_target.py).
target=$("$VENV/bin/python" scripts/ct_target.py "$INVENTORY")
eval "$target"
py=${TRAINER_PYTHON:-$ct_venv/bin/python}
# The log directory from the CT's train.toml; tensorboard as the module of the trainer environment.
inner="d=\$($py -c 'import tomllib; print(tomllib.load(open(\"/etc/dflash/train.toml\", \"rb\")).get(\"trackers\", {}).get(\"tensorboard\") or \"\")') && [ -n \"\$d\" ] || { echo 'train.toml has no [trackers] tensorboard directory' >&2; exit 1; }; exec $py -m tensorboard.main --logdir \"\$d\" --host 127.0.0.1 --port $PORT"
echo "tensorboard: http://127.0.0.1:$PORT/ (Ctrl-C stops it)"
case "$ct_kind" in
  lxc)
    rootfs=/var/lib/lxc/$ct_address/rootfs
    dir=$(.venv-trainer/bin/python -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb")).get("trackers", {}).get("tensorboard") or "")' "$rootfs/etc/dflash/train.toml")
    [ -n "$dir" ] || { echo "$rootfs/etc/dflash/train.toml has no [trackers] tensorboard directory" >&2; exit 1; }
    exec .venv-trainer/bin/tensorboard --logdir "$rootfs$dir" --host 127.0.0.1 --port "$PORT" ;;
  ssh) exec ssh -o BatchMode=yes -o ExitOnForwardFailure=yes -L "$PORT:127.0.0.1:$PORT" "$ct_user@$ct_address" "$inner" ;;
  pct)
    echo "CT $ct_vmid is reached through pct exec on $ct_address: its loopback is not the host's. Run tensorboard on the CT's" \
      "address (the PVE firewall must allow it from your machine) or copy the directory:" >&2
    echo "  ssh $ct_user@$ct_address pct exec $ct_vmid -- $py -m tensorboard.main --logdir DIR --host CT_ADDRESS --port $PORT" >&2
    exit 2 ;;
esac
