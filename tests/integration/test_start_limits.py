"""Limits a run passes as it starts: its template's `maxRunning` (MongoDB decides, whatever
Redis loses) and its `rateLimit` window."""

import asyncio
from datetime import datetime, timedelta
from pathlib import Path

from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.queue.entry import QueueEntry
from jobplane.queue.pop import Popped
from jobplane.runs import RunRequest, RunService
from jobplane.runs.admission.starts import NONE_HELD_SECONDS, Starts
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings
from jobplane.store.gates import SPARE_MIN_CAP
from jobplane.templates import load_file
from tests.conftest import sync_redis
from tests.integration.conftest import Register
from tests.integration.flow import peak, sampled, started, started_spans, until, workers
from tests.integration.workers import running, settled

SLEEP = [{"id": "work", "handler": "builtin.sleep"}]


async def create(service: RunService, template: str, n: int, **payload: object) -> list[str]:
    ids = []
    for i in range(n):
        request = RunRequest(template, "account", f"a{i % 3}", dict(payload))
        ids.append((await service.create(request, "user:t"))[0].id)
    return ids


async def test_no_more_than_max_running_runs_start_across_worker_processes_and_a_redis_wipe(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """32 worker slots, a template capped at 4 whose 30 runs come from three scopes, and
    Redis wiped in the middle: at no sampled moment, nor in the trails, are more than 4
    started; every run succeeds on its first attempt, claimed once."""
    await register("capped", maxRunning=4, steps=SLEEP)
    service = RunService(backends.store, backends.queue)
    ids = await create(service, "capped", 30, sleepSeconds=0.25)
    held = backends.queue.keys.held("capped")
    held_peak = 0

    async def held_now() -> bool:
        nonlocal held_peak
        held_peak = max(held_peak, await backends.queue.redis.zcard(held))
        return held_peak > 0

    filters = {"started": started({"templateType": "capped"})}
    async with sampled(backends.store, filters) as peaks, workers(settings, tmp_path):
        await until(held_now, 60)
        await asyncio.sleep(0.5)
        with sync_redis(settings.redis_url or "") as redis:
            redis.flushall()
        runs = await settled(backends.store, ids, within=120)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert {r.attempt for r in runs} == {1}
    assert peaks["started"] == 4
    assert peak(await started_spans(backends.store, ids)) == 4
    for run in runs:
        transitions = [
            e.metadata.get("transition")
            for e in await backends.store.trail.events_of(run.id)
            if e.type == "status_changed"
        ]
        assert transitions == ["claim_limited", "complete"], (run.id, transitions)


async def test_a_large_cap_with_spare_places_holds_across_worker_processes_and_a_redis_wipe(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """A cap large enough for spare places (`store/gates.py`): 96 slots in two worker
    processes, each keeping spares of its own, 200 runs of a template capped at 64 and Redis
    wiped in the middle. Never more than 64 started, sampled or in the trails; every run
    succeeds on its first attempt; once the workers stop, their spares are back."""
    cap = SPARE_MIN_CAP
    await register("capped", maxRunning=cap, steps=SLEEP)
    service = RunService(backends.store, backends.queue)
    ids = await create(service, "capped", 200, sleepSeconds=0.3)
    filters = {"started": started({"templateType": "capped"})}
    async with (
        sampled(backends.store, filters) as peaks,
        workers(settings, tmp_path, JOBPLANE_WORKER_CONCURRENCY="48"),
    ):
        await until(lambda: more_than(backends, "capped", 32), 60)
        with sync_redis(settings.redis_url or "") as redis:
            redis.flushall()
        runs = await settled(backends.store, ids, within=180)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert {r.attempt for r in runs} == {1}
    assert peaks["started"] <= cap
    assert peak(await started_spans(backends.store, ids)) <= cap
    assert await backends.store.gates.admitted("capped") == 0


async def more_than(backends: Backends, template_type: str, n: int) -> bool:
    return await backends.store.gates.admitted(template_type) > n


async def test_a_held_run_says_why_and_goes_as_soon_as_a_place_frees(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register("capped", maxRunning=1, steps=SLEEP)
    service = RunService(backends.store, backends.queue)
    first, second = await create(service, "capped", 2, sleepSeconds=1)
    waiting = Waiting(backends.store, backends.queue, max_age=0)
    async with running(backends, settings):

        async def held() -> bool:
            [run] = await waiting.explain([await service.get(second)])
            return run.waiting_for is not None and run.waiting_for.reason != "handler"

        await until(held)
        [run] = await waiting.explain([await service.get(second)])
        assert run.waiting_for is not None
        assert (run.waiting_for.reason, run.waiting_for.detail) == (
            "max_running",
            "1 runs of it have started",
        )
        done = await settled(backends.store, [first, second], within=30)
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}
    assert done[0].completed_at and done[1].started_at
    gap = (done[1].started_at - done[0].completed_at).total_seconds()
    assert 0 <= gap < 1, "the end of the first let the second go at once, not at a tick"


def most_in_a_window(starts: list[datetime], period: float) -> int:
    """The most starts in any `period` seconds (a window [t, t + period))."""
    ordered = sorted(starts)
    return max(sum(1 for s in ordered if t <= s < t + timedelta(seconds=period)) for t in ordered)


async def test_no_rate_window_holds_more_than_its_limit_of_starts(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """A rate limit of 5 a second per partner, 20 runs for each of two partners, two worker
    processes: no second of either partner's starts holds more than 5, the partners go side
    by side, and every run succeeds on its first attempt."""
    limit = {"limit": 5, "periodSeconds": 1, "key": ["payload.partner"]}
    await register("rated", rateLimit=limit)
    service = RunService(backends.store, backends.queue)
    ids = {p: await create(service, "rated", 20, partner=p) for p in ("acme", "globex")}
    async with workers(settings, tmp_path):
        runs = {p: await settled(backends.store, i, within=120) for p, i in ids.items()}
    for partner, done in runs.items():
        assert {r.status for r in done} == {RunStatus.SUCCEEDED}
        assert {r.attempt for r in done} == {1}
        starts = [r.started_at for r in done if r.started_at]
        assert len(starts) == 20
        assert most_in_a_window(starts, 1.0) == 5, partner
        span = (max(starts) - min(starts)).total_seconds()
        assert span >= 3 - 0.01, "20 starts at 5 a second take at least 3 seconds"
    together = [r.started_at for done in runs.values() for r in done if r.started_at]
    assert most_in_a_window(together, 1.0) > 5, "each partner has its own window"


async def test_a_run_sent_back_by_its_rate_window_says_until_when(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register("rated", rateLimit={"limit": 1, "periodSeconds": 30})
    service = RunService(backends.store, backends.queue)
    first, second = await create(service, "rated", 2)
    waiting = Waiting(backends.store, backends.queue, max_age=0)
    async with running(backends, settings):
        await settled(backends.store, [first], within=30)

        async def sent_back() -> bool:
            [run] = await waiting.explain([await service.get(second)])
            return run.waiting_for is not None and run.waiting_for.reason != "handler"

        await until(sent_back)
        [run] = await waiting.explain([await service.get(second)])
    assert run.status == RunStatus.QUEUED and run.attempt == 0
    assert run.waiting_for is not None and run.waiting_for.reason == "rate_limit"
    assert run.waiting_for.detail.startswith("1 starts per 30 s; tries again at ")


async def test_a_rated_run_reaches_a_claim_only_past_its_window(
    backends: Backends, register: Register
) -> None:
    """A window is taken by the pop alone. A rated run claimed without it (by id, or popped by a
    blocking pop from the ready set an older version queued it in) is not claimed: it goes back
    to its lane's rated set, and the next pop takes its window."""
    await register("rated", rateLimit={"limit": 1, "periodSeconds": 30})
    service = RunService(backends.store, backends.queue)
    first, second = await create(service, "rated", 2)
    queue, starts = backends.queue, Starts(backends.store, backends.queue)

    async def claimed(run_ids: list[str], popped: Popped | None = None) -> list[str]:
        return [
            run.id async for batch in starts.claim(run_ids, "w", 30, popped) for run, _ in batch
        ]

    assert await claimed([first, second]) == []
    # As an older version queued it: in the ready set a blocking pop takes from.
    entry = QueueEntry.of(await service.get(first))
    lane, handlers = [entry.queue], [entry.handler] if entry.handler else []
    await queue.remove(entry)
    await queue.redis.zadd(queue.keys.queue(entry.queue, entry.handler), {entry.member: 0})
    legacy = await queue.pop(lane, 1, backends.store.clock.now(), 1, handlers)
    assert (legacy.run_ids, legacy.windows) == ([first], {})
    assert await claimed(legacy.run_ids, legacy) == []
    assert await queue.missing([entry]) == [], "back in its rated set"
    popped = await queue.pop(lane, 5, backends.store.clock.now(), handlers=handlers)
    assert popped.windows == {first: True} and len(popped.refused) == 1
    assert await claimed(popped.run_ids, popped) == [first]
    assert (await service.get(second)).status == RunStatus.QUEUED


async def test_the_shipped_flow_control_template_runs(
    backends: Backends, settings: Settings
) -> None:
    """`templates/partner_sync.yaml`: a key limit, maxRunning, a rate limit, round robin and a
    lock, all at once, with the built-in handlers."""
    spec = load_file(Path(__file__).parents[2] / "templates" / "partner_sync.yaml")
    await backends.store.templates.register(spec)
    service = RunService(backends.store, backends.queue)
    ids = [
        (
            await service.create(
                RunRequest(
                    "partner_sync", "account", f"a{i % 2}", {"partner": p, "sleepSeconds": 0.1}
                ),
                "user:t",
            )
        )[0].id
        for i in range(6)
        for p in ("acme", "globex")
    ]
    async with running(backends, settings, scheduler=True):
        runs = await settled(backends.store, ids, within=60)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert {r.attempt for r in runs} == {1}


async def test_ends_that_found_none_held_skip_asking_redis_for_a_moment_only(
    backends: Backends, register: Register
) -> None:
    """An end that found none of its template's runs held spares the next ends of this process
    the question for `NONE_HELD_SECONDS`: a run another process held back meanwhile is let go
    by the first end after that."""
    await register("capped", maxRunning=1)
    service = RunService(backends.store, backends.queue)
    ended_id, held_id = await create(service, "capped", 2)
    ended, held = await service.get(ended_id), await service.get(held_id)
    starts = Starts(backends.store, backends.queue)
    await starts.freed(ended)
    await backends.queue.limits.hold([QueueEntry.of(held)])  # by another process
    await starts.freed(ended)
    assert await backends.queue.limits.holding([QueueEntry.of(held)]) == {held_id}
    await asyncio.sleep(NONE_HELD_SECONDS)
    await starts.freed(ended)
    assert await backends.queue.limits.holding([QueueEntry.of(held)]) == set()
