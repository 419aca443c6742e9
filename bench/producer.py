"""How many runs a second one producer process creates through `jobplane.Client`.

No worker runs: what is measured is the producer's path, from the call to its return with the
run durable in MongoDB (`majority` by default) and pushed to Redis. For each transport, each
workload gets a fresh database and Redis prefix with one template (a `builtin.noop` step):

callers     N creates from C concurrent callers (a closed loop: each caller makes its next call
            when the last one returned), one run per call.
batches     B runs in one `create_many` call: chunks of 1,000, a few in flight at once.
sequential  a smaller sample, strictly one create after another: the latency of one create.

direct      `Client(mongodb_url=..., redis_url=...)` in this process: `RunService` directly,
            concurrent creates sharing MongoDB and Redis writes (the store's group commit).
http        `Client(url=..., api_key=...)` against a real `python -m jobplane api` process
            (the bootstrap admin key; one keep-alive pool in the client).

A window runs from the first call until the client is closed after the last return (in direct
mode closing waits for the store's deferred writes, the event copies); after it the
script checks that MongoDB holds every run. CPU seconds of this process (`bench`), the API
process, mongod and redis are printed per window with the machine's total: "others" is CPU that
processes this benchmark did not start took meanwhile, so a busy neighbour shows. The seconds
this process spent in Python's collector are printed too: this process is the application's,
on asyncio with Python's collector settings, unless `--tuned-collector` applies what
docs/operations.md suggests to a busy producer (`jobplane.process.tune_collector()`).

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given.

    .venv/bin/python bench/producer.py [--runs N] [--batch-runs B] [--sequential-runs S]
                                       [--callers C] [--transport direct|http|both] [--repeat K]
                                       [--tuned-collector]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import jobplane.process
from jobplane import Client, CreateRequest
from jobplane.backends import open_backends
from jobplane.devstack.servers import free_port
from jobplane.model import TemplateSpec
from jobplane.settings import Settings
from jobplane.store.database import Collections

# bench/ is not a package: Python puts a script's own folder first on sys.path.
from throughput import Processes, machine, run_main

TEMPLATE = TemplateSpec.model_validate(
    {"type": "bench_noop", "steps": [{"id": "only", "handler": "builtin.noop"}]}
)


@dataclass
class Bench:
    args: argparse.Namespace
    mongo_url: str
    redis_url: str
    procs: Processes

    def settings(self) -> Settings:
        return Settings(
            mongodb_url=self.mongo_url,
            redis_url=self.redis_url,
            db=f"bench_{secrets.token_hex(4)}",
            redis_prefix=f"bench{secrets.token_hex(4)}:",
            write_concern=self.args.write_concern,
            admin_key=secrets.token_urlsafe(16),
            port=free_port(),
            log_format="json",
        )

    @contextlib.asynccontextmanager
    async def client(self, transport: str) -> AsyncIterator[tuple[Client, Settings]]:
        """A client of a fresh database with the template, and (http) an API process."""
        settings = self.settings()
        async with open_backends(settings) as backends:
            await backends.store.templates.register(TEMPLATE)
        try:
            client = await self.procs.client(settings, http=transport == "http")
            async with client:
                yield client, settings
        finally:
            self.procs.stop()
            async with open_backends(settings) as backends:
                await backends.store.client.drop_database(settings.db)


@dataclass
class CollectorTime:
    """Seconds this process spent in Python's collector (a `gc.callbacks` entry)."""

    seconds: float = 0.0
    began: float = 0.0

    def observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.began


collector_time = CollectorTime()


async def callers(client: Client, runs: int, concurrency: int) -> None:
    left = runs

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.create("bench_noop", scope="system", scope_id="bench")

    await asyncio.gather(*(caller() for _ in range(concurrency)))


async def batches(client: Client, runs: int) -> None:
    request = CreateRequest("bench_noop", "system", "bench")
    results = await client.create_many([request] * runs)
    refused = [r for r in results if isinstance(r, Exception)]
    if refused:
        raise RuntimeError(f"{len(refused)} runs refused, first: {refused[0]!r}")


async def sequential(client: Client, runs: int) -> None:
    for _ in range(runs):
        await client.create("bench_noop", scope="system", scope_id="bench")


async def window(
    bench: Bench,
    transport: str,
    runs: int,
    work: Callable[[Client], Awaitable[None]],
) -> float:
    """Runs a second of one workload on a fresh database; prints the window's CPU use."""
    async with bench.client(transport) as (client, settings):
        # One call first: connections and the template cache are warm, as in a running app.
        await client.create("bench_noop", scope="system", scope_id="warm-up")
        before, start = bench.procs.cpu(), time.perf_counter()
        collected = collector_time.seconds
        await work(client)
        # Closing waits for this process's deferred writes (direct: the event copies the
        # creates caused), so the window holds all the work they cost.
        await client.close()
        seconds = time.perf_counter() - start
        after = bench.procs.cpu()
        async with open_backends(settings) as backends:
            stored = await Collections.of(backends.store.db).runs.count_documents(
                {"scopeId": "bench"}
            )
    if stored != runs:
        raise RuntimeError(f"{runs} runs created, {stored} in MongoDB")
    used = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    ours = sum(v for k, v in used.items() if k != "machine")
    used["others"] = max(0.0, used.pop("machine") - ours)
    cpu = " ".join(f"{k} {v:.1f}" for k, v in sorted(used.items()) if v >= 0.05)
    gc_seconds = collector_time.seconds - collected
    print(
        f"  {runs / seconds:9,.0f} runs/s  {runs} runs in {seconds:.2f} s  cpu s: {cpu}"
        f" (of which this process's collector {gc_seconds:.2f})"
    )
    return runs / seconds


async def main_async(bench: Bench) -> None:
    a = bench.args
    if a.tuned_collector:
        jobplane.process.tune_collector()
    gc.callbacks.append(collector_time.observe)
    print(machine())
    setting = "tuned (jobplane.process.tune_collector)" if a.tuned_collector else "Python's"
    print(
        f"runs {a.runs} (callers {a.callers}), batch runs {a.batch_runs}, sequential "
        f"{a.sequential_runs}, write concern {a.write_concern}, repeat {a.repeat}, "
        f"collector {setting}\n"
        f"mongodb {bench.mongo_url}, redis {bench.redis_url}\n",
        flush=True,
    )
    transports = ["direct", "http"] if a.transport == "both" else [a.transport]
    workloads: list[tuple[str, int, Callable[[Client], Awaitable[None]]]] = [
        (f"{a.callers} callers", a.runs, lambda c: callers(c, a.runs, a.callers)),
        ("create_many", a.batch_runs, lambda c: batches(c, a.batch_runs)),
        ("sequential", a.sequential_runs, lambda c: sequential(c, a.sequential_runs)),
    ]
    figures: dict[str, list[float]] = {}
    for _ in range(a.repeat):
        for transport in transports:
            for name, runs, work in workloads:
                label = f"{transport}: {name}"
                print(label, flush=True)
                figures.setdefault(label, []).append(await window(bench, transport, runs, work))
    print(f"\n{'workload':28} {'median':>9} {'min':>9} {'max':>9}  each (runs/s)")
    for label, rates in figures.items():
        each = " ".join(f"{r:,.0f}" for r in rates)
        print(
            f"{label:28} {statistics.median(rates):9,.0f} {min(rates):9,.0f} {max(rates):9,.0f}"
            f"  {each}"
        )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs of the callers workload")
    parser.add_argument("--batch-runs", type=int, default=20000, help="runs in create_many")
    parser.add_argument("--sequential-runs", type=int, default=500)
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--transport", choices=["direct", "http", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write-concern", default="majority")
    parser.add_argument("--mongodb-url", help="a MongoDB of your own (default: a throwaway one)")
    parser.add_argument("--redis-url", help="a Redis of your own (default: a throwaway one)")
    parser.add_argument(
        "--tuned-collector",
        action="store_true",
        help="set this process's collector as docs/operations.md suggests for busy producers",
    )
    return parser.parse_args()


def main() -> None:
    args = parse()

    def start(mongo: str, redis: str, procs: Processes) -> Coroutine[Any, Any, None]:
        return main_async(Bench(args, mongo, redis, procs))

    # This process is an application's, on asyncio's event loop.
    run_main(args, start, asyncio.run)


if __name__ == "__main__":
    main()
