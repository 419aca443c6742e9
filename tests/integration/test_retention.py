"""Retention: terminal runs past the age move to `job_runs_archive`, stay readable by id, and
are never missing to a reader while they move."""

import asyncio
from datetime import UTC, datetime

import httpx
import pytest

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.model import TERMINAL, RunStatus
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.store import MongoStore
from jobplane.store.maintenance import archivable
from tests.integration.conftest import Client, Register
from tests.integration.db import raw
from tests.integration.runs import run_in

DAY = 86400


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 1, tzinfo=UTC))


async def test_only_terminal_runs_past_the_age_move(
    timed: MongoStore,
    register: Register,
    clock: ManualClock,
    backends: Backends,
    settings: Settings,
) -> None:
    template = await register()
    old = {s: (await run_in(timed, template, s))[0] for s in RunStatus}
    # A non-repeatable template's succeeded run keeps its key: moving it would free the key.
    spent, _ = await run_in(timed, template, RunStatus.SUCCEEDED, dedupeKey="k1")
    clock.advance(29 * DAY)
    young = {s: (await run_in(timed, template, s))[0] for s in TERMINAL}
    clock.advance(2 * DAY)

    await Scheduler(timed, backends.queue, settings, clock).tick()

    archived = {d["_id"] async for d in raw(timed).archive.find({}, {"_id": 1})}
    assert {str(i) for i in archived} == {old[s].id for s in TERMINAL}
    live = {str(d["_id"]) async for d in raw(timed).runs.find({}, {"_id": 1})}
    assert live == {
        *(old[s].id for s in set(RunStatus) - TERMINAL),
        spent.id,
        *(r.id for r in young.values()),
    }
    for status in TERMINAL:
        moved = await timed.runs.get(old[status].id)
        assert moved == old[status], "an archived run reads as it was"
        assert [e.type for e in await timed.trail.events_of(moved.id)] == ["created"]


async def test_a_pass_is_bounded_and_the_query_reads_only_what_it_moves(
    timed: MongoStore, register: Register, clock: ManualClock
) -> None:
    template = await register()
    for _ in range(7):
        await run_in(timed, template, RunStatus.SUCCEEDED)
    for i in range(20):
        await run_in(timed, template, RunStatus.SUCCEEDED, dedupeKey=f"kept{i}")
    clock.advance(DAY)
    assert await timed.maintenance.archive(clock.now(), 5) == 5
    assert await timed.maintenance.archive(clock.now(), 5) == 2
    assert await timed.maintenance.archive(clock.now(), 5) == 0
    plan = await raw(timed).runs.find(archivable(clock.now())).explain()
    stats = plan["executionStats"]
    assert "COLLSCAN" not in str(plan["queryPlanner"]["winningPlan"])
    assert stats["totalDocsExamined"] == 0, "runs that keep their key are not even read"


async def test_a_run_moved_while_being_read_is_never_lost(
    timed: MongoStore, register: Register, clock: ManualClock
) -> None:
    template = await register()
    runs = [(await run_in(timed, template, RunStatus.SUCCEEDED))[0] for _ in range(200)]
    clock.advance(DAY)
    moving, moved = True, 0
    misses: list[str] = []

    async def read() -> int:
        reads = 0
        while moving:
            for run in runs:
                if await timed.runs.get(run.id) is None or not await timed.trail.events_of(run.id):
                    misses.append(run.id)
                reads += 1
        return reads

    readers = [asyncio.create_task(read()) for _ in range(4)]
    try:
        while batch := await timed.maintenance.archive(clock.now(), 3):
            moved += batch
    finally:
        moving = False
        reads = await asyncio.gather(*readers)
    assert sum(reads) > len(runs), "the readers ran while the runs moved"
    assert misses == []
    assert moved == len(runs) and await raw(timed).runs.count_documents({}) == 0
    assert await raw(timed).archive.count_documents({}) == len(runs)


async def test_a_copy_left_by_a_crashed_pass_is_replaced(
    timed: MongoStore, register: Register, clock: ManualClock
) -> None:
    """A pass that died between copying and deleting left a copy behind; the next one
    copies again over it and then deletes."""
    template = await register()
    run, _ = await run_in(timed, template, RunStatus.FAILED)
    stale = await raw(timed).runs.find_one({})
    assert stale is not None
    await raw(timed).archive.insert_one({**stale, "status": "running"})
    clock.advance(31 * DAY)
    assert await timed.maintenance.archive(clock.now(), 10) == 1
    assert await timed.runs.get(run.id) == run


async def test_the_api_finds_an_archived_run_by_id(
    timed: MongoStore,
    register: Register,
    clock: ManualClock,
    client_for: Client,
    settings: Settings,
) -> None:
    template = await register()
    run, _ = await run_in(timed, template, RunStatus.SUCCEEDED)
    clock.advance(DAY)
    assert await timed.maintenance.archive(clock.now(), 10) == 1
    assert settings.admin_key is not None
    api: httpx.AsyncClient = client_for(settings.admin_key)
    got = await api.get(f"/v1/runs/{run.id}")
    assert got.status_code == 200 and got.json()["status"] == "succeeded"
    events = await api.get(f"/v1/runs/{run.id}/events")
    assert events.status_code == 200 and [e["type"] for e in events.json()] == ["created"]
    cancel = await api.post(f"/v1/runs/{run.id}/cancel")
    assert cancel.status_code == 409
