"""How many runs a second the HTTP API creates: POST /v1/runs through uvicorn and FastAPI.

A real `python -m jobplane api` process (its settings in `JOBPLANE_*`, as in a deployment)
serves the API; this process is the load generator: each caller has its own
`httpx.AsyncClient` holding one HTTP/1.1 keep-alive connection. No worker runs: what is
measured is the create path only, from the request to a `201` whose run is durable in MongoDB
(`majority` by default) and pushed to Redis. Each round, for each key role, gets a fresh
database, Redis prefix and API process; one template (a `builtin.noop` step) is registered
through POST /v1/templates, then:

warm-up     200 creates (--warmup) from C callers, not measured: connections are open after.
callers     N creates from C concurrent callers (a closed loop: each caller sends its next
            request when the last one is answered).
sequential  a smaller sample, strictly one request at a time: the latency of one create.

A window runs from the first request to the last response; a latency runs from sending a
request to having read its response, as the client sees it. Two key roles are measured: the
bootstrap admin key (JOBPLANE_ADMIN_KEY, compared in memory) and a user key made through
POST /v1/api-keys, which costs a MongoDB read per request. Before and after each window the
script reads MongoDB `serverStatus` and `top`, Redis `INFO commandstats` and the CPU time of
every process (`apis` is the API process), and prints them per run; "others" is CPU that
processes this benchmark did not start took meanwhile, and the load generator's own CPU is
`bench`: all of them share the machine's cores.

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given; counters are server-wide, so give URLs only of servers nothing else uses.

    .venv/bin/python bench/api.py [--runs N] [--sequential-runs M] [--callers C]
                                  [--key-role admin|user|both] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from jobplane.backends import Backends, open_backends
from jobplane.devstack.servers import free_port
from jobplane.settings import Settings
from jobplane.store.database import Collections

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's process registry, throwaway servers and counters are importable from here.
from throughput import Child, Counters, Processes, begin, run_main

TEMPLATE = {
    "type": "bench_noop",
    "payloadSchema": {"type": "object"},
    "steps": [{"id": "only", "handler": "builtin.noop"}],
}
USER_KEY = {"name": "bench", "role": "user", "scopes": ["user:bench"]}
# Both roles send the same body (an admin may act in every scope); encoded once, so that the
# load generator spends its CPU on HTTP, not on JSON.
RUN_BODY = json.dumps(
    {"templateType": "bench_noop", "scope": "user", "scopeId": "bench", "payload": {}}
).encode()
ROLES = ("admin", "user")
# Not a key: the bare endpoint of bench/bare_api.py in place of `jobplane api`, the path's floor.
BARE = "bare"
SETTLE_SECONDS = 30.0


# -- one measured window ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """`runs` creates answered in `seconds`, with each request's latency in seconds, sorted."""

    runs: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.runs / self.seconds

    def ms(self, quantile: float) -> float:
        """The latency at `quantile` (nearest rank), in milliseconds; 1.0 is the maximum."""
        rank = max(1, math.ceil(quantile * len(self.latencies)))
        return 1000 * self.latencies[rank - 1]


async def create_runs(clients: Sequence[httpx.AsyncClient], n: int) -> Window:
    """POST `n` runs, one caller per client, all at once (a closed loop); refuse any non-201."""
    todo = iter(range(n))
    latencies: list[float] = []

    async def caller(client: httpx.AsyncClient) -> None:
        for _ in todo:
            sent = time.perf_counter()
            response = await client.post("/v1/runs", content=RUN_BODY)
            latencies.append(time.perf_counter() - sent)
            if response.status_code != 201:
                raise RuntimeError(
                    f"POST /v1/runs answered {response.status_code}: {response.text[:500]}"
                )

    started = time.perf_counter()
    await asyncio.gather(*(caller(client) for client in clients[:n]))
    return Window(n, time.perf_counter() - started, sorted(latencies))


# -- the API under test ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """A fresh database and Redis prefix, the API process serving them, and one client per
    caller, each holding the key under test."""

    settings: Settings
    backends: Backends
    clients: list[httpx.AsyncClient]


async def call(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    if response.status_code not in {200, 201}:
        raise RuntimeError(f"POST {path} answered {response.status_code}: {response.text[:500]}")
    answer: dict[str, Any] = response.json()
    return answer


@dataclass
class Bench:
    args: argparse.Namespace
    mongo_url: str
    redis_url: str
    procs: Processes
    # workload -> figure -> one value per round
    figures: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def settings(self) -> Settings:
        tag = os.urandom(4).hex()
        return Settings(
            mongodb_url=self.mongo_url,
            redis_url=self.redis_url,
            db=f"bench_{tag}",
            redis_prefix=f"bench:{tag}:",
            write_concern=self.args.write_concern,
            admin_key=secrets.token_urlsafe(24),
            port=free_port(),
        )

    @contextlib.asynccontextmanager
    async def stack(self, role: str) -> AsyncIterator[Stack]:
        """A `jobplane api` process on fresh storage with the template; dropped afterwards."""
        settings = self.settings()
        base_url = f"http://{settings.host}:{settings.port}"
        async with open_backends(settings) as backends:
            try:
                key = settings.admin_key
                if role == BARE:
                    self.start_bare(settings)
                    await self.procs.api_ready(base_url)
                else:
                    # The port reaches the process as JOBPLANE_PORT, like every other setting.
                    self.procs.start(settings, "api")
                    admin = {"authorization": f"Bearer {settings.admin_key}"}
                    await self.procs.api_ready(base_url)
                    async with httpx.AsyncClient(base_url=base_url, headers=admin) as setup:
                        await call(setup, "/v1/templates", TEMPLATE)
                        if role == "user":
                            key = (await call(setup, "/v1/api-keys", USER_KEY))["key"]
                # A client per caller, not one pool for all: httpcore's pool looks at each of its
                # connections for every request, which cost about three times the CPU per
                # request at 32 connections. Each client keeps its one connection alive.
                headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
                async with contextlib.AsyncExitStack() as opened:
                    clients = [
                        await opened.enter_async_context(
                            httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60)
                        )
                        for _ in range(self.args.callers)
                    ]
                    yield Stack(settings, backends, clients)
            finally:
                self.procs.stop()
                await backends.store.client.drop_database(settings.db)
                keys = [
                    k async for k in backends.queue.redis.scan_iter(f"{settings.redis_prefix}*")
                ]
                if keys:
                    await backends.queue.redis.delete(*keys)

    def start_bare(self, settings: Settings) -> None:
        """bench/bare_api.py on the stack's port and key; its CPU counts as the API's."""
        env = os.environ | {
            "JOBPLANE_PORT": str(settings.port),
            "JOBPLANE_ADMIN_KEY": str(settings.admin_key),
        }
        log = self.procs.log_dir / f"bare-api-{len(self.procs.children)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("bare_api.py"))],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.children.append(Child("api", proc, log))

    async def round(self, role: str) -> None:
        a = self.args
        bare = role == BARE
        async with self.stack(role) as stack:
            await create_runs(stack.clients, a.warmup)
            total = a.warmup
            if not bare:
                await settle(stack, total)
            what = "bare endpoint" if bare else f"{role} key"
            for name, n, callers in (
                (f"{what}, {a.callers} callers", a.runs, a.callers),
                (f"{what}, sequential", a.sequential_runs, 1),
            ):
                before = await Counters.read(stack.backends, stack.settings, self.procs)
                window = await create_runs(stack.clients[:callers], n)
                total += n
                # The API copies each run's events to `job_events` just after answering: that
                # work belongs to these runs, so the counters are read once it is done.
                if not bare:
                    await settle(stack, total)
                after = await Counters.read(stack.backends, stack.settings, self.procs)
                self.record(name, window, before, after)
            if not bare:
                await verify(stack, a.warmup + a.runs + a.sequential_runs)

    def record(self, name: str, window: Window, before: Counters, after: Counters) -> None:
        cpu = {k: 1000 * (after.cpu[k] - before.cpu.get(k, 0)) / window.runs for k in after.cpu}
        figures = {
            "runs/s": window.rate,
            "p50": window.ms(0.5),
            "p90": window.ms(0.9),
            "p99": window.ms(0.99),
            "max": window.ms(1.0),
            "api cpu": cpu.get("apis", 0.0),
            "mongod cpu": cpu.get("mongod", 0.0),
            "client cpu": cpu.get("bench", 0.0),
        }
        for figure, value in figures.items():
            self.figures.setdefault(name, {}).setdefault(figure, []).append(value)
        print(
            f"  {name}: {window.rate:,.0f} runs/s ({window.runs} runs in {window.seconds:.2f} s);"
            f" latency ms p50 {figures['p50']:.1f}, p90 {figures['p90']:.1f},"
            f" p99 {figures['p99']:.1f}, max {figures['max']:.1f}",
            flush=True,
        )
        for line in before.per_run(after, window.runs, window.seconds):
            print(f"      {line}", flush=True)


async def settle(stack: Stack, runs: int) -> None:
    """Wait until the events of `runs` creates (one `created` each: runs are created `queued`)
    are copied from the runs' trails to `job_events`."""
    events = Collections.of(stack.backends.store.db).events
    async with asyncio.timeout(SETTLE_SECONDS):
        while await events.count_documents({"type": "created"}) < runs:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def verify(stack: Stack, created: int) -> None:
    """Every answered create left a `queued` run in MongoDB and its id in the Redis queue."""
    queued = await Collections.of(stack.backends.store.db).runs.count_documents(
        {"status": "queued"}
    )
    queue = stack.backends.queue
    # The template's one step is a `builtin.noop` one: its runs wait in that handler's lane.
    in_redis = await queue.redis.zcard(queue.keys.queue("default", "builtin.noop"))
    if queued != created or in_redis != created:
        raise RuntimeError(
            f"{created} runs created, {queued} queued in MongoDB, {in_redis} in Redis"
        )


# -- report ----------------------------------------------------------------------------------------


def configuration(bench: Bench) -> list[str]:
    # uvicorn picks httptools and uvloop when they are importable, else h11 and asyncio; the
    # API process runs on this same interpreter, so what is importable here is what it uses.
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    a = bench.args
    return [
        f"api: uvicorn {version('uvicorn')} ({http}, {loop} loop), fastapi "
        f"{version('fastapi')}, starlette {version('starlette')}, pydantic {version('pydantic')}; "
        f"client: httpx {version('httpx')}, HTTP/1.1 keep-alive, a client per caller",
        f"runs {a.runs} (sequential {a.sequential_runs}, warm-up {a.warmup}), callers "
        f"{a.callers}, keys {', '.join(a.roles)}, write concern {a.write_concern}, "
        f"repeat {a.repeat}",
    ]


def summary(figures: dict[str, dict[str, list[float]]]) -> None:
    """Per workload: runs/s over the rounds, and the median of each round's other figures."""
    latency, cpu = ("p50", "p90", "p99", "max"), ("api cpu", "mongod cpu", "client cpu")
    print(f"\n{'':24} {'runs/s':^21}  {'latency ms (median)':^27}  {'cpu ms/run (median)':^20}")
    print(
        f"{'workload':24} {'median':>7}{'min':>7}{'max':>7}  "
        + "".join(f"{k:>7}" for k in latency)
        + "  "
        + "".join(f"{k.split()[0]:>7}" for k in cpu)
    )
    for name, values in figures.items():
        rate = values["runs/s"]
        median = {k: statistics.median(v) for k, v in values.items()}
        print(
            f"{name:24} {median['runs/s']:7,.0f}{min(rate):7,.0f}{max(rate):7,.0f}  "
            + "".join(f"{median[k]:7.1f}" for k in latency)
            + "  "
            + "".join(f"{median[k]:7.2f}" for k in cpu)
        )


async def main_async(bench: Bench) -> None:
    await begin(bench, *configuration(bench))
    for i in range(bench.args.repeat):
        print(f"round {i + 1} of {bench.args.repeat}", flush=True)
        for role in bench.args.roles:
            await bench.round(role)
    summary(bench.figures)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs from concurrent callers")
    parser.add_argument("--sequential-runs", type=int, default=500)
    parser.add_argument("--callers", type=int, default=32, help="concurrent callers")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured runs first")
    parser.add_argument(
        "--key-role",
        choices=[*ROLES, "both", BARE, "floor"],
        default="both",
        help="the bootstrap admin key, a stored user key, or both (default); bare: "
        "bench/bare_api.py's endpoint instead of the API (the path's floor); floor: admin, "
        "then bare",
    )
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    if min(args.runs, args.sequential_runs, args.callers, args.repeat) < 1 or args.warmup < 0:
        parser.error("--runs, --sequential-runs, --callers and --repeat must be at least 1")
    args.roles = {"both": list(ROLES), "floor": ["admin", BARE]}.get(args.key_role, [args.key_role])
    return args


def main() -> None:
    args = parse()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
