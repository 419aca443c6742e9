"""Webhooks and their deliveries.

A webhook's life (created, changed, its secret rotated, disabled, deleted) is written with its
event in one transaction, as an API key's is: the trail never misses one. Deliveries are
written by the notifier: one per (webhook, event), whichever notifier writes it first, so a
notifier that reads an event twice (after a restart, say) adds nothing.

A new delivery's first try is made before it is stored (`Claimed.first_try`): it is stored
once, with that try's outcome, as `add` stores one (majority: the notifier's place in the trail
moves past it after). A stored delivery is claimed before each try by moving its
`nextAttemptAt` a lease ahead: a notifier killed mid-try leaves it due again once the lease
passes, and another tries it (at least once). Each of those outcomes is written only by the
claim that tried (`claim`, a token per try). Claims and their outcomes are written with `w: 1`:
a lost one costs a repeated try, never a delivery.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from bson import ObjectId
from pymongo import AsyncMongoClient, ReturnDocument, UpdateOne
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError
from pymongo.write_concern import WriteConcern

from jobplane.clock import Clock
from jobplane.groupcommit import GroupCommit
from jobplane.model.webhooks import Delivery, SignedWebhook, Webhook
from jobplane.store import convert
from jobplane.store.convert import DUPLICATE_KEY, Doc, listed, object_id
from jobplane.store.database import Collections, transaction
from jobplane.store.trail import MongoTrailStore

T = TypeVar("T")

# A webhook as the API shows it: its secrets stay in MongoDB.
_NO_SECRETS = {"secrets": 0}
# A delivery as listed: without the body it sends, and the claim of its try.
_LISTED = {"body": 0, "claim": 0, "tries": 0}


@dataclass(frozen=True)
class Claimed:
    """A delivery claimed for one try: the body to send, which try of its round this is, and
    the claim that alone may write the try's outcome. A first try the notifier makes before
    the delivery is stored has no claim but the delivery as it would be stored (`unstored`):
    its outcome is stored with it, in one insert."""

    delivery: Delivery
    body: str
    tries: int
    claim: str | None
    unstored: Doc | None = None

    @classmethod
    def first_try(cls, doc: Doc) -> "Claimed":
        """The first try of a delivery not stored yet (`doc` as `add` would store it)."""
        return cls(convert.delivery(doc), doc["body"], 1, None, doc)


class MongoWebhookStore:
    def __init__(
        self,
        client: AsyncMongoClient[Doc],
        db: Collections,
        clock: Clock,
        trail: MongoTrailStore,
    ) -> None:
        self._client = client
        self._db = db
        self._clock = clock
        self._trail = trail
        self._outcomes = GroupCommit(self._write_outcomes)
        # Claims and outcomes of tries wait for no majority: one lost in a failover sends its
        # delivery once more (deliveries are at least once), it never loses one. A delivery's
        # creation does wait: the notifier's position in the trail moves past it after.
        self._tries = db.deliveries.with_options(write_concern=WriteConcern(w=1))

    # -- webhooks ------------------------------------------------------------------------------

    async def insert(self, webhook: SignedWebhook) -> None:
        doc = webhook.model_dump(by_alias=True, exclude={"id"})
        doc["_id"] = ObjectId(webhook.id)
        event = _webhook_event(webhook, "webhook_created", webhook.created_by, webhook.create_at)

        async def write(session: AsyncClientSession) -> None:
            await self._db.webhooks.insert_one(doc, session=session)
            await self._trail.record(event, session)

        await self._transaction(write)

    async def get(self, webhook_id: str) -> SignedWebhook | None:
        oid = object_id(webhook_id)
        doc = await self._db.webhooks.find_one({"_id": oid}) if oid else None
        return convert.webhook(doc) if doc else None

    async def page(
        self, within: Sequence[tuple[str, str]] | None, before: str | None, limit: int
    ) -> list[Webhook]:
        """Webhooks newest first, in the scopes `within` unless it is None."""
        find = listed((), within)
        if before is not None:
            find["_id"] = {"$lt": ObjectId(before)}
        cursor = self._db.webhooks.find(find, _NO_SECRETS).sort("_id", -1).limit(limit)
        return [convert.public_webhook(d) async for d in cursor]

    async def enabled(self) -> list[SignedWebhook]:
        """Every enabled webhook: what the notifier matches events against."""
        cursor = self._db.webhooks.find({"enabled": True})
        return [convert.webhook(d) async for d in cursor]

    async def change(
        self, webhook_id: str, fields: Doc, kind: str, actor: str, message: str, only_if: Doc
    ) -> Webhook | None:
        """Set `fields` on the webhook if it still matches `only_if`, with a `kind` event;
        None if it does not (or no such webhook)."""
        oid = object_id(webhook_id)
        if oid is None:
            return None
        now = self._clock.now()

        async def write(session: AsyncClientSession) -> Doc | None:
            doc = await self._db.webhooks.find_one_and_update(
                {"_id": oid, **only_if},
                {"$set": {**fields, "updateAt": now}, "$inc": {"version": 1}},
                _NO_SECRETS,
                return_document=ReturnDocument.AFTER,
                session=session,
            )
            if doc is not None:
                changed = convert.public_webhook(doc)
                event = _webhook_event(changed, kind, actor, now, message)
                await self._trail.record(event, session)
            return doc

        doc = await self._transaction(write)
        return convert.public_webhook(doc) if doc else None

    async def delete(self, webhook_id: str, actor: str) -> Webhook | None:
        """Delete the webhook, with its event, and its deliveries; None if there is none."""
        oid = object_id(webhook_id)
        if oid is None:
            return None
        now = self._clock.now()

        async def write(session: AsyncClientSession) -> Doc | None:
            doc = await self._db.webhooks.find_one_and_delete(
                {"_id": oid}, _NO_SECRETS, session=session
            )
            if doc is not None:
                gone = convert.public_webhook(doc)
                await self._trail.record(
                    _webhook_event(gone, "webhook_deleted", actor, now), session
                )
            return doc

        doc = await self._transaction(write)
        if doc is None:
            return None
        # Nothing sends a deleted webhook's deliveries: the notifier matches enabled webhooks.
        await self._db.deliveries.delete_many({"webhookId": webhook_id})
        return convert.public_webhook(doc)

    async def _transaction(self, write: Callable[[AsyncClientSession], Awaitable[T]]) -> T:
        return await transaction(self._client, self._db.webhooks.write_concern, write)

    # -- deliveries ----------------------------------------------------------------------------

    async def add(self, deliveries: Sequence[Doc]) -> None:
        """Store new deliveries; one of a (webhook, event) stored already (by this notifier
        before a restart, or by another) is left as it was."""
        if deliveries:
            await _insert_new(self._db.deliveries, deliveries)

    async def stored(self, pairs: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        """Of these (webhook id, event id), those whose delivery is stored."""
        if not pairs:
            return set()
        find = {
            "webhookId": {"$in": sorted({w for w, _ in pairs})},
            "eventId": {"$in": sorted({e for _, e in pairs})},
        }
        cursor = self._db.deliveries.find(find, {"webhookId": 1, "eventId": 1, "_id": 0})
        return {(d["webhookId"], d["eventId"]) async for d in cursor} & set(pairs)

    async def claim(
        self, now: datetime, webhook_ids: Sequence[str], until: datetime, limit: int
    ) -> list[Claimed]:
        """Claim up to `limit` due deliveries of `webhook_ids` for one try each, until
        `until`. A claim a notifier made before it died is due again at its `until`."""
        due = {"status": "pending", "nextAttemptAt": {"$lte": now}}
        due["webhookId"] = {"$in": list(webhook_ids)}
        candidates = self._db.deliveries.find(due).sort("nextAttemptAt", 1).limit(limit)
        found = {d["_id"]: d async for d in candidates}
        if not found:
            return []
        token = ObjectId()
        fields = {"nextAttemptAt": until, "claim": token, "lastAttemptAt": now}
        done = await self._tries.update_many(
            {"_id": {"$in": list(found)}, **due},
            {"$set": fields, "$inc": {"attempts": 1, "tries": 1}},
        )
        if done.modified_count < len(found):  # another notifier claimed some meanwhile
            ours = self._db.deliveries.find({"_id": {"$in": list(found)}, "claim": token})
            found = {d["_id"]: d async for d in ours}
        else:
            for doc in found.values():
                doc |= fields | {"attempts": doc["attempts"] + 1, "tries": doc["tries"] + 1}
        return [
            Claimed(convert.delivery(d), d["body"], d["tries"], str(token)) for d in found.values()
        ]

    async def tried(self, claimed: Claimed, outcome: Doc) -> None:
        """Write a try's outcome, if its claim still holds the delivery (a redelivery, or
        another notifier's claim after this one's ran out, does not); a first try's before the
        delivery was stored, with the delivery (unless a copy was stored meanwhile: it keeps its
        own). Outcomes written at once share one bulk write: at a high rate, one journal sync
        for many tries."""
        await self._outcomes.submit((claimed, outcome))

    async def _write_outcomes(self, items: list[tuple[Claimed, Doc]]) -> list[None]:
        # A delivery stored with its first try's outcome is stored as any other (`add`): the
        # notifier's position in the trail moves past it after.
        new = [claimed.unstored | outcome for claimed, outcome in items if claimed.unstored]
        updates = [
            UpdateOne(
                {"_id": ObjectId(claimed.delivery.id), "claim": ObjectId(claimed.claim)},
                {"$set": outcome, "$unset": {"claim": ""}},
            )
            for claimed, outcome in items
            if claimed.claim is not None
        ]
        writes: list[Awaitable[Any]] = []
        if new:
            writes.append(_insert_new(self._db.deliveries, new))
        if updates:
            writes.append(self._tries.bulk_write(updates, ordered=False))
        await asyncio.gather(*writes)
        return [None] * len(items)

    async def page_deliveries(
        self, webhook_id: str, before: str | None, limit: int
    ) -> list[Delivery]:
        """The webhook's deliveries, newest first."""
        find: Doc = {"webhookId": webhook_id}
        if before is not None:
            find["_id"] = {"$lt": ObjectId(before)}
        cursor = self._db.deliveries.find(find, _LISTED).sort("_id", -1).limit(limit)
        return [convert.delivery(d) async for d in cursor]

    async def redeliver(self, webhook_id: str, delivery_id: str) -> Delivery | None:
        """Try the delivery again now, with a new round of tries; None if there is none."""
        oid = object_id(delivery_id)
        if oid is None:
            return None
        doc = await self._db.deliveries.find_one_and_update(
            {"_id": oid, "webhookId": webhook_id},
            {
                "$set": {"status": "pending", "nextAttemptAt": self._clock.now(), "tries": 0},
                # A try in flight writes nothing: this round starts afresh.
                "$unset": {"deliveredAt": "", "claim": ""},
            },
            _LISTED,
            return_document=ReturnDocument.AFTER,
        )
        return convert.delivery(doc) if doc else None

    async def note_failing(self, webhook_id: str, since: datetime) -> datetime | None:
        """Record that the webhook's deliveries fail, since `since` unless they did before;
        returns since when they have failed."""
        doc = await self._db.webhooks.find_one_and_update(
            {"_id": ObjectId(webhook_id)},
            [{"$set": {"failingSince": {"$ifNull": ["$failingSince", since]}}}],
            {"failingSince": 1},
            return_document=ReturnDocument.AFTER,
        )
        return doc.get("failingSince") if doc else None

    async def note_healthy(self, webhook_id: str) -> None:
        await self._db.webhooks.update_one(
            {"_id": ObjectId(webhook_id), "failingSince": {"$ne": None}},
            {"$set": {"failingSince": None}},
        )


async def _insert_new(deliveries: AsyncCollection[Doc], docs: Sequence[Doc]) -> None:
    """Insert the deliveries; one stored already is a no-op."""
    try:
        await deliveries.insert_many(docs, ordered=False)
    except BulkWriteError as exc:
        errors = exc.details["writeErrors"]
        if exc.details.get("writeConcernErrors") or any(e["code"] != DUPLICATE_KEY for e in errors):
            raise


def _webhook_event(
    webhook: Webhook, kind: str, actor: str, now: datetime, message: str | None = None
) -> Doc:
    """An event of a webhook's life, in its scope: `jobId` is the webhook's id, and its version
    orders the webhook's events."""
    return convert.event(
        webhook.id,
        kind,
        actor,
        webhook.scope,
        webhook.scope_id,
        webhook.version,
        message=message or f"webhook {webhook.url} {kind.removeprefix('webhook_')}",
        metadata={"url": webhook.url, "events": webhook.events},
        now=now,
    )
