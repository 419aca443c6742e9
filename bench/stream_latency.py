"""How soon a step's `progress()` reaches an open run stream: from the call to the SSE message.

Each run has one step, `bench.progress`, which calls `ctx.progress(p, message)` `--reports`
times, `--every` seconds apart (more than the worker's 0.25 s progress throttle, so that each
call is written at once), with the wall-clock time read just before the call as the message.
For each run this process opens `GET /v1/runs/{id}/stream` on a real `jobplane api` process
right after creating it, and for each message whose `progress.summary` is new takes the time
it arrived minus the time in it: call, fenced write to MongoDB, the API's change stream, its
read of the run, and the SSE message, on this machine's clock (`time.time()`). `--in-flight`
runs stream at once, on W real `python -m jobplane worker` processes. A call whose message is
superseded before the stream reads the run (a newer one arrived first) is counted as missed:
a stream sends the run as it is, not every write. A call made before its stream's first message
arrived is not counted (the stream was not open yet: its first message shows the call, however
late it opened); how long streams took to open, from the create's answer, is printed beside.
Percentiles are nearest-rank.

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given.

    .venv/bin/python bench/stream_latency.py [--runs N] [--in-flight K] [--reports R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import ClassVar

import aiohttp

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmarks' process registry, throwaway servers and machine line are importable.
import throughput
from jobplane.devstack import free_port
from jobplane.model import TemplateSpec
from jobplane.runs import RunService
from jobplane.runs.service import RunRequest
from jobplane.settings import Settings
from jobplane.worker import StepContext, handler
from latency import let_workers_import_this, line
from throughput import run_main

HANDLER_MODULE = "stream_latency"  # this file, as the workers import it
TEMPLATE = TemplateSpec.model_validate(
    {"type": "bench_progress", "steps": [{"id": "only", "handler": "bench.progress"}]}
)
ADMIN_KEY = "bench-admin-key"
GOAL_P99_MS = 250.0


@handler("bench.progress")
async def progress(ctx: StepContext) -> None:
    reports, every = int(ctx.payload["reports"]), float(ctx.payload["every"])
    await asyncio.sleep(every)  # the stream is open by now
    for i in range(reports):
        ctx.progress(100 * (i + 1) / (reports + 1), repr(time.time()))
        await asyncio.sleep(every)


@dataclass
class Outcome:
    latencies_ms: list[float]
    missed: int
    # From the create's answer to the stream's first message, each run.
    open_ms: list[float]
    # Calls made before the stream's first message arrived: that message shows them, but they
    # measure how soon a stream opens, not how soon a change reaches an open one.
    before_open: int


async def follow(
    http: aiohttp.ClientSession, service: RunService, reports: int, every: float
) -> Outcome:
    """One run, created and followed on its stream until it ends."""
    payload = {"reports": reports, "every": every}
    run, _ = await service.create(RunRequest("bench_progress", "system", "bench", payload), "b")
    created = time.time()
    opened: float | None = None
    latencies: list[float] = []
    seen: set[str] = set()
    before_open = 0
    async with http.get(f"/v1/runs/{run.id}/stream") as response:
        response.raise_for_status()
        async for raw in response.content:
            text = raw.decode()
            if not text.startswith("data:"):
                continue
            arrived = time.time()
            opened = opened or arrived
            summary = json.loads(text.removeprefix("data:"))["progress"].get("summary")
            if summary and summary not in seen:
                seen.add(summary)
                if float(summary) < opened:
                    before_open += 1
                else:
                    latencies.append(1000 * (arrived - float(summary)))
    open_ms = [1000 * (opened - created)] if opened else []
    return Outcome(latencies, reports - len(seen), open_ms, before_open)


@dataclass
class Bench(throughput.Bench):
    template: ClassVar[TemplateSpec] = TEMPLATE

    def settings(self) -> Settings:
        base = super().settings()
        return base.model_copy(
            update={"admin_key": ADMIN_KEY, "port": free_port(), "handlers": [HANDLER_MODULE]}
        )

    async def round(self) -> Outcome:
        a = self.args
        async with self.fresh() as (settings, _, service):
            self.procs.start(settings, "worker", a.workers)
            self.procs.start(settings, "api")
            url = f"http://{settings.host}:{settings.port}"
            await self.procs.api_ready(url)
            await self.procs.workers_ready()
            headers = {"authorization": f"Bearer {ADMIN_KEY}"}
            # aiohttp, not httpx: with 50 streams read at once, httpx's pool held each new
            # stream's request back here (create -> first message p50 250-320 ms, not 70).
            async with aiohttp.ClientSession(
                base_url=url,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_read=60),
                connector=aiohttp.TCPConnector(limit=a.in_flight + 4),
            ) as http:
                gate = asyncio.Semaphore(a.in_flight)

                async def one() -> Outcome:
                    async with gate:
                        return await follow(http, service, a.reports, a.every)

                outcomes = await asyncio.gather(*(one() for _ in range(a.runs)))
            self.procs.check()
        latencies = [ms for o in outcomes for ms in o.latencies_ms]
        missed = sum(o.missed for o in outcomes)
        opens = [ms for o in outcomes for ms in o.open_ms]
        before = sum(o.before_open for o in outcomes)
        print(f"  progress() -> stream message: {line(latencies)} ({len(latencies)} messages)")
        print(f"  mean {statistics.fmean(latencies):.2f} ms; superseded before sent: {missed}")
        print(f"  create -> the stream's first message: {line(opens)}")
        print(f"  calls made before their stream's first message (not counted): {before}")
        return Outcome(latencies, missed, opens, before)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--in-flight", type=int, default=50, help="runs streamed at once")
    parser.add_argument("--reports", type=int, default=10, help="progress calls per run")
    parser.add_argument("--every", type=float, default=0.3, help="seconds between the calls")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    return parser.parse_args(argv)


async def main_async(bench: Bench) -> None:
    a = bench.args
    print(throughput.machine())
    print(
        f"runs {a.runs}, {a.in_flight} streamed at once, {a.reports} progress calls each "
        f"{a.every:g} s apart, workers {a.workers} x concurrency {a.concurrency}, "
        f"write concern {a.write_concern}, repeat {a.repeat}"
    )
    everything: list[float] = []
    for r in range(a.repeat):
        print(f"round {r + 1}:", flush=True)
        everything += (await bench.round()).latencies_ms
    p99 = sorted(everything)[max(0, int(0.99 * len(everything) + 0.5) - 1)]
    verdict = "within" if p99 <= GOAL_P99_MS else "past"
    print(f"all rounds: {line(everything)}; p99 {verdict} the {GOAL_P99_MS:g} ms goal")


def main() -> None:
    args = parse()
    let_workers_import_this()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
