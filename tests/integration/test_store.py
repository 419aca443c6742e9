"""Uniqueness that MongoDB enforces for the store (dedupe, idempotency, template versions), and
the reads of the template cache."""

import asyncio

import pytest

from jobplane.model import RunStatus
from jobplane.store import DuplicateRun, KeyHeld, MongoStore, NewRun
from tests.integration.conftest import Register, template_spec
from tests.integration.db import raw


async def test_one_active_run_per_dedupe_key_under_concurrent_inserts(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    new = NewRun(template, "user", "u1", dedupe_key="u1|target")

    async def insert() -> str:
        try:
            return (await store.runs.insert(new, "user:a")).id
        except KeyHeld as held:
            assert held.holder is not None
            return f"conflict:{held.holder.id}"

    outcomes = await asyncio.gather(*(insert() for _ in range(50)))
    winners = [o for o in outcomes if not o.startswith("conflict:")]
    assert len(winners) == 1
    assert set(outcomes) - set(winners) == {f"conflict:{winners[0]}"}
    assert await raw(store).runs.count_documents({}) == 1

    # The key is held only while the run is active.
    [(_, lease)] = await store.transitions.claim(winners, "w", 5)
    await store.transitions.complete(lease, 0, "only", None, None)
    again = await store.runs.insert(new, "user:a")
    assert again.status == RunStatus.QUEUED and again.dedupe_key == new.dedupe_key


async def test_idempotency_key_returns_the_existing_run(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    first = await store.runs.insert(NewRun(template, "user", "u1", idempotency_key="k"), "user:a")
    with pytest.raises(DuplicateRun) as caught:
        await store.runs.insert(NewRun(template, "user", "u1", idempotency_key="k"), "user:a")
    assert caught.value.run.id == first.id
    other_scope = await store.runs.insert(
        NewRun(template, "user", "u2", idempotency_key="k"), "user:b"
    )
    assert other_scope.id != first.id


async def test_concurrent_registrations_make_consecutive_versions(store: MongoStore) -> None:
    specs = [template_spec("t", description=str(i)) for i in range(8)]
    results = await asyncio.gather(*(store.templates.register(s) for s in specs))
    # Eight different definitions: each becomes its own version, none lost to the race.
    assert sorted(t.version for t, created in results if created) == list(range(1, 9))
    assert await raw(store).templates.count_documents({"type": "t"}) == 8


async def test_an_earlier_versions_indexes_are_replaced_without_a_gap(
    store: MongoStore, register: Register
) -> None:
    """A deployment made by an earlier version has full indexes where this one keeps partial
    ones: starting up creates the new ones next to the old (same keys, other names), then
    drops the old, and a second start changes nothing."""
    old_runs = {
        "status_1_lockedUntil_1": [("status", 1), ("lockedUntil", 1)],
        "status_1_deadline_1": [("status", 1), ("deadline", 1)],
        "status_1_cancelDeadline_1": [("status", 1), ("cancelDeadline", 1)],
        "scheduleId_1__id_-1": [("scheduleId", 1), ("_id", -1)],
        "status_1_dedupeKey_1_updateAt_1": [("status", 1), ("dedupeKey", 1), ("updateAt", 1)],
    }
    for name in ("leases", "deadlines", "cancel_deadlines", "schedule_runs", "ended"):
        await raw(store).runs.drop_index(name)
    for name, keys in old_runs.items():
        assert await raw(store).runs.create_index(keys) == name
    await raw(store).events.create_index([("jobId", 1), ("runVersion", 1), ("_id", 1)])
    template = await register()
    run = await store.runs.insert(NewRun(template, "user", "u1"), "user:a")

    await store.ensure_indexes()
    await store.ensure_indexes()

    runs = await raw(store).runs.index_information()
    assert not old_runs.keys() & runs.keys()
    assert runs["leases"]["partialFilterExpression"] == {"lockedUntil": {"$exists": True}}
    assert runs["ended"]["partialFilterExpression"] == {"completedAt": {"$exists": True}}
    assert "jobId_1_runVersion_1__id_1" not in await raw(store).events.index_information()
    assert await store.runs.get(run.id) is not None


async def test_processes_starting_together_all_ensure_the_indexes(store: MongoStore) -> None:
    """Workers, schedulers and API processes start at once on a new database: each makes the
    collections and indexes, none fails because another made them first."""
    await raw(store).schedules.drop()
    await asyncio.gather(*(store.ensure_indexes() for _ in range(4)))
    assert len(await raw(store).schedules.index_information()) > 1


async def test_creates_that_miss_the_template_cache_together_share_one_read(
    store: MongoStore,
) -> None:
    await store.templates.register(template_spec("shared"))
    db = raw(store).templates.database
    await db.command("profile", 2)
    try:
        found = await asyncio.gather(*(store.templates.cached("shared") for _ in range(32)))
    finally:
        await db.command("profile", 0)
    assert {t.type for t in found if t is not None} == {"shared"} and None not in found
    reads = await db["system.profile"].count_documents(
        {"ns": f"{db.name}.job_templates", "op": "query"}
    )
    assert reads == 1
