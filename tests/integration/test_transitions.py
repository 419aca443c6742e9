"""Every named transition against every status, on the real database."""

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest
from bson import ObjectId

from jobplane.clock import ManualClock
from jobplane.model import TRANSITIONS, Run, RunError, RunStatus
from jobplane.store import Lease, Lost, MongoStore, Moved, NewRun
from tests.integration.conftest import Register
from tests.integration.runs import TOKEN, WORKER, run_in


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
async def test_each_transition_moves_only_from_its_sources(
    store: MongoStore, register: Register, name: str
) -> None:
    template = await register()
    t = TRANSITIONS[name]
    for status in RunStatus:
        run, lease = await run_in(store, template, status)
        outcome = await store._transition(name, run.id, "test", lease=lease)
        after = await store.get_run(run.id)
        assert after is not None
        events = await store.events_of(run.id)
        changes = [e for e in events if e.type == "status_changed"]
        if status in t.sources:
            assert outcome == Moved(run.id, status, t.target), (name, status)
            assert after.status == t.target
            assert after.version == run.version + 1
            assert [(e.from_, e.to) for e in changes] == [(status, t.target)]
            assert changes[0].metadata["transition"] == name
        else:
            assert outcome == Lost(run.id, "status", status), (name, status)
            assert after == run, "a refused transition must not write anything"
            assert changes == []


@pytest.mark.parametrize("name", sorted(n for n, t in TRANSITIONS.items() if t.fenced))
async def test_fenced_transitions_reject_a_superseded_lease(
    store: MongoStore, register: Register, name: str
) -> None:
    template = await register()
    source = sorted(TRANSITIONS[name].sources)[0]
    run, _ = await run_in(store, template, source)
    zombie = Lease(run.id, WORKER, "older-token")
    outcome = await store._transition(name, run.id, "test", lease=zombie)
    assert outcome == Lost(run.id, "lease", source)
    assert await store.get_run(run.id) == run
    events = await store.events_of(run.id)
    assert [e.type for e in events][-1] == "stale_write_rejected"
    assert events[-1].metadata["write"] == name


@pytest.mark.parametrize("name", sorted(n for n, t in TRANSITIONS.items() if not t.fenced))
async def test_unfenced_transitions_that_lose_record_no_stale_write(
    store: MongoStore, register: Register, name: str
) -> None:
    # An external worker offers the lease it would get to `resume`; losing that race is not
    # the write of a superseded lease (the stateful test found such events in the trail).
    template = await register()
    run, _ = await run_in(store, template, RunStatus.SUCCEEDED)
    stranger = Lease(run.id, "x1", "never-granted")
    outcome = await store._transition(name, run.id, "test", lease=stranger)
    assert outcome == Lost(run.id, "status", RunStatus.SUCCEEDED)
    assert "stale_write_rejected" not in [e.type for e in await store.events_of(run.id)]


async def test_enqueue_leaves_a_run_waiting_for_its_key_pending(
    store: MongoStore, register: Register
) -> None:
    # Queued, a waiting run could never be claimed nor take its key (both want it pending).
    template = await register()
    waiting = await store.insert_run(NewRun(template, "user", "u1", dedupe_wait="k"), "user:a")
    assert await store.enqueue(waiting.id, "user:a") == Lost(
        waiting.id, "status", RunStatus.PENDING
    )
    assert await store.get_run(waiting.id) == waiting
    assert isinstance(await store.take_key(waiting, "scheduler"), Moved)
    assert await store.enqueue(waiting.id, "user:a") == Moved(
        waiting.id, RunStatus.PENDING, RunStatus.QUEUED
    )


async def test_reap_does_not_overrule_a_cancel_asked_after_its_read(
    store: MongoStore, register: Register
) -> None:
    # The reaper read a run whose lease expired with no attempt left (→ expired); a cancel
    # asked before its write must win, as it does when asked before the read.
    template = await register()
    run, _ = await run_in(store, template, RunStatus.RUNNING, attempt=1, maxAttempts=1)
    [seen] = [r for r in await store.expired_leases(100) if r.id == run.id]
    asked = await store.request_cancel(run.id, "user:a", "stop")
    assert asked == Moved(run.id, RunStatus.RUNNING, RunStatus.CANCEL_REQUESTED)
    assert await store.reap(seen) == Lost(run.id, "status", RunStatus.CANCEL_REQUESTED)
    [again] = [r for r in await store.expired_leases(100) if r.id == run.id]
    assert await store.reap(again) == Moved(run.id, RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED)


async def test_unknown_and_malformed_ids_are_missing(store: MongoStore) -> None:
    assert await store.cancel("not-an-id", "user:x", None) == Lost("not-an-id", "missing")
    ghost = "0123456789abcdef01234567"
    assert await store.cancel(ghost, "user:x", None) == Lost(ghost, "missing")


Op = Callable[[MongoStore, str, Lease], Awaitable[object]]
ERROR = RunError(code="boom", message="boom", step="only", attempt=1)

# The public methods, each with the transition it performs.
OPS: dict[str, tuple[str, Op]] = {
    "enqueue": ("enqueue", lambda s, i, le: s.enqueue(i, "user:t")),
    "cancel": ("cancel", lambda s, i, le: s.cancel(i, "user:t", "why")),
    "request_cancel": ("request_cancel", lambda s, i, le: s.request_cancel(i, "user:t", "why")),
    "complete": ("complete", lambda s, i, le: s.complete(le, 0, "only", 1, 1)),
    "fail": ("fail", lambda s, i, le: s.fail(le, 0, ERROR)),
    "retry": ("retry", lambda s, i, le: s.retry(le, 0, ERROR, s.clock.now())),
    "release": ("release", lambda s, i, le: s.release(le)),
    "acknowledge_cancel": ("acknowledge_cancel", lambda s, i, le: s.acknowledge_cancel(le, True)),
    "wait_worker": ("wait_worker", lambda s, i, le: s.wait_worker(le, 0, "only", "external")),
}


@pytest.mark.parametrize("op", sorted(OPS))
async def test_public_methods_follow_the_table(
    store: MongoStore, register: Register, op: str
) -> None:
    template = await register()
    name, call = OPS[op]
    for status in RunStatus:
        run, lease = await run_in(store, template, status)
        outcome = await call(store, run.id, lease)
        after = await store.get_run(run.id)
        assert after is not None
        if status in TRANSITIONS[name].sources:
            assert isinstance(outcome, Moved), (op, status, outcome)
            assert after.status == TRANSITIONS[name].target
        else:
            assert isinstance(outcome, Lost), (op, status)
            assert after == run


async def test_claim_takes_only_claimable_runs(store: MongoStore, register: Register) -> None:
    template = await register()
    runs = {s: (await run_in(store, template, s, notBefore=None))[0] for s in RunStatus}
    claimed = await store.claim([r.id for r in runs.values()], "w2", 5)
    assert {run.id for run, _ in claimed} == {runs[RunStatus.PENDING].id, runs[RunStatus.QUEUED].id}
    for run, lease in claimed:
        assert run.status == RunStatus.RUNNING
        assert run.locked_by == "w2" and run.lease_token == lease.token
        assert run.attempt == 2  # run_in starts at attempt 1; a claim counts one more
        events = await store.events_of(run.id)
        assert events[-1].to == RunStatus.RUNNING
        assert (
            events[-1].from_
            == runs[
                RunStatus.PENDING if run.id == runs[RunStatus.PENDING].id else RunStatus.QUEUED
            ].status
        )
    for status in set(RunStatus) - {RunStatus.PENDING, RunStatus.QUEUED}:
        assert await store.get_run(runs[status].id) == runs[status]


async def test_claim_respects_not_before(store: MongoStore, register: Register) -> None:
    from datetime import timedelta

    template = await register()
    later = store.clock.now() + timedelta(hours=1)
    run, _ = await run_in(store, template, RunStatus.QUEUED, notBefore=later)
    assert await store.claim([run.id], "w2", 5) == []


async def test_reap_picks_the_transition_for_the_run(store: MongoStore, register: Register) -> None:
    template = await register()
    retryable, _ = await run_in(store, template, RunStatus.RUNNING, attempt=1, maxAttempts=3)
    spent, _ = await run_in(store, template, RunStatus.RUNNING, attempt=3, maxAttempts=3)
    cancelling, _ = await run_in(store, template, RunStatus.CANCEL_REQUESTED)
    expired = {r.id for r in await store.expired_leases(100)}
    assert {retryable.id, spent.id, cancelling.id} <= expired
    assert await store.reap(retryable) == Moved(retryable.id, RunStatus.RUNNING, RunStatus.QUEUED)
    assert await store.reap(spent) == Moved(spent.id, RunStatus.RUNNING, RunStatus.EXPIRED)
    assert await store.reap(cancelling) == Moved(
        cancelling.id, RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED
    )
    for run in (retryable, spent, cancelling):
        types = [e.type for e in await store.events_of(run.id)]
        assert types[-2:] == ["status_changed", "lease_expired"]
    requeued = await store.get_run(retryable.id)
    assert requeued is not None and requeued.lease_token is None and requeued.attempt == 1


async def test_reap_loses_to_a_renewed_lease(store: MongoStore, register: Register) -> None:
    template = await register()
    run, lease = await run_in(store, template, RunStatus.RUNNING)
    held, _ = await store.heartbeat(WORKER, [lease], 30)
    assert held == {run.id}
    assert await store.reap(run) == Lost(run.id, "status", RunStatus.RUNNING)
    assert TOKEN == (await store.get_run(run.id)).lease_token  # type: ignore[union-attr]


async def test_external_claims_resume_only_waiting_runs_of_their_type(
    store: MongoStore, register: Register
) -> None:
    template = await register()
    runs = {s: (await run_in(store, template, s))[0] for s in RunStatus}
    waiting = runs[RunStatus.WAITING_WORKER]
    await store.runs.update_one(
        {"_id": ObjectId(waiting.id)},
        {"$set": {"externalType": "external"}, "$unset": {"lockedBy": "", "leaseToken": ""}},
    )
    assert await store.claim_external("gpu", "x", 5) is None
    # Two external workers at once: one gets the run, the other nothing.
    outcomes = await asyncio.gather(
        *(store.claim_external("external", f"x{i}", 5) for i in range(4))
    )
    won = [o for o in outcomes if o is not None]
    assert len(won) == 1
    run, lease = won[0]
    assert run.id == waiting.id and run.status == RunStatus.RUNNING
    assert (run.locked_by, run.lease_token) == (lease.worker_id, lease.token)
    assert run.external_type is None and run.attempt == waiting.attempt
    [resumed] = [e for e in await store.events_of(run.id) if e.type == "status_changed"]
    assert (resumed.from_, resumed.to, resumed.actor) == (
        RunStatus.WAITING_WORKER,
        RunStatus.RUNNING,
        f"worker:{lease.worker_id}",
    )
    for status, other in runs.items():
        if status != RunStatus.WAITING_WORKER:
            assert await store.get_run(other.id) == other
    # The claims that lost were never granted the run: none of them is a stale write.
    assert all(e.type != "stale_write_rejected" for e in await store.events_of(run.id))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 7, tzinfo=UTC))


async def read(store: MongoStore, run_id: str) -> Run:
    run = await store.get_run(run_id)
    assert run is not None
    return run


async def test_a_retried_run_that_succeeds_has_no_error_and_keeps_its_attempts(
    timed: MongoStore, clock: ManualClock, register: Register
) -> None:
    template = await register(retryPolicy={"maxAttempts": 3})
    run = await timed.insert_run(NewRun(template, "user", "u1"), "user:a")
    began = clock.now()
    [(_, lease)] = await timed.claim([run.id], "w1", 30)
    # A shutdown hands the attempt back; the claim that goes on with it keeps its start.
    clock.advance(5)
    assert isinstance(await timed.release(lease), Moved)
    [(_, lease)] = await timed.claim([run.id], "w1", 30)
    clock.advance(2)
    failed = clock.now()
    boom = RunError(code="boom", message="first try", step="only")
    assert isinstance(await timed.retry(lease, 0, boom, clock.now()), Moved)

    waiting = await read(timed, run.id)
    assert waiting.status == RunStatus.QUEUED
    assert waiting.error is None, "no outcome yet"
    assert waiting.attempt_started_at is None
    [first] = waiting.attempts
    assert (first.attempt, first.started_at, first.ended_at) == (1, began, failed)
    assert first.error == boom.model_copy(update={"attempt": 1})

    clock.advance(3)
    [(claimed, lease)] = await timed.claim([run.id], "w1", 30)
    assert (claimed.attempt, claimed.attempt_started_at) == (2, clock.now())
    assert isinstance(await timed.complete(lease, 0, "only", 1, 1), Moved)
    done = await read(timed, run.id)
    assert done.status == RunStatus.SUCCEEDED and done.error is None
    assert done.attempts == [first]
    assert done.attempt_started_at == claimed.attempt_started_at
    # The trail keeps the first attempt's error too.
    events = await timed.events_of(run.id)
    retried = [e for e in events if e.metadata.get("transition") == "retry"]
    assert [e.message for e in retried] == ["first try"]


async def test_a_run_that_fails_for_good_has_the_last_error_and_every_attempt(
    timed: MongoStore, clock: ManualClock, register: Register
) -> None:
    template = await register(retryPolicy={"maxAttempts": 2})
    run = await timed.insert_run(NewRun(template, "user", "u1"), "user:a")
    errors = [RunError(code=f"e{n}", message=f"try {n}", step="only") for n in (1, 2)]
    for n, error in enumerate(errors, 1):
        [(_, lease)] = await timed.claim([run.id], "w1", 30)
        clock.advance(1)
        if n < len(errors):
            assert isinstance(await timed.retry(lease, 0, error, clock.now()), Moved)
        else:
            assert isinstance(await timed.fail(lease, 0, error), Moved)
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
    run = await timed.insert_run(NewRun(template, "user", "u1"), "user:a")
    [(_, lease)] = await timed.claim([run.id], "w1", 30)
    clock.advance(11)
    [seen] = (await timed.overdue(10))[0]
    boom = RunError(code="boom", message="boom", step="only")
    assert isinstance(await timed.retry(lease, 0, boom, clock.now()), Moved)
    [(claimed, _)] = await timed.claim([run.id], "w1", 30)
    assert seen.attempt == 1 and claimed.attempt == 2
    assert isinstance(await timed.expire_deadline(seen, "reaper"), Moved)
    expired = await read(timed, run.id)
    assert [(a.attempt, a.error.code) for a in expired.attempts] == [
        (1, "boom"),
        (2, "deadline_exceeded"),
    ]
    assert expired.error is not None and expired.error.attempt == 2
