"""Worker behaviour around cancel, shutdown and lost leases, on one event loop."""

import asyncio
import contextlib
import threading
import time

import pytest
from bson import ObjectId

from jobplane.backends import Backends
from jobplane.model import Run, RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.worker import StepContext, Worker, registry
from tests.conftest import REDIS_TOPOLOGIES
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.workers import running, settled

pytestmark = REDIS_TOPOLOGIES

SLEEPY = [
    {"id": "nap", "handler": "builtin.sleep"},
    {"id": "after", "handler": "builtin.noop"},
]


async def wait_status(backends: Backends, run_id: str, status: RunStatus) -> None:
    """Until the run is in `status` and, if running, its current step shows as running."""
    async with asyncio.timeout(20):
        # Polling: the test watches MongoDB from outside, as a user would.
        while not (run := await backends.store.runs.get(run_id)) or not in_status(run, status):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def in_status(run: Run, status: RunStatus) -> bool:
    stepping = any(s.status == StepStatus.RUNNING for s in run.progress.steps)
    return run.status == status and (status != RunStatus.RUNNING or stepping)


async def test_cancel_mid_step_stops_at_the_next_checkpoint(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=SLEEPY)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a")
    async with running(backends, settings):
        await wait_status(backends, run.id, RunStatus.RUNNING)
        asked = await service.cancel(run.id, "user:a", "no longer needed")
        # The worker may have stopped already by the time the answer is read; the trail below
        # shows the request came first.
        assert asked.status in {RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED}
        [done] = await settled(backends.store, [run.id], within=5)
    assert done.status == RunStatus.CANCELLED
    assert [s.status for s in done.progress.steps] == [StepStatus.CANCELLED, StepStatus.SKIPPED]
    assert done.cancel_reason == "no longer needed" and done.cancel_requested_by == "user:a"
    trail = [(e.type, e.to) for e in await backends.store.trail.events_of(run.id)]
    assert trail[-3:] == [
        ("status_changed", RunStatus.CANCEL_REQUESTED),
        ("cancel_requested", None),
        ("status_changed", RunStatus.CANCELLED),
    ]


async def test_a_non_cancelable_step_finishes_before_the_cancel(
    backends: Backends, settings: Settings, register: Register
) -> None:
    steps = [{**SLEEPY[0], "cancelable": False}, SLEEPY[1]]
    await register(steps=steps)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 0.8}), "user:a"
    )
    async with running(backends, settings):
        await wait_status(backends, run.id, RunStatus.RUNNING)
        await service.cancel(run.id, "user:a", None)
        [done] = await settled(backends.store, [run.id], within=5)
    assert done.status == RunStatus.CANCELLED
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED, StepStatus.SKIPPED]
    assert done.outputs["nap"] == {"sleptSeconds": 0.8}


async def test_graceful_stop_releases_unfinished_runs_without_an_attempt(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=SLEEPY)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a")
    stop = asyncio.Event()
    worker = Worker(backends.store, backends.queue, settings)
    task = asyncio.create_task(worker.run(stop, drain_seconds=0.2))
    await wait_status(backends, run.id, RunStatus.RUNNING)
    stop.set()
    await task
    released = await backends.store.runs.get(run.id)
    assert released is not None and released.status == RunStatus.QUEUED
    assert released.attempt == 0 and released.locked_by is None
    assert released.progress.steps[0].status == StepStatus.PENDING
    popped = await backends.queue.pop(
        settings.queues, 10, backends.store.clock.now(), handlers=registry.offered()
    )
    assert popped.run_ids == [run.id], "the released run is back in Redis"


# -- handlers the tests below register ---------------------------------------------------------

running_now = {"n": 0, "most": 0}
guard = threading.Lock()


@registry.register("test.quiet_sleep")
async def quiet_sleep(ctx: StepContext) -> None:
    """Sleeps without progress writes, so only the heartbeat can notice a lost lease."""
    await asyncio.sleep(float(ctx.payload["sleepSeconds"]))


@registry.register("test.sync_busy")
def sync_busy(ctx: StepContext) -> str:
    """A sync handler that counts how many copies of itself run at once."""
    with guard:
        running_now["n"] += 1
        running_now["most"] = max(running_now["most"], running_now["n"])
    try:
        for _ in range(int(ctx.payload["ticks"])):
            ctx.checkpoint()
            time.sleep(0.05)
        return "done"
    finally:
        with guard:
            running_now["n"] -= 1


async def test_heartbeats_keep_a_step_longer_than_the_lease(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "long", "handler": "test.quiet_sleep"}])
    quick = settings.model_copy(update={"lease_seconds": 1.0, "heartbeat_seconds": 0.2})
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 2.5}), "user:a"
    )
    async with running(backends, quick, scheduler=True):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 1
    types = [e.type for e in await backends.store.trail.events_of(run.id)]
    assert "lease_expired" not in types and "stale_write_rejected" not in types


async def test_heartbeat_stops_a_handler_whose_lease_was_superseded(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "long", "handler": "test.quiet_sleep"}])
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a"
    )
    async with running(backends, settings) as [worker]:
        await wait_status(backends, run.id, RunStatus.RUNNING)
        await raw(backends.store).runs.update_one(
            {"_id": ObjectId(run.id)}, {"$set": {"leaseToken": "someone-else"}}
        )
        async with asyncio.timeout(5):
            while run.id in worker.held:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    after = await backends.store.runs.get(run.id)
    assert after is not None and after.lease_token == "someone-else"
    rejected = [
        e for e in await backends.store.trail.events_of(run.id) if e.type == "stale_write_rejected"
    ]
    assert [e.metadata["write"] for e in rejected] == ["heartbeat"]


async def test_a_worker_cut_off_from_mongodb_stops_once_its_lease_passed(
    backends: Backends, settings: Settings, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    await register(steps=[{"id": "long", "handler": "test.quiet_sleep"}])
    quick = settings.model_copy(update={"lease_seconds": 1.0, "heartbeat_seconds": 0.2})
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a"
    )
    async with running(backends, quick) as [worker]:
        await wait_status(backends, run.id, RunStatus.RUNNING)

        async def unreachable(*args: object) -> None:
            raise ConnectionError("MongoDB unreachable")

        monkeypatch.setattr(worker.store.leases, "heartbeat", unreachable)
        async with asyncio.timeout(5):
            while run.id in worker.held:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        monkeypatch.undo()


async def test_step_timeout_retries_and_a_sync_step_never_runs_twice_at_once(
    backends: Backends, settings: Settings, register: Register
) -> None:
    policy = {"maxAttempts": 3, "backoffSeconds": [0, 0]}
    await register(
        steps=[{"id": "busy", "handler": "test.sync_busy", "timeoutSeconds": 0.3}],
        retryPolicy=policy,
    )
    running_now.update(n=0, most=0)
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"ticks": 40}), "user:a"
    )
    async with running(backends, settings, workers=2):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.FAILED and done.attempt == 3
    assert done.error is not None and done.error.code == "step_timeout"
    assert running_now["most"] == 1, "a timed-out thread finished before the retry began"


async def test_cancel_during_a_non_cancelable_last_step_keeps_its_output(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "last", "handler": "builtin.sleep", "cancelable": False}])
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 0.6}), "user:a"
    )
    async with running(backends, settings):
        await wait_status(backends, run.id, RunStatus.RUNNING)
        await service.cancel(run.id, "user:a", None)
        [done] = await settled(backends.store, [run.id], within=5)
    assert done.status == RunStatus.CANCELLED
    assert done.progress.steps[0].status == StepStatus.SUCCEEDED
    assert done.outputs == {"last": {"sleptSeconds": 0.6}}
    types = [e.type for e in await backends.store.trail.events_of(run.id)]
    assert types[-2:] == ["step_finished", "status_changed"]


async def test_a_worker_stops_even_if_a_driver_call_absorbs_cancellation(
    backends: Backends, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick = settings.model_copy(update={"heartbeat_seconds": 0.01})
    worker = Worker(backends.store, backends.queue, quick)
    give_up = asyncio.Event()

    async def absorbing(*args: object) -> None:
        # As seen from PyMongo's network layer: a cancel during a read does not propagate.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)
        if give_up.is_set():  # lets a broken worker's loop end once the test has failed
            raise asyncio.CancelledError

    monkeypatch.setattr(worker, "_renew", absorbing)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop, drain_seconds=0))
    await asyncio.sleep(0.2)
    stop.set()
    # The call in flight ends within a second; then the heartbeat loop must see the stop.
    done, _ = await asyncio.wait([task], timeout=4)
    give_up.set()
    assert done, "the worker did not stop: its heartbeat loop swallowed the cancel"


async def test_a_run_writes_no_lock_in_redis(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """MongoDB's lease alone says who holds a run: its claim, its heartbeats and its end write
    no `jobs:lock:<runId>` (the Redis mirror of the lease that once did was read by nothing)."""
    await register(steps=SLEEPY)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 2}), "user:a")
    locks = f"{settings.redis_prefix}jobs:lock:*"

    async def renewed() -> bool:
        """A heartbeat renewed the lease since the claim (here it beats every second)."""
        held = await backends.store.runs.get(run.id)
        return held is not None and held.heartbeat_at != held.started_at

    async with running(backends, settings):
        await wait_status(backends, run.id, RunStatus.RUNNING)
        async with asyncio.timeout(10):
            while not await renewed():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert [k async for k in backends.queue.redis.scan_iter(match=locks)] == []
        [done] = await settled(backends.store, [run.id], within=10)
    assert done.status == RunStatus.SUCCEEDED
    assert [k async for k in backends.queue.redis.scan_iter(match=locks)] == []
