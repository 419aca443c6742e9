"""Worker behaviour around cancel, shutdown and lost leases, on one event loop."""

import asyncio

from jobplane.backends import Backends
from jobplane.model import RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.store import Lost
from jobplane.worker import Worker
from tests.integration.conftest import Register
from tests.integration.workers import running, settled

SLEEPY = [
    {"id": "nap", "handler": "builtin.sleep"},
    {"id": "after", "handler": "builtin.noop"},
]


async def wait_status(backends: Backends, run_id: str, status: RunStatus) -> None:
    async with asyncio.timeout(20):
        # Polling: the test watches MongoDB from outside, as a user would.
        while (run := await backends.store.get_run(run_id)) is None or run.status != status:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_cancel_mid_step_stops_at_the_next_checkpoint(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=SLEEPY)
    service = RunService(backends.store, backends.queue)
    run = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a")
    async with running(backends, settings):
        await wait_status(backends, run.id, RunStatus.RUNNING)
        moved = await backends.store.request_cancel(run.id, "user:a", "no longer needed")
        assert not isinstance(moved, Lost) and moved.to == RunStatus.CANCEL_REQUESTED
        await backends.queue.signal_cancel(run.id)
        [done] = await settled(backends.store, [run.id], within=5)
    assert done.status == RunStatus.CANCELLED
    assert [s.status for s in done.progress.steps] == [StepStatus.CANCELLED, StepStatus.SKIPPED]
    assert done.cancel_reason == "no longer needed" and done.cancel_requested_by == "user:a"
    trail = [(e.type, e.to) for e in await backends.store.events_of(run.id)]
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
    run = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 0.8}), "user:a")
    async with running(backends, settings):
        await wait_status(backends, run.id, RunStatus.RUNNING)
        await backends.store.request_cancel(run.id, "user:a", None)
        await backends.queue.signal_cancel(run.id)
        [done] = await settled(backends.store, [run.id], within=5)
    assert done.status == RunStatus.CANCELLED
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED, StepStatus.SKIPPED]
    assert done.outputs["nap"] == {"sleptSeconds": 0.8}


async def test_graceful_stop_releases_unfinished_runs_without_an_attempt(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=SLEEPY)
    service = RunService(backends.store, backends.queue)
    run = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a")
    stop = asyncio.Event()
    worker = Worker(backends.store, backends.queue, settings)
    task = asyncio.create_task(worker.run(stop, drain_seconds=0.2))
    await wait_status(backends, run.id, RunStatus.RUNNING)
    stop.set()
    await task
    released = await backends.store.get_run(run.id)
    assert released is not None and released.status == RunStatus.QUEUED
    assert released.attempt == 0 and released.locked_by is None
    assert released.progress.steps[0].status == StepStatus.PENDING
    popped = await backends.queue.pop(settings.queues, 10, backends.store.clock.now())
    assert popped.run_ids == [run.id], "the released run is back in Redis"


async def test_a_worker_that_loses_its_lease_stops_the_handler(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=SLEEPY, retryPolicy={"maxAttempts": 3})
    service = RunService(backends.store, backends.queue)
    run = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a")
    async with running(backends, settings) as [worker]:
        await wait_status(backends, run.id, RunStatus.RUNNING)
        # Another claim supersedes the lease, as after an expiry the worker slept through.
        await backends.store.runs.update_one(
            {"_id": __import__("bson").ObjectId(run.id)}, {"$set": {"leaseToken": "someone-else"}}
        )
        async with asyncio.timeout(5):
            while run.id in worker.held:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        after = await backends.store.get_run(run.id)
    assert after is not None and after.status == RunStatus.RUNNING
    assert after.lease_token == "someone-else", "the stopped worker wrote nothing more"
