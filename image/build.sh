#!/usr/bin/env bash
# Builds the CT template that CT 200 is created from (see docs/image.md):
#   image/build.sh [cpu|cuda]          build build/image/debian-12-dflash-VARIANT_VERSION_amd64.tar.zst
#   image/build.sh --print [cpu|cuda]  print the archive's path, file name and volid without building
#   image/build.sh --refresh-pins      re-resolve image/packages.in into image/packages.txt (review the diff)
#   image/build.sh --prune [cpu|cuda]  remove all but the newest IMAGE_KEEP (2) archives of a variant (a build
#                                      does this after publishing)
# One line per phase with its duration; the details go to build/image/VARIANT.log.
# Overrides (tests, other machines): IMAGE_OUT_DIR, IMAGE_CACHE, IMAGE_LOCK, IMAGE_PACKAGES_IN, IMAGE_PINS,
# IMAGE_STORAGE, IMAGE_ZSTD_LEVEL, IMAGE_MIN_FREE_GB, IMAGE_MIRROR, IMAGE_SECURITY_MIRROR, IMAGE_KEEP.
# shellcheck disable=SC2016  # hook strings and dpkg-query formats are expanded later, by design
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SUITE=bookworm
DEBIAN_RELEASE=12
ARCH=amd64
MIRROR=${IMAGE_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${IMAGE_SECURITY_MIRROR:-http://security.debian.org/debian-security}
OUT_DIR=${IMAGE_OUT_DIR:-$REPO/build/image}
CACHE=${IMAGE_CACHE:-/var/cache/dflash-image}
LOCK_OVERRIDE=${IMAGE_LOCK:-}  # the variant's lock otherwise: requirements.lock (cpu), requirements-cuda.lock
LOCK=""
PACKAGES_IN=${IMAGE_PACKAGES_IN:-$REPO/image/packages.in}
PINS=${IMAGE_PINS:-$REPO/image/packages.txt}
STORAGE=${IMAGE_STORAGE:-local}
PY=/usr/bin/python3   # Debian's, the image's Python: not whatever python3 comes first on PATH
ANSIBLE_PLAYBOOK=$REPO/.venv/bin/ansible-playbook  # renders the units from the roles' templates (make bootstrap)
TOOLS_PY=$REPO/.venv/bin/python  # builds the trainer wheel with the setuptools of requirements/tools.lock
ZSTD_LEVEL=${IMAGE_ZSTD_LEVEL:-3}  # -9 took 9 of 17 minutes on a loaded machine for 8% less
KEEP=${IMAGE_KEEP:-2}  # archives of each variant left in OUT_DIR (one per commit built: 0.7 GB cpu, 2.8 GB cuda)
BUDGET_S=600          # a cpu build with warm caches on 2 cores
BUDGET_MB=2048        # the cpu archive

TMP=""
PARTIAL=""
LOG=/dev/null
STARTED=$SECONDS

say() { echo "image: $*"; }
die() { echo "image: $*" >&2; exit 1; }

usage() { awk 'NR > 1 && /^#/ { if (!/shellcheck/) { sub(/^# ?/, ""); print }; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }

# --- names ---------------------------------------------------------------------------------------------------

trainer_version() {
  "$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$REPO/trainer/pyproject.toml"
}

# Read once: others may commit while a build runs, and the name, the manifest and the epoch must agree.
COMMIT=$(git -C "$REPO" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
SOURCE_DATE_EPOCH=$(git -C "$REPO" log -1 --format=%ct "$COMMIT" 2>/dev/null || date +%s)
commit() { echo "$COMMIT"; }

# The inputs that end up in the image; a change not committed yet marks the version (".dirty").
dirty() {
  [ -n "$(git -C "$REPO" status --porcelain -- image trainer/pyproject.toml trainer/requirements.lock \
          trainer/requirements-cuda.lock trainer/src ':(glob)roles/*/files/**' ':(glob)roles/*/templates/**' \
          ':(glob)roles/*/defaults/**' 2>/dev/null)" ]
}

image_version() { local v; v="$(trainer_version)-g$(commit)"; if dirty; then v="$v.dirty"; fi; echo "$v"; }

image_name() {  # Proxmox's template naming: OS-RELEASE-NAME_VERSION_ARCH.tar.zst (no "_" inside a field)
  echo "debian-$DEBIAN_RELEASE-dflash-$1_$(image_version)_$ARCH.tar.zst"
}

print_names() {
  local variant=$1 name
  name=$(image_name "$variant")
  echo "path=$OUT_DIR/$name"
  echo "name=$name"
  echo "volid=$STORAGE:vztmpl/$name"
}

# --- plumbing ------------------------------------------------------------------------------------------------

cleanup() {
  local rc=$?
  if [ -n "$TMP" ] && [ -d "$TMP" ]; then
    # Anything still mounted below TMP (an interrupted mmdebstrap or hook) is unmounted before the removal,
    # and the removal never crosses into another file system.
    awk -v d="$TMP" '$5 ~ "^"d {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
      umount -l "$m" || true
    done
    rm -rf --one-file-system "$TMP"
  fi
  if [ -n "$PARTIAL" ] && [ -e "$PARTIAL" ]; then rm -f "$PARTIAL"; fi
  if [ $rc -ne 0 ]; then echo "image: failed after $((SECONDS - STARTED)) s; log: $LOG" >&2; fi
}

cause() {  # the lines of a failed phase that say why; the last lines of the log otherwise
  local why
  why=$(grep -E '^(image|customize): |^E: |^ERROR: |No space left' "$LOG" | grep -v '^E: mmdebstrap failed' \
        | tail -n 4 || true)
  if [ -z "$why" ]; then why=$(tail -n 4 "$LOG"); fi
  echo "$why"
}

phase() {  # phase NAME FUNCTION...: run in a subshell with errexit, output to the log, one line on the console
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "=== $name" >>"$LOG"
  set +e
  ( set -e; "$@" ) >>"$LOG" 2>&1
  rc=$?
  set -e
  if [ $rc -ne 0 ]; then
    printf 'image: %-9s FAILED after %ds:\n' "$name" $((SECONDS - t0)) >&2
    cause | sed 's/^/  /' >&2
    exit $rc
  fi
  printf 'image: %-9s %4ds\n' "$name" $((SECONDS - t0))
}

free_gb() { df -P --block-size=1G "$1" | awk 'NR==2 {print $4}'; }

check_space() {  # check_space VARIANT: before anything is written
  local need=$1 dir free
  for dir in "$OUT_DIR" "$CACHE"; do
    free=$(free_gb "$dir")
    [ "$free" -ge "$need" ] || die "not enough free space for a $VARIANT build: $free GiB free on \
$(df -P "$dir" | awk 'NR==2 {print $6}') ($dir), $need GiB needed; free some space or set IMAGE_OUT_DIR / \
IMAGE_CACHE to a larger file system"
  done
}

pkg_list() { grep -v '^\s*#' "$1" | sed 's/#.*//; s/\s//g' | grep -v '^$'; }

sources() {
  printf '%s\n' "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
    "deb $SECURITY_MIRROR $SUITE-security main"
}

# --- phases --------------------------------------------------------------------------------------------------

wheels() {  # the lock's wheels for VARIANT in the warm wheelhouse; offline when it already holds them
  local wh=$CACHE/wheels/$VARIANT
  mkdir -p "$wh"
  # --require-hashes: every file must match one of its pin's sha256 in the lock, here and again at install.
  local args=(download --quiet --only-binary=:all: --require-hashes --requirement "$LOCK" --dest "$wh")
  local err=$TMP/pip-download.err
  if "$PY" -m pip "${args[@]}" --isolated --no-index --find-links "$wh" >/dev/null 2>"$err"; then
    echo "wheelhouse $wh already holds the lock"
    return 0
  fi
  # A file of the wheelhouse that matches none of its hashes: pip deletes it ("Previously-downloaded file ...
  # has bad hash", then pip 23.0 fails on the file it deleted), and the download below fetches it again.
  local bad
  for bad in $(sed -n 's/.*Previously-downloaded file \(.*\) has bad hash.*/\1/p' "$err" | sort -u); do
    echo "image: $(basename "$bad") in the wheelhouse matched none of its hashes in $(basename "$LOCK"): \
removed, fetching it again"
    rm -f "$bad"
  done
  # pip's configuration here offers the CPU build of torch (find-links): that is what the cpu variant takes;
  # the cuda variant asks PyPI alone (--isolated), so torch==X is its CUDA build with its NVIDIA wheels.
  local source=(); [ "$VARIANT" = cpu ] || source=(--isolated)
  if ! "$PY" -m pip "${args[@]}" "${source[@]}" 2>"$err"; then
    grep -v "is ignored" "$err" >&2 || true
    if grep -q "DO NOT MATCH THE HASHES" "$err"; then
      die "a downloaded file matches none of its hashes in $(basename "$LOCK"): $(hash_mismatch "$err"); \
refused (tampered with, or the lock is stale: 'make lock' and review)"
    fi
    die "the lock does not resolve for $VARIANT: $(basename "$LOCK") (see pip's error above)"
  fi
  if [ "$VARIANT" = cpu ] && ! compgen -G "$wh/torch-*+cpu-*.whl" >/dev/null; then
    die "no CPU build of torch in $wh: the cpu variant needs pip's find-links to offer one (pip config list)"
  fi
  if [ "$VARIANT" = cuda ] && compgen -G "$wh/torch-*+cpu-*.whl" >/dev/null; then
    die "$wh holds a CPU build of torch; remove it and rebuild"
  fi
}

hash_mismatch() {  # hash_mismatch PIP_STDERR: "NAME==VERSION (expected H, got H)" of each file pip refused
  awk '/ from .*:$/ { req = $1 } /Expected sha256/ { want = $3 } /Got/ { print req " (expected " want ", got " $2 ")" }' \
    "$1" | paste -sd ';' -
}

# The same reproducible build as L3's (roles/ct_environment/files/pack_trainer.py): offline, no build isolation,
# the tools venv's hashed setuptools; it writes trainer-wheel.lock (the wheel's sha256) that the hook installs by.
trainer_wheel() {
  "$TOOLS_PY" "$REPO/roles/ct_environment/files/pack_trainer.py" "$REPO/trainer" "$TMP/dist" \
    || die "could not build the trainer wheel from trainer/ (pack_trainer.py, above)"
  compgen -G "$TMP/dist/dflash_trainer-*.whl" >/dev/null || die "pack_trainer.py wrote no dflash_trainer wheel"
}

units() {  # the roles' unit files and the tools they run, rendered with the roles' defaults (image/units.yml)
  ANSIBLE_CONFIG=$REPO/ansible/ansible.cfg ANSIBLE_NOCOLOR=1 "$ANSIBLE_PLAYBOOK" -i localhost, \
    "$REPO/image/units.yml" -e "image_unit_dir=$TMP/units" || die "could not render the unit files (image/units.yml)"
}

pins_pref() {  # packages.txt as apt preferences: the pinned version of every package wins, up or down
  local line
  pkg_list "$PINS" | while read -r line; do
    printf 'Package: %s\nPin: version %s\nPin-Priority: 1001\n\n' "${line%%=*}" "${line#*=}"
  done >"$TMP/dflash-pins.pref"
}

mmdebstrap_common() {  # the arguments shared by a build and a refresh of the pins
  local include
  include=$(pkg_list "$PACKAGES_IN" | paste -sd, -)
  MMARGS=(--mode=root --variant=minbase --aptopt='APT::Install-Recommends "false"' --include="$include"
          --skip=essential/unlink
          --setup-hook='mkdir -p "$1"/var/cache/apt/archives/ "$1"/etc/apt/preferences.d/'
          --setup-hook="sync-in $CACHE/apt/archives /var/cache/apt/archives/")
}

rootfs() {  # mmdebstrap, the customize hook, and zstd into the .partial file
  mkdir -p "$CACHE/apt/archives"
  pins_pref
  mmdebstrap_common
  MMARGS+=(--format=tar
           --setup-hook="copy-in $TMP/dflash-pins.pref /etc/apt/preferences.d/"
           --customize-hook="sync-out /var/cache/apt/archives $CACHE/apt/archives"
           --customize-hook="$REPO/image/hooks/customize.sh \"\$1\""
           --customize-hook='rm -f "$1"/etc/apt/preferences.d/dflash-pins.pref'
           --customize-hook="du -sx --block-size=1 \"\$1\" | cut -f1 > $TMP/unpacked-bytes")
  local wheel
  wheel=$(compgen -G "$TMP/dist/dflash_trainer-*.whl" | head -n1)
  IMAGE_WHEELHOUSE=$CACHE/wheels/$VARIANT IMAGE_LOCK=$LOCK IMAGE_PINS=$PINS IMAGE_TRAINER_WHEEL_PATH=$wheel \
  IMAGE_TRAINER_WHEEL_LOCK=$TMP/dist/trainer-wheel.lock \
  IMAGE_REPO=$REPO IMAGE_NAME=$NAME IMAGE_VARIANT=$VARIANT IMAGE_VERSION=$VERSION IMAGE_COMMIT=$(commit) \
  IMAGE_SUITE=$SUITE IMAGE_LOCK_SHA256=$(sha256sum "$LOCK" | cut -d' ' -f1) \
  IMAGE_PINS_SHA256=$(sha256sum "$PINS" | cut -d' ' -f1) IMAGE_TRAINER_VERSION=$(trainer_version) \
  IMAGE_MANIFEST_OUT=$TMP/image.json IMAGE_UNITS_DIR=$TMP/units TMPDIR=$TMP \
    mmdebstrap "${MMARGS[@]}" "$SUITE" - "$(sources)" | zstd -q -T0 -"$ZSTD_LEVEL" -o "$PARTIAL"
}

publish() {  # the .partial becomes the archive; a JSON beside it says what and where it is
  local name=$1 archive=$OUT_DIR/$1 seconds=$2
  mv -f "$PARTIAL" "$archive"
  PARTIAL=""
  "$PY" - "$archive" "$TMP/image.json" "$(cat "$TMP/unpacked-bytes")" "$seconds" "$STORAGE:vztmpl/$name" \
    "$OUT_DIR/$VARIANT.json" <<'EOF'
import hashlib, json, sys
from pathlib import Path
archive, manifest, unpacked, seconds, volid, out = sys.argv[1:]
digest = hashlib.sha256()
with open(archive, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
info = {"path": archive, "name": Path(archive).name, "volid": volid, "sha256": digest.hexdigest(),
        "size_bytes": Path(archive).stat().st_size, "unpacked_bytes": int(unpacked),
        "build_seconds": int(seconds), "manifest": json.loads(Path(manifest).read_text())}
Path(archive).with_name(Path(archive).name.removesuffix(".tar.zst") + ".json").write_text(json.dumps(info, indent=2) + "\n")
Path(out + ".partial").write_text(json.dumps(info, indent=2) + "\n")
Path(out + ".partial").rename(out)
EOF
}

prune() {  # prune VARIANT: all but the newest KEEP archives of VARIANT go, with their JSON copies
  local variant=$1 archive
  [[ $KEEP =~ ^[1-9][0-9]*$ ]] || die "IMAGE_KEEP must be a whole number of 1 or more (got '$KEEP')"
  # The latest build (VARIANT.json) is never pruned, whatever the modification times say.
  local latest
  latest=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["path"])' "$OUT_DIR/$variant.json" \
           2>/dev/null || true)
  local archives=()  # newest first; none at all is fine
  mapfile -t archives < <(ls -1t "$OUT_DIR"/debian-"$DEBIAN_RELEASE"-dflash-"$variant"_*_"$ARCH".tar.zst 2>/dev/null || true)
  for archive in "${archives[@]:KEEP}"; do
    [ "$archive" = "$latest" ] && continue
    rm -f "$archive" "${archive%.tar.zst}.json"
    say "pruned    $(basename "$archive") (IMAGE_KEEP=$KEEP)"
  done
}

report() {  # report ARCHIVE SECONDS
  local archive=$1 seconds=$2 size_mb unpacked_mb
  size_mb=$(( $(stat -c %s "$archive") / 1048576 ))
  unpacked_mb=$(( $(cat "$TMP/unpacked-bytes") / 1048576 ))
  say "archive   $archive"
  say "volid     $STORAGE:vztmpl/$(basename "$archive")"
  say "manifest  /etc/dflash/image.json (copy: ${archive%.tar.zst}.json; latest: $OUT_DIR/$VARIANT.json)"
  # CPU time of every build process: on a busy shared machine the wall time says more about the neighbours.
  times >"$TMP/times"  # a builtin, redirected (not piped) so that it reports on this shell's children
  say "cpu       $(tail -n1 "$TMP/times" | awk '{print "user " $1 ", sys " $2}') of all build processes; \
load average now $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ "$VARIANT" = cpu ]; then
    say "size      $size_mb MiB (unpacked $unpacked_mb MiB); budget $BUDGET_MB MiB: \
$([ "$size_mb" -le $BUDGET_MB ] && echo ok || echo OVER)"
    say "time      $((seconds / 60))m$((seconds % 60))s on $(nproc) cores; budget $((BUDGET_S / 60))m: \
$([ "$seconds" -le $BUDGET_S ] && echo ok || echo "OVER (a cold apt cache or wheelhouse costs minutes)")"
  else
    say "size      $size_mb MiB (unpacked $unpacked_mb MiB); time $((seconds / 60))m$((seconds % 60))s"
  fi
}

# --- entry points --------------------------------------------------------------------------------------------

preflight() {
  [ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap --mode=root, mounts in the chroot)"
  local tool
  for tool in mmdebstrap zstd "$PY" git flock; do
    command -v "$tool" >/dev/null || die "$tool is missing: run 'make bootstrap' (or apt-get install $tool)"
  done
  [ -x "$ANSIBLE_PLAYBOOK" ] || die "$ANSIBLE_PLAYBOOK is missing (it renders the units): run 'make bootstrap'"
  [ -x "$TOOLS_PY" ] || die "$TOOLS_PY is missing (it builds the trainer wheel): run 'make bootstrap'"
  [ -r "$LOCK" ] || die "no lock at $LOCK"
  [ -r "$PACKAGES_IN" ] || die "no package list at $PACKAGES_IN"
  mkdir -p "$OUT_DIR" "$CACHE"
  exec 9>"$CACHE/.build.lock"
  flock -n 9 || die "another image build holds $CACHE/.build.lock; wait for it"
}

variant_lock() {  # the lock a variant installs: the CUDA libraries of torch's CUDA build are pinned apart
  case $1 in
    cpu) echo "${LOCK_OVERRIDE:-$REPO/trainer/requirements.lock}" ;;
    cuda) echo "${LOCK_OVERRIDE:-$REPO/trainer/requirements-cuda.lock}" ;;
  esac
}

build() {
  local min_free
  case $VARIANT in
    cpu) min_free=${IMAGE_MIN_FREE_GB:-10} ;;
    cuda) min_free=${IMAGE_MIN_FREE_GB:-30} ;;
    *) die "unknown variant '$VARIANT' (cpu or cuda)" ;;
  esac
  LOCK=$(variant_lock "$VARIANT")
  preflight
  [ -s "$PINS" ] || die "no pins at $PINS: run 'image/build.sh --refresh-pins' first"
  check_space "$min_free"
  NAME=$(image_name "$VARIANT")
  VERSION=$(image_version)
  export SOURCE_DATE_EPOCH
  LOG=$OUT_DIR/$VARIANT.log
  : >"$LOG"
  TMP=$(mktemp -d "$OUT_DIR/.tmp-$VARIANT.XXXXXX")
  PARTIAL=$OUT_DIR/.$NAME.partial
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  say "building $NAME ($VARIANT, commit $(commit), SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"
  if dirty; then say "warning: uncommitted changes under image/, trainer/ or roles/: version marked .dirty"; fi
  phase wheels wheels
  phase trainer trainer_wheel
  phase units units
  phase rootfs rootfs
  local seconds=$((SECONDS - STARTED))
  phase publish publish "$NAME" "$seconds"
  report "$OUT_DIR/$NAME" "$seconds"
  prune "$VARIANT"
}

refresh_pins() {
  VARIANT=pins
  LOCK=$(variant_lock cpu)
  preflight
  check_space 4
  LOG=$OUT_DIR/pins.log
  : >"$LOG"
  TMP=$(mktemp -d "$OUT_DIR/.tmp-pins.XXXXXX")
  trap cleanup EXIT
  refresh() {
    mkdir -p "$CACHE/apt/archives"
    mmdebstrap_common
    MMARGS+=(--format=null
             --customize-hook="sync-out /var/cache/apt/archives $CACHE/apt/archives"
             --customize-hook='chroot "$1" dpkg-query -W -f "\${db:Status-Status} \${Package}=\${Version}\n"'" > $TMP/raw")
    TMPDIR=$TMP mmdebstrap "${MMARGS[@]}" "$SUITE" /dev/null "$(sources)"
    awk '$1 == "installed" {print $2}' "$TMP/raw" | LC_ALL=C sort >"$TMP/pins"
    {
      echo "# Exact Debian versions of everything in the CT image; generated by 'image/build.sh --refresh-pins'"
      echo "# from image/packages.in against $MIRROR $SUITE{,-updates} and $SECURITY_MIRROR $SUITE-security."
      echo "# Review the diff: a version change here is an image change. The build fails when the mirror no longer"
      echo "# serves one of these versions (a point release or a security update); refresh then."
      cat "$TMP/pins"
    } >"$PINS.partial"
    mv "$PINS.partial" "$PINS"
  }
  phase pins refresh
  say "wrote $PINS ($(pkg_list "$PINS" | wc -l) packages); review 'git diff $PINS'"
}

case ${1:-} in
  -h|--help) usage 0 ;;
  --print) VARIANT=${2:-${VARIANT:-cpu}}; print_names "$VARIANT" ;;
  --refresh-pins) refresh_pins ;;
  --prune) VARIANT=${2:-${VARIANT:-cpu}}
           case $VARIANT in cpu|cuda) prune "$VARIANT" ;; *) die "unknown variant '$VARIANT' (cpu or cuda)" ;; esac ;;
  ""|cpu|cuda) VARIANT=${1:-${VARIANT:-cpu}}; build ;;
  *) echo "image: unknown argument '$1' (a variant is cpu or cuda)" >&2; usage 2 >&2 ;;
esac
