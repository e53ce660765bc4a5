"""The manifest's GET goes through awscli (no signing code of ours): its failures are one line naming the URI
and the cause. Runs the tool on this machine with the venv's awscli against a moto server of its own that
checks credentials as S3 does (moto/settings.py INITIAL_NO_AUTH_ACTION_COUNT=0: every request is
authenticated, an unknown access key gets 403, as S3's InvalidAccessKeyId), and against a closed port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.l4_data.conftest import REPO

TOOL = REPO / "roles/shard_sync/files/dflash_s3_sync.py"
AWS = REPO / ".venv/bin/aws"
URI = "s3://dflash-l4-test/shards/MANIFEST.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def strict_s3() -> Iterator[str]:
    port = free_port()
    env = os.environ | {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    proc = subprocess.Popen(
        [str(REPO / ".venv/bin/moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def fetch(tmp_path: Path, endpoint: str) -> subprocess.CompletedProcess[str]:
    creds = tmp_path / "credentials"
    creds.write_text(
        "[default]\naws_access_key_id = AKIANOTAREALKEY00000\naws_secret_access_key = " + "x" * 40 + "\n"
    )
    creds.chmod(0o600)
    env = os.environ | {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": os.devnull}
    argv = [
        sys.executable,
        str(TOOL),
        "--source",
        URI.rsplit("/", 1)[0] + "/",
        "--dest",
        str(tmp_path / "d" / "s"),
    ]
    argv += [
        "--endpoint-url",
        endpoint,
        "--region",
        "us-east-1",
        "--aws",
        str(AWS),
        "--manifest-sha256",
        "0" * 64,
    ]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_bad_credentials_are_one_line_naming_the_uri(tmp_path: Path, strict_s3: str) -> None:
    proc = fetch(tmp_path, strict_s3)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"dflash-s3-sync: error: {URI}: cannot read it: access denied: "
        "check s3_access_key_id / s3_secret_access_key ("
    ), line
    assert "(403)" in line
    assert not (tmp_path / "d").exists()


def test_an_unreachable_endpoint_is_one_line_naming_the_uri(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = fetch(tmp_path, endpoint)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"dflash-s3-sync: error: {URI}: cannot read it: endpoint {endpoint} unreachable ("
    ), line
    assert not (tmp_path / "d").exists()
