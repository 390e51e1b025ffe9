"""What the store's write and read paths share: the reserved metadata entry and key parsing."""

from __future__ import annotations

from tierstore.errors import InvalidKeyError
from tierstore.keys import ShardKey

__all__ = ["INTERNAL", "UNREAD", "check_key"]

INTERNAL = "_ts"  # metadata entry holding kind/base/target, so objects describe themselves
UNREAD = object()  # _get's record argument when the caller has not read the index yet


def check_key(key: object) -> ShardKey:
    """``key`` as a :class:`ShardKey` (a ``'model/layer/step/rank'`` string is parsed).

    Raises:
        InvalidKeyError: neither a ShardKey nor a well-formed key string.
    """
    if isinstance(key, ShardKey):
        return key
    if isinstance(key, str):
        return ShardKey.parse(key)
    raise InvalidKeyError(f"a key must be a ShardKey or 'model/layer/step/rank', got {type(key).__name__}", field="key")
