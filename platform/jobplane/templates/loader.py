"""Turn template files into validated `TemplateSpec`s.

YAML is parsed with the safe loader only, with a size cap, and with a cap on what its aliases
expand to, so a file cannot construct Python objects or balloon (a "billion laughs" parses in
microseconds into shared lists, and only blows up when stored or validated).
"""

import json
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import ValidationError

from jobplane.errors import ValidationFailed
from jobplane.model import StepSpec, TemplateSpec
from jobplane.model.graph import Graph, GraphError
from jobplane.model.storable import unstorable
from jobplane.templates.expressions import ITEM_NAMES, WHEN_NAMES, ExpressionError, check

MAX_TEMPLATE_BYTES = 1 << 20
# Values in a template once its aliases are expanded; a 1 MiB template without aliases has fewer.
MAX_TEMPLATE_VALUES = 200_000
SUFFIXES = {".yaml", ".yml", ".json"}


def parse_template(text: str | bytes, yaml_syntax: bool) -> TemplateSpec:
    """Parse and validate one template; raises `ValidationFailed` with a pointer per problem."""
    if len(text) > MAX_TEMPLATE_BYTES:
        raise ValidationFailed("template too large", [{"pointer": "", "message": "over 1 MiB"}])
    try:
        data: Any = yaml.safe_load(text) if yaml_syntax else json.loads(text)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        kind = "YAML" if yaml_syntax else "JSON"
        problem = {"pointer": "", "message": _syntax_error(exc)}
        raise ValidationFailed(f"malformed {kind}", [problem]) from exc
    return check_template(data)


def check_template(data: Any) -> TemplateSpec:
    """Validate a parsed template (a file's, a request's or one built in code); raises
    `ValidationFailed` with a pointer per problem."""
    if _values_over(data, MAX_TEMPLATE_VALUES):
        message = f"over {MAX_TEMPLATE_VALUES} values once its aliases are expanded"
        raise ValidationFailed("template too large", [{"pointer": "", "message": message}])
    if problems := unstorable(data):
        raise ValidationFailed("template cannot be stored as sent", problems)
    try:
        spec = TemplateSpec.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed("invalid template", pydantic_errors(exc)) from exc
    try:
        Draft202012Validator.check_schema(spec.payload_schema)
    except SchemaError as exc:
        pointer = "/payloadSchema" + "".join(f"/{p}" for p in exc.absolute_path)
        raise ValidationFailed(
            "payloadSchema is not a valid JSON Schema",
            [{"pointer": pointer, "message": exc.message}],
        ) from exc
    if problems := nonsense(spec):
        raise ValidationFailed("invalid template", problems)
    return spec


def _syntax_error(exc: Exception) -> str:
    """Where the text stops parsing, by line and column, and why: PyYAML's own text names the
    input `"<byte string>"` and spans lines."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        said = f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
        if exc.context and exc.context_mark is not None:
            start = exc.context_mark
            said += f" ({exc.context} at line {start.line + 1}, column {start.column + 1})"
        return said
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    return " ".join(str(exc).split())


def nonsense(spec: TemplateSpec) -> list[dict[str, Any]]:
    """What each field allows alone but the template cannot mean, with a pointer each."""
    problems: list[dict[str, Any]] = []

    def refuse(pointer: str, message: str) -> None:
        problems.append({"pointer": pointer, "message": message})

    ids = [s.id for s in spec.steps]
    if len(set(ids)) != len(ids):
        refuse("/steps", f"step ids must be unique; ids: {ids}")
    else:
        try:
            Graph.of([(s.id, s.needs) for s in spec.steps])
        except GraphError as exc:
            for pointer, message in exc.problems:
                refuse(pointer, message)
    if "concurrency_limit" in spec.model_fields_set and spec.concurrency_policy == "allow":
        refuse(
            "/concurrencyLimit",
            "concurrencyLimit needs a concurrencyPolicy (reject_same_scope, queue_same_scope "
            "or cancel_previous): with allow, any number of runs may be active",
        )
    if spec.concurrency_limit > 1 and not spec.repeatable:
        # A key of a template that is not repeatable may see one run succeed, ever: two
        # active at once could both succeed.
        refuse("/concurrencyLimit", "a template that is not repeatable allows 1 run per key")
    for i, step in enumerate(spec.steps):
        if step.when is not None:
            try:
                check(step.when, WHEN_NAMES)
            except ExpressionError as exc:
                refuse(f"/steps/{i}/when", str(exc))
        if step.map is not None:
            for field, source, seen in (
                ("items", step.map.items, WHEN_NAMES),
                ("payload", step.map.payload, ITEM_NAMES),
            ):
                if source is None:
                    continue
                try:
                    check(source, seen)
                except ExpressionError as exc:
                    refuse(f"/steps/{i}/map/{field}", str(exc))
            # Its children have their own; a map step itself waits and retries nothing.
            for field in ("locks", "timeout_seconds", "retry_policy"):
                if field in step.model_fields_set:
                    name = StepSpec.model_fields[field].alias or field
                    refuse(f"/steps/{i}/{name}", f"a map step has no {name}: its children do")
        names = [lock.name for lock in step.locks]
        for j, name in enumerate(names):
            if name in names[:j]:
                refuse(f"/steps/{i}/locks/{j}", f"lock {name!r} is listed twice")
    return problems


def _values_over(data: Any, limit: int) -> bool:
    """Whether `data` holds more than `limit` values, counting a shared value at each place it
    appears (as storing it would); stops counting at the limit."""
    stack, seen = [data], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def load_file(path: Path) -> TemplateSpec:
    return parse_template(path.read_bytes(), yaml_syntax=path.suffix != ".json")


def load_path(path: Path) -> list[TemplateSpec]:
    """One file, or every template file in a directory (sorted by name)."""
    if path.is_dir():
        return [load_file(p) for p in sorted(path.iterdir()) if p.suffix in SUFFIXES]
    return [load_file(path)]


def pydantic_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors as `{pointer, message}` with JSON pointers (RFC 6901)."""
    out = []
    for err in exc.errors():
        parts = [str(p).replace("~", "~0").replace("/", "~1") for p in err["loc"]]
        out.append({"pointer": "".join(f"/{p}" for p in parts), "message": err["msg"]})
    return out
