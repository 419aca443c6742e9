"""Recovery with real processes: a worker killed mid-step, Redis flushed mid-drain."""

import asyncio
import signal
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from jobplane.backends import Backends, open_backends
from jobplane.devstack import RedisServer, free_port
from jobplane.model import TERMINAL, RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.worker import StepContext, handler
from tests.integration.conftest import Register, template_spec
from tests.integration.db import raw
from tests.integration.processes import spawn, terminate
from tests.integration.workers import create_many, running, settled

FLUSHED_RUNS = 1000


async def counted_up_to(backends: Backends, query: dict[str, Any], n: int) -> None:
    """Wait until `n` runs match `query`; one count per poll, however many runs there are."""
    async with asyncio.timeout(120):
        while await raw(backends.store).runs.count_documents(query) < n:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


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
            while (await backends.store.runs.get(run.id)).status != RunStatus.RUNNING:  # type: ignore[union-attr]  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
    finally:
        terminate(victim)
    async with running(backends, quick, scheduler=True):
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 2
    events = await backends.store.trail.events_of(run.id)
    claims = [e for e in events if e.metadata.get("transition") == "claim"]
    assert len(claims) == 2 and claims[0].actor != claims[1].actor
    assert [e.type for e in events].count("lease_expired") == 1
    moves = [(e.from_, e.to) for e in events if e.type == "status_changed"]
    assert [to for _, to in moves].count(RunStatus.SUCCEEDED) == 1
    # The trail has no hole where the victim died: each move starts where the last one ended.
    assert all(prev[1] == nxt[0] for prev, nxt in pairwise(moves))


@pytest.mark.slow
async def test_flushall_mid_drain_of_1000_runs_loses_none_and_runs_each_once(
    settings: Settings, tmp_path: Path
) -> None:
    # A server of its own, so that a real FLUSHALL wipes all this deployment had in Redis and
    # nothing of other tests'.
    redis = RedisServer(tmp_path / "redis", free_port(), tmp_path / "redis.log")
    redis.start()
    settings = settings.model_copy(update={"redis_url": redis.url})
    executions: Counter[str] = Counter()

    async def counted(ctx: StepContext) -> None:
        executions[ctx.run.id] += 1
        await asyncio.sleep(0.01)  # long enough for a second copy to overlap, were there one

    handler("test.recovery.counted")(counted)
    try:
        async with open_backends(settings) as backends:
            steps = [{"id": "step", "handler": "test.recovery.counted"}]
            await backends.store.templates.register(template_spec("t_counted", steps=steps))
            service = RunService(backends.store, backends.queue)
            request = RunRequest("t_counted", "user", "u")
            ids = await create_many(service, request, FLUSHED_RUNS, "user:a")
            async with running(backends, settings, workers=2, scheduler=True):
                await counted_up_to(backends, {"status": RunStatus.SUCCEEDED}, len(ids) // 4)
                # One transaction, so the count is of exactly what the flush wiped.
                async with backends.queue.redis.pipeline(transaction=True) as pipe:
                    pipe.zcard(backends.queue.keys.queue("default", "test.recovery.counted"))
                    pipe.flushall()
                    waiting, _ = await pipe.execute()
                assert waiting > 0, "runs were still waiting in Redis when it was flushed"
                await counted_up_to(backends, {"status": {"$in": sorted(TERMINAL)}}, len(ids))
            statuses = [d["status"] async for d in raw(backends.store).runs.find({}, {"status": 1})]
            assert Counter(statuses) == {RunStatus.SUCCEEDED: len(ids)}
            claims = await raw(backends.store).events.aggregate(
                [
                    {"$match": {"type": "status_changed", "metadata.transition": "claim"}},
                    {"$group": {"_id": "$jobId", "n": {"$sum": 1}}},
                ]
            )
            assert {d["_id"]: d["n"] async for d in claims} == dict.fromkeys(ids, 1)
    finally:
        redis.stop()
    # Each step ran once: never twice at the same time, nor again after a requeue.
    assert executions == dict.fromkeys(ids, 1)
