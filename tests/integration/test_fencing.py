"""A worker whose lease was superseded (a zombie) can change nothing."""

from datetime import timedelta

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.model import RunError, RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.store import Lost, MongoStore
from tests.integration.conftest import Register
from tests.integration.runs import reap


async def test_zombie_writes_are_rejected_and_recorded(
    backends: Backends, register: Register
) -> None:
    clock = ManualClock()
    store = MongoStore(backends.store.client, backends.store.db.name, clock=clock)
    steps = [{"id": "a", "handler": "builtin.noop"}, {"id": "b", "handler": "h"}]
    await register(steps=steps, retryPolicy={"maxAttempts": 3})
    run, _ = await RunService(store, backends.queue).create(
        RunRequest("t_noop", "user", "u1"), "user:a"
    )
    [(_, zombie)] = await store.transitions.claim([run.id], "zombie", lease_seconds=5)
    assert await store.leases.start_step(zombie, 0, "a") is None

    # The zombie stalls past its lease; the reaper requeues the run and another worker claims it.
    clock.advance(6)
    [expired] = await store.maintenance.expired_leases(10)
    assert (await reap(store, expired)).to == RunStatus.QUEUED  # type: ignore[union-attr]
    [(_, fresh)] = await store.transitions.claim([run.id], "healthy", lease_seconds=5)
    assert fresh.token != zombie.token
    before = await store.runs.get(run.id)
    assert before is not None and before.attempt == 2

    error = RunError(code="x", message="x", step="a", attempt=1)
    outcomes = [
        await store.leases.report_progress(zombie, 0, 50, 25, "still here"),
        await store.leases.finish_step(zombie, 0, "a", "out", 50, next_handler=None),
        await store.transitions.complete(zombie, 1, "b", "out", "result"),
        await store.transitions.fail(zombie, 1, error),
        await store.transitions.retry(zombie, 1, error, clock.now() + timedelta(seconds=1)),
    ]
    assert outcomes == [Lost(run.id, "lease", RunStatus.RUNNING)] * 5
    assert await store.runs.get(run.id) == before, "the zombie changed nothing"
    held, _ = await store.leases.heartbeat("zombie", [zombie], 5)
    assert held == set()

    rejected = [e for e in await store.trail.events_of(run.id) if e.type == "stale_write_rejected"]
    assert [e.metadata["write"] for e in rejected] == [
        "progress",
        "finish_step",
        "complete",
        "fail",
        "retry",
    ]
    assert all(e.actor == "worker:zombie" for e in rejected)

    # The healthy worker's writes still go through.
    assert await store.leases.start_step(fresh, 0, "a") is None
    assert await store.leases.finish_step(fresh, 0, "a", 1, 50, next_handler=None) is None
    done = await store.transitions.complete(fresh, 1, "b", 2, 2)
    assert not isinstance(done, Lost) and done.to == RunStatus.SUCCEEDED
