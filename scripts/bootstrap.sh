#!/usr/bin/env bash
# Installs everything the project needs on a Debian 12 machine (root, python3 with pip):
# the Debian packages, then the project venv (.venv) from the pinned locks.
# A second run with nothing to do costs about a second: the venv carries a stamp of the locks it was built from.
# Every lock carries the sha256 of each file it may install and is installed with --require-hashes (pip refuses a
# file that matches none, and any package the lock does not pin); scripts/lock.sh writes them.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TRAINER_VENV=${TRAINER_VENV:-$ROOT/.venv-trainer}
# Two environments, as on a real deployment: the operator's tooling (.venv: ansible, molecule, testinfra, awscli)
# and exactly what CT 200 runs (.venv-trainer: trainer/requirements.lock, plus pytest and test-only clients).
TOOLS_LOCK="$ROOT/requirements/tools.lock"
# A GPU machine installs the CUDA lock (PyPI's torch and the CUDA libraries it needs):
#   TRAINER_LOCK=trainer/requirements-cuda.lock make bootstrap
TRAINER_LOCK=${TRAINER_LOCK:-$ROOT/trainer/requirements.lock}
TRAINER_TEST_LOCK="$ROOT/requirements/trainer-test.lock"
# Test-only clients installed without their dependencies (their runtime needs are in the trainer lock).
NODEPS_LOCK="$ROOT/requirements/test-clients.lock"
PIP_LOCK="$ROOT/requirements/pip.lock"  # the pip each venv is upgraded to first
# The Ansible collections the roles use; they come with the tools lock's ansible package, checked, not installed.
COLLECTIONS="$ROOT/ansible/requirements.yml"

# lxc + python3-lxc: the lab's containers and Ansible's community.general.lxc connection.
# mmdebstrap + keyring: root filesystems for the lab and the CT image. dkms + build tools: the L1 driver build.
# libfuse3-3: the lab's NFS stand-in for shared storage (lab/nfs_standin.py, through mfusepy).
APT_PACKAGES=(lxc python3-lxc mmdebstrap debian-archive-keyring uidmap rsync iproute2 procps
              psmisc python3-venv build-essential dkms zstd libfuse3-3)

die() { echo "bootstrap: $*" >&2; exit 1; }
beat() {  # beat WHAT CMD...: runs CMD; while it runs, a line every 10 s says so (a fresh machine: minutes)
  local what=$1 pid t=0; shift
  "$@" & pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1; t=$((t + 1))
    if [ $((t % 10)) = 0 ] && kill -0 "$pid" 2>/dev/null; then echo "bootstrap: $what: still running (${t} s)"; fi
  done
  wait "$pid"
}

[ "$(id -u)" = 0 ] || die "must run as root (it installs Debian packages and manages LXC containers)"
command -v "$PYTHON" >/dev/null || die "no '$PYTHON' on PATH; install python3 first"
for lock in "$TOOLS_LOCK" "$TRAINER_LOCK" "$TRAINER_TEST_LOCK" "$NODEPS_LOCK" "$PIP_LOCK" "$COLLECTIONS"; do [ -r "$lock" ] || die "missing input file $lock"; done

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  apt-get update -qq || die "apt-get update failed"
  beat "apt-get install" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install failed for: ${missing[*]}"
fi

venv_current() {  # venv_current DIR FILES...: true when DIR was built from exactly these files
  local dir=$1; shift
  [ -x "$dir/bin/python" ] && [ -f "$dir/.locks.sha256" ] &&
    [ "$(cat "$dir/.locks.sha256")" = "$(cat "$@" "$0" | sha256sum | cut -d' ' -f1)" ]
}
stamp_venv() { local dir=$1; shift; cat "$@" "$0" | sha256sum | cut -d' ' -f1 > "$dir/.locks.sha256"; }
# --no-compile: pip byte-compiles every installed file, serially; on 2 cores that was 64 of the tools venv's
# 85 s (and as much again for the trainer's). Python compiles what is imported, once, instead: the Makefile
# lets it write that bytecode even where PYTHONDONTWRITEBYTECODE is set.
pip_q() {  # pip_q VENV ARGS...: quiet pip that keeps its exit status and drops the find-links noise
  local venv=$1; shift
  "$venv/bin/python" -m pip -q "$@" 2> >(grep -v "is ignored" >&2)
}
pip_install() { local venv=$1; shift; pip_q "$venv" install --no-compile "$@"; }
new_venv() {
  echo "bootstrap: building $1 (a few minutes the first time)"
  [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1" || die "could not create venv at $1"
  pip_q "$1" install --require-hashes --requirement="$PIP_LOCK" || die "could not install $PIP_LOCK into $1"
}

build_tools_venv() {  # the operator's tooling: ansible, molecule, testinfra, awscli
  if ! venv_current "$VENV" "$TOOLS_LOCK" "$PIP_LOCK" "$COLLECTIONS"; then
    new_venv "$VENV"
    beat "pip install $TOOLS_LOCK" pip_install "$VENV" --require-hashes --requirement="$TOOLS_LOCK" \
      || die "pip could not install $TOOLS_LOCK into $VENV"
    "$VENV/bin/python" -m pip check >/dev/null || die "$VENV does not satisfy $TOOLS_LOCK: run '$VENV/bin/pip check'"
    # community.general.lxc imports Debian's python3-lxc binding; make exactly that package visible to the venv.
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for f in /usr/lib/python3/dist-packages/lxc /usr/lib/python3/dist-packages/_lxc.cpython-311-x86_64-linux-gnu.so; do
      [ -e "$f" ] || die "python3-lxc is installed but $f is missing"
      ln -sfn "$f" "$site/$(basename "$f")"
    done
    "$VENV/bin/python" -c 'import lxc' || die "the lxc binding does not import in $VENV"
    # Its own line names each collection that is missing or at another version than requirements.yml says.
    ANSIBLE_CONFIG="$ROOT/ansible/ansible.cfg" "$VENV/bin/python" "$ROOT/scripts/check_collections.py" "$COLLECTIONS" \
      || die "the Ansible collections in $VENV do not satisfy $COLLECTIONS (the lines above name them)"
    stamp_venv "$VENV" "$TOOLS_LOCK" "$PIP_LOCK" "$COLLECTIONS"
    echo "bootstrap: $VENV ready"
  fi
}

trainer_inputs=("$TRAINER_LOCK" "$TRAINER_TEST_LOCK" "$NODEPS_LOCK" "$PIP_LOCK" "$ROOT/trainer/pyproject.toml")
build_trainer_venv() {  # exactly what CT 200 runs, plus the test clients
  if ! venv_current "$TRAINER_VENV" "${trainer_inputs[@]}"; then
    new_venv "$TRAINER_VENV"
    # torch==2.13.0: the CPU wheel of pip's find-links, the one build whose hash the cpu lock carries.
    beat "pip install $TRAINER_LOCK" pip_install "$TRAINER_VENV" --require-hashes \
      --requirement="$TRAINER_LOCK" --requirement="$TRAINER_TEST_LOCK" \
      || die "pip could not install $TRAINER_LOCK into $TRAINER_VENV"
    pip_install "$TRAINER_VENV" --require-hashes --no-deps --requirement="$NODEPS_LOCK" \
      || die "pip could not install $NODEPS_LOCK"
    # The trainer itself from this tree, editable (the tests run the tree; tests/l5_service reads its .pth), so it
    # has no file to hash: built offline by the setuptools the trainer lock just installed with its hash, with no
    # build isolation (which would fetch an unchecked setuptools). L3 and the image install a hashed wheel.
    pip_q "$TRAINER_VENV" install --no-deps --no-index --no-build-isolation -e "$ROOT/trainer" \
      || die "pip could not install the trainer from $ROOT/trainer"
    stamp_venv "$TRAINER_VENV" "${trainer_inputs[@]}"
    echo "bootstrap: $TRAINER_VENV ready"
  fi
}

# The two venvs are independent: built side by side (on a fresh machine each pip install takes about a minute).
build_tools_venv & tools_pid=$!
build_trainer_venv & trainer_pid=$!
wait "$tools_pid" || die "building $VENV failed (the lines above say why)"
wait "$trainer_pid" || die "building $TRAINER_VENV failed (the lines above say why)"
