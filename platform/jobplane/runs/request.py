"""A create request as producers send it, checked alike by the API and the direct client.

`RunCreate` is the body of `POST /v1/runs` (and an item of `POST /v1/runs/batch`); a body that
passes it, and whose payload is within the size limit, becomes the service's `RunRequest`.
"""

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictStr, ValidationError

from jobplane.errors import PayloadTooLarge, ValidationFailed
from jobplane.model import JSON_INTEGER, Instant, ScopeId, Version
from jobplane.model.bodies import RequestBody
from jobplane.model.storable import storable
from jobplane.runs.service import RunRequest


class RunCreate(RequestBody):
    # Not a `Name`: a type no template has is looked up and not found (404). Only a string
    # that cannot even be sent to MongoDB (a lone surrogate) is refused.
    template_type: Annotated[StrictStr, AfterValidator(storable)]
    template_version: Version | None = None
    scope: Literal["user", "account", "system"]
    scope_id: ScopeId
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: Annotated[int, Field(ge=-100, le=100), JSON_INTEGER] | None = None
    delay_seconds: Annotated[float, Field(ge=0, le=366 * 86400)] | None = None
    not_before: Instant | None = None
    idempotency_key: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = None


def run_request(body: RunCreate, max_payload_bytes: int) -> RunRequest:
    """The service's request for a valid body, unless its payload is over the size limit."""
    # `surrogatepass`: a string UTF-8 cannot encode is measured here and refused by the service.
    compact = json.dumps(body.payload, ensure_ascii=False, separators=(",", ":"))
    size = len(compact.encode(errors="surrogatepass"))
    if size > max_payload_bytes:
        raise PayloadTooLarge(
            f"payload is {size} bytes; the limit is {max_payload_bytes}",
            {"limit": max_payload_bytes, "size": size},
        )
    return RunRequest(**body.model_dump())


def read_request(body: Mapping[str, Any], max_payload_bytes: int) -> RunRequest:
    """The service's request for a body as sent (camelCase), refused as the API refuses it:
    `ValidationFailed` pointing at each bad field, or `PayloadTooLarge`."""
    try:
        valid = RunCreate.model_validate(body)
    except ValidationError as exc:
        problems = [
            {"pointer": "".join(f"/{p}" for p in e["loc"]), "message": e["msg"]}
            for e in exc.errors()
        ]
        raise ValidationFailed("invalid request", problems) from None
    return run_request(valid, max_payload_bytes)
