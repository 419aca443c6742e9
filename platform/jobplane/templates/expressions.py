"""The Common Expression Language (CEL) expressions templates carry: a step's `when`, and a
map step's `items` and children's `payload`.

Evaluated by `common-expression-language` (a Rust CEL engine): it takes and gives plain JSON
values, compares a JSON integer with a float as a reader expects, and names a syntax error's
line and column. Each expression is compiled once per process and reused; a compiled program
is safe to share between threads.
"""

import re
from functools import lru_cache
from typing import Any

import cel

# What a step's `when` and a map's `items` see (`worker/flow.py` builds it).
WHEN_NAMES = frozenset({"payload", "outputs", "run"})
# What a map's `payload` sees, once per item.
ITEM_NAMES = frozenset({"item", "index", "payload", "outputs"})
# A comprehension's own variable (`payload.xs.all(x, x > 1)`), which `variables()` lists too.
_BOUND = re.compile(r"\.\s*(?:map|filter|all|exists|exists_one)\s*\(\s*([A-Za-z_]\w*)\s*,")
_SYNTAX = re.compile(r"<input>:(\d+):(\d+): (?:Syntax error: )?(.*)")


class ExpressionError(ValueError):
    """An expression that does not compile, names what it cannot see, or fails as it runs."""


def check(source: str, names: frozenset[str]) -> None:
    """Compile `source`; `ExpressionError` if it does not, or if it names a top-level
    variable other than `names`."""
    _compiled(source, names)


def evaluate_when(source: str, activation: dict[str, Any]) -> bool:
    """A step's `when` over `activation`: whether the step runs. `ExpressionError` if it
    fails, or gives anything but true or false."""
    value = _evaluate(source, WHEN_NAMES, activation)
    if not isinstance(value, bool):
        raise ExpressionError(f"gave {value!r}, not true or false")
    return value


def evaluate_items(source: str, activation: dict[str, Any]) -> list[Any]:
    """A map's `items` over `activation` (as a `when`'s): the list to fan out over."""
    value = _evaluate(source, WHEN_NAMES, activation)
    if not isinstance(value, list):
        raise ExpressionError(f"gave {type(value).__name__} {_short(value)}, not a list")
    return value


def evaluate_payload(source: str, activation: dict[str, Any]) -> dict[str, Any]:
    """A map's child `payload` over one item's `activation`: an object, as every payload."""
    value = _evaluate(source, ITEM_NAMES, activation)
    if not isinstance(value, dict):
        raise ExpressionError(f"gave {type(value).__name__} {_short(value)}, not an object")
    return value


def _evaluate(source: str, names: frozenset[str], activation: dict[str, Any]) -> Any:
    program = _compiled(source, names)
    used = set(program.variables())
    try:
        # Only what it reads: the engine converts every value it is handed.
        return program.execute({k: v for k, v in activation.items() if k in used})
    except KeyError as exc:
        raise ExpressionError(f"no such key: {exc.args[0]!r}") from None
    except Exception as exc:  # the engine raises TypeError, RuntimeError, ZeroDivisionError…
        raise ExpressionError(f"{type(exc).__name__}: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@lru_cache(maxsize=1024)
def _compiled(source: str, names: frozenset[str]) -> Any:
    try:
        program = cel.compile(source)
    except ValueError as exc:
        found = _SYNTAX.search(str(exc))
        where = f"syntax error at {found[1]}:{found[2]}: {found[3]}" if found else str(exc)
        raise ExpressionError(where) from None
    unknown = sorted(set(program.variables()) - names - set(_BOUND.findall(source)))
    if unknown:
        allowed = ", ".join(sorted(names))
        raise ExpressionError(f"unknown name {', '.join(unknown)} (it may use {allowed})")
    return program
