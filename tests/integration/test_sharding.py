"""jobplane on a sharded cluster, proven as far as a replica set can prove it.

mongos does not run here, so these tests check what a sharded cluster would refuse or scatter:
every unique index of a sharded collection starts with its shard key (else MongoDB could not
enforce it across shards), and every write the platform sends to one run names the run's shard
key (a `findAndModify` must; an `update` or `delete` of one document by `_id` alone is allowed but
goes to every shard). Earlier deployments' unique indexes are replaced with no guarantee lost.
"""

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import ObjectId
from pymongo import AsyncMongoClient
from pymongo.monitoring import CommandFailedEvent, CommandListener, CommandStartedEvent
from pymongo.monitoring import CommandSucceededEvent as Succeeded

from jobplane.api.auth import mint_key
from jobplane.clock import ManualClock
from jobplane.model import LockWait, RunError, RunStatus, StepOutcome, StepStatus
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunRequest, RunService
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.store import DuplicateRun, KeyHeld, Lease, Lost, MongoStore, NewRun
from jobplane.store.indexes import SHARD_KEYS, index_models
from tests.integration.conftest import Register, template_spec
from tests.integration.db import raw

Doc = dict[str, Any]

STEPS = [{"id": "first", "handler": "builtin.noop"}, {"id": "second", "handler": "builtin.noop"}]
LEASE = 30.0


def shard_fields(collection: str) -> list[str]:
    return [name for name, _ in SHARD_KEYS[collection]]


def test_every_unique_index_of_a_sharded_collection_starts_with_its_shard_key() -> None:
    models = index_models()
    assert set(SHARD_KEYS) == {"job_runs", "job_events", "job_runs_archive"}
    unique = 0
    for collection in SHARD_KEYS:
        for model in models.get(collection, []):
            doc = model.document
            if doc.get("unique"):
                unique += 1
                fields = list(doc["key"])
                prefix = shard_fields(collection)
                assert fields[: len(prefix)] == prefix, f"{collection} {doc['name']}"
    assert unique == 4  # dedupe, idempotency, one run per fire time, a map step's places


async def test_the_indexes_made_follow_the_shard_keys(store: MongoStore) -> None:
    """What `ensure_indexes` leaves in a database, not only what it asks for."""
    for collection in SHARD_KEYS:
        indexes = await store.db[collection].index_information()
        for name, index in indexes.items():
            if index.get("unique") and name != "_id_":
                fields = [field for field, _ in index["key"]]
                prefix = shard_fields(collection)
                assert fields[: len(prefix)] == prefix, f"{collection} {name}"


# -- the commands the store sends ----------------------------------------------------------------


class Commands(CommandListener):
    """Every command a client starts."""

    def __init__(self) -> None:
        self.sent: list[CommandStartedEvent] = []

    def started(self, event: CommandStartedEvent) -> None:
        self.sent.append(event)

    def succeeded(self, event: Succeeded) -> None:
        pass

    def failed(self, event: CommandFailedEvent) -> None:
        pass


def targeted(query: Doc, fields: list[str]) -> bool:
    """The query names one value of each shard key field, itself or in each of its `$or`s."""
    if all(isinstance(query.get(f), str) for f in fields):
        return True
    branches = query.get("$or")
    return bool(branches) and all(targeted(b, fields) for b in branches)


def is_claim(update: Any) -> bool:
    """The claim's pipeline update: the one write a worker makes with run ids alone."""
    return isinstance(update, list) and "leaseToken" in update[0]["$set"]


def writes(commands: Commands) -> set[str]:
    """Check every write `commands` sent to a sharded collection names its shard key, but for
    the claim, whose run ids come from Redis alone and which is a multi-document update,
    allowed by `_id` alone (listed in docs/operations.md as scatter-gather); returns the kinds
    of writes seen (`update job_runs targeted`, `update job_runs claim`, `delete job_runs`, …)."""
    seen: set[str] = set()
    for event in commands.sent:
        name = event.command_name
        command = event.command
        collection = command.get(name)
        if collection not in SHARD_KEYS:
            continue
        fields = shard_fields(collection)
        if name == "insert":
            for doc in command["documents"]:
                assert all(isinstance(doc.get(f), str) for f in fields), doc
        elif name == "findAndModify":
            assert targeted(command["query"], fields), command["query"]
        elif name == "update":
            for statement in command["updates"]:
                query, multi = statement["q"], statement.get("multi", False)
                if targeted(query, fields):
                    kind = "targeted"
                else:
                    # What MongoDB 6.0 allows without the shard key, all of it the claim's.
                    assert not statement.get("upsert"), statement
                    assert multi or isinstance(query.get("_id"), ObjectId), statement
                    assert is_claim(statement["u"]), statement
                    kind = "claim"
                seen.add(f"update {collection} {kind}")
        elif name == "delete":
            for statement in command["deletes"]:
                assert targeted(statement["q"], fields), statement
                seen.add(f"delete {collection}")
    return seen


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 7, tzinfo=UTC))


@pytest.fixture
async def watched(
    mongo_url: str, db_name: str, clock: ManualClock
) -> AsyncIterator[tuple[MongoStore, Commands]]:
    """A store on a client of its own, whose commands are recorded."""
    commands = Commands()
    client: AsyncMongoClient[Doc] = AsyncMongoClient(
        mongo_url, tz_aware=True, event_listeners=[commands]
    )
    store = MongoStore(client, db_name, clock=clock)
    await store.ensure_indexes()
    try:
        yield store, commands
    finally:
        await store.close()


async def test_every_write_to_a_run_names_its_shard_key(
    watched: tuple[MongoStore, Commands],
    queue: RedisQueue,
    settings: Settings,
    clock: ManualClock,
) -> None:
    """A run's life as the services live it (create, claim one and many, heartbeat, steps,
    progress, complete, fail, retry, release, cancel either way, a dedupe key handed on, the
    reaper, a stale write, a lent step's every move, retention): each write to a sharded
    collection names the shard key, except the claim, whose run ids come from Redis alone and
    which is a multi-document update, allowed by `_id` alone (listed in docs/operations.md as
    scatter-gather)."""
    store, commands = watched
    plain, _ = await store.templates.register(
        template_spec("t_plain", steps=STEPS, retryPolicy={"maxAttempts": 2})
    )
    timed, _ = await store.templates.register(template_spec("t_timed", timeoutSeconds=20))
    keyed, _ = await store.templates.register(
        template_spec("t_keyed", concurrencyPolicy="queue_same_scope")
    )
    service = RunService(store, queue)

    async def create(template: str = plain.type, scope_id: str = "u1") -> str:
        run, _ = await service.create(RunRequest(template, "user", scope_id), "user:a")
        return run.id

    async def claim(*run_ids: str) -> list[Lease]:
        claimed = {
            run.id: lease
            for run, lease in await store.transitions.claim(list(run_ids), "w1", LEASE)
        }
        assert claimed.keys() == set(run_ids)
        return [claimed[run_id] for run_id in run_ids]

    commands.sent.clear()
    done, failed, retried, released = [await create(scope_id=f"u{i}") for i in range(4)]
    [lease] = await claim(done)
    await store.leases.heartbeat("w1", [lease], LEASE)
    await store.leases.start_step(lease, 0, "first")
    await store.leases.report_progress(lease, 0, 50, 25, "half way")
    await store.leases.finish_step(lease, 0, "first", {"ok": True}, 50, next_handler=None)
    assert not isinstance(
        await store.transitions.complete(lease, 1, "second", None, None, clock.now()), Lost
    )
    leases = await claim(failed, retried, released)
    await store.leases.heartbeat("w1", leases, LEASE)
    error = RunError(code="boom", message="boom", step="first", attempt=1)
    await store.transitions.fail(leases[0], 0, error)
    await store.transitions.retry(leases[1], 0, error, clock.now())
    await store.transitions.release(leases[2])

    waiting, requested = await create(), await create()
    await service.cancel(waiting, "user:a", "not needed")
    [held] = await claim(requested)
    await service.cancel(requested, "user:a", "stop")
    await store.leases.heartbeat("w1", [held], LEASE)
    await store.transitions.acknowledge_cancel(held, interrupted=True)

    first, second = await create(keyed.type), await create(keyed.type)
    assert (await service.get(second)).status == RunStatus.PENDING
    [key_lease] = await claim(first)
    await store.transitions.complete(key_lease, 0, "only", None, None)
    await service.lifecycle.admit_next((await service.get(second)).dedupe_wait or "", "worker:w1")
    assert (await service.get(second)).status == RunStatus.QUEUED

    lost, slow, late = await create(), await create(), await create(timed.type)
    [lost_lease, *_] = await claim(lost, slow, late)
    await service.cancel(slow, "user:a", "stop")
    scheduler = Scheduler(store, queue, settings, clock)
    clock.advance(LEASE - 1)  # past the deadline, within the lease
    assert await scheduler.reap() == 1
    clock.advance(LEASE * 2)  # past the lease and the cancel's grace
    assert await scheduler.reap() == 2
    assert isinstance(
        await store.leases.finish_step(lost_lease, 0, "first", None, 50, next_handler=None), Lost
    )
    outcomes = [(await service.get(r)).status for r in (lost, slow, late)]
    assert outcomes == [RunStatus.QUEUED, RunStatus.CANCELLED, RunStatus.EXPIRED]

    # A step lent, claimed, renewed, started, given back, claimed again and reported; another
    # lent, asked to stop and taken back.
    lent_run, lent_again = await create(), await create()
    holder, again = await claim(lent_run, lent_again)
    assert await store.lending.lend(holder, 1, "second", "h", 1) is None
    for borrower in ("w2", "w3"):
        [(_, step_lease)] = await store.lending.claim([(lent_run, 1)], borrower, LEASE)
        assert await store.lending.heartbeat([step_lease], LEASE) == ({step_lease.key}, set())
        assert await store.leases.start_step(step_lease, 1, "second") is None
        if borrower == "w2":
            assert await store.lending.give_back(step_lease, "second") is None
    done_at = clock.now()
    outcome = StepOutcome(status=StepStatus.SUCCEEDED, output=1, started_at=done_at)
    assert await store.lending.report(step_lease, outcome) is None
    assert await store.lending.step(holder, 1) is not None
    assert await store.leases.finish_step(holder, 1, "second", 1, 100, next_handler=None) is None
    assert await store.lending.lend(again, 1, "second", "h", 1) is None
    assert await store.lending.ask_stop(again, 1) is None
    assert await store.lending.take_back(again, 1, "second", None, "its run stops") is None

    clock.advance(timedelta(days=settings.run_retention_days + 1).total_seconds())
    assert await store.maintenance.archive(clock.now(), 100) > 0
    await store.trail.flush()

    seen = writes(commands)
    # The life above made each kind of write at least once.
    assert seen >= {
        "update job_runs targeted",
        "update job_runs claim",
        "update job_runs_archive targeted",
        "delete job_runs",
    }, seen


async def test_key_events_name_their_shard_key(
    watched: tuple[MongoStore, Commands], clock: ManualClock
) -> None:
    """An API key's events go to `job_events` with a shard key like any other, written in the
    transaction that creates or revokes the key."""
    store, commands = watched
    _, key = mint_key("ci", "author", [], "user:admin", clock.now())
    assert await store.keys.insert(key)
    assert await store.keys.revoke(key.id, "user:admin")
    inserted = [
        (doc, event.command.get("autocommit"))
        for event in commands.sent
        if event.command_name == "insert" and event.command["insert"] == "job_events"
        for doc in event.command["documents"]
    ]
    assert [doc["type"] for doc, _ in inserted] == ["api_key_created", "api_key_revoked"]
    for doc, autocommit in inserted:
        assert all(isinstance(doc.get(f), str) for f in shard_fields("job_events")), doc
        assert autocommit is False  # in a transaction


async def test_flow_control_writes_name_their_shard_key_or_are_claims(
    watched: tuple[MongoStore, Commands], queue: RedisQueue, clock: ManualClock
) -> None:
    """Flow control's writes to runs: a key's places taken and admitted, a claim under
    `maxRunning` (its gate is an unsharded collection; its claim is the claim's
    multi-document update by `_id`), a lock waited for and taken, and a queue's pause, whose
    event names the shard key like any other."""
    store, commands = watched
    steps = [{"id": "call", "handler": "builtin.noop", "locks": [{"name": "api"}]}]
    limited, _ = await store.templates.register(
        template_spec(
            "t_limited",
            steps=steps,
            concurrencyPolicy="queue_same_scope",
            concurrencyLimit=2,
            maxRunning=1,
            rateLimit={"limit": 10, "periodSeconds": 1},
        )
    )
    service = RunService(store, queue)
    commands.sent.clear()
    ids = [
        (await service.create(RunRequest(limited.type, "user", "u1"), "user:a"))[0].id
        for _ in range(3)
    ]
    runs = [await service.get(i) for i in ids]
    assert [r.status for r in runs] == [RunStatus.QUEUED, RunStatus.QUEUED, RunStatus.PENDING]
    capped = [(r.id, r.start_limits) for r in runs[:2] if r.start_limits]
    [(_, lease)], held = await store.transitions.claim_limited(capped, "w1", LEASE, clock.now())
    assert held == [runs[1].id]
    wait = LockWait(lock="api", holder="other", count=1)
    assert not isinstance(await store.transitions.release(lease, lock_wait=wait), Lost)
    [(_, lease)], _ = await store.transitions.claim_limited(capped[:1], "w1", LEASE, clock.now())
    assert await store.leases.locks_taken(lease) is None
    await store.transitions.complete(lease, 0, "call", None, None)
    await service.lifecycle.admit_next(runs[2].dedupe_wait or "", "worker:w1")
    assert (await service.get(ids[2])).status == RunStatus.QUEUED
    await store.queues.set_paused("default", True, "user:a", "why")
    await store.trail.flush()

    kinds = {kind.split()[-1] for kind in writes(commands) if kind.startswith("update job_runs")}
    assert kinds == {"targeted", "claim"}


# -- indexes of earlier versions -----------------------------------------------------------------

OLD_UNIQUE = {
    "dedupeKey_1": ("dedupeKey", [("dedupeKey", 1)]),
    "scheduleId_1_scheduledFor_1": ("scheduleId", [("scheduleId", 1), ("scheduledFor", 1)]),
    # One place per key, before `concurrencyLimit`.
    "scope_1_scopeId_1_dedupeKey_1": (
        "dedupeKey",
        [("scope", 1), ("scopeId", 1), ("dedupeKey", 1)],
    ),
}
NEW_UNIQUE = {
    "scope_1_scopeId_1_dedupeKey_1_dedupeSlot_1": "dedupeKey",
    "scope_1_scopeId_1_scheduleId_1_scheduledFor_1": "scheduleId",
}


async def test_unique_indexes_of_an_unsharded_deployment_are_replaced(
    store: MongoStore, register: Register, mongos: bool
) -> None:
    """A deployment of an earlier version has unique indexes that do not start with the shard
    key: starting up creates the new ones first, then drops the old, and dedupe and one run
    per fire time still hold."""
    if mongos:
        pytest.skip("such indexes cannot exist on a sharded collection")
    for name in NEW_UNIQUE:
        await raw(store).runs.drop_index(name)
    for name, (field, keys) in OLD_UNIQUE.items():
        partial = {field: {"$exists": True}}
        made = await raw(store).runs.create_index(
            keys, unique=True, partialFilterExpression=partial
        )
        assert made == name
    template = await register("t_keyed", concurrencyPolicy="reject_same_scope")
    holder = await store.runs.insert(NewRun(template, "user", "u1", dedupe_key="k1"), "user:a")
    fire = datetime(2026, 3, 7, 2, 30, tzinfo=UTC)
    schedule_id = str(ObjectId())
    fired = NewRun(template, "user", "u1", schedule_id=schedule_id, scheduled_for=fire)
    first_fire = await store.runs.insert(fired, "scheduler")

    await store.ensure_indexes()
    await store.ensure_indexes()

    indexes = await raw(store).runs.index_information()
    assert not OLD_UNIQUE.keys() & indexes.keys()
    for name, field in NEW_UNIQUE.items():
        assert indexes[name]["unique"]
        assert indexes[name]["partialFilterExpression"] == {field: {"$exists": True}}
    with pytest.raises(KeyHeld) as held:
        await store.runs.insert(NewRun(template, "user", "u1", dedupe_key="k1"), "user:a")
    assert held.value.holder is not None and held.value.holder.id == holder.id
    with pytest.raises(DuplicateRun) as duplicate:
        await store.runs.insert(fired, "scheduler")
    assert duplicate.value.run.id == first_fire.id
