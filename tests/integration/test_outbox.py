"""A write and its events are one MongoDB write: events survive a writer that dies before
copying them into `job_events`, and the scheduler's sweep copies them exactly once."""

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from bson import ObjectId

from jobplane.model import RunStatus
from jobplane.store import MongoStore, NewRun
from tests.integration.conftest import Register


async def test_events_a_dead_writer_never_copied_are_read_and_swept_once(
    store: MongoStore, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = await register()

    async def die_before_copying(run: ObjectId, events: list[dict[str, Any]]) -> None:
        return None

    with monkeypatch.context() as patched:
        patched.setattr(store._outbox, "hand", die_before_copying)
        run = await store.insert_run(NewRun(template, "user", "u1"), "user:a")
        [(_, lease)] = await store.claim([run.id], "w", 5)
        await store.complete(lease, 0, "only", "out", None)
    assert await store.events.count_documents({"jobId": run.id}) == 0

    # Readers see the whole trail already: it is durable with the writes themselves.
    trail = [(e.type, e.to) for e in await store.events_of(run.id)]
    assert trail == [
        ("created", RunStatus.PENDING),
        ("status_changed", RunStatus.RUNNING),
        ("step_finished", None),
        ("status_changed", RunStatus.SUCCEEDED),
    ]

    # A run written just now is left to its writer.
    assert await store.sweep_outboxes(store.clock.now() - timedelta(seconds=60), 10) == 0
    # Two sweeps racing copy each event once.
    later = store.clock.now() + timedelta(seconds=1)
    await asyncio.gather(store.sweep_outboxes(later, 10), store.sweep_outboxes(later, 10))
    assert await store.events.count_documents({"jobId": run.id}) == 4
    assert (await store.runs.find_one({"_id": ObjectId(run.id)}))["outbox"] == []  # type: ignore[index]
    assert [(e.type, e.to) for e in await store.events_of(run.id)] == trail
    assert await store.sweep_outboxes(later, 10) == 0


async def test_copied_events_leave_the_outbox(store: MongoStore, register: Register) -> None:
    template = await register()
    runs = [await store.insert_run(NewRun(template, "user", "u1"), "user:a") for _ in range(20)]
    claimed = await store.claim([r.id for r in runs], "w", 5)
    await asyncio.gather(*(store.complete(lease, 0, "only", None, None) for _, lease in claimed))
    await store.flush_events()
    assert await store.runs.count_documents({"outbox.0": {"$exists": True}}) == 0
    assert await store.events.count_documents({}) == 20 * 4
