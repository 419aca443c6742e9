"""The document's schema of a body a route reads itself (FastAPI documents only the models it
parses)."""

from typing import Any

from pydantic import BaseModel


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema (camelCase), nested models and all, for a body a route reads
    itself: FastAPI puts only the models it parses in the document's components."""
    schema = model.model_json_schema(by_alias=True)
    return dict(_inlined(schema, schema.pop("$defs", {})))


def _inlined(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with each `{"$ref": "#/$defs/<name>"}` replaced by that definition."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inlined(defs[schema["$ref"].removeprefix("#/$defs/")], defs)
        return {key: _inlined(value, defs) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_inlined(value, defs) for value in schema]
    return schema
