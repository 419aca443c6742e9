"""The MongoDB store: the only code that reads or writes jobplane's collections.

Every change of a run's status is one named method built on `_transition`: a single conditional
update whose filter names the source statuses from `TRANSITIONS` (plus `lockedBy` and
`leaseToken` for worker writes) and which appends the transition's events to the run's own
`trail`, to be copied into `job_events` right after. A filter that matches nothing is a lost
race; it comes back as `Lost` and is never retried here.
"""

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

import pymongo
from bson import ObjectId
from pymongo import (
    ASCENDING,
    DESCENDING,
    HASHED,
    AsyncMongoClient,
    IndexModel,
    ReplaceOne,
    ReturnDocument,
    UpdateOne,
)
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure, WriteError
from pymongo.write_concern import WriteConcern

from jobplane.clock import Clock, SystemClock
from jobplane.groupcommit import Backlog, GroupCommit
from jobplane.model import (
    ACTIVE,
    CLAIMABLE,
    LEASED,
    TERMINAL,
    TRANSITIONS,
    ApiKey,
    ApiKeyPublic,
    Attempt,
    Event,
    Progress,
    Run,
    RunError,
    RunStatus,
    Schedule,
    StepProgress,
    StepStatus,
    Template,
    TemplateSpec,
)

Doc = dict[str, Any]
T = TypeVar("T")

log = logging.getLogger("jobplane.store")

_DUPLICATE_KEY = 11000
# A run waiting for a dedupe key stays `pending`: queued, it could never be claimed nor take its
# key (both look for a pending run without `dedupeWait`).
_NOT_WAITING = {"dedupeWait": {"$exists": False}}
# How far before the last sweep's end the next one starts: writers' clocks may lag.
_SWEEP_SKEW = timedelta(seconds=30)
# How long a process creating runs trusts a template it read (see `cached_template`).
TEMPLATE_CACHE_SECONDS = 1.0
# A run's trail can be long; reads that do not need it leave it out.
_NO_TRAIL = {"trail": 0}
# The audit query's equality filters, each with an index ending in (createAt, _id).
_EVENT_FILTERS: list[list[tuple[str, int]]] = [
    [],
    [("jobId", ASCENDING)],
    [("scope", ASCENDING), ("scopeId", ASCENDING)],
    [("type", ASCENDING)],
    [("actor", ASCENDING)],
]
# Indexes of earlier versions, replaced by partial ones (fewer entries to keep up on every
# write), by ones that start with the shard key, or found unused; `ensure_indexes` drops them.
_REPLACED_INDEXES = {
    "job_runs": {
        "status_1_lockedUntil_1",
        "status_1_deadline_1",
        "status_1_cancelDeadline_1",
        "scheduleId_1__id_-1",
        "status_1_dedupeKey_1_updateAt_1",
        # Unique indexes that did not start with the shard key (see `SHARD_KEYS`).
        "dedupeKey_1",
        "scheduleId_1_scheduledFor_1",
    },
    "job_events": {"jobId_1_runVersion_1__id_1"},
}
# Every large collection is sharded on its runs' owner: the scope and, hashed, the scope id. Its
# unique indexes must start with the shard key for a sharded cluster to enforce them, and the
# guarantees are per scope anyway (see `index_models`); a run's writes know its scope, so they
# go to one shard. `scope` first keeps the idempotency index (scope, scopeId, idempotencyKey) as
# it was; hashing spreads scope ids evenly. One scope's runs live on one shard.
SHARD_KEYS: dict[str, list[tuple[str, int | str]]] = {
    collection: [("scope", ASCENDING), ("scopeId", HASHED)]
    for collection in ("job_runs", "job_events", "job_runs_archive")
}


def index_models() -> dict[str, list[IndexModel]]:
    """Every index `ensure_indexes` creates, by collection."""
    # Every index is work for every write that changes its keys. Fields only some runs have (a
    # lease, a deadline, a schedule) get partial indexes, so a run is in them only while it has
    # the field; terminal runs enter the retention index only once they end.
    runs = [
        # Claim path: the reconciler finds claimable runs missing from Redis.
        IndexModel([("status", ASCENDING), ("_id", ASCENDING)]),
        # The reaper's scans: leases that ran out, deadlines and cancel graces passed.
        _only_with(
            "lockedUntil", [("status", ASCENDING), ("lockedUntil", ASCENDING)], name="leases"
        ),
        _only_with("deadline", [("status", ASCENDING), ("deadline", ASCENDING)], name="deadlines"),
        _only_with(
            "cancelDeadline",
            [("status", ASCENDING), ("cancelDeadline", ASCENDING)],
            name="cancel_deadlines",
        ),
        # The unique indexes start with the shard key (scope, scopeId). For dedupe that is the
        # same guarantee as a unique `dedupeKey`: a key is `runs.service.dedupe_key`, which
        # holds the run's scope and scope id, or a schedule's `schedule:<id>` (overlapPolicy
        # queue), whose runs all carry the schedule's scope, which never changes.
        _only_with(
            "dedupeKey",
            [("scope", ASCENDING), ("scopeId", ASCENDING), ("dedupeKey", ASCENDING)],
            unique=True,
        ),
        _only_with(
            "idempotencyKey",
            [("scope", ASCENDING), ("scopeId", ASCENDING), ("idempotencyKey", ASCENDING)],
            unique=True,
        ),
        # One run per fire time: a schedule's runs all carry its scope, which never changes
        # (`ScheduleService.update`), so this is unique on (scheduleId, scheduledFor).
        _only_with(
            "scheduleId",
            [
                ("scope", ASCENDING),
                ("scopeId", ASCENDING),
                ("scheduleId", ASCENDING),
                ("scheduledFor", ASCENDING),
            ],
            unique=True,
        ),
        IndexModel([("scope", ASCENDING), ("scopeId", ASCENDING), ("_id", DESCENDING)]),
        IndexModel([("templateType", ASCENDING), ("_id", DESCENDING)]),
        # Ended runs of a template by status (its dead letters): without it a list of a rare
        # status of one template walks every run of that status. Only ended runs, which never
        # change status again: an entry per run, written once.
        _only_with(
            "completedAt",
            [("templateType", ASCENDING), ("status", ASCENDING), ("_id", DESCENDING)],
            name="ended_by_template",
        ),
        _only_with(
            "scheduleId", [("scheduleId", ASCENDING), ("_id", DESCENDING)], name="schedule_runs"
        ),
        # Runs waiting for a dedupe key, oldest first.
        _only_with("dedupeWait", [("dedupeWait", ASCENDING), ("_id", ASCENDING)]),
        # The sweep: runs written since its last pass.
        IndexModel([("updateAt", ASCENDING)]),
        # Retention: terminal runs (those with `completedAt`) by age. Runs holding a spent
        # dedupe key never move (the key must stay under the unique index); a null `dedupeKey`
        # bound keeps the pass from even reading them.
        _only_with(
            "completedAt",
            [("status", ASCENDING), ("dedupeKey", ASCENDING), ("updateAt", ASCENDING)],
            name="ended",
        ),
    ]
    return {
        "job_templates": [
            IndexModel([("type", ASCENDING), ("version", ASCENDING)], unique=True),
            # The latest version of each type, and every queue templates name.
            IndexModel([("type", ASCENDING), ("version", DESCENDING)]),
            IndexModel([("queue", ASCENDING)]),
        ],
        "job_runs": runs,
        "job_schedules": [
            IndexModel([("enabled", ASCENDING), ("nextRunAt", ASCENDING)]),
            IndexModel([("scope", ASCENDING), ("scopeId", ASCENDING), ("_id", DESCENDING)]),
        ],
        # The audit query pages by (createAt, _id) under at most one equality filter, and each
        # such filter has its index, so no query scans the collection. A run's own events are
        # found by the `jobId` one.
        "job_events": [
            IndexModel([*fields, ("createAt", ASCENDING), ("_id", ASCENDING)])
            for fields in _EVENT_FILTERS
        ],
        "api_keys": [IndexModel([("name", ASCENDING)], unique=True)],
    }


# Fields a write's events (and the attempt it may end) need from the run it changes, and
# `_lost` needs to explain a miss.
_STATE_FIELDS = {
    "status": 1,
    "scope": 1,
    "scopeId": 1,
    "leaseToken": 1,
    "lockedBy": 1,
    "version": 1,
    "attempt": 1,
    "attemptStartedAt": 1,
}
# The scope of API keys' events. Its id has a space, which no scope id of a run, a schedule or
# a key may have: no user key can be bound to it, so only the roles that see every scope (admin,
# auditor) see these events.
_KEY_EVENTS_SCOPE = ("system", "api keys")
# A key as listed: its secret's hash stays in MongoDB.
_NO_SECRET = {"secretHash": 0}
# The shard key of a run (see `SHARD_KEYS`).
_OWNER_FIELDS = {"scope": 1, "scopeId": 1}
# A run holds these only while a worker owns it.
_LEASE_FIELDS = ("lockedBy", "leaseToken", "lockedUntil")
# Array filters: the step a worker was in, and steps that will not run now (a step that failed
# in an earlier attempt is retried later, so it counts as not done).
_RUNNING_STEP = {"r.status": StepStatus.RUNNING}
_UNDONE_STEP = {"p.status": {"$in": [StepStatus.PENDING, StepStatus.FAILED]}}


@dataclass
class Known:
    """What a writer knows of a run from its own last write.

    With it, the next write can be a conditional update on that status and version with no
    read first: if it matches, the writer knew the run's state exactly; if another writer got
    in between, it misses, and the writer reads the state and tries again.
    """

    status: RunStatus
    version: int
    scope: str
    scope_id: str
    # The attempt in progress, for a write that ends it in an error (see `_attempt_failed`).
    attempt: int = 0
    attempt_started_at: datetime | None = None

    @property
    def owner(self) -> Doc:
        """The run's shard key fields, which never change."""
        return _owner(self.scope, self.scope_id)


@dataclass(frozen=True)
class _Update:
    """One conditional run update (see `_update_many`)."""

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
    ) -> "_Update":
        """An update filtered on `state`, the exact status and version its `trail` moves from,
        and on the run's scope: the shard key, so a sharded cluster sends it to one shard."""
        return cls(
            {**query, **state.owner, "status": state.status, "version": state.version},
            _merged(update, {"$push": {"trail": {"$each": trail}}}),
            list(array_filters) if array_filters else None,
        )

    @property
    def first_event(self) -> ObjectId | None:
        """The first event the update appends to the trail, which tells whether it applied."""
        pushed = self.update.get("$push", {}).get("trail", {}).get("$each")
        return pushed[0]["_id"] if pushed else None


@dataclass
class Lease:
    """Proof of ownership that every worker write carries."""

    run_id: str
    worker_id: str
    token: str
    # Kept up to date by the store after each write made with this lease.
    known: Known | None = field(default=None, compare=False, repr=False)

    @property
    def actor(self) -> str:
        return f"worker:{self.worker_id}"


@dataclass(frozen=True)
class Moved:
    """A transition that took place."""

    run_id: str
    from_: RunStatus
    to: RunStatus


@dataclass(frozen=True)
class Lost:
    """A write whose filter matched nothing: the caller lost a race.

    `reason` is "missing" (no such run), "lease" (another claim superseded the caller's lease;
    a `stale_write_rejected` event was recorded) or "status" (the run is in `status`, from which
    the write is not allowed).
    """

    run_id: str
    reason: Literal["missing", "lease", "status"]
    status: RunStatus | None = None


@dataclass(frozen=True)
class NewRun:
    template: Template
    scope: Literal["user", "account", "system"]
    scope_id: str
    payload: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    not_before: datetime | None = None
    # The key the run holds while active, or the one it waits for (`queue_same_scope`).
    dedupe_key: str | None = None
    dedupe_wait: str | None = None
    idempotency_key: str | None = None
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    rerun_of: str | None = None


@dataclass(frozen=True)
class RunQuery:
    """Filters of the run list; `before` is the id the previous page ended at."""

    status: RunStatus | None = None
    template_type: str | None = None
    scope: str | None = None
    scope_id: str | None = None
    schedule_id: str | None = None
    before: str | None = None


@dataclass(frozen=True)
class ScheduleQuery:
    """Filters of the schedule list; `before` is the id the previous page ended at."""

    template_type: str | None = None
    scope: str | None = None
    scope_id: str | None = None
    enabled: bool | None = None
    before: str | None = None


@dataclass(frozen=True)
class EventQuery:
    """Filters of the audit query; `after` is the (createAt, id) the previous page ended at."""

    job_id: str | None = None
    type: str | None = None
    scope: str | None = None
    scope_id: str | None = None
    actor: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after: tuple[datetime, str] | None = None


class KeyHeld(Exception):
    """Another run holds the dedupe key: an active run, or (non-repeatable templates) the run
    that succeeded for it. `holder` is None if it let go before it could be read."""

    def __init__(self, key: str, holder: Run | None) -> None:
        super().__init__(f"dedupe key {key} is held by {holder.id if holder else 'a run'}")
        self.key = key
        self.holder = holder


class NotSharded(Exception):
    """`MongoStore.shard` was asked of a server that is not a sharded cluster's mongos."""


class DuplicateRun(Exception):
    """A run with this idempotency key (or schedule fire time) already exists."""

    def __init__(self, run: Run) -> None:
        super().__init__(f"run {run.id} already exists")
        self.run = run


def _owner(scope: str, scope_id: str) -> Doc:
    """A filter on the shard key of `SHARD_KEYS`: a run's (or an event's) scope."""
    return {"scope": scope, "scopeId": scope_id}


def object_id(run_id: str) -> ObjectId | None:
    return ObjectId(run_id) if ObjectId.is_valid(run_id) else None


class MongoStore:
    # Nobody waits for an event copy, so a copy waits this long for more events to share its
    # insert: at a low rate, events of many runs go in one insert instead of one per write.
    COPY_LINGER_SECONDS = 0.05

    def __init__(
        self,
        client: AsyncMongoClient[Doc],
        db_name: str,
        write_concern: str = "majority",
        clock: Clock | None = None,
    ) -> None:
        self.client = client
        w: int | str = int(write_concern) if write_concern.isdigit() else write_concern
        self.db = client.get_database(db_name, write_concern=WriteConcern(w=w))
        self.templates: AsyncCollection[Doc] = self.db["job_templates"]
        self.runs: AsyncCollection[Doc] = self.db["job_runs"]
        self.archive: AsyncCollection[Doc] = self.db["job_runs_archive"]
        self.schedules: AsyncCollection[Doc] = self.db["job_schedules"]
        self.events: AsyncCollection[Doc] = self.db["job_events"]
        self.api_keys: AsyncCollection[Doc] = self.db["api_keys"]
        self.clock: Clock = clock or SystemClock()
        self.meta: AsyncCollection[Doc] = self.db["job_meta"]
        # Events are copied from the trails into `job_events` off the writers' path (see
        # `_copy_events`).
        self._copier = Backlog(self._copy_events, linger=self.COPY_LINGER_SECONDS)
        self._inserts = GroupCommit(self._insert_many)
        self._template_cache: dict[tuple[str, int | None], tuple[float, Template]] = {}
        self._updates = GroupCommit(self._update_many)

    @classmethod
    def connect(
        cls,
        url: str,
        db_name: str,
        write_concern: str = "majority",
        clock: Clock | None = None,
        connect_timeout_seconds: float = 20,
    ) -> "MongoStore":
        client: AsyncMongoClient[Doc] = AsyncMongoClient(
            url,
            tz_aware=True,
            retryWrites=True,
            connectTimeoutMS=int(connect_timeout_seconds * 1000),
        )
        return cls(client, db_name, write_concern, clock)

    async def close(self, within: float | None = None) -> None:
        """Copy the events still waiting to `job_events`, then disconnect; with `within`, a
        MongoDB that does not answer is given up on after that many seconds. The events stay in
        their runs' trails, where the scheduler's sweep finds them."""
        loop = asyncio.get_running_loop()
        by = None if within is None else loop.time() + within
        try:
            async with asyncio.timeout_at(by):
                await self.flush()
        except TimeoutError:
            log.warning("events not copied to job_events within %.1f s; the sweep will", within)
        # Closing ends the client's sessions with a command that waits for a server as any
        # other does (30 s). It only spares the server memory (it drops idle sessions after 30
        # minutes), so it gets a second at most; PyMongo then closes the sockets anyway.
        ending = 1.0 if by is None else min(1.0, max(by - loop.time(), 0.1))
        with pymongo.timeout(ending):
            await self.client.close()

    async def flush(self) -> None:
        """Wait until this process's copies of its events to `job_events` are written."""
        await self._copier.drain()

    async def ping(self) -> None:
        await self.db.command("ping")

    async def ensure_indexes(self) -> None:
        """Create every index of `index_models`; safe to run at each start-up and from several
        processes.

        Indexes an earlier version made and this one replaced are dropped after their
        replacements exist, so no query is left without an index, and no guarantee without its
        unique index, meanwhile.
        """
        for collection, models in index_models().items():
            await self.db[collection].create_indexes(models)
        for collection, names in _REPLACED_INDEXES.items():
            existing = await self.db[collection].index_information()
            for name in names & existing.keys():
                with contextlib.suppress(OperationFailure):  # another process dropped it first
                    await self.db[collection].drop_index(name)

    async def shard(self) -> list[str]:
        """Shard the large collections of this database on `SHARD_KEYS` (a mongos only).

        Indexes are brought up to date first: a collection with data can be sharded only once
        each of its unique indexes starts with the shard key. Safe to run again. Returns the
        namespaces sharded; raises `NotSharded` if the server is not a mongos.
        """
        hello = await self.client.admin.command("hello")
        if hello.get("msg") != "isdbgrid":
            raise NotSharded(
                f"the MongoDB server is not a sharded cluster's mongos: {self.db.name} stays "
                "unsharded"
            )
        await self.ensure_indexes()
        await self.client.admin.command("enableSharding", self.db.name)
        sharded = []
        for collection, key in SHARD_KEYS.items():
            # A collection with data needs the hashed index before it is sharded (MongoDB
            # builds it itself only for an empty one).
            await self.db[collection].create_index(key)
            namespace = f"{self.db.name}.{collection}"
            await self.client.admin.command("shardCollection", namespace, key=dict(key))
            sharded.append(namespace)
        return sharded

    # -- templates -----------------------------------------------------------------------------

    async def register_template(self, spec: TemplateSpec) -> tuple[Template, bool]:
        """Store `spec` as the next version of its type; an unchanged spec returns the latest.

        Returns the template and whether a new version was created. Two authors registering at
        once race on the unique (type, version) index; the loser re-reads and tries again.
        """
        definition = _definition(spec)
        while True:
            latest = await self.get_template(spec.type)
            if latest is not None and _definition(latest) == definition:
                return latest, False
            now = self.clock.now()
            doc = spec.model_dump(by_alias=True, mode="json")
            doc |= {
                "version": latest.version + 1 if latest else 1,
                "enabled": latest.enabled if latest else spec.enabled,
                "createAt": now,
                "updateAt": now,
            }
            try:
                await self.templates.insert_one(doc)
            except DuplicateKeyError:
                continue
            self._template_cache.clear()
            return _template(doc), True

    async def get_template(self, type_: str, version: int | None = None) -> Template | None:
        query: Doc = {"type": type_}
        if version is not None:
            query["version"] = version
        doc = await self.templates.find_one(query, sort=[("version", DESCENDING)])
        return _template(doc) if doc else None

    async def cached_template(self, type_: str, version: int | None = None) -> Template | None:
        """`get_template` for creating runs, read at most once per `TEMPLATE_CACHE_SECONDS`.

        A version's definition never changes; only `enabled` and the latest version can, so
        another process's disable or new version is seen here within that time (this process's
        own at once).
        """
        key = (type_, version)
        now = time.monotonic()
        cached = self._template_cache.get(key)
        if cached is not None and now - cached[0] < TEMPLATE_CACHE_SECONDS:
            return cached[1]
        template = await self.get_template(type_, version)
        if template is not None:  # one registered meanwhile is found at once
            self._template_cache[key] = (now, template)
        return template

    async def latest_templates(self) -> list[Template]:
        """The latest version of every template type, by type."""
        cursor = await self.templates.aggregate(
            [
                {"$sort": {"type": 1, "version": -1}},
                {"$group": {"_id": "$type", "doc": {"$first": "$$ROOT"}}},
                {"$replaceWith": "$doc"},
                {"$sort": {"type": 1}},
            ]
        )
        return [_template(d) async for d in cursor]

    async def queues(self) -> list[str]:
        """Every queue a template version names (a run keeps the queue of its version)."""
        return sorted(await self.templates.distinct("queue"))

    async def set_template_enabled(self, type_: str, enabled: bool) -> Template | None:
        """Enable or disable a template type. `enabled` is not part of a version's definition,
        so it is set on every version: a run pinned to an old version is refused too."""
        now = self.clock.now()
        result = await self.templates.update_many(
            {"type": type_}, {"$set": {"enabled": enabled, "updateAt": now}}
        )
        self._template_cache.clear()
        return await self.get_template(type_) if result.matched_count else None

    # -- schedules -------------------------------------------------------------------------------

    async def insert_schedule(self, schedule: Schedule) -> None:
        doc = schedule.model_dump(by_alias=True)
        doc["_id"] = ObjectId(doc.pop("id"))
        await self.schedules.insert_one(doc)

    async def get_schedule(self, schedule_id: str) -> Schedule | None:
        oid = object_id(schedule_id)
        doc = await self.schedules.find_one({"_id": oid}) if oid else None
        return _schedule(doc) if doc else None

    async def list_schedules(
        self, query: ScheduleQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Schedule]:
        """Schedules matching `query`, newest first, only in the scopes `within` unless None."""
        find: Doc = {
            field: value
            for field, value in (
                ("templateType", query.template_type),
                ("scope", query.scope),
                ("scopeId", query.scope_id),
                ("enabled", query.enabled),
            )
            if value is not None
        }
        if within is not None:
            find["$or"] = [{"scope": s, "scopeId": i} for s, i in within]
        if query.before is not None:
            find["_id"] = {"$lt": ObjectId(query.before)}
        cursor = self.schedules.find(find).sort("_id", -1).limit(limit)
        return [_schedule(d) async for d in cursor]

    async def replace_schedule(self, schedule: Schedule) -> Schedule | None:
        """Write `schedule` over the stored one if that is still at `schedule.version`; None
        if another change got there first (the caller reads again)."""
        doc = schedule.model_dump(by_alias=True, exclude={"id"})
        doc |= {"version": schedule.version + 1, "updateAt": self.clock.now()}
        stored = await self.schedules.find_one_and_replace(
            {"_id": ObjectId(schedule.id), "version": schedule.version},
            doc,
            return_document=ReturnDocument.AFTER,
        )
        return _schedule(stored) if stored else None

    async def due_schedules(self, now: datetime, limit: int) -> list[Schedule]:
        """Enabled schedules whose next fire time has come, the most overdue first."""
        due = {"enabled": True, "nextRunAt": {"$lte": now}}
        cursor = self.schedules.find(due).sort("nextRunAt", 1).limit(limit)
        return [_schedule(d) async for d in cursor]

    async def next_fire_time(self) -> datetime | None:
        """The earliest `nextRunAt` of any enabled schedule: when the tick must look next."""
        doc = await self.schedules.find_one(
            {"enabled": True, "nextRunAt": {"$ne": None}}, {"nextRunAt": 1}, sort=[("nextRunAt", 1)]
        )
        return doc["nextRunAt"] if doc else None

    async def advance_schedule(
        self, schedule: Schedule, next_run_at: datetime, fired: tuple[datetime, str] | None
    ) -> bool:
        """Move a schedule past the fire times it handled, if nobody else did (another
        scheduler, or a change that recomputed `nextRunAt`) since it was read."""
        fields: Doc = {"nextRunAt": next_run_at, "updateAt": self.clock.now()}
        if fired is not None:
            fields |= {"lastRunAt": fired[0], "lastRunId": fired[1]}
        result = await self.schedules.update_one(
            {
                "_id": ObjectId(schedule.id),
                "nextRunAt": schedule.next_run_at,
                "version": schedule.version,
            },
            {"$set": fields, "$inc": {"version": 1}},
        )
        return result.modified_count == 1

    async def note_schedule_run(self, schedule_id: str, at: datetime, run_id: str) -> None:
        """Record a run a schedule made off its cron (a trigger) as its last one, unless a
        later one is recorded already. A new version, so that a change read before this write
        does not put the old last run back."""
        await self.schedules.update_one(
            {"_id": ObjectId(schedule_id), "lastRunAt": {"$not": {"$gt": at}}},
            {
                "$set": {"lastRunAt": at, "lastRunId": run_id, "updateAt": self.clock.now()},
                "$inc": {"version": 1},
            },
        )

    async def active_run_of(self, schedule: Schedule) -> Run | None:
        # The schedule's runs carry its scope: the read goes to one shard.
        active = {"scheduleId": schedule.id, "status": {"$in": sorted(ACTIVE)}}
        active |= _owner(schedule.scope, schedule.scope_id)
        doc = await self.runs.find_one(active, _NO_TRAIL)
        return _run(doc) if doc else None

    async def schedule_event(
        self, schedule: Schedule, kind: str, message: str, metadata: Doc, actor: str
    ) -> None:
        """An event about a schedule (a fire skipped, say): its `jobId` is the schedule's id."""
        event = _event(
            schedule.id,
            kind,
            actor,
            schedule.scope,
            schedule.scope_id,
            schedule.version,
            message=message,
            metadata=metadata,
            now=self.clock.now(),
        )
        await self.events.insert_one(event)

    async def delete_schedule(self, schedule_id: str) -> bool:
        oid = object_id(schedule_id)
        return bool(oid and (await self.schedules.delete_one({"_id": oid})).deleted_count)

    # -- API keys --------------------------------------------------------------------------------
    # A key's creation and its revocation are each written with their event in one transaction:
    # the audit trail never misses one, nor names one that did not happen. Both are rare.

    async def insert_api_key(self, key: ApiKey) -> bool:
        """Store a new key and its `api_key_created` event; False if its name is taken."""
        doc = key.model_dump(by_alias=True, exclude={"id"})
        doc["_id"] = ObjectId(key.id)
        event = _key_event(key, "api_key_created", key.created_by, key.create_at)

        async def write(session: AsyncClientSession) -> None:
            await self.api_keys.insert_one(doc, session=session)
            await self.events.insert_one(event, session=session)

        try:
            await self._transaction(write)
        except DuplicateKeyError:
            return False
        return True

    async def get_api_key(self, key_id: str) -> ApiKey | None:
        oid = object_id(key_id)
        doc = await self.api_keys.find_one({"_id": oid}) if oid else None
        if doc is None:
            return None
        doc["id"] = str(doc.pop("_id"))
        return ApiKey.model_validate(doc)

    async def list_api_keys(self, before: str | None, limit: int) -> list[ApiKeyPublic]:
        """Keys newest first, revoked ones too, without their secrets' hashes; `before` is the
        id the previous page ended at."""
        find: Doc = {"_id": {"$lt": ObjectId(before)}} if before else {}
        cursor = self.api_keys.find(find, _NO_SECRET).sort("_id", -1).limit(limit)
        return [_public_key(d) async for d in cursor]

    async def revoke_api_key(self, key_id: str, actor: str) -> ApiKeyPublic | None:
        """Mark the key revoked by `actor`, with its `api_key_revoked` event. A key revoked
        already is left as it was (a repeated revoke changes nothing); None if no key has
        this id."""
        oid = object_id(key_id)
        if oid is None:
            return None
        now = self.clock.now()

        async def write(session: AsyncClientSession) -> Doc | None:
            doc = await self.api_keys.find_one_and_update(
                {"_id": oid, "revokedAt": None},
                {"$set": {"revokedAt": now, "revokedBy": actor}},
                _NO_SECRET,
                return_document=ReturnDocument.AFTER,
                session=session,
            )
            if doc is not None:
                event = _key_event(_public_key(doc), "api_key_revoked", actor, now)
                await self.events.insert_one(event, session=session)
            return doc

        doc = await self._transaction(write)
        if doc is None:  # revoked already, or no such key
            doc = await self.api_keys.find_one({"_id": oid}, _NO_SECRET)
        return _public_key(doc) if doc else None

    async def _transaction(self, write: Callable[[AsyncClientSession], Awaitable[T]]) -> T:
        """`write` in one transaction, committed with the store's write concern; a write
        conflict runs it again."""
        async with self.client.start_session() as session:
            return await session.with_transaction(write, write_concern=self.db.write_concern)

    # -- runs ----------------------------------------------------------------------------------

    async def insert_run(self, new: NewRun, actor: str) -> Run:
        """Write a new run and its `created` event: `queued`, as its creator pushes it to Redis
        next (the reconciler does if the creator cannot), or `pending` while it waits for its
        dedupe key.

        Concurrent calls are written together (group commit). The unique indexes decide dedupe
        and idempotency, so concurrent creates cannot both win.
        """
        return await self._inserts.submit((new, actor))

    async def insert_runs(self, news: Sequence[NewRun], actor: str) -> list[Run | Exception]:
        """Write many new runs in one unordered bulk insert; each item gets its run or the
        `DuplicateRun` / `KeyHeld` it collided with, and one bad item does not stop the rest."""
        return await self._insert_many([(new, actor) for new in news])

    async def _insert_many(self, items: list[tuple[NewRun, str]]) -> list[Run | Exception]:
        if not items:  # a batch whose every item was refused, or holds a dedupe key
            return []
        now = self.clock.now()
        runs: list[Run] = []
        docs: list[Doc] = []
        for new, actor in items:
            run, doc = self._new_run(new, actor, now)
            runs.append(run)
            docs.append(doc)
        outcomes: list[Run | Exception] = list(runs)
        try:
            await self.runs.insert_many(docs, ordered=False)
        except BulkWriteError as exc:
            if exc.details.get("writeConcernErrors"):
                raise
            for error in exc.details["writeErrors"]:
                i = error["index"]
                if error["code"] != _DUPLICATE_KEY:
                    raise
                duplicate = DuplicateKeyError(error["errmsg"], error["code"], error)
                outcomes[i] = await self._duplicate(duplicate, items[i][0])
        await self._copier.hand(
            [doc["trail"][0] for doc, o in zip(docs, outcomes, strict=True) if isinstance(o, Run)]
        )
        return outcomes

    @staticmethod
    def _new_run(new: NewRun, actor: str, now: datetime) -> tuple[Run, Doc]:
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
            status=RunStatus.PENDING if new.dedupe_wait else RunStatus.QUEUED,
            payload=new.payload,
            priority=t.priority if new.priority is None else new.priority,
            queue=t.queue,
            handler=t.handler_at(0),
            progress=Progress(steps=[StepProgress(id=s.id) for s in t.steps]),
            max_attempts=t.retry_policy.max_attempts,
            timeout_seconds=t.timeout_seconds,
            cancel_grace_seconds=t.cancel_policy.grace_seconds,
            not_before=new.not_before,
            dedupe_key=new.dedupe_key,
            dedupe_wait=new.dedupe_wait,
            idempotency_key=new.idempotency_key,
            schedule_id=new.schedule_id,
            scheduled_for=new.scheduled_for,
            rerun_of=new.rerun_of,
            create_at=now,
            update_at=now,
        )
        doc = run.model_dump(by_alias=True, exclude_none=True)
        del doc["id"]
        doc["_id"] = oid
        created = _event(
            run.id, "created", actor, run.scope, run.scope_id, 1, to=run.status, now=now
        )
        doc["trail"] = [created]
        return run, doc

    async def _duplicate(self, exc: DuplicateKeyError, new: NewRun) -> Exception:
        """Say which run the insert collided with. A run with the same idempotency key wins
        over a dedupe key collision: a repeated create is answered with its first run."""
        if new.idempotency_key is not None:
            same = {"scope": new.scope, "scopeId": new.scope_id}
            idempotent = {**same, "idempotencyKey": new.idempotency_key}
            existing = await self.runs.find_one(idempotent, _NO_TRAIL)
            if existing is not None:
                return DuplicateRun(_run(existing))
        pattern = (exc.details or {}).get("keyPattern", {})
        if "dedupeKey" in pattern:
            assert new.dedupe_key is not None
            return await self._key_held(new.dedupe_key, new.scope, new.scope_id)
        if "scheduleId" in pattern:
            fire = {"scheduleId": new.schedule_id, "scheduledFor": new.scheduled_for}
            fire |= _owner(new.scope, new.scope_id)
            existing = await self.runs.find_one(fire, _NO_TRAIL)
            if existing is not None:
                return DuplicateRun(_run(existing))
        # The run collided with was removed before this read; report the collision as it was.
        return exc

    async def _key_held(self, key: str, scope: str, scope_id: str) -> KeyHeld:
        """The run holding `key`: one of `scope` (the unique index is per scope)."""
        holder = await self.runs.find_one({**_owner(scope, scope_id), "dedupeKey": key}, _NO_TRAIL)
        return KeyHeld(key, _run(holder) if holder else None)

    async def take_key(self, run: Run, actor: str) -> Moved | Lost:
        """A run waiting for its dedupe key takes it (it stays `pending`, ready to queue).

        The unique index decides between takers; raises `KeyHeld` if another run has the key.
        """
        key = run.dedupe_wait
        oid = object_id(run.id)
        if key is None or oid is None:
            return Lost(run.id, "status", run.status)
        query = {"_id": oid, **_owner(run.scope, run.scope_id)}
        query |= {"status": RunStatus.PENDING, "dedupeWait": key}
        now = self.clock.now()
        update: Doc = {
            "$set": {"dedupeKey": key, "updateAt": now},
            "$unset": {"dedupeWait": ""},
            "$inc": {"version": 1},
        }

        def events(state: Known) -> list[Doc]:
            return [
                _event(
                    run.id,
                    "dedupe_key_taken",
                    actor,
                    state.scope,
                    state.scope_id,
                    state.version + 1,
                    metadata={"dedupeKey": key},
                    now=now,
                )
            ]

        try:
            written = await self._write(query, lambda _: update, None, CLAIMABLE, None, events)
        except DuplicateKeyError:
            raise await self._key_held(key, run.scope, run.scope_id) from None
        if written is None:
            return await self._lost(run.id, None, "take_key", _owner(run.scope, run.scope_id))
        await self._copier.hand(written[1])
        return Moved(run.id, RunStatus.PENDING, RunStatus.PENDING)

    async def next_waiting(self, key: str) -> Run | None:
        """The oldest pending run waiting for `key`."""
        query = {"dedupeWait": key, "status": RunStatus.PENDING}
        doc = await self.runs.find_one(query, _NO_TRAIL, sort=[("_id", 1)])
        return _run(doc) if doc else None

    async def waited_keys(self, limit: int) -> list[str]:
        """Keys that pending runs wait for and no active run holds: the process that freed
        them may have died before it admitted the next run (held keys are left out, so a
        backlog of them cannot crowd out the free ones)."""
        cursor = await self.runs.aggregate(
            [
                {"$match": {"dedupeWait": {"$exists": True}, "status": RunStatus.PENDING}},
                # A key's runs are all of one scope (see `index_models`), so the holder is
                # looked up under the unique index, which starts with the scope.
                {
                    "$group": {
                        "_id": "$dedupeWait",
                        "scope": {"$first": "$scope"},
                        "scopeId": {"$first": "$scopeId"},
                    }
                },
                {
                    "$lookup": {
                        "from": self.runs.name,
                        "localField": "_id",
                        "foreignField": "dedupeKey",
                        "let": {"scope": "$scope", "scopeId": "$scopeId"},
                        "as": "holder",
                        "pipeline": [
                            {
                                "$match": {
                                    "$expr": {
                                        "$and": [
                                            {"$eq": ["$scope", "$$scope"]},
                                            {"$eq": ["$scopeId", "$$scopeId"]},
                                        ]
                                    },
                                    "status": {"$nin": sorted(TERMINAL)},
                                }
                            }
                        ],
                    }
                },
                {"$match": {"holder": {"$size": 0}}},
                {"$limit": limit},
            ]
        )
        return [d["_id"] async for d in cursor]

    async def get_run(self, run_id: str) -> Run | None:
        """The run, live or archived."""
        doc = await self._find_run(run_id, _NO_TRAIL)
        return _run(doc) if doc else None

    async def _find_run(self, run_id: str, projection: Doc) -> Doc | None:
        # `archive_runs` copies before it deletes, so a run that is not in `job_runs` by the
        # time this reads it is in the archive already.
        oid = object_id(run_id)
        if oid is None:
            return None
        doc = await self.runs.find_one({"_id": oid}, projection)
        return doc if doc is not None else await self.archive.find_one({"_id": oid}, projection)

    async def events_of(self, run_id: str) -> list[Event]:
        """The run's whole trail, whether or not its events were copied to `job_events` yet
        (plus `stale_write_rejected` events, which are not a write to the run)."""
        run = await self._find_run(run_id, {"trail": 1, **_OWNER_FIELDS})
        # A run's events carry its scope: read from its shard alone.
        of_run = {"jobId": run_id, **(_owner(run["scope"], run["scopeId"]) if run else {})}
        copied = await self.events.find(of_run).to_list()
        trail = {d["_id"]: d for d in [*(run or {}).get("trail", []), *copied]}
        # The run's version orders its trail: MongoDB serialized the writes that made it, while
        # clocks of two processes (or two writes in one millisecond) cannot.
        return sorted(map(_event_model, trail.values()), key=lambda e: (e.run_version, e.id))

    async def list_runs(
        self, query: RunQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Run]:
        """Runs matching `query`, newest first, only in the scopes `within` unless it is None."""
        find: Doc = {
            field: value
            for field, value in (
                ("status", query.status),
                ("templateType", query.template_type),
                ("scope", query.scope),
                ("scopeId", query.scope_id),
                ("scheduleId", query.schedule_id),
            )
            if value is not None
        }
        if query.status in TERMINAL:
            # True of every ended run; it lets the partial index of ended runs serve the query.
            find["completedAt"] = {"$exists": True}
        if within is not None:
            find["$or"] = [{"scope": s, "scopeId": i} for s, i in within]
        if query.before is not None:
            find["_id"] = {"$lt": ObjectId(query.before)}
        cursor = self.runs.find(find, _NO_TRAIL).sort("_id", -1).limit(limit)
        return [_run(d) async for d in cursor]

    def event_query(self, query: EventQuery, within: Sequence[tuple[str, str]] | None) -> Doc:
        """The filter of `list_events` (public so a test can check its plan with `explain`)."""
        find: Doc = {
            field: value
            for field, value in (
                ("jobId", query.job_id),
                ("type", query.type),
                ("scope", query.scope),
                ("scopeId", query.scope_id),
                ("actor", query.actor),
            )
            if value is not None
        }
        if within is not None:
            find["$or"] = [{"scope": s, "scopeId": i} for s, i in within]
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

    async def list_events(
        self, query: EventQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Event]:
        """Events matching `query` in (createAt, _id) order, after `query.after`."""
        find = self.event_query(query, within)
        cursor = self.events.find(find).sort([("createAt", 1), ("_id", 1)]).limit(limit)
        return [_event_model(d) async for d in cursor]

    async def sweep_trails(self, settled: datetime) -> int:
        """Copy the events missing from `job_events` of runs written since the last sweep and
        before `settled`: events whose writer died before it copied them.

        The last sweep's end is kept in `job_meta`; the window reaches `_SWEEP_SKEW` before it,
        since `updateAt` comes from the writers' clocks. Returns how many events were copied.
        """
        mark = await self.meta.find_one({"_id": "trail_sweep"})
        since = mark["through"] - _SWEEP_SKEW if mark else datetime.min.replace(tzinfo=UTC)
        cursor = await self.runs.aggregate(
            [
                {"$match": {"updateAt": {"$gte": since, "$lt": settled}}},
                # Only events written in the window: a run's older events were swept before.
                {"$project": {"_id": 0, "trail": 1}},
                {"$unwind": "$trail"},
                {"$match": {"trail.createAt": {"$gte": since}}},
                {
                    "$lookup": {
                        "from": self.events.name,
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
        await self.meta.update_one(
            {"_id": "trail_sweep"}, {"$set": {"through": settled}}, upsert=True
        )
        return len(missing)

    async def _copy_events(self, events: list[Doc]) -> None:
        """Copy events from the runs' trails into `job_events`, in bulk, off the writers' path.

        A write appends its events to the run's `trail` in the same update, so they are as
        durable as the write itself, and the trail is kept. Whatever a process that died never
        copied, the scheduler's sweep finds in the trails and copies.
        """
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
            await self.events.insert_many(events, ordered=False)
        except BulkWriteError as exc:
            # Each copy keeps the event's `_id`: copied before (by this process or by the
            # sweep), it is a duplicate-key no-op.
            if exc.details.get("writeConcernErrors") or any(
                e["code"] != _DUPLICATE_KEY for e in exc.details["writeErrors"]
            ):
                raise

    async def archive_runs(self, before: datetime, limit: int) -> int:
        """Move up to `limit` runs that ended before `before` to `job_runs_archive`; returns
        how many moved.

        Each run is copied (replacing an earlier copy a crashed pass left) before it is deleted,
        and deleted only at the version copied, so a reader always finds it in one of the two.
        Runs holding a dedupe key stay: a non-repeatable template's key must stay unique.
        """
        docs = await self.runs.find(archivable(before)).limit(limit).to_list()
        if not docs:
            return 0
        # Both by shard key too: a sharded cluster refuses an upsert without it, and sends
        # the delete only to the shards of the runs' scopes.
        await self.archive.bulk_write(
            [ReplaceOne(_run_key(d), d, upsert=True) for d in docs], ordered=False
        )
        moved = await self.runs.delete_many(
            {"$or": [{**_run_key(d), "version": d["version"]} for d in docs]}
        )
        return moved.deleted_count

    async def claimable(self, after: str | None, limit: int, idle_since: datetime) -> list[Run]:
        """Pending and queued runs untouched since `idle_since`, in id order, for the reconciler
        to check against Redis (younger ones are most likely being created right now)."""
        query: Doc = {
            "status": {"$in": sorted(CLAIMABLE)},
            "updateAt": {"$lt": idle_since},
            "dedupeWait": {"$exists": False},
        }
        if after:
            query["_id"] = {"$gt": ObjectId(after)}
        cursor = self.runs.find(query, _NO_TRAIL).sort("_id", 1).limit(limit)
        return [_run(d) async for d in cursor]

    # -- transitions without a lease -----------------------------------------------------------

    async def enqueue(
        self, run_id: str, actor: str, scope: tuple[str, str] | None = None
    ) -> Moved | Lost:
        """pending → queued: a run that took the dedupe key it waited for, or one the
        reconciler found `pending` (its process died before it could queue it).

        Here and in the other writes by run id, `scope` is the run's scope, when the caller
        knows it: the write then goes to the run's shard alone (see `SHARD_KEYS`).
        """
        return await self._transition("enqueue", run_id, actor, extra=_NOT_WAITING, scope=scope)

    async def cancel(
        self,
        run_id: str,
        actor: str,
        reason: str | None,
        scope: tuple[str, str] | None = None,
    ) -> Moved | Lost:
        """A run no worker holds yet ends at once; its pending steps are skipped."""
        now = self.clock.now()
        return await self._transition(
            "cancel",
            run_id,
            actor,
            set_={
                "cancelRequestedAt": now,
                "cancelReason": reason,
                "cancelRequestedBy": actor,
                "completedAt": now,
                "progress.steps.$[p].status": StepStatus.SKIPPED,
            },
            unset=["dedupeKey", "dedupeWait"],
            array_filters=[_UNDONE_STEP],
            message=reason,
            scope=scope,
        )

    async def request_cancel(
        self,
        run_id: str,
        actor: str,
        reason: str | None,
        grace_seconds: float = 30,
        scope: tuple[str, str] | None = None,
    ) -> Moved | Lost:
        """Ask the worker holding the run to stop; it converges via `acknowledge_cancel`, or
        the reaper overrules it once `grace_seconds` have passed (`cancel_timeout`)."""
        now = self.clock.now()
        return await self._transition(
            "request_cancel",
            run_id,
            actor,
            set_={
                "cancelRequestedAt": now,
                "cancelReason": reason,
                "cancelRequestedBy": actor,
                "cancelDeadline": now + timedelta(seconds=grace_seconds),
            },
            also=[("cancel_requested", reason, {})],
            message=reason,
            scope=scope,
        )

    async def claim(
        self, run_ids: Sequence[str], worker_id: str, lease_seconds: float
    ) -> list[tuple[Run, Lease]]:
        """Lease every claimable run among `run_ids` to `worker_id` under a fresh token.

        One conditional `update_many` and one read-back take the leases; ids whose runs are no
        longer claimable (cancelled, claimed by another worker, not yet due) are not returned.
        Ids popped from Redis come without their runs' scopes, so on a sharded cluster both go
        to every shard: a `find_one_and_update` would need the shard key (MongoDB 6.0), while
        a multi-document update and a read may go by `_id` alone.
        """
        oids = [oid for oid in map(object_id, run_ids) if oid]
        if not oids:
            return []
        now = self.clock.now()
        token = secrets.token_hex(12)
        due = {"$or": [{"notBefore": None}, {"notBefore": {"$lte": now}}]}
        actor = f"worker:{worker_id}"
        event_ids = [ObjectId() for _ in oids]
        # The claim event is built by the pipeline, which sees each run as it was before the
        # write: its `from` status and version are exact whatever lands after. Its `_id` comes
        # from the list made here, so this worker knows which event in the trail is its own.
        claim_event = {
            "_id": {
                "$arrayElemAt": [
                    {"$literal": event_ids},
                    {"$indexOfArray": [{"$literal": oids}, "$_id"]},
                ]
            },
            "jobId": {"$toString": "$_id"},
            "type": "status_changed",
            "actor": {"$literal": actor},
            "scope": "$scope",
            "scopeId": "$scopeId",
            "metadata": {
                "transition": "claim",
                "attempt": {"$add": ["$attempt", 1]},
                "lease": {"$literal": token[:8]},
            },
            "runVersion": {"$add": ["$version", 1]},
            "createAt": now,
            "from": "$status",
            "to": RunStatus.RUNNING.value,
        }
        claimable = {
            "_id": {"$in": oids},
            "status": {"$in": sorted(CLAIMABLE)},
            "dedupeWait": {"$exists": False},
            **due,
        }
        take = [
            {
                "$set": {
                    "version": {"$add": ["$version", 1]},
                    "attempt": {"$add": ["$attempt", 1]},
                    "status": {"$literal": RunStatus.RUNNING.value},
                    "lockedBy": {"$literal": worker_id},
                    "leaseToken": {"$literal": token},
                    "lockedUntil": now + timedelta(seconds=lease_seconds),
                    "heartbeatAt": now,
                    "updateAt": now,
                    "startedAt": {"$ifNull": ["$startedAt", now]},
                    # Unset unless a shutdown handed the attempt back: then this claim goes on
                    # with it.
                    "attemptStartedAt": {"$ifNull": ["$attemptStartedAt", now]},
                    # The whole-run limit counts from the first start, across attempts.
                    "deadline": {
                        "$ifNull": [
                            "$deadline",
                            {
                                "$cond": [
                                    {"$gt": ["$timeoutSeconds", 0]},
                                    {"$add": [now, {"$multiply": ["$timeoutSeconds", 1000]}]},
                                    "$$REMOVE",
                                ]
                            },
                        ]
                    },
                    "trail": {"$concatArrays": [{"$ifNull": ["$trail", []]}, [claim_event]]},
                }
            }
        ]
        await self.runs.update_many(claimable, take)
        # The runs this token won, each with only this claim's event of its trail: the rest is
        # not the worker's to copy.
        mine = {"$in": ["$$this._id", {"$literal": event_ids}]}
        cursor = await self.runs.aggregate(
            [
                {"$match": {"_id": {"$in": oids}, "lockedBy": worker_id, "leaseToken": token}},
                {"$set": {"trail": {"$filter": {"input": "$trail", "cond": mine}}}},
            ]
        )
        docs = await cursor.to_list()
        claimed: list[tuple[Run, Lease]] = []
        for doc in docs:
            run = _run(doc)
            claimed.append((run, Lease(run.id, worker_id, token, _known(doc))))
        await self._copier.hand([e for doc in docs for e in doc.get("trail", [])])
        return claimed

    async def expired_leases(self, limit: int) -> list[Run]:
        """Leased runs whose `lockedUntil` has passed, oldest lease first."""
        query = {"status": {"$in": sorted(LEASED)}, "lockedUntil": {"$lt": self.clock.now()}}
        cursor = self.runs.find(query, _NO_TRAIL).sort("lockedUntil", 1).limit(limit)
        return [_run(d) async for d in cursor]

    async def overdue(self, limit: int) -> tuple[list[Run], list[Run]]:
        """Runs past their deadline, and cancel-requested runs past their grace."""
        now = self.clock.now()
        late = {"status": {"$in": sorted(LEASED)}, "deadline": {"$lt": now}}
        slow = {"status": RunStatus.CANCEL_REQUESTED, "cancelDeadline": {"$lt": now}}
        return (
            [_run(d) async for d in self.runs.find(late, _NO_TRAIL).limit(limit)],
            [_run(d) async for d in self.runs.find(slow, _NO_TRAIL).limit(limit)],
        )

    async def expire_deadline(self, run: Run, actor: str) -> Moved | Lost:
        """End a run whose deadline passed, even if its worker still heartbeats: the lease is
        taken away, so the worker's later writes are fenced."""
        now = self.clock.now()
        error = RunError(
            code="deadline_exceeded",
            message=f"run exceeded its timeout of {run.timeout_seconds}s (deadline {run.deadline})",
            step=run.phase,
        )
        return await self._transition(
            "deadline_expire",
            run.id,
            actor,
            extra={"deadline": {"$lte": now}},
            error=error,
            set_={
                "completedAt": now,
                "progress.steps.$[r].status": StepStatus.FAILED,
                "progress.steps.$[r].completedAt": now,
                "progress.steps.$[p].status": StepStatus.SKIPPED,
            },
            unset=[*_LEASE_FIELDS, "dedupeKey"],
            array_filters=[_RUNNING_STEP, _UNDONE_STEP],
            message=error.message,
            scope=(run.scope, run.scope_id),
        )

    async def time_out_cancel(self, run: Run) -> Moved | Lost:
        """The worker did not acknowledge a cancel within the grace: cancel it without it."""
        now = self.clock.now()
        return await self._transition(
            "cancel_timeout",
            run.id,
            "reaper",
            extra={"cancelDeadline": {"$lte": now}},
            set_={
                "completedAt": now,
                "progress.steps.$[r].status": StepStatus.CANCELLED,
                "progress.steps.$[r].completedAt": now,
                "progress.steps.$[p].status": StepStatus.SKIPPED,
            },
            unset=[*_LEASE_FIELDS, "dedupeKey"],
            array_filters=[_RUNNING_STEP, _UNDONE_STEP],
            message=f"cancel not acknowledged within {run.cancel_grace_seconds}s",
            also=[("cancel_timeout", None, {"graceSeconds": run.cancel_grace_seconds})],
            scope=(run.scope, run.scope_id),
        )

    async def reap(self, run: Run) -> Moved | Lost:
        """Recover a run whose lease expired, as seen in `run`.

        A cancel-requested run is cancelled; one with attempts left is queued again (the lost
        lease counted as an attempt, so a poison run cannot loop forever); the rest expire.
        The filter repeats what that choice was made on: the expired lease, so a heartbeat that
        renewed it meanwhile wins, and the status, so a cancel requested meanwhile is not
        overruled by an expiry (the next pass cancels the run).
        """
        now = self.clock.now()
        seen = {"status": run.status, "leaseToken": run.lease_token, "lockedUntil": {"$lt": now}}
        stopped = {"progress.steps.$[r].status": StepStatus.FAILED, "completedAt": now}
        error = RunError(
            code="lease_expired",
            message=f"lease of {run.locked_by} expired at {run.locked_until}",
            step=run.phase,
        )
        running = [_RUNNING_STEP]
        lease_event = (
            "lease_expired",
            f"lease of {run.locked_by} expired",
            {"attempt": run.attempt},
        )
        if run.status is RunStatus.CANCEL_REQUESTED:
            stopped["progress.steps.$[r].status"] = StepStatus.CANCELLED
            return await self._transition(
                "reap_cancel",
                run.id,
                "reaper",
                extra=seen,
                set_=stopped,
                unset=[*_LEASE_FIELDS, "dedupeKey"],
                array_filters=running,
                also=[lease_event],
                scope=(run.scope, run.scope_id),
            )
        if run.attempt < run.max_attempts:
            return await self._transition(
                "reap_requeue",
                run.id,
                "reaper",
                extra=seen,
                error=error,
                set_={"progress.steps.$[r].status": StepStatus.PENDING},
                unset=list(_LEASE_FIELDS),
                array_filters=running,
                also=[lease_event],
                scope=(run.scope, run.scope_id),
            )
        return await self._transition(
            "reap_expire",
            run.id,
            "reaper",
            extra=seen,
            error=error,
            set_=stopped,
            unset=[*_LEASE_FIELDS, "dedupeKey"],
            array_filters=running,
            also=[lease_event],
            scope=(run.scope, run.scope_id),
        )

    # -- worker writes: fenced by lockedBy + leaseToken ----------------------------------------

    async def heartbeat(
        self, worker_id: str, leases: Sequence[Lease], lease_seconds: float
    ) -> tuple[set[str], set[str]]:
        """Renew many leases at once.

        Returns the ids still held and, among them, those whose cancel was requested, and keeps
        each held lease's `known` state current. Only the worker can tell a lease lost from a
        run it finished meanwhile, so nothing is recorded.
        """
        # Grouped by token and by scope where the lease knows it: on a sharded cluster each
        # group goes only to the shard of its scope.
        groups: dict[tuple[str, str | None, str | None], list[ObjectId]] = {}
        for lease in leases:
            known = lease.known
            group = (lease.token, *((known.scope, known.scope_id) if known else (None, None)))
            groups.setdefault(group, []).append(ObjectId(lease.run_id))
        if not groups:
            return set(), set()
        now = self.clock.now()
        held_filter = {
            "lockedBy": worker_id,
            "status": {"$in": sorted(LEASED)},
            "$or": [
                {
                    "leaseToken": token,
                    **(_owner(scope, scope_id) if scope and scope_id else {}),
                    "_id": {"$in": ids},
                }
                for (token, scope, scope_id), ids in groups.items()
            ],
        }
        until = now + timedelta(seconds=lease_seconds)
        await self.runs.update_many(
            held_filter,
            {"$set": {"lockedUntil": until, "heartbeatAt": now}, "$inc": {"version": 1}},
        )
        found = await self.runs.find(held_filter, _STATE_FIELDS).to_list()
        docs = {str(d["_id"]): d for d in found}
        for lease in leases:
            doc = docs.get(lease.run_id)
            # The beat moved the version: the worker's next write would miss and read it again.
            if doc and (lease.known is None or lease.known.version < doc["version"]):
                lease.known = _known(doc)
        cancel = {i for i, d in docs.items() if d["status"] == RunStatus.CANCEL_REQUESTED}
        return set(docs), cancel

    async def start_step(
        self, lease: Lease, index: int, step_id: str, at: datetime | None = None
    ) -> Lost | None:
        """Mark a step running. Workers write this only for steps that are not over at once."""
        now = self.clock.now()
        started, events = _unwritten_start(index, step_id, at or now)
        s = f"progress.steps.{index}"
        update = {**started, f"{s}.status": StepStatus.RUNNING, f"{s}.percentage": 0}
        return await self._fenced_write(lease, "start_step", {"$set": update}, events, now)

    async def finish_step(
        self,
        lease: Lease,
        index: int,
        step_id: str,
        output: Any,
        percentage: float,
        started_at: datetime | None = None,
        *,
        next_handler: str | None,
    ) -> Lost | None:
        """Record a step's success (and its start, when that was not written yet); the run's
        `handler` becomes the next step's."""
        now = self.clock.now()
        update, events = _unwritten_start(index, step_id, started_at)
        update |= {
            **_step_succeeded(index, step_id, output, now),
            "progress.percentage": percentage,
        }
        events.append(("step_finished", None, {"step": step_id}))
        write: Doc = {"$set": update}
        if next_handler is None:
            write["$unset"] = {"handler": ""}
        else:
            update["handler"] = next_handler
        return await self._fenced_write(lease, "finish_step", write, events, now)

    async def report_progress(
        self,
        lease: Lease,
        index: int,
        step_percentage: float,
        percentage: float,
        message: str | None,
    ) -> Lost | None:
        """Progress is frequent, so it writes the run only; no event per tick."""
        s = f"progress.steps.{index}"
        update: Doc = {f"{s}.percentage": step_percentage, f"{s}.message": message}
        if message is not None:
            update["progress.summary"] = message
        # $max: the run's progress never goes back, whatever order writes land in.
        write = {"$set": update, "$max": {"progress.percentage": percentage}}
        return await self._fenced_write(lease, "progress", write, [], self.clock.now())

    async def complete(
        self,
        lease: Lease,
        index: int,
        step_id: str,
        output: Any,
        result: Any,
        started_at: datetime | None = None,
        spend_key: bool = False,
    ) -> Moved | Lost:
        """The last step succeeded. With `spend_key` (a template that is not `repeatable`) the
        run keeps its dedupe key, so the unique index refuses every later run for that key."""
        now = self.clock.now()
        started, before = _unwritten_start(index, step_id, started_at)
        before.append(("step_finished", None, {"step": step_id}))
        return await self._transition(
            "complete",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_={
                **started,
                **_step_succeeded(index, step_id, output, now),
                "result": result,
                "completedAt": now,
                "progress.percentage": 100,
            },
            unset=["leaseToken", "lockedUntil", *([] if spend_key else ["dedupeKey"])],
            before=before,
        )

    async def fail(
        self, lease: Lease, index: int, error: RunError, started_at: datetime | None = None
    ) -> Moved | Lost:
        """End the run `failed`: retries exhausted or a non-retryable error (a dead letter)."""
        now = self.clock.now()
        started, before = _step_ended_badly(index, error, started_at)
        return await self._transition(
            "fail",
            lease.run_id,
            lease.actor,
            lease=lease,
            error=error,
            set_={**started, **_step_failed(index, error, now), "completedAt": now},
            unset=["leaseToken", "lockedUntil", "dedupeKey"],
            before=before,
            message=error.message,
        )

    async def retry(
        self,
        lease: Lease,
        index: int,
        error: RunError,
        not_before: datetime,
        started_at: datetime | None = None,
    ) -> Moved | Lost:
        """Queue the run again after a retryable failure; it resumes at the failed step."""
        now = self.clock.now()
        started, before = _step_ended_badly(index, error, started_at)
        return await self._transition(
            "retry",
            lease.run_id,
            lease.actor,
            lease=lease,
            error=error,
            set_={**started, **_step_failed(index, error, now), "notBefore": not_before},
            unset=list(_LEASE_FIELDS),
            before=before,
            message=error.message,
            also=[("retry_scheduled", None, {"notBefore": not_before.isoformat()})],
        )

    async def release(self, lease: Lease, handler: str | None = None) -> Moved | Lost:
        """Hand a run back without spending the attempt it was on: on shutdown, or (with
        `handler`, its current step's) to a worker that offers the handler this one lacks."""
        set_: Doc = {"progress.steps.$[r].status": StepStatus.PENDING}
        if handler is not None:
            set_["handler"] = handler
        return await self._transition(
            "release",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_=set_,
            unset=list(_LEASE_FIELDS),
            inc={"attempt": -1},
            array_filters=[{"r.status": StepStatus.RUNNING}],
            message=None if handler is None else f"handed on for handler {handler!r}",
        )

    async def acknowledge_cancel(self, lease: Lease, interrupted: bool) -> Moved | Lost:
        """The worker stopped: steps not done are skipped, and the step it was in is cancelled
        if a checkpoint interrupted it (skipped if the cancel came between steps)."""
        now = self.clock.now()
        stopped = StepStatus.CANCELLED if interrupted else StepStatus.SKIPPED
        return await self._transition(
            "acknowledge_cancel",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_={
                "completedAt": now,
                "progress.steps.$[r].status": stopped,
                "progress.steps.$[r].completedAt": now,
                "progress.steps.$[p].status": StepStatus.SKIPPED,
            },
            unset=["leaseToken", "lockedUntil", "dedupeKey"],
            array_filters=[_RUNNING_STEP, _UNDONE_STEP],
        )

    async def wait_worker(
        self, lease: Lease, index: int, step_id: str, worker_type: str
    ) -> Moved | Lost:
        """Hand the current step to an external worker: the inline worker lets go of the lease
        (a step may wait for an external worker longer than any lease), and the run waits
        for `claim_external`."""
        now = self.clock.now()
        return await self._transition(
            "wait_worker",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_={
                "phase": step_id,
                "externalType": worker_type,
                f"progress.steps.{index}.status": StepStatus.RUNNING,
                f"progress.steps.{index}.startedAt": now,
            },
            unset=list(_LEASE_FIELDS),
        )

    async def claim_external(
        self, worker_type: str, worker_id: str, lease_seconds: float
    ) -> tuple[Run, Lease] | None:
        """Lease the oldest run waiting for a `worker_type` worker to `worker_id` (`resume`).

        Two external workers may pick the same run; the guarded write lets one have it and the
        other tries the next.
        """
        waiting = {"status": RunStatus.WAITING_WORKER, "externalType": worker_type}
        for _ in range(5):
            doc = await self.runs.find_one(waiting, _OWNER_FIELDS, sort=[("_id", 1)])
            if doc is None:
                return None
            now = self.clock.now()
            token = secrets.token_hex(12)
            lease = Lease(str(doc["_id"]), worker_id, token)
            moved = await self._transition(
                "resume",
                lease.run_id,
                lease.actor,
                lease=lease,
                extra={"externalType": worker_type},
                set_={
                    "lockedBy": worker_id,
                    "leaseToken": token,
                    "lockedUntil": now + timedelta(seconds=lease_seconds),
                    "heartbeatAt": now,
                },
                unset=["externalType"],
                scope=(doc["scope"], doc["scopeId"]),
            )
            if isinstance(moved, Moved):
                run = await self.get_run(lease.run_id)
                assert run is not None
                return run, lease
        return None

    # -- the machinery -------------------------------------------------------------------------

    async def _transition(
        self,
        name: str,
        run_id: str,
        actor: str,
        *,
        lease: Lease | None = None,
        extra: Mapping[str, Any] | None = None,
        error: RunError | None = None,
        set_: Mapping[str, Any] | None = None,
        unset: Sequence[str] = (),
        inc: Mapping[str, int] | None = None,
        array_filters: list[Doc] | None = None,
        before: Sequence[tuple[str, str | None, Doc]] = (),
        also: Sequence[tuple[str, str | None, Doc]] = (),
        message: str | None = None,
        scope: tuple[str, str] | None = None,
    ) -> Moved | Lost:
        """Apply the named transition as one conditional write, then record its events.

        `error` is the one the attempt in progress ended with (see `_attempt_failed`).
        `before` events are written ahead of the `status_changed` event, `also` after it.
        `scope` is the run's (the lease's known state has it too): given, even the read of a
        run's state goes to its one shard.
        """
        t = TRANSITIONS[name]
        if object_id(run_id) is None:
            return Lost(run_id, "missing")
        query: Doc = {"_id": ObjectId(run_id), "status": {"$in": sorted(t.sources)}}
        owner = _known_owner(lease, scope)
        query |= owner
        if t.fenced:
            assert lease is not None, f"{name} is a worker write and needs a lease"
            query |= {"lockedBy": lease.worker_id, "leaseToken": lease.token}
        query |= extra or {}
        now = self.clock.now()
        update: Doc = {
            "$set": {"status": t.target, "updateAt": now, **(set_ or {})},
            "$inc": {"version": 1, **(inc or {})},
        }
        if unset:
            update["$unset"] = dict.fromkeys(unset, "")

        def changes(state: Known) -> Doc:
            if error is None:
                return update
            return _merged(update, _attempt_failed(error, state, t.target in TERMINAL, now))

        def events(state: Known) -> list[Doc]:
            def event(kind: str, m: str | None, md: Doc, **moved: RunStatus) -> Doc:
                return _event(
                    run_id,
                    kind,
                    actor,
                    state.scope,
                    state.scope_id,
                    state.version + 1,
                    message=m,
                    metadata=md,
                    now=now,
                    **moved,
                )

            return [
                *(event(*e) for e in before),
                event(
                    "status_changed", message, {"transition": name}, from_=state.status, to=t.target
                ),
                *(event(*e) for e in also),
            ]

        written = await self._write(
            query, changes, lease.known if lease else None, t.sources, array_filters, events
        )
        if written is None:
            # Only a fenced write can come from a superseded lease: a lease offered to an
            # unfenced move (an external worker's `resume` that lost the race) was never granted.
            return await self._lost(run_id, lease if t.fenced else None, name, owner)
        state, trail = written
        if lease is not None:
            lease.known = replace(state, status=t.target, version=state.version + 1)
        await self._copier.hand(trail)
        return Moved(run_id, state.status, t.target)

    async def _fenced_write(
        self,
        lease: Lease,
        what: str,
        update: Doc,
        events: Sequence[tuple[str, str | None, Doc]],
        now: datetime,
    ) -> Lost | None:
        """A worker write that changes no status, allowed while the lease is held."""
        oid = ObjectId(lease.run_id)
        owner = _known_owner(lease, None)
        query = {
            "_id": oid,
            **owner,
            "status": {"$in": sorted(LEASED)},
            "lockedBy": lease.worker_id,
            "leaseToken": lease.token,
        }
        update["$set"]["updateAt"] = now
        update["$inc"] = {"version": 1}
        if not events:
            # Without events the write names no state it moves the run from, so the lease is
            # its whole condition: a heartbeat that moved the version cannot make it miss.
            if not await self._updates.submit(_Update(query, update)):
                return await self._lost(lease.run_id, lease, what, owner)
            if lease.known is not None:
                # Exact unless another write landed meanwhile; then the next write that needs
                # the version misses once and reads it.
                lease.known = replace(lease.known, version=lease.known.version + 1)
            return None

        def trail(state: Known) -> list[Doc]:
            return [
                _event(
                    lease.run_id,
                    kind,
                    lease.actor,
                    state.scope,
                    state.scope_id,
                    state.version + 1,
                    message=m,
                    metadata=meta,
                    now=now,
                )
                for kind, m, meta in events
            ]

        written = await self._write(query, lambda _: update, lease.known, LEASED, None, trail)
        if written is None:
            return await self._lost(lease.run_id, lease, what, owner)
        state, recorded = written
        lease.known = replace(state, version=state.version + 1)
        await self._copier.hand(recorded)
        return None

    async def _write(
        self,
        query: Doc,
        update: Callable[[Known], Doc],
        known: Known | None,
        allowed: frozenset[RunStatus],
        array_filters: list[Doc] | None,
        events: Callable[[Known], list[Doc]],
    ) -> tuple[Known, list[Doc]] | None:
        """One conditional write that appends its events to the run's trail.

        The events (and the attempt an update may end) name the state the write moves the run
        from, so the write is filtered on that exact status and version as well as on the
        guards in `query`. A writer that knows the state from its own last write (`known`)
        needs no read; otherwise it reads the state, and reads again if another write got in
        between. Returns the state before the write and the events written, or None once a
        read shows the guards no longer hold.
        """
        state = known if known is not None and known.status in allowed else None
        while True:
            if state is None:
                doc = await self.runs.find_one(query, _STATE_FIELDS)
                if doc is None:
                    return None
                state = _known(doc)
            trail = events(state)
            exact = _Update.exact(query, update(state), state, trail, array_filters)
            if await self._updates.submit(exact):
                return state, trail
            state = None

    async def _update_many(self, updates: list[_Update]) -> list[bool | Exception]:
        """Apply many writers' conditional updates in one unordered bulk write; each learns
        whether its own filter matched."""
        ops = [UpdateOne(u.query, u.update, array_filters=u.array_filters) for u in updates]
        outcomes: list[bool | Exception] = [True] * len(updates)
        try:
            result = await self.runs.bulk_write(ops, ordered=False)
            matched = result.matched_count
        except BulkWriteError as exc:
            if exc.details.get("writeConcernErrors"):
                raise
            for error in exc.details["writeErrors"]:
                # What `update_one` would have raised for this update alone.
                kind = DuplicateKeyError if error["code"] == _DUPLICATE_KEY else WriteError
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
            runs = [_identity(u.query) for u, f in zip(updates, firsts, strict=True) if f]
            cursor = await self.runs.aggregate(
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
            held = await self.runs.find({"$or": guards}, {"_id": 1}).to_list()
            applied |= {doc["_id"] for doc in held}
        # Event ids and run ids are all ObjectIds, unique across both.
        return [
            (first or u.query["_id"]) in applied if o is True else o
            for u, first, o in zip(updates, firsts, outcomes, strict=True)
        ]

    async def lease_lost(self, lease: Lease, what: str) -> Lost:
        """Record why `lease` no longer holds its run (for a loss the worker found itself)."""
        return await self._lost(lease.run_id, lease, what, _known_owner(lease, None))

    async def _lost(
        self, run_id: str, lease: Lease | None, what: str, owner: Doc | None = None
    ) -> Lost:
        """Say why a write matched nothing; a superseded lease is put on the record. `owner`
        is the run's scope, if the caller knows it."""
        oid = object_id(run_id)
        if oid is None:
            return Lost(run_id, "missing")
        doc = await self.runs.find_one({"_id": oid, **(owner or {})}, _STATE_FIELDS)
        if doc is None:
            return Lost(run_id, "missing")
        status = RunStatus(doc["status"])
        holder = (doc.get("lockedBy"), doc.get("leaseToken"))
        if lease is not None and holder != (lease.worker_id, lease.token):
            meta = {"write": what, "lease": lease.token[:8], "worker": lease.worker_id}
            # No run write to ride on: the event is inserted on its own.
            rejected = _event(
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
            await self.events.insert_one(rejected)
            return Lost(run_id, "lease", status)
        return Lost(run_id, "status", status)


async def shard_database(url: str, db_name: str) -> list[str]:
    """`MongoStore.shard` for `jobplane db shard`: connects, shards, closes."""
    store = MongoStore.connect(url, db_name)
    try:
        return await store.shard()
    finally:
        await store.close()


# -- conversion to and from BSON: here and nowhere else ------------------------------------------


def _known_owner(lease: Lease | None, scope: tuple[str, str] | None) -> Doc:
    """The shard key filter of a run, from `scope` or the lease's known state; empty if
    neither is known (then the write goes by `_id` alone, which MongoDB allows)."""
    if scope is not None:
        return _owner(*scope)
    if lease is not None and lease.known is not None:
        return lease.known.owner
    return {}


def _known(doc: Doc) -> Known:
    """A run's state as read with `_STATE_FIELDS`."""
    return Known(
        RunStatus(doc["status"]),
        doc["version"],
        doc["scope"],
        doc["scopeId"],
        doc["attempt"],
        doc.get("attemptStartedAt"),
    )


def _merged(update: Doc, more: Doc) -> Doc:
    """Two updates' operators as one update (their fields do not overlap)."""
    return {op: {**update.get(op, {}), **more.get(op, {})} for op in update.keys() | more.keys()}


def _run_key(doc: Doc) -> Doc:
    """A stored run's `_id` and shard key."""
    return {"_id": doc["_id"], **_owner(doc["scope"], doc["scopeId"])}


def _identity(query: Doc) -> Doc:
    """What names one run in an update's filter: its `_id` and, when there, its shard key."""
    return {k: query[k] for k in ("_id", "scope", "scopeId") if k in query}


def _only_with(field: str, keys: list[tuple[str, int]], **options: Any) -> IndexModel:
    """An index of the runs that have `field` only: a write to any other run skips it."""
    return IndexModel(keys, partialFilterExpression={field: {"$exists": True}}, **options)


def _definition(spec: TemplateSpec) -> Doc:
    """What makes two registrations the same version: everything an author wrote but `enabled`."""
    fields = set(TemplateSpec.model_fields) - {"enabled"}
    return spec.model_dump(by_alias=True, mode="json", include=fields)


def _schedule(doc: Doc) -> Schedule:
    doc = dict(doc)
    doc["id"] = str(doc.pop("_id"))
    return Schedule.model_validate(doc)


def _template(doc: Doc) -> Template:
    return Template.model_validate({k: v for k, v in doc.items() if k != "_id"})


def archivable(before: datetime) -> Doc:
    """Terminal runs last written before `before` that hold no dedupe key."""
    return {
        "status": {"$in": sorted(TERMINAL)},
        "dedupeKey": None,
        "updateAt": {"$lt": before},
        "completedAt": {"$exists": True},
    }


def _run(doc: Doc) -> Run:
    doc = dict(doc)
    doc["id"] = str(doc.pop("_id"))
    return Run.model_validate(doc)


def _public_key(doc: Doc) -> ApiKeyPublic:
    doc = dict(doc)
    doc["id"] = str(doc.pop("_id"))
    return ApiKeyPublic.model_validate(doc)


def _key_event(key: ApiKeyPublic, kind: str, actor: str, now: datetime) -> Doc:
    """An event of `key`'s life, in `_KEY_EVENTS_SCOPE`: `jobId` is the key's id, its version
    (1 created, 2 revoked) orders the key's trail, and the metadata say what the key may do."""
    return _event(
        key.id,
        kind,
        actor,
        *_KEY_EVENTS_SCOPE,
        1 if key.revoked_at is None else 2,
        message=f"API key {key.name} ({key.role}) {kind.removeprefix('api_key_')}",
        metadata={"name": key.name, "role": key.role, "scopes": key.scopes},
        now=now,
    )


def _event_model(doc: Doc) -> Event:
    doc = dict(doc)
    doc["id"] = str(doc.pop("_id"))
    return Event.model_validate(doc)


def _event(
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
    event: Doc = {
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
        event["from"] = from_.value
    if to is not None:
        event["to"] = to.value
    if message is not None:
        event["message"] = message
    return event


def _attempt_failed(error: RunError, state: Known, ends_run: bool, now: datetime) -> Doc:
    """What a transition that ends the attempt in progress (`state`'s) with `error` writes too.

    The attempt joins `attempts`, whatever comes next. The run's `error` is its outcome's: set
    only when the run ends with this one, so a run that succeeds on a later attempt has none.
    A run that goes on waits for a new attempt, which its next claim starts.
    """
    error = error.model_copy(update={"attempt": state.attempt})
    attempt = Attempt(
        attempt=state.attempt, error=error, started_at=state.attempt_started_at, ended_at=now
    )
    update: Doc = {"$push": {"attempts": attempt.model_dump(by_alias=True)}}
    if ends_run:
        update["$set"] = {"error": error.model_dump(by_alias=True)}
    else:
        update["$unset"] = {"attemptStartedAt": ""}
    return update


def _unwritten_start(
    index: int, step_id: str, started_at: datetime | None
) -> tuple[Doc, list[tuple[str, str | None, Doc]]]:
    """The fields and event of a step's start, to go along with the write that ends it."""
    if started_at is None:
        return {}, []
    fields = {"phase": step_id, f"progress.steps.{index}.startedAt": started_at}
    return fields, [("step_started", None, {"step": step_id})]


def _step_ended_badly(
    index: int, error: RunError, started_at: datetime | None
) -> tuple[Doc, list[tuple[str, str | None, Doc]]]:
    fields, events = _unwritten_start(index, error.step or "", started_at)
    events.append(("step_finished", error.message, {"step": error.step, "status": "failed"}))
    return fields, events


def _step_succeeded(index: int, step_id: str, output: Any, now: datetime) -> Doc:
    s = f"progress.steps.{index}"
    return {
        f"{s}.status": StepStatus.SUCCEEDED,
        f"{s}.completedAt": now,
        f"{s}.percentage": 100,
        # An earlier attempt's error at this step is in the run's `attempts`.
        f"{s}.error": None,
        f"outputs.{step_id}": output,
    }


def _step_failed(index: int, error: RunError, now: datetime) -> Doc:
    s = f"progress.steps.{index}"
    return {f"{s}.status": StepStatus.FAILED, f"{s}.completedAt": now, f"{s}.error": error.message}
