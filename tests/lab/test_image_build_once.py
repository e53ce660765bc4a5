"""`make lab` makes its containers side by side: on a machine with no CT image yet, the two CTs of
inventory/lab-multinode both need one. The first builds it, the second waits and takes the same build (it
ran image/build.sh a second time, which refused: `make test-multinode` on a fresh machine failed)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import stat
from pathlib import Path

import pytest

from lab import image
from lab.errors import LabError

# What image/build.sh does that matters here, from the script itself: `flock -n` on the cache's build lock
# (a second build exits 1 at once: "another image build holds ...; wait for it"), minutes of work, then the
# archive and, last and by rename, VARIANT.json with the lock's and the Debian pins' hashes in its manifest.
FAKE_BUILD = """#!/usr/bin/env bash
set -eu
exec 9>"{out}/.build.lock"
flock -n 9 || {{ echo "image: another image build holds {out}/.build.lock; wait for it" >&2; exit 1; }}
echo run >>"{out}/runs"
sleep 1
echo archive >"{out}/fake-$1.tar.zst"
cat >"{out}/$1.json.tmp" <<'JSON'
{record}
JSON
mv "{out}/$1.json.tmp" "{out}/$1.json"
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    archive = tmp_path / "fake-cpu.tar.zst"
    record = {
        "path": str(archive),
        "name": archive.name,
        "volid": f"local:vztmpl/{archive.name}",
        "sha256": "0" * 64,
        "size_bytes": 8,
        "manifest": {
            "variant": "cpu",
            "lock_sha256": _sha256(image.LOCKS["cpu"]),
            "packages_txt_sha256": _sha256(image.PINS),
        },
    }
    script = tmp_path / "build.sh"
    script.write_text(FAKE_BUILD.format(out=tmp_path, record=json.dumps(record)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(image, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(image, "BUILD_SCRIPT", script)
    return tmp_path


def test_containers_made_side_by_side_build_the_image_once(fake_build: Path) -> None:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        built = [f.result() for f in [pool.submit(image.ensure_image, "cpu") for _ in range(3)]]
    assert (fake_build / "runs").read_text().splitlines() == ["run"]
    assert {b.path for b in built} == {fake_build / "fake-cpu.tar.zst"}


def test_a_build_that_fails_is_named(fake_build: Path) -> None:
    (fake_build / "build.sh").write_text("#!/usr/bin/env bash\nexit 7\n")
    with pytest.raises(LabError, match=r"image/build.sh cpu failed \(exit 7\)"):
        image.ensure_image("cpu")
