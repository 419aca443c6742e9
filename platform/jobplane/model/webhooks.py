"""Webhooks: a subscription of one scope's run events, and each delivery of an event to it."""

from datetime import datetime
from typing import Literal

from pydantic import Field

from jobplane.model.documents import Document, Scope

# What a subscriber may ask for, as the contract names them (docs/contract.md, "Webhooks").
WebhookEventType = Literal[
    "run.created",
    "run.started",
    "run.succeeded",
    "run.failed",
    "run.cancelled",
    "run.expired",
    "run.retrying",
    "run.progress",
    "step.succeeded",
    "step.failed",
    "step.skipped",
]
DeliveryStatus = Literal["pending", "succeeded", "failed"]


class Webhook(Document):
    """A subscription as the API shows it: everything but its secrets."""

    id: str
    url: str
    # `["*"]` for every type.
    events: list[str]
    scope: Scope
    scope_id: str
    description: str | None = None
    enabled: bool = True
    disabled_at: datetime | None = None
    disabled_reason: str | None = None
    # Since when every delivery has failed (none has succeeded since); None while one does.
    failing_since: datetime | None = None
    created_by: str
    create_at: datetime
    update_at: datetime
    # Orders the webhook's own events in the trail, as a run's version does.
    version: int = 1

    def wants(self, kind: str) -> bool:
        return "*" in self.events or kind in self.events


class Secret(Document):
    """A signing secret; one replaced by a rotation still signs until `until`."""

    secret: str
    until: datetime | None = None


class SignedWebhook(Webhook):
    """A webhook as the notifier reads it: with the secrets it signs with."""

    secrets: list[Secret] = Field(default_factory=list)

    def signing(self, now: datetime) -> list[str]:
        return [s.secret for s in self.secrets if s.until is None or s.until > now]


class Delivery(Document):
    """One event for one webhook, and how its tries went."""

    id: str
    # `msg_<event id>`, the same on every try (`webhook-id`): receivers dedupe by it.
    message_id: str
    webhook_id: str
    event_id: str
    type: str
    run_id: str
    # Orders one run's deliveries (docs/contract.md, "Webhooks").
    sequence: int
    status: DeliveryStatus
    attempts: int = 0
    last_status_code: int | None = None
    last_error: str | None = None
    last_attempt_at: datetime | None = None
    # When the next try is due (None once the delivery succeeded or failed).
    next_attempt_at: datetime | None = None
    delivered_at: datetime | None = None
    create_at: datetime
