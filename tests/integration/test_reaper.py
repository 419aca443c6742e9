"""The reaper as the scheduler runs it: expired leases, cancel grace and deadlines, one bounded
pass at a time, with requeued runs back in Redis. Time moves on an injected clock.

What each store method does to one run is in test_transitions.py; here the scheduler picks the
runs, picks the method and pushes the requeued runs again.
"""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import ObjectId

from jobplane.clock import ManualClock
from jobplane.model import TERMINAL, Run, RunStatus, Template
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunService
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.store import MongoStore, NewRun
from jobplane.worker import registry
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.runs import run_in

S = RunStatus
LEASE = 30.0
# The pass runs at t0 + PASS: times set at t0 + GONE have passed by then, t0 + LATER have not.
PASS = 60.0
GONE = 30.0
LATER = 600.0
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Case:
    """A run as the reaper finds it (times in seconds after t0), and what one pass makes of it."""

    status: RunStatus
    attempt: int = 1
    # None: no worker holds the run, as `wait_worker` leaves it for an external worker.
    lease: float | None = GONE
    deadline: float | None = None
    cancel_deadline: float | None = None
    # None: the pass leaves the run as it was.
    becomes: RunStatus | None = None
    transition: str | None = None
    # The event recorded after the status change, and the error the attempt ends with (in
    # `attempts`, and the run's `error` if the run ends).
    event: str | None = None
    error: str | None = None


CASES: dict[str, Case] = {
    "running, lease lost, attempts left": Case(
        S.RUNNING,
        becomes=S.QUEUED,
        transition="reap_requeue",
        event="lease_expired",
        error="lease_expired",
    ),
    "running, lease lost, attempts spent": Case(
        S.RUNNING,
        MAX_ATTEMPTS,
        becomes=S.EXPIRED,
        transition="reap_expire",
        event="lease_expired",
        error="lease_expired",
    ),
    "waiting_worker, lease lost, attempts left": Case(
        S.WAITING_WORKER,
        becomes=S.QUEUED,
        transition="reap_requeue",
        event="lease_expired",
        error="lease_expired",
    ),
    "waiting_worker, lease lost, attempts spent": Case(
        S.WAITING_WORKER,
        MAX_ATTEMPTS,
        becomes=S.EXPIRED,
        transition="reap_expire",
        event="lease_expired",
        error="lease_expired",
    ),
    "cancel_requested, lease lost within the grace": Case(
        S.CANCEL_REQUESTED,
        cancel_deadline=LATER,
        becomes=S.CANCELLED,
        transition="reap_cancel",
        event="lease_expired",
    ),
    # A cancel wins over the attempt count: the user asked for this run to end.
    "cancel_requested, lease lost, attempts spent": Case(
        S.CANCEL_REQUESTED,
        MAX_ATTEMPTS,
        cancel_deadline=LATER,
        becomes=S.CANCELLED,
        transition="reap_cancel",
        event="lease_expired",
    ),
    "cancel_requested past the grace, lease held": Case(
        S.CANCEL_REQUESTED,
        lease=LATER,
        cancel_deadline=GONE,
        becomes=S.CANCELLED,
        transition="cancel_timeout",
        event="cancel_timeout",
    ),
    "running past its deadline, lease held": Case(
        S.RUNNING,
        lease=LATER,
        deadline=GONE,
        becomes=S.EXPIRED,
        transition="deadline_expire",
        error="deadline_exceeded",
    ),
    "waiting_worker past its deadline, no lease": Case(
        S.WAITING_WORKER,
        lease=None,
        deadline=GONE,
        becomes=S.EXPIRED,
        transition="deadline_expire",
        error="deadline_exceeded",
    ),
    "running, lease held": Case(S.RUNNING, lease=LATER, deadline=LATER),
    "waiting_worker, no lease": Case(S.WAITING_WORKER, lease=None, deadline=LATER),
    "cancel_requested within the grace, lease held": Case(
        S.CANCEL_REQUESTED, lease=LATER, cancel_deadline=LATER
    ),
}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 7, tzinfo=UTC))


@pytest.fixture
async def template(register: Register) -> Template:
    return await register(retryPolicy={"maxAttempts": MAX_ATTEMPTS})


def scheduler(timed: MongoStore, queue: RedisQueue, settings: Settings) -> Scheduler:
    return Scheduler(timed, queue, settings, timed.clock)


async def status_of(store: MongoStore, run_id: str) -> RunStatus:
    run = await store.runs.get(run_id)
    assert run is not None
    return run.status


async def put(store: MongoStore, template: Template, case: Case, shift: float = 0) -> Run:
    """A run in the state `case` describes, its times counted from now + `shift` seconds."""

    def at(seconds: float | None) -> datetime | None:
        return None if seconds is None else store.clock.now() + timedelta(seconds=seconds + shift)

    fields: dict[str, Any] = {
        "attempt": case.attempt,
        "maxAttempts": MAX_ATTEMPTS,
        "lockedUntil": at(case.lease),
        "deadline": at(case.deadline),
        "cancelDeadline": at(case.cancel_deadline),
    }
    run, _ = await run_in(store, template, case.status, **fields)
    # Absent rather than null, as the store leaves them.
    unset = [name for name, value in fields.items() if value is None]
    if case.lease is None:
        unset += ["lockedBy", "leaseToken"]
    if unset:
        await raw(store).runs.update_one(
            {"_id": ObjectId(run.id)}, {"$unset": dict.fromkeys(unset, "")}
        )
    stored = await store.runs.get(run.id)
    assert stored is not None
    return stored


async def test_one_pass_moves_each_run_as_the_table_says(
    timed: MongoStore,
    queue: RedisQueue,
    settings: Settings,
    clock: ManualClock,
    template: Template,
) -> None:
    before = {name: await put(timed, template, case) for name, case in CASES.items()}
    trails = {name: len(await timed.trail.events_of(run.id)) for name, run in before.items()}
    clock.advance(PASS)
    reaper = scheduler(timed, queue, settings)

    moving = [name for name, case in CASES.items() if case.becomes is not None]
    assert await reaper.reap() == len(moving)
    assert await reaper.reap() == 0, "a second pass finds nothing left to do"
    for name, case in CASES.items():
        after = await timed.runs.get(before[name].id)
        assert after is not None
        new = (await timed.trail.events_of(after.id))[trails[name] :]
        if case.becomes is None:
            assert after == before[name], name
            assert new == [], name
            continue
        assert after.status == case.becomes, name
        # The lost lease stays counted: the attempt is not handed back as on a graceful release.
        assert after.attempt == case.attempt, name
        # The lease is gone; an ended run keeps the worker that held it last.
        last = before[name].locked_by if case.becomes in TERMINAL else None
        assert (after.locked_by, after.lease_token, after.locked_until) == (last, None, None), name
        ended = [(a.attempt, a.error.code) for a in after.attempts]
        assert ended == ([(case.attempt, case.error)] if case.error else []), name
        outcome = case.error if case.becomes in TERMINAL else None
        assert (after.error.code if after.error else None) == outcome, name
        moved, *also = new
        assert (moved.type, moved.from_, moved.to) == (
            "status_changed",
            case.status,
            case.becomes,
        ), name
        assert moved.metadata["transition"] == case.transition, name
        assert [e.type for e in also] == ([case.event] if case.event else []), name
        assert {e.actor for e in new} == {"reaper"}, name

    # Exactly the requeued runs are back in Redis, where a worker pops them and its claim
    # counts the next attempt.
    requeued = {before[name].id for name in moving if CASES[name].becomes == S.QUEUED}
    popped = await queue.pop(settings.queues, 100, clock.now(), handlers=registry.offered())
    assert sorted(popped.run_ids) == sorted(requeued)
    claimed = await timed.transitions.claim(popped.run_ids, "w-next", LEASE)
    assert sorted((run.id, run.attempt) for run, _ in claimed) == sorted((i, 2) for i in requeued)


@pytest.mark.parametrize(
    "name",
    [
        "running, lease lost, attempts left",
        "running past its deadline, lease held",
        "cancel_requested past the grace, lease held",
    ],
)
async def test_a_pass_moves_at_most_reap_batch_runs_of_each_kind(
    timed: MongoStore,
    queue: RedisQueue,
    settings: Settings,
    clock: ManualClock,
    template: Template,
    name: str,
) -> None:
    case = CASES[name]
    assert case.becomes is not None
    # One second apart, so the oldest lease is known.
    runs = [await put(timed, template, case, shift=i) for i in range(12)]
    clock.advance(PASS)
    reaper = scheduler(timed, queue, settings.model_copy(update={"reap_batch": 5}))

    done = 0
    for expected in (5, 5, 2, 0):
        assert await reaper.reap() == expected
        done += expected
        moved = {r.id for r in runs if await status_of(timed, r.id) == case.becomes}
        assert len(moved) == done
        if case.transition == "reap_requeue":
            # Expired leases are taken oldest first, so none waits behind newer ones.
            assert moved == {r.id for r in runs[:done]}
    ready = await queue.redis.zcard(queue.keys.queue("default", template.handler_at(0)))
    assert ready == (len(runs) if case.becomes == S.QUEUED else 0)


async def test_a_renewed_lease_is_not_reaped(
    timed: MongoStore,
    queue: RedisQueue,
    settings: Settings,
    clock: ManualClock,
    template: Template,
) -> None:
    alive = await timed.runs.insert(NewRun(template, "user", "u1"), "user:test")
    gone = await timed.runs.insert(NewRun(template, "user", "u1"), "user:test")
    [(_, lease)] = await timed.transitions.claim([alive.id], "w-alive", LEASE)
    await timed.transitions.claim([gone.id], "w-gone", LEASE)
    reaper = scheduler(timed, queue, settings)

    clock.advance(LEASE * 2 / 3)
    held, _ = await timed.leases.heartbeat("w-alive", [lease], LEASE)
    assert held == {alive.id}
    clock.advance(LEASE * 2 / 3)  # past both first leases, within the renewed one
    assert await reaper.reap() == 1
    kept = await timed.runs.get(alive.id)
    assert kept is not None and kept.status == S.RUNNING
    assert (kept.locked_by, kept.lease_token) == ("w-alive", lease.token)
    assert "lease_expired" not in [e.type for e in await timed.trail.events_of(alive.id)]
    lost = await timed.runs.get(gone.id)
    assert lost is not None and lost.status == S.QUEUED

    # Once the renewed lease runs out too, the same run is reaped: only the renewal kept it.
    clock.advance(LEASE)
    assert await reaper.reap() == 1
    assert await status_of(timed, alive.id) == S.QUEUED


async def test_the_templates_timeout_and_cancel_grace_decide_when_runs_end(
    timed: MongoStore,
    queue: RedisQueue,
    settings: Settings,
    clock: ManualClock,
    register: Register,
) -> None:
    template = await register(timeoutSeconds=95, cancelPolicy={"graceSeconds": 35})
    late = await timed.runs.insert(NewRun(template, "user", "u1"), "user:test")
    stubborn = await timed.runs.insert(NewRun(template, "user", "u1"), "user:test")
    leases = [
        lease for _, lease in await timed.transitions.claim([late.id, stubborn.id], "w", LEASE)
    ]
    await RunService(timed, queue).cancel(stubborn.id, "user:test", "stop")
    reaper = scheduler(timed, queue, settings)

    # The worker keeps heartbeating: only the limits can end these runs.
    ended: dict[str, int] = {}
    for elapsed in range(10, 130, 10):
        clock.advance(10)
        await timed.leases.heartbeat("w", leases, LEASE)
        await reaper.reap()
        for run_id in (late.id, stubborn.id):
            if run_id not in ended and await status_of(timed, run_id) in TERMINAL:
                ended[run_id] = elapsed
    assert ended == {stubborn.id: 40, late.id: 100}
    expired = await timed.runs.get(late.id)
    assert expired is not None and expired.status == S.EXPIRED
    assert expired.error is not None and expired.error.code == "deadline_exceeded"
    assert await status_of(timed, stubborn.id) == S.CANCELLED
    types = [e.type for e in await timed.trail.events_of(stubborn.id)]
    assert types[-2:] == ["status_changed", "cancel_timeout"]
