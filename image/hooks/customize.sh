#!/usr/bin/env bash
# mmdebstrap --customize-hook for the CT image: runs on the build machine with $1 = the image's root directory,
# after apt installed the Debian packages. Its inputs come from image/build.sh through IMAGE_* variables.
#   1. the installed Debian set must equal image/packages.txt (pins drift when the mirror moves on);
#   2. the trainer venv at /opt/dflash/venv from the lock, offline, from the build's wheelhouse, every file checked
#      against the lock's sha256 (--require-hashes); the trainer wheel likewise, by its build's hash lock;
#   3. the units of the CT's services (image/units.yml renders them from the roles) and the tools they run;
#   4. /etc/dflash/image.json; files that differ between build machines are removed.
# shellcheck disable=SC2016  # hook strings and dpkg-query formats are expanded later, by design
set -euo pipefail

ROOT=${1:?usage: customize.sh ROOTDIR}
: "${IMAGE_TRAINER_VERSION:?}" "${IMAGE_WHEELHOUSE:?}" "${IMAGE_LOCK:?}" "${IMAGE_PINS:?}" "${IMAGE_TRAINER_WHEEL_PATH:?}" "${IMAGE_REPO:?}"
: "${IMAGE_UNITS_DIR:?}" "${IMAGE_TRAINER_WHEEL_LOCK:?}"
STAGE=/tmp/dflash-build  # inside the chroot; mmdebstrap empties /tmp at the end
# The L3 role's layout (roles/ct_environment/tasks/venv.yml): one venv per lock under venvs/, stamped complete
# with the lock's sha256, and the stable path a link to it. The role then finds this venv complete and keeps it.
: "${IMAGE_LOCK_SHA256:?}"
VENV=/opt/dflash/venvs/${IMAGE_LOCK_SHA256:0:16}
VENV_LINK=/opt/dflash/venv

die() { echo "customize: $*" >&2; exit 1; }

in_chroot() {  # a clean environment: the build machine's pip settings (find-links, constraints) stay outside
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE= "$@"
}

check_pins() {
  local want got
  want=$(grep -v '^#' "$IMAGE_PINS" | grep -v '^$' | LC_ALL=C sort)
  got=$(in_chroot dpkg-query -W -f '${db:Status-Status} ${Package}=${Version}\n' \
        | awk '$1 == "installed" {print $2}' | LC_ALL=C sort)
  if [ "$want" != "$got" ]; then
    echo "customize: the installed Debian packages differ from image/packages.txt (< pinned, > installed):" >&2
    diff <(echo "$want") <(echo "$got") | grep '^[<>]' | head -20 >&2 || true
    die "the mirror no longer serves these pins, or packages.in changed: run 'image/build.sh --refresh-pins' and review"
  fi
}

unmount_wheels() { mountpoint -q "$ROOT$STAGE/wheels" && umount "$ROOT$STAGE/wheels"; return 0; }

install_venv() {
  mkdir -p "$ROOT$STAGE/wheels"
  cp "$IMAGE_LOCK" "$ROOT$STAGE/requirements.lock"
  mkdir -p "$ROOT$STAGE/trainer-wheel"
  cp "$IMAGE_TRAINER_WHEEL_PATH" "$IMAGE_TRAINER_WHEEL_LOCK" "$ROOT$STAGE/trainer-wheel/"
  cp "$IMAGE_REPO/image/manifest.py" "$ROOT$STAGE/manifest.py"
  # Read-only bind mount: nothing the chroot does (or a failed cleanup) can touch the warm wheelhouse.
  mount --bind "$IMAGE_WHEELHOUSE" "$ROOT$STAGE/wheels"
  mount -o remount,bind,ro "$ROOT$STAGE/wheels"
  trap unmount_wheels EXIT
  in_chroot python3 -m venv "$VENV"
  # --require-hashes: a wheel in the wheelhouse that matches none of its pin's sha256 is refused.
  # --no-compile, then compileall below: pip's bytecode records each source's mtime, which the tarball then
  # clamps to SOURCE_DATE_EPOCH, so every .pyc of the image would be stale and each first import in CT 200
  # would compile again. Hash-checked bytecode stays valid, and compiles on both cores.
  in_chroot "$VENV/bin/python" -m pip install -q --no-compile --no-index --find-links "$STAGE/wheels" --require-hashes \
    --requirement "$STAGE/requirements.lock" || die "pip could not install the lock from the wheelhouse"
  # The wheel of the build's hash lock (pack_trainer.py), and only it: no index, no dependencies, its sha256.
  in_chroot "$VENV/bin/python" -m pip install -q --no-compile --no-index --no-deps --require-hashes \
    --find-links "$STAGE/trainer-wheel" --requirement "$STAGE/trainer-wheel/trainer-wheel.lock" \
    || die "pip could not install the trainer wheel of $(basename "$IMAGE_TRAINER_WHEEL_LOCK")"
  in_chroot "$VENV/bin/python" -m pip check >&2 || die "the venv's dependencies are inconsistent (pip check)"
  # Its exit status is 1 whenever one file does not compile, and some wheels ship such files on purpose
  # (torch's py312_intrinsics.py on 3.11; pip skips them too). L3's verify checks the bytecode is there and
  # current (tests/verify/test_l3_environment.py).
  in_chroot "$VENV/bin/python" -m compileall -q -j 0 --invalidation-mode checked-hash "$VENV/lib" >/dev/null || true
  unmount_wheels
  trap - EXIT
  echo "$IMAGE_LOCK_SHA256" >"$ROOT$VENV/.dflash-lock.sha256"
  # L3's stamp of the installed trainer build: the role's build of the same sources has the same sha256.
  sha256sum "$IMAGE_TRAINER_WHEEL_PATH" | cut -d' ' -f1 >"$ROOT$VENV/.dflash-trainer.sha256"
  ln -sfn "$VENV" "$ROOT$VENV_LINK"
  ln -sfn "$VENV_LINK/bin/dflash-train" "$ROOT/usr/local/bin/dflash-train"
}

install_units() {  # vendor units, not enabled: the L4/L5 roles write the deployment's own to /etc and enable them
  local unit tool names=()
  for unit in "$IMAGE_UNITS_DIR"/systemd/*; do
    [ -f "$unit" ] || continue
    install -D -m 0644 "$unit" "$ROOT/usr/lib/systemd/system/$(basename "$unit")"
    names+=("$(basename "$unit")")
  done
  for tool in "$IMAGE_UNITS_DIR"/sbin/*; do
    [ -f "$tool" ] || continue
    install -D -m 0755 "$tool" "$ROOT/usr/local/sbin/$(basename "$tool")"
  done
  [ ${#names[@]} -gt 0 ] || die "no unit files in $IMAGE_UNITS_DIR/systemd (image/units.yml rendered none)"
  IMAGE_UNITS="${names[*]}"
  export IMAGE_UNITS
  echo "customize: units installed: $IMAGE_UNITS" >&2
}

write_manifest() {
  in_chroot IMAGE_NAME="$IMAGE_NAME" IMAGE_VARIANT="$IMAGE_VARIANT" IMAGE_VERSION="$IMAGE_VERSION" \
    IMAGE_COMMIT="$IMAGE_COMMIT" SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" IMAGE_SUITE="$IMAGE_SUITE" \
    IMAGE_LOCK_SHA256="$IMAGE_LOCK_SHA256" IMAGE_PINS_SHA256="$IMAGE_PINS_SHA256" \
    IMAGE_TRAINER_VERSION="$IMAGE_TRAINER_VERSION" IMAGE_TRAINER_WHEEL="$(basename "$IMAGE_TRAINER_WHEEL_PATH")" \
    IMAGE_UNITS="$IMAGE_UNITS" python3 "$STAGE/manifest.py" /etc/dflash/image.json
  cp "$ROOT/etc/dflash/image.json" "$IMAGE_MANIFEST_OUT"
}

make_reproducible() {
  # Proxmox (and lab/image.py) write these per container; the build machine's copies must not leak in.
  rm -f "$ROOT/etc/resolv.conf"
  echo localhost > "$ROOT/etc/hostname"
}

step() {  # step NAME: one line per step with its duration, in the build log
  local t0=$SECONDS
  "$1"
  echo "customize: $1 $((SECONDS - t0))s" >&2
}

step check_pins
step install_venv
step install_units
step write_manifest
step make_reproducible
