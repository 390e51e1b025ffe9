"""Shard keys: ``ShardKey(model, layer, step, rank)``, written ``model/layer/step/rank``.

This module imports nothing of the project but :mod:`tierstore.errors`, so
every layer may use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierstore.errors import InvalidKeyError

__all__ = ["MAX_NAME_LEN", "ShardKey", "validate_name"]

MAX_NAME_LEN = 200
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_INT_RE = re.compile(r"(0|[1-9][0-9]{0,18})")


def validate_name(value: object, field: str) -> str:
    """Return ``value`` if it is a valid model or layer name, else raise.

    A name is 1 to 200 characters of ``[A-Za-z0-9._-]``, is not ``.`` and
    holds no ``..`` (so it is always safe as a path segment).

    Raises:
        InvalidKeyError: naming ``field`` and what is wrong.
    """
    if not isinstance(value, str):
        raise InvalidKeyError(f"{field} must be a str, got {type(value).__name__}", field=field)
    if not value:
        raise InvalidKeyError(f"{field} must not be empty", field=field)
    if len(value) > MAX_NAME_LEN:
        raise InvalidKeyError(
            f"{field} is {len(value)} characters long; at most {MAX_NAME_LEN} are allowed",
            field=field,
        )
    if not _NAME_RE.fullmatch(value):
        bad = next(c for c in value if not _NAME_RE.fullmatch(c))
        raise InvalidKeyError(
            f"{field} {value[:60]!r} holds {bad!r}; only letters, digits, '.', '_' and '-' are allowed",
            field=field,
        )
    if value == "." or ".." in value:
        raise InvalidKeyError(f"{field} {value!r} must not be '.' or contain '..'", field=field)
    return value


def _validate_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidKeyError(f"{field} must be an int, got {type(value).__name__}", field=field)
    if value < 0:
        raise InvalidKeyError(f"{field} must be non-negative, got {value}", field=field)
    if value >= 2**63:
        raise InvalidKeyError(f"{field} {value} is too large", field=field)
    return value


@dataclass(frozen=True, order=True, slots=True)
class ShardKey:
    """What one rank holds of one layer at one step.

    Frozen and hashable; validated on construction. ``str(key)`` gives the
    canonical ``model/layer/step/rank`` form and :meth:`parse` reads it back.
    """

    model: str
    layer: str
    step: int
    rank: int

    def __post_init__(self) -> None:
        validate_name(self.model, "model")
        validate_name(self.layer, "layer")
        _validate_int(self.step, "step")
        _validate_int(self.rank, "rank")

    def __str__(self) -> str:
        return f"{self.model}/{self.layer}/{self.step}/{self.rank}"

    @property
    def path(self) -> str:
        """The key as an object name below a tier's root (same as ``str``)."""
        return str(self)

    def with_step(self, step: int) -> ShardKey:
        return ShardKey(self.model, self.layer, step, self.rank)

    def with_rank(self, rank: int) -> ShardKey:
        return ShardKey(self.model, self.layer, self.step, rank)

    @classmethod
    def parse(cls, text: object) -> ShardKey:
        """Parse ``model/layer/step/rank``.

        Raises:
            InvalidKeyError: naming the field that is wrong.
        """
        if not isinstance(text, str):
            raise InvalidKeyError(f"a key must be a str, got {type(text).__name__}", field="key")
        parts = text.split("/")
        if len(parts) != 4:
            raise InvalidKeyError(
                f"a key has the form model/layer/step/rank; {text[:80]!r} has {len(parts)} parts",
                field="key",
            )
        model, layer, step, rank = parts
        for name, value in (("step", step), ("rank", rank)):
            if not _INT_RE.fullmatch(value):
                raise InvalidKeyError(f"{name} {value[:40]!r} is not a non-negative integer", field=name)
        return cls(model, layer, int(step), int(rank))
