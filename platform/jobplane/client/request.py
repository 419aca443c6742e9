"""One run to create, as `Client.create` takes it and `POST /v1/runs` reads it."""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobplane.model import Scope


@dataclass(frozen=True)
class CreateRequest:
    """One run to create: the arguments of `Client.create`, as an item of `create_many`."""

    template_type: str
    scope: Scope
    scope_id: str
    payload: dict[str, Any] | None = None
    template_version: int | None = None
    priority: int | None = None
    delay_seconds: float | None = None
    not_before: datetime | None = None
    idempotency_key: str | None = None

    def body(self) -> dict[str, Any]:
        """The body of `POST /v1/runs`: camelCase, JSON-ready, without the fields left unset."""
        fields = {
            "templateType": self.template_type,
            "templateVersion": self.template_version,
            "scope": self.scope,
            "scopeId": self.scope_id,
            "payload": self.payload,
            "priority": self.priority,
            "delaySeconds": self.delay_seconds,
            "notBefore": self.not_before.isoformat() if self.not_before else None,
            "idempotencyKey": self.idempotency_key,
        }
        return {name: value for name, value in fields.items() if value is not None}
