"""The event trail: each run's events ride in its own `trail`, and `job_events` holds copies.

A write appends its events to the run's `trail` in the same update, so they are exactly as
durable as the write. The writer then hands them here, and they are copied into `job_events`
in bulk, off its path; whatever a process that died never copied, the scheduler's sweep finds
in the trails. A copy keeps the event's `_id`, so a second one is a duplicate-key no-op.
Events that change no run (a rejected stale write, a schedule's skipped fire, an API key's
life) are inserted into `job_events` directly.
"""

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId
from pymongo.asynchronous.change_stream import AsyncChangeStream
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.cursor import AsyncCursor
from pymongo.errors import BulkWriteError

from jobplane.clock import Clock
from jobplane.groupcommit import Backlog
from jobplane.model import Event, Schedule
from jobplane.store import convert
from jobplane.store.convert import DUPLICATE_KEY, OWNER_FIELDS, Doc, listed, owner
from jobplane.store.database import Collections
from jobplane.store.types import WATCH_WAIT_MS, EventQuery

log = logging.getLogger("jobplane.store")

# How far before the last sweep's end the next one starts: writers' clocks may lag.
_SWEEP_SKEW = timedelta(seconds=30)


class MongoTrailStore:
    # Nobody waits for an event copy, so a copy waits this long for more events to share its
    # insert: at a low rate, events of many runs go in one insert instead of one per write.
    COPY_LINGER_SECONDS = 0.05

    def __init__(self, db: Collections, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        self._copier = Backlog(self._copy_events, linger=self.COPY_LINGER_SECONDS)

    async def hand(self, events: Sequence[Doc]) -> None:
        """Copy events a write appended to their runs' trails into `job_events`, soon."""
        await self._copier.hand(events)

    async def flush(self) -> None:
        """Wait until this process's copies of its events to `job_events` are written."""
        await self._copier.drain()

    async def record(self, event: Doc, session: AsyncClientSession | None = None) -> None:
        """Insert an event that rides in no run's trail (in `session`'s transaction, if any)."""
        await self._db.events.insert_one(event, session=session)

    async def events_of(self, run_id: str) -> list[Event]:
        """The run's whole trail, whether or not its events were copied to `job_events` yet
        (plus `stale_write_rejected` events, which are not a write to the run)."""
        run = await self._db.find_run(run_id, {"trail": 1, **OWNER_FIELDS})
        # A run's events carry its scope: read from its shard alone.
        of_run = {"jobId": run_id, **(owner(run["scope"], run["scopeId"]) if run else {})}
        copied = await self._db.events.find(of_run).to_list()
        trail = {d["_id"]: d for d in [*(run or {}).get("trail", []), *copied]}
        # The run's version orders its trail: MongoDB serialized the writes that made it, while
        # clocks of two processes (or two writes in one millisecond) cannot.
        events = map(convert.event_model, trail.values())
        return sorted(events, key=lambda e: (e.run_version, e.id))

    def audit_filter(self, query: EventQuery, within: Sequence[tuple[str, str]] | None) -> Doc:
        """The filter of `page` (public so a test can check its plan with `explain`)."""
        find = listed(
            (
                ("jobId", query.job_id),
                ("type", query.type),
                ("scope", query.scope),
                ("scopeId", query.scope_id),
                ("actor", query.actor),
            ),
            within,
        )
        created: Doc = {}
        if query.since is not None:
            created["$gte"] = query.since
        if query.until is not None:
            created["$lt"] = query.until
        if query.after is not None:
            at, last = query.after
            created["$gte"] = max(at, created.get("$gte", at))
            find["$nor"] = [{"createAt": at, "_id": {"$lte": ObjectId(last)}}]
        if created:
            find["createAt"] = created
        return find

    async def page(
        self, query: EventQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Event]:
        """Events matching `query` in (createAt, _id) order, after `query.after`."""
        find = self.audit_filter(query, within)
        cursor = self._db.events.find(find).sort([("createAt", 1), ("_id", 1)]).limit(limit)
        return [convert.event_model(d) async for d in cursor]

    async def watch_audit(
        self, query: EventQuery, within: Sequence[tuple[str, str]] | None, after: Any
    ) -> AsyncChangeStream[Doc]:
        """Events matching `query` (its equality filters) in `within`'s scopes unless it is
        None, as they reach `job_events`: after the change whose resume token is `after`, or
        from now on."""
        find = self.audit_filter(
            EventQuery(query.job_id, query.type, query.scope, query.scope_id, query.actor), within
        )
        match: Doc = {"operationType": "insert"}
        for field, value in find.items():
            if field == "$or":
                match["$or"] = [{f"fullDocument.{k}": v for k, v in o.items()} for o in value]
            else:
                match[f"fullDocument.{field}"] = value
        return await self._db.events.watch(
            [{"$match": match}], start_after=after, max_await_time_ms=WATCH_WAIT_MS
        )

    def event_of(self, doc: Doc) -> Event:
        """An event as `watch_audit` brings it."""
        return convert.event_model(doc)

    def since(self, at: datetime, types: Sequence[str]) -> AsyncCursor[Doc]:
        """Events of `types` written at `at` or later, oldest first: what a reader whose
        change stream's history is lost reads again."""
        find = {"type": {"$in": list(types)}, "createAt": {"$gte": at}}
        return self._db.events.find(find).sort([("createAt", 1), ("_id", 1)])

    async def schedule_event(
        self, schedule: Schedule, kind: str, message: str, metadata: Doc, actor: str
    ) -> None:
        """An event about a schedule (a fire skipped, say): its `jobId` is the schedule's id."""
        event = convert.event(
            schedule.id,
            kind,
            actor,
            schedule.scope,
            schedule.scope_id,
            schedule.version,
            message=message,
            metadata=metadata,
            now=self._clock.now(),
        )
        await self.record(event)

    async def sweep(self, settled: datetime) -> int:
        """Copy the events missing from `job_events` of runs written since the last sweep and
        before `settled`: events whose writer died before it copied them.

        The last sweep's end is kept in `job_meta`; the window reaches `_SWEEP_SKEW` before it,
        since `updateAt` comes from the writers' clocks. Returns how many events were copied.
        """
        mark = await self._db.meta.find_one({"_id": "trail_sweep"})
        since = mark["through"] - _SWEEP_SKEW if mark else datetime.min.replace(tzinfo=UTC)
        cursor = await self._db.runs.aggregate(
            [
                {"$match": {"updateAt": {"$gte": since, "$lt": settled}}},
                # Only events written in the window: a run's older events were swept before.
                {"$project": {"_id": 0, "trail": 1}},
                {"$unwind": "$trail"},
                {"$match": {"trail.createAt": {"$gte": since}}},
                {
                    "$lookup": {
                        "from": self._db.events.name,
                        "localField": "trail._id",
                        "foreignField": "_id",
                        "as": "copy",
                        "pipeline": [{"$project": {"_id": 1}}],
                    }
                },
                {"$match": {"copy": {"$size": 0}}},
                {"$replaceWith": "$trail"},
            ]
        )
        missing = await cursor.to_list()
        for start in range(0, len(missing), 1000):
            await self._copy(missing[start : start + 1000])
        await self._db.meta.update_one(
            {"_id": "trail_sweep"}, {"$set": {"through": settled}}, upsert=True
        )
        return len(missing)

    async def _copy_events(self, events: list[Doc]) -> None:
        """The copier's write: a failure is logged, and left to the sweep."""
        try:
            await self._copy(events)
        except Exception:
            log.warning(
                "copying %d events failed; the sweep copies them from the runs' trails",
                len(events),
                exc_info=True,
            )

    async def _copy(self, events: list[Doc]) -> None:
        try:
            await self._db.events.insert_many(events, ordered=False)
        except BulkWriteError as exc:
            # Each copy keeps the event's `_id`: copied before (by this process or by the
            # sweep), it is a duplicate-key no-op.
            if exc.details.get("writeConcernErrors") or any(
                e["code"] != DUPLICATE_KEY for e in exc.details["writeErrors"]
            ):
                raise
