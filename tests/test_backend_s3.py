"""S3Backend against a real S3 server (moto over HTTP on loopback).

The conformance suite, plus multipart, parallel ranged gets, retries with an
injected no-op sleep, and the error translation table.
"""

from __future__ import annotations

import logging

import pytest

from backends.s3 import S3Backend, S3Config
from tests.conformance import BackendConformance
from tests.s3_server import s3_bucket, s3_env, s3_server  # noqa: F401 - fixtures

logging.getLogger("werkzeug").setLevel(logging.ERROR)

MiB = 1024 * 1024


def _no_sleep(_s: float) -> None:
    pass


class TestS3Conformance(BackendConformance):
    @pytest.fixture
    def backend(self, s3_bucket):  # noqa: F811
        url, bucket = s3_bucket
        b = S3Backend(bucket, "ckpt/run1", endpoint_url=url, region_name="us-east-1", sleep=_no_sleep)
        yield b
        b.close()
