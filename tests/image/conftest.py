"""Fixtures for the CT image checks: a built image of each variant (the cpu one is the lab's, built by
`make lab`; either is built here when missing) and a throwaway LXC container booted from it, removed at
the end. Never touches the lab's own containers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from testinfra.host import Host

from lab import image
from lab.errors import LabError
from tests.verify.backends import LxcAttachBackend


# cpu: the lab's image, checked in `make test`; cuda: PyPI's CUDA torch (2.8 GB of wheels), `make test-slow`.
@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.slow)])
def built(request: pytest.FixtureRequest) -> image.BuiltImage:
    try:  # the lab's own rule: the latest build when it is the tree's, else a new one
        return image.ensure_image(request.param)
    except LabError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def ct(built: image.BuiltImage) -> Iterator[Host]:
    name = f"img-test-{built.manifest['variant']}"
    try:
        image.boot_from_image(name, built.path, image.BUILD_DIR / f"{name}.lxc.log")
        yield Host(LxcAttachBackend(name))
    finally:
        image.destroy(name)
