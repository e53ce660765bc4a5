"""dflash-s3-sync reads the manifest with a signed stdlib GET: its SigV4 signature must equal botocore's."""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
from pathlib import Path
from unittest import mock

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

TOOL = Path(__file__).resolve().parents[2] / "roles/shard_sync/files/dflash_s3_sync.py"
spec = importlib.util.spec_from_file_location("dflash_s3_sync", TOOL)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

KEY_ID, SECRET = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
NOW = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.UTC)


class _Now(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


class _Response:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self) -> bytes:
        return b"{}"


@pytest.mark.parametrize(
    ("endpoint", "uri"),
    [
        ("http://127.0.0.1:7480", "s3://b-1/a prefix/MANIFEST.json"),
        (None, "s3://bucket/shards/MANIFEST.json"),
        (None, "s3://dotted.bucket/x/MANIFEST.json"),
    ],
)
def test_signature_equals_botocores(monkeypatch: pytest.MonkeyPatch, endpoint: str | None, uri: str) -> None:
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    sent = {}

    def urlopen(request, timeout):
        sent["request"] = request
        return _Response()

    with (
        mock.patch.object(tool.datetime, "datetime", _Now),
        mock.patch.object(tool.urllib.request, "urlopen", urlopen),
    ):
        assert tool.Aws("/bin/true", endpoint, "eu-central-1").read_direct(uri) == "{}"
    request = sent["request"]
    expected = AWSRequest(
        method="GET", url=request.full_url, headers={"x-amz-content-sha256": hashlib.sha256(b"").hexdigest()}
    )
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW):
        S3SigV4Auth(Credentials(KEY_ID, SECRET), "s3", "eu-central-1").add_auth(expected)
    assert request.get_header("Authorization") == expected.headers["Authorization"]
