import pytest

from jobplane.model.storable import MAX_DEPTH, unstorable


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "pointer", "problem"),
    [
        ({"a": [1, {"b/c": float("nan")}]}, "/a/1/b~1c", "NaN"),
        ({"n": 1 << 63}, "/n", "64-bit"),
        ({"n": -(1 << 63) - 1}, "/n", "64-bit"),
        ({"s": "\ud800"}, "/s", "UTF-8"),
        ({"k\0": 1}, "", "NUL"),
        ({"\ud800": 1}, "", "UTF-8"),
        ({"deep": nested(MAX_DEPTH)}, "/deep" + "/0" * MAX_DEPTH, "deeper"),
    ],
)
def test_each_unstorable_value_is_named_by_its_pointer(
    value: object, pointer: str, problem: str
) -> None:
    [found] = unstorable(value)
    assert found["pointer"] == pointer and problem in found["message"]


def test_what_json_and_bson_share_is_storable() -> None:
    value = {"$gt": "", "a.b": [True, None, 1.5, -(1 << 63), "日本", {"~": []}]}
    assert unstorable(value) == []
    assert unstorable(nested(MAX_DEPTH)) == []


def test_a_hostile_value_gets_a_bounded_answer() -> None:
    assert len(unstorable([float("nan")] * 100_000)) == 10
