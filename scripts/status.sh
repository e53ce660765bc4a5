#!/usr/bin/env bash
# `make status`: the training unit of the inventory's CT on one screen (python -m dflash_trainer.alerts status, run
# in the CT over the inventory's connection: lxc-attach in the lab, ssh to the CT, or ssh to the Proxmox host and
# `pct exec`). TRAINER_PYTHON overrides the CT's python (default: the inventory's ct_venv_dir/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"
read -r kind a b c venv < <("$VENV/bin/python" - "$INVENTORY" <<'PY'
import json, pathlib, subprocess, sys
if not pathlib.Path(sys.argv[1]).exists():
    sys.exit(f"INVENTORY={sys.argv[1]}: no such file or directory")
proc = subprocess.run(["ansible-inventory", "-i", sys.argv[1], "--list"], capture_output=True, text=True)
if proc.returncode != 0:
    sys.exit(f"{sys.argv[1]}: ansible-inventory failed: {proc.stderr.strip()[-300:]}")
inv = json.loads(proc.stdout)
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
cmd=("${TRAINER_PYTHON:-$venv/bin/python}" -m dflash_trainer.alerts status)
case "$kind" in
  lxc) exec lxc-attach -n "$a" -- "${cmd[@]}" ;;
  pct) exec ssh -o BatchMode=yes "$c@$a" pct exec "$b" -- "${cmd[@]}" ;;
  ssh) exec ssh -o BatchMode=yes "$b@$a" "${cmd[@]}" ;;
esac
