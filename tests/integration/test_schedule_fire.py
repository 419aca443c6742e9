"""Firing schedules: on time, across DST, after an outage (misfire policies), with a previous
run still active (overlap policies), and with two schedulers at once. Times move on an
injected clock, except in the test of the running loop."""

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.model import Run, RunStatus, Schedule, ScheduleSpec
from jobplane.runs import RunService
from jobplane.scheduler import Scheduler
from jobplane.schedules import ScheduleService
from jobplane.settings import Settings
from jobplane.store import MongoStore
from tests.integration.conftest import Register
from tests.integration.db import raw

SCHEMA = {"type": "object", "properties": {"at": {"type": "string"}}, "required": ["at"]}
GRACE = 60


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 7, 0, 0, tzinfo=UTC))


@pytest.fixture
def timed(timed: MongoStore, backends: Backends) -> ScheduleService:
    """The schedule service over conftest's store on this module's clock."""
    return ScheduleService(timed, backends.queue)


async def schedule(timed: ScheduleService, register: Register, **fields: Any) -> Schedule:
    await register("t_report", schedulable=True, payloadSchema=SCHEMA)
    spec = {
        "templateType": "t_report",
        "scope": "account",
        "scopeId": "acme",
        "cron": "0 * * * *",
        "payloadTemplate": {"at": "{{scheduledFor}}"},
        **fields,
    }
    return await timed.create(ScheduleSpec.model_validate(spec), "user:test")


async def runs_of(timed: ScheduleService, schedule_id: str) -> list[dict[str, Any]]:
    cursor = raw(timed.store).runs.find({"scheduleId": schedule_id}).sort("scheduledFor", 1)
    return await cursor.to_list()


async def skips_of(timed: ScheduleService, schedule_id: str) -> list[dict[str, Any]]:
    return (
        await raw(timed.store).events.find({"jobId": schedule_id, "type": "fire_skipped"}).to_list()
    )


async def test_a_fire_makes_one_run_and_moves_the_schedule_on(
    timed: ScheduleService, register: Register, clock: ManualClock
) -> None:
    made = await schedule(timed, register, cron="30 2 * * *", timezone="America/New_York")
    # 2026-03-08 02:30 does not exist in New York: that day fires at the jump, 07:00 UTC.
    assert made.next_run_at == datetime(2026, 3, 7, 7, 30, tzinfo=UTC)
    assert await timed.fire_due(clock.now(), 10, GRACE) == 0
    for expected in ("2026-03-07T07:30", "2026-03-08T07:00", "2026-03-09T06:30"):
        at = datetime.fromisoformat(expected).replace(tzinfo=UTC)
        clock.advance((at - clock.now()).total_seconds() + 1)
        assert await timed.fire_due(clock.now(), 10, GRACE) == 1
        assert await timed.fire_due(clock.now(), 10, GRACE) == 0, "each fire time once"
    runs = await runs_of(timed, made.id)
    assert [r["scheduledFor"] for r in runs] == [
        datetime(2026, 3, 7, 7, 30, tzinfo=UTC),
        datetime(2026, 3, 8, 7, 0, tzinfo=UTC),
        datetime(2026, 3, 9, 6, 30, tzinfo=UTC),
    ]
    assert runs[1]["payload"] == {"at": "2026-03-08T07:00:00+00:00"}
    after = await timed.get(made.id)
    assert after.last_run_id == str(runs[-1]["_id"])
    assert after.next_run_at == datetime(2026, 3, 10, 6, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("policy", "fired_hours", "skipped"),
    [("skip", [], 5), ("run_once", [4], 4), ("catch_up", [2, 3, 4], 2)],
)
async def test_misfire_policies_after_an_outage(
    timed: ScheduleService,
    register: Register,
    clock: ManualClock,
    policy: str,
    fired_hours: list[int],
    skipped: int,
) -> None:
    made = await schedule(timed, register, misfirePolicy=policy, catchUpLimit=3)
    first = made.next_run_at
    assert first is not None
    clock.advance(5.5 * 3600)  # down across five fire times (01:00 to 05:00)
    await timed.fire_due(clock.now(), 10, GRACE)
    runs = await runs_of(timed, made.id)
    assert [r["scheduledFor"] for r in runs] == [first + timedelta(hours=h) for h in fired_hours]
    [skip] = await skips_of(timed, made.id)
    assert skip["metadata"]["count"] == skipped and skip["metadata"]["reason"] == "misfire"
    assert (await timed.get(made.id)).next_run_at == first + timedelta(hours=5)


async def test_a_fire_within_the_grace_is_on_time(
    timed: ScheduleService, register: Register, clock: ManualClock
) -> None:
    made = await schedule(timed, register, misfirePolicy="skip")
    assert made.next_run_at is not None
    clock.advance((made.next_run_at - clock.now()).total_seconds() + GRACE - 1)
    assert await timed.fire_due(clock.now(), 10, GRACE) == 1
    assert await skips_of(timed, made.id) == []


async def test_overlap_skip_records_the_skip(
    timed: ScheduleService, register: Register, clock: ManualClock
) -> None:
    made = await schedule(timed, register, overlapPolicy="skip")
    clock.advance(3600)
    assert await timed.fire_due(clock.now(), 10, GRACE) == 1
    clock.advance(3600)  # the first run is still queued: no worker runs here
    assert await timed.fire_due(clock.now(), 10, GRACE) == 0
    [skip] = await skips_of(timed, made.id)
    assert skip["metadata"]["reason"].startswith("overlap: run ")
    assert len(await runs_of(timed, made.id)) == 1


async def test_overlap_queue_waits_for_the_previous_run(
    timed: ScheduleService, register: Register, clock: ManualClock
) -> None:
    made = await schedule(timed, register, overlapPolicy="queue")
    clock.advance(3600)
    await timed.fire_due(clock.now(), 10, GRACE)
    clock.advance(3600)
    await timed.fire_due(clock.now(), 10, GRACE)
    await timed.store.trail.flush()
    first, second = await runs_of(timed, made.id)
    assert first["status"] == RunStatus.QUEUED and second["status"] == RunStatus.PENDING
    assert second["dedupeWait"] == f"schedule:{made.id}"
    await RunService(timed.store, timed.queue).cancel(str(first["_id"]), "user:test", None)
    await timed.store.trail.flush()
    admitted = await timed.store.runs.get(str(second["_id"]))
    assert admitted is not None and admitted.status == RunStatus.QUEUED


async def test_a_disabled_template_skips_the_fire(
    timed: ScheduleService, register: Register, clock: ManualClock
) -> None:
    made = await schedule(timed, register)
    await timed.store.templates.set_enabled("t_report", False)
    clock.advance(3600)
    assert await timed.fire_due(clock.now(), 10, GRACE) == 0
    [skip] = await skips_of(timed, made.id)
    assert skip["metadata"]["reason"] == "template_disabled"
    assert (await timed.get(made.id)).next_run_at == made.next_run_at + timedelta(hours=1)  # type: ignore[operator]


async def test_a_disabled_schedule_does_not_fire_and_records_the_skip_on_resume(
    timed: ScheduleService, register: Register, clock: ManualClock
) -> None:
    made = await schedule(timed, register)
    await timed.update(made.id, {"enabled": False})
    clock.advance(3.5 * 3600)
    assert await timed.fire_due(clock.now(), 10, GRACE) == 0
    assert await skips_of(timed, made.id) == []
    resumed = await timed.update(made.id, {"enabled": True})
    [skip] = await skips_of(timed, made.id)
    assert skip["metadata"]["reason"] == "schedule_disabled"
    assert skip["metadata"]["count"] == 3
    assert skip["metadata"]["first"] == made.next_run_at.isoformat()  # type: ignore[union-attr]
    assert resumed.next_run_at == made.next_run_at + timedelta(hours=3)  # type: ignore[operator]
    assert await timed.fire_due(clock.now(), 10, GRACE) == 0, "nothing of the pause fires late"
    assert await runs_of(timed, made.id) == []


async def test_a_schedule_that_fails_to_fire_holds_up_no_other(
    timed: ScheduleService, register: Register, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = await schedule(timed, register)
    fine = await schedule(timed, register)
    fire_once = timed._fire_once

    async def failing(s: Schedule, at: datetime) -> Run | None:
        if s.id == broken.id:
            raise ConnectionError("MongoDB went away for this one")
        return await fire_once(s, at)

    monkeypatch.setattr(timed, "_fire_once", failing)
    clock.advance(3600)
    assert await timed.fire_due(clock.now(), 10, GRACE) == 1
    assert len(await runs_of(timed, fine.id)) == 1
    assert (await timed.get(broken.id)).next_run_at == broken.next_run_at, "still due"
    monkeypatch.undo()
    assert await timed.fire_due(clock.now(), 10, GRACE) == 1
    assert len(await runs_of(timed, broken.id)) == 1


async def test_two_schedulers_firing_at_once_make_one_run_per_fire_time(
    timed: ScheduleService,
    register: Register,
    clock: ManualClock,
    backends: Backends,
    settings: Settings,
) -> None:
    made = await schedule(timed, register, misfirePolicy="catch_up", catchUpLimit=10)
    others = [
        ScheduleService(MongoStore(backends.store.client, settings.db, clock=clock), backends.queue)
        for _ in range(4)
    ]
    for _ in range(5):
        clock.advance(3 * 3600)
        await asyncio.gather(*(s.fire_due(clock.now(), 10, GRACE) for s in [timed, *others]))
    runs = await runs_of(timed, made.id)
    times = [r["scheduledFor"] for r in runs]
    assert len(times) == len(set(times)) == 15
    assert (await timed.get(made.id)).next_run_at == made.next_run_at + timedelta(hours=15)  # type: ignore[operator]


@pytest.mark.slow
async def test_the_running_loop_fires_every_second_with_a_standby(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """Two schedulers on the real clock; one holds the lock. A cron firing every second gets
    one run per second, whichever scheduler fired it."""
    await register("t_report", schedulable=True, payloadSchema=SCHEMA)
    service = ScheduleService(backends.store, backends.queue)
    spec = ScheduleSpec.model_validate(
        {
            "templateType": "t_report",
            "scope": "account",
            "scopeId": "acme",
            "cron": "* * * * * *",
            "payloadTemplate": {"at": "{{scheduledFor}}"},
        }
    )
    made = await service.create(spec, "user:test")
    stop = asyncio.Event()
    quick = settings.model_copy(update={"scheduler_lock_seconds": 3, "misfire_grace_seconds": 5})
    tasks = [
        asyncio.create_task(
            Scheduler(backends.store, backends.queue, quick, owner=f"s{i}").run(stop)
        )
        for i in range(2)
    ]
    try:
        async with asyncio.timeout(30):
            while (  # noqa: ASYNC110
                len(
                    await raw(backends.store).runs.distinct("scheduledFor", {"scheduleId": made.id})
                )
                < 4
            ):
                await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    runs = await raw(backends.store).runs.find({"scheduleId": made.id}).to_list()
    times = sorted(r["scheduledFor"] for r in runs)
    assert len(times) == len(set(times)), "one run per fire time"
    assert all(t.microsecond == 0 for t in times)
