"""A jobplane cluster of real processes for a chaos scenario, the load it is put under, and
the faults injected into it.

Every process is `python -m jobplane api|worker|scheduler|notifier`; MongoDB and Redis are
real servers, Redis the scenario's own so that it can be killed or flushed. The notifiers
deliver the end of every run to a webhook receiver in this process (`hooks.py`).
"""

import asyncio
import os
import random
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
from pymongo import AsyncMongoClient
from pymongo.asynchronous.database import AsyncDatabase

from jobplane.devstack import RedisServer, free_port
from jobplane.devstack.topologies import RedisClusterNodes, SentinelGroup
from jobplane.model import ACTIVE
from jobplane.settings import Settings
from tests.chaos.hooks import Receiver, serving
from tests.chaos.invariants import ENDED, ends_to_deliver
from tests.integration.processes import spawn, terminate

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "chaos-admin-key"
Doc = dict[str, Any]
# The Redis a scenario's processes use: one server, a Redis Cluster, or Sentinel's master.
Redis = RedisServer | RedisClusterNodes | SentinelGroup

RETRY = {"maxAttempts": 6, "backoffSeconds": [0]}
TEMPLATES: list[Doc] = [
    # A cap large enough for spare places (`store/gates.py`): workers keep some, and the
    # faults kill workers that hold them.
    {
        "type": "chaos_quick",
        "maxRunning": 64,
        "steps": [{"id": "only", "handler": "builtin.noop"}],
    },
    {
        "type": "chaos_steps",
        "steps": [
            {"id": "first", "handler": "builtin.echo"},
            {"id": "nap", "handler": "chaos.nap"},
            {"id": "last", "handler": "builtin.echo"},
        ],
    },
    {
        "type": "chaos_flaky",
        "steps": [
            {"id": "flaky", "handler": "builtin.fail"},
            {"id": "after", "handler": "builtin.echo"},
        ],
    },
    {"type": "chaos_fatal", "steps": [{"id": "fatal", "handler": "builtin.fail"}]},
    {
        "type": "chaos_once",
        "repeatable": False,
        "dedupeKeys": ["scopeId", "payload.key"],
        "concurrencyPolicy": "reject_same_scope",
        "steps": [{"id": "nap", "handler": "chaos.nap"}],
    },
    {
        "type": "chaos_tick",
        "schedulable": True,
        "steps": [{"id": "only", "handler": "builtin.noop"}],
    },
    # Flow control: two places per key (few keys: its runs are all in one account), at most
    # three runs started and five starts a second, so that runs wait for a place (`pending`, in
    # MongoDB), for a start (held back in Redis, which some faults wipe) and for their rate
    # window (taken by the pops the faults hit).
    {
        "type": "chaos_limited",
        "concurrencyPolicy": "queue_same_scope",
        "concurrencyLimit": 2,
        "dedupeKeys": ["payload.group"],
        "maxRunning": 3,
        "rateLimit": {"limit": 5, "periodSeconds": 1},
        "steps": [{"id": "nap", "handler": "chaos.nap"}],
    },
    # A flow beyond a line: two branches nap side by side, a third is skipped by its `when`,
    # and the last step needs all three.
    {
        "type": "chaos_diamond",
        "steps": [
            {"id": "first", "handler": "builtin.echo"},
            {"id": "left", "handler": "chaos.nap", "needs": ["first"]},
            # Offered by some workers only: the others lend it.
            {"id": "right", "handler": "chaos.far", "needs": ["first"]},
            {
                "id": "never",
                "handler": "builtin.echo",
                "needs": ["first"],
                "when": "payload.napSeconds > 1000.0",
            },
            {"id": "last", "handler": "builtin.echo", "needs": ["left", "right", "never"]},
        ],
    },
    # A map step: a child per part, two at a time, between two steps of its own.
    {
        "type": "chaos_map",
        "steps": [
            {"id": "first", "handler": "builtin.echo"},
            {
                "id": "parts",
                "workerType": "map",
                "map": {
                    "items": "payload.parts",
                    "template": "chaos_part",
                    "payload": "{'napSeconds': payload.napSeconds, 'part': item}",
                    "maxConcurrency": 2,
                },
            },
            {"id": "last", "handler": "builtin.echo"},
        ],
    },
    {"type": "chaos_part", "steps": [{"id": "nap", "handler": "chaos.nap"}]},
    # Its second step holds a lock per partner (three of them), whatever the run's account.
    {
        "type": "chaos_locked",
        "steps": [
            {"id": "first", "handler": "builtin.echo"},
            {
                "id": "call",
                "handler": "chaos.nap",
                "locks": [{"name": "chaos-partner", "key": ["payload.partner"]}],
            },
        ],
    },
]
# The share of each template in a load, out of 100.
MIX = [
    ("chaos_quick", 20),
    ("chaos_steps", 20),
    ("chaos_diamond", 10),
    ("chaos_map", 5),
    ("chaos_flaky", 10),
    ("chaos_fatal", 5),
    ("chaos_once", 10),
    ("chaos_limited", 10),
    ("chaos_locked", 10),
]
# How long the limited and the locked runs nap, whatever the load's `nap`: long enough that,
# at the shortened load's pace, runs wait for a place, a start or a lock at times, and short
# enough that the full load's backlog of them drains within its time.
LIMITED_NAP = (0.3, 1.0)
LOCKED_NAP = (0.1, 0.4)
# A call the cluster could not take (503, or no answer) is retried with its idempotency key.
RETRY_PAUSE = 0.2
POLL = 0.1


def quick(settings: Settings) -> Settings:
    """Short leases and ticks, so that a lost process is noticed within seconds."""
    return settings.model_copy(
        update={
            "lease_seconds": 2,
            "heartbeat_seconds": 0.5,
            "reconcile_seconds": 0.5,
            "poll_seconds": 0.2,
            "scheduler_lock_seconds": 2,
            "admin_key": ADMIN,
            # The receiver is on 127.0.0.1; a try cut short (a notifier killed or frozen, a
            # failover) is tried again within seconds, for a while.
            "webhook_allow_private": True,
            "webhook_retry_seconds": [0, 0.5, 1, *[2] * 9],
            "webhook_timeout_seconds": 5,
        }
    )


class Cluster:
    """The API, worker, scheduler and notifier processes of one scenario."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        self.settings = settings
        self.folder = folder
        self.trace = folder / "trace"
        self.trace.mkdir(parents=True, exist_ok=True)
        self.url = f"http://{settings.host}:{settings.port}"
        self.api: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.schedulers: list[subprocess.Popen[bytes]] = []
        self.notifiers: list[subprocess.Popen[bytes]] = []
        # Processes a fault ended on purpose; reaped at close.
        self.dead: list[subprocess.Popen[bytes]] = []
        # The workers that offer `chaos.far` (every other one).
        self.far: list[subprocess.Popen[bytes]] = []
        self._spawned = 0

    def spawn(self, command: str, far: bool = False) -> subprocess.Popen[bytes]:
        self._spawned += 1
        proc = spawn(
            self.settings,
            command,
            self.folder / f"{command}-{self._spawned}.log",
            # The suite's handlers import from here, whatever else the path holds.
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            JOBPLANE_HANDLERS="tests.chaos.steps" + (",tests.chaos.far" if far else ""),
            CHAOS_TRACE=str(self.trace),
        )
        if far:
            self.far.append(proc)
        return proc

    async def start(self, workers: int, schedulers: int, notifiers: int = 2) -> None:
        self.api = self.spawn("api")
        self.workers = [self.spawn("worker", far=i % 2 == 0) for i in range(workers)]
        self.schedulers = [self.spawn("scheduler") for _ in range(schedulers)]
        self.notifiers = [self.spawn("notifier") for _ in range(notifiers)]
        async with httpx.AsyncClient() as http, asyncio.timeout(60):
            while True:
                self.check()
                try:
                    if (await http.get(f"{self.url}/healthz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(POLL)

    def check(self) -> None:
        """Fail if a process exited that no fault ended."""
        for proc in [self.api, *self.workers, *self.schedulers, *self.notifiers]:
            if proc is not None and proc.poll() is not None:
                logs = "\n".join(
                    f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.folder.glob("*.log")
                )
                raise AssertionError(f"process {proc.pid} exited with {proc.returncode}:\n{logs}")

    def kill(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """SIGKILL a worker, scheduler or notifier, and start another in its place."""
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.dead.append(proc)
        crews = {"worker": self.workers, "scheduler": self.schedulers, "notifier": self.notifiers}
        [(command, crew)] = [(c, crew) for c, crew in crews.items() if proc in crew]
        fresh = self.spawn(command, far=proc in self.far)
        crew[crew.index(proc)] = fresh
        return fresh

    def close(self) -> None:
        for proc in [*self.workers, *self.schedulers, *self.notifiers, self.api]:
            if proc is not None:
                proc.send_signal(signal.SIGCONT)  # a frozen process cannot hear SIGTERM
                terminate(proc)
        for proc in self.dead:
            proc.wait()


@dataclass
class Load:
    """Mixed runs created through the HTTP API by concurrent callers, as users would."""

    http: httpx.AsyncClient
    rng: random.Random
    nap: tuple[float, float] = (0.02, 0.2)
    mix: list[tuple[str, int]] = field(default_factory=lambda: MIX)
    # idempotency key -> the run the API acknowledged for it
    accepted: dict[str, str] = field(default_factory=dict)
    # Refusals by design (a non-repeatable template's key in use), by error code.
    refused: Counter[str] = field(default_factory=Counter)
    # 503s and calls without an answer, each retried.
    unavailable: int = 0
    # Answers outside the contract (5xx other than 503, or an error not in SPEC's shape).
    broken: list[str] = field(default_factory=list)

    async def register(self) -> None:
        for template in TEMPLATES:
            # Lost leases count as attempts: a run may lose a few to the faults and still end.
            body = {**template, "retryPolicy": RETRY}
            response = await self.http.post("/v1/templates", json=body)
            assert response.status_code in (200, 201), response.text

    def request(self, i: int) -> Doc:
        [kind] = self.rng.choices([k for k, _ in self.mix], [w for _, w in self.mix])
        payload: Doc = {}
        if kind in ("chaos_steps", "chaos_once", "chaos_diamond", "chaos_map"):
            payload["napSeconds"] = round(self.rng.uniform(*self.nap), 3)
        if kind == "chaos_map":
            payload["parts"] = list(range(self.rng.randrange(1, 6)))
        if kind == "chaos_flaky":
            payload["failTimes"] = 1
        if kind == "chaos_fatal":
            payload["fatal"] = True
        if kind == "chaos_once":
            payload["key"] = f"k{self.rng.randrange(50)}"
        scope_id = f"acct{i % 7}"
        if kind == "chaos_limited":
            # One account: its keys are few enough to be contended.
            scope_id = "acct0"
            payload["group"] = f"g{self.rng.randrange(2)}"
            payload["napSeconds"] = round(self.rng.uniform(*LIMITED_NAP), 3)
        if kind == "chaos_locked":
            payload["partner"] = f"p{self.rng.randrange(3)}"
            payload["napSeconds"] = round(self.rng.uniform(*LOCKED_NAP), 3)
        return {
            "templateType": kind,
            "scope": "account",
            "scopeId": scope_id,
            "payload": payload,
            "idempotencyKey": f"chaos-{i}",
        }

    async def create(self, n: int, rate: float, callers: int = 32) -> None:
        """Create `n` runs, the i-th due `i / rate` seconds from now (or as soon as a caller
        is free), so that the load spans the faults; each is retried until the API answers."""
        numbers = iter(range(n))
        loop = asyncio.get_running_loop()
        began = loop.time()

        async def caller() -> None:
            for i in numbers:
                await asyncio.sleep(began + i / rate - loop.time())
                await self.create_one(self.request(i))

        await asyncio.gather(*(caller() for _ in range(callers)))

    async def create_one(self, body: Doc) -> None:
        response = await self.post("/v1/runs", body)
        if response.status_code in (200, 201):
            self.accepted[body["idempotencyKey"]] = response.json()["id"]
        elif response.status_code == 409 and _error_shape(response):
            self.refused[response.json()["error"]["code"]] += 1
        else:
            self.broken.append(f"POST /v1/runs: {response.status_code} {response.text[:300]}")

    async def post(self, path: str, body: Doc) -> httpx.Response:
        """POST until the cluster answers: a 503 or a broken connection is retried (creates
        carry an idempotency key, and a cancel repeated is a cancel)."""
        async with asyncio.timeout(180):
            while True:
                try:
                    response = await self.http.post(path, json=body)
                except httpx.TransportError:
                    self.unavailable += 1
                    await asyncio.sleep(RETRY_PAUSE)
                    continue
                if response.status_code == 503 and _error_shape(response):
                    self.unavailable += 1
                    await asyncio.sleep(RETRY_PAUSE)
                    continue
                return response


def _error_shape(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and set(body.get("error", {})) == {"code", "message", "details"}


def as_read() -> datetime:
    """Now, as MongoDB's times are read: UTC without a zone."""
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass
class Stage:
    """A started cluster with its load and its database."""

    cluster: Cluster
    load: Load
    db: AsyncDatabase[Doc]
    redis: Redis
    receiver: Receiver
    began: datetime = field(default_factory=lambda: datetime.now(UTC))
    # The windows of the faults that took locks from their holders, for the audit.
    locks_lost: list[tuple[datetime, datetime]] = field(default_factory=list)

    @contextmanager
    def losing_locks(self) -> Iterator[None]:
        """Mark what the block does as a fault that takes the steps' locks from their holders:
        it wipes Redis, or keeps holders from renewing them for a lease length."""
        began = as_read()
        try:
            yield
        finally:
            self.locks_lost.append((began, as_read()))

    async def unfinished(self) -> int:
        statuses = [s.value for s in ACTIVE]
        return await self.db.job_runs.count_documents({"status": {"$in": statuses}})

    async def settled(self, within: float) -> float:
        """Wait until every run is terminal; return how long that took."""
        began = asyncio.get_running_loop().time()
        async with asyncio.timeout(within):
            while await self.unfinished():
                self.cluster.check()
                await asyncio.sleep(POLL)
        return asyncio.get_running_loop().time() - began

    async def following(self, within: float = 60) -> None:
        """Wait until a notifier follows the trail: the events before that reach no webhook."""
        async with asyncio.timeout(within):
            while await self.db.job_meta.find_one({"_id": "webhook_feed"}) is None:
                self.cluster.check()
                await asyncio.sleep(POLL)

    async def ends(self) -> list[Doc]:
        """The trail's run ends in the scopes of the receiver's webhooks."""
        scopes = [{"scope": s, "scopeId": i} for s, i in sorted(self.receiver.subscribed)]
        find = {"type": "status_changed", "to": {"$in": sorted(ENDED)}, "$or": scopes}
        fields = {"type": 1, "to": 1, "jobId": 1, "scope": 1, "scopeId": 1}
        return await self.db.job_events.find(find, fields).to_list()

    async def delivered(self, within: float) -> tuple[list[Doc], float]:
        """Wait until every run's end in a subscribed scope reached its webhook, up to
        `within` seconds; return the ends (as then) and how long the wait took."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        while True:
            ends = await self.ends()
            expected = ends_to_deliver(ends, self.receiver.subscribed)
            got = set(self.receiver.received)
            if all(((e["scope"], e["scopeId"]), m) in got for m, e in expected.items()):
                break
            if loop.time() - began > within:
                break
            await asyncio.sleep(POLL * 5)
        return ends, loop.time() - began

    async def longest_stall(self) -> float:
        """The longest time, since the scenario began, in which no run finished."""
        ends = [self.began]
        async for run in self.db.job_runs.find({}, {"completedAt": 1}).sort("completedAt", 1):
            if at := run.get("completedAt"):
                ends.append(at.replace(tzinfo=UTC))
        return max((b - a).total_seconds() for a, b in pairwise(ends))


@asynccontextmanager
async def staged(
    folder: Path,
    mongodb_url: str,
    db: str,
    workers: int,
    schedulers: int = 1,
    slots: int = 16,
    seed: int = 0,
    redis: Redis | None = None,
    **load: Any,
) -> AsyncIterator[Stage]:
    """Start a Redis of the scenario's own (one server unless `redis` names another topology),
    the webhook receiver, then the cluster (each worker running up to `slots` runs at once);
    register the templates, and subscribe a webhook to the runs' ends in each scope."""
    redis = redis or RedisServer(folder / "redis", free_port(), folder / "redis.log")
    redis.start()
    settings = quick(
        Settings(
            mongodb_url=mongodb_url,
            redis_url=redis.url,
            db=db,
            port=free_port(),
            worker_concurrency=slots,
        )
    )
    cluster = Cluster(settings, folder)
    async with AsyncExitStack() as stack:
        stack.callback(redis.stop)
        receiver = await stack.enter_async_context(serving(Receiver()))
        stack.callback(cluster.close)
        await cluster.start(workers, schedulers)
        headers = {"authorization": f"Bearer {ADMIN}"}
        # No retry of its own on a broken connection: the load retries, and counts.
        http = httpx.AsyncClient(
            base_url=cluster.url,
            headers=headers,
            timeout=60,
            limits=httpx.Limits(max_connections=64),
        )
        stack.push_async_callback(http.aclose)
        mongo: AsyncMongoClient[Doc] = AsyncMongoClient(mongodb_url)
        stack.push_async_callback(mongo.close)
        stage = Stage(cluster, Load(http, random.Random(seed), **load), mongo[db], redis, receiver)
        await stage.load.register()
        # Before the load: a webhook receives only what happens after it was made.
        await receiver.subscribe(http)
        await stage.following()
        yield stage
