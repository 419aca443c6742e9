"""Scheduler processes against one MongoDB + Redis: `python -m jobplane scheduler` twice, a
schedule firing every second, and the active one SIGKILLed. Each fire time gets exactly one
run, and the standby takes the lock once it expires and fires what fell due meanwhile.
"""

import asyncio
import signal
import subprocess
import time
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.model import Schedule, ScheduleSpec
from jobplane.schedules import ScheduleService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.processes import spawn, terminate

SCHEMA = {"type": "object", "properties": {"at": {"type": "string"}}, "required": ["at"]}
# Bounds for what takes a second or two on a laptop; a loaded CI machine may need many times that.
WITHIN = 60.0
POLL = 0.05
TTL = 2.0
# How far past the lock's TTL a takeover may come: the standby retries every TTL / 3 at most,
# the rest is room for a slow machine (starting Python, for one).
SLACK = 5.0
SECOND = timedelta(seconds=1)


async def every_second(backends: Backends, register: Register) -> Schedule:
    await register("t_tick", schedulable=True, payloadSchema=SCHEMA)
    spec = ScheduleSpec.model_validate(
        {
            "templateType": "t_tick",
            "scope": "account",
            "scopeId": "acme",
            "cron": "* * * * * *",
            "payloadTemplate": {"at": "{{scheduledFor}}"},
        }
    )
    return await ScheduleService(backends.store, backends.queue).create(spec, "user:test")


async def fires_of(backends: Backends, schedule_id: str) -> list[tuple[datetime, datetime]]:
    """(scheduledFor, createAt) of every run of the schedule, by fire time."""
    cursor = raw(backends.store).runs.find({"scheduleId": schedule_id}).sort("scheduledFor", 1)
    return [(r["scheduledFor"], r["createAt"]) async for r in cursor]


async def lock_holder(backends: Backends) -> int | None:
    """The pid of the scheduler holding the lock; its owner string is `scheduler-<pid>-<hex>`."""
    text, _ = await backends.queue.locks.singleton_holder("scheduler")
    if text is None:
        return None
    return int(text.split("-")[1])


def check_alive(procs: list[subprocess.Popen[bytes]], logs: Path) -> None:
    for proc in procs:
        if proc.poll() is not None:
            output = "\n".join(p.read_text() for p in sorted(logs.glob("*.log")))
            pytest.fail(f"scheduler {proc.pid} exited with {proc.returncode}:\n{output}")


async def fired_through(
    backends: Backends,
    schedule_id: str,
    at: datetime,
    procs: list[subprocess.Popen[bytes]],
    logs: Path,
) -> None:
    """Wait until the fire time `at` (or a later one) has its run, with `procs` alive all along."""
    async with asyncio.timeout(WITHIN):
        while not (fires := await fires_of(backends, schedule_id)) or fires[-1][0] < at:
            check_alive(procs, logs)
            await asyncio.sleep(POLL)


def assert_one_run_per_second(fires: list[tuple[datetime, datetime]], first: datetime) -> None:
    times = [at for at, _ in fires]
    assert len(times) == len(set(times)), "a fire time has two runs"
    assert times[0] == first, "the first fire time is the one the schedule was created with"
    gaps = [(a, b) for a, b in pairwise(times) if b - a != SECOND]
    assert gaps == [], "fire times with no run between them"
    # Fire times are whole seconds, so MongoDB's millisecond truncation of `createAt` cannot
    # make a run that was on time look early.
    assert all(created >= at for at, created in fires), "a run was made before its fire time"


@pytest.mark.slow
async def test_two_scheduler_processes_make_one_run_per_fire_time(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    made = await every_second(backends, register)
    assert made.next_run_at is not None
    procs = [spawn(settings, "scheduler", tmp_path / f"scheduler-{i}.log") for i in range(2)]
    pids = {p.pid for p in procs}
    holders: set[int] = set()
    try:
        # About ten ticks with both processes up; the lock is looked at along the way.
        until = datetime.now(UTC) + 10 * SECOND
        async with asyncio.timeout(WITHIN):
            while not (fires := await fires_of(backends, made.id)) or fires[-1][0] < until:
                check_alive(procs, tmp_path)
                if (holder := await lock_holder(backends)) is not None:
                    holders.add(holder)
                await asyncio.sleep(POLL)
    finally:
        for proc in procs:
            terminate(proc)
    assert holders and holders <= pids, "only the two schedulers held the lock"
    fires = await fires_of(backends, made.id)
    assert len(fires) >= 10
    assert_one_run_per_second(fires, made.next_run_at)
    assert [p.returncode for p in procs] == [0, 0], "both stopped cleanly on SIGTERM"


@pytest.mark.slow
async def test_the_standby_takes_over_from_a_killed_scheduler_and_misses_nothing(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Three times over: SIGKILL the lock's holder, see the standby take the lock once it
    expires and fire the times that fell due meanwhile, then start a new standby."""
    quick = settings.model_copy(update={"scheduler_lock_seconds": TTL})
    made = await every_second(backends, register)
    assert made.next_run_at is not None
    started = [spawn(quick, "scheduler", tmp_path / f"scheduler-{i}.log") for i in range(2)]
    alive = list(started)
    # Per kill: when it was sent, the earliest the dead holder's lock could expire, and when
    # the test saw the standby holding it.
    outages: list[tuple[datetime, datetime, datetime]] = []
    try:
        # Both processes get a couple of seconds to start before the first kill.
        await fired_through(backends, made.id, datetime.now(UTC) + 2 * SECOND, alive, tmp_path)
        previous: int | None = None
        for _ in range(3):
            holder = await lock_holder(backends)
            assert holder is not None
            if previous is not None:
                assert holder == previous, "a newly started scheduler took a held lock"
            [active] = [p for p in alive if p.pid == holder]
            [standby] = [p for p in alive if p is not active]

            read, read_at = time.monotonic(), datetime.now(UTC)
            _, left = await backends.queue.locks.singleton_holder("scheduler")
            assert left > 0, "the holder keeps its lock alive"
            killed = datetime.now(UTC)
            active.send_signal(signal.SIGKILL)
            assert active.wait(WITHIN) == -signal.SIGKILL
            async with asyncio.timeout(WITHIN):
                while (taker := await lock_holder(backends)) in (holder, None):
                    check_alive([standby], tmp_path)
                    await asyncio.sleep(POLL)
            took = time.monotonic() - read
            taken = datetime.now(UTC)
            assert taker == standby.pid
            # Never before the dead holder's lock ran out (it may have extended it after
            # the PTTL was read, never shortened it), and about one TTL after the kill.
            assert took >= left - POLL
            assert took <= TTL + SLACK, f"the standby took {took:.1f} s to take over"
            outages.append((killed, read_at + timedelta(seconds=left), taken))

            # The new holder keeps firing, with a new standby started beside it.
            replacement = spawn(quick, "scheduler", tmp_path / f"scheduler-{len(started)}.log")
            started.append(replacement)
            alive = [standby, replacement]
            await fired_through(backends, made.id, taken + 2 * SECOND, alive, tmp_path)
            previous = standby.pid
    finally:
        for proc in started:
            terminate(proc)

    fires = await fires_of(backends, made.id)
    assert_one_run_per_second(fires, made.next_run_at)
    # Fire times due while a dead process held the lock were fired late by the standby,
    # one run each, rather than skipped or fired early by someone ignoring the lock.
    late = [
        (at, created, expired)
        for killed, expired, taken in outages
        for at, created in fires
        if killed < at < taken
    ]
    assert late, "some fire times fell due during an outage"
    for at, created, expired in late:
        assert created >= max(at, expired) - timedelta(seconds=POLL), (
            f"{at} was fired while a dead scheduler held the lock"
        )
    skips = await raw(backends.store).events.count_documents({"type": "fire_skipped"})
    assert skips == 0
