"""The Common Expression Language (CEL) expressions templates carry: a step's `when`.

Evaluated by `common-expression-language` (a Rust CEL engine): it takes and gives plain JSON
values, compares a JSON integer with a float as a reader expects, and names a syntax error's
line and column. Each expression is compiled once per process and reused; a compiled program
is safe to share between threads.
"""

import re
from functools import lru_cache
from typing import Any

import cel

# What a step's `when` sees (`worker/flow.py` builds it).
WHEN_NAMES = frozenset({"payload", "outputs", "run"})
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
    program = _compiled(source, WHEN_NAMES)
    used = set(program.variables())
    try:
        # Only what it reads: the engine converts every value it is handed.
        value = program.execute({k: v for k, v in activation.items() if k in used})
    except KeyError as exc:
        raise ExpressionError(f"no such key: {exc.args[0]!r}") from None
    except Exception as exc:  # the engine raises TypeError, RuntimeError, ZeroDivisionError…
        raise ExpressionError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(value, bool):
        raise ExpressionError(f"gave {value!r}, not true or false")
    return value


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
