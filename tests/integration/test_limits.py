"""Limits the worker cannot talk its way out of: the run deadline, the cancel grace, and what a
failed step leaves for the person reading the dead letter."""

import asyncio
import threading
from datetime import timedelta

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.model import Run, RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.store import MongoStore
from jobplane.worker import StepContext, Worker, registry
from tests.integration.conftest import Register
from tests.integration.workers import running, settled

# Lets a stubborn handler's thread end when its test is over.
released = threading.Event()


@registry.register("test.stubborn")
def stubborn(ctx: StepContext) -> None:
    """Heartbeats and never reaches a checkpoint: only the platform can stop it."""
    while not released.wait(0.05):
        ctx.heartbeat()


@registry.register("test.deep_failure")
async def deep_failure(ctx: StepContext) -> None:
    def inner() -> None:
        raise ValueError(f"bad input {ctx.payload['n']}")

    inner()


async def start(backends: Backends, payload: dict[str, object]) -> str:
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", payload), "user:a")
    return run.id


async def test_a_run_past_its_deadline_expires_even_while_it_heartbeats(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(
        steps=[
            {"id": "work", "handler": "test.stubborn"},
            {"id": "after", "handler": "builtin.noop"},
        ],
        timeoutSeconds=1,
    )
    released.clear()
    run_id = await start(backends, {})
    try:
        async with running(backends, settings, scheduler=True):
            [done] = await settled(backends.store, [run_id], within=20)
            released.set()  # the thread ends, so its worker can stop
    finally:
        released.set()
    assert done.status == RunStatus.EXPIRED
    assert done.error is not None and done.error.code == "deadline_exceeded"
    assert [s.status for s in done.progress.steps] == [StepStatus.FAILED, StepStatus.SKIPPED]
    assert done.deadline is not None and done.started_at is not None
    assert (done.deadline - done.started_at).total_seconds() == 1
    assert done.completed_at is not None and done.completed_at >= done.deadline
    moves = [e.metadata.get("transition") for e in await backends.store.trail.events_of(run_id)]
    assert moves.count("deadline_expire") == 1


async def test_a_cancel_the_handler_ignores_is_forced_after_the_grace(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(
        steps=[{"id": "work", "handler": "test.stubborn"}],
        cancelPolicy={"graceSeconds": 0.5},
    )
    released.clear()
    run_id = await start(backends, {})
    service = RunService(backends.store, backends.queue)
    try:
        async with running(backends, settings, scheduler=True):
            async with asyncio.timeout(20):
                while (await service.get(run_id)).status != RunStatus.RUNNING:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            asked = await service.cancel(run_id, "user:a", "stop it")
            assert asked.status == RunStatus.CANCEL_REQUESTED
            assert asked.cancel_deadline is not None
            [done] = await settled(backends.store, [run_id], within=20)
            released.set()  # the handler returns now; its worker's writes must be fenced
            await asyncio.sleep(0.5)
    finally:
        released.set()
    assert done.status == RunStatus.CANCELLED
    assert done.completed_at is not None and done.completed_at >= asked.cancel_deadline
    assert done.progress.steps[0].status == StepStatus.CANCELLED
    events = await backends.store.trail.events_of(run_id)
    assert [e.type for e in events].count("cancel_timeout") == 1
    assert [e for e in events if e.type == "status_changed"][-1].actor == "reaper"
    final = await service.get(run_id)
    assert final.status == RunStatus.CANCELLED and final.version == done.version


async def test_a_failed_step_keeps_its_traceback(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "parse", "handler": "test.deep_failure"}])
    run_id = await start(backends, {"n": 7})
    async with running(backends, settings):
        [done] = await settled(backends.store, [run_id], within=20)
    assert done.status == RunStatus.FAILED and done.error is not None
    assert done.error.message == "ValueError: bad input 7"
    assert done.error.traceback is not None
    assert "in inner" in done.error.traceback and "ValueError: bad input 7" in done.error.traceback


async def test_retry_backoff_follows_the_policy_on_an_injected_clock(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """Backoff timing without sleeping through it: the worker, store and queue share a clock
    that only the test moves."""
    clock = ManualClock()
    store = MongoStore(backends.store.client, settings.db, clock=clock)
    await register(
        steps=[{"id": "flaky", "handler": "builtin.fail"}],
        retryPolicy={"maxAttempts": 3, "backoffSeconds": [120, 600]},
    )
    service = RunService(store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {"failTimes": 2}), "user:a")
    failed_at = clock.now()

    async def settled_in(status: RunStatus, attempt: int) -> Run:
        async with asyncio.timeout(20):
            while True:
                now = await store.runs.get(run.id)
                if now is not None and now.status == status and now.attempt == attempt:
                    return now
                await asyncio.sleep(0.02)

    worker = Worker(store, backends.queue, settings, clock=clock)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop, drain_seconds=5))
    try:
        first = await settled_in(RunStatus.QUEUED, 1)
        assert first.not_before == failed_at + timedelta(seconds=120)
        await asyncio.sleep(1)  # real time passes; the injected clock does not
        assert (await store.runs.get(run.id)).status == RunStatus.QUEUED  # type: ignore[union-attr]
        clock.advance(119)
        await asyncio.sleep(1)
        assert (await store.runs.get(run.id)).attempt == 1  # type: ignore[union-attr]
        clock.advance(2)
        second = await settled_in(RunStatus.QUEUED, 2)
        assert second.not_before == clock.now() + timedelta(seconds=600)
        clock.advance(601)
        done = await settled_in(RunStatus.SUCCEEDED, 3)
    finally:
        stop.set()
        await task
        await store.trail.flush()
    assert done.error is None and [a.attempt for a in done.attempts] == [1, 2]
