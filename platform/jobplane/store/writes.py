"""The write machinery every change to a run after its insert goes through.

A write is one conditional update. One that carries events names the state it moves the run
from (its events say `from` and `runVersion`), so it is filtered on that exact status and
version as well as on its guards: a writer that knows the state from its own last write
(`Known`) writes at once, any other reads it first, and reads again if another write got in
between. Concurrent writers share their round trips: their updates leave as one unordered
`bulk_write` (group commit), and each learns whether its own filter matched. A filter that
matches nothing is a lost race, reported as `Lost`.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from bson import ObjectId
from pymongo import UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, WriteError

from jobplane.clock import Clock
from jobplane.groupcommit import GroupCommit
from jobplane.model import LEASED, RunStatus
from jobplane.store import convert
from jobplane.store.convert import (
    DUPLICATE_KEY,
    STATE_FIELDS,
    Doc,
    identity,
    known_owner,
    merged,
)
from jobplane.store.database import Collections
from jobplane.store.trail import MongoTrailStore
from jobplane.store.types import Known, Lease, Lost

# An event a write appends to the run's trail besides a status change: (type, message, metadata).
TrailEntry = tuple[str, str | None, Doc]


def held_by(worker_id: str, token: str) -> Doc:
    """The fence of a lease holder's write: the run is still leased to this worker under this
    token. A lease once lost never comes back, so a write it lets through was the holder's."""
    return {"lockedBy": worker_id, "leaseToken": token}


# What `lost` reads to tell a step lease's loss from its run's.
_WITH_STEP_LEASES = {**STATE_FIELDS, "progress.steps.lease": 1}


def fence(lease: Lease) -> Doc:
    """The fence of `lease`'s writes: the run's lease, or for a step lease the step's."""
    if lease.step is None:
        return held_by(lease.worker_id, lease.token)
    s = f"progress.steps.{lease.step}.lease"
    return {f"{s}.workerId": lease.worker_id, f"{s}.token": lease.token}


def recorded(
    run_id: str, actor: str, state: Known, now: datetime, entries: Sequence[TrailEntry]
) -> list[Doc]:
    """The events of `entries` for a write that moves the run on from `state`."""
    return [
        convert.event(
            run_id,
            kind,
            actor,
            state.scope,
            state.scope_id,
            state.version + 1,
            message=message,
            metadata=metadata,
            now=now,
        )
        for kind, message, metadata in entries
    ]


@dataclass(frozen=True)
class Update:
    """One conditional run update, as group commit sends it."""

    query: Doc
    update: Doc
    array_filters: list[Mapping[str, Any]] | None = None

    @classmethod
    def exact(
        cls,
        query: Doc,
        update: Doc,
        state: Known,
        trail: list[Doc],
        array_filters: list[Doc] | None = None,
    ) -> "Update":
        """An update filtered on `state`, the exact status and version its `trail` moves from,
        and on the run's scope: the shard key, so a sharded cluster sends it to one shard."""
        return cls(
            {
                **query,
                **convert.known_owner(state),
                "status": state.status,
                "version": state.version,
            },
            merged(update, {"$push": {"trail": {"$each": trail}}}),
            list(array_filters) if array_filters else None,
        )

    @property
    def first_event(self) -> ObjectId | None:
        """The first event the update appends to the trail, which tells whether it applied."""
        pushed = self.update.get("$push", {}).get("trail", {}).get("$each")
        return pushed[0]["_id"] if pushed else None


class RunWrites:
    """The machinery, and what the stores that write runs share: the collections, the clock
    and the trail their events go to."""

    def __init__(self, db: Collections, clock: Clock, trail: MongoTrailStore) -> None:
        self.db = db
        self.clock = clock
        self.trail = trail
        self._updates = GroupCommit(self._update_many)

    async def write(
        self,
        query: Doc,
        update: Callable[[Known], Doc],
        known: Known | None,
        allowed: frozenset[RunStatus],
        array_filters: list[Doc] | None,
        events: Callable[[Known], list[Doc]],
    ) -> tuple[Known, list[Doc]] | None:
        """One conditional write that appends its events to the run's trail.

        `update` and `events` are made for the state the write moves the run from. Returns
        that state and the events written, or None once a read shows the guards in `query` no
        longer hold (or `allowed`, the statuses it may move the run from).
        """
        state = known if known is not None and known.status in allowed else None
        while True:
            if state is None:
                doc = await self.db.runs.find_one(query, STATE_FIELDS)
                if doc is None:
                    return None
                state = convert.known(doc)
            trail = events(state)
            exact = Update.exact(query, update(state), state, trail, array_filters)
            if await self._updates.submit(exact):
                return state, trail
            state = None

    async def fenced(
        self,
        lease: Lease,
        what: str,
        update: Doc,
        events: Sequence[TrailEntry],
        now: datetime,
        where: Doc | None = None,
    ) -> Lost | None:
        """A lease holder's write that changes no status, allowed while the lease is held
        (and `where` holds: a lent step's lease state, for a step lease move)."""
        run_owner = known_owner(lease.known)
        query = {
            "_id": ObjectId(lease.run_id),
            **run_owner,
            "status": {"$in": sorted(LEASED)},
            **fence(lease),
        }
        if where:  # beside the fence, never over it: both may name the step lease's token
            query["$and"] = [where]
        update["$set"]["updateAt"] = now
        update["$inc"] = {"version": 1}
        if not events:
            # Without events the write names no state it moves the run from, so the lease is
            # its whole condition: a heartbeat that moved the version cannot make it miss.
            if not await self.guarded(query, update):
                return await self.lost(lease.run_id, lease, what, run_owner)
            if lease.known is not None:
                # Exact unless another write landed meanwhile; then the next write that needs
                # the version misses once and reads it.
                lease.known = replace(lease.known, version=lease.known.version + 1)
            return None

        def trail(state: Known) -> list[Doc]:
            return recorded(lease.run_id, lease.actor, state, now, events)

        written = await self.write(query, lambda _: update, lease.known, LEASED, None, trail)
        if written is None:
            return await self.lost(lease.run_id, lease, what, run_owner)
        state, appended = written
        lease.known = replace(state, version=state.version + 1)
        await self.trail.hand(appended)
        return None

    async def guarded(self, query: Doc, update: Doc) -> bool:
        """A write with no events, filtered on `query` alone (a lease holder's progress);
        whether it applied."""
        return await self._updates.submit(Update(query, update))

    async def lost(self, run_id: str, lease: Lease | None, what: str, owner: Doc) -> Lost:
        """Say why a write matched nothing; a superseded lease is put on the record. `owner`
        is the run's scope, if the caller knows it."""
        oid = convert.object_id(run_id)
        if oid is None:
            return Lost(run_id, "missing")
        fields = STATE_FIELDS if lease is None or lease.step is None else _WITH_STEP_LEASES
        doc = await self.db.runs.find_one({"_id": oid, **owner}, fields)
        if doc is None:
            return Lost(run_id, "missing")
        status = RunStatus(doc["status"])
        holder = (doc.get("lockedBy"), doc.get("leaseToken"))
        if lease is not None and lease.step is not None:
            steps = doc.get("progress", {}).get("steps", [])
            step = steps[lease.step].get("lease") or {} if lease.step < len(steps) else {}
            holder = (step.get("workerId"), step.get("token"))
        if lease is not None and holder != (lease.worker_id, lease.token):
            meta = {"write": what, "lease": lease.token[:8], "worker": lease.worker_id}
            # No run write to ride on: the event is inserted on its own.
            rejected = convert.event(
                run_id,
                "stale_write_rejected",
                lease.actor,
                doc["scope"],
                doc["scopeId"],
                doc["version"],
                message=f"{what} from a superseded lease rejected",
                metadata=meta,
                now=self.clock.now(),
            )
            await self.trail.record(rejected)
            return Lost(run_id, "lease", status)
        return Lost(run_id, "status", status)

    async def _update_many(self, updates: list[Update]) -> list[bool | Exception]:
        """Apply many writers' conditional updates in one unordered bulk write; each learns
        whether its own filter matched."""
        ops = [UpdateOne(u.query, u.update, array_filters=u.array_filters) for u in updates]
        outcomes: list[bool | Exception] = [True] * len(updates)
        try:
            result = await self.db.runs.bulk_write(ops, ordered=False)
            matched = result.matched_count
        except BulkWriteError as exc:
            if exc.details.get("writeConcernErrors"):
                raise
            for error in exc.details["writeErrors"]:
                # What `update_one` would have raised for this update alone.
                kind = DuplicateKeyError if error["code"] == DUPLICATE_KEY else WriteError
                outcomes[error["index"]] = kind(error["errmsg"], error["code"], error)
            matched = exc.details["nMatched"]
        if matched == sum(o is True for o in outcomes):
            return outcomes
        # Some filters matched nothing (lost races); the bulk result only counts them. An update
        # with events applied if its first event is in the run's trail. One without is filtered
        # on a lease alone, and a lease once lost never comes back: it applied if it holds now.
        firsts = [u.first_event for u in updates]
        applied: set[ObjectId] = set()
        if events := [f for f in firsts if f is not None]:
            runs = [identity(u.query) for u, f in zip(updates, firsts, strict=True) if f]
            cursor = await self.db.runs.aggregate(
                [
                    {"$match": {"$or": runs}},
                    {
                        "$project": {
                            "hit": {"$setIntersection": ["$trail._id", {"$literal": events}]}
                        }
                    },
                ]
            )
            applied |= {event for doc in await cursor.to_list() for event in doc["hit"]}
        if guards := [u.query for u in updates if u.first_event is None]:
            held = await self.db.runs.find({"$or": guards}, {"_id": 1}).to_list()
            applied |= {doc["_id"] for doc in held}
        # Event ids and run ids are all ObjectIds, unique across both.
        return [
            (first or u.query["_id"]) in applied if o is True else o
            for u, first, o in zip(updates, firsts, outcomes, strict=True)
        ]
