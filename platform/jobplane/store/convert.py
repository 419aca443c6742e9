"""Conversion to and from BSON: here and nowhere else.

Models become documents (and back) in these functions, and so do the small filters every
store module shares: a run's shard key, its identity, the state a writer knows of it.
"""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from bson import ObjectId

from jobplane.model import LEASED, Event, Run, RunStatus, Schedule, Template
from jobplane.model.documents import ApiKeyPublic
from jobplane.model.webhooks import Delivery, SignedWebhook, Webhook
from jobplane.store.types import Admission, Known

Doc = dict[str, Any]

DUPLICATE_KEY = 11000
# A run's trail can be long; reads that do not need it leave it out.
NO_TRAIL = {"trail": 0}
# Fields a write's events (and the attempt it may end) need from the run it changes, and a
# lost write needs to explain its miss.
STATE_FIELDS = {
    "status": 1,
    "scope": 1,
    "scopeId": 1,
    "leaseToken": 1,
    "lockedBy": 1,
    "version": 1,
    "attempt": 1,
    "attemptStartedAt": 1,
    "templateType": 1,
    "admissionToken": 1,
}
# The shard key of a run (see `indexes.SHARD_KEYS`).
OWNER_FIELDS = {"scope": 1, "scopeId": 1}


def object_id(id_: str) -> ObjectId | None:
    return ObjectId(id_) if ObjectId.is_valid(id_) else None


def owner(scope: str, scope_id: str) -> Doc:
    """A filter on the shard key of `SHARD_KEYS`: a run's (or an event's) scope."""
    return {"scope": scope, "scopeId": scope_id}


def listed(equal: Sequence[tuple[str, Any]], within: Sequence[tuple[str, str]] | None) -> Doc:
    """A list's filter: each field equal to its value where one is given, in the scopes
    `within` only unless it is None."""
    find = {field: value for field, value in equal if value is not None}
    if within is not None:
        find["$or"] = [owner(s, i) for s, i in within]
    return find


def known_owner(known: Known | None, scope: tuple[str, str] | None = None) -> Doc:
    """The shard key filter of a run, from `scope` or a writer's known state; empty if neither
    is known (then the write goes by `_id` alone, which MongoDB allows)."""
    if scope is not None:
        return owner(*scope)
    if known is not None:
        return owner(known.scope, known.scope_id)
    return {}


def known(doc: Doc) -> Known:
    """A run's state as read with `STATE_FIELDS`."""
    status = RunStatus(doc["status"])
    admission = None
    # A run keeps the token of the admission it last started under; it holds the place only
    # while started.
    if status in LEASED and (token := doc.get("admissionToken")):
        admission = Admission(doc["templateType"], doc["_id"], token)
    return Known(
        status,
        doc["version"],
        doc["scope"],
        doc["scopeId"],
        doc["attempt"],
        doc.get("attemptStartedAt"),
        admission,
    )


def run_key(doc: Doc) -> Doc:
    """A stored run's `_id` and shard key."""
    return {"_id": doc["_id"], **owner(doc["scope"], doc["scopeId"])}


def identity(query: Doc) -> Doc:
    """What names one run in an update's filter: its `_id` and, when there, its shard key."""
    return {k: query[k] for k in ("_id", "scope", "scopeId") if k in query}


def merged(update: Doc, more: Doc) -> Doc:
    """Two updates' operators as one update (their fields do not overlap)."""
    return {op: {**update.get(op, {}), **more.get(op, {})} for op in update.keys() | more.keys()}


def run(doc: Doc) -> Run:
    return Run.model_validate(_with_id(doc))


def schedule(doc: Doc) -> Schedule:
    return Schedule.model_validate(_with_id(doc))


def public_key(doc: Doc) -> ApiKeyPublic:
    return ApiKeyPublic.model_validate(_with_id(doc))


def event_model(doc: Doc) -> Event:
    return Event.model_validate(_with_id(doc))


def webhook(doc: Doc) -> SignedWebhook:
    return SignedWebhook.model_validate(_with_id(doc))


def public_webhook(doc: Doc) -> Webhook:
    return Webhook.model_validate(_with_id(doc))


def delivery(doc: Doc) -> Delivery:
    return Delivery.model_validate(_with_id(doc))


def template(doc: Doc) -> Template:
    return Template.model_validate({k: v for k, v in doc.items() if k != "_id"})


def _with_id(doc: Doc) -> Doc:
    doc = dict(doc)
    doc["id"] = str(doc.pop("_id"))
    return doc


def event(
    run_id: str,
    kind: str,
    actor: str,
    scope: str,
    scope_id: str,
    run_version: int,
    *,
    now: datetime,
    from_: RunStatus | None = None,
    to: RunStatus | None = None,
    message: str | None = None,
    metadata: Doc | None = None,
) -> Doc:
    """An event document: of a run (`jobId` is the run's id), or of a schedule or a key."""
    doc: Doc = {
        "jobId": run_id,
        "type": kind,
        "actor": actor,
        "_id": ObjectId(),
        "scope": scope,
        "scopeId": scope_id,
        "metadata": metadata or {},
        "runVersion": run_version,
        "createAt": now,
    }
    if from_ is not None:
        doc["from"] = from_.value
    if to is not None:
        doc["to"] = to.value
    if message is not None:
        doc["message"] = message
    return doc
