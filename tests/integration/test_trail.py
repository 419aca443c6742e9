"""A write and its events are one MongoDB write: the events live in the run's trail, survive a
writer that dies before copying them into `job_events`, and the sweep copies them once."""

import asyncio
from datetime import timedelta

import pytest

from jobplane.clock import ManualClock
from jobplane.model import RunStatus
from jobplane.store import MongoStore, NewRun
from tests.integration.conftest import Register
from tests.integration.db import raw


async def test_events_a_dead_writer_never_copied_are_read_and_swept_once(
    store: MongoStore, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = await register()
    with monkeypatch.context() as patched:
        # The process dies after each write and before its copy.
        patched.setattr(store.trail, "_copy", _die)
        run = await store.runs.insert(NewRun(template, "user", "u1"), "user:a")
        [(_, lease)] = await store.transitions.claim([run.id], "w", 5)
        await store.transitions.complete(lease, 0, "only", "out", None)
        await store.trail.flush()
    assert await raw(store).events.count_documents({"jobId": run.id}) == 0

    # Readers see the whole trail already: it is durable with the writes themselves.
    trail = [(e.type, e.to) for e in await store.trail.events_of(run.id)]
    assert trail == [
        ("created", RunStatus.QUEUED),
        ("status_changed", RunStatus.RUNNING),
        ("step_finished", None),
        ("status_changed", RunStatus.SUCCEEDED),
    ]

    # Runs written after the settled mark are left to their writers.
    assert await store.trail.sweep(store.clock.now() - timedelta(seconds=60)) == 0
    # Two sweeps racing copy each event once.
    later = store.clock.now() + timedelta(seconds=1)
    await asyncio.gather(store.trail.sweep(later), store.trail.sweep(later))
    assert await raw(store).events.count_documents({"jobId": run.id}) == 4
    assert [(e.type, e.to) for e in await store.trail.events_of(run.id)] == trail
    assert await store.trail.sweep(later) == 0


async def test_the_sweep_checks_only_runs_written_since_its_last_pass(
    store: MongoStore, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    timed = MongoStore(store.client, store.db.name, clock=clock)
    template = await register()
    first = await timed.runs.insert(NewRun(template, "user", "u1"), "user:a")
    await timed.trail.flush()
    # Past the skew the sweep allows for writers' clocks (30 s).
    assert await timed.trail.sweep(clock.now() + timedelta(seconds=60)) == 0
    # An event gone from `job_events` of a run nobody wrote since is not looked for again...
    await raw(timed).events.delete_many({"jobId": first.id})
    clock.advance(120)
    # ...but one of a run written after the last pass is.
    with monkeypatch.context() as patched:
        patched.setattr(timed.trail, "_copy", _die)
        second = await timed.runs.insert(NewRun(template, "user", "u2"), "user:a")
        await timed.trail.flush()
    assert await timed.trail.sweep(clock.now() + timedelta(seconds=1)) == 1
    assert await raw(timed).events.count_documents({"jobId": second.id}) == 1
    assert await raw(timed).events.count_documents({"jobId": first.id}) == 0


async def test_copies_keep_up_and_trails_stay_whole(store: MongoStore, register: Register) -> None:
    template = await register()
    runs = [await store.runs.insert(NewRun(template, "user", "u1"), "user:a") for _ in range(20)]
    claimed = await store.transitions.claim([r.id for r in runs], "w", 5)
    await asyncio.gather(
        *(store.transitions.complete(lease, 0, "only", None, None) for _, lease in claimed)
    )
    await store.trail.flush()
    assert await raw(store).events.count_documents({}) == 20 * 4
    doc = await raw(store).runs.find_one({})
    assert doc is not None and len(doc["trail"]) == 4
    later = store.clock.now() + timedelta(seconds=1)
    assert await store.trail.sweep(later) == 0


async def _die(events: object) -> None:
    raise ConnectionError("the process died before it copied its events")
