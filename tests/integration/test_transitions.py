"""Every named transition against every status, on the real database.

The table (`model/status.py`) is walked row by row: each row's store method, named as the row,
moves a run from the row's sources only, under the row's guards, and does to the run what the
row says entering its target means.
"""

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import ObjectId

from jobplane.clock import ManualClock
from jobplane.model import (
    TRANSITIONS,
    AttemptChange,
    Guard,
    KeyChange,
    LeaseChange,
    Run,
    RunError,
    RunStatus,
    StartLimits,
    Template,
    Transition,
)
from jobplane.store import Lease, Lost, MongoStore, Moved, NewRun, TransitionStore
from jobplane.store.transitions import MongoTransitionStore
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.runs import TOKEN, WORKER, reap, run_in

ERROR = RunError(code="boom", message="boom", step="only", attempt=1)

# What each row's method is called with, as its callers call it: `run` is the run as its
# caller read it (the reaper's rows decide on it), `lease` the one its worker holds.
Args = Callable[[MongoStore, Run, Lease], tuple[object, ...]]
ARGS: dict[str, Args] = {
    "enqueue": lambda s, r, le: (r.id, "user:t"),
    "claim": lambda s, r, le: ([r.id], "w2", 5),
    "claim_limited": lambda s, r, le: ([limited(r)], "w2", 5, s.clock.now()),
    "wait_worker": lambda s, r, le: (le, 0, "only", "external"),
    "resume": lambda s, r, le: ("external", "x2", 5),
    "wait_children": lambda s, r, le: (le,),
    "children_done": lambda s, r, le: (r, "scheduler", "3/3"),
    "complete": lambda s, r, le: (le, 0, "only", 1, 1),
    "fail": lambda s, r, le: (le, 0, ERROR),
    "retry": lambda s, r, le: (le, 0, ERROR, s.clock.now()),
    "release": lambda s, r, le: (le,),
    "cancel": lambda s, r, le: (r.id, "user:t", "why"),
    "request_cancel": lambda s, r, le: (r.id, "user:t", "why"),
    "acknowledge_cancel": lambda s, r, le: (le, True),
    "reap_requeue": lambda s, r, le: (r, "reaper"),
    "reap_expire": lambda s, r, le: (r, "reaper"),
    "reap_cancel": lambda s, r, le: (r, "reaper"),
    "cancel_timeout": lambda s, r, le: (r, "reaper"),
    "deadline_expire": lambda s, r, le: (r, "reaper"),
}


def limited(run: Run) -> tuple[str, StartLimits]:
    """A run as `claim_limited` takes it: its id and the limits its queue entry carries."""
    return run.id, run.start_limits or StartLimits(run.template_type)


async def call(store: MongoStore, name: str, run: Run, lease: Lease) -> Moved | Lost:
    """The store's method named as the row `name`, its answer as a move of `run` or not."""
    outcome = await getattr(store.transitions, name)(*ARGS[name](store, run, lease))
    if name == "claim":  # the runs it leased
        outcome = outcome[0][0] if outcome else None
    elif name == "claim_limited":  # the runs it leased, and those `maxRunning` held back
        outcome = outcome[0][0][0] if outcome[0] else None
    elif name == "resume":  # the oldest run waiting for the worker type, and its lease
        outcome = outcome[0] if outcome else None
    if isinstance(outcome, Run):
        assert outcome.id == run.id
        return Moved(run.id, run.status, outcome.status)
    return Lost(run.id, "status", run.status) if outcome is None else outcome


async def ready(
    store: MongoStore, template: Template, status: RunStatus, **fields: Any
) -> tuple[Run, Lease]:
    """A run in `status` on which every guard of every row holds (its lease ran out, its
    deadline and cancel grace passed, it waits for an `external` worker), but for `fields`."""
    past = store.clock.now() - timedelta(seconds=1)
    holds = {"deadline": past, "cancelDeadline": past, "externalType": "external"}
    holds |= {"dedupeKey": f"key-{status}", **fields}
    return await run_in(store, template, status, **holds)


def test_each_row_has_its_method() -> None:
    assert set(ARGS) == set(TRANSITIONS)
    for name in TRANSITIONS:
        assert callable(getattr(MongoTransitionStore, name, None)), name
        assert callable(getattr(TransitionStore, name, None)), name


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
async def test_each_transition_moves_only_from_its_sources(
    store: MongoStore, register: Register, name: str
) -> None:
    template = await register()
    t = TRANSITIONS[name]
    for status in RunStatus:
        run, lease = await ready(store, template, status)
        outcome = await call(store, name, run, lease)
        after = await store.runs.get(run.id)
        assert after is not None
        events = await store.trail.events_of(run.id)
        changes = [e for e in events if e.type == "status_changed"]
        if status in t.sources:
            assert outcome == Moved(run.id, status, t.target), (name, status)
            assert after.status == t.target
            assert after.version == run.version + 1
            assert [(e.from_, e.to) for e in changes] == [(status, t.target)]
            assert changes[0].metadata["transition"] == name
            entered(t, run, after)
        else:
            assert outcome == Lost(run.id, "status", status), (name, status)
            assert after == run, "a refused transition must not write anything"
            assert changes == []


def entered(t: Transition, before: Run, after: Run) -> None:
    """`after` is what the row says entering its target makes of `before`."""
    lease = (after.locked_by, after.lease_token, after.locked_until)
    match t.lease:
        case LeaseChange.GRANT:
            assert after.locked_by in ("w2", "x2") and after.lease_token != before.lease_token
            assert after.locked_until is not None and after.heartbeat_at is not None
            assert after.locked_until > after.heartbeat_at
        case LeaseChange.KEEP:
            assert lease == (before.locked_by, before.lease_token, before.locked_until)
        case LeaseChange.DROP:
            assert lease == (None, None, None)
        case LeaseChange.END:
            # An ended run keeps the worker that held it last (docs/contract.md).
            assert lease == (before.locked_by, None, None)
    # `complete` is called for a repeatable template's run, which lets go of its key.
    kept = before.dedupe_key if t.key is KeyChange.KEEP else None
    assert after.dedupe_key == kept, t.name
    assert (after.completed_at is not None) == t.ends, t.name
    counted = {AttemptChange.START: 1, AttemptChange.HAND_BACK: -1}.get(t.attempt, 0)
    assert after.attempt == before.attempt + counted, t.name
    ended = int(t.attempt is AttemptChange.FAIL)
    assert len(after.attempts) == len(before.attempts) + ended, t.name
    assert after.error is not None if ended and t.ends else after.error is None, t.name


# What makes each guard fail on a run in a source status of its row. `LEASE` fails for a
# superseded lease (below), `AS_READ` for a run that changed since its reader saw it.
FUTURE = datetime(2100, 1, 1, tzinfo=UTC)
REFUSED: dict[Guard, dict[str, Any]] = {
    Guard.NOT_WAITING: {"dedupeWait": "k"},
    Guard.UNLIMITED: {"maxRunning": 5},
    Guard.DUE: {"notBefore": FUTURE},
    Guard.EXTERNAL_TYPE: {"externalType": "gpu"},
    Guard.AS_READ: {},
    Guard.LEASE_EXPIRED: {"lockedUntil": FUTURE},
    Guard.DEADLINE_PASSED: {"deadline": FUTURE},
    Guard.GRACE_PASSED: {"cancelDeadline": FUTURE},
}


@pytest.mark.parametrize(
    ("name", "guard"),
    sorted((t.name, g) for t in TRANSITIONS.values() for g in t.guards if g is not Guard.LEASE),
)
async def test_a_transition_moves_no_run_its_guard_refuses(
    store: MongoStore, register: Register, name: str, guard: Guard
) -> None:
    template = await register()
    source = sorted(TRANSITIONS[name].sources)[0]
    run, lease = await ready(store, template, source, **REFUSED[guard])
    # A run read before another write gave it a new lease.
    read = run.model_copy(update={"lease_token": "older"}) if guard is Guard.AS_READ else run
    assert isinstance(await call(store, name, read, lease), Lost), (name, guard)
    assert await store.runs.get(run.id) == run


@pytest.mark.parametrize("name", sorted(n for n, t in TRANSITIONS.items() if t.fenced))
async def test_fenced_transitions_reject_a_superseded_lease(
    store: MongoStore, register: Register, name: str
) -> None:
    template = await register()
    source = sorted(TRANSITIONS[name].sources)[0]
    run, _ = await ready(store, template, source)
    zombie = Lease(run.id, WORKER, "older-token")
    outcome = await call(store, name, run, zombie)
    assert outcome == Lost(run.id, "lease", source)
    assert await store.runs.get(run.id) == run
    events = await store.trail.events_of(run.id)
    assert [e.type for e in events][-1] == "stale_write_rejected"
    assert events[-1].metadata["write"] == name


@pytest.mark.parametrize("name", sorted(n for n, t in TRANSITIONS.items() if not t.fenced))
async def test_unfenced_transitions_that_lose_record_no_stale_write(
    store: MongoStore, register: Register, name: str
) -> None:
    # An external worker's `resume` makes the lease it would get; losing that race is not the
    # write of a superseded lease (the stateful test found such events in the trail).
    template = await register()
    run, _ = await ready(store, template, RunStatus.SUCCEEDED)
    stranger = Lease(run.id, "x1", "never-granted")
    outcome = await call(store, name, run, stranger)
    assert outcome == Lost(run.id, "status", RunStatus.SUCCEEDED)
    assert "stale_write_rejected" not in [e.type for e in await store.trail.events_of(run.id)]


async def test_enqueue_leaves_a_run_waiting_for_its_key_pending(
    store: MongoStore, register: Register
) -> None:
    # Queued, a waiting run could never be claimed nor take its key (both want it pending).
    template = await register()
    waiting = await store.runs.insert(NewRun(template, "user", "u1", dedupe_wait="k"), "user:a")
    assert await store.transitions.enqueue(waiting.id, "user:a") == Lost(
        waiting.id, "status", RunStatus.PENDING
    )
    assert await store.runs.get(waiting.id) == waiting
    assert isinstance(await store.runs.take_key(waiting, "scheduler"), Moved)
    assert await store.transitions.enqueue(waiting.id, "user:a") == Moved(
        waiting.id, RunStatus.PENDING, RunStatus.QUEUED
    )


async def test_reap_does_not_overrule_a_cancel_asked_after_its_read(
    store: MongoStore, register: Register
) -> None:
    # The reaper read a run whose lease expired with no attempt left (→ expired); a cancel
    # asked before its write must win, as it does when asked before the read.
    template = await register()
    run, _ = await run_in(store, template, RunStatus.RUNNING, attempt=1, maxAttempts=1)
    [seen] = [r for r in await store.maintenance.expired_leases(100) if r.id == run.id]
    asked = await store.transitions.request_cancel(run.id, "user:a", "stop")
    assert asked == Moved(run.id, RunStatus.RUNNING, RunStatus.CANCEL_REQUESTED)
    assert await reap(store, seen) == Lost(run.id, "status", RunStatus.CANCEL_REQUESTED)
    [again] = [r for r in await store.maintenance.expired_leases(100) if r.id == run.id]
    assert await reap(store, again) == Moved(
        run.id, RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED
    )


async def test_unknown_and_malformed_ids_are_missing(store: MongoStore) -> None:
    assert await store.transitions.cancel("not-an-id", "user:x", None) == Lost(
        "not-an-id", "missing"
    )
    ghost = "0123456789abcdef01234567"
    assert await store.transitions.cancel(ghost, "user:x", None) == Lost(ghost, "missing")


async def test_claim_takes_only_claimable_runs(store: MongoStore, register: Register) -> None:
    template = await register()
    runs = {s: (await run_in(store, template, s, notBefore=None))[0] for s in RunStatus}
    claimed = await store.transitions.claim([r.id for r in runs.values()], "w2", 5)
    assert {run.id for run, _ in claimed} == {runs[RunStatus.PENDING].id, runs[RunStatus.QUEUED].id}
    for run, lease in claimed:
        assert run.status == RunStatus.RUNNING
        assert run.locked_by == "w2" and run.lease_token == lease.token
        assert run.attempt == 2  # run_in starts at attempt 1; a claim counts one more
        events = await store.trail.events_of(run.id)
        assert events[-1].to == RunStatus.RUNNING
        assert (
            events[-1].from_
            == runs[
                RunStatus.PENDING if run.id == runs[RunStatus.PENDING].id else RunStatus.QUEUED
            ].status
        )
    for status in set(RunStatus) - {RunStatus.PENDING, RunStatus.QUEUED}:
        assert await store.runs.get(runs[status].id) == runs[status]


async def test_claim_respects_not_before(store: MongoStore, register: Register) -> None:
    from datetime import timedelta

    template = await register()
    later = store.clock.now() + timedelta(hours=1)
    run, _ = await run_in(store, template, RunStatus.QUEUED, notBefore=later)
    assert await store.transitions.claim([run.id], "w2", 5) == []


async def test_reap_picks_the_transition_for_the_run(store: MongoStore, register: Register) -> None:
    template = await register()
    retryable, _ = await run_in(store, template, RunStatus.RUNNING, attempt=1, maxAttempts=3)
    spent, _ = await run_in(store, template, RunStatus.RUNNING, attempt=3, maxAttempts=3)
    cancelling, _ = await run_in(store, template, RunStatus.CANCEL_REQUESTED)
    expired = {r.id for r in await store.maintenance.expired_leases(100)}
    assert {retryable.id, spent.id, cancelling.id} <= expired
    assert await reap(store, retryable) == Moved(retryable.id, RunStatus.RUNNING, RunStatus.QUEUED)
    assert await reap(store, spent) == Moved(spent.id, RunStatus.RUNNING, RunStatus.EXPIRED)
    assert await reap(store, cancelling) == Moved(
        cancelling.id, RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED
    )
    for run in (retryable, spent, cancelling):
        types = [e.type for e in await store.trail.events_of(run.id)]
        assert types[-2:] == ["status_changed", "lease_expired"]
    requeued = await store.runs.get(retryable.id)
    assert requeued is not None and requeued.lease_token is None and requeued.attempt == 1


async def test_reap_loses_to_a_renewed_lease(store: MongoStore, register: Register) -> None:
    template = await register()
    run, lease = await run_in(store, template, RunStatus.RUNNING)
    held, _ = await store.leases.heartbeat(WORKER, [lease], 30)
    assert held == {run.id}
    assert await reap(store, run) == Lost(run.id, "status", RunStatus.RUNNING)
    assert TOKEN == (await store.runs.get(run.id)).lease_token  # type: ignore[union-attr]


async def test_external_claims_resume_only_waiting_runs_of_their_type(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    runs = {s: (await run_in(store, template, s))[0] for s in RunStatus}
    waiting = runs[RunStatus.WAITING_WORKER]
    await raw(store).runs.update_one(
        {"_id": ObjectId(waiting.id)},
        {"$set": {"externalType": "external"}, "$unset": {"lockedBy": "", "leaseToken": ""}},
    )
    assert await store.transitions.resume("gpu", "x", 5) is None
    # Two external workers at once: one gets the run, the other nothing.
    outcomes = await asyncio.gather(
        *(store.transitions.resume("external", f"x{i}", 5) for i in range(4))
    )
    won = [o for o in outcomes if o is not None]
    assert len(won) == 1
    run, lease = won[0]
    assert run.id == waiting.id and run.status == RunStatus.RUNNING
    assert (run.locked_by, run.lease_token) == (lease.worker_id, lease.token)
    assert run.external_type is None and run.attempt == waiting.attempt
    [resumed] = [e for e in await store.trail.events_of(run.id) if e.type == "status_changed"]
    assert (resumed.from_, resumed.to, resumed.actor) == (
        RunStatus.WAITING_WORKER,
        RunStatus.RUNNING,
        f"worker:{lease.worker_id}",
    )
    for status, other in runs.items():
        if status != RunStatus.WAITING_WORKER:
            assert await store.runs.get(other.id) == other
    # The claims that lost were never granted the run: none of them is a stale write.
    assert all(e.type != "stale_write_rejected" for e in await store.trail.events_of(run.id))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 7, tzinfo=UTC))


async def read(store: MongoStore, run_id: str) -> Run:
    run = await store.runs.get(run_id)
    assert run is not None
    return run


async def test_a_retried_run_that_succeeds_has_no_error_and_keeps_its_attempts(
    timed: MongoStore, clock: ManualClock, register: Register
) -> None:
    template = await register(retryPolicy={"maxAttempts": 3})
    run = await timed.runs.insert(NewRun(template, "user", "u1"), "user:a")
    began = clock.now()
    [(_, lease)] = await timed.transitions.claim([run.id], "w1", 30)
    # A shutdown hands the attempt back; the claim that goes on with it keeps its start.
    clock.advance(5)
    assert isinstance(await timed.transitions.release(lease), Moved)
    [(_, lease)] = await timed.transitions.claim([run.id], "w1", 30)
    clock.advance(2)
    failed = clock.now()
    boom = RunError(code="boom", message="first try", step="only")
    assert isinstance(await timed.transitions.retry(lease, 0, boom, clock.now()), Moved)

    waiting = await read(timed, run.id)
    assert waiting.status == RunStatus.QUEUED
    assert waiting.error is None, "no outcome yet"
    assert waiting.attempt_started_at is None
    [first] = waiting.attempts
    assert (first.attempt, first.started_at, first.ended_at) == (1, began, failed)
    assert first.error == boom.model_copy(update={"attempt": 1})

    clock.advance(3)
    [(claimed, lease)] = await timed.transitions.claim([run.id], "w1", 30)
    assert (claimed.attempt, claimed.attempt_started_at) == (2, clock.now())
    assert isinstance(await timed.transitions.complete(lease, 0, "only", 1, 1), Moved)
    done = await read(timed, run.id)
    assert done.status == RunStatus.SUCCEEDED and done.error is None
    assert done.attempts == [first]
    assert done.attempt_started_at == claimed.attempt_started_at
    # The trail keeps the first attempt's error too.
    events = await timed.trail.events_of(run.id)
    retried = [e for e in events if e.metadata.get("transition") == "retry"]
    assert [e.message for e in retried] == ["first try"]


async def test_a_run_that_fails_for_good_has_the_last_error_and_every_attempt(
    timed: MongoStore, clock: ManualClock, register: Register
) -> None:
    template = await register(retryPolicy={"maxAttempts": 2})
    run = await timed.runs.insert(NewRun(template, "user", "u1"), "user:a")
    errors = [RunError(code=f"e{n}", message=f"try {n}", step="only") for n in (1, 2)]
    for n, error in enumerate(errors, 1):
        [(_, lease)] = await timed.transitions.claim([run.id], "w1", 30)
        clock.advance(1)
        if n < len(errors):
            assert isinstance(await timed.transitions.retry(lease, 0, error, clock.now()), Moved)
        else:
            assert isinstance(await timed.transitions.fail(lease, 0, error), Moved)
    failed = await read(timed, run.id)
    assert failed.status == RunStatus.FAILED
    assert [(a.attempt, a.error.code, a.error.attempt) for a in failed.attempts] == [
        (1, "e1", 1),
        (2, "e2", 2),
    ]
    assert failed.error == failed.attempts[-1].error
    assert failed.attempt_started_at == failed.attempts[-1].started_at


async def test_an_expiry_records_the_attempt_it_ended_not_the_one_read(
    timed: MongoStore, clock: ManualClock, register: Register
) -> None:
    # The reaper read the run during attempt 1; by its write a retry and a claim began
    # attempt 2. The write is exact on the run's version, so it records the attempt it ends.
    template = await register(retryPolicy={"maxAttempts": 3}, timeoutSeconds=10)
    run = await timed.runs.insert(NewRun(template, "user", "u1"), "user:a")
    [(_, lease)] = await timed.transitions.claim([run.id], "w1", 30)
    clock.advance(11)
    [seen] = (await timed.maintenance.overdue(10))[0]
    boom = RunError(code="boom", message="boom", step="only")
    assert isinstance(await timed.transitions.retry(lease, 0, boom, clock.now()), Moved)
    [(claimed, _)] = await timed.transitions.claim([run.id], "w1", 30)
    assert seen.attempt == 1 and claimed.attempt == 2
    assert isinstance(await timed.transitions.deadline_expire(seen, "reaper"), Moved)
    expired = await read(timed, run.id)
    assert [(a.attempt, a.error.code) for a in expired.attempts] == [
        (1, "boom"),
        (2, "deadline_exceeded"),
    ]
    assert expired.error is not None and expired.error.attempt == 2


async def test_concurrent_claims_under_max_running_start_no_more_than_it(
    store: MongoStore, register: Register
) -> None:
    """Twelve workers claim at once from thirty runs of a template capped at three: the
    template's gate admits three, whatever the race, and three start."""
    template = await register("capped", maxRunning=3)
    runs = [await store.runs.insert(NewRun(template, "user", f"u{i}"), "u") for i in range(30)]
    now = store.clock.now()
    started = await asyncio.gather(
        *(
            store.transitions.claim_limited(list(map(limited, runs[i::12])), f"w{i}", 30, now)
            for i in range(12)
        )
    )
    claimed = [run for leased, _ in started for run, _ in leased]
    held = [run_id for _, over in started for run_id in over]
    assert len(claimed) == 3 and len(held) == 27
    assert {r.status for r in claimed} == {RunStatus.RUNNING}
    assert {r.id for r in claimed} | set(held) == {r.id for r in runs}
    # An ended run makes room for one more.
    first, lease = claimed[0], next(le for leased, _ in started for r, le in leased)
    assert first.id == lease.run_id
    assert isinstance(await store.transitions.complete(lease, 0, "only", 1, 1), Moved)
    waiting = [limited(r) for r in runs if r.id in held[:2]]
    [more], still = await store.transitions.claim_limited(waiting, "w", 30, store.clock.now())
    assert len(still) == 1 and more[0].id == waiting[0][0]
