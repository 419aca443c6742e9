"""What JSON can say that MongoDB cannot store, or would not give back as it was sent."""

import math
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator

T = TypeVar("T")

# Deeper than any real payload; MongoDB refuses documents past 100-odd levels, and the run or
# template around a payload adds its own.
MAX_DEPTH = 64
INT64 = (-(1 << 63), (1 << 63) - 1)
# One error per problem is enough to fix the input; a hostile one may have millions.
MAX_PROBLEMS = 10


def unstorable(value: Any, pointer: str = "") -> list[dict[str, str]]:
    """Each place in `value` (parsed JSON or YAML) that cannot be stored as sent: nesting past
    MAX_DEPTH, integers outside int64, NaN and infinities (BSON keeps them, JSON answers
    cannot), strings that are not UTF-8 (lone surrogates) and keys with a NUL."""
    problems: list[dict[str, str]] = []
    stack: list[tuple[Any, str, int]] = [(value, pointer, 0)]
    while stack and len(problems) < MAX_PROBLEMS:
        item, at, depth = stack.pop()
        problem = _problem(item, depth)
        if problem:
            problems.append({"pointer": at, "message": problem})
        elif isinstance(item, dict):
            for key, child in item.items():
                key_problem = _text_problem(key) or ("a key holds a NUL" if "\0" in key else "")
                if key_problem:
                    problems.append({"pointer": at, "message": key_problem})
                else:
                    stack.append((child, f"{at}/{_escape(key)}", depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{at}/{i}", depth + 1) for i, child in enumerate(item))
    return problems


def storable(value: T) -> T:
    """`value` as it is, if MongoDB can store it as sent; a pydantic validator, so it raises
    ValueError naming each problem."""
    if problems := unstorable(value):
        raise ValueError("; ".join(f"{p['message']} at '{p['pointer']}'" for p in problems))
    return value


# Any JSON a request carries into a document as it is (and that no service checks).
Storable = Annotated[Any, AfterValidator(storable)]


def _problem(item: Any, depth: int) -> str:
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(item, bool):
        return ""
    if isinstance(item, int) and not INT64[0] <= item <= INT64[1]:
        return "an integer outside the 64-bit range"
    if isinstance(item, float) and not math.isfinite(item):
        return "NaN and infinities are not JSON numbers"
    if isinstance(item, str):
        return _text_problem(item)
    return ""


def _text_problem(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        return "a string that is not valid UTF-8 (a lone surrogate escape)"
    return ""


def _escape(key: str) -> str:
    """A key as a JSON pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
