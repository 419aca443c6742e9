"""Queues' pauses: who paused a queue, why and when, each change audited.

A pause or a resume is written with its event in one transaction, like an API key's creation:
the audit trail never misses one, nor names one that did not happen. MongoDB holds the truth;
Redis holds a copy the workers' pops read (`queue/redis.py`), which `runs/admission/pause.py`
keeps in step.
"""

from datetime import datetime

from pymongo import AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.errors import DuplicateKeyError

from jobplane.clock import Clock
from jobplane.model import QueueState
from jobplane.store import convert
from jobplane.store.convert import Doc
from jobplane.store.database import Collections, transaction
from jobplane.store.trail import MongoTrailStore

# The scope of queues' events. Its id has a space, which no run's, schedule's or key's scope id
# may have: only the roles that see every scope (admin, auditor) see these events.
_QUEUE_EVENTS_SCOPE = ("system", "job queues")


class MongoQueueStore:
    def __init__(
        self, client: AsyncMongoClient[Doc], db: Collections, clock: Clock, trail: MongoTrailStore
    ) -> None:
        self._client = client
        self._db = db
        self._clock = clock
        self._trail = trail

    async def states(self) -> list[QueueState]:
        """Every queue ever paused, paused now or not, by name."""
        return [_state(d) async for d in self._db.queues.find({}).sort("_id", 1)]

    async def set_paused(
        self, queue: str, paused: bool, actor: str, reason: str | None
    ) -> tuple[QueueState, bool]:
        """Pause or resume `queue`, with its `queue_paused` / `queue_resumed` event; returns
        its state and whether it changed (pausing a paused queue changes nothing)."""
        now = self._clock.now()
        fields: Doc = (
            {"paused": True, "pausedBy": actor, "pauseReason": reason, "pausedAt": now}
            if paused
            else {"paused": False, "resumedBy": actor, "resumedAt": now}
        )

        async def write(session: AsyncClientSession) -> Doc | None:
            doc = await self._db.queues.find_one_and_update(
                {"_id": queue, "paused": {"$ne": paused}},
                {"$set": fields, "$inc": {"version": 1}},
                upsert=True,
                return_document=ReturnDocument.AFTER,
                session=session,
            )
            assert doc is not None
            await self._trail.record(_queue_event(_state(doc), actor, reason, now), session)
            return doc

        if await self._db.queues.count_documents({"_id": queue, "paused": paused}, limit=1):
            current = await self._db.queues.find_one({"_id": queue})
            assert current is not None
            return _state(current), False
        try:
            doc = await transaction(self._client, self._db.queues.write_concern, write)
        except DuplicateKeyError:
            # Changed to this state by someone else since the read: the upsert found no
            # document to match and could not insert one with the same `_id`.
            current = await self._db.queues.find_one({"_id": queue})
            assert current is not None
            return _state(current), False
        assert doc is not None
        return _state(doc), True


def _state(doc: Doc) -> QueueState:
    return QueueState.model_validate({**doc, "queue": doc["_id"]})


def _queue_event(state: QueueState, actor: str, reason: str | None, now: datetime) -> Doc:
    """`queue_paused` or `queue_resumed`: `jobId` is the queue, and the queue's version orders
    its trail."""
    kind = "queue_paused" if state.paused else "queue_resumed"
    return convert.event(
        state.queue,
        kind,
        actor,
        *_QUEUE_EVENTS_SCOPE,
        state.version,
        message=f"queue {state.queue} {kind.removeprefix('queue_')}"
        + (f": {reason}" if reason else ""),
        metadata={"queue": state.queue, **({"reason": reason} if reason else {})},
        now=now,
    )
