"""What the flow-control tests share: real worker processes, a sampler of MongoDB, and the
spans each run spent started, read back from the runs' trails.

Each property is checked twice: by sampling MongoDB while the runs go (the issue's "at no
sampled moment"), and afterwards from MongoDB's own record of every run's moves, which misses
no moment between two samples.
"""

import asyncio
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jobplane.model import LEASED, RunStatus
from jobplane.settings import Settings
from jobplane.store import Store
from tests.integration.db import raw
from tests.integration.processes import spawn, terminate

Doc = dict[str, Any]


@asynccontextmanager
async def workers(
    settings: Settings, logs: Path, count: int = 2, *, scheduler: bool = True, **env: str
) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """`count` `jobplane worker` processes (and a `jobplane scheduler`) until the block ends."""
    procs = [
        spawn(settings, "worker", logs / f"worker-{i}.log", JOBPLANE_WORKER_ID=f"w{i}", **env)
        for i in range(count)
    ]
    if scheduler:
        procs.append(spawn(settings, "scheduler", logs / "scheduler.log"))
    try:
        yield procs
    finally:
        for proc in procs:
            terminate(proc)


async def until(holds: Callable[[], Awaitable[bool]], within: float = 30) -> None:
    """Wait until `holds()` is true, looking every 50 ms; fails the test after `within` s."""
    async with asyncio.timeout(within):
        while True:
            if await holds():
                return
            await asyncio.sleep(0.05)


@asynccontextmanager
async def sampled(
    store: Store, filters: dict[str, Doc], every: float = 0.02
) -> AsyncIterator[dict[str, int]]:
    """The largest number of runs each named filter matched, sampled every `every` seconds
    while the block runs (and once more at its end)."""
    runs = raw(store).runs
    peaks = dict.fromkeys(filters, 0)
    stop = asyncio.Event()

    async def sample() -> None:
        # One snapshot for all: a plain read may count a run twice when its status moves
        # further along the index the count is scanning.
        async with runs.database.client.start_session(snapshot=True) as session:
            for name, query in filters.items():
                count = await runs.count_documents(query, session=session)
                peaks[name] = max(peaks[name], count)

    async def loop() -> None:
        while not stop.is_set():
            await sample()
            await asyncio.sleep(every)

    task = asyncio.create_task(loop())
    try:
        yield peaks
    finally:
        stop.set()
        await task
        await sample()


def started(filter_: Doc) -> Doc:
    """`filter_`'s runs while started: running, waiting for an external worker, or asked to
    cancel (what `maxRunning` counts)."""
    return {**filter_, "status": {"$in": sorted(LEASED)}}


@dataclass(frozen=True)
class Span:
    run_id: str
    start: datetime
    end: datetime


async def started_spans(store: Store, run_ids: Iterable[str]) -> list[Span]:
    """Each span a run spent started, from its trail: from a claim until the move that took
    it out of the started statuses."""
    spans: list[Span] = []
    for run_id in run_ids:
        begun: datetime | None = None
        for event in await store.trail.events_of(run_id):
            if event.type != "status_changed":
                continue
            if event.to in LEASED and begun is None:
                begun = event.create_at
            elif event.to not in LEASED and begun is not None:
                spans.append(Span(run_id, begun, event.create_at))
                begun = None
        assert begun is None, f"run {run_id} never left its started statuses"
    return spans


def peak(spans: Sequence[Span]) -> int:
    """The most spans open at one instant (one that ends as another starts is not open)."""
    edges = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    open_, most = 0, 0
    for _, change in edges:
        open_ += change
        most = max(most, open_)
    return most


def statuses(runs: Iterable[Any]) -> set[RunStatus]:
    return {r.status for r in runs}
