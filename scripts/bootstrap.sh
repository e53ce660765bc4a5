#!/usr/bin/env bash
# Installs everything the project needs on a Debian 12 machine (root, python3 with pip):
# the Debian packages, then the project venv (.venv) from the pinned locks.
# A second run with nothing to do costs about a second: the venv carries a stamp of the locks it was built from.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
LOCKS=("$ROOT/requirements/tools.lock" "$ROOT/trainer/requirements.lock")
# Test-only clients installed without their dependencies (their runtime needs are in the trainer lock).
NODEPS_LOCK="$ROOT/requirements/test-clients.lock"

# lxc + python3-lxc: the lab's containers and Ansible's community.general.lxc connection.
# mmdebstrap + keyring: root filesystems for the lab and the CT image. dkms + build tools: the L1 driver build.
APT_PACKAGES=(lxc python3-lxc mmdebstrap debian-archive-keyring uidmap rsync iproute2 procps
              psmisc python3-venv build-essential dkms zstd)

die() { echo "bootstrap: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs Debian packages and manages LXC containers)"
command -v "$PYTHON" >/dev/null || die "no '$PYTHON' on PATH; install python3 first"
for lock in "${LOCKS[@]}" "$NODEPS_LOCK"; do [ -r "$lock" ] || die "missing lock file $lock"; done

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install failed for: ${missing[*]}"
fi

stamp="$VENV/.locks.sha256"
want=$(cat "${LOCKS[@]}" "$NODEPS_LOCK" "$ROOT/trainer/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "bootstrap: building $VENV from the locks (a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || die "could not create venv at $VENV"
pip_q() { "$VENV/bin/python" -m pip -q "$@" 2> >(grep -v "is ignored" >&2); }
pip_q install --upgrade pip || die "could not upgrade pip in $VENV"
# torch==2.13.0 resolves to the CPU wheel where pip's find-links offers it, to PyPI's CUDA build elsewhere.
pip_q install "${LOCKS[@]/#/--requirement=}" || die "pip could not install the locks into $VENV"
pip_q install --no-deps --requirement="$NODEPS_LOCK" || die "pip could not install $NODEPS_LOCK"
pip_q install --no-deps -e "$ROOT/trainer" || die "pip could not install the trainer package from $ROOT/trainer"
"$VENV/bin/python" -m pip check >/dev/null || die "the venv does not satisfy its locks: run '$VENV/bin/pip check'"

# community.general.lxc imports Debian's python3-lxc binding; make exactly that package visible to the venv.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for f in /usr/lib/python3/dist-packages/lxc /usr/lib/python3/dist-packages/_lxc.cpython-311-x86_64-linux-gnu.so; do
  [ -e "$f" ] || die "python3-lxc is installed but $f is missing"
  ln -sfn "$f" "$site/$(basename "$f")"
done
"$VENV/bin/python" -c 'import lxc' || die "the lxc binding does not import in $VENV"

echo "$want" > "$stamp"
echo "bootstrap: $VENV ready"
