"""ShardKey: validation, the string form, parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierstore.errors import InvalidKeyError
from tierstore.keys import MAX_STEP, ShardKey

NAME = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=40).filter(lambda s: s != "." and ".." not in s)


@given(NAME, NAME, st.integers(0, MAX_STEP), st.integers(0, 2**20))
def test_round_trip(model, layer, step, rank):
    k = ShardKey(model, layer, step, rank)
    assert ShardKey.parse(str(k)) == k
    assert hash(k) == hash(ShardKey.parse(str(k)))


@pytest.mark.parametrize(
    "args, field",
    [
        (("", "l", 1, 0), "model"),
        (("m/x", "l", 1, 0), "model"),
        (("..", "l", 1, 0), "model"),
        (("m", "a..b", 1, 0), "layer"),
        (("m", "l\x00", 1, 0), "layer"),
        (("m", "x" * 201, 1, 0), "layer"),
        (("m", "l", -1, 0), "step"),
        (("m", "l", True, 0), "step"),
        (("m", "l", 1.0, 0), "step"),
        (("m", "l", MAX_STEP + 1, 0), "step"),
        (("m", "l", 2**62, 0), "step"),
        (("m", "l", 1, -3), "rank"),
        ((3, "l", 1, 0), "model"),
    ],
)
def test_invalid_fields_name_the_field(args, field):
    with pytest.raises(InvalidKeyError) as ei:
        ShardKey(*args)
    assert ei.value.field == field
    assert field in str(ei.value)


@pytest.mark.parametrize("text", ["m/l/1", "m/l/1/0/x", "m/l/01/0", "m/l/-1/0", "m/l/1/ 0", "../l/1/0", "", 5])
def test_parse_rejects(text):
    with pytest.raises(InvalidKeyError):
        ShardKey.parse(text)


def test_frozen():
    k = ShardKey("m", "l", 1, 0)
    with pytest.raises(AttributeError):
        k.step = 2  # type: ignore[misc]
    assert str(k) == "m/l/1/0" and k.with_step(5) == ShardKey("m", "l", 5, 0)
