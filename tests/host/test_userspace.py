"""L1 on a host that gets the NVIDIA userspace in the same run: nvidia-modprobe and nvidia-persistenced must
be installed before the device-node and persistence units start, or their ConditionPathExists skips them
silently and persistence stays off. A stand-in for the .run installer (it installs two tiny programs under
the real names, and refuses to run without --no-kernel-modules) plays the userspace; lab-host's systemd runs
the units."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from tests.host.conftest import HOST, attach, playbook

RUNFILE = "/root/lab-nvidia-userspace.run"
FAKE_RUN = b"""#!/bin/sh
# Stand-in for NVIDIA-Linux-x86_64-VERSION.run (tests/host/test_userspace.py).
case " $* " in
  *" --no-kernel-modules "*) ;;
  *) echo "would install kernel modules: refused" >&2; exit 1 ;;
esac
printf '#!/bin/sh\\nexit 0\\n' > /usr/bin/nvidia-modprobe
printf '#!/bin/sh\\n( exec sleep infinity ) </dev/null >/dev/null 2>&1 &\\nexit 0\\n' \\
  > /usr/bin/nvidia-persistenced
chmod 0755 /usr/bin/nvidia-modprobe /usr/bin/nvidia-persistenced
"""
CLEAN = (
    "systemctl stop nvidia-persistenced.service nvidia-device-nodes.service 2>/dev/null;"
    " rm -f /usr/bin/nvidia-modprobe /usr/bin/nvidia-persistenced /var/lib/dflash/nvidia-userspace-version"
    f" {RUNFILE} /var/cache/dflash/nvidia/NVIDIA-Linux-x86_64-*.run; true"
)


def active(unit: str) -> str:
    return attach("systemctl", "is-active", unit).stdout.strip()


@pytest.mark.slow  # the whole L1 play (a DKMS compile when the lab host has none yet)
def test_units_start_with_the_userspace_installed_in_the_same_run(lab_host):
    attach("sh", "-c", CLEAN)
    put = subprocess.run(
        ["lxc-attach", "-n", HOST, "--", "sh", "-c", f"cat > {RUNFILE}"], input=FAKE_RUN, check=False
    )
    assert put.returncode == 0
    extra = {
        "host_gpu_count": 1,
        "nvidia_driver_userspace_method": "runfile",
        "nvidia_driver_userspace_url": f"file://{RUNFILE}",
        "nvidia_driver_userspace_sha256": hashlib.sha256(FAKE_RUN).hexdigest(),
    }
    try:
        proc = playbook("ansible/l1_driver.yml", "-e", json.dumps(extra))
        assert proc.returncode == 0, proc.stdout[-3000:]
        states = {u: active(u) for u in ("nvidia-device-nodes.service", "nvidia-persistenced.service")}
    finally:
        attach("sh", "-c", CLEAN)
    want = {"nvidia-device-nodes.service": "active", "nvidia-persistenced.service": "active"}
    assert states == want, states
