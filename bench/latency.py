"""How long a run waits before its step starts, at a steady rate: enqueue-to-start, open loop.

Runs arrive on a fixed clock (`--rate` a second, 200 by default): the i-th create is issued at
start + i / rate whether or not the earlier ones have returned, so a slow platform cannot slow
the arrivals down (an open loop, as real producers are). Each create is `RunService.create`
in this process (the API's code path without HTTP), with the wall-clock time read just before
the call in its payload (`{"i": i, "t": t}`). The template has one step whose handler,
`bench.started`, returns the wall-clock time read first thing when it runs; the worker stores it
as the step's output. The figure per run is that output minus `payload.t`: from the create call
to the step handler starting, both on this machine's clock (`time.time()`).

The runs execute on W real `python -m jobplane worker` processes (JOBPLANE_WORKER_CONCURRENCY
C), which import this file as a handler module (JOBPLANE_HANDLERS=latency, with bench/ on their
PYTHONPATH), and a `jobplane scheduler` runs as in a deployment (its reconciler re-pushes runs
that Redis lost), as in bench/throughput.py's end-to-end workload. The first `--warmup` seconds
of arrivals are not measured. After the last arrival the benchmark waits until every run
succeeded, then reads the figures from MongoDB. Percentiles are nearest-rank. `--json` prints
them as the last line, one JSON object, for bench/peers/run.py.

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given; counters are server-wide, so give URLs only of servers nothing else uses.

    .venv/bin/python bench/latency.py [--rate R] [--seconds S] [--workers W] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's process registry, throwaway servers, counters and machine line are importable.
import throughput
from jobplane.model import TemplateSpec
from jobplane.runs.service import RunRequest
from jobplane.settings import Settings
from jobplane.store.database import Collections
from jobplane.worker import StepContext, handler
from throughput import Counters, Create, run_main

HANDLER_MODULE = "latency"  # this file, as the workers import it
TEMPLATE = TemplateSpec.model_validate(
    {"type": "bench_latency", "steps": [{"id": "only", "handler": "bench.started"}]}
)
LATENCY = "create call -> step handler started"


@handler("bench.started")
async def started(ctx: StepContext) -> dict[str, float]:
    """The step's whole work: note when it began (wall clock, comparable across processes)."""
    return {"startedAt": time.time()}


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


def line(values: Sequence[float]) -> str:
    quantiles = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
    return ", ".join(f"{label} {nearest_rank(values, q):.2f}" for label, q in quantiles) + " ms"


def request(i: int, sent: float) -> RunRequest:
    """The i-th run, created at `sent` (epoch seconds)."""
    return RunRequest("bench_latency", "system", "bench", {"i": i, "t": sent})


async def open_loop(
    create: Create,
    rate: float,
    count: int,
    make: Callable[[int, float], RunRequest] = request,
) -> tuple[list[float], float]:
    """Create runs 0..count-1 (`make(i, sent)`) at `rate` a second on a fixed clock, none
    waiting for another.

    Returns how long each create call took (seconds) and how late the latest call began
    after its arrival time (the producer's own lag; the figures do not include it)."""
    calls = [0.0] * count
    lag = 0.0

    async def one(i: int) -> None:
        sent = time.time()
        began = time.perf_counter()
        await create(make(i, sent))
        calls[i] = time.perf_counter() - began

    start = time.perf_counter()
    creates = []
    for i in range(count):
        due = start + i / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        lag = max(lag, time.perf_counter() - due)
        creates.append(asyncio.create_task(one(i)))
    await asyncio.gather(*creates)
    return calls, lag


@dataclass
class Bench(throughput.Bench):
    template: ClassVar[TemplateSpec] = TEMPLATE
    # The step whose handler's start is timed (bench/flows.py times a flow's last step).
    timed_step: ClassVar[str] = "only"

    def settings(self) -> Settings:
        return super().settings().model_copy(update={"handlers": [HANDLER_MODULE]})

    def timed_request(self, i: int, sent: float) -> RunRequest:
        """The i-th run of the open loop (bench/flow_control.py varies it)."""
        return request(i, sent)

    async def measure(self) -> dict[str, float]:
        a = self.args
        warm, measured = round(a.rate * a.warmup), round(a.rate * a.seconds)
        count = warm + measured
        async with (
            self.fresh() as (settings, backends, service),
            self.producer(settings, service) as create,
        ):
            self.procs.start(settings, "scheduler")
            self.start_workers(settings)
            await self.procs.workers_ready()
            await asyncio.sleep(0.5)  # let start-up settle so the workers are really idle
            before = await Counters.read(backends, settings, self.procs)
            began = time.perf_counter()
            calls, lag = await open_loop(create, a.rate, count, self.timed_request)
            await self.wait_succeeded(backends, settings, count)
            seconds = time.perf_counter() - began
            after = await Counters.read(backends, settings, self.procs)
            self.spent(LATENCY, before, after, count)
            latencies: dict[int, float] = {}
            step = self.timed_step
            projection = {"payload": 1, f"outputs.{step}.startedAt": 1}
            async for doc in Collections.of(backends.store.db).runs.find({}, projection):
                i = doc["payload"]["i"]
                latencies[i] = 1000 * (doc["outputs"][step]["startedAt"] - doc["payload"]["t"])
        if sorted(latencies) != list(range(count)):
            raise RuntimeError(f"{len(latencies)} runs found for {count} created")
        ms = [latencies[i] for i in range(warm, count)]
        print(f"  {measured} runs at {a.rate:g}/s after {warm} warm-up runs ({seconds:.1f} s)")
        print(f"  {LATENCY}: {line(ms)}")
        print(f"  create call returned:                {line([1000 * c for c in calls[warm:]])}")
        print(f"  creates began at most {1000 * lag:.2f} ms after their arrival time")
        for detail in before.per_run(after, count, seconds):
            print(f"      {detail}")
        return {
            "latency_p50_ms": nearest_rank(ms, 0.5),
            "latency_p90_ms": nearest_rank(ms, 0.9),
            "latency_p99_ms": nearest_rank(ms, 0.99),
            "latency_max_ms": max(ms),
            "producer_lag_max_ms": 1000 * lag,
        }


def configuration(bench: Bench) -> str:
    a, settings = bench.args, bench.settings()
    return (
        f"rate {a.rate:g}/s for {a.seconds:g} s after {a.warmup:g} s of warm-up, workers "
        f"{a.workers} x concurrency {a.concurrency}, write concern {a.write_concern}, poll "
        f"{settings.poll_seconds:g}s, lease {settings.lease_seconds:g}s"
    )


async def main_async(bench: Bench) -> None:
    await throughput.begin(bench, configuration(bench))
    figures = await bench.measure()
    if bench.args.json:
        print(json.dumps(figures), flush=True)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200, help="runs created a second")
    parser.add_argument("--seconds", type=float, default=10, help="measured seconds of arrivals")
    parser.add_argument("--warmup", type=float, default=2, help="seconds of arrivals not measured")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument("--json", action="store_true", help="end with the figures as JSON")
    parser.add_argument("--tracing", action="store_true", help=throughput.TRACING_HELP)
    args = parser.parse_args(argv)
    check_rate(parser, args)
    return args


def check_rate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rate <= 0 or args.seconds * args.rate < 1 or args.warmup < 0:
        parser.error("--rate and --seconds must give at least one measured run; --warmup >= 0")


def let_workers_import_this() -> None:
    """The workers import this file by name (JOBPLANE_HANDLERS); they inherit our environment."""
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)


def main() -> None:
    args = parse()
    let_workers_import_this()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
