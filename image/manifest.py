"""Writes /etc/dflash/image.json inside the image being built (run by image/hooks/customize.sh in the chroot).

Standard library only: it runs under the image's own /usr/bin/python3 (Debian 12's 3.11).
Every value comes from the chroot itself or from the build's environment, so two builds of one commit
write the same file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

VENV = Path("/opt/dflash/venv")  # a link to venvs/LOCKSHA16, as the L3 role lays it out


def debian_packages() -> dict[str, str]:
    fmt = "${db:Status-Status}\t${Package}\t${Version}\n"
    out = subprocess.run(["dpkg-query", "-W", "-f", fmt], capture_output=True, text=True, check=True).stdout
    rows = (line.split("\t") for line in out.splitlines() if line)
    return dict(sorted((name, version) for status, name, version in rows if status == "installed"))


def python_packages() -> dict[str, str]:
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "pip", "freeze", "--all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pairs = (line.split("==", 1) for line in out.splitlines() if "==" in line)
    return dict(sorted((name.lower(), version) for name, version in pairs))


def units() -> list[str]:
    directory = Path("/usr/lib/systemd/system")  # vendor units (image/hooks/customize.sh)
    listed = os.environ.get("IMAGE_UNITS", "").split()
    return sorted(name for name in listed if (directory / name).is_file())


def manifest() -> dict[str, object]:
    env = os.environ
    epoch = int(env["SOURCE_DATE_EPOCH"])
    return {
        "name": env["IMAGE_NAME"],
        "variant": env["IMAGE_VARIANT"],
        "version": env["IMAGE_VERSION"],
        "commit": env["IMAGE_COMMIT"],
        "build_date": datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source_date_epoch": epoch,
        "suite": env["IMAGE_SUITE"],
        "lock_sha256": env["IMAGE_LOCK_SHA256"],
        "packages_txt_sha256": env["IMAGE_PINS_SHA256"],
        "trainer_version": env["IMAGE_TRAINER_VERSION"],
        "trainer_wheel": env["IMAGE_TRAINER_WHEEL"],
        "venv": str(VENV),
        "venv_dir": str(VENV.resolve()),
        "units": units(),
        "debian_packages": debian_packages(),
        "python_packages": python_packages(),
    }


def main() -> int:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/etc/dflash/image.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(manifest(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
