#!/usr/bin/env bash
# `make smoke-train`: the 100-step warmup of the real configuration as the transient unit dflash-smoke in the
# inventory's container (INVENTORY, default inventory/lab), its journal streamed here, ending in PASS or FAIL.
# Builds what is missing first: the lab (lab inventory), then layers L3-L5 when dflash-smoke is not installed
# (PROVISION=1 forces it). Reaches the container with lxc-attach in the lab, with ssh + pct exec on a real host.
set -euo pipefail
cd "$(dirname "$0")/.."
# The clock of the summary's "time to first step": from when `make smoke-train` was typed (the Makefile passes
# it, before bootstrap), else from here.
T0=${DFLASH_SMOKE_T0:-$(date +%s.%N)}
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH" ANSIBLE_CONFIG=${ANSIBLE_CONFIG:-$PWD/ansible/ansible.cfg}

# The first host of training_cts and how to reach it: "lxc NAME" or "pct PROXMOX_ADDRESS VMID USER".
target=$("$VENV/bin/python" - "$INVENTORY" <<'PY'
import json, subprocess, sys
inv = json.loads(subprocess.run(["ansible-inventory", "-i", sys.argv[1], "--list"], capture_output=True,
                                text=True, check=True).stdout)
hosts = inv.get("training_cts", {}).get("hosts", [])
if not hosts:
    sys.exit(f"{sys.argv[1]}: no host in group training_cts")
hv = inv["_meta"]["hostvars"]; name = hosts[0]; v = hv[name]
conn = v.get("ansible_connection", "ssh")
if conn in ("community.general.lxc", "lxc"):
    print("lxc", v.get("ansible_host", name), name)
elif conn == "community.proxmox.proxmox_pct_remote":
    px = v.get("ct_proxmox_host", v.get("ansible_host"))
    print("pct", hv.get(px, {}).get("ansible_host", px), v["ct_vmid"], v.get("ansible_user", "root"), name)
else:
    print("ssh", v.get("ansible_host", name), v.get("ansible_user", "root"), name)
PY
)
read -r kind a b c d <<<"$target"
ct() {  # ct CMD...: run a command inside the container, output streamed
  case "$kind" in
    lxc) lxc-attach -n "$a" -- "$@" ;;
    pct) ssh -o BatchMode=yes -t "$c@$a" pct exec "$b" -- "$@" ;;
    ssh) ssh -o BatchMode=yes -t "$b@$a" "$@" ;;
  esac
}
host=${d:-${c:-$b}}

if [ "$INVENTORY" = inventory/lab ] || [ "$kind" = lxc ]; then
  # Its progress streams here (minutes on a fresh machine: the CT image, the seed), nothing hides in a file.
  echo "smoke-train: make lab (builds or repairs the lab; seconds when it is up)"
  if ! make --no-print-directory lab; then
    ct true 2>/dev/null || { echo "smoke-train: the lab is not up (make lab failed above)"; echo FAIL; exit 1; }
    echo "smoke-train: warning: make lab reported the problem above, but $a answers; going on"
  fi
fi
if [ "${PROVISION:-0}" = 1 ] || ! ct test -x /usr/local/sbin/dflash-smoke 2>/dev/null; then
  echo "smoke-train: layer L5 is not installed in $host; provisioning L3, L4, L5 first"
  make --no-print-directory provision INVENTORY="$INVENTORY" TAGS=l3,l4,l5
fi
echo "smoke-train: dflash-smoke in $host ($kind)"
ct env DFLASH_SMOKE_T0="$T0" DFLASH_SMOKE_KEEP="${DFLASH_SMOKE_KEEP:-0}" /usr/local/sbin/dflash-smoke
