"""How long a cancel takes to stop a running step: from the cancel call to `cancelled`.

Each run has one `builtin.sleep` step (payload `sleepSeconds`, 30 by default: it never ends by
itself) and runs on W real `python -m jobplane worker` processes. K runs are in flight at a
time: for each, this process creates the run, waits until its step is `running` (the worker
wrote the step's start), then calls `RunService.cancel` in process (the API's code path without
HTTP; it moves the run to `cancel_requested` and publishes the Redis cancel signal). The worker
sees the signal, its handler stops at its next checkpoint (`builtin.sleep` checks every 0.1 s),
and it acknowledges the cancel: `cancelled`, with `completedAt` set by the worker.

The latency is taken from the run document, not by polling: `completedAt` minus the wall-clock
time read just before the cancel call (both clocks are this machine's; MongoDB keeps
milliseconds, so a figure may be up to 1 ms short). The benchmark polls MongoDB only to know
when a run is running or done: one `find` by id for all runs in flight every `--poll` seconds,
so the poll interval does not enter the figures. Also shown: how long the cancel call took to
return (`cancel_requested`), and `cancelRequestedAt` to `completedAt` (the worker's part).
Percentiles are nearest-rank. No scheduler runs, so every cancel is finished by the worker that
holds the run, never by the reaper's grace timeout.

Before and after the measured runs the benchmark reads the same counters as `throughput.py`
and prints the cost of one run (create, claim, step start, cancel, acknowledgement); "others" is
CPU that processes this benchmark did not start took meanwhile.

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given; counters are server-wide, so give URLs only of servers nothing else uses.

    .venv/bin/python bench/cancel_latency.py [--runs N] [--in-flight K] [--workers W]
                                             [--concurrency C] [--sleep-seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

from bson import ObjectId

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's process registry, throwaway servers, counters and machine line are importable.
import throughput
from jobplane.backends import Backends
from jobplane.model import TERMINAL, RunStatus, TemplateSpec
from jobplane.runs import RunService
from jobplane.runs.service import RunRequest
from jobplane.store.database import Collections
from throughput import Counters, run_main

TEMPLATE = TemplateSpec.model_validate(
    {"type": "bench_sleep", "steps": [{"id": "nap", "handler": "builtin.sleep"}]}
)
ACTOR = "user:bench"
GOAL_P99_MS = 500.0
# What the watcher reads of each run: enough to tell running, done and when.
WATCHED = {"status": 1, "progress.steps.status": 1, "completedAt": 1, "cancelRequestedAt": 1}
Doc = dict[str, Any]


# -- watching runs ---------------------------------------------------------------------------------


class Watcher:
    """One poller for every run in flight: a `find` by ids each `interval` seconds, rather than
    a query per run, so that watching costs MongoDB little while it serves the workers."""

    def __init__(self, backends: Backends, interval: float) -> None:
        self.runs = Collections.of(backends.store.db).runs
        self.interval = interval
        self.waiting: dict[str, tuple[Callable[[Doc], bool], asyncio.Future[Doc]]] = {}

    async def until(self, run_id: str, ok: Callable[[Doc], bool]) -> Doc:
        """The run's document once `ok` holds for it, or once the run is over."""
        done: asyncio.Future[Doc] = asyncio.get_running_loop().create_future()
        self.waiting[run_id] = (ok, done)
        return await done

    async def run(self) -> None:
        while True:
            if self.waiting:
                ids = [ObjectId(i) for i in self.waiting]
                async for doc in self.runs.find({"_id": {"$in": ids}}, WATCHED):
                    run_id = str(doc["_id"])
                    waiter = self.waiting.get(run_id)
                    if waiter and (waiter[0](doc) or doc["status"] in TERMINAL):
                        del self.waiting[run_id]
                        waiter[1].set_result(doc)
            await asyncio.sleep(self.interval)


def stepping(doc: Doc) -> bool:
    steps = doc.get("progress", {}).get("steps", [])
    running = any(s.get("status") == "running" for s in steps)
    return doc["status"] == RunStatus.RUNNING and running


def over(doc: Doc) -> bool:
    return doc["status"] in TERMINAL


# -- one measurement -------------------------------------------------------------------------------


@dataclass
class Sample:
    total_ms: float  # just before the cancel call -> completedAt
    call_ms: float  # the cancel call, until it returned
    worker_ms: float  # cancelRequestedAt -> completedAt


@dataclass
class Samples:
    items: list[Sample] = field(default_factory=list)

    def ms(self, name: str, quantile: float) -> float:
        """Nearest rank; 1.0 is the maximum."""
        values: list[float] = sorted(getattr(s, name) for s in self.items)
        return values[max(1, math.ceil(quantile * len(values))) - 1]

    def line(self, name: str) -> str:
        quantiles = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        figures = ", ".join(f"{label} {self.ms(name, q):7.1f}" for label, q in quantiles)
        mean = sum(getattr(s, name) for s in self.items) / len(self.items)
        return f"{figures}, mean {mean:7.1f} ms"


async def cancel_one(service: RunService, watcher: Watcher, sleep_seconds: float) -> Sample:
    request = RunRequest("bench_sleep", "system", "bench", {"sleepSeconds": sleep_seconds})
    run, _ = await service.create(request, ACTOR)
    doc = await watcher.until(run.id, stepping)
    if not stepping(doc):
        raise RuntimeError(f"run {run.id} ended {doc['status']} before it was cancelled")
    asked = datetime.now(UTC)
    started = time.perf_counter()
    returned = await service.cancel(run.id, ACTOR, "bench")
    call = time.perf_counter() - started
    # The worker may acknowledge before the call reads the run back: `cancelled` already.
    if returned.status not in (RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED):
        raise RuntimeError(f"run {run.id}: cancel returned {returned.status}")
    doc = await watcher.until(run.id, over)
    if doc["status"] != RunStatus.CANCELLED:
        raise RuntimeError(f"run {run.id} ended {doc['status']}, not cancelled")
    # BSON dates come back as naive UTC unless the client is tz-aware; the store's client is.
    completed: datetime = doc["completedAt"]
    requested: datetime = doc["cancelRequestedAt"]
    return Sample(
        total_ms=1000 * (completed - asked).total_seconds(),
        call_ms=1000 * call,
        worker_ms=1000 * (completed - requested).total_seconds(),
    )


async def cancel_many(
    service: RunService, watcher: Watcher, n: int, in_flight: int, sleep_seconds: float
) -> Samples:
    """`n` runs, `in_flight` at a time, each cancelled once its step runs."""
    todo = iter(range(n))
    samples = Samples()

    async def slot() -> None:
        for _ in todo:
            samples.items.append(await cancel_one(service, watcher, sleep_seconds))

    await asyncio.gather(*(slot() for _ in range(min(in_flight, n))))
    return samples


# -- the benchmark ---------------------------------------------------------------------------------


@dataclass
class Bench(throughput.Bench):
    template: ClassVar[TemplateSpec] = TEMPLATE

    async def round(self) -> Samples:
        a = self.args
        async with self.fresh() as (settings, backends, service):
            self.procs.start(settings, "worker", a.workers)
            await self.procs.workers_ready()
            watcher = Watcher(backends, a.poll)
            watching = asyncio.create_task(watcher.run())
            try:
                if a.warmup:
                    await cancel_many(service, watcher, a.warmup, a.in_flight, a.sleep_seconds)
                before = await Counters.read(backends, settings, self.procs)
                began = time.perf_counter()
                samples = await cancel_many(service, watcher, a.runs, a.in_flight, a.sleep_seconds)
                seconds = time.perf_counter() - began
                await backends.store.trail.flush()
                after = await Counters.read(backends, settings, self.procs)
                self.procs.check()
            finally:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching
            print(f"  {a.runs} runs cancelled in {seconds:.2f} s", flush=True)
            print(f"  cancel -> cancelled            {samples.line('total_ms')}")
            print(f"  cancel call returned           {samples.line('call_ms')}")
            print(f"  cancelRequestedAt -> cancelled {samples.line('worker_ms')}")
            for detail in before.per_run(after, a.runs, seconds):
                print(f"      {detail}")
            return samples


def configuration(bench: Bench) -> str:
    a, settings = bench.args, bench.settings()
    return (
        f"runs {a.runs} (warm-up {a.warmup}), in flight {a.in_flight}, workers {a.workers} x "
        f"concurrency {a.concurrency}, sleepSeconds {a.sleep_seconds:g}, poll {a.poll:g}s, "
        f"write concern {a.write_concern}, lease {settings.lease_seconds:g}s, heartbeat "
        f"{settings.heartbeat_seconds:g}s, repeat {a.repeat}"
    )


async def main_async(bench: Bench) -> None:
    await throughput.begin(bench, configuration(bench))
    rounds: list[Samples] = []
    for i in range(bench.args.repeat):
        print(f"round {i + 1} of {bench.args.repeat}", flush=True)
        rounds.append(await bench.round())
    every = Samples([s for r in rounds for s in r.items])
    p99 = every.ms("total_ms", 0.99)
    verdict = "met" if p99 < GOAL_P99_MS else "NOT met"
    print(f"\nall rounds, {len(every.items)} runs, cancel -> cancelled: {every.line('total_ms')}")
    print(f"goal p99 < {GOAL_P99_MS:.0f} ms: {verdict} (p99 {p99:.1f} ms)")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="measured runs per round")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured runs first")
    parser.add_argument("--in-flight", type=int, default=20, help="runs running at a time")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=16, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--sleep-seconds", type=float, default=30, help="payload.sleepSeconds")
    parser.add_argument("--poll", type=float, default=0.02, help="watcher interval, seconds")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    if min(args.runs, args.in_flight, args.workers, args.concurrency, args.repeat) < 1:
        parser.error("--runs, --in-flight, --workers, --concurrency and --repeat must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.in_flight > args.workers * args.concurrency:
        # Runs beyond the workers' slots would wait in the queue: fewer than K would run.
        parser.error("--in-flight may not exceed --workers x --concurrency")
    return args


def main() -> None:
    args = parse()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
