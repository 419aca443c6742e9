"""`GET /metrics`: counters and histograms move by what the platform did, with the right labels,
and the state gauges tell the truth about queues, workers and the scheduler.

Counters live in the process's registry, which every test in the session shares: each test
names its own templates and queues, and reads labels it shares with others as deltas.
"""

import asyncio
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
from bson import ObjectId
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from jobplane.api import create_app
from jobplane.backends import Backends, open_backends
from jobplane.clock import ManualClock
from jobplane.devstack import free_port
from jobplane.model import Run, RunStatus, ScheduleSpec, StepStatus
from jobplane.process import JSONFormatter
from jobplane.queue.entry import QueueEntry
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunRequest, RunService
from jobplane.scheduler import Scheduler
from jobplane.schedules import ScheduleService
from jobplane.settings import Settings
from tests.integration.conftest import Client, Register, template_spec
from tests.integration.db import raw
from tests.integration.flow import until
from tests.integration.processes import spawn, terminate
from tests.integration.runs import run_in
from tests.integration.workers import running, settled

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a series never written, as Prometheus would read it."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def unique() -> str:
    return f"m{uuid4().hex[:10]}"


NAP = [{"id": "nap", "handler": "builtin.sleep"}]


async def stepping(backends: Backends, run_id: str) -> None:
    """Until a worker is inside the run's step (its start written)."""

    def inside(run: Run | None) -> bool:
        return run is not None and run.progress.steps[0].status == StepStatus.RUNNING

    async with asyncio.timeout(20):
        # Polling: the test watches MongoDB from outside, as a user would.
        while not inside(await backends.store.runs.get(run_id)):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@pytest.fixture
async def client(client_for: Client) -> httpx.AsyncClient:
    # No key: /metrics is open, like /healthz.
    return client_for("")


async def test_runs_drained_by_a_worker_move_the_counters_and_histograms(
    backends: Backends, settings: Settings, register: Register, client_for: Client
) -> None:
    queue = unique()
    ok, flaky = f"{queue}_ok", f"{queue}_flaky"
    await register(ok, queue=queue)
    retry = {"maxAttempts": 2, "backoffSeconds": [0]}
    await register(
        flaky, queue=queue, steps=[{"id": "only", "handler": "builtin.fail"}], retryPolicy=retry
    )
    api = client_for(settings.admin_key or "")

    async def create(template: str, **body: object) -> str:
        run = {"templateType": template, "scope": "user", "scopeId": "u1", **body}
        response = await api.post("/v1/runs", json=run)
        assert response.status_code in (200, 201), response.text
        run_id: str = response.json()["id"]
        return run_id

    first = await create(ok, idempotencyKey="k")
    # A repeated idempotency key returns the first run: one run, counted once.
    assert await create(ok, idempotencyKey="k") == first
    ids = [first, await create(ok), await create(ok), await create(flaky, payload={"failTimes": 1})]
    cancelled = await create(ok)
    assert (await api.post(f"/v1/runs/{cancelled}/cancel", json={})).status_code == 200

    async with running(backends, settings.model_copy(update={"queues": [queue]})):
        runs = await settled(backends.store, ids)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}

    samples = await scrape(api)
    assert value(samples, "jobplane_runs_created_total", template=ok) == 4
    assert value(samples, "jobplane_runs_created_total", template=flaky) == 1
    assert value(samples, "jobplane_runs_claimed_total", template=ok) == 3
    assert value(samples, "jobplane_runs_claimed_total", template=flaky) == 2
    assert value(samples, "jobplane_run_retries_total", template=flaky) == 1
    finished = "jobplane_runs_finished_total"
    assert value(samples, finished, template=ok, status="succeeded") == 3
    assert value(samples, finished, template=ok, status="cancelled") == 1
    assert value(samples, finished, template=flaky, status="succeeded") == 1
    assert value(samples, finished, template=flaky, status="failed") == 0
    # Durations of the runs that started; the cancelled one never did.
    duration = "jobplane_run_duration_seconds_count"
    assert value(samples, duration, template=ok, status="succeeded") == 3
    assert value(samples, duration, template=flaky, status="succeeded") == 1
    assert value(samples, duration, template=ok, status="cancelled") == 0
    # A start delay per new run: the flaky run's second claim is a retry, not a start.
    assert value(samples, "jobplane_run_start_delay_seconds_count", queue=queue) == 4
    assert value(samples, "jobplane_run_start_delay_seconds_sum", queue=queue) >= 0
    assert value(samples, "jobplane_queue_depth", queue=queue, state="ready") == 0
    assert value(samples, "jobplane_queue_depth", queue=queue, state="delayed") == 0


async def test_starts_a_rate_window_refused_are_counted_with_their_wait(
    backends: Backends, settings: Settings, register: Register, client_for: Client
) -> None:
    """The worker's pop refuses two of three runs of a window of one start per 30 s: each is
    counted once, with the wait it was told."""
    queue = unique()
    rated = f"{queue}_rated"
    await register(rated, queue=queue, rateLimit={"limit": 1, "periodSeconds": 30})
    service = RunService(backends.store, backends.queue)
    ids = [(await service.create(RunRequest(rated, "user", "u", {}), "t"))[0].id for _ in "abc"]
    api = client_for(settings.admin_key or "")
    async with running(backends, settings.model_copy(update={"queues": [queue]})):
        await settled(backends.store, ids[:1])

        async def both_counted() -> bool:
            samples = await scrape(api)
            return value(samples, "jobplane_rate_limit_delays_total", template=rated) >= 2

        await until(both_counted)
    samples = await scrape(api)
    assert value(samples, "jobplane_rate_limit_delays_total", template=rated) == 2
    delays = "jobplane_rate_limit_delay_seconds"
    assert value(samples, f"{delays}_count", template=rated) == 2
    # Told to come back as the window frees, each a period after the one before: 30 s, 60 s.
    assert 85 < value(samples, f"{delays}_sum", template=rated) <= 90
    assert {(await service.get(i)).status for i in ids[1:]} == {RunStatus.QUEUED}


@pytest.fixture
async def clocked(settings: Settings) -> AsyncIterator[tuple[Backends, ManualClock]]:
    """Backends whose store reads a clock the test moves."""
    clock = ManualClock()
    async with open_backends(settings, clock) as opened:
        yield opened, clock


async def test_queue_depth_and_oldest_ready_age_for_a_known_backlog(
    clocked: tuple[Backends, ManualClock], settings: Settings
) -> None:
    backends, clock = clocked
    backlog, due_only = unique(), unique()
    for queue in (backlog, due_only):
        await backends.store.templates.register(template_spec(queue, queue=queue))
    now = clock.now()

    def created(seconds_ago: float) -> str:
        return str(ObjectId.from_datetime(now - timedelta(seconds=seconds_ago)))

    service = RunService(backends.store, backends.queue)
    for _ in range(2):  # real runs, created just now
        await service.create(RunRequest(backlog, "user", "u1"), "user:test")
    await backends.queue.push(
        [
            # The oldest waits behind a newer run of a higher priority: the age must not
            # come from the head of the line alone.
            QueueEntry(created(600), backlog, 0),
            QueueEntry(created(60), backlog, 9),
            QueueEntry(str(ObjectId()), backlog, 0, not_before=now + timedelta(seconds=10)),
            QueueEntry(str(ObjectId()), backlog, 0, not_before=now + timedelta(hours=1)),
            QueueEntry(str(ObjectId()), due_only, 0, not_before=now + timedelta(seconds=10)),
        ],
        now,
    )
    clock.advance(20)  # the 10 s delayed runs are due since 10 s, still in the delayed set

    transport = httpx.ASGITransport(app=create_app(settings, backends))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        samples = await scrape(client)

    depth, age = "jobplane_queue_depth", "jobplane_queue_oldest_ready_age_seconds"
    assert value(samples, depth, queue=backlog, state="ready") == 5
    assert value(samples, depth, queue=backlog, state="delayed") == 1
    # ObjectIds keep whole seconds: created 600 s before `now`, 20 s ago.
    assert 620 <= value(samples, age, queue=backlog) < 621
    assert value(samples, depth, queue=due_only, state="ready") == 1
    assert value(samples, depth, queue=due_only, state="delayed") == 0
    assert value(samples, age, queue=due_only) == 10  # from its notBefore, to the millisecond
    assert value(samples, depth, queue="default", state="ready") == 0
    assert value(samples, age, queue="default") == 0
    assert value(samples, "jobplane_backend_up", backend="mongodb") == 1
    assert value(samples, "jobplane_backend_up", backend="redis") == 1


async def test_liveness_of_workers_and_the_scheduler(
    backends: Backends, settings: Settings, register: Register, client: httpx.AsyncClient
) -> None:
    idle = await scrape(client)
    assert value(idle, "jobplane_workers_alive") == 0
    assert value(idle, "jobplane_scheduler_leader") == 0
    assert value(idle, "jobplane_scheduler_lock_ttl_seconds") == 0

    await register(steps=NAP)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "u")
    began = time.time()
    async with running(backends, settings, workers=2, scheduler=True):
        await stepping(backends, run.id)

        def live(s: Samples) -> bool:
            return (
                value(s, "jobplane_workers_alive") == 2
                and value(s, "jobplane_worker_runs_held") == 1  # as of the next heartbeat
                and value(s, "jobplane_scheduler_leader") == 1
                and value(s, "jobplane_scheduler_last_tick_timestamp_seconds") >= began
            )

        async with asyncio.timeout(20):
            # Polling: a scraper sees the platform from outside.
            while not live(samples := await scrape(client)):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        ttl = value(samples, "jobplane_scheduler_lock_ttl_seconds")
        assert 0 < ttl <= settings.scheduler_lock_seconds
        await service.cancel(run.id, "u", None)  # so the workers stop without a drain wait
        await settled(backends.store, [run.id])

    # Stopped cleanly: the workers' keys and the lock are gone at once, not at their TTLs.
    gone = await scrape(client)
    assert value(gone, "jobplane_workers_alive") == 0
    assert value(gone, "jobplane_worker_runs_held") == 0
    assert value(gone, "jobplane_scheduler_leader") == 0


async def test_reaper_actions_lease_expiries_and_stale_writes(
    backends: Backends, settings: Settings, register: Register, client: httpx.AsyncClient
) -> None:
    template = await register(unique())
    await run_in(backends.store, template, RunStatus.RUNNING)  # an attempt left: requeued
    await run_in(backends.store, template, RunStatus.RUNNING, attempt=3)  # none: expired
    before = await scrape(client)
    assert await Scheduler(backends.store, backends.queue, settings).reap() == 2
    after = await scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("jobplane_lease_expiries_total", template=template.type) == 2
    assert moved("jobplane_reaper_actions_total", action="reap_requeue") == 1
    assert moved("jobplane_reaper_actions_total", action="reap_expire") == 1
    assert moved("jobplane_runs_finished_total", template=template.type, status="expired") == 1

    # A worker whose lease was taken over: each of its writes after that is refused, recorded
    # as a `stale_write_rejected` event, and counted.
    await register(steps=NAP)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "u")
    before = await scrape(client)
    with worker_lines() as out:
        async with running(backends, settings) as [worker]:
            await stepping(backends, run.id)
            await raw(backends.store).runs.update_one(
                {"_id": ObjectId(run.id)}, {"$set": {"leaseToken": "someone-else"}}
            )
            async with asyncio.timeout(20):
                while run.id in worker.held:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
    after = await scrape(client)
    rejected = await raw(backends.store).events.count_documents(
        {"jobId": run.id, "type": "stale_write_rejected"}
    )
    assert rejected >= 1
    assert moved("jobplane_stale_writes_rejected_total") == rejected

    # The zombie's lines name the run, the worker and its lease (the prefix the claim recorded).
    [claim] = [e for e in await backends.store.trail.events_of(run.id) if e.to == RunStatus.RUNNING]
    lost = [line for line in out if "lease lost" in line["message"]]
    assert lost
    for line in lost:
        assert (line["run_id"], line["worker_id"]) == (run.id, worker.id)
        assert line["lease"] == claim.metadata["lease"]


@contextmanager
def worker_lines() -> Iterator[list[dict[str, Any]]]:
    """The worker's log lines, as the JSON objects a worker process writes."""
    out, logger, parsed = io.StringIO(), logging.getLogger("jobplane.worker"), []
    handler = logging.StreamHandler(out)
    handler.setFormatter(JSONFormatter())
    logger.addHandler(handler)
    try:
        yield parsed
    finally:
        logger.removeHandler(handler)
        parsed += [json.loads(line) for line in out.getvalue().splitlines()]


async def test_a_backend_down_is_reported_and_the_counters_still_served(
    backends: Backends, settings: Settings, client_for: Client
) -> None:
    down = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    cut_off = Backends(backends.store, RedisQueue(down, backends.queue.keys))
    transport = httpx.ASGITransport(app=create_app(settings, cut_off))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            samples = await scrape(client)
    finally:
        await down.aclose()
    assert value(samples, "jobplane_backend_up", backend="mongodb") == 1
    assert value(samples, "jobplane_backend_up", backend="redis") == 0
    # What Redis would have said is left out, not reported as zero; MongoDB's figures stay.
    from_redis = ("jobplane_queue_depth", "jobplane_queue_oldest", "jobplane_workers")
    assert not any(name.startswith(from_redis) for name, _ in samples)
    assert any(name == "jobplane_queue_started" for name, _ in samples)
    assert ("jobplane_stale_writes_rejected_total", frozenset()) in samples


async def test_schedule_fires_misfires_and_duplicates(
    backends: Backends, register: Register, client: httpx.AsyncClient
) -> None:
    template = await register(unique(), schedulable=True)
    schedules = ScheduleService(backends.store, backends.queue)
    spec = ScheduleSpec.model_validate(
        {
            "templateType": template.type,
            "scope": "user",
            "scopeId": "u1",
            "cron": "* * * * *",
            "misfirePolicy": "skip",
        }
    )
    schedule = await schedules.create(spec, "user:test")
    assert schedule.next_run_at is not None
    # Ten and a half minutes late: ten fire times were missed, the last is within the grace.
    late = schedule.next_run_at + timedelta(minutes=10, seconds=30)
    before = await scrape(client)
    assert await schedules.fire_due(late, 10, grace_seconds=60) == 1
    after = await scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("jobplane_schedule_misfires_total", policy="skip") == 10
    assert moved("jobplane_schedule_fires_total", outcome="created") == 1
    assert moved("jobplane_runs_created_total", template=template.type) == 1

    # A second scheduler that read the schedule before the first advanced it fires the same
    # time: the unique (scheduleId, scheduledFor) index turns it into the first run.
    before = after
    await schedules._fire(schedule, late, timedelta(seconds=60))
    after = await scrape(client)
    assert moved("jobplane_schedule_fires_total", outcome="duplicate") == 1
    assert moved("jobplane_schedule_fires_total", outcome="created") == 0
    assert moved("jobplane_runs_created_total", template=template.type) == 0


async def test_a_scheduler_process_serves_its_own_metrics_and_logs_json(
    settings: Settings, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "scheduler.log"
    proc = spawn(settings, "scheduler", log, JOBPLANE_METRICS_PORT=str(port))
    try:
        async with httpx.AsyncClient(base_url=f"http://{settings.host}:{port}") as client:
            async with asyncio.timeout(30):
                while True:  # until it serves and has ticked
                    assert proc.poll() is None, log.read_text()
                    try:
                        samples = await scrape(client)
                        if value(samples, "jobplane_scheduler_last_tick_timestamp_seconds"):
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
    finally:
        assert terminate(proc) == 0, log.read_text()
    # Its own counters only: the state gauges are the API's.
    assert ("jobplane_stale_writes_rejected_total", frozenset()) in samples
    assert not any(name.startswith("jobplane_queue_") for name, _ in samples)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
