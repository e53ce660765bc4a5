#!/usr/bin/env bash
# `make tensorboard`: the training curves of the inventory's CT in a browser at http://127.0.0.1:${PORT:-6006}/.
# The directory is train.toml's [trackers] tensorboard. In the lab, .venv-trainer's tensorboard on this machine
# reads it through the lab CT's root filesystem (the lab CT image has no /etc/hosts, and tensorboard resolves
# "localhost"). A CT reached over ssh runs its own (the trainer environment's) on its loopback, through `ssh -L`. A CT reached through `pct exec` on its host has no port of its own on
# the host: the script says the one command to run instead. TRAINER_PYTHON overrides the CT's python.
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
PORT=${PORT:-6006}
export PATH="$VENV/bin:$PATH"
read -r kind a b c venv < <("$VENV/bin/python" - "$INVENTORY" <<'PY'
import json, pathlib, subprocess, sys
if not pathlib.Path(sys.argv[1]).exists():
    sys.exit(f"INVENTORY={sys.argv[1]}: no such file or directory")
inv = json.loads(subprocess.run(["ansible-inventory", "-i", sys.argv[1], "--list"], capture_output=True,
                                text=True, check=True).stdout)
hosts = inv.get("training_cts", {}).get("hosts", [])
if not hosts:
    sys.exit(f"{sys.argv[1]}: no host in group training_cts")
hv = inv["_meta"]["hostvars"]; v = hv[hosts[0]]
venv = v.get("ct_venv_dir", "/opt/dflash/venv")
conn = v.get("ansible_connection", "ssh")
if conn in ("community.general.lxc", "lxc"):
    print("lxc", v.get("ansible_host", hosts[0]), "-", "-", venv)
elif conn == "community.proxmox.proxmox_pct_remote":
    px = v.get("ct_proxmox_host", v.get("ansible_host"))
    print("pct", hv.get(px, {}).get("ansible_host", px), v["ct_vmid"], v.get("ansible_user", "root"), venv)
else:
    print("ssh", v.get("ansible_host", hosts[0]), v.get("ansible_user", "root"), "-", venv)
PY
)
py=${TRAINER_PYTHON:-$venv/bin/python}
# The log directory from the CT's train.toml; tensorboard as the module of the trainer environment.
inner="d=\$($py -c 'import tomllib; print(tomllib.load(open(\"/etc/dflash/train.toml\", \"rb\")).get(\"trackers\", {}).get(\"tensorboard\") or \"\")') && [ -n \"\$d\" ] || { echo 'train.toml has no [trackers] tensorboard directory' >&2; exit 1; }; exec $py -m tensorboard.main --logdir \"\$d\" --host 127.0.0.1 --port $PORT"
echo "tensorboard: http://127.0.0.1:$PORT/ (Ctrl-C stops it)"
case "$kind" in
  lxc)
    rootfs=/var/lib/lxc/$a/rootfs
    dir=$(.venv-trainer/bin/python -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb")).get("trackers", {}).get("tensorboard") or "")' "$rootfs/etc/dflash/train.toml")
    [ -n "$dir" ] || { echo "$rootfs/etc/dflash/train.toml has no [trackers] tensorboard directory" >&2; exit 1; }
    exec .venv-trainer/bin/tensorboard --logdir "$rootfs$dir" --host 127.0.0.1 --port "$PORT" ;;
  ssh) exec ssh -o BatchMode=yes -o ExitOnForwardFailure=yes -L "$PORT:127.0.0.1:$PORT" "$b@$a" "$inner" ;;
  pct)
    echo "CT $b is reached through pct exec on $a: its loopback is not the host's. Run tensorboard on the CT's" \
      "address (the PVE firewall must allow it from your machine) or copy the directory:" >&2
    echo "  ssh $c@$a pct exec $b -- $py -m tensorboard.main --logdir DIR --host CT_ADDRESS --port $PORT" >&2
    exit 2 ;;
esac
