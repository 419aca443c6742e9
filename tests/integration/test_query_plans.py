"""No query the platform issues scans a collection.

Each test seeds a realistic mix: runs in every status, leases that expired, deadlines and
cancel graces that passed, delayed runs, runs waiting for a dedupe key, schedules due and not,
events of every kind, API keys. It then turns MongoDB's profiler on for its own database
(level 2: every operation is recorded), drives one part of the platform through its real code
and reads `system.profile`. No operation on `job_runs`, `job_events`, `job_schedules`,
`job_templates` or `api_keys` may have a plan with a `COLLSCAN`. MongoDB plans a collection
scan, however small the collection, only when no index can answer the query, so a scan here is
a missing index. `$lookup` stages do not show in the profile's plan summary; each aggregation
with one is replayed with `explain`, which shows how the joined collection was read.

The last test replays the hottest queries with `explain("executionStats")` beside thousands of
terminal runs: what they examine must be bounded by what they return.
"""

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import pytest
from bson import ObjectId

from jobplane import metrics
from jobplane.api.auth import mint_key
from jobplane.errors import ConcurrencyConflict, ResourceInvalidState
from jobplane.model import (
    TERMINAL,
    MapProgress,
    Progress,
    Run,
    RunError,
    RunStatus,
    Schedule,
    ScheduleSpec,
    Template,
)
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunRequest, RunService
from jobplane.scheduler import Scheduler
from jobplane.schedules import ScheduleService
from jobplane.settings import Settings
from jobplane.store import (
    EventQuery,
    Lease,
    MongoStore,
    Moved,
    NewRun,
    RunQuery,
    ScheduleQuery,
)
from jobplane.worker import Worker
from tests.integration.conftest import template_spec
from tests.integration.db import raw
from tests.integration.runs import reap

Doc = dict[str, Any]

PROFILED = ("job_runs", "job_events", "job_schedules", "job_templates", "api_keys")
# Large enough that no entry of a test is overwritten (the default is 1 MB).
PROFILE_BYTES = 256 * 2**20
# Driver and session fields of a recorded command: noise in a message, refused by `explain`.
ENVELOPE = {
    "lsid",
    "$clusterTime",
    "$db",
    "$readPreference",
    "txnNumber",
    "readConcern",
    "writeConcern",
    "maxTimeMS",
    "comment",
}
PER_STATUS = 200
SCOPES = [*(("user", f"u{i}") for i in range(5)), ("account", "acme"), ("system", "ops")]
# A user key's scopes, as `Caller.within` gives them.
WITHIN = [("user", "u1"), ("account", "acme")]
EVENT_TYPES = [
    "step_started",
    "step_finished",
    "progress",
    "cancel_requested",
    "lease_expired",
    "stale_write_rejected",
    "retry_scheduled",
]
ACTORS = ["user:admin", "worker:w-seed", "scheduler", "reaper"]
STEPS = [
    {"id": "first", "handler": "builtin.noop"},
    {"id": "second", "handler": "builtin.noop"},
]
SEEDER = "user:seed"
WORKER = "w-qp"
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)


# -- the profiler --------------------------------------------------------------------------------


class Profiler:
    """Records every operation on the store's database while the block runs."""

    def __init__(self, store: MongoStore) -> None:
        self.store = store
        self.entries: list[Doc] = []

    async def __aenter__(self) -> "Profiler":
        db = self.store.db
        await self.store.trail.flush()  # the seeding's own writes stay out of the record
        await db.command("profile", 0)
        await db.drop_collection("system.profile")
        await db.create_collection("system.profile", capped=True, size=PROFILE_BYTES)
        await db.command("profile", 2)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        db = self.store.db
        try:
            await self.store.trail.flush()
        finally:
            await db.command("profile", 0)
        names = [f"{db.name}.{c}" for c in PROFILED]
        cursor = db["system.profile"].find({"ns": {"$in": names}}).sort("ts", 1)
        self.entries = await cursor.to_list()

    def planned(self) -> list[Doc]:
        """The entries that ran a query plan (inserts do not)."""
        return [e for e in self.entries if "planSummary" in e]

    def touched(self) -> set[str]:
        """Collections queried, joined ones (`$lookup`) included."""
        joined = {
            stage["$lookup"]["from"]
            for e in self.planned()
            for stage in command(e).get("pipeline", [])
            if "$lookup" in stage
        }
        return joined | {e["ns"].split(".", 1)[1] for e in self.planned()}


def command(entry: Doc) -> Doc:
    return {k: v for k, v in entry.get("command", {}).items() if k not in ENVELOPE}


def describe(entry: Doc, note: str = "") -> str:
    text = str(command(entry))
    text = text if len(text) < 900 else text[:900] + "…"
    collection = entry["ns"].split(".", 1)[1]
    return f"{collection} {entry['op']} [{entry.get('planSummary', note)}] {text}"


def _walk(node: Any, skip: frozenset[str] = frozenset()) -> Iterator[Doc]:
    """Every mapping inside an explain document, leaving out the keys in `skip`."""
    if isinstance(node, dict):
        yield node
        for key, value in node.items():
            if key not in skip:
                yield from _walk(value, skip)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value, skip)


# Plans MongoDB tried and dropped are no part of how a query ran.
_NOT_RUN = frozenset({"rejectedPlans", "allPlansExecution"})


async def lookup_scans(store: MongoStore, entries: Sequence[Doc]) -> list[str]:
    """Aggregations whose `$lookup` read the joined collection without an index."""
    found: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        cmd = command(entry)
        pipeline = cmd.get("pipeline") or []
        if not any("$lookup" in stage for stage in pipeline) or repr(pipeline) in seen:
            continue
        seen.add(repr(pipeline))
        plan = await store.db.command(
            "explain",
            {"aggregate": cmd["aggregate"], "pipeline": pipeline, "cursor": {}},
            verbosity="executionStats",
        )
        for node in _walk(plan, _NOT_RUN):
            # The classic engine reports each `$lookup` stage with what it read; the slot
            # engine turns an equality `$lookup` into an EQ_LOOKUP join, which reads the joined
            # collection through an index only with the IndexedLoopJoin strategy.
            # An index that does not lead with the join key can serve a join too, walking most
            # of the collection (`status` under `$nin`, say): more documents read than joined.
            classic = "$lookup" in node and (
                node.get("collectionScans", 0) > 0
                or node.get("totalDocsExamined", 0) > 2 * node.get("nReturned", 0) + 10
            )
            slot = node.get("stage") == "EQ_LOOKUP" and node.get("strategy") != "IndexedLoopJoin"
            if classic or slot:
                found.append(describe(entry, "$lookup scans the joined collection"))
                break
    return found


def wide(entries: Sequence[Doc]) -> list[Doc]:
    """Entries that examined far more documents or keys than they returned or wrote (counts,
    which `$group` what they read, aside)."""
    found = []
    for e in entries:
        if any("$group" in stage for stage in command(e).get("pipeline", [])):
            continue
        got = e.get("nreturned", e.get("nMatched", e.get("ndeleted", 0)))
        if max(e.get("docsExamined", 0), e.get("keysExamined", 0)) > 2 * got + 100:
            found.append(e)
    return found


async def assert_no_scans(profile: Profiler, expected: set[str]) -> None:
    """No recorded plan scans a collection, and each collection in `expected` was queried."""
    assert expected <= profile.touched(), (
        f"the profiler saw no query on {sorted(expected - profile.touched())}"
    )
    offenders = [describe(e) for e in profile.planned() if "COLLSCAN" in e["planSummary"]]
    offenders += await lookup_scans(profile.store, profile.entries)
    for entry in wide(profile.planned()):
        # Shown with -s, not asserted: an index walked further than the answer needs.
        print("examined much more than it returned:", describe(entry)[:300])  # noqa: T201
    assert not offenders, "queries that scan a collection:\n" + "\n".join(dict.fromkeys(offenders))


# -- the seeded database -------------------------------------------------------------------------


@dataclass
class Seeded:
    plain: Template
    keyed: Template
    timed: Template
    runs: dict[RunStatus, list[str]]
    # Queued runs whose `notBefore` is an hour away.
    delayed: list[str]
    # Runs created with an idempotency key, and the key.
    idempotent: list[tuple[Run, str]]
    # Dedupe keys that runs wait for: held by an active run, and free (nobody admitted the next).
    held_keys: list[str]
    free_keys: list[str]
    schedules: list[Schedule]
    api_keys: list[str]
    # Finished runs the schedules fired.
    scheduled: list[Run] = field(default_factory=list)

    def claimable(self) -> list[str]:
        delayed = set(self.delayed)
        return [r for r in self.runs[RunStatus.QUEUED] if r not in delayed]


async def register(store: MongoStore, type_: str, **fields: Any) -> Template:
    template, _ = await store.templates.register(template_spec(type_, steps=STEPS, **fields))
    return template


async def insert(store: MongoStore, news: Sequence[NewRun]) -> list[Run]:
    runs = []
    for outcome in await store.runs.insert_many(news, SEEDER):
        assert isinstance(outcome, Run), outcome
        runs.append(outcome)
    return runs


async def set_fields(
    store: MongoStore, ids: Sequence[str], fields: Doc, unset: Sequence[str] = ()
) -> None:
    """Put runs into a state directly, as tests/integration/runs.py does: seeding only."""
    if not ids:
        return
    update: Doc = {"$set": fields} if fields else {}
    if unset:
        update["$unset"] = dict.fromkeys(unset, "")
    await raw(store).runs.update_many({"_id": {"$in": [ObjectId(i) for i in ids]}}, update)


def lease_fields(now: datetime, expired: bool, token: str = "seed-token") -> Doc:
    return {
        "lockedBy": "w-seed",
        "leaseToken": token,
        "lockedUntil": now + (-MINUTE if expired else 10 * MINUTE),
        "heartbeatAt": now - (2 * MINUTE if expired else 5 * SECOND),
        "startedAt": now - 5 * MINUTE,
        "phase": "first",
        "progress.steps.0.status": "running",
        "progress.steps.0.startedAt": now - 5 * MINUTE,
    }


async def seed_statuses(
    store: MongoStore, template: Template, now: datetime
) -> dict[RunStatus, list[str]]:
    """PER_STATUS runs of `template` in every status, spread over the scopes."""
    news = [
        NewRun(template, *SCOPES[i % len(SCOPES)], payload={"i": i})
        for _ in RunStatus
        for i in range(PER_STATUS)
    ]
    made = [r.id for r in await insert(store, news)]
    runs = {s: made[k * PER_STATUS : (k + 1) * PER_STATUS] for k, s in enumerate(RunStatus)}
    half, third = PER_STATUS // 2, PER_STATUS // 3
    S = RunStatus

    pending = runs[S.PENDING]
    await set_fields(store, pending[:half], {"updateAt": now - HOUR})
    queued = runs[S.QUEUED]
    await set_fields(store, queued, {"status": S.QUEUED.value})
    await set_fields(store, queued[:half], {"updateAt": now - HOUR})
    await set_fields(store, queued[half:], {"notBefore": now + HOUR})
    for status in (S.RUNNING, S.WAITING_WORKER, S.CANCEL_REQUESTED):
        ids = runs[status]
        await set_fields(store, ids, {"status": status.value, "attempt": 1, "maxAttempts": 3})
        await set_fields(store, ids[:half], lease_fields(now, expired=True))
        await set_fields(store, ids[half:], lease_fields(now, expired=False))
        # A lost lease on a run out of attempts expires it rather than queueing it again.
        await set_fields(store, ids[:third], {"attempt": 3})
        await set_fields(store, ids[::3], {"deadline": now - MINUTE})
        await set_fields(store, ids[1::3], {"deadline": now + HOUR})
    waiting = runs[S.WAITING_WORKER]
    await set_fields(store, waiting, {"externalType": "external"})
    # `wait_worker` lets go of the lease; a later external claim takes one.
    await set_fields(store, waiting[half:], {}, unset=["lockedBy", "leaseToken", "lockedUntil"])
    asked = runs[S.CANCEL_REQUESTED]
    await set_fields(store, asked, {"cancelRequestedAt": now - 2 * MINUTE, "cancelReason": "seed"})
    await set_fields(store, asked[::2], {"cancelDeadline": now - MINUTE})
    await set_fields(store, asked[1::2], {"cancelDeadline": now + HOUR})
    for status in TERMINAL:
        ids = runs[status]
        fields: Doc = {"status": status.value, "progress.percentage": 100, "attempt": 1}
        if status in (S.FAILED, S.EXPIRED):
            error = RunError(code=f"{status.value}_seed", message="seeded", step="first")
            fields["error"] = error.model_dump(by_alias=True)
        await set_fields(store, ids, fields)
        # Ended over the last 40 days: some are past the 30-day retention.
        for k, run_id in enumerate(ids):
            ended = now - k * 40 * DAY / PER_STATUS
            await raw(store).runs.update_one(
                {"_id": ObjectId(run_id)}, {"$set": {"completedAt": ended, "updateAt": ended}}
            )
    return runs


async def seed_events(store: MongoStore, run_ids: Sequence[str], now: datetime, n: int) -> None:
    """Events of every kind and actor beside the runs' own, over the last 30 days."""
    docs = []
    for i in range(n):
        scope, scope_id = SCOPES[i % len(SCOPES)]
        docs.append(
            {
                "_id": ObjectId(),
                "jobId": run_ids[i % len(run_ids)],
                "type": EVENT_TYPES[i % len(EVENT_TYPES)],
                "actor": ACTORS[i % len(ACTORS)],
                "scope": scope,
                "scopeId": scope_id,
                "metadata": {"seed": i},
                "runVersion": 2,
                "createAt": now - i * 30 * DAY / n,
            }
        )
    await raw(store).events.insert_many(docs)


async def seed(store: MongoStore, queue: RedisQueue) -> Seeded:
    now = store.clock.now()
    plain = await register(
        store,
        "qp_plain",
        timeoutSeconds=3600,
        retryPolicy={"maxAttempts": 3},
        cancelPolicy={"graceSeconds": 30},
    )
    keyed = await register(
        store, "qp_keyed", concurrencyPolicy="queue_same_scope", dedupeKeys=["payload.target"]
    )
    timed = await register(store, "qp_timed", schedulable=True, queue="timed")
    await register(store, "qp_unique", concurrencyPolicy="reject_same_scope")
    runs = await seed_statuses(store, plain, now)
    service = RunService(store, queue)

    # Schedules, due and not, some paused; finished runs of theirs.
    schedules = ScheduleService(store, queue)
    made = []
    for i in range(40):
        scope, scope_id = SCOPES[i % len(SCOPES)]
        spec = ScheduleSpec(
            template_type=timed.type,
            scope=scope,
            scope_id=scope_id,
            cron="*/5 * * * *",
            enabled=i % 4 != 3,
        )
        schedule = await schedules.create(spec, SEEDER)
        due = now - MINUTE if i % 2 else now + HOUR
        await raw(store).schedules.update_one(
            {"_id": ObjectId(schedule.id)}, {"$set": {"nextRunAt": due}}
        )
        made.append(schedule.model_copy(update={"next_run_at": due}))
    fires = [
        NewRun(timed, s.scope, s.scope_id, schedule_id=s.id, scheduled_for=now - k * HOUR)
        for s in made
        for k in range(1, 4)
    ]
    scheduled = await insert(store, fires)
    await set_fields(store, [r.id for r in scheduled], {"status": "succeeded"})

    # Idempotent creates.
    idempotent = []
    for i in range(20):
        key = f"idem-{i}"
        run, _ = await service.create(
            RunRequest(plain.type, "user", "u1", idempotency_key=key), SEEDER
        )
        idempotent.append((run, key))

    # Holders of dedupe keys and runs waiting for them; the holders of the last ten ended
    # without admitting the next (a process died), so their keys are free.
    targets = [f"target-{i}" for i in range(20)]
    holders = [
        (await service.create(RunRequest(keyed.type, "user", "u1", {"target": t}), SEEDER))[0]
        for t in targets
    ]
    for t in targets:
        for _ in range(3):
            await service.create(RunRequest(keyed.type, "user", "u1", {"target": t}), SEEDER)
    gone = [h.id for h in holders[10:]]
    await set_fields(store, gone, {"status": "succeeded", "completedAt": now}, unset=["dedupeKey"])
    await set_fields(
        store, [h.id for h in holders[:10]], {"status": "running", **lease_fields(now, False)}
    )

    events_for = [*itertools.chain.from_iterable(runs.values())]
    await seed_events(store, events_for, now, 2000)

    api_keys = []
    for i in range(5):
        _, record = mint_key(f"qp-key-{i}", "user", ["user:u1"], SEEDER, now)
        assert await store.keys.insert(record)
        api_keys.append(record.id)
    await store.trail.flush()
    return Seeded(
        plain=plain,
        keyed=keyed,
        timed=timed,
        runs=runs,
        delayed=runs[RunStatus.QUEUED][PER_STATUS // 2 :],
        idempotent=idempotent,
        held_keys=[h.dedupe_key or "" for h in holders[:10]],
        free_keys=[h.dedupe_key or "" for h in holders[10:]],
        schedules=made,
        api_keys=api_keys,
        scheduled=scheduled,
    )


@pytest.fixture
async def seeded(store: MongoStore, queue: RedisQueue) -> Seeded:
    return await seed(store, queue)


# -- the platform's operations, by part ------------------------------------------------------------


async def test_claims_and_worker_writes_never_scan(
    store: MongoStore, queue: RedisQueue, settings: Settings, seeded: Seeded
) -> None:
    pending = seeded.runs[RunStatus.PENDING]
    cancelled = seeded.runs[RunStatus.CANCELLED]
    async with Profiler(store) as profile:
        # Claimable runs among ones that are not: delayed, finished, claimed already.
        asked = [*seeded.claimable()[:40], *pending[:20], *seeded.delayed[:5], *cancelled[:5]]
        claimed = await store.transitions.claim(asked, WORKER, 30)
        assert len(claimed) == 60
        leases = [lease for _, lease in claimed]
        held, _ = await store.leases.heartbeat(WORKER, leases, 30)
        assert len(held) == 60
        for lease in leases[:10]:  # step by step, to success
            assert await store.leases.start_step(lease, 0, "first") is None
            assert await store.leases.report_progress(lease, 0, 50, 25, "half way") is None
            assert (
                await store.leases.finish_step(
                    lease, 0, "first", {"ok": True}, 50, next_handler=None
                )
                is None
            )
            await store.transitions.complete(
                lease, 1, "second", None, None, started_at=store.clock.now()
            )
        error = RunError(code="boom", message="boom", step="first", attempt=1)
        for lease in leases[10:15]:
            await store.transitions.fail(lease, 0, error, started_at=store.clock.now())
        for lease in leases[15:20]:
            await store.transitions.retry(lease, 0, error, store.clock.now() + MINUTE)
        for lease in leases[20:25]:
            await store.transitions.release(lease)
        for lease in leases[25:30]:
            await store.transitions.request_cancel(lease.run_id, "user:qp", "stop", 30)
            await store.transitions.acknowledge_cancel(lease, interrupted=True)
        for lease in leases[30:35]:  # an external step: let go, claimed by an external worker
            await store.transitions.wait_worker(lease, 0, "first", "external")
        for _ in range(10):  # these five, and some of the seeded ones
            taken = await store.transitions.resume("external", "ext-qp", 30)
            assert taken is not None
            await store.transitions.complete(taken[1], 0, "first", None, None)
        # A heartbeat moves the version under the writers' feet: their next writes read again.
        await store.leases.heartbeat(WORKER, leases[35:45], 30)
        for lease in leases[35:45]:
            await store.transitions.complete(lease, 1, "second", None, None)
        # A zombie's writes are refused and recorded.
        for lease in leases[45:50]:
            zombie = replace(lease, token="superseded", known=None)
            await store.leases.report_progress(zombie, 0, 10, 5, None)
            await store.leases.lease_lost(zombie, "heartbeat")
        for lease in leases[50:55]:  # not past its deadline: the write finds nothing to do
            run = await store.runs.get(lease.run_id)
            assert run is not None
            await store.transitions.deadline_expire(run, lease.actor)

        # The worker itself, on runs it claims: template read, writes, Redis, admitting keys.
        worker = Worker(store, queue, settings, worker_id="w-real")
        await worker.claim([*seeded.claimable()[40:80], *pending[20:40]])
        assert worker.held
        async with asyncio.timeout(30):
            while worker.held:  # noqa: ASYNC110  (the worker's run tasks end by themselves)
                await asyncio.sleep(0.02)
    await assert_no_scans(profile, {"job_runs", "job_templates"})


async def test_the_reaper_reconciler_sweep_and_retention_never_scan(
    store: MongoStore, queue: RedisQueue, settings: Settings, seeded: Seeded
) -> None:
    now = store.clock.now()
    async with Profiler(store) as profile:
        expired = await store.maintenance.expired_leases(500)
        late, slow = await store.maintenance.overdue(500)
        assert expired and late and slow
        for run in late[:10]:
            await store.transitions.deadline_expire(run, "reaper")
        for run in slow[:10]:
            await store.transitions.cancel_timeout(run, "reaper")
        for run in expired[:30]:
            await reap(store, run)
        page = await store.maintenance.to_reconcile(None, 100, now - MINUTE)
        assert page
        await store.maintenance.to_reconcile(page[-1].id, 100, now - MINUTE)
        assert set(await store.maintenance.waited_keys(500)) == set(seeded.free_keys)
        for key in [*seeded.free_keys[:3], *seeded.held_keys[:3]]:
            waiting = await store.runs.next_waiting(key)
            assert waiting is not None
            if key in seeded.free_keys:
                await store.runs.take_key(waiting, "scheduler")
                await store.transitions.enqueue(waiting.id, "scheduler")
        await store.transitions.enqueue(seeded.runs[RunStatus.PENDING][0], "scheduler")
        await store.trail.sweep(now - timedelta(seconds=10))
        await store.trail.sweep(now)
        assert await store.maintenance.archive(now - 30 * DAY, 50) > 0
        # The same, as the scheduler's tick does them (with the fires of due schedules).
        scheduler = Scheduler(store, queue, settings)
        await scheduler.tick()
        await scheduler.tick()
    await assert_no_scans(profile, {"job_runs", "job_events", "job_schedules", "job_templates"})


async def test_creating_reading_and_cancelling_runs_never_scan(
    store: MongoStore, queue: RedisQueue, seeded: Seeded
) -> None:
    service = RunService(store, queue)
    runs = seeded.runs
    now = store.clock.now()
    async with Profiler(store) as profile:
        await service.create(RunRequest(seeded.plain.type, "user", "u1"), "user:qp")
        await service.create(
            RunRequest(seeded.plain.type, "user", "u2", delay_seconds=60), "user:qp"
        )
        for run, key in seeded.idempotent[:5]:  # repeats answer with the first run
            again, new = await service.create(
                RunRequest(seeded.plain.type, "user", "u1", idempotency_key=key), "user:qp"
            )
            assert (again.id, new) == (run.id, False)
        batch = [RunRequest(seeded.plain.type, *SCOPES[i % len(SCOPES)]) for i in range(20)]
        batch.append(RunRequest(seeded.plain.type, "user", "u1", idempotency_key="idem-0"))
        await service.create_many(batch, "user:qp")
        # A key that is held: wait for it (queue_same_scope) or be refused (reject_same_scope).
        target = {"target": "target-0"}
        waiting, _ = await service.create(
            RunRequest(seeded.keyed.type, "user", "u1", target), "user:qp"
        )
        assert waiting.dedupe_wait is not None
        await service.create(RunRequest("qp_unique", "user", "u3"), "user:qp")
        with pytest.raises(ConcurrencyConflict):
            await service.create(RunRequest("qp_unique", "user", "u3"), "user:qp")
        # A schedule's fire time that exists already.
        fired = seeded.scheduled[0]
        repeat = RunRequest(
            seeded.timed.type,
            fired.scope,
            fired.scope_id,
            schedule_id=fired.schedule_id,
            scheduled_for=fired.scheduled_for,
        )
        again, new = await service.create(repeat, "scheduler")
        assert (again.id, new) == (fired.id, False)
        await service.rerun(runs[RunStatus.SUCCEEDED][0], "user:qp")
        # Cancels: at once, requested of a worker, refused for a finished run.
        for run_id in [*runs[RunStatus.PENDING][:5], *seeded.claimable()[:5]]:
            assert (await service.cancel(run_id, "user:qp", "no")).status == RunStatus.CANCELLED
        for run_id in runs[RunStatus.RUNNING][-5:]:
            asked = await service.cancel(run_id, "user:qp", "stop")
            assert asked.status == RunStatus.CANCEL_REQUESTED
        with pytest.raises(ResourceInvalidState):
            await service.cancel(runs[RunStatus.FAILED][0], "user:qp", None)
        await store.transitions.request_cancel(
            runs[RunStatus.WAITING_WORKER][-1], "user:qp", "stop"
        )
        await service.lifecycle.admit_next(seeded.free_keys[0], "user:qp")
        # Reads, of live runs and of archived ones.
        assert await store.maintenance.archive(now - 30 * DAY, 10) == 10
        archived = await raw(store).archive.find_one({})
        assert archived is not None
        for run_id in [
            str(archived["_id"]),
            runs[RunStatus.RUNNING][0],
            runs[RunStatus.SUCCEEDED][0],
        ]:
            assert await store.runs.get(run_id) is not None
            assert await store.trail.events_of(run_id)
        assert await store.runs.get(str(ObjectId())) is None
    await assert_no_scans(profile, {"job_runs", "job_events", "job_templates"})


async def test_a_map_steps_children_never_scan(
    store: MongoStore, queue: RedisQueue, settings: Settings, seeded: Seeded
) -> None:
    """Made, counted, admitted to places, read back, listed, cancelled with their parent, and
    mended by the tick: each read and write of a map step's children uses an index."""
    service = RunService(store, queue)
    parent, _ = await service.create(RunRequest(seeded.plain.type, "account", "acme"), "user:qp")
    payloads = [{"n": n} for n in range(60)]
    async with Profiler(store) as profile:
        refused = await service.create_children(
            parent, "first", seeded.plain, payloads, 5, "worker:qp"
        )
        assert refused == []
        kids = await store.runs.page(RunQuery(parent_run_id=parent.id), None, 100)
        assert len(kids) == 60
        first = next(k for k in kids if k.map_place is not None)
        await store.transitions.cancel(first.id, "user:qp", "done", (first.scope, first.scope_id))
        assert await store.children.admit_next(first, "user:qp") is not None
        assert await store.children.any_left(first)
        await store.children.counts(parent.model_copy(update={"progress": _made(parent, 60)}))
        assert len(await store.children.ends(parent, "first")) == 1
        await store.children.waiting_parents(100)
        assert await store.children.waiting_children(100)
        await store.children.orphaned(100, store.clock.now())
        await service.lifecycle.cancel_children(parent, "user:qp", "enough")
        assert await store.children.active(parent) == []
        scheduler = Scheduler(store, queue, settings)
        await scheduler.mend_families()
    await assert_no_scans(profile, {"job_runs"})


def _made(run: Run, total: int) -> Progress:
    """`run`'s progress as its first step made `total` children."""
    steps = [s.model_copy(update={"map": MapProgress(total=total)}) for s in run.progress.steps]
    return run.progress.model_copy(update={"steps": steps})


def filter_sets(filters: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every combination of the filters, the empty one included."""
    for n in range(len(filters) + 1):
        for names in itertools.combinations(filters, n):
            combined: dict[str, Any] = {}
            for name in names:
                value = filters[name]
                combined |= value if isinstance(value, dict) else {name: value}
            yield combined


async def test_run_lists_never_scan(store: MongoStore, seeded: Seeded) -> None:
    schedule = seeded.scheduled[0]
    filters = {
        "status": RunStatus.SUCCEEDED,
        "template_type": seeded.timed.type,
        "scope": {"scope": schedule.scope, "scope_id": schedule.scope_id},
        "schedule_id": schedule.schedule_id,
    }
    queries = [RunQuery(**f) for f in filter_sets(filters)]
    queries += [RunQuery(status=s) for s in RunStatus]
    queries += [RunQuery(status=s, template_type=seeded.plain.type) for s in RunStatus]
    async with Profiler(store) as profile:
        for query, within in itertools.product(queries, (None, WITHIN)):
            # The first page and, when there is one, the next from the cursor it ends at.
            page = await store.runs.page(query, within, 21)
            if page:
                await store.runs.page(replace(query, before=page[-1].id), within, 21)
    await assert_no_scans(profile, {"job_runs"})


async def test_a_rare_status_of_one_template_is_listed_without_walking_the_others(
    store: MongoStore,
) -> None:
    """Dead letters of a template whose runs all succeeded, next to many failed runs of
    another: found through the partial index of ended runs, walking neither the template's
    runs nor the other failed ones."""
    failing, fine = await register(store, "qp_failing"), await register(store, "qp_fine")
    now = store.clock.now()
    for template, status in ((failing, "failed"), (fine, "succeeded")):
        runs = await store.runs.insert_many([NewRun(template, "user", "u1")] * 300, "user:qp")
        ids = [r.id for r in runs if isinstance(r, Run)]
        await set_fields(store, ids, {"status": status, "completedAt": now})
    async with Profiler(store) as profile:
        assert await store.runs.page(RunQuery(RunStatus.FAILED, fine.type), None, 21) == []
    [entry] = [e for e in profile.planned() if e["ns"].endswith(".job_runs")]
    assert entry["planSummary"] == "IXSCAN { templateType: 1, status: 1, _id: -1 }", describe(entry)
    assert entry["docsExamined"] == 0, describe(entry)


async def test_event_queries_never_scan(store: MongoStore, seeded: Seeded) -> None:
    now = store.clock.now()
    job = seeded.runs[RunStatus.RUNNING][0]
    filters = {
        "job_id": job,
        "type": "status_changed",
        "scope": {"scope": "user", "scope_id": "u1"},
        "actor": "reaper",
        "since": now - 10 * DAY,
        "until": now - DAY,
    }
    async with Profiler(store) as profile:
        for fields, within in itertools.product(filter_sets(filters), (None, WITHIN)):
            query = EventQuery(**fields)
            found = await store.trail.page(query, within, 21)
            if found:
                after = (found[-1].create_at, found[-1].id)
                await store.trail.page(replace(query, after=after), within, 21)
        for run_id in seeded.runs[RunStatus.SUCCEEDED][:5]:
            assert await store.trail.events_of(run_id)
    await assert_no_scans(profile, {"job_events", "job_runs"})


async def test_schedules_never_scan(store: MongoStore, queue: RedisQueue, seeded: Seeded) -> None:
    now = store.clock.now()
    service = ScheduleService(store, queue)
    first = seeded.schedules[0]
    filters = {
        "template_type": seeded.timed.type,
        "scope": {"scope": first.scope, "scope_id": first.scope_id},
        "enabled": True,
    }
    async with Profiler(store) as profile:
        assert await store.schedules.due(now, 100)
        assert await store.schedules.next_fire_time() is not None
        for fields, within in itertools.product(filter_sets(filters), (None, WITHIN)):
            query = ScheduleQuery(**fields)
            found = await store.schedules.page(query, within, 7)
            if found:
                await store.schedules.page(replace(query, before=found[-1].id), within, 7)
        assert await service.fire_due(now, 100, 60) > 0
        assert await store.schedules.next_fire_time() is not None
        for schedule in seeded.schedules[:4]:
            await service.get(schedule.id)
            await store.runs.active_of(schedule)
            await service.update(schedule.id, {"cron": "*/10 * * * *"})
            await service.trigger(schedule.id, "user:qp")
        await service.update(first.id, {"enabled": False})
        await service.update(first.id, {"enabled": True})
        await service.delete(seeded.schedules[-1].id)
    await assert_no_scans(profile, {"job_schedules", "job_runs", "job_templates"})


async def test_templates_and_api_keys_never_scan(store: MongoStore, seeded: Seeded) -> None:
    async with Profiler(store) as profile:
        for type_ in (seeded.plain.type, seeded.timed.type, "qp_missing"):
            await store.templates.get(type_)
            await store.templates.get(type_, 1)
            await store.templates.cached(type_)
        changed = template_spec(seeded.plain.type, steps=STEPS, description="v2")
        assert (await store.templates.register(changed))[1]
        assert not (await store.templates.register(changed))[1]
        await store.templates.set_enabled(seeded.timed.type, False)
        await store.templates.set_enabled(seeded.timed.type, True)
        for key_id in [*seeded.api_keys, str(ObjectId())]:
            await store.keys.get(key_id)
        _, record = mint_key("qp-key-0", "user", [], "user:qp", store.clock.now())
        assert not await store.keys.insert(record)  # the name is taken
        listed = await store.keys.page(None, 3)
        assert len(await store.keys.page(listed[-1].id, 3)) == 2
        for key_id in [seeded.api_keys[0], seeded.api_keys[0], str(ObjectId()), "nope"]:
            await store.keys.revoke(key_id, "user:qp")
    await assert_no_scans(profile, {"job_templates", "api_keys"})


async def test_listing_templates_and_their_queues_never_scans(
    store: MongoStore, queue: RedisQueue, seeded: Seeded
) -> None:
    async with Profiler(store) as profile:
        assert len(await store.templates.latest()) == 4
        assert await store.templates.queues() == ["default", "timed"]
        await metrics.read_state(store, queue, ["default"])
    # The scrape's figures of runs too: started runs by queue, runs held back by a limit.
    await assert_no_scans(profile, {"job_templates", "job_runs"})


async def test_the_overview_never_scans(store: MongoStore, seeded: Seeded) -> None:
    now = store.clock.now()
    async with Profiler(store) as profile:
        for within in (None, WITHIN):
            figures = await store.overview.run_figures(within, now)
        assert figures.held
    await assert_no_scans(profile, {"job_runs"})


# -- what the hottest queries examine --------------------------------------------------------------

TERMINAL_RUNS = 4000


async def explained(store: MongoStore, entry: Doc) -> tuple[str, int, int] | None:
    """How a profiled query ran: (how it was measured, documents examined, keys examined).

    A read is replayed with `explain("executionStats")`. A write is taken from its profile
    entry, which records what the write itself examined: replayed afterwards, its filter would
    meet the runs it already moved.
    """
    cmd = command(entry)
    collection = entry["ns"].split(".", 1)[1]
    if entry["op"] in ("update", "remove"):
        return "profiled write", entry["docsExamined"], entry["keysExamined"]
    if entry["op"] == "query":
        keep = ("filter", "sort", "projection", "limit", "hint")
        query = {"find": collection, **{k: cmd[k] for k in keep if k in cmd}}
    elif "aggregate" in cmd:
        query = {"aggregate": collection, "pipeline": cmd["pipeline"], "cursor": {}}
    else:
        return None
    plan: Doc = await store.db.command("explain", query, verbosity="executionStats")
    return "explain", *examined(plan)


def examined(plan: Doc) -> tuple[int, int]:
    """Documents and index keys a plan examined, over all its stages."""
    docs = keys = 0
    for node in _walk(plan, _NOT_RUN):
        stats = node.get("executionStats")
        if isinstance(stats, dict) and "totalDocsExamined" in stats:
            docs += stats["totalDocsExamined"]
            keys += stats["totalKeysExamined"]
    return docs, keys


async def test_the_hottest_queries_examine_only_what_they_return(store: MongoStore) -> None:
    now = store.clock.now()
    plain = await register(store, "qp_plain", timeoutSeconds=3600)
    # Thousands of finished runs beside the few each query is after.
    news = [NewRun(plain, *SCOPES[i % len(SCOPES)]) for i in range(TERMINAL_RUNS)]
    finished = await insert(store, news)
    for k, status in enumerate(sorted(TERMINAL)):
        ended = {"status": status.value, "completedAt": now - HOUR, "updateAt": now - HOUR}
        await set_fields(store, [r.id for r in finished[k :: len(TERMINAL)]], ended)
    queued, fresh, lost, late, slow, patient, held = [
        [r.id for r in await insert(store, [NewRun(plain, "user", "u1") for _ in range(n)])]
        for n in (40, 20, 30, 20, 20, 20, 30)
    ]
    await set_fields(store, queued, {"status": "queued", "updateAt": now - HOUR})
    # Just queued: the reconciler leaves these to their creator.
    await set_fields(store, fresh, {"status": "queued"})
    running = {"status": "running", "attempt": 1, "deadline": now + HOUR}
    await set_fields(store, lost, {**running, **lease_fields(now, expired=True)})
    await set_fields(store, late, {**running, **lease_fields(now, False), "deadline": now - MINUTE})
    await set_fields(
        store,
        slow,
        {
            **running,
            **lease_fields(now, False),
            "status": "cancel_requested",
            "cancelDeadline": now - MINUTE,
        },
    )
    await set_fields(
        store,
        patient,
        {
            **running,
            **lease_fields(now, False),
            "status": "cancel_requested",
            "cancelDeadline": now + MINUTE,
        },
    )
    leases = [Lease(run_id, "w-hot", f"hot-{i}") for i, run_id in enumerate(held)]
    for lease in leases:
        fields = {**running, **lease_fields(now, False, lease.token), "lockedBy": "w-hot"}
        await set_fields(store, [lease.run_id], fields)

    async def overdue() -> list[Run]:
        late, slow = await store.maintenance.overdue(500)
        return [*late, *slow]

    async def heartbeat() -> list[str]:
        return sorted((await store.leases.heartbeat("w-hot", leases, 30))[0])

    claimed: list[Lease] = []

    async def claim() -> list[tuple[Run, Lease]]:
        taken = await store.transitions.claim([*queued, *fresh], WORKER, 30)
        claimed.extend(lease for _, lease in taken)
        return taken

    async def complete() -> list[object]:  # the claimed runs' ends, group-committed
        ends = [store.transitions.complete(lease, 1, "second", None, None) for lease in claimed]
        moved = list(await asyncio.gather(*ends))
        assert all(isinstance(m, Moved) for m in moved), moved
        return moved

    # In this order: the claim takes the runs `claimable` finds.
    calls: dict[str, Callable[[], Awaitable[Sequence[Any]]]] = {
        "claimable": lambda: store.maintenance.to_reconcile(None, 500, now - MINUTE),
        "claim": claim,
        "complete": complete,
        "expired_leases": lambda: store.maintenance.expired_leases(500),
        "overdue": overdue,
        "heartbeat": heartbeat,
        "list_runs": lambda: store.runs.page(RunQuery(), None, 51),
        "list_runs by status": lambda: store.runs.page(
            RunQuery(status=RunStatus.SUCCEEDED), None, 51
        ),
        "list_events": lambda: store.trail.page(EventQuery(), None, 101),
        "events_of": lambda: store.trail.events_of(finished[0].id),
    }
    report: list[str] = []
    for name, call in calls.items():
        async with Profiler(store) as profile:
            returned = len(await call())
        assert returned, f"{name} found nothing to measure"
        for entry in profile.planned():
            measured = await explained(store, entry)
            if measured is None:
                continue
            how, docs, keys = measured
            plan = entry["planSummary"][:60]
            report.append(
                f"{name}: returned {returned}; {entry['op']} [{plan}] examined {docs} "
                f"documents, {keys} keys ({how})"
            )
            # Twice at most: a plan over `$or` branches (the heartbeat's, one per lease token)
            # fetches a run in its branch and again above them; and a few keys more, one per
            # status bound of an `$in` and at the end of each range.
            assert docs <= 2 * returned and keys <= 2 * returned + 10, "\n".join(report)
    print("\n".join(report))  # noqa: T201  (shown with -s: what each query costs)
