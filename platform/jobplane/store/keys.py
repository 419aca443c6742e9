"""API keys: their records, and their creation and revocation, each audited.

A key's creation and its revocation are each written with their event in one transaction: the
audit trail never misses one, nor names one that did not happen. Both are rare.
"""

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TypeVar

from bson import ObjectId
from pymongo import AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.errors import DuplicateKeyError

from jobplane.clock import Clock
from jobplane.model import ApiKey, ApiKeyPublic
from jobplane.store import convert
from jobplane.store.convert import Doc, object_id
from jobplane.store.database import Collections, transaction
from jobplane.store.trail import MongoTrailStore

T = TypeVar("T")

# The scope of API keys' events. Its id has a space, which no scope id of a run, a schedule or
# a key may have: no user key can be bound to it, so only the roles that see every scope (admin,
# auditor) see these events.
_KEY_EVENTS_SCOPE = ("system", "api keys")
# A key as listed: its secret's hash stays in MongoDB.
_NO_SECRET = {"secretHash": 0}


class MongoKeyStore:
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

    async def insert(self, key: ApiKey) -> bool:
        """Store a new key and its `api_key_created` event; False if its name is taken."""
        doc = key.model_dump(by_alias=True, exclude={"id"})
        doc["_id"] = ObjectId(key.id)
        event = _key_event(key, "api_key_created", key.created_by, key.create_at)

        async def write(session: AsyncClientSession) -> None:
            await self._db.api_keys.insert_one(doc, session=session)
            await self._trail.record(event, session)

        try:
            await self._transaction(write)
        except DuplicateKeyError:
            return False
        return True

    async def get(self, key_id: str) -> ApiKey | None:
        oid = object_id(key_id)
        doc = await self._db.api_keys.find_one({"_id": oid}) if oid else None
        if doc is None:
            return None
        doc["id"] = str(doc.pop("_id"))
        return ApiKey.model_validate(doc)

    async def page(self, before: str | None, limit: int) -> list[ApiKeyPublic]:
        """Keys newest first, revoked ones too, without their secrets' hashes; `before` is the
        id the previous page ended at."""
        find: Doc = {"_id": {"$lt": ObjectId(before)}} if before else {}
        cursor = self._db.api_keys.find(find, _NO_SECRET).sort("_id", -1).limit(limit)
        return [convert.public_key(d) async for d in cursor]

    async def revoke(self, key_id: str, actor: str) -> ApiKeyPublic | None:
        """Mark the key revoked by `actor`, with its `api_key_revoked` event. A key revoked
        already is left as it was (a repeated revoke changes nothing); None if no key has
        this id."""
        oid = object_id(key_id)
        if oid is None:
            return None
        now = self._clock.now()

        async def write(session: AsyncClientSession) -> Doc | None:
            doc = await self._db.api_keys.find_one_and_update(
                {"_id": oid, "revokedAt": None},
                {"$set": {"revokedAt": now, "revokedBy": actor}},
                _NO_SECRET,
                return_document=ReturnDocument.AFTER,
                session=session,
            )
            if doc is not None:
                event = _key_event(convert.public_key(doc), "api_key_revoked", actor, now)
                await self._trail.record(event, session)
            return doc

        doc = await self._transaction(write)
        if doc is None:  # revoked already, or no such key
            doc = await self._db.api_keys.find_one({"_id": oid}, _NO_SECRET)
        return convert.public_key(doc) if doc else None

    async def _transaction(self, write: Callable[[AsyncClientSession], Awaitable[T]]) -> T:
        return await transaction(self._client, self._db.api_keys.write_concern, write)


def _key_event(key: ApiKeyPublic, kind: str, actor: str, now: datetime) -> Doc:
    """An event of `key`'s life, in `_KEY_EVENTS_SCOPE`: `jobId` is the key's id, its version
    (1 created, 2 revoked) orders the key's trail, and the metadata say what the key may do."""
    return convert.event(
        key.id,
        kind,
        actor,
        *_KEY_EVENTS_SCOPE,
        1 if key.revoked_at is None else 2,
        message=f"API key {key.name} ({key.role}) {kind.removeprefix('api_key_')}",
        metadata={"name": key.name, "role": key.role, "scopes": key.scopes},
        now=now,
    )
