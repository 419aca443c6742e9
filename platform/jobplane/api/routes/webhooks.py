"""Webhooks: subscribe a URL to one scope's run events; read, change, delete; its deliveries."""

import base64
import secrets
from datetime import timedelta
from typing import Annotated, get_args

from bson import ObjectId
from fastapi import APIRouter
from pydantic import AfterValidator, Field, StrictBool, StrictStr

from jobplane.api import pages
from jobplane.api.auth import Caller
from jobplane.api.deps import StoreDep, WebhookReader, WebhookWriter
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.pages import Cursor, Limit
from jobplane.errors import NotFound
from jobplane.model import Scope, ScopeId
from jobplane.model.answers import Page
from jobplane.model.bodies import RequestBody
from jobplane.model.webhooks import Delivery, Secret, SignedWebhook, Webhook, WebhookEventType
from jobplane.store import Store
from jobplane.webhooks.guard import MAX_URL_LENGTH, URL_PATTERN, check_url

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=ERROR_RESPONSES)

# A rotated secret still signs this long, so receivers can move to the new one.
ROTATION_OVERLAP = timedelta(hours=24)

# The pattern is only shown: `check_url` says what is wrong in words.
Url = Annotated[
    StrictStr,
    Field(max_length=MAX_URL_LENGTH, json_schema_extra={"pattern": URL_PATTERN}),
    AfterValidator(check_url),
]
_EVENT_TYPES = (*get_args(WebhookEventType), "*")


def _known(kind: str) -> str:
    if kind not in _EVENT_TYPES:
        raise ValueError(f"not an event type: one of {', '.join(_EVENT_TYPES)}")
    return kind


Events = Annotated[
    list[Annotated[StrictStr, AfterValidator(_known)]],
    Field(min_length=1, max_length=20, json_schema_extra={"items": {"enum": list(_EVENT_TYPES)}}),
    AfterValidator(lambda events: list(dict.fromkeys(events))),
]
Description = Annotated[StrictStr, Field(max_length=1000)]


class WebhookCreate(RequestBody):
    url: Url
    events: Events
    scope: Scope
    scope_id: ScopeId
    description: Description | None = None


class WebhookChange(RequestBody):
    """What a `PATCH` may change; `enabled: true` re-enables a disabled webhook."""

    url: Url | None = None
    events: Events | None = None
    description: Description | None = None
    enabled: StrictBool | None = None


class WebhookCreated(Webhook):
    """A webhook and its signing secret, `secret`: shown here once."""

    secret: str


def _new_secret() -> str:
    # Standard Webhooks: a base64 secret of 24 to 64 bytes, with the `whsec_` prefix.
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


async def _visible(store: Store, caller: Caller, webhook_id: str) -> SignedWebhook:
    hook = await store.webhooks.get(webhook_id)
    if hook is None or not caller.sees(hook.scope, hook.scope_id):
        raise NotFound(f"webhook {webhook_id!r} not found")
    return hook


def _shown(hook: SignedWebhook) -> Webhook:
    return Webhook.model_validate(hook.model_dump(exclude={"secrets"}))


@router.post(
    "",
    summary="Subscribe a URL to run events",
    status_code=201,
    response_model=WebhookCreated,
    response_model_by_alias=True,
)
async def create(body: WebhookCreate, store: StoreDep, caller: WebhookWriter) -> WebhookCreated:
    """A new webhook of one scope's runs, with a `webhook_created` event. `secret` signs its
    deliveries (Standard Webhooks) and is shown only here."""
    caller.may_act_in(body.scope, body.scope_id)
    now = store.clock.now()
    secret = _new_secret()
    hook = SignedWebhook(
        id=str(ObjectId()),
        url=body.url,
        events=list(body.events),
        scope=body.scope,
        scope_id=body.scope_id,
        description=body.description,
        created_by=caller.actor,
        create_at=now,
        update_at=now,
        secrets=[Secret(secret=secret)],
    )
    await store.webhooks.insert(hook)
    return WebhookCreated(**_shown(hook).model_dump(), secret=secret)


@router.get("", summary="List webhooks", response_model=Page[Webhook], response_model_by_alias=True)
async def list_webhooks(
    store: StoreDep, caller: WebhookReader, limit: Limit = 100, cursor: Cursor = None
) -> Page[Webhook]:
    """The webhooks of the key's scopes (every scope for admin and auditor keys), newest
    first; never a secret."""
    return pages.newest_first(await store.webhooks.page(caller.within, cursor, limit + 1), limit)


@router.get(
    "/{webhook_id}", summary="Get a webhook", response_model=Webhook, response_model_by_alias=True
)
async def get(webhook_id: str, store: StoreDep, caller: WebhookReader) -> Webhook:
    return _shown(await _visible(store, caller, webhook_id))


@router.patch(
    "/{webhook_id}",
    summary="Change or re-enable a webhook",
    response_model=Webhook,
    response_model_by_alias=True,
)
async def change(
    webhook_id: str, body: WebhookChange, store: StoreDep, caller: WebhookWriter
) -> Webhook:
    """Change its URL, events or description, or enable or disable it, with an event:
    `webhook_enabled`, `webhook_disabled` or `webhook_changed`. Re-enabled, it sends the
    deliveries that waited meanwhile, and its five days of failures start again. With nothing
    to change, the webhook as it is."""
    hook = await _visible(store, caller, webhook_id)
    fields = body.model_dump(by_alias=True, exclude_unset=True, exclude_none=True)
    if not fields:
        return _shown(hook)
    kind = "webhook_changed"
    if body.enabled is True and not hook.enabled:
        kind = "webhook_enabled"
        fields |= {"disabledAt": None, "disabledReason": None, "failingSince": None}
    elif body.enabled is False and hook.enabled:
        kind = "webhook_disabled"
        fields |= {"disabledAt": store.clock.now(), "disabledReason": f"by {caller.actor}"}
    message = f"webhook {webhook_id} {kind.removeprefix('webhook_')} by {caller.actor}"
    changed = await store.webhooks.change(webhook_id, fields, kind, caller.actor, message, {})
    if changed is None:
        raise NotFound(f"webhook {webhook_id!r} not found")
    return changed


@router.delete(
    "/{webhook_id}",
    summary="Delete a webhook",
    response_model=Webhook,
    response_model_by_alias=True,
)
async def delete(webhook_id: str, store: StoreDep, caller: WebhookWriter) -> Webhook:
    """Delete it and its deliveries, with a `webhook_deleted` event; nothing more is sent."""
    await _visible(store, caller, webhook_id)
    gone = await store.webhooks.delete(webhook_id, caller.actor)
    if gone is None:
        raise NotFound(f"webhook {webhook_id!r} not found")
    return gone


@router.post(
    "/{webhook_id}/rotate-secret",
    summary="Rotate a webhook's secret",
    response_model=WebhookCreated,
    response_model_by_alias=True,
)
async def rotate_secret(webhook_id: str, store: StoreDep, caller: WebhookWriter) -> WebhookCreated:
    """A new secret, shown only here. For 24 hours deliveries are signed with both the new
    and the old one (two `v1,` signatures), so receivers can move over."""
    hook = await _visible(store, caller, webhook_id)
    now = store.clock.now()
    secret = _new_secret()
    kept = [
        {"secret": s.secret, "until": s.until or now + ROTATION_OVERLAP}
        for s in hook.secrets
        if s.until is None or s.until > now
    ]
    fields = {"secrets": [{"secret": secret, "until": None}, *kept]}
    message = f"webhook {webhook_id} secret rotated by {caller.actor}"
    changed = await store.webhooks.change(
        webhook_id, fields, "webhook_secret_rotated", caller.actor, message, {}
    )
    if changed is None:
        raise NotFound(f"webhook {webhook_id!r} not found")
    return WebhookCreated(**changed.model_dump(), secret=secret)


@router.get(
    "/{webhook_id}/deliveries",
    summary="List a webhook's deliveries",
    response_model=Page[Delivery],
    response_model_by_alias=True,
)
async def deliveries(
    webhook_id: str,
    store: StoreDep,
    caller: WebhookReader,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Page[Delivery]:
    """Newest first: each with its event, `attempts`, the last status code or error, and
    when the next try is due."""
    await _visible(store, caller, webhook_id)
    found = await store.webhooks.page_deliveries(webhook_id, cursor, limit + 1)
    return pages.newest_first(found, limit)


@router.post(
    "/{webhook_id}/deliveries/{delivery_id}/redeliver",
    summary="Send a delivery again",
    response_model=Delivery,
    response_model_by_alias=True,
)
async def redeliver(
    webhook_id: str, delivery_id: str, store: StoreDep, caller: WebhookWriter
) -> Delivery:
    """Try it again now, with a new round of the retry schedule: a failed delivery, or a
    succeeded one a receiver lost. Its `webhook-id` stays the same."""
    await _visible(store, caller, webhook_id)
    again = await store.webhooks.redeliver(webhook_id, delivery_id)
    if again is None:
        raise NotFound(f"delivery {delivery_id!r} not found")
    return again
