"""A run's whole life, end to end, with a worker on real MongoDB + Redis."""

import asyncio
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.errors import NotFound, ResourceInvalidState
from jobplane.model import RunStatus, StepStatus, WaitingFor
from jobplane.runs import RunRequest, RunService
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings
from jobplane.templates import load_file
from jobplane.worker import StepContext, registry
from tests.integration.conftest import Register
from tests.integration.workers import running, settled

TEMPLATES = Path(__file__).parents[2] / "templates"

# Run ids whose handler may reach its checkpoint: until then a cancel stays only requested,
# however fast the worker hears of it.
cued: set[str] = set()


@registry.register("test.checkpoint_on_cue")
async def checkpoint_on_cue(ctx: StepContext) -> None:
    async with asyncio.timeout(20):
        while ctx.run.id not in cued:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    ctx.checkpoint()


async def test_demo_long_task_runs_to_success(backends: Backends, settings: Settings) -> None:
    store = backends.store
    await store.templates.register(load_file(TEMPLATES / "demo_long_task.yaml"))
    service = RunService(store, backends.queue)
    payload = {"target": "t", "sleepSeconds": 0.5}
    run, _ = await service.create(RunRequest("demo_long_task", "user", "u1", payload), "user:alice")
    assert run.status == RunStatus.QUEUED and run.template_version == 1

    progress_seen: list[float] = []
    async with running(backends, settings):
        while (current := await service.get(run.id)).status != RunStatus.SUCCEEDED:
            progress_seen.append(current.progress.percentage)
            assert current.status in {RunStatus.QUEUED, RunStatus.RUNNING}
    assert progress_seen == sorted(progress_seen), "progress never goes back"
    assert any(0 < p < 100 for p in progress_seen), "progress is visible mid-run"

    done = await service.get(run.id)
    assert done.progress.percentage == 100
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED] * 3
    assert all(s.started_at and s.completed_at for s in done.progress.steps)
    assert done.result == payload  # finalize is builtin.echo
    assert set(done.outputs) == {"prepare", "execute", "finalize"}
    assert done.attempt == 1 and done.completed_at and done.started_at
    assert done.locked_until is None and done.lease_token is None

    story = [
        (e.type, e.from_, e.to, e.metadata.get("step")) for e in await store.trail.events_of(run.id)
    ]
    S = RunStatus
    assert story == [
        ("created", None, S.QUEUED, None),
        ("status_changed", S.QUEUED, S.RUNNING, None),
        ("step_started", None, None, "prepare"),
        ("step_finished", None, None, "prepare"),
        ("step_started", None, None, "execute"),
        ("step_finished", None, None, "execute"),
        ("step_started", None, None, "finalize"),
        ("step_finished", None, None, "finalize"),
        ("status_changed", S.RUNNING, S.SUCCEEDED, None),
    ]
    actors = [e.actor for e in await store.trail.events_of(run.id)]
    assert actors[0] == "user:alice"
    assert all(a.startswith("worker:") for a in actors[1:])


async def test_retryable_failure_resumes_at_the_failed_step(
    backends: Backends, settings: Settings, register: Register
) -> None:
    steps = [
        {"id": "first", "handler": "builtin.echo"},
        {"id": "flaky", "handler": "builtin.fail"},
    ]
    policy = {"maxAttempts": 3, "backoffSeconds": [0, 0]}
    await register("flaky", steps=steps, retryPolicy=policy)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("flaky", "user", "u1", {"failTimes": 2}), "user:a")
    async with running(backends, settings):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 3
    events = await backends.store.trail.events_of(run.id)
    started = [e.metadata["step"] for e in events if e.type == "step_started"]
    assert started == ["first", "flaky", "flaky", "flaky"], "first ran once, flaky three times"
    # The run succeeded, so it has no error; the attempts that failed keep theirs.
    assert done.error is None
    assert [(a.attempt, a.error.code, a.error.step) for a in done.attempts] == [
        (1, "retryable", "flaky"),
        (2, "retryable", "flaky"),
    ]
    assert all(a.error.message.endswith(f"failing attempt {a.attempt}") for a in done.attempts)
    assert all(a.started_at and a.started_at < a.ended_at for a in done.attempts)
    assert [s.error for s in done.progress.steps] == [None, None]


async def test_fatal_error_and_exhausted_attempts_fail(
    backends: Backends, settings: Settings, register: Register
) -> None:
    policy = {"maxAttempts": 2, "backoffSeconds": [0]}
    await register("failing", steps=[{"id": "f", "handler": "builtin.fail"}], retryPolicy=policy)
    await register("unknown", steps=[{"id": "u", "handler": "nowhere.to_be:found"}])
    service = RunService(backends.store, backends.queue)
    fatal, _ = await service.create(RunRequest("failing", "user", "u", {"fatal": True}), "user:a")
    spent, _ = await service.create(RunRequest("failing", "user", "u", {"failTimes": 5}), "user:a")
    unknown, _ = await service.create(RunRequest("unknown", "user", "u"), "user:a")
    async with running(backends, settings):
        runs = await settled(backends.store, [fatal.id, spent.id])
    by_id = {r.id: r for r in runs}
    assert by_id[fatal.id].status == RunStatus.FAILED and by_id[fatal.id].attempt == 1
    assert by_id[fatal.id].error.code == "fatal"  # type: ignore[union-attr]
    assert by_id[spent.id].status == RunStatus.FAILED and by_id[spent.id].attempt == 2
    # Failed for good: the error it ended with, after every attempt's.
    assert [a.attempt for a in by_id[spent.id].attempts] == [1, 2]
    assert by_id[spent.id].error == by_id[spent.id].attempts[-1].error
    # No worker offers the unknown handler: its run waits, saying so, and spends nothing.
    [waiting] = await Waiting(backends.store, backends.queue).explain(
        [await service.get(unknown.id)]
    )
    assert waiting.status == RunStatus.QUEUED and waiting.attempt == 0
    assert waiting.waiting_for == WaitingFor(reason="handler", detail="nowhere.to_be:found")


async def test_priority_orders_the_queue(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register()
    service = RunService(backends.store, backends.queue)
    low, _ = await service.create(RunRequest("t_noop", "user", "u", priority=-5), "user:a")
    mid, _ = await service.create(RunRequest("t_noop", "user", "u"), "user:a")
    high, _ = await service.create(RunRequest("t_noop", "user", "u", priority=5), "user:a")
    popped = await backends.queue.pop(
        settings.queues, 10, backends.store.clock.now(), handlers=registry.offered()
    )
    assert popped.run_ids == [high.id, mid.id, low.id]


async def test_delayed_run_waits_for_not_before(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register()
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", delay_seconds=0.6), "user:a")
    assert run.not_before is not None
    async with running(backends, settings):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.SUCCEEDED
    assert done.started_at is not None and done.started_at >= run.not_before


async def test_cancel_follows_rule_4_in_each_state(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "nap", "handler": "builtin.sleep"}])
    service = RunService(backends.store, backends.queue)
    queued, _ = await service.create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a"
    )
    done = await service.cancel(queued.id, "user:a", "changed my mind")
    assert done.status == RunStatus.CANCELLED and done.cancel_reason == "changed my mind"
    assert done.progress.steps[0].status == StepStatus.SKIPPED
    popped = await backends.queue.pop(
        settings.queues, 10, backends.store.clock.now(), handlers=registry.offered()
    )
    assert popped.run_ids == [], "a cancelled run leaves the Redis queue"
    with pytest.raises(ResourceInvalidState):
        await service.cancel(queued.id, "user:a", None)

    await register(steps=[{"id": "nap", "handler": "test.checkpoint_on_cue"}])
    held, _ = await service.create(RunRequest("t_noop", "user", "u", {}), "user:a")
    async with running(backends, settings):
        async with asyncio.timeout(10):
            while (await service.get(held.id)).status != RunStatus.RUNNING:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        asked = await service.cancel(held.id, "user:b", None)
        assert asked.status == RunStatus.CANCEL_REQUESTED
        again = await service.cancel(held.id, "user:c", None)
        assert again.cancel_requested_by == "user:b", "a second cancel changes nothing"
        cued.add(held.id)
        [stopped] = await settled(backends.store, [held.id], within=5)
    assert stopped.status == RunStatus.CANCELLED

    with pytest.raises(NotFound):
        await service.cancel("0123456789abcdef01234567", "user:a", None)
