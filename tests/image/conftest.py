"""Fixtures for the CT image checks: the built cpu image (built here when there is none) and a throwaway LXC
container booted from it, removed at the end. Never touches the lab's own containers."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from testinfra.host import Host

from lab import image
from lab.settings import REPO
from tests.verify.backends import LxcAttachBackend

CONTAINER = "img-test-cpu"
BUILD_TIMEOUT_S = 3600


@pytest.fixture(scope="session")
def built() -> image.BuiltImage:
    found = image.built_image("cpu")
    if found is None:
        proc = subprocess.run(
            [str(REPO / "image" / "build.sh"), "cpu"],
            text=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            pytest.fail(f"image/build.sh cpu failed:\n{proc.stdout}{proc.stderr}")
        found = image.built_image("cpu")
    assert found is not None, "image/build.sh cpu succeeded but left no build/image/cpu.json"
    return found


@pytest.fixture(scope="module")
def ct(built: image.BuiltImage) -> Iterator[Host]:
    try:
        image.boot_from_image(CONTAINER, built.path, image.BUILD_DIR / f"{CONTAINER}.lxc.log")
        yield Host(LxcAttachBackend(CONTAINER))
    finally:
        image.destroy(CONTAINER)
