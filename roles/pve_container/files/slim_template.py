#!/usr/bin/env python3
"""Makes a CT template (.tar.zst) from a root filesystem tarball, without docs, man pages and locales.

Used in the lab only, where the lab's cached Debian root filesystem stands in for the image that `make image`
builds. Written to DEST.partial and renamed, so a half-written template is never taken for a finished one.
Usage: slim_template.py SOURCE.tar DEST.tar.zst
"""

import re
import subprocess
import sys
import tarfile
from pathlib import Path

DROP = re.compile(r"^\.?/?usr/share/(doc|man|locale|info)/")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.splitlines()[-1], file=sys.stderr)
        return 2
    src, dest = Path(sys.argv[1]), Path(sys.argv[2])
    if not src.is_file():
        print(f"slim_template: {src}: no such file (run `make lab` first)", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    with open(partial, "wb") as out:
        zstd = subprocess.Popen(["zstd", "-q", "-12", "-T2", "-c"], stdin=subprocess.PIPE, stdout=out)
        assert zstd.stdin is not None
        with (
            tarfile.open(src) as tin,
            tarfile.open(fileobj=zstd.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tout,
        ):
            for member in tin:
                if DROP.match(member.name) and not member.isdir():
                    continue
                tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
        zstd.stdin.close()
        if zstd.wait() != 0:
            partial.unlink(missing_ok=True)
            print(f"slim_template: zstd failed writing {dest}", file=sys.stderr)
            return 1
    partial.rename(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
