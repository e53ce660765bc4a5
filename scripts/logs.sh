#!/usr/bin/env bash
# `make logs`: follows the dflash-train journal (every rank) in the inventory's container. UNIT=dflash-smoke for
# the smoke run; LINES=N for more history (default 100).
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"
read -r kind a b c < <("$VENV/bin/python" - "$INVENTORY" <<'PY'
import json, subprocess, sys
inv = json.loads(subprocess.run(["ansible-inventory", "-i", sys.argv[1], "--list"], capture_output=True,
                                text=True, check=True).stdout)
hosts = inv.get("training_cts", {}).get("hosts", [])
if not hosts:
    sys.exit(f"{sys.argv[1]}: no host in group training_cts")
hv = inv["_meta"]["hostvars"]; v = hv[hosts[0]]
conn = v.get("ansible_connection", "ssh")
if conn in ("community.general.lxc", "lxc"):
    print("lxc", v.get("ansible_host", hosts[0]))
elif conn == "community.proxmox.proxmox_pct_remote":
    px = v.get("ct_proxmox_host", v.get("ansible_host"))
    print("pct", hv.get(px, {}).get("ansible_host", px), v["ct_vmid"], v.get("ansible_user", "root"))
else:
    print("ssh", v.get("ansible_host", hosts[0]), v.get("ansible_user", "root"))
PY
)
cmd=(journalctl -f -n "${LINES:-100}" -u "${UNIT:-dflash-train}" --no-hostname -o short-iso)
case "$kind" in
  lxc) exec lxc-attach -n "$a" -- "${cmd[@]}" ;;
  pct) exec ssh -o BatchMode=yes -t "$c@$a" pct exec "$b" -- "${cmd[@]}" ;;
  ssh) exec ssh -o BatchMode=yes -t "$b@$a" "${cmd[@]}" ;;
esac
