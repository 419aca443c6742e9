"""Running workers and schedulers inside a test, and waiting for runs to settle."""

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from jobplane.backends import Backends
from jobplane.model import TERMINAL, Run
from jobplane.runs import RunRequest, RunService
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.store import MongoStore
from jobplane.worker import Worker


@asynccontextmanager
async def running(
    backends: Backends, settings: Settings, workers: int = 1, scheduler: bool = False
) -> AsyncIterator[list[Worker]]:
    """Workers (and a scheduler) on this event loop until the block ends."""
    stop = asyncio.Event()
    started = [Worker(backends.store, backends.queue, settings) for _ in range(workers)]
    tasks = [asyncio.create_task(w.run(stop, drain_seconds=5)) for w in started]
    if scheduler:
        tasks.append(
            asyncio.create_task(Scheduler(backends.store, backends.queue, settings).run(stop))
        )
    try:
        yield started
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        # As a worker process does on exit: its events are all in `job_events` once it stops.
        await backends.store.trail.flush()


async def settled(store: MongoStore, run_ids: Iterable[str], within: float = 60) -> list[Run]:
    """Wait until every run is terminal; fails the test after `within` seconds."""
    ids = list(run_ids)
    async with asyncio.timeout(within):
        while True:
            runs = [await store.runs.get(i) for i in ids]
            if all(r is not None and r.status in TERMINAL for r in runs):
                return [r for r in runs if r is not None]
            await asyncio.sleep(0.05)


async def create_many(service: RunService, request: RunRequest, n: int, actor: str) -> list[str]:
    """Create `n` runs of `request`, 64 at a time; their ids in creation order."""
    gate = asyncio.Semaphore(64)

    async def create() -> str:
        async with gate:
            return (await service.create(request, actor))[0].id

    return await asyncio.gather(*(create() for _ in range(n)))
