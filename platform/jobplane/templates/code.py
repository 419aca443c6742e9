"""Templates defined in Python, beside their handlers.

    report = Template(
        "report",
        payload=Report,  # a pydantic model, or a JSON Schema dict
        steps=[Step("render", render, timeout_seconds=60), Step("email", "mail.send")],
        retry_policy={"maxAttempts": 3},
    )

A field is named as in YAML, in snake_case or camelCase, at any depth. A `Template` is checked
when it is made, as registering it would check it (`check_template`), so a mistake is refused
with the same message and pointer as `POST /v1/templates` gives; registering it sends `body()`.
"""

import importlib
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from jobplane.errors import ValidationFailed
from jobplane.model import TemplateSpec
from jobplane.templates.loader import check_template
from jobplane.worker.handlers import Handler, registry


@dataclass(frozen=True, init=False)
class Step:
    """One step: `Step(id, handler, **fields)`. `handler` is a function (registered with
    `@handler(name)`, or at the top level of a module the workers load) or a handler's name;
    a map step has none. Checked with its template."""

    body: Mapping[str, Any]

    def __init__(self, id: str, handler: Handler | str | None = None, **fields: Any) -> None:
        body: dict[str, Any] = {"id": id, **fields}
        if handler is not None:
            body["handler"] = handler if isinstance(handler, str) else registry.name_of(handler)
        object.__setattr__(self, "body", MappingProxyType(body))


@dataclass(frozen=True, init=False)
class Template:
    """A template defined in code; `spec` is what registering it stores."""

    spec: TemplateSpec

    def __init__(
        self,
        type: str,
        *,
        steps: Sequence[Step | Mapping[str, Any]],
        payload: type[BaseModel] | Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        data: dict[str, Any] = _camel({"type": type, **fields})
        data["steps"] = [_camel(s.body if isinstance(s, Step) else s) for s in steps]
        if payload is not None:
            if "payloadSchema" in data:
                problem = {"pointer": "/payloadSchema", "message": "give payload or payload_schema"}
                raise ValidationFailed("invalid template", [problem])
            data["payloadSchema"] = (
                payload.model_json_schema() if inspect.isclass(payload) else dict(payload)
            )
        object.__setattr__(self, "spec", check_template(data))

    @property
    def type(self) -> str:
        return self.spec.type

    def body(self) -> dict[str, Any]:
        """The template as `POST /v1/templates` takes it: camelCase JSON, the fields given."""
        return self.spec.model_dump(by_alias=True, mode="json", exclude_unset=True)

    def yaml(self) -> str:
        """`body()` as a YAML template file."""
        return yaml.safe_dump(self.body(), sort_keys=False, allow_unicode=True)


# The author's own JSON Schema: its property names are the payload's.
_AS_GIVEN = {"payload_schema", "payloadSchema"}


def _camel(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Field names as the YAML form spells them, at any depth, so that a refusal points where
    `POST /v1/templates` would; a payload schema is the author's own and kept as it is."""
    return {to_camel(k): v if k in _AS_GIVEN else _camel_any(v) for k, v in fields.items()}


def _camel_any(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _camel(value)
    if isinstance(value, list | tuple):
        return [_camel_any(v) for v in value]
    return value


# `package.module:attribute`, as `JOBPLANE_HANDLERS` and uvicorn name things to import.
CODE_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def load_code(ref: str) -> list[Template]:
    """The templates `package.module:attribute` names: a `Template`, or a list or tuple of
    them. A `LookupError` says what is missing; the module's own errors propagate."""
    module_name, _, attr = ref.partition(":")
    try:
        value: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name + ".").startswith(exc.name + "."):
            raise LookupError(
                f"module {module_name!r} not found: is its folder on PYTHONPATH?"
            ) from None
        raise
    for part in attr.split("."):
        if not hasattr(value, part):
            raise LookupError(f"{module_name!r} has no attribute {attr!r}")
        value = getattr(value, part)
    found = list(value) if isinstance(value, list | tuple) else [value]
    templates = [t for t in found if isinstance(t, Template)]
    if not found or len(templates) != len(found):
        raise LookupError(f"{ref} is not a jobplane Template or a list of them")
    return templates
