#!/usr/bin/env bash
# `make smoke-train`: the 100-step warmup of the real configuration as the transient unit dflash-smoke in the
# inventory's container (INVENTORY, default inventory/lab), its journal streamed here, ending in PASS or FAIL.
# Builds what is missing first: the lab (lab inventory), then layers L3-L5 when dflash-smoke is not installed
# (PROVISION=1 forces it). Reaches the container with lxc-attach in the lab, with ssh + pct exec on a real host.
# When the first CT of training_cts is one node of a multi-node job (the group training_job), the smoke run is the
# job's: dflash-smoke prepares on the first CT, runs on every CT of the job at once (their journals here, each
# line led by its CT), and the report on the first CT checks every node's ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
# The clock of the summary's "time to first step": from when `make smoke-train` was typed (the Makefile passes
# it, before bootstrap), else from here.
T0=${DFLASH_SMOKE_T0:-$(date +%s.%N)}
INVENTORY=${INVENTORY:-inventory/lab}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH" ANSIBLE_CONFIG=${ANSIBLE_CONFIG:-$PWD/ansible/ansible.cfg}

# The CTs to run on, one line each: "lxc NAME INVENTORY_NAME", "pct PROXMOX_ADDRESS VMID USER INVENTORY_NAME" or
# "ssh ADDRESS USER INVENTORY_NAME": the first host of training_cts, or every CT of its job.
targets=$("$VENV/bin/python" - "$INVENTORY" <<'PY'
import json, subprocess, sys
inv = json.loads(subprocess.run(["ansible-inventory", "-i", sys.argv[1], "--list"], capture_output=True,
                                text=True, check=True).stdout)
hosts = inv.get("training_cts", {}).get("hosts", [])
if not hosts:
    sys.exit(f"{sys.argv[1]}: no host in group training_cts")
job = inv.get("training_job", {}).get("hosts", [])
hv = inv["_meta"]["hostvars"]
for name in (job if hosts[0] in job else hosts[:1]):
    v = hv[name]
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
mapfile -t cts <<<"$targets"
on() {  # on "TARGET LINE" CMD...: run a command inside that container, output streamed
  local kind a b c
  read -r kind a b c _ <<<"$1"
  shift
  case "$kind" in
    lxc) lxc-attach -n "$a" -- "$@" ;;
    pct) ssh -o BatchMode=yes -t "$c@$a" pct exec "$b" -- "$@" ;;
    ssh) ssh -o BatchMode=yes -t "$b@$a" "$@" ;;
  esac
}
name_of() { awk '{print $NF}' <<<"$1"; }
ct() { on "${cts[0]}" "$@"; }
kind=$(awk '{print $1}' <<<"${cts[0]}")
host=$(name_of "${cts[0]}")

if [ "$kind" = lxc ]; then
  # Its progress streams here (minutes on a fresh machine: the CT image, the seed), nothing hides in a file.
  echo "smoke-train: make lab (builds or repairs the lab; seconds when it is up)"
  if ! make --no-print-directory lab LAB_INVENTORY="$INVENTORY"; then
    ct true 2>/dev/null || { echo "smoke-train: the lab is not up (make lab failed above)"; echo FAIL; exit 1; }
    # A lab that stopped halfway may answer and still lack what provisioning reads (its secrets, the seed's
    # digests): `lab status` names each part that is down, instead of Ansible's "file not found" later.
    if report=$("$VENV/bin/python" -m lab status --inventory "$INVENTORY"); then
      echo "smoke-train: warning: make lab reported the problem above, but $host answers and lab status is all up; going on"
    else
      echo "smoke-train: make lab failed above and left these parts of the lab down (lab status):"
      grep -E "^.{22} DOWN" <<<"$report" | sed 's/^/  /'
      echo "smoke-train: fix the cause make lab names above, then run make lab (it repairs what is missing)"
      echo FAIL
      exit 1
    fi
  fi
fi
missing=
for t in "${cts[@]}"; do on "$t" test -x /usr/local/sbin/dflash-smoke 2>/dev/null || missing+=" $(name_of "$t")"; done
if [ "${PROVISION:-0}" = 1 ] || [ -n "$missing" ]; then
  echo "smoke-train: layer L5 is not installed in${missing:- the CTs (PROVISION=1)}; provisioning L3, L4, L5 first"
  make --no-print-directory provision INVENTORY="$INVENTORY" TAGS=l3,l4,l5
fi
smoke_env=(env DFLASH_SMOKE_T0="$T0" DFLASH_SMOKE_KEEP="${DFLASH_SMOKE_KEEP:-0}")
if [ "${#cts[@]}" -eq 1 ]; then
  echo "smoke-train: dflash-smoke in $host ($kind)"
  ct "${smoke_env[@]}" /usr/local/sbin/dflash-smoke
  exit
fi

# One job on several CTs: one run id names the shared work directory on every CT.
smoke_env+=(DFLASH_SMOKE_RUN="$(date +%Y%m%d-%H%M%S)-$$")
echo "smoke-train: job of ${#cts[@]} CTs ($(for t in "${cts[@]}"; do name_of "$t"; done | paste -sd' ')); prepare on $host"
ct "${smoke_env[@]}" /usr/local/sbin/dflash-smoke prepare || { echo FAIL; exit 1; }
pids=()
for t in "${cts[@]}"; do
  n=$(name_of "$t")
  on "$t" "${smoke_env[@]}" /usr/local/sbin/dflash-smoke run 2>&1 | sed -u "s/^/[$n] /" &
  pids+=($!)
done
failed=
for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed+=" $(name_of "${cts[$i]}")"; done
ct "${smoke_env[@]}" /usr/local/sbin/dflash-smoke report
rc=$?
if [ -n "$failed" ]; then echo "smoke-train: dflash-smoke run failed on$failed (its lines above)"; echo FAIL; exit 1; fi
exit "$rc"
