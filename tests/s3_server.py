"""A real S3 server on loopback for tests: moto's ``ThreadedMotoServer`` over HTTP.

Fixtures (import them into a test module:
``from tests.s3_server import s3_server, s3_bucket  # noqa: F401``):

* ``s3_server`` (module scope): starts one server on ``127.0.0.1`` and a free
  port, yields its endpoint URL, stops it at the end of the module.
* ``s3_env`` (function scope): fake credentials and a region through
  environment variables for the test only (monkeypatch), and a server reset
  (``POST /moto-api/reset``) so every test starts with no buckets.
* ``s3_bucket`` (function scope): a fresh bucket; yields ``(endpoint_url, bucket)``.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator

import pytest

__all__ = ["FAKE_ENV", "s3_bucket", "s3_env", "s3_server", "start_moto"]

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_moto():
    """Start a ThreadedMotoServer on a free loopback port; return ``(server, endpoint_url)``."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"moto[server] is not installed: {e}")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    server, url = start_moto()
    try:
        yield url
    finally:
        server.stop()
        _ADMIN.pop(url, None)


_ADMIN: dict[str, object] = {}


def _admin_client(url: str):
    """A client for the fixtures' own set-up calls (fake keys given explicitly: tests only)."""
    if url not in _ADMIN:
        import boto3

        _ADMIN[url] = boto3.client(
            "s3",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id=FAKE_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
        )
    return _ADMIN[url]


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for k, v in FAKE_ENV.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    req = urllib.request.Request(f"{s3_server}/moto-api/reset", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: str) -> tuple[str, str]:
    bucket = f"ts-test-{uuid.uuid4().hex[:12]}"
    _admin_client(s3_env).create_bucket(Bucket=bucket)
    return s3_env, bucket
