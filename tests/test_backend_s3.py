"""S3Backend against a real S3 server (moto over HTTP on loopback).

The conformance suite, plus multipart, parallel ranged gets, retries with an
injected no-op sleep, and the error translation table.
"""

from __future__ import annotations

import logging
import os

import pytest

from backends.s3 import ChainReader, S3Backend, S3Config, parse_s3_url, slice_buffers, translate
from tests.conformance import BackendConformance
from tests.s3_server import s3_bucket, s3_env, s3_server  # noqa: F401 - fixtures
from tierstore.errors import (
    AccessDeniedError,
    ConfigError,
    KeyExistsError,
    TierStoreError,
    TierUnavailableError,
)

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


# -- helpers ---------------------------------------------------------------------------


def _payload(n: int) -> bytes:
    import numpy as np

    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_kw):
        yield self._body


class Injector:
    """Answers the first ``times`` requests of an operation with an error, before they are sent.

    Uses botocore's ``before-send`` event on the backend's own client: an
    injected answer never reaches the server; every other request goes to moto.
    """

    def __init__(self, client, op: str, status: int, code: str, times: int = 10**9) -> None:
        self.status, self.code, self.left = status, code, times
        self.injected = 0
        self.sent = 0
        client.meta.events.register(f"before-send.s3.{op}", self)

    def __call__(self, request, **_kw):
        from botocore.awsrequest import AWSResponse

        if self.left <= 0:
            self.sent += 1
            return None
        self.left -= 1
        self.injected += 1
        body = f"<Error><Code>{self.code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, _Raw(body))


class Sleeps(list):
    def __call__(self, s: float) -> None:
        self.append(s)


def _backend(s3_bucket, **cfg):  # noqa: F811
    url, bucket = s3_bucket
    sleeps = Sleeps()
    config = S3Config(**cfg) if cfg else None
    b = S3Backend(bucket, "p", endpoint_url=url, region_name="us-east-1", config=config, sleep=sleeps)
    return b, sleeps


def _count_calls(client, op: str) -> list[dict]:
    calls: list[dict] = []
    client.meta.events.register(f"before-parameter-build.s3.{op}", lambda params, **kw: calls.append(params))
    return calls


SMALL_PARTS = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}


# -- transfers -------------------------------------------------------------------------


def test_multipart_put_and_ranged_get(s3_bucket):  # noqa: F811
    b, _ = _backend(s3_bucket, **SMALL_PARTS)
    data = _payload(12 * MiB + 777)
    parts = _count_calls(b.client, "UploadPart")
    completes = _count_calls(b.client, "CompleteMultipartUpload")
    single = _count_calls(b.client, "PutObject")
    b.put("big", [data[:3 * MiB], memoryview(data)[3 * MiB: 9 * MiB + 5], bytearray(data[9 * MiB + 5:])])
    assert (len(parts), len(completes), len(single)) == (3, 1, 0)
    assert sorted(p["PartNumber"] for p in parts) == [1, 2, 3]
    gets = _count_calls(b.client, "GetObject")
    got = b.get("big")
    assert bytes(got) == data
    assert len(gets) == 3
    assert sorted(g["Range"] for g in gets) == sorted(
        [f"bytes=0-{5 * MiB - 1}", f"bytes={5 * MiB}-{10 * MiB - 1}", f"bytes={10 * MiB}-{12 * MiB + 776}"]
    )
    assert all(g.get("IfMatch") for g in gets if not g["Range"].startswith("bytes=0-"))
    assert b.size("big") == len(data)
    b.close()


def test_multipart_if_absent(s3_bucket):  # noqa: F811
    b, _ = _backend(s3_bucket, **SMALL_PARTS)
    data = _payload(6 * MiB)
    b.put("once", data, if_absent=True)
    with pytest.raises(KeyExistsError):
        b.put("once", b"x" * (6 * MiB), if_absent=True)
    assert bytes(b.get("once")) == data
    assert b.client.list_multipart_uploads(Bucket=b.bucket).get("Uploads", []) == []
    b.close()


def test_multipart_failure_aborts_upload(s3_bucket):  # noqa: F811
    b, _ = _backend(s3_bucket, max_attempts=2, **SMALL_PARTS)
    inj = Injector(b.client, "UploadPart", 500, "InternalError")
    with pytest.raises(TierUnavailableError) as ei:
        b.put("failed", _payload(11 * MiB))
    assert ei.value.attempts == 2
    assert b.get("failed") is None
    assert b.client.list_multipart_uploads(Bucket=b.bucket).get("Uploads", []) == []
    assert inj.injected >= 2
    b.close()


def test_object_replaced_during_ranged_get(s3_bucket):  # noqa: F811
    """An overwrite between the ranges is detected (If-Match) and the new version read whole."""
    b, _ = _backend(s3_bucket, **SMALL_PARTS)
    old, new = _payload(11 * MiB), _payload(11 * MiB + 1)
    b.put("moving", old)
    state = {"done": False}

    def overwrite(params, **_kw):
        if not state["done"] and not params.get("Range", "bytes=0-").startswith("bytes=0-"):
            state["done"] = True
            other = S3Backend(b.bucket, "p", endpoint_url=b.endpoint_url, region_name="us-east-1")
            other.put("moving", new)
            other.close()

    b.client.meta.events.register("before-parameter-build.s3.GetObject", overwrite)
    assert bytes(b.get("moving")) == new
    assert state["done"]
    b.close()


# -- retries and the error table ----------------------------------------------------------


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (500, "InternalError"), (429, "TooManyRequests")])
def test_retry_then_success(s3_bucket, status, code):  # noqa: F811
    b, sleeps = _backend(s3_bucket, max_attempts=4, backoff_base_s=0.5, backoff_max_s=2.0)
    inj = Injector(b.client, "PutObject", status, code, times=2)
    b.put("r", b"after retries")
    assert inj.injected == 2 and inj.sent == 1
    assert len(sleeps) == 2 and all(0 <= s <= 2.0 for s in sleeps)
    assert b.get("r") == b"after retries"  # it really reached the server
    b.close()


def test_retries_exhausted(s3_bucket):  # noqa: F811
    b, sleeps = _backend(s3_bucket, max_attempts=3)
    inj = Injector(b.client, "GetObject", 503, "SlowDown")
    with pytest.raises(TierUnavailableError) as ei:
        b.get("k")
    assert inj.injected == 3 and len(sleeps) == 2
    assert ei.value.attempts == 3 and ei.value.key == "p/k"
    assert "3 attempt" in str(ei.value)
    b.close()


def test_access_denied_fails_fast(s3_bucket):  # noqa: F811
    b, sleeps = _backend(s3_bucket, max_attempts=5)
    inj = Injector(b.client, "PutObject", 403, "AccessDenied")
    with pytest.raises(AccessDeniedError) as ei:
        b.put("k", b"x")
    assert inj.injected == 1 and sleeps == []
    assert ei.value.code == "AccessDenied"
    b.close()


def test_other_4xx_not_retried(s3_bucket):  # noqa: F811
    b, sleeps = _backend(s3_bucket, max_attempts=5)
    inj = Injector(b.client, "PutObject", 400, "InvalidArgument")
    with pytest.raises(TierStoreError):
        b.put("k", b"x")
    assert inj.injected == 1 and sleeps == []
    b.close()


def test_no_such_bucket(s3_env):  # noqa: F811
    b = S3Backend("no-such-bucket-here", endpoint_url=s3_env, region_name="us-east-1", sleep=_no_sleep)
    with pytest.raises(TierUnavailableError, match="no-such-bucket-here") as ei:
        b.put("k", b"x")
    assert ei.value.bucket == "no-such-bucket-here" and ei.value.attempts == 1
    with pytest.raises(TierUnavailableError, match="does not exist"):
        b.get("k")
    with pytest.raises(TierUnavailableError):
        list(b.list())
    b.close()


def test_server_stopped(s3_env, monkeypatch):  # noqa: F811
    from tests.s3_server import start_moto

    server, url = start_moto()
    sleeps = Sleeps()
    b = S3Backend("bkt-down", endpoint_url=url, region_name="us-east-1",
                  config=S3Config(max_attempts=3, connect_timeout_s=2, read_timeout_s=2), sleep=sleeps)
    b.client.create_bucket(Bucket="bkt-down")
    b.put("k", b"x")
    server.stop()
    with pytest.raises(TierUnavailableError) as ei:
        b.get("k")
    assert ei.value.attempts == 3 and len(sleeps) == 2
    assert isinstance(ei.value.__cause__, Exception) and ei.value.__cause__ is not None
    b.close()


@pytest.mark.parametrize(
    "code,status,expected",
    [
        ("NoSuchKey", 404, None),
        ("404", 404, None),
        ("AccessDenied", 403, AccessDeniedError),
        ("403", 403, AccessDeniedError),
        ("NoSuchBucket", 404, TierUnavailableError),
        ("PreconditionFailed", 412, KeyExistsError),
        ("ConditionalRequestConflict", 409, KeyExistsError),
        ("SlowDown", 503, TierUnavailableError),
        ("InternalError", 500, TierUnavailableError),
        ("InvalidBucketName", 400, ConfigError),
        ("Weird", 400, TierStoreError),
    ],
)
def test_translate_table(code, status, expected):
    from botocore.exceptions import ClientError

    e = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")
    out = translate(e, op="get", key="k", bucket="bkt", attempts=2)
    if expected is None:
        assert out is None
    else:
        assert type(out) is expected
        assert out.key == "k" and out.bucket == "bkt"


# -- lifecycle, URL, fork -----------------------------------------------------------------


def test_from_url_and_prefix_isolation(s3_bucket):  # noqa: F811
    url, bucket = s3_bucket
    a = S3Backend.from_url(f"s3://{bucket}/run/a", endpoint_url=url, region_name="us-east-1")
    b = S3Backend.from_url(f"s3://{bucket}/run/ab", endpoint_url=url, region_name="us-east-1")
    assert a.url == f"s3://{bucket}/run/a" and a.prefix == "run/a"
    a.put("x", b"1")
    b.put("y", b"2")
    assert list(a.list()) == ["x"] and list(b.list()) == ["y"]
    assert b.get("x") is None
    a.close()
    b.close()
    with pytest.raises(ConfigError):
        parse_s3_url("file:///x")
    with pytest.raises(ConfigError):
        S3Backend("bkt", "../up")


def test_list_paginates(s3_bucket, monkeypatch):  # noqa: F811
    b, _ = _backend(s3_bucket)
    calls = _count_calls(b.client, "ListObjectsV2")
    b.client.meta.events.register(
        "provide-client-params.s3.ListObjectsV2", lambda params, **kw: params.update(MaxKeys=3)
    )
    names = [f"n/{i:02d}" for i in range(8)]
    for n in names:
        b.put(n, b"")
    assert list(b.list("n/")) == names
    assert len(calls) == 3
    b.close()


def test_closed_backend(s3_bucket):  # noqa: F811
    b, _ = _backend(s3_bucket)
    b.close()
    b.close()
    with pytest.raises(TierUnavailableError, match="closed"):
        b.get("k")


def test_fork_makes_a_new_client(s3_bucket):  # noqa: F811
    b, _ = _backend(s3_bucket, **SMALL_PARTS)
    b.put("parent", b"p")
    parent_client = b.client
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = 1
        try:
            os.close(r)
            ok = int(b.client is parent_client)
            b.put("child", _payload(6 * MiB))  # multipart: needs the child's own pool
            ok |= int(bytes(b.get("child")) != _payload(6 * MiB)) << 1
        except Exception:  # noqa: BLE001 - reported to the parent as a status
            ok = 4
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    status = os.read(r, 1)
    os.waitpid(pid, 0)
    os.close(r)
    assert status == b"\x00"
    assert b.get("child") is not None and b.client is parent_client
    b.close()


def test_chain_reader_seek_and_read():
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh"), memoryview(b"i")]
    r = ChainReader(views)
    assert len(r) == 9 and r.read() == b"abcdefghi"
    r.seek(2)
    assert r.read(4) == b"cdef"
    r.seek(-2, os.SEEK_END)
    assert r.read() == b"hi" and r.read() == b""
    r.seek(0)
    assert r.read(100) == b"abcdefghi"
    assert slice_buffers(views, 2, 5) == [b"c", b"defg"]
    assert ChainReader.body([memoryview(b"whole")]) == b"whole"
    assert ChainReader.body([]) == b""
