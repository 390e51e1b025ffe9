"""Helpers of the S3 backend: request bodies over the caller's buffers, and the one error table."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError, SSLError
from botocore.exceptions import ConnectionError as BotoConnectionError

from tierstore.errors import (
    AccessDeniedError,
    ConfigError,
    KeyExistsError,
    TierStoreError,
    TierUnavailableError,
)

__all__ = ["ERROR_CODES", "RETRY_CODES", "ChainReader", "is_retryable", "parse_s3_url", "slice_buffers", "translate"]

# -- request bodies over the caller's buffers (no concatenation) --------------------


class ChainReader(io.RawIOBase):
    """A seekable, read-only file over memoryviews read in order (botocore's request body).

    botocore reads a body to checksum it, seeks back, streams it, and seeks
    back before a retry: this does all that without joining the buffers.
    """

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._views = [v for v in views if v.nbytes]
        self._size = sum(v.nbytes for v in self._views)
        self._pos = 0

    @staticmethod
    def body(views: Sequence[memoryview]) -> bytes | bytearray | ChainReader:
        """The cheapest body botocore takes: the underlying object when one view is all of it."""
        live = [v for v in views if v.nbytes]
        if not live:
            return b""
        if len(live) == 1 and isinstance(live[0].obj, (bytes, bytearray)) and live[0].nbytes == len(live[0].obj):
            return live[0].obj
        return ChainReader(live)

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = start = 0
        for v in self._views:
            end = start + v.nbytes
            if n < out.nbytes and start <= self._pos < end:
                k = min(end - self._pos, out.nbytes - n)
                out[n: n + k] = v[self._pos - start: self._pos - start + k]
                n += k
                self._pos += k
            start = end
        return n


def slice_buffers(views: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """The views covering bytes ``[start, start + length)`` of the buffers' concatenation."""
    out: list[memoryview] = []
    pos = 0
    end = start + length
    for v in views:
        lo, hi = max(start, pos), min(end, pos + v.nbytes)
        if lo < hi:
            out.append(v[lo - pos: hi - pos])
        pos += v.nbytes
        if pos >= end:
            break
    return out


# -- the one error table -----------------------------------------------------------

_MISS: Any = object()  # a table entry: "not there", which get/exists/size answer with None/False

#: S3 error code -> what it means here. Looked up before the HTTP status.
ERROR_CODES: dict[str, Any] = {
    "NoSuchKey": _MISS,
    "NotFound": _MISS,
    "404": _MISS,
    "AccessDenied": AccessDeniedError,
    "403": AccessDeniedError,
    "Forbidden": AccessDeniedError,
    "AllAccessDisabled": AccessDeniedError,
    "InvalidAccessKeyId": AccessDeniedError,
    "SignatureDoesNotMatch": AccessDeniedError,
    "ExpiredToken": AccessDeniedError,
    "InvalidToken": AccessDeniedError,
    "AccountProblem": AccessDeniedError,
    "NoSuchBucket": TierUnavailableError,
    "NoSuchUpload": TierUnavailableError,
    "InvalidBucketName": ConfigError,
    "PreconditionFailed": KeyExistsError,
    "412": KeyExistsError,
    "ConditionalRequestConflict": KeyExistsError,
}
#: HTTP status -> meaning, where the code is not in ERROR_CODES.
ERROR_STATUS: dict[int, Any] = {404: _MISS, 403: AccessDeniedError, 412: KeyExistsError}
#: codes retried whatever their status (S3 sends throttling as 503 SlowDown, some servers as 429/400).
RETRY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
     "RequestThrottled", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeTooSkewed"}
)


def _wait_all(futures: Sequence[Future]) -> None:
    """Wait for all; on the first failure cancel what has not started and raise that failure."""
    _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


class _ShortRead(Exception):
    """A ranged GET body was shorter or longer than its range (retried)."""


class _ObjectChanged(Exception):
    """The object was overwritten between the ranged GETs of one get()."""


def _code_status(e: ClientError) -> tuple[str, int]:
    resp = getattr(e, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_retryable(e: BaseException) -> bool:
    """Whether a request that raised ``e`` may succeed when sent again."""
    if isinstance(e, ClientError):
        code, status = _code_status(e)
        return status >= 500 or status == 429 or code in RETRY_CODES
    if isinstance(e, SSLError):
        return False  # a certificate problem does not heal by retrying
    return isinstance(e, (BotoConnectionError, HTTPClientError, IncompleteReadError, _ShortRead))


def translate(e: BaseException, *, op: str, key: str, bucket: str, attempts: int = 1) -> TierStoreError | None:
    """Map a boto error to the tierstore error for it; ``None`` means "no such object".

    Retryable errors that reach here have used up their attempts and become
    :class:`TierUnavailableError` naming the key and the attempts.
    """
    fields = {"key": key, "bucket": bucket, "op": op, "attempts": attempts, "tier": "durable"}
    if isinstance(e, ClientError):
        code, status = _code_status(e)
        fields.update(code=code, status=status)
        kind = ERROR_CODES.get(code, ERROR_STATUS.get(status))
        if kind is _MISS:
            return None
        if kind is TierUnavailableError and code == "NoSuchBucket":
            return TierUnavailableError(f"S3 bucket {bucket!r} does not exist ({op} of {key!r})", **fields)
        if kind is KeyExistsError:
            return KeyExistsError(f"S3 object {bucket}/{key} already exists (create-once {op})", **fields)
        if kind is not None:
            return kind(f"S3 {op} of {bucket}/{key} failed: {code} (HTTP {status})", **fields)
    if is_retryable(e):
        return TierUnavailableError(
            f"S3 {op} of {bucket}/{key} failed after {attempts} attempt(s): {e}", **fields
        )
    return TierStoreError(f"S3 {op} of {bucket}/{key} failed: {e}", **fields)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``."""
    m = re.fullmatch(r"s3://([^/]+)/?(.*)", url)
    if not m:
        raise ConfigError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)", field="url")
    return m.group(1), m.group(2).strip("/")


