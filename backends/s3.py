"""The durable tier on S3 (or any S3-compatible server), through one boto3 client.

Protocol: construct one :class:`S3Backend` per bucket/prefix and share it
between threads (the boto3 client and the part thread pool are thread-safe
and owned by the instance); call :meth:`S3Backend.close` once at the end.
After ``os.fork`` the child makes its own client and pool on first use.
Credentials come only from boto3's standard chain (environment, profile,
instance role), never from parameters.

Transfers:

* ``put`` below ``multipart_threshold``: one ``PutObject`` whose body streams
  from the caller's buffers (no concatenation). At or above it: a multipart
  upload with parts uploaded in parallel by the instance's pool, each part a
  view of the caller's buffers; any failure aborts the upload.
* ``get``: one ranged ``GET`` of the first ``part_size`` bytes; if the object
  is larger, the remaining ranges are fetched in parallel (``If-Match`` the
  first ETag, so a concurrent overwrite is detected, never mixed) into one
  preallocated ``bytearray``.
* ``put(..., if_absent=True)``: ``IfNoneMatch="*"`` on ``PutObject`` or on
  ``CompleteMultipartUpload`` (S3 conditional writes).

Retries (tenacity, jittered exponential backoff, injectable ``sleep``) cover
throttling (``SlowDown``, 503, 429), other 5xx and connection/timeout errors;
other 4xx fail at once. Errors are translated at one place, :func:`translate`,
driven by one table (s3fs ``translate_boto_error`` style).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from backends.base import Backend, Buffer, as_buffers, check_range, total_size, validate_object_name
from tierstore.errors import (
    ConfigError,
    InvalidKeyError,
    MissingDependencyError,
    TierStoreError,
    TierUnavailableError,
)

try:
    import boto3
    import botocore.loaders
    import botocore.session
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        f"the S3 backend needs boto3 and tenacity ({_e}); install them with `pip install boto3 tenacity`"
    ) from _e

__all__ = ["S3Backend", "S3Config", "is_retryable", "parse_s3_url", "translate"]

MiB = 1024 * 1024
_MAX_PARTS = 10_000
_READ_CHUNK = 1 * MiB
_LOADER_LOCK = threading.Lock()
_LOADER: Any = None


def _shared_loader() -> Any:
    """One botocore model loader per process: parsing the S3 model costs ~0.2 s per client."""
    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
        return _LOADER


@dataclass(frozen=True)
class S3Config:
    """Transfer and retry settings of one :class:`S3Backend`.

    Memory bound: a put streams from the caller's buffers (parts are views,
    nothing is concatenated) and a get fills one preallocated buffer of the
    object's size. Beyond that, one transfer holds at most
    ``max_concurrency × part_size`` bytes in flight in the worst case (4 × 16
    MiB = 64 MiB with the defaults); in practice ``max_concurrency × 1 MiB``,
    since bodies are read in chunks.

    Attributes:
        multipart_threshold: objects of at least this many bytes use multipart
            upload and parallel ranged gets.
        part_size: bytes per part and per ranged GET (S3 needs >= 5 MiB; raised
            automatically to keep an upload under 10,000 parts).
        max_concurrency: parts in flight per transfer (the pool's size).
        max_attempts: attempts per request, the first included.
        backoff_base_s: backoff multiplier: attempt n waits uniform(0, base × 2^n).
        backoff_max_s: the most one backoff waits.
        connect_timeout_s, read_timeout_s: socket timeouts per request.
        addressing_style: "auto", "path" or "virtual".
        checksum_algorithm: the flexible checksum of multipart parts ("CRC32"),
            or None for servers that do not support them.
    """

    multipart_threshold: int = 64 * MiB
    part_size: int = 16 * MiB
    max_concurrency: int = 4
    max_attempts: int = 5
    backoff_base_s: float = 0.1
    backoff_max_s: float = 5.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    addressing_style: str = "auto"
    checksum_algorithm: str | None = "CRC32"

    def __post_init__(self) -> None:
        if self.part_size < 5 * MiB:
            raise ConfigError(f"part_size must be >= 5 MiB (S3's minimum), got {self.part_size}", field="part_size")
        if self.multipart_threshold < 1:
            raise ConfigError("multipart_threshold must be >= 1", field="multipart_threshold")
        if self.max_concurrency < 1 or self.max_attempts < 1:
            raise ConfigError("max_concurrency and max_attempts must be >= 1", field="max_concurrency")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ConfigError("backoff times must be >= 0", field="backoff_base_s")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"unknown addressing_style {self.addressing_style!r}", field="addressing_style")


from backends.s3_util import (  # noqa: E402  (kept importable from here)
    _MISS,
    ChainReader,
    _code_status,
    _ObjectChanged,
    _ShortRead,
    _wait_all,
    is_retryable,
    parse_s3_url,
    slice_buffers,
    translate,
)


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix/<object name>``.

    Args:
        bucket: the bucket (must exist; a missing one gives ``TierUnavailableError``).
        prefix: a key prefix, ``/``-separated validated segments, or "".
        endpoint_url, region_name: passed to the boto3 client.
        config: transfer and retry settings.
        client: a ready boto3 S3 client to use instead of making one (the
            caller owns it: ``close`` leaves it open; it is not remade after fork).
        sleep: the backoff sleep (tests inject a no-op).
    """

    tier = "durable"
    survives = "cluster"
    zero_copy_get = False
    reservable = False
    atomic_create_once = True
    ranged_get = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        config: S3Config | None = None,
        client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(bucket, str) or not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ConfigError(f"invalid S3 bucket name {bucket!r}", field="bucket")
        prefix = prefix.strip("/")
        if prefix:
            try:
                validate_object_name(prefix)
            except InvalidKeyError as e:
                raise ConfigError(f"invalid S3 prefix {prefix!r}", field="prefix") from e
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.config = config or S3Config()
        self._sleep = sleep
        self._owns_client = client is None
        self._closed = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._client = client if client is not None else self._make_client()
        self._pool = self._make_pool()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Backend:
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, **options)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    # -- client, pool, fork ------------------------------------------------------------
    def _make_client(self) -> Any:
        cfg = self.config
        boto_cfg = BotoConfig(
            retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries, not botocore
            max_pool_connections=max(10, 2 * cfg.max_concurrency + 2),
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            s3={"addressing_style": cfg.addressing_style},
            tcp_keepalive=True,
        )
        # a fresh session per instance (its own credentials, resolved by the standard
        # chain), sharing only the read-only cache of parsed service models
        bs = botocore.session.Session()
        bs.register_component("data_loader", _shared_loader())
        session = boto3.session.Session(botocore_session=bs, region_name=self.region_name)
        return session.client("s3", endpoint_url=self.endpoint_url, config=boto_cfg)

    def _make_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix=f"s3-{self.bucket}")

    @property
    def client(self) -> Any:
        """The boto3 client of this process (remade after a fork)."""
        if self._closed:
            raise TierUnavailableError(f"S3 backend {self.url} is closed", bucket=self.bucket)
        if self._pid != os.getpid():
            # the child of a fork: the parent's sockets, threads and locks are not ours
            self._lock = threading.Lock()
            if self._owns_client:
                self._client = self._make_client()
            self._pool = self._make_pool()
            self._pid = os.getpid()
        return self._client

    def _key(self, name: str) -> str:
        validate_object_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, op: str, key: str, fn: Callable[[], Any], *, miss_ok: bool = False) -> Any:
        """Run ``fn`` with retries; translate its failure. Returns ``_MISS`` for a miss."""
        cfg = self.config
        attempts = 0

        def once() -> Any:
            nonlocal attempts
            attempts += 1
            return fn()

        retrying = Retrying(
            stop=stop_after_attempt(cfg.max_attempts),
            wait=wait_random_exponential(multiplier=cfg.backoff_base_s, max=cfg.backoff_max_s),
            retry=retry_if_exception(is_retryable),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            return retrying(once)
        except (ClientError, BotoCoreError, _ShortRead) as e:
            err = translate(e, op=op, key=key, bucket=self.bucket, attempts=attempts)
            if err is None:
                if miss_ok:
                    return _MISS
                err = TierUnavailableError(f"S3 {op} of {self.bucket}/{key}: not found", key=key, op=op)
            raise err from e

    # -- put -------------------------------------------------------------------------
    def put(self, name: str, data: Buffer | Sequence[Buffer], *, if_absent: bool = False) -> None:
        key = self._key(name)
        bufs = as_buffers(data)
        size = total_size(bufs)
        client = self.client
        cond = {"IfNoneMatch": "*"} if if_absent else {}
        if size < self.config.multipart_threshold:
            self._call("put", key, lambda: client.put_object(
                Bucket=self.bucket, Key=key, Body=ChainReader.body(bufs), **cond))
        else:
            self._multipart_put(client, key, bufs, size, cond)

    def _multipart_put(self, client: Any, key: str, bufs: list[memoryview], size: int, cond: dict) -> None:
        cfg = self.config
        part = max(cfg.part_size, -(-size // _MAX_PARTS))
        algo = {"ChecksumAlgorithm": cfg.checksum_algorithm} if cfg.checksum_algorithm else {}
        mpu = self._call("create_multipart_upload", key, lambda: client.create_multipart_upload(
            Bucket=self.bucket, Key=key, **algo))
        upload_id = mpu["UploadId"]
        futures: list[Future] = []
        try:
            for num, off in enumerate(range(0, size, part), start=1):
                views = slice_buffers(bufs, off, min(part, size - off))
                futures.append(self._pool.submit(self._upload_part, client, key, upload_id, num, views, algo))
            _wait_all(futures)
            parts = [f.result() for f in futures]
            self._call("complete_multipart_upload", key, lambda: client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **cond))
        except BaseException:
            wait(futures)
            try:
                self._call("abort_multipart_upload", key, lambda: client.abort_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id), miss_ok=True)
            except TierStoreError:
                pass  # the first failure is the one to report; a lifecycle rule reaps the rest
            raise

    def _upload_part(self, client: Any, key: str, upload_id: str, num: int, views: list[memoryview],
                     algo: dict) -> dict:
        resp = self._call(f"upload_part {num}", key, lambda: client.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=num,
            Body=ChainReader.body(views), **algo))
        out = {"PartNumber": num, "ETag": resp["ETag"]}
        if algo:
            ck = "Checksum" + algo["ChecksumAlgorithm"].upper()
            if resp.get(ck):
                out[ck] = resp[ck]
        return out

    # -- get -------------------------------------------------------------------------
    def get(self, name: str) -> bytes | memoryview | None:
        key = self._key(name)
        for _ in range(3):
            try:
                return self._get_once(key)
            except _ObjectChanged:
                continue  # overwritten mid-read: read the new version from the start
        raise TierUnavailableError(f"S3 object {self.bucket}/{key} kept changing while being read", key=key)

    def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        """The bytes ``[offset, offset + length)``: one ranged GET (``bytes=a-b``)."""
        check_range(offset, length)
        key = self._key(name)
        if length == 0:
            return b"" if self.exists(name) else None

        def fetch() -> bytes:
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
            except ClientError as e:
                if _code_status(e)[0] != "InvalidRange":  # 416: the object ends before offset
                    raise
                self.client.head_object(Bucket=self.bucket, Key=key)  # a miss raises here (NoSuchKey / 404)
                return b""
            body = r["Body"].read()
            if len(body) > length:
                raise _ShortRead(f"range at {offset} returned {len(body)} bytes, more than {length}")
            return body

        got = self._call("get range", key, fetch, miss_ok=True)
        return None if got is _MISS else got

    def tail(self, name: str, nbytes: int) -> bytes | None:
        """The last ``nbytes`` bytes: one ranged GET (``bytes=-n``)."""
        key = self._key(name)
        if nbytes <= 0:
            return b"" if self.exists(name) else None

        def fetch() -> bytes:
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=-{nbytes}")
            except ClientError as e:
                if _code_status(e)[0] != "InvalidRange":  # 416: an empty object
                    raise
                r = self.client.get_object(Bucket=self.bucket, Key=key)
            return r["Body"].read()

        got = self._call("get tail", key, fetch, miss_ok=True)
        return None if got is _MISS else got

    def _get_once(self, key: str) -> bytes | memoryview | None:
        client = self.client
        part = self.config.part_size

        def first() -> tuple[dict, bytes]:
            try:
                r = client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{part - 1}")
            except ClientError as e:
                if _code_status(e)[0] != "InvalidRange":  # 416: an empty object
                    raise
                r = client.get_object(Bucket=self.bucket, Key=key)
            return r, r["Body"].read()

        got = self._call("get", key, first, miss_ok=True)
        if got is _MISS:
            return None
        resp, head = got
        m = re.fullmatch(r"bytes \d+-\d+/(\d+)", resp.get("ContentRange") or "")
        total = int(m.group(1)) if m else len(head)
        if total == len(head):
            return head
        buf = bytearray(total)
        view = memoryview(buf)
        view[: len(head)] = head
        etag = resp["ETag"]
        ranges = [(s, min(s + part, total)) for s in range(len(head), total, part)]
        futures = [self._pool.submit(self._get_range, client, key, etag, view[s:e], s) for s, e in ranges]
        _wait_all(futures)
        return view.toreadonly()

    def _get_range(self, client: Any, key: str, etag: str, dst: memoryview, start: int) -> None:
        def fetch() -> None:
            try:
                r = client.get_object(Bucket=self.bucket, Key=key, IfMatch=etag,
                                      Range=f"bytes={start}-{start + dst.nbytes - 1}")
            except ClientError as e:
                if _code_status(e)[0] in ("PreconditionFailed", "NoSuchKey"):
                    raise _ObjectChanged(key) from e
                raise
            body, off = r["Body"], 0
            while chunk := body.read(_READ_CHUNK):
                if off + len(chunk) > dst.nbytes:
                    raise _ShortRead(f"range at {start} returned more than {dst.nbytes} bytes")
                dst[off: off + len(chunk)] = chunk
                off += len(chunk)
            if off != dst.nbytes:
                raise _ShortRead(f"range at {start} returned {off} of {dst.nbytes} bytes")

        self._call("get range", key, fetch)

    # -- the rest ----------------------------------------------------------------------
    def size(self, name: str) -> int | None:
        key = self._key(name)
        client = self.client
        r = self._call("head", key, lambda: client.head_object(Bucket=self.bucket, Key=key), miss_ok=True)
        return None if r is _MISS else int(r["ContentLength"])

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> bool:
        """Delete; whether it existed comes from a HEAD first (S3's DELETE does not tell)."""
        if not self.exists(name):
            return False
        key = self._key(name)
        client = self.client
        self._call("delete", key, lambda: client.delete_object(Bucket=self.bucket, Key=key))
        return True

    def delete_many(self, names: Iterable[str]) -> int:
        """HEAD each name, then one ``DeleteObjects`` per 1,000 that exist; returns how many."""
        present = [self._key(n) for n in names if self.exists(n)]
        client = self.client
        for i in range(0, len(present), 1000):
            batch = {"Objects": [{"Key": k} for k in present[i: i + 1000]], "Quiet": True}
            r = self._call("delete_objects", present[i],
                           functools.partial(client.delete_objects, Bucket=self.bucket, Delete=batch))
            if r.get("Errors"):
                first = r["Errors"][0]
                raise TierUnavailableError(
                    f"S3 delete of {len(r['Errors'])} object(s) failed, first {first.get('Key')}: "
                    f"{first.get('Code')}", key=first.get("Key"), code=first.get("Code"), bucket=self.bucket)
        return len(present)

    def list(self, prefix: str = "") -> Iterator[str]:
        client = self.client
        strip = len(self.prefix) + 1 if self.prefix else 0
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", full, functools.partial(client.list_objects_v2, **kw))
            for obj in page.get("Contents", []):
                name = obj["Key"][strip:]
                try:
                    yield validate_object_name(name)
                except InvalidKeyError:
                    continue  # a foreign key under our prefix
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._owns_client:
                self._client.close()

    def __repr__(self) -> str:
        return f"<S3Backend {self.url} endpoint={self.endpoint_url}>"
