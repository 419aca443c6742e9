"""Locks steps hold and handlers take: owner-checked in Redis, renewed with the heartbeat,
let go at the step's end, freed within a lease length of a holder's death, and fenced by
tokens that keep growing across a Redis wipe."""

import asyncio
import itertools
import signal
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jobplane.backends import Backends
from jobplane.groupcommit import GroupCommit
from jobplane.model import RunStatus, StartLimits, StepStatus
from jobplane.queue.entry import QueueEntry, run_of
from jobplane.queue.locks import Blocked, Taken
from jobplane.queue.pop import Popped
from jobplane.runs import RunRequest, RunService
from jobplane.runs.admission.locks import Locks
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings
from jobplane.worker.handlers import registry
from jobplane.worker.worker import Worker
from tests.conftest import sync_redis
from tests.integration import lock_handlers  # noqa: F401 (its handlers, for workers in here)
from tests.integration.conftest import Register
from tests.integration.flow import until, workers
from tests.integration.processes import spawn, terminate
from tests.integration.workers import running, settled

HANDLERS = "tests.integration.lock_handlers"
SHARED = [{"name": "partner-api", "key": ["payload.partner"]}]


def holding(handler: str = "locks.hold", locks: list[Any] = SHARED) -> list[dict[str, Any]]:
    return [{"id": "call", "handler": handler, "locks": locks}]


async def test_locks_are_owner_checked_all_or_none_and_fenced(
    backends: Backends, settings: Settings
) -> None:
    locks = Locks(backends.store, backends.queue, ttl_seconds=5)
    a = await locks.take(["l1", "l2"], "run-a:lease")
    assert isinstance(a, Taken) and a.tokens["l1"] < a.tokens["l2"]
    # Another owner gets none of them, not even the free one: all or none.
    b = await locks.take(["l3", "l2"], "run-b:lease")
    assert b == Blocked("l2", "run-a:lease")
    assert isinstance(await locks.take(["l3"], "run-c:lease"), Taken), "l3 stayed free"
    # The owner takes them again at no cost, under the same tokens.
    assert await locks.take(["l2", "l1"], "run-a:lease") == a
    # Only the owner renews or lets go.
    assert await locks.renew(["l1"], "run-b:lease") == {"l1"}
    assert await locks.renew(["l1", "l2"], "run-a:lease") == set()
    await locks.release(["l1", "l2"], "run-b:lease", backends.store.clock.now())
    assert isinstance(await locks.take(["l1"], "run-b:lease"), Blocked)
    await locks.release(["l1", "l2"], "run-a:lease", backends.store.clock.now())
    again = await locks.take(["l1"], "run-b:lease")
    assert isinstance(again, Taken) and again.tokens["l1"] > a.tokens["l2"]


async def test_tokens_keep_growing_across_a_redis_wipe(
    backends: Backends, settings: Settings
) -> None:
    locks = Locks(backends.store, backends.queue, ttl_seconds=5)
    before = await locks.take(["partner"], "run-a:lease")
    assert isinstance(before, Taken)
    with sync_redis(settings.redis_url or "") as redis:
        redis.flushall()
    after = await locks.take(["partner"], "run-b:lease")
    assert isinstance(after, Taken), "the wipe lost the lock"
    assert after.tokens["partner"] > before.tokens["partner"]


async def test_two_templates_sharing_a_lock_never_hold_it_at_once(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Runs of two templates naming one lock, on two worker processes: no two of their
    steps' spans overlap, each grant's token is greater than the one before, a run that
    found the lock held says so, and every run succeeds without spending an attempt."""
    await register("sync_in", steps=holding())
    await register("sync_out", steps=holding("locks.take", []))
    service = RunService(backends.store, backends.queue)
    ids = []
    for i in range(8):
        for kind in ("sync_in", "sync_out"):
            payload = {"partner": "acme", "seconds": 0.15, "n": i}
            ids.append((await service.create(RunRequest(kind, "user", "u", payload), "t"))[0].id)
    other = RunRequest("sync_in", "user", "u", {"partner": "globex", "seconds": 0.15})
    free = (await service.create(other, "t"))[0].id
    async with workers(settings, tmp_path, JOBPLANE_HANDLERS=HANDLERS):
        runs = await settled(backends.store, [*ids, free], within=120)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert {r.attempt for r in runs} == {1}
    # When each run held the lock: its step's span (a step's lock), or the span its handler
    # held it for (`ctx.lock`, taken inside the step).
    held = sorted(
        (
            r.outputs["call"].get("began") or r.progress.steps[0].started_at.timestamp(),  # type: ignore[union-attr]
            r.outputs["call"].get("ended") or r.progress.steps[0].completed_at.timestamp(),  # type: ignore[union-attr]
            r.outputs["call"]["token"],
        )
        for r in runs[:-1]
    )
    for (_, ended, _), (began, _, _) in itertools.pairwise(held):
        assert ended <= began, "spans overlap"
    tokens = [token for _, _, token in held]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
    handed_back = [
        e.message
        for run_id in ids
        for e in await backends.store.trail.events_of(run_id)
        if e.metadata.get("transition") == "release"
    ]
    assert handed_back, "some run found the lock held"
    assert all(
        m and m.startswith('waits for lock partner-api:["acme"] held by run') for m in handed_back
    )


async def test_a_run_whose_lock_is_held_goes_back_to_wait_and_says_so(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register("sync_in", steps=holding("builtin.noop"))
    service = RunService(backends.store, backends.queue)
    locks = Locks(backends.store, backends.queue, ttl_seconds=30)
    await locks.take(['partner-api:["acme"]'], "somebody:lease")
    run = (await service.create(RunRequest("sync_in", "user", "u", {"partner": "acme"}), "t"))[0]
    waiting = Waiting(backends.store, backends.queue, max_age=0)

    async def handed_back() -> bool:
        found = await service.get(run.id)
        return found.status == RunStatus.QUEUED and found.lock_wait is not None

    async with running(backends, settings):
        await until(handed_back)
        [seen] = await waiting.explain([await service.get(run.id)])
        assert seen.waiting_for is not None
        assert (seen.waiting_for.reason, seen.waiting_for.detail) == (
            "lock",
            'lock partner-api:["acme"] is held by run somebody',
        )
        assert seen.attempt == 0, "no attempt spent"
        # Let go, it is woken at once rather than at the end of its back-off.
        await locks.release(['partner-api:["acme"]'], "somebody:lease", backends.store.clock.now())
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED and done.lock_wait is None


async def test_a_lock_whose_holder_was_killed_is_free_within_a_lease_length(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("sync_in", steps=holding())
    service = RunService(backends.store, backends.queue)
    payload = {"partner": "acme", "seconds": 60}
    doomed = (await service.create(RunRequest("sync_in", "user", "u", payload), "t"))[0]
    log = tmp_path / "doomed.log"
    proc = spawn(settings, "worker", log, JOBPLANE_HANDLERS=HANDLERS)
    lock = backends.queue.keys.lock('partner-api:["acme"]')
    try:
        await until(lambda: backends.queue.redis.exists(lock), 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # Its holder dead, nothing renews it: what its last renewal left is at most a lease
        # length (read from Redis, not timed here, so a slow machine cannot fail it; -2: gone).
        left = await backends.queue.redis.pttl(lock)
        assert left == -2 or 0 < left <= settings.lease_seconds * 1000
        await until(lambda: _gone(backends, lock), settings.lease_seconds + 30)
    finally:
        terminate(proc)
    # The reaper gives the run to another worker, which takes the lock again.
    quick = {**payload, "seconds": 0.1}
    await backends.store.runs.get(doomed.id)
    next_run = (await service.create(RunRequest("sync_in", "user", "u", quick), "t"))[0]
    async with workers(settings, tmp_path, 1, JOBPLANE_HANDLERS=HANDLERS):
        [done] = await settled(backends.store, [next_run.id], within=60)
    assert done.status == RunStatus.SUCCEEDED


async def test_a_step_whose_lock_lapsed_while_it_ran_writes_no_end_and_runs_again(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """A holder whose lock lapsed while its step ran (deleted here, as an expiry would; its
    heartbeat too far off to notice) may have shared it: the step's end is not written as if
    it had held the lock, and the run is handed back, without spending an attempt, to run the
    step again under a new grant. (The step runs past half the lock's TTL, beyond which its
    end asks Redis; its second run ends well within the TTL.)"""
    await register("sync_in", steps=holding())
    service = RunService(backends.store, backends.queue)
    payload = {"partner": "acme", "seconds": 2.5}
    run = (await service.create(RunRequest("sync_in", "user", "u", payload), "t"))[0]
    lock = backends.queue.keys.lock(ACME)
    deaf = settings.model_copy(update={"heartbeat_seconds": 60, "lease_seconds": 4})
    async with running(backends, deaf):
        await until(lambda: backends.queue.redis.exists(lock))
        first = int((await backends.queue.redis.get(lock)).split(b"\n")[1])
        await backends.queue.redis.delete(lock)
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 1
    assert done.outputs["call"]["token"] > first, "the step ran again, under a new grant"
    trail = await backends.store.trail.events_of(run.id)
    assert [e.type for e in trail].count("step_finished") == 1
    assert "release" in [e.metadata.get("transition") for e in trail]


async def test_a_heartbeat_renews_every_held_runs_locks_in_one_round_trip(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """The runs a worker holds have their locks renewed together, so the last is renewed as
    soon as the first: a beat with many locked runs leaves none of them closer to lapsing."""
    await register("sync_in", steps=holding())
    service = RunService(backends.store, backends.queue)
    partners = [f"p{i}" for i in range(5)]
    beating = settings.model_copy(update={"heartbeat_seconds": 0.3})
    batches: list[list[str]] = []
    renew_many = backends.queue.locks._renew_many

    async def counted(renewals: list[tuple[list[str], str, int]]) -> list[Any]:
        batches.append(sorted(lock for lock_ids, _, _ in renewals for lock in lock_ids))
        return await renew_many(renewals)

    backends.queue.locks._renewals = GroupCommit(counted)
    async with running(backends, beating):
        runs = [
            (await service.create(RunRequest("sync_in", "user", "u", p), "t"))[0]
            for p in ({"partner": partner, "seconds": 2} for partner in partners)
        ]
        done = await settled(backends.store, [r.id for r in runs], within=30)
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}
    every = sorted(f'partner-api:["{p}"]' for p in partners)
    assert every in batches, f"no beat renewed all five runs' locks at once: {batches}"


async def test_a_failed_steps_locks_are_let_go_after_its_failure_is_written(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """A failed step's recorded span lies inside its hold of its locks, as every step's does:
    its end is written with the attempt's failure once the walk stops, and its locks are let
    go after that write (the run has left `running` at each let-go)."""
    await register("sync_in", steps=holding("builtin.fail"))
    service = RunService(backends.store, backends.queue)
    seen: list[RunStatus] = []
    async with running(backends, settings) as [worker]:
        release = worker.locks.release

        async def watched(lock_ids: Sequence[str], owner: str, now: datetime) -> None:
            seen.append((await service.get(owner.split(":")[0])).status)
            await release(lock_ids, owner, now)

        worker.locks.release = watched  # type: ignore[method-assign]
        payload = {"partner": "acme", "fatal": True}
        run = (await service.create(RunRequest("sync_in", "user", "u", payload), "t"))[0]
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.FAILED
    assert seen == [RunStatus.FAILED], seen


async def _gone(backends: Backends, key: str) -> bool:
    return not await backends.queue.redis.exists(key)


async def test_a_run_that_takes_its_lock_after_its_back_off_waits_no_more(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """A holder that died lets its lock expire, which wakes nobody: the waiting run takes it
    at the end of its back-off, and leaves the lock's waiters, so that the next wake-up goes
    to a run still waiting."""
    await register("sync_in", steps=holding("builtin.noop"))
    service = RunService(backends.store, backends.queue)
    locks = Locks(backends.store, backends.queue, ttl_seconds=30)
    lock = 'partner-api:["acme"]'
    await locks.take([lock], "dead:lease")
    run = (await service.create(RunRequest("sync_in", "user", "u", {"partner": "acme"}), "t"))[0]
    waiters = backends.queue.keys.lock_waiters(lock)

    async def handed_back() -> bool:
        return bool(await backends.queue.redis.zcard(waiters))

    async with running(backends, settings):
        await until(handed_back)
        await backends.queue.redis.delete(backends.queue.keys.lock(lock))  # as if it expired
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED
    assert await backends.queue.redis.zcard(waiters) == 0


ACME = 'partner-api:["acme"]'


async def pop(backends: Backends, settings: Settings) -> Popped:
    """What a worker's pop of every lane it offers finds."""
    now = backends.store.clock.now()
    return await backends.queue.pop(settings.queues, 10, now, handlers=registry.offered())


def counting_takes(worker: Worker) -> list[str]:
    """The owners the worker's lock takes were for, in order; a take made once the run was
    held (by its runner, not beside its claim) is marked `held:`."""
    owners: list[str] = []
    take = worker.locks.take

    async def counted(lock_ids: Sequence[str], owner: str) -> Taken | Blocked:
        held = owner.split(":")[0] in worker.held
        owners.append(f"held:{owner}" if held else owner)
        return await take(lock_ids, owner)

    worker.locks.take = counted  # type: ignore[method-assign]
    return owners


async def test_a_runs_first_locks_are_taken_beside_its_claim_under_its_lease(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """The run's queue entry names its first step's locks; its worker takes them beside the
    claim, under the lease the claim grants, and its step starts without taking them again."""
    await register("sync_in", steps=holding("builtin.noop"))
    service = RunService(backends.store, backends.queue)
    run = (await service.create(RunRequest("sync_in", "user", "u", {"partner": "acme"}), "t"))[0]
    assert run.start_locks == [ACME]
    popped = await pop(backends, settings)
    assert popped.run_ids == [run.id]
    limits = popped.limits[run.id]
    assert limits.locks == (ACME,) and not limits.gated
    worker = Worker(backends.store, backends.queue, settings)
    owners = counting_takes(worker)
    await worker.claim(popped.run_ids, popped)
    [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED
    [owner] = owners  # taken once...
    assert not owner.startswith("held:"), "...beside the claim, before the run was held"
    await backends.store.trail.flush()
    [claim] = [e for e in await backends.store.trail.events_of(run.id) if e.to == "running"]
    run_id, lease = owner.split(":")
    assert run_id == run.id and claim.metadata["lease"] == lease[:8], "under the claim's lease"
    # Let go as the step ends, just after the write that ended the run, which `settled` saw.
    await until(lambda: _gone(backends, backends.queue.keys.lock(ACME)), 10)


async def test_locks_taken_ahead_of_a_claim_that_lost_the_run_are_let_go(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register("sync_in", steps=holding("builtin.noop"))
    service = RunService(backends.store, backends.queue)
    run = (await service.create(RunRequest("sync_in", "user", "u", {"partner": "acme"}), "t"))[0]
    popped = await pop(backends, settings)
    await backends.store.transitions.claim([run.id], "another-worker", 30)
    worker = Worker(backends.store, backends.queue, settings)
    owners = counting_takes(worker)
    await worker.claim(popped.run_ids, popped)
    assert len(owners) == 1 and not worker.held, "taken ahead, but the run is another's"
    assert not await backends.queue.redis.exists(backends.queue.keys.lock(ACME)), "let go"


async def test_two_workers_claiming_one_locked_run_start_it_once_and_free_its_lock(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """Two pops of one run (the reconciler pushed it again while a worker held its pop): both
    workers take its locks ahead, one claim wins. The loser gives its take back; the winner's
    step ran on the locks, or found the loser's take and was handed back and woken."""
    await register("sync_in", steps=holding("builtin.noop"))
    service = RunService(backends.store, backends.queue)
    for _ in range(5):
        run = (await service.create(RunRequest("sync_in", "user", "u", {"partner": "acme"}), "t"))[
            0
        ]
        popped = await pop(backends, settings)
        one, two = (Worker(backends.store, backends.queue, settings) for _ in range(2))
        await asyncio.gather(*(w.claim(popped.run_ids, popped) for w in (one, two)))
        async with running(backends, settings):
            [done] = await settled(backends.store, [run.id], within=30)
        assert done.status == RunStatus.SUCCEEDED and done.attempt == 1
        moves = [e.metadata.get("transition") for e in await backends.store.trail.events_of(run.id)]
        assert moves.count("claim") == moves.count("release") + 1, moves
        assert not await backends.queue.redis.exists(backends.queue.keys.lock(ACME))


async def test_a_lock_taken_ahead_that_no_step_takes_up_is_let_go_before_the_run_goes_on(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """The first step's `when` is false: its lock, taken beside the claim, is free while the
    step after it runs."""
    first = {"id": "call", "handler": "builtin.noop", "locks": SHARED, "when": "payload.call"}
    await register("sync_in", steps=[first, {"id": "then", "handler": "builtin.sleep"}])
    service = RunService(backends.store, backends.queue)
    payload = {"partner": "acme", "call": False, "sleepSeconds": 30}
    run = (await service.create(RunRequest("sync_in", "user", "u", payload), "t"))[0]
    popped = await pop(backends, settings)
    assert popped.limits[run.id].locks == (ACME,)
    worker = Worker(backends.store, backends.queue, settings)
    owners = counting_takes(worker)
    await worker.claim(popped.run_ids, popped)
    assert [o.split(":")[0] for o in owners] == [run.id], "taken beside the claim"

    async def sleeping() -> bool:
        found = await service.get(run.id)
        return found.progress.steps[1].status == StepStatus.RUNNING

    held = worker.held[run.id]
    try:
        await until(sleeping)
        assert not await backends.queue.redis.exists(backends.queue.keys.lock(ACME))
        assert held.locks == {}
    finally:
        held.interrupt("shutdown")  # handed back to its queue, as a worker that stops does
        assert held.task is not None
        await held.task


async def test_a_run_whose_step_has_started_names_no_locks_to_take_ahead(
    backends: Backends, register: Register
) -> None:
    """A retry may start at a later step, elsewhere: its locks are taken as its steps start."""
    await register("sync_in", steps=holding("builtin.noop"))
    service = RunService(backends.store, backends.queue)
    run = (await service.create(RunRequest("sync_in", "user", "u", {"partner": "acme"}), "t"))[0]
    assert run.start_limits == StartLimits("sync_in", locks=(ACME,))
    started = run.progress.steps[0].model_copy(update={"status": StepStatus.FAILED})
    retried = run.model_copy(
        update={"progress": run.progress.model_copy(update={"steps": [started]})}
    )
    assert retried.start_limits is None
    # What a queue entry names survives its member's round trips.
    entry = QueueEntry.of(run)
    assert run_of(entry.member) == (run.id, run.start_limits)
    assert QueueEntry.unheld(entry.held()) == entry
