"""Fixtures for the CT image checks: a built image of each variant (the cpu one is the lab's, built by
`make lab`; either is built here when missing) and a throwaway LXC container booted from it, removed at
the end. Never touches the lab's own containers."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from testinfra.host import Host

from lab import image
from lab.settings import REPO
from tests.verify.backends import LxcAttachBackend

BUILD_TIMEOUT_S = 3600


# cpu: the lab's image, checked in `make test`; cuda: PyPI's CUDA torch (2.8 GB of wheels), `make test-slow`.
@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.slow)])
def built(request: pytest.FixtureRequest) -> image.BuiltImage:
    variant = request.param
    found = image.built_image(variant)
    if found is None or found.stale_inputs():
        proc = subprocess.run(
            [str(REPO / "image" / "build.sh"), variant],
            text=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            pytest.fail(f"image/build.sh {variant} failed:\n{proc.stdout}{proc.stderr}")
        found = image.built_image(variant)
    assert found is not None, f"image/build.sh {variant} succeeded but left no build/image/{variant}.json"
    return found


@pytest.fixture(scope="module")
def ct(built: image.BuiltImage) -> Iterator[Host]:
    name = f"img-test-{built.manifest['variant']}"
    try:
        image.boot_from_image(name, built.path, image.BUILD_DIR / f"{name}.lxc.log")
        yield Host(LxcAttachBackend(name))
    finally:
        image.destroy(name)
