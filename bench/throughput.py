"""How many no-op runs a second jobplane creates and finishes on this machine.

No-op runs (one `builtin.noop` step) cost nothing to execute, so what is measured is the
platform's own price per run: every MongoDB write, `job_events` insert and Redis call of the run
lifecycle, and the Python around them. Three workloads, each on a fresh database and Redis prefix:

create      `RunService.create` (the API's path without HTTP) from 32 concurrent callers in this
            process, then strictly one after another for a smaller sample. The sequential figure
            is bounded by the durable round trips of one create (with majority write concern
            each write waits for the journal).
drain       N runs created beforehand, then W `python -m jobplane worker` processes (each with
            JOBPLANE_WORKER_CONCURRENCY=C) empty the queue. Measured window: the first claim's
            `status_changed` event (`job_events.createAt`) to the last `job_runs.completedAt`;
            the window from spawning the workers (Python start-up included) is shown too.
end-to-end  The workers and a `jobplane scheduler` (its reconciler re-pushes queued runs that
            Redis lost) are started and idle; a producer then creates N runs (32 concurrent)
            while they drain. Window: just before the first create to the last `completedAt`.
            When the workers go idle with runs left in `queued` (their ids were popped but not
            claimed) those wait for the reconciler; the rate up to that pause is shown too.

For each workload the script also reads MongoDB's `serverStatus` (requests, opcounters, journal
syncs) and `top` (time per collection), Redis `INFO commandstats` and the CPU time of every
process before and after, and prints them per run: the cost of one run, not only the rate.
"others" is CPU that processes not started by the benchmark took meanwhile: a busy neighbour
makes the figures worthless, and this shows it.

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given; counters are server-wide, so give URLs only of servers nothing else uses.

    .venv/bin/python bench/throughput.py [--runs N] [--workers W] [--concurrency C] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Protocol

import httpx
import pymongo
import redis
import redis.asyncio as aioredis
from bson import ObjectId
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import jobplane.process
from jobplane import Client, tracing
from jobplane.backends import Backends, open_backends
from jobplane.devstack.servers import MongoServer, RedisServer, free_port
from jobplane.devstack.topologies import RedisClusterNodes, SentinelGroup
from jobplane.model import RunStatus, TemplateSpec
from jobplane.queue.connect import RedisClient
from jobplane.runs import RunService
from jobplane.runs.service import RunRequest
from jobplane.settings import Settings
from jobplane.store.database import Collections

CALLERS = 32
TRACING_HELP = "trace every process, exporting OTLP to a local receiver"
ACTOR = "user:bench"
TEMPLATE = TemplateSpec.model_validate(
    {"type": "bench_noop", "steps": [{"id": "only", "handler": "builtin.noop"}]}
)
REQUEST = RunRequest(template_type="bench_noop", scope="system", scope_id="bench")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
TOP_KINDS = ("insert", "queries", "update", "remove", "getmore", "commands")
WORKLOADS = ("create", "drain", "e2e")
DRAIN = "drain, first claim -> last done"
E2E = "end-to-end, first create -> last done"
# Progress paused this long means the workers are idle with runs left (stranded in `queued`);
# the scheduler's reconciler re-pushes those every JOBPLANE_RECONCILE_SECONDS (10 s).
QUIET_SECONDS = 1.0
STALL_SECONDS = 30.0
# A way of creating one run, as a producer of the end-to-end and latency workloads has it.
Create = Callable[[RunRequest], Awaitable[object]]


# -- processes -------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def machine_cpu_seconds() -> float:
    """CPU time every process on the machine used since boot (all but idle and iowait)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICK


@dataclass(frozen=True)
class Child:
    command: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Processes:
    """The processes this benchmark owns, so that they can be stopped on any exit."""

    log_dir: Path
    servers: dict[str, int] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)

    def start(self, settings: Settings, command: str, count: int = 1, nice: int = 0) -> None:
        """Start `count` processes `jobplane COMMAND`, `settings` in their environment, at
        `nice` (0: as this process)."""
        env = dict(os.environ)
        # Only what the benchmark set: a setting it leaves alone is the process's own default.
        for name, value in settings.model_dump(exclude_unset=True, exclude_none=True).items():
            if name in {"queues", "handlers"}:
                value = ",".join(value)
            env[f"JOBPLANE_{name.upper()}"] = str(value)
        for _ in range(count):
            path = self.log_dir / f"{command}-{len(self.children)}.log"
            with path.open("wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "jobplane", command],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=(lambda: os.nice(nice)) if nice else None,
                )
            self.children.append(Child(command, proc, path))

    async def workers_ready(self) -> None:
        """Return once every worker logged that it started its loops."""
        async with asyncio.timeout(60):
            for child in self.children:
                while (
                    child.command == "worker" and b" started: queues " not in child.log.read_bytes()
                ):
                    self.check()
                    await asyncio.sleep(0.02)

    async def client(self, settings: Settings, http: bool) -> Client:
        """The public `Client` of `settings`' database: over HTTP to an API process started
        here, or direct to MongoDB and Redis."""
        if http:
            self.start(settings, "api")
            url = f"http://{settings.host}:{settings.port}"
            await self.api_ready(url)
            return Client(url, api_key=settings.admin_key)
        return Client(
            mongodb_url=settings.mongodb_url,
            redis_url=settings.redis_url,
            db=settings.db,
            redis_prefix=settings.redis_prefix,
            actor="client:bench",
        )

    async def api_ready(self, url: str) -> None:
        """Return once the API process at `url` answers /readyz (it reaches MongoDB and Redis)."""
        async with httpx.AsyncClient(base_url=url) as http, asyncio.timeout(60):
            while True:
                self.check()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/readyz")).status_code == 200:
                        return
                await asyncio.sleep(0.05)

    def check(self) -> None:
        for child in self.children:
            if child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.command} {child.proc.pid} exited with {child.proc.returncode}:\n"
                    + child.log.read_text()[-3000:]
                )

    def reconciled(self) -> int:
        """How many runs the scheduler's reconciler pushed to Redis, from its log."""
        logs = [c.log.read_text() for c in self.children if c.command == "scheduler"]
        return sum(int(m) for log in logs for m in re.findall(r"tick: .*queued (\d+)", log))

    def stop(self, timeout: float = 30) -> None:
        # SIGTERM to all first: each drains, which takes up to a poll interval.
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        self.children.clear()

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each kind of process, and by the whole machine."""
        times = os.times()
        cpu = {"machine": machine_cpu_seconds(), "bench": times.user + times.system}
        for name, pid in self.servers.items():
            kind = name.partition("#")[0]  # the servers of a Redis Cluster count as one
            cpu[kind] = cpu.get(kind, 0) + cpu_seconds(pid)
        for child in self.children:
            name = f"{child.command}s"
            cpu[name] = cpu.get(name, 0) + cpu_seconds(child.proc.pid)
        return cpu


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[tuple[str, str, Processes]]:
    """MongoDB and Redis URLs (throwaway servers unless given) and the process registry."""
    with tempfile.TemporaryDirectory(prefix="jobplane-bench-") as tmp, contextlib.ExitStack() as st:
        root = Path(tmp)
        procs = Processes(root)
        st.callback(procs.stop)
        mongo_url, redis_url = args.mongodb_url, args.redis_url
        if not mongo_url:
            mongo = MongoServer(root / "mongo", free_port(), root / "mongod.log")
            mongo.start()
            st.callback(mongo.stop)
            mongo_url, procs.servers["mongod"] = mongo.url, mongo.pid or 0
        if not redis_url:
            redis_url = start_redis("single", root, procs, st)
        if getattr(args, "tracing", False):
            start_tracing(root, procs, st)
        yield mongo_url, redis_url, procs


def start_tracing(root: Path, procs: Processes, stack: contextlib.ExitStack) -> None:
    """Trace every process of the benchmark, this one (the producer) too, exporting through
    the SDK's batch processor to a local receiver (`otlp_sink.py`; its CPU counts as
    `otlp-sink`)."""
    port = free_port()
    with (root / "otlp-sink.log").open("wb") as log:
        sink = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("otlp_sink.py")), str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    stack.callback(sink.kill)
    procs.servers["otlp-sink"] = sink.pid
    deadline = time.monotonic() + 30
    while b"listening" not in (root / "otlp-sink.log").read_bytes():
        if sink.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the OTLP receiver did not start")
        time.sleep(0.02)
    # The children inherit it: each process sets its own tracing up from it.
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    tracing.configure("bench-producer")
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        stack.callback(provider.shutdown)  # its last spans sent before the receiver stops


def start_redis(topology: str, root: Path, procs: Processes, stack: contextlib.ExitStack) -> str:
    """Start throwaway Redis servers of a topology; their CPU counts as `redis`."""
    servers: list[RedisServer]
    if topology == "cluster":
        cluster = RedisClusterNodes(root / "redis-cluster")
        cluster.start()
        stack.callback(cluster.stop)
        url, servers = cluster.url, cluster.nodes
    elif topology == "sentinel":
        group = SentinelGroup(root / "redis-sentinel")
        group.start()
        stack.callback(group.stop)
        url, servers = group.url, [group.master, group.replica, *group.sentinels]
    else:
        rds = RedisServer(root / "redis", free_port(), root / "redis.log")
        rds.start()
        stack.callback(rds.stop)
        url, servers = rds.url, [rds]
    for i, server in enumerate(servers):
        procs.servers[f"redis#{topology}{i}"] = server.pid or 0
    return url


# -- counters --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """Server-wide counters and CPU times at one instant; differences give the cost of a span."""

    mongo: dict[str, float]
    # MongoDB commands by name (`metrics.commands`), each a round trip of some client.
    commands: dict[str, float]
    # Documents written and read, and bytes: the journal's and both ways on the network.
    volume: dict[str, float]
    # `top`: per "collection.kind" the number of operations and the µs they took (wall time,
    # waits on locks and I/O included, concurrent operations summed).
    top_count: dict[str, float]
    top_time: dict[str, float]
    redis: dict[str, float]
    cpu: dict[str, float]

    @staticmethod
    async def read(backends: Backends, settings: Settings, procs: Processes) -> Counters:
        admin = backends.store.client.admin
        status = await admin.command("serverStatus")
        mongo: dict[str, float] = {"requests": status["network"]["numRequests"]}
        mongo |= {k: v for k, v in status["opcounters"].items() if isinstance(v, int)}
        mongo["journal syncs"] = status["wiredTiger"]["log"]["log sync operations"]
        mongo["transactions"] = status["transactions"]["totalStarted"]
        mongo["aborted transactions"] = status["transactions"]["totalAborted"]
        commands = {
            name: float(c["total"])
            for name, c in status["metrics"]["commands"].items()
            if isinstance(c, dict) and isinstance(c.get("total"), int)
        }
        document = status["metrics"]["document"]
        volume: dict[str, float] = {
            "docs inserted": document["inserted"],
            "docs updated": document["updated"],
            "docs returned": document["returned"],
            "journal bytes": status["wiredTiger"]["log"]["log bytes written"],
            "bytes in": status["network"]["bytesIn"],
            "bytes out": status["network"]["bytesOut"],
        }
        top_count: dict[str, float] = {}
        top_time: dict[str, float] = {}
        for ns, kinds in (await admin.command("top"))["totals"].items():
            if ns.startswith(f"{settings.db}."):
                for kind in TOP_KINDS:
                    key = f"{ns.split('.', 1)[1]}.{kind}"
                    top_count[key], top_time[key] = kinds[kind]["count"], kinds[kind]["time"]
        calls: dict[str, float] = {}
        for stats in await redis_info(backends.queue.redis, "commandstats"):
            for k, v in stats.items():
                name = k.removeprefix("cmdstat_")
                calls[name] = calls.get(name, 0) + float(v["calls"])
        return Counters(mongo, commands, volume, top_count, top_time, calls, procs.cpu())

    def per_run(self, later: Counters, runs: int, seconds: float) -> list[str]:
        """Lines describing what `runs` runs cost between this reading and `later`."""

        def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: (b[k] - a.get(k, 0)) / runs for k in b if b[k] - a.get(k, 0) > 0}

        top_count = delta(self.top_count, later.top_count)
        top_time = delta(self.top_time, later.top_time)
        top = {f"{k} {top_count[k]:.2f}x": v for k, v in top_time.items() if k in top_count}
        rds = delta(self.redis, later.redis)
        cpu = {k: 1000 * v for k, v in delta(self.cpu, later.cpu).items() if k != "machine"}
        others = self.others_ms(later, runs)
        ours = sum(cpu.values())
        cpu |= {"others": others}
        cores = runs * (ours + others) / 1000 / seconds if seconds else 0
        return [
            "mongod per run: " + _fmt(delta(self.mongo, later.mongo), "{:.2f}"),
            "mongod commands per run: " + _fmt(delta(self.commands, later.commands), "{:.3f}"),
            "mongod volume per run: " + _fmt(delta(self.volume, later.volume), "{:.0f}"),
            "mongod top per run (count, µs): " + _fmt(top, "{:.0f}", 8),
            f"redis per run: {sum(rds.values()):.2f} commands: " + _fmt(rds, "{:.2f}", 7),
            "cpu ms per run: "
            + _fmt(cpu, "{:.2f}")
            + f"; {cores:.2f} of {os.cpu_count()} cores busy",
        ]

    def others_ms(self, later: Counters, runs: int) -> float:
        """CPU ms per run that processes the benchmark did not start took until `later`."""
        used = {k: v - self.cpu.get(k, 0) for k, v in later.cpu.items()}
        # A process gone meanwhile reads 0: its negative difference is not taken off ours.
        ours = sum(v for k, v in used.items() if k != "machine" and v > 0)
        return max(0.0, 1000 * (used.get("machine", 0) - ours) / runs)


async def redis_info(client: RedisClient, section: str) -> list[dict[str, Any]]:
    """INFO `section` of the server, or of each master of a cluster."""
    if isinstance(client, aioredis.RedisCluster):
        per_node = await client.info(section, target_nodes=aioredis.RedisCluster.PRIMARIES)
        return list(per_node.values())
    return [await client.info(section)]


def _fmt(values: dict[str, float], spec: str, top: int = 12) -> str:
    ranked = sorted(values.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {spec.format(v)}" for k, v in ranked) or "-"


# -- workloads -------------------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    mongo_url: str
    redis_url: str
    procs: Processes
    figures: dict[str, list[float]] = field(default_factory=dict)
    stranded: list[tuple[int, int]] = field(default_factory=list)
    # A database to keep (scale.py's, seeded with a million runs) instead of a new one per
    # workload. Each workload then counts, sorts and deletes only its own runs and events, those
    # from `since` on: the documents that were there before stay, and cost the polling nothing.
    db: str | None = None
    since: ObjectId | None = None
    # What `fresh` registers; other benchmarks built on this class register their own.
    template: ClassVar[TemplateSpec] = TEMPLATE

    def start_workers(self, settings: Settings) -> None:
        """The workload's worker processes (bench/flows.py gives each its own handlers)."""
        self.procs.start(settings, "worker", self.args.workers)

    def settings(self) -> Settings:
        tag = os.urandom(4).hex()
        return Settings(
            mongodb_url=self.mongo_url,
            redis_url=self.redis_url,
            db=self.db or f"bench_{tag}",
            redis_prefix=f"bench:{tag}:",
            write_concern=self.args.write_concern,
            worker_concurrency=self.args.concurrency,
        )

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[tuple[Settings, Backends, RunService]]:
        """Backends on a new prefix and a new database (or `db`), with the template; the prefix
        and the database (or the workload's runs and events in `db`) dropped afterwards."""
        if self.db:
            # ObjectIds keep whole seconds: wait for the next one, so that all the workload's
            # runs are newer than `since` and nothing made before is.
            await asyncio.sleep(1 - time.time() % 1 + 0.01)
            self.since = ObjectId.from_datetime(datetime.now(UTC))
        settings = self.settings()
        async with open_backends(settings) as backends:
            try:
                await backends.store.templates.register(self.template)
                yield settings, backends, RunService(backends.store, backends.queue)
            finally:
                self.procs.stop()
                await backends.store.trail.flush()
                if self.db:
                    await Collections.of(backends.store.db).runs.delete_many(self.own_runs())
                    await Collections.of(backends.store.db).events.delete_many(self.own_events())
                else:
                    await backends.store.client.drop_database(settings.db)
                await forget_redis(backends, settings)

    def request(self) -> RunRequest:
        """The next run the workloads create: `REQUEST` (bench/flow_control.py varies it)."""
        return REQUEST

    def own_runs(self) -> dict[str, Any]:
        """The `job_runs` filter to the workload's runs (all of them unless `db` is kept)."""
        return {} if self.since is None else {"_id": {"$gte": self.since}}

    def own_events(self) -> dict[str, Any]:
        """The `job_events` filter to the workload's events (all of them unless `db` is kept)."""
        return {} if self.since is None else {"createAt": {"$gte": self.since.generation_time}}

    def spent(self, name: str, before: Counters, after: Counters, runs: int) -> None:
        """Called with the readings around workload `name`'s `runs` runs, for a subclass to keep
        what they cost (scale.py tabulates it); this benchmark prints it with the figure."""

    def record(self, name: str, rate: float, line: str, details: Sequence[str] = ()) -> None:
        self.figures.setdefault(name, []).append(rate)
        print(f"  {name}: {rate:,.0f} runs/s ({line})", flush=True)
        for detail in details:
            print(f"      {detail}", flush=True)

    async def create(self) -> None:
        n, seq = self.args.runs, self.args.sequential_runs
        async with self.fresh() as (settings, backends, service):
            before = await Counters.read(backends, settings, self.procs)
            seconds = await create_many(service, n, CALLERS, self.request)
            after = await Counters.read(backends, settings, self.procs)
            self.record(
                f"create, {CALLERS} callers",
                n / seconds,
                f"{n} runs in {seconds:.2f} s",
                before.per_run(after, n, seconds),
            )
            seconds = await create_many(service, seq, 1, self.request)
            self.record("create, sequential", seq / seconds, f"{seq} runs in {seconds:.2f} s")

    async def drain(self) -> None:
        n = self.args.runs
        async with self.fresh() as (settings, backends, service):
            await create_many(service, n, CALLERS, self.request)
            spawned = datetime.now(UTC)
            self.start_workers(settings)
            await self.procs.workers_ready()
            before = await Counters.read(backends, settings, self.procs)
            await self.wait_succeeded(backends, settings, n)
            after = await Counters.read(backends, settings, self.procs)
            claims = ["claim", "claim_limited"]  # runs without and with limits to pass
            claim = {"type": "status_changed", "metadata.transition": {"$in": claims}}
            first = await Collections.of(backends.store.db).events.find_one(
                claim | self.own_events(), sort=[("createAt", 1)]
            )
            assert first is not None
            last = await self.last_completed(backends)
            window = (last - first["createAt"]).total_seconds()
            self.spent(DRAIN, before, after, n)
            self.record(
                DRAIN,
                n / window,
                f"{n} runs in {window:.2f} s",
                before.per_run(after, n, window),
            )
            from_spawn = (last - spawned).total_seconds()
            self.record("drain, from spawn", n / from_spawn, f"{from_spawn:.2f} s")

    @contextlib.asynccontextmanager
    async def producer(self, settings: Settings, service: RunService) -> AsyncIterator[Create]:
        """How the end-to-end and latency workloads create runs: `service` in this process
        (the API's code path without HTTP); bench/as_users.py puts `jobplane.Client` here."""

        async def create(request: RunRequest) -> object:
            return await service.create(request, ACTOR)

        yield create

    async def end_to_end(self) -> None:
        n = self.args.runs
        async with (
            self.fresh() as (settings, backends, service),
            self.producer(settings, service) as create,
        ):
            # The scheduler's reconciler belongs to a deployment: it re-pushes queued runs
            # missing from Redis, which the bench needs when a popped run was not claimed.
            self.procs.start(settings, "scheduler")
            self.start_workers(settings)
            await self.procs.workers_ready()
            await asyncio.sleep(0.5)  # let start-up settle so the workers are really idle
            before = await Counters.read(backends, settings, self.procs)
            started = datetime.now(UTC)
            created = await closed_loop(lambda: create(self.request()), n, CALLERS)
            quiet = await self.wait_succeeded(backends, settings, n)
            after = await Counters.read(backends, settings, self.procs)
            last = await self.last_completed(backends)
            window = (last - started).total_seconds()
            self.spent(E2E, before, after, n)
            self.record(
                E2E,
                n / window,
                f"{n} runs in {window:.2f} s; the creates took {created:.2f} s",
                before.per_run(after, n, window) if quiet is None else (),
            )
            # Costs are shown up to the pause when runs were stranded: after it nothing moves.
            quiet = quiet or Quiet(n, last, after)
            done, window = quiet.done, (quiet.last - started).total_seconds()
            self.stranded.append((n - done, self.procs.reconciled()))
            self.record(
                "end-to-end, excluding stranded",
                done / window,
                f"{done} runs in {window:.2f} s; {n - done} left in `queued` when the workers "
                f"went idle; the reconciler pushed {self.stranded[-1][1]} runs in all",
                before.per_run(quiet.counters, done, window) if done < n else (),
            )

    async def wait_succeeded(self, backends: Backends, settings: Settings, n: int) -> Quiet | None:
        """Poll until `n` runs succeeded; give up after `STALL_SECONDS` without progress.

        Returns what was done when progress first paused for `QUIET_SECONDS` short of `n`: the
        runs left then wait for the reconciler. None when there was no such pause.
        """
        runs = Collections.of(backends.store.db).runs
        done, moved, quiet = 0, time.monotonic(), None
        succeeded = {"status": RunStatus.SUCCEEDED} | self.own_runs()
        while done < n:
            await asyncio.sleep(0.2)
            self.procs.check()
            count = await runs.count_documents(succeeded)
            idle = time.monotonic() - moved
            if count > done:
                done, moved = count, time.monotonic()
            elif quiet is None and idle > QUIET_SECONDS:
                counters = await Counters.read(backends, settings, self.procs)
                quiet = Quiet(done, await self.last_completed(backends), counters)
            elif idle > STALL_SECONDS:
                pipeline = [
                    {"$match": self.own_runs()},
                    {"$group": {"_id": "$status", "n": {"$sum": 1}}},
                ]
                counts = {d["_id"]: d["n"] async for d in await runs.aggregate(pipeline)}
                raise RuntimeError(f"stalled at {done} of {n} succeeded; statuses {counts}")
        return quiet

    async def last_completed(self, backends: Backends) -> datetime:
        doc = await Collections.of(backends.store.db).runs.find_one(
            {"status": RunStatus.SUCCEEDED} | self.own_runs(), sort=[("completedAt", -1)]
        )
        assert doc is not None
        completed: datetime = doc["completedAt"]
        return completed


@dataclass(frozen=True)
class Quiet:
    """The state when the workers first went idle with runs left over."""

    done: int
    last: datetime
    counters: Counters


async def create_many(
    service: RunService,
    n: int,
    callers: int,
    request: Callable[[], RunRequest] = lambda: REQUEST,
) -> float:
    """Create `n` runs (each `request()`) from `callers` concurrent callers; returns the
    seconds it took, up to the end of the work the creates left behind (event copies)."""
    started = time.perf_counter()
    await closed_loop(lambda: service.create(request(), ACTOR), n, callers)
    await service.store.trail.flush()
    return time.perf_counter() - started


async def closed_loop(create: Callable[[], Awaitable[object]], n: int, callers: int) -> float:
    """Call `create` `n` times from `callers` concurrent callers, each calling again once its
    last call returned; returns the seconds until the last one returned."""
    todo = iter(range(n))

    async def caller() -> None:
        for _ in todo:
            await create()

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(min(callers, n))))
    return time.perf_counter() - started


async def forget_redis(backends: Backends, settings: Settings) -> None:
    """Delete the keys under the settings' prefix."""
    client = backends.queue.redis
    keys = [k async for k in client.scan_iter(f"{settings.redis_prefix}*")]
    if keys:
        await client.delete(*keys)


# -- report ----------------------------------------------------------------------------------------


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), "?")
    meminfo = Path("/proc/meminfo").read_text().split()
    mem_gib = int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20
    usable = len(os.sched_getaffinity(0))
    return (
        f"machine: {os.cpu_count()} cpus ({usable} usable), {model}, {mem_gib:.1f} GiB, "
        f"{platform.platform()}"
    )


async def software(settings: Settings) -> str:
    """The versions of Python, the servers and their clients, and this process's event loop."""
    async with open_backends(settings) as backends:
        mongod = (await backends.store.client.admin.command("buildInfo"))["version"]
        [server, *_] = await redis_info(backends.queue.redis, "server")
        await backends.store.client.drop_database(settings.db)
    hiredis = "yes" if redis.utils.HIREDIS_AVAILABLE else "no"
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return (
        f"python {platform.python_version()}, mongod {mongod}, redis-server "
        f"{server['redis_version']}, pymongo {pymongo.version}, redis-py {redis.__version__} "
        f"(hiredis {hiredis}), this process on {loop}'s event loop"
    )


class Configured(Protocol):
    mongo_url: str
    redis_url: str

    def settings(self) -> Settings: ...


async def begin(bench: Configured, *config: str) -> None:
    """What every benchmark does first: let SIGTERM cancel the work (so that every `finally`
    runs as on Ctrl-C), and print the machine, the software, the configuration and the servers."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    print(machine())
    print(await software(bench.settings()))
    for line in config:
        print(line)
    print(f"mongodb {bench.mongo_url}, redis {bench.redis_url}\n", flush=True)


def configuration(bench: Bench) -> str:
    a, settings = bench.args, bench.settings()
    return (
        f"runs {a.runs} (sequential {a.sequential_runs}), callers {CALLERS}, workers {a.workers}, "
        f"worker concurrency {a.concurrency}, write concern {a.write_concern}, "
        f"lease {settings.lease_seconds}s, heartbeat {settings.heartbeat_seconds}s, "
        f"poll {settings.poll_seconds}s, repeat {a.repeat}"
    )


def summary(figures: dict[str, list[float]]) -> None:
    print(f"\n{'workload':40} {'median':>9} {'min':>9} {'max':>9}  each (runs/s)")
    for name, rates in figures.items():
        each = " ".join(f"{r:,.0f}" for r in rates)
        print(
            f"{name:40} {statistics.median(rates):9,.0f} {min(rates):9,.0f} {max(rates):9,.0f}"
            f"  {each}"
        )


async def main_async(bench: Bench) -> None:
    await begin(bench, configuration(bench))
    steps: dict[str, Callable[[], Awaitable[None]]] = {
        "create": bench.create,
        "drain": bench.drain,
        "e2e": bench.end_to_end,
    }
    for i in range(bench.args.repeat):
        print(f"round {i + 1} of {bench.args.repeat}", flush=True)
        for name in bench.args.workloads:
            await steps[name]()
    summary(bench.figures)
    if bench.stranded:
        print(
            "end-to-end runs stranded in `queued` when the workers went idle, and runs the "
            f"reconciler pushed: {', '.join(f'{a} / {b}' for a, b in bench.stranded)}"
        )
    if bench.args.json:
        # The last line, for bench/peers: medians under the peers' workload names.
        names = {
            "enqueue": "create, 32 callers",
            "drain": DRAIN,
            "e2e": E2E,
        }
        medians = {
            short: statistics.median(bench.figures[long])
            for short, long in names.items()
            if long in bench.figures
        }
        print(json.dumps(medians))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs per workload")
    parser.add_argument("--sequential-runs", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="end with the medians as JSON")
    parser.add_argument("--tracing", action="store_true", help=TRACING_HELP)
    parser.add_argument(
        "--workloads",
        type=lambda s: [w for w in s.split(",") if w],
        default=list(WORKLOADS),
        help="comma-separated subset of: " + ",".join(WORKLOADS),
    )
    args = parser.parse_args(argv)
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    return args


def interrupt(signum: int, frame: object) -> None:
    """Outside the event loop SIGTERM unwinds like Ctrl-C, so the servers are stopped."""
    raise KeyboardInterrupt


def run_main(
    args: argparse.Namespace,
    start: Callable[[str, str, Processes], Coroutine[Any, Any, None]],
    runner: Callable[[Coroutine[Any, Any, None]], None] = jobplane.process.run,
) -> None:
    """Start (or reach) the servers, run `start(mongo_url, redis_url, procs)`, stop them.

    This process stands in for a jobplane service (the API without HTTP, a scheduler), so by
    default it runs as they do: `jobplane.process.run`'s event loop and collector settings."""
    signal.signal(signal.SIGTERM, interrupt)
    try:
        with servers(args) as (mongo_url, redis_url, procs):
            try:
                runner(start(mongo_url, redis_url, procs))
            finally:
                signal.signal(signal.SIGTERM, interrupt)  # closing the loop reset it
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit(130)


def main() -> None:
    args = parse()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
