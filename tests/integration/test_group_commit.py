"""Writes of many callers share one bulk write; each caller still learns its own outcome.

The bulk result only counts matched filters, so when some lost their race the store reads
which ones were applied (their events are in the trail). These tests race writers inside
one batch on purpose.
"""

import asyncio

from bson import ObjectId

from jobplane.model import Run, RunStatus
from jobplane.store import DuplicateRun, KeyHeld, Lost, MongoStore, Moved, NewRun
from tests.integration.conftest import Register
from tests.integration.db import raw


async def test_two_writers_from_one_state_in_one_batch_one_wins(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    runs = [await store.runs.insert(NewRun(template, "user", "u1"), "user:a") for _ in range(10)]
    # Each run cancelled twice at once: both writers read the same state, and their writes
    # share a bulk write.
    outcomes = await asyncio.gather(
        *(store.transitions.cancel(r.id, "user:a", None) for r in [*runs, *runs])
    )
    for first, second in zip(outcomes[: len(runs)], outcomes[len(runs) :], strict=True):
        assert sorted(type(o).__name__ for o in (first, second)) == ["Lost", "Moved"]
    for run in runs:
        stored = await store.runs.get(run.id)
        assert stored is not None and stored.status == RunStatus.CANCELLED and stored.version == 2
    await store.trail.flush()
    # Exactly one `status_changed` per run: the loser's events were never written.
    assert await raw(store).events.count_documents({"type": "status_changed"}) == len(runs)


async def test_lost_and_won_writes_in_one_batch_are_told_apart(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    runs = [await store.runs.insert(NewRun(template, "user", "u1"), "user:a") for _ in range(10)]
    leases = [lease for _, lease in await store.transitions.claim([r.id for r in runs], "w1", 30)]
    taken = leases[::2]
    for lease in taken:  # another worker's lease now: the holder's own state is stale
        await raw(store).runs.update_one(
            {"_id": ObjectId(lease.run_id)}, {"$set": {"leaseToken": "other"}}
        )
    outcomes = await asyncio.gather(
        *(store.transitions.complete(lease, 0, "only", None, {"ok": True}) for lease in leases)
    )
    assert [type(o).__name__ for o in outcomes] == ["Lost", "Moved"] * 5
    assert all(isinstance(o, Lost) and o.reason == "lease" for o in outcomes[::2])
    await store.trail.flush()
    # Only the writes that applied had their events copied.
    completed = await raw(store).events.distinct("jobId", {"metadata.transition": "complete"})
    assert sorted(completed) == sorted(lease.run_id for lease in leases[1::2])


async def test_a_duplicate_key_in_a_batch_fails_only_its_writer(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    waiting = [
        await store.runs.insert(NewRun(template, "user", "u1", dedupe_wait="k"), "user:a")
        for _ in range(6)
    ]
    outcomes = await asyncio.gather(
        *(store.runs.take_key(run, "user:a") for run in waiting), return_exceptions=True
    )
    assert sum(isinstance(o, Moved) for o in outcomes) == 1
    assert all(isinstance(o, KeyHeld) for o in outcomes if not isinstance(o, Moved))
    assert await raw(store).runs.count_documents({"dedupeKey": "k"}) == 1


async def test_a_bulk_insert_reports_each_collision_on_its_own_item(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    news = [NewRun(template, "user", "u1", idempotency_key=f"k{i % 3}") for i in range(9)]
    outcomes = await store.runs.insert_many(news, "user:a")
    first = {o.idempotency_key: o.id for o in outcomes if isinstance(o, Run)}
    assert sorted(first) == ["k0", "k1", "k2"]
    # Every other item is answered with the run that took its key, whichever item that was.
    for new, outcome in zip(news, outcomes, strict=True):
        if isinstance(outcome, DuplicateRun):
            assert outcome.run.id == first[new.idempotency_key]
        else:
            assert isinstance(outcome, Run)
    assert await raw(store).runs.count_documents({}) == 3


async def test_progress_writes_in_one_batch_are_fenced_by_the_lease_alone(
    store: MongoStore, register: Register
) -> None:
    """A progress write carries no event, so it names no version: a heartbeat that moved the
    version does not make it miss, while a lost lease does, even inside a batch of winners."""
    template = await register()
    runs = [await store.runs.insert(NewRun(template, "user", "u1"), "user:a") for _ in range(6)]
    claimed = await store.transitions.claim([r.id for r in runs], "w1", lease_seconds=30)
    leases = [lease for _, lease in claimed]
    beat_known = [lease.known for lease in leases]
    await store.leases.heartbeat("w1", leases, 30)
    assert all(  # the beat moved every version, and the leases know it
        lease.known and before and lease.known.version == before.version + 1
        for lease, before in zip(leases, beat_known, strict=True)
    )
    stale = [lease.known for lease in leases]
    for lease, known_before in zip(leases, beat_known, strict=True):
        lease.known = known_before  # as if the beat's read-back had not come yet
    taken = leases[::2]
    for lease in taken:  # another worker's lease now: these writes must be refused
        await raw(store).runs.update_one(
            {"_id": ObjectId(lease.run_id)}, {"$set": {"leaseToken": "other"}}
        )
    outcomes = await asyncio.gather(
        *(store.leases.report_progress(lease, 0, 50, 50, "half") for lease in leases)
    )
    assert [o is None for o in outcomes] == [False, True] * 3
    assert all(isinstance(o, Lost) and o.reason == "lease" for o in outcomes[::2])
    for lease, before in zip(leases, stale, strict=True):
        stored = await store.runs.get(lease.run_id)
        assert stored is not None and before is not None
        written = lease not in taken
        assert stored.progress.percentage == (50 if written else 0)
        assert stored.version == before.version + written
