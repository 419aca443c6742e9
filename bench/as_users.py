"""Headline figures as users get them: jobplane's processes at their defaults, the public Client.

Each set-up is a way of running the same two workloads, both from bench/throughput.py and
bench/latency.py, on a fresh database and Redis prefix with fresh processes:

e2e       W `python -m jobplane worker` processes and a `jobplane scheduler` idle, then N no-op
          runs created by 32 concurrent callers while the workers drain them. Window: just
          before the first create to the last `completedAt` (as throughput.py's end to end).
latency   runs created on a fixed clock, `--rate` a second (an open loop), each timed from the
          create call to its step handler starting, p50 and p99 (as latency.py).

The set-ups (`--setups`, the first three by default):

users-direct   what a user gets from the docs: the workers with no `JOBPLANE_*` tuning (their
               default concurrency), and the producer an application process of its own:
               `jobplane.Client(mongodb_url=..., redis_url=...)` on `asyncio.run`, Python's
               collector settings.
users-http     the same workers, a `jobplane api` process at its defaults, and the producer
               `jobplane.Client(url, api_key=...)` on `asyncio.run`.
tuned          the set-up behind the figures docs/benchmarks.md led with before: workers with
               JOBPLANE_WORKER_CONCURRENCY=32, `RunService` in this process (the API's code
               path without HTTP, no `Client`), on uvloop with `jobplane.process.tune_collector`.
direct+c32, direct+uvloop, direct+gc
               users-direct with one tuning each: the workers' concurrency 32, the producer on
               uvloop, the producer's collector tuned; direct+all has the three together.
http+uvloop    users-http with the producer on uvloop.

Within a round the set-ups run one after another, so `--repeat 3` interleaves them (A B C A B
C A B C). This process is the producer: each set-up's workloads run in an event loop of their
own (asyncio's or uvloop's) with the set-up's collector settings, restored afterwards. With
`--max-load L` each set-up first waits (up to 30 minutes) until the machine's 1-minute load
average is below L, and says at what load it began. Every workload prints the cost per run
as throughput.py does, and "others": CPU that processes the benchmark did not start took
meanwhile. The workers import bench/latency.py for the latency workload's handler.

    .venv/bin/python bench/as_users.py [--setups a,b,...] [--repeat K] [--runs N] [--rate R]
                                       [--json]   # last line: the first set-up's medians
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import secrets
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import uvloop

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmarks' workloads, process registry, throwaway servers and counters are importable.
import jobplane.process
import latency
import throughput
from jobplane.backends import Backends
from jobplane.devstack.servers import free_port
from jobplane.runs import RunService
from jobplane.runs.service import RunRequest
from jobplane.settings import Settings
from throughput import E2E, Counters, Create, begin, interrupt, servers

WORKLOADS = ("e2e", "latency")
LOAD_WAIT_SECONDS = 30 * 60


@dataclass(frozen=True)
class SetUp:
    """How the producer and the workers run."""

    producer: Literal["client-direct", "client-http", "service"]
    loop: Literal["asyncio", "uvloop"] = "asyncio"
    tuned_collector: bool = False
    # JOBPLANE_WORKER_CONCURRENCY; None leaves it unset, so the workers take their default.
    concurrency: int | None = None

    def describe(self) -> str:
        concurrency = self.concurrency or f"default ({Settings().worker_concurrency})"
        collector = "tuned" if self.tuned_collector else "Python's"
        return (
            f"producer {self.producer} on {self.loop}, collector {collector}; "
            f"worker concurrency {concurrency}"
        )


SETUPS = {
    "users-direct": SetUp("client-direct"),
    "users-http": SetUp("client-http"),
    "tuned": SetUp("service", "uvloop", tuned_collector=True, concurrency=32),
    "direct+c32": SetUp("client-direct", concurrency=32),
    "direct+uvloop": SetUp("client-direct", loop="uvloop"),
    "direct+gc": SetUp("client-direct", tuned_collector=True),
    "direct+all": SetUp("client-direct", "uvloop", tuned_collector=True, concurrency=32),
    "http+uvloop": SetUp("client-http", loop="uvloop"),
}


@dataclass
class Bench(latency.Bench):
    setup: SetUp = SETUPS["users-direct"]
    name: str = "users-direct"
    # set-up -> figure -> one value per round
    results: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def settings(self) -> Settings:
        # Only what every set-up needs: the rest stays unset, and so at the processes' defaults.
        tag = os.urandom(4).hex()
        settings = Settings(
            mongodb_url=self.mongo_url,
            redis_url=self.redis_url,
            db=f"bench_{tag}",
            redis_prefix=f"bench:{tag}:",
            handlers=[latency.HANDLER_MODULE],
        )
        if self.setup.producer == "client-http":
            update: dict[str, Any] = {"admin_key": secrets.token_urlsafe(24), "port": free_port()}
            settings = settings.model_copy(update=update)
        if self.setup.concurrency:
            settings = settings.model_copy(update={"worker_concurrency": self.setup.concurrency})
        return settings

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[tuple[Settings, Backends, RunService]]:
        async with super().fresh() as (settings, backends, service):
            # The latency workload's template is registered; the end-to-end one's no-op too.
            await backends.store.templates.register(throughput.TEMPLATE)
            yield settings, backends, service

    @contextlib.asynccontextmanager
    async def producer(self, settings: Settings, service: RunService) -> AsyncIterator[Create]:
        if self.setup.producer == "service":
            async with super().producer(settings, service) as in_process:
                yield in_process
            return
        client = await self.procs.client(settings, http=self.setup.producer == "client-http")

        async def create(request: RunRequest) -> object:
            return await client.create(
                request.template_type,
                scope=request.scope,
                scope_id=request.scope_id,
                payload=request.payload,
            )

        async with client:
            yield create

    def spent(self, name: str, before: Counters, after: Counters, runs: int) -> None:
        workload = "e2e" if name == E2E else "latency"
        self.keep(f"{workload}: others, cpu ms per run", before.others_ms(after, runs))

    def record(self, name: str, rate: float, line: str, details: Sequence[str] = ()) -> None:
        super().record(name, rate, line, details)
        if name == E2E:
            self.keep("e2e: runs/s", rate)

    def keep(self, figure: str, value: float) -> None:
        self.results.setdefault(self.name, {}).setdefault(figure, []).append(value)

    async def round(self) -> None:
        """The set-up's workloads, in the event loop it runs on."""
        if "e2e" in self.args.workloads:
            await self.end_to_end()
        if "latency" in self.args.workloads:
            figures = await self.measure()
            self.keep("latency: p50 ms", figures["latency_p50_ms"])
            self.keep("latency: p99 ms", figures["latency_p99_ms"])


@contextlib.contextmanager
def collector(tuned: bool) -> Iterator[None]:
    """This process's collector as a jobplane process sets it, if `tuned`; restored after."""
    if not tuned:
        yield
        return
    threshold = gc.get_threshold()
    jobplane.process.tune_collector()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def wait_for_load(limit: float) -> float:
    """Wait until the 1-minute load average is below `limit` (at most LOAD_WAIT_SECONDS);
    returns it then."""
    deadline = time.monotonic() + LOAD_WAIT_SECONDS
    while (load := os.getloadavg()[0]) >= limit and time.monotonic() < deadline:
        time.sleep(15)
    return load


def summary(bench: Bench) -> None:
    """Per set-up and figure: the median over the rounds, then each round's value."""
    print(f"\n{'set-up':14} {'figure':32} {'median':>9}  each round")
    for name, figures in bench.results.items():
        for figure, values in figures.items():
            each = " / ".join(f"{v:,.2f}" if v < 100 else f"{v:,.0f}" for v in values)
            median = statistics.median(values)
            print(f"{name:14} {figure:32} {median:9,.2f}  {each}")
    if any(stranded for stranded, _ in bench.stranded):
        print(
            "e2e runs stranded in `queued` when the workers went idle, and runs the reconciler "
            f"pushed: {', '.join(f'{a} / {b}' for a, b in bench.stranded)}"
        )


def medians(bench: Bench, name: str) -> dict[str, float]:
    """The last line for bench/peers: a set-up's medians under the peers' workload names."""
    names = {"e2e": "e2e: runs/s", "latency_p50_ms": "latency: p50 ms"}
    names["latency_p99_ms"] = "latency: p99 ms"
    figures = bench.results.get(name, {})
    return {k: statistics.median(figures[v]) for k, v in names.items() if v in figures}


def configuration(args: argparse.Namespace) -> list[str]:
    return [
        f"set-ups {', '.join(args.setups)}; workloads {', '.join(args.workloads)}; "
        f"repeat {args.repeat}",
        f"e2e: {args.runs} runs from {throughput.CALLERS} callers; latency: {args.rate:g}/s for "
        f"{args.seconds:g} s after {args.warmup:g} s of warm-up; workers {args.workers}",
    ]


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setups",
        type=lambda s: [w for w in s.split(",") if w],
        default=["users-direct", "users-http", "tuned"],
        help="comma-separated, of: " + ", ".join(SETUPS),
    )
    parser.add_argument(
        "--workloads",
        type=lambda s: [w for w in s.split(",") if w],
        default=list(WORKLOADS),
        help="comma-separated subset of: " + ",".join(WORKLOADS),
    )
    parser.add_argument("--runs", type=int, default=5000, help="runs of the e2e workload")
    parser.add_argument("--rate", type=float, default=200, help="latency: runs created a second")
    parser.add_argument("--seconds", type=float, default=10, help="latency: measured seconds")
    parser.add_argument("--warmup", type=float, default=2, help="latency: seconds not measured")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-load", type=float, help="wait for a 1-minute load below this")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--json", action="store_true", help="end with the first set-up's medians as JSON"
    )
    args = parser.parse_args(argv)
    if unknown := set(args.setups) - set(SETUPS):
        parser.error(f"unknown set-ups: {', '.join(sorted(unknown))}")
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    latency.check_rate(parser, args)
    return args


def main() -> None:
    args = parse()
    latency.let_workers_import_this()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        with servers(args) as (mongo_url, redis_url, procs):
            bench = Bench(args, mongo_url, redis_url, procs)
            asyncio.run(begin(bench, *configuration(args)))
            signal.signal(signal.SIGTERM, interrupt)  # closing a loop resets it
            for i in range(args.repeat):
                for name in args.setups:
                    load = wait_for_load(args.max_load) if args.max_load else os.getloadavg()[0]
                    bench.name, bench.setup = name, SETUPS[name]
                    print(
                        f"round {i + 1} of {args.repeat}, {name}: {bench.setup.describe()}; "
                        f"1-minute load {load:.2f}",
                        flush=True,
                    )
                    runner: Callable[[Coroutine[Any, Any, None]], None]
                    runner = uvloop.run if bench.setup.loop == "uvloop" else asyncio.run
                    with collector(bench.setup.tuned_collector):
                        runner(bench.round())
                    signal.signal(signal.SIGTERM, interrupt)  # closing a loop resets it
            summary(bench)
            if args.json:
                print(json.dumps(medians(bench, args.setups[0])))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit(130)


if __name__ == "__main__":
    main()
