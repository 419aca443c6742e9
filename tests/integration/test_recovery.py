"""Recovery with real processes: a worker killed mid-step, Redis wiped mid-drain."""

import asyncio
import signal
from itertools import pairwise
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.processes import spawn, terminate
from tests.integration.workers import running, settled


@pytest.mark.slow
async def test_a_run_whose_worker_was_sigkilled_is_finished_by_another(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    steps = [{"id": "nap", "handler": "builtin.sleep"}, {"id": "after", "handler": "builtin.echo"}]
    await register(steps=steps, retryPolicy={"maxAttempts": 3, "backoffSeconds": [0]})
    quick = settings.model_copy(update={"lease_seconds": 1.5, "heartbeat_seconds": 0.3})
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 1.0}), "user:a"
    )
    victim = spawn(quick, "worker", tmp_path / "victim.log")
    try:
        async with asyncio.timeout(20):
            while (await backends.store.get_run(run.id)).status != RunStatus.RUNNING:  # type: ignore[union-attr]  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
    finally:
        terminate(victim)
    async with running(backends, quick, scheduler=True):
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 2
    events = await backends.store.events_of(run.id)
    claims = [e for e in events if e.metadata.get("transition") == "claim"]
    assert len(claims) == 2 and claims[0].actor != claims[1].actor
    assert [e.type for e in events].count("lease_expired") == 1
    moves = [(e.from_, e.to) for e in events if e.type == "status_changed"]
    assert [to for _, to in moves].count(RunStatus.SUCCEEDED) == 1
    # The trail has no hole where the victim died: each move starts where the last one ended.
    assert all(prev[1] == nxt[0] for prev, nxt in pairwise(moves))


@pytest.mark.slow
async def test_redis_wiped_mid_drain_loses_nothing_and_runs_nothing_twice(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "nap", "handler": "builtin.sleep"}])
    service = RunService(backends.store, backends.queue)
    request = RunRequest("t_noop", "user", "u", {"sleepSeconds": 0.05})
    ids = [(await service.create(request, "user:a"))[0].id for _ in range(300)]
    async with running(backends, settings, workers=2, scheduler=True):
        async with asyncio.timeout(30):
            while await backends.store.runs.count_documents({"status": "succeeded"}) < 50:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        # FLUSHALL as this deployment sees it (a shared test Redis keeps other data).
        keys = [k async for k in backends.queue.redis.scan_iter(f"{settings.redis_prefix}*")]
        assert keys, "the queue held work when it was wiped"
        await backends.queue.redis.delete(*keys)
        runs = await settled(backends.store, ids, within=60)
    assert [r.status for r in runs] == [RunStatus.SUCCEEDED] * len(ids)
    claims = await backends.store.events.count_documents(
        {"type": "status_changed", "metadata.transition": "claim"}
    )
    assert claims == len(ids), "every run was claimed exactly once"
