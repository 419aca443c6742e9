"""Runs: their creation with its dedupe and idempotency keys, and reads, live or archived.

A run is inserted `queued` (its creator pushes it to Redis next), or `pending` while it waits
for its dedupe key. MongoDB's unique indexes decide dedupe and idempotency, so of concurrent
creates for one key exactly one wins; every later change to a run is a transition.
"""

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from bson import ObjectId
from pymongo.asynchronous.change_stream import AsyncChangeStream
from pymongo.errors import BulkWriteError, DuplicateKeyError

from jobplane.groupcommit import GroupCommit
from jobplane.model import (
    ACTIVE,
    CLAIMABLE,
    TERMINAL,
    Progress,
    Run,
    RunRate,
    RunStatus,
    Schedule,
    StepProgress,
    Template,
)
from jobplane.store import convert
from jobplane.store.convert import DUPLICATE_KEY, NO_TRAIL, Doc, listed, object_id, owner
from jobplane.store.types import (
    WATCH_WAIT_MS,
    ChildOf,
    DuplicateRun,
    KeyHeld,
    Known,
    Lost,
    Moved,
    NewRun,
    RunQuery,
)
from jobplane.store.writes import RunWrites


class MongoRunStore:
    def __init__(self, writes: RunWrites) -> None:
        self._writes = writes
        self._db, self._clock, self._trail = writes.db, writes.clock, writes.trail
        self._inserts = GroupCommit(self._insert_many)

    async def insert(self, new: NewRun, actor: str) -> Run:
        """Write a new run and its `created` event: `queued`, as its creator pushes it to Redis
        next (the reconciler does if the creator cannot), or `pending` while it waits for its
        dedupe key.

        Concurrent calls are written together (group commit). The unique indexes decide dedupe
        and idempotency, so concurrent creates cannot both win. A key with several places
        (`key_places`) is held in its first free place; `KeyHeld` (naming the oldest holder)
        once every place is held.
        """
        if new.dedupe_key is None or new.key_places == 1:
            return await self._inserts.submit((new, actor))
        for _ in range(_PLACE_TRIES):
            place = await self._free_place(new.dedupe_key, new.scope, new.scope_id, new.key_places)
            try:
                return await self._inserts.submit((replace(new, dedupe_slot=place), actor))
            except KeyHeld as held:
                if held.spent:
                    raise
                # Another create took this place first; look for the next.
        raise KeyHeld(new.dedupe_key, None)

    async def insert_many(self, news: Sequence[NewRun], actor: str) -> list[Run | Exception]:
        """Write many new runs in one unordered bulk insert; each item gets its run or the
        `DuplicateRun` / `KeyHeld` it collided with, and one bad item does not stop the rest."""
        return await self._insert_many([(new, actor) for new in news])

    async def watch(self, run_ids: Sequence[str], after: Any) -> AsyncChangeStream[Doc]:
        """Which of these runs change, as they do (each change names only the run: a reader
        reads it), after the change whose resume token is `after`, or from now on. A wait for
        the next change returns within `WATCH_WAIT_MS` even if there is none."""
        ids = [oid for run_id in run_ids if (oid := object_id(run_id)) is not None]
        pipeline: list[Doc] = [
            {"$match": {"documentKey._id": {"$in": ids}}},
            {"$project": {"documentKey": 1, "operationType": 1}},
        ]
        return await self._db.runs.watch(
            pipeline, start_after=after, max_await_time_ms=WATCH_WAIT_MS
        )

    async def get(self, run_id: str) -> Run | None:
        """The run, live or archived."""
        doc = await self._db.find_run(run_id, NO_TRAIL)
        return convert.run(doc) if doc else None

    async def page(
        self, query: RunQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Run]:
        """Runs matching `query`, newest first, only in the scopes `within` unless it is None."""
        find = listed(
            (
                ("status", query.status),
                ("templateType", query.template_type),
                ("scope", query.scope),
                ("scopeId", query.scope_id),
                ("scheduleId", query.schedule_id),
                ("parentRunId", query.parent_run_id),
            ),
            within,
        )
        if query.status in TERMINAL:
            # True of every ended run; it lets the partial index of ended runs serve the query.
            find["completedAt"] = {"$exists": True}
        if query.before is not None:
            find["_id"] = {"$lt": ObjectId(query.before)}
        cursor = self._db.runs.find(find, NO_TRAIL).sort("_id", -1).limit(limit)
        return [convert.run(d) async for d in cursor]

    async def active_of(self, schedule: Schedule) -> Run | None:
        """An active run `schedule` made, if any (its `overlapPolicy` asks)."""
        # The schedule's runs carry its scope: the read goes to one shard.
        active = {"scheduleId": schedule.id, "status": {"$in": sorted(ACTIVE)}}
        active |= owner(schedule.scope, schedule.scope_id)
        doc = await self._db.runs.find_one(active, NO_TRAIL)
        return convert.run(doc) if doc else None

    async def limited(self, run_ids: Sequence[str]) -> list[Run]:
        """Those of `run_ids` that could start now but have limits to pass first (a template's
        `maxRunning` or `rateLimit`), in the order asked: what `transitions.claim` left out."""
        oids = [oid for oid in map(object_id, run_ids) if oid]
        now = self._clock.now()
        query = {
            "_id": {"$in": oids},
            "status": {"$in": sorted(CLAIMABLE)},
            "dedupeWait": {"$exists": False},
            "$or": [{"maxRunning": {"$exists": True}}, {"rate": {"$exists": True}}],
            "$and": [{"$or": [{"notBefore": None}, {"notBefore": {"$lte": now}}]}],
        }
        found = {str(d["_id"]): convert.run(d) async for d in self._db.runs.find(query, NO_TRAIL)}
        return [found[i] for i in run_ids if i in found]

    async def next_waiting(self, key: str) -> Run | None:
        """The oldest pending run waiting for `key`."""
        query = {"dedupeWait": key, "status": RunStatus.PENDING}
        doc = await self._db.runs.find_one(query, NO_TRAIL, sort=[("_id", 1)])
        return convert.run(doc) if doc else None

    async def holders(self, key: str, scope: str, scope_id: str) -> list[Run]:
        """The runs holding a place of `key`, oldest first: active ones, or one that spent it
        (the unique index is per scope, as every key is)."""
        cursor = self._db.runs.find(
            {**owner(scope, scope_id), "dedupeKey": key}, NO_TRAIL, sort=[("_id", 1)]
        )
        return [convert.run(d) async for d in cursor]

    async def with_key(self, key: str, scope: str, scope_id: str) -> list[Run]:
        """The active runs of `key`, oldest first: those holding a place and those waiting for
        one."""
        either = {"$or": [{"dedupeKey": key}, {"dedupeWait": key}]}
        active = {**owner(scope, scope_id), **either, "status": {"$nin": sorted(TERMINAL)}}
        cursor = self._db.runs.find(active, NO_TRAIL, sort=[("_id", 1)])
        return [convert.run(d) async for d in cursor]

    async def take_key(self, run: Run, actor: str) -> Moved | Lost:
        """A run waiting for its dedupe key takes a place of it (it stays `pending`, ready to
        queue): the first free one of the run's `concurrencyLimit`.

        The unique index decides between takers; raises `KeyHeld` if every place is held.
        """
        key = run.dedupe_wait
        if key is None:
            return Lost(run.id, "status", run.status)
        places = run.concurrency_limit or 1
        for _ in range(_PLACE_TRIES):
            place = 0
            if places > 1:
                place = await self._free_place(key, run.scope, run.scope_id, places)
            try:
                return await self._take_place(run, key, place, actor)
            except KeyHeld as held:
                if places == 1 or held.spent:
                    raise
        raise KeyHeld(key, None)

    async def _free_place(self, key: str, scope: str, scope_id: str, places: int) -> int:
        """The first place of `key` no run holds; `KeyHeld` naming the oldest holder if none."""
        holders = await self.holders(key, scope, scope_id)
        taken = {h.dedupe_slot or 0 for h in holders}
        free = next((p for p in range(places) if p not in taken), None)
        if free is None:
            raise KeyHeld(key, holders[0] if holders else None)
        return free

    async def _take_place(self, run: Run, key: str, place: int, actor: str) -> Moved | Lost:
        oid = object_id(run.id)
        if oid is None:
            return Lost(run.id, "missing")
        query = {"_id": oid, **owner(run.scope, run.scope_id)}
        query |= {"status": RunStatus.PENDING, "dedupeWait": key}
        now = self._clock.now()
        update: Doc = {
            "$set": {"dedupeKey": key, "updateAt": now, **_place(place)},
            "$unset": {"dedupeWait": ""},
            "$inc": {"version": 1},
        }

        def events(state: Known) -> list[Doc]:
            return [
                convert.event(
                    run.id,
                    "dedupe_key_taken",
                    actor,
                    state.scope,
                    state.scope_id,
                    state.version + 1,
                    metadata={"dedupeKey": key, **({"place": place} if place else {})},
                    now=now,
                )
            ]

        try:
            written = await self._writes.write(
                query, lambda _: update, None, CLAIMABLE, None, events
            )
        except DuplicateKeyError:
            raise await self._key_held(key, run.scope, run.scope_id) from None
        if written is None:
            return await self._writes.lost(run.id, None, "take_key", owner(run.scope, run.scope_id))
        await self._trail.hand(written[1])
        return Moved(run.id, RunStatus.PENDING, RunStatus.PENDING)

    async def _insert_many(self, items: list[tuple[NewRun, str]]) -> list[Run | Exception]:
        if not items:  # a batch whose every item was refused, or holds a dedupe key
            return []
        now = self._clock.now()
        runs: list[Run] = []
        docs: list[Doc] = []
        for new, actor in items:
            run, doc = _new_run(new, actor, now)
            runs.append(run)
            docs.append(doc)
        outcomes: list[Run | Exception] = list(runs)
        try:
            await self._db.runs.insert_many(docs, ordered=False)
        except BulkWriteError as exc:
            if exc.details.get("writeConcernErrors"):
                raise
            for error in exc.details["writeErrors"]:
                i = error["index"]
                if error["code"] != DUPLICATE_KEY:
                    raise
                duplicate = DuplicateKeyError(error["errmsg"], error["code"], error)
                outcomes[i] = await self._duplicate(duplicate, items[i][0])
        await self._trail.hand(
            [doc["trail"][0] for doc, o in zip(docs, outcomes, strict=True) if isinstance(o, Run)]
        )
        return outcomes

    async def _duplicate(self, exc: DuplicateKeyError, new: NewRun) -> Exception:
        """Say which run the insert collided with. A run with the same idempotency key wins
        over a dedupe key collision: a repeated create is answered with its first run."""
        if new.idempotency_key is not None:
            idempotent = {**owner(new.scope, new.scope_id), "idempotencyKey": new.idempotency_key}
            existing = await self._db.runs.find_one(idempotent, NO_TRAIL)
            if existing is not None:
                return DuplicateRun(convert.run(existing))
        pattern = (exc.details or {}).get("keyPattern", {})
        if "dedupeKey" in pattern:
            assert new.dedupe_key is not None
            return await self._key_held(new.dedupe_key, new.scope, new.scope_id)
        if "scheduleId" in pattern:
            fire = {"scheduleId": new.schedule_id, "scheduledFor": new.scheduled_for}
            fire |= owner(new.scope, new.scope_id)
            existing = await self._db.runs.find_one(fire, NO_TRAIL)
            if existing is not None:
                return DuplicateRun(convert.run(existing))
        # The run collided with was removed before this read; report the collision as it was.
        return exc

    async def _key_held(self, key: str, scope: str, scope_id: str) -> KeyHeld:
        """The run holding `key`: one of `scope` (the unique index is per scope)."""
        holder = await self._db.runs.find_one(
            {**owner(scope, scope_id), "dedupeKey": key}, NO_TRAIL
        )
        return KeyHeld(key, convert.run(holder) if holder else None)


# A create or an admission that loses a place to another tries the next this many times.
_PLACE_TRIES = 5


def _place(place: int) -> Doc:
    """The field naming the place of a key a run holds: none for the first, so a key of one
    place is stored as it always was."""
    return {"dedupeSlot": place} if place else {}


def _new_run(new: NewRun, actor: str, now: datetime) -> tuple[Run, Doc]:
    """A new run and its document, with its `created` event in its trail."""
    t = new.template
    oid = ObjectId()
    # Validated although every value was checked on its way in: pydantic-core validates a
    # run in a few microseconds, several times faster than `model_construct` builds one.
    run = Run(
        id=str(oid),
        template_type=t.type,
        template_version=t.version,
        scope=new.scope,
        scope_id=new.scope_id,
        status=RunStatus.PENDING if new.waits else RunStatus.QUEUED,
        payload=new.payload,
        priority=t.priority if new.priority is None else new.priority,
        queue=t.queue,
        handler=t.handler_at(0),
        progress=Progress(
            steps=[
                StepProgress(id=s.id, needs=[t.steps[n].id for n in needs])
                for s, needs in zip(t.steps, t.graph.needs, strict=True)
            ]
        ),
        max_attempts=t.retry_policy.max_attempts,
        timeout_seconds=t.timeout_seconds,
        cancel_grace_seconds=t.cancel_policy.grace_seconds,
        not_before=new.not_before,
        dedupe_key=new.dedupe_key,
        dedupe_slot=new.dedupe_slot or None,
        dedupe_wait=new.dedupe_wait,
        concurrency_limit=new.key_places if new.key_places > 1 else None,
        max_running=t.max_running,
        rate=_rate(t, new.rate_key),
        start_locks=new.start_locks or None,
        fairness="round_robin" if t.fairness == "round_robin" else None,
        idempotency_key=new.idempotency_key,
        schedule_id=new.schedule_id,
        scheduled_for=new.scheduled_for,
        rerun_of=new.rerun_of,
        trace_context=new.trace_context,
        **_child(new.child),
        create_at=now,
        update_at=now,
    )
    doc = run.model_dump(by_alias=True, exclude_none=True, exclude={"trace_id"})
    del doc["id"]
    doc["_id"] = oid
    created = convert.event(
        run.id, "created", actor, run.scope, run.scope_id, 1, to=run.status, now=now
    )
    doc["trail"] = [created]
    return run, doc


def _child(child: ChildOf | None) -> dict[str, Any]:
    """A map step's child's fields."""
    if child is None:
        return {}
    return {
        "parent_run_id": child.parent_run_id,
        "parent_step_id": child.parent_step_id,
        "root_run_id": child.root_run_id,
        "map_index": child.index,
        "map_limit": child.limit,
        "map_place": child.place,
        "map_wait": True if child.waits else None,
    }


def _rate(t: Template, key: str | None) -> RunRate | None:
    if t.rate_limit is None or key is None:
        return None
    return RunRate(key=key, limit=t.rate_limit.limit, period_seconds=t.rate_limit.period_seconds)
