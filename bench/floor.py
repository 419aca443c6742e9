"""The floor under jobplane's cost per run: a bare script that makes exactly jobplane's durable
writes for a no-op run, and nothing else, measured as `throughput.py --workloads e2e` is.

What jobplane writes for one no-op run (read from the code, and checked at every start, below):
the producer inserts the run (`queued`, its `created` event in `trail`) into `job_runs`, concurrent
creates group-committed into one unordered `insert_many`, then ZADDs its id to the queue (grouped
too). A worker pops up to its free slots of ids, claims them with one pipeline `update_many`
(`store/rows.py` `claiming`) and one `aggregate` read-back, runs the step, and ends each run with
one conditional update (group-committed into one unordered `bulk_write`) that sets the step's
end, `succeeded`, `completedAt`, removes the lease and `$push`es 3 events into `trail`. The 5
events of the run are copied into `job_events` by `insert_many`s that linger 50 ms for company.
Not per run, and left out: the workers' heartbeats (every 10 s), the template reads a worker
caches, the scheduler's ticks.

How the floor gets jobplane's exact writes: at start (`--role capture`, its own process and
database) jobplane itself creates 2 runs (`RunService.create`, as throughput.py's producer) and
a real `python -m jobplane worker` (`--role capture-worker`: the same command with a PyMongo
`CommandListener` registered) runs them; every command both processes send is recorded. The
first run's inserted document and completion update become the templates (new ObjectIds, dates,
worker id, lease token and version for every run); the builders must reproduce the second run's
insert and completion exactly, and the claim (made by jobplane's own `rows.claiming`) and its
read-back must have the captured shape, or the benchmark stops. The indexes are
`jobplane.store.indexes.ensure_indexes`'s; the clients are opened as `store/mongo.py` and
`queue/connect.py` open theirs (write concern majority, retryable writes, tz-aware; redis-py with
hiredis); every process runs on `jobplane.process.run`'s event loop (uvloop) and collector
settings; the batching is jobplane's own `GroupCommit` and `Backlog`, and the worker's claim loop
keeps jobplane's (pop up to the free slots; under a backlog wait up to 10 ms for a quarter of
them). Redis is kept to the least in every variant: one sorted set, a ZADD per push batch, and a
pop of BZPOPMIN (when idle) + ZPOPMIN in one round trip, where jobplane evaluates its pop script
over its lanes.

Variants (`--variant`, several interleaved, `--repeat K` rounds):

same        jobplane's documents, updates, indexes and event copies: the floor of its data model.
no-copy     the same without the copies to `job_events`.
lean        the least a durable queue on MongoDB does: a run document of `_id`, `status` and
            `createAt`, the `_id` index alone; a claim of one `update_many` ($set of the lease)
            and one `find`, a lease-fenced `UpdateOne` per run to end it (group-committed); no
            events, no trail.
jobplane    throughput.py's end-to-end workload itself (workers, a scheduler, this process as the
            producer), so that the platform's figures sit beside the floor's in one table.

Each workload is end to end on a fresh database: P worker processes (each C concurrent runs) are
started and idle, then this process creates N runs from 32 concurrent callers while they drain.
Window: just before the first create to the last `completedAt`. Per run: CPU ms of each process
(from /proc, as throughput.py reads it), MongoDB's `serverStatus` opcounters and
`metrics.document`, journal syncs and Redis calls. At the end of each workload every run must be
`succeeded` (and, for `same`, 5 events per run in `job_events`). The table shows each column's
median over the rounds (so a total is not the sum of the medians above it).

    .venv/bin/python bench/floor.py [--runs N] [--variant same,no-copy,lean,jobplane] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import bson
import redis.asyncio as aioredis
from bson import ObjectId
from bson.codec_options import CodecOptions
from pymongo import AsyncMongoClient, UpdateOne, monitoring
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.write_concern import WriteConcern

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's servers, process registry, CPU readings and end-to-end workload are importable.
import throughput
from jobplane.clock import SystemClock
from jobplane.groupcommit import Backlog, GroupCommit
from jobplane.model import TRANSITIONS
from jobplane.process import run as run_process
from jobplane.settings import Settings
from jobplane.store import rows
from jobplane.store.indexes import ensure_indexes
from jobplane.store.trail import MongoTrailStore
from jobplane.store.types import lease_token, worker_actor
from jobplane.worker.worker import CLAIM_GATHER, default_worker_id

Doc = dict[str, Any]

VARIANTS = ("same", "no-copy", "lean", "jobplane")
DEFAULTS = Settings()
LEASE = timedelta(seconds=DEFAULTS.lease_seconds)
POLL_SECONDS = DEFAULTS.poll_seconds
QUEUE = "queue"  # the one sorted set, under the workload's prefix
# Dates as jobplane's client reads them.
CODEC: CodecOptions[Doc] = CodecOptions(tz_aware=True, tzinfo=UTC)
clock = SystemClock()  # jobplane's: UTC, to the millisecond as BSON keeps it


def spawn(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `command`, its output to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def logged(log: Path, text: bytes) -> bool:
    return text in log.read_bytes()


def load(path: Path) -> bytes:
    return path.read_bytes()


def save(path: Path, data: bytes) -> None:
    path.write_bytes(data)


# -- jobplane's writes, captured -------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """A run's inserted document and completion update as jobplane sent them; the builders
    make another run's from them."""

    run: Doc
    complete: Doc  # {"q": filter, "u": update}

    def new_run(self, oid: ObjectId, event_id: ObjectId, now: datetime) -> Doc:
        created = {**self.run["trail"][0], "_id": event_id, "jobId": str(oid), "createAt": now}
        return {**self.run, "_id": oid, "createAt": now, "updateAt": now, "trail": [created]}

    def completion(
        self,
        run: Doc,
        worker_id: str,
        started: datetime,
        now: datetime,
        event_ids: list[ObjectId],
    ) -> Doc:
        """The completion of `run` (as the claim's read-back returned it) by `worker_id`."""
        q, u = self.complete["q"], self.complete["u"]
        fence = {"lockedBy": worker_id, "leaseToken": run["leaseToken"], "version": run["version"]}
        ended = {"updateAt": now, "completedAt": now, "progress.steps.0.completedAt": now}
        events = [
            {
                **event,
                "_id": event_id,
                "jobId": str(run["_id"]),
                "actor": worker_actor(worker_id),
                "runVersion": run["version"] + 1,
                "createAt": now,
            }
            for event, event_id in zip(u["$push"]["trail"]["$each"], event_ids, strict=True)
        ]
        return {
            "q": {**q, "_id": run["_id"], **fence},
            "u": {
                **u,
                "$set": {**u["$set"], **ended, "progress.steps.0.startedAt": started},
                "$push": {"trail": {"$each": events}},
            },
        }


def read_back(
    oids: list[ObjectId], worker_id: str, token: str, event_ids: list[ObjectId]
) -> list[Doc]:
    """The claim's read-back (`transitions._read`): the runs leased, each with only the claim's
    event in its trail."""
    mine = {"$in": ["$$this._id", {"$literal": event_ids}]}
    return [
        {"$match": {"_id": {"$in": oids}, "lockedBy": worker_id, "leaseToken": token}},
        {"$set": {"trail": {"$filter": {"input": "$trail", "cond": mine}}}},
    ]


def shape(value: Any) -> Any:
    """A value's structure: its keys and the types of its leaves (a str enum is a string to
    BSON). Not the keys' order: a filter's comes from a set of guards (`rows.guarded`), which
    differs between processes."""
    if isinstance(value, dict):
        return sorted((k, shape(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return [shape(v) for v in value]
    return "str" if isinstance(value, str) else type(value).__name__


class Recorder(monitoring.CommandListener):
    """Every command of the database `db` a process's clients send, BSON-encoded, with its time."""

    def __init__(self, db: str, sink: list[bytes]) -> None:
        self.db, self.sink = db, sink

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.database_name == self.db:
            body = {"t": time.time(), "name": event.command_name, "cmd": event.command}
            self.sink.append(bson.encode(body))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def capture_worker(out: Path) -> None:
    """`python -m jobplane worker`, every command of its database recorded into `out`."""
    sink: list[bytes] = []
    monitoring.register(Recorder(os.environ["JOBPLANE_DB"], sink))
    from jobplane.cli import main

    try:
        main(["worker"])
    finally:
        out.write_bytes(b"".join(sink))


async def capture(args: argparse.Namespace) -> None:
    """Two no-op runs made by jobplane (this process as the producer, a real worker process),
    every command both sent, and the documents they left, into `args.out`."""
    from jobplane.backends import open_backends
    from jobplane.runs import RunService

    tag = os.urandom(4).hex()
    db_name, prefix = f"floor_capture_{tag}", f"floor:capture:{tag}:"
    sink: list[bytes] = []
    monitoring.register(Recorder(db_name, sink))  # this process only: it ends with the capture
    settings = Settings(
        mongodb_url=args.mongodb_url,
        redis_url=args.redis_url,
        db=db_name,
        redis_prefix=prefix,
        worker_concurrency=args.concurrency,
    )
    out, log = Path(args.out), Path(args.out + ".worker.log")
    env = os.environ | {
        "JOBPLANE_MONGODB_URL": args.mongodb_url,
        "JOBPLANE_REDIS_URL": args.redis_url,
        "JOBPLANE_DB": db_name,
        "JOBPLANE_REDIS_PREFIX": prefix,
        "JOBPLANE_WORKER_CONCURRENCY": str(args.concurrency),
    }
    command = [sys.executable, __file__, "--role", "capture-worker", "--out", f"{out}.worker"]
    async with open_backends(settings) as backends:
        store = backends.store
        try:
            await store.templates.register(throughput.TEMPLATE)
            worker = spawn(command, log, env)
            try:
                async with asyncio.timeout(60):
                    while not logged(log, b" started: queues "):
                        if worker.poll() is not None:
                            raise RuntimeError(f"capture worker exited: see {log}")
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                began = time.time()
                service = RunService(store, backends.queue)
                create = service.create(throughput.REQUEST, throughput.ACTOR)
                await asyncio.gather(create, service.create(throughput.REQUEST, throughput.ACTOR))
                async with asyncio.timeout(30):
                    while (  # noqa: ASYNC110
                        await store.db.job_runs.count_documents({"status": "succeeded"}) < 2
                        or await store.db.job_events.count_documents({}) < 10
                    ):
                        await asyncio.sleep(0.1)
                producer = [c for c in map(bson.decode, sink) if c["t"] >= began]
            finally:
                worker.send_signal(signal.SIGTERM)
                worker.wait(60)
            sent = bson.decode_all(load(Path(f"{out}.worker")), CODEC)
            captured = {
                "producer": producer,
                "worker": [c for c in sent if c["t"] >= began],
                "runs": await store.db.job_runs.find().to_list(),
                "events": await store.db.job_events.find().to_list(),
            }
            save(out, bson.encode(captured))
        finally:
            await store.client.drop_database(db_name)
            keys = [k async for k in backends.queue.redis.scan_iter(f"{prefix}*")]
            if keys:
                await backends.queue.redis.delete(*keys)


def shapes_of(captured: Doc) -> tuple[Shapes, list[str]]:
    """The templates from the first captured run, checked against the second; and what each
    process sent, for the report."""
    producer, worker = captured["producer"], captured["worker"]
    inserted = [
        d for c in producer if c["cmd"].get("insert") == "job_runs" for d in c["cmd"]["documents"]
    ]
    updates = [
        u for c in worker if c["cmd"].get("update") == "job_runs" for u in c["cmd"]["updates"]
    ]
    claims = [u for u in updates if u.get("multi")]
    completions = {u["q"]["_id"]: u for u in updates if not u.get("multi")}
    reads = [c["cmd"]["pipeline"] for c in worker if c["cmd"].get("aggregate") == "job_runs"]
    if len(inserted) != 2 or len(completions) != 2 or not claims or not reads:
        raise SystemExit(
            f"floor: jobplane's writes changed: for 2 runs it inserted {len(inserted)}, claimed "
            f"in {len(claims)} updates and read back in {len(reads)}, and ended {len(completions)}"
        )
    a, b = inserted
    ca, cb = completions[a["_id"]], completions[b["_id"]]
    shapes = Shapes(a, {"q": ca["q"], "u": ca["u"]})
    # The builders, from the first run, must give the second run's writes exactly.
    run_b = shapes.new_run(b["_id"], b["trail"][0]["_id"], b["createAt"])
    qb, ub = cb["q"], cb["u"]
    claimed = {"_id": b["_id"], "leaseToken": qb["leaseToken"], "version": qb["version"]}
    event_ids = [e["_id"] for e in ub["$push"]["trail"]["$each"]]
    started = ub["$set"]["progress.steps.0.startedAt"]
    done = ub["$set"]["completedAt"]
    complete_b = shapes.completion(claimed, qb["lockedBy"], started, done, event_ids)
    # The claim is jobplane's own `rows.claiming`: its shape for as many runs as the capture's.
    oids = claims[0]["q"]["_id"]["$in"]
    ids = [ObjectId() for _ in oids]
    now = clock.now()
    q, u = rows.claiming(TRANSITIONS["claim"], oids, ids, "w", "t", now + LEASE, now)
    checks = {
        "insert": run_b == b,
        "completion": complete_b == {"q": qb, "u": ub},
        "claim": shape([q, u]) == shape([claims[0]["q"], claims[0]["u"]]),
        "read-back": shape(read_back(oids, "w", "t", ids)) == shape(reads[0]),
    }
    # Each run's 5 events are copied to `job_events` as its trail holds them.
    trails = {e["_id"]: e for r in captured["runs"] for e in r["trail"]}
    events = {e["_id"]: e for e in captured["events"]}
    checks["events"] = len(events) == 10 and trails == events
    if not all(checks.values()):
        failed = ", ".join(k for k, ok in checks.items() if not ok)
        raise SystemExit(f"floor: jobplane's writes changed shape ({failed}): update floor.py")

    def summary(commands: list[Doc]) -> str:
        parts = []
        for c in commands:
            cmd, name = c["cmd"], c["name"]
            counting = name == "aggregate" and "$group" in str(cmd["pipeline"])  # our polls
            if name in {"insert", "update", "aggregate", "find", "delete"} and not counting:
                n = len(cmd.get("documents") or cmd.get("updates") or [None])
                multi = " (multi)" if name == "update" and cmd["updates"][0].get("multi") else ""
                parts.append(f"{name} {cmd[name]}{multi} x{n}")
        return ", ".join(parts)

    report = [
        "jobplane's commands for 2 no-op runs (checked: " + ", ".join(checks) + "):",
        "  producer: " + summary(producer),
        "  worker: " + summary(worker),
    ]
    return shapes, report


# -- the floor's processes -------------------------------------------------------------------------


def connect(mongo_url: str, redis_url: str, db: str) -> tuple[AsyncDatabase[Doc], aioredis.Redis]:
    """Clients as jobplane opens its own (`MongoStore.connect`, `open_backends`)."""
    client: AsyncMongoClient[Doc] = AsyncMongoClient(
        mongo_url, tz_aware=True, retryWrites=True, connectTimeoutMS=20_000
    )
    database = client.get_database(db, write_concern=WriteConcern(w="majority"))
    return database, aioredis.Redis.from_url(redis_url, health_check_interval=30)


class Producer:
    """Creates runs as `RunService.create` writes them: insert (grouped), copy the `created`
    event (lingering), push the id (grouped)."""

    def __init__(
        self, db: AsyncDatabase[Doc], redis: aioredis.Redis, prefix: str, variant: str, s: Shapes
    ) -> None:
        self.db, self.redis, self.key, self.variant, self.shapes = (
            db,
            redis,
            prefix + QUEUE,
            variant,
            s,
        )
        self.copy = variant == "same"
        self.inserts: GroupCommit[Doc, None] = GroupCommit(self._insert_many)
        self.pushes: GroupCommit[str, None] = GroupCommit(self._push_many)
        self.copier: Backlog[Doc] = Backlog(self._copy, MongoTrailStore.COPY_LINGER_SECONDS)

    async def create(self) -> None:
        oid, now = ObjectId(), clock.now()
        doc: Doc
        if self.variant == "lean":
            doc = {"_id": oid, "status": "queued", "createAt": now}
        else:
            doc = self.shapes.new_run(oid, ObjectId(), now)
        await self.inserts.submit(doc)
        if self.copy:
            await self.copier.hand(doc["trail"])
        await self.pushes.submit(str(oid))

    async def _insert_many(self, docs: list[Doc]) -> list[None]:
        await self.db.job_runs.insert_many(docs, ordered=False)
        return [None] * len(docs)

    async def _push_many(self, ids: list[str]) -> list[None]:
        await self.redis.zadd(self.key, dict.fromkeys(ids, 0))
        return [None] * len(ids)

    async def _copy(self, events: list[Doc]) -> None:
        await self.db.job_events.insert_many(events, ordered=False)


class Worker:
    """Claims and ends runs as jobplane's worker does, with a no-op step."""

    def __init__(
        self,
        db: AsyncDatabase[Doc],
        redis: aioredis.Redis,
        prefix: str,
        variant: str,
        shapes: Shapes,
        concurrency: int,
    ) -> None:
        self.db, self.redis, self.key, self.variant, self.shapes = (
            db,
            redis,
            prefix + QUEUE,
            variant,
            shapes,
        )
        self.copy = variant == "same"
        self.concurrency = concurrency
        self.id = default_worker_id()
        self.busy = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.slot_free = asyncio.Event()
        self.completes: GroupCommit[UpdateOne, None] = GroupCommit(self._complete_many)
        self.copier: Backlog[Doc] = Backlog(self._copy, MongoTrailStore.COPY_LINGER_SECONDS)

    async def claim_loop(self, stop: asyncio.Event) -> None:
        """`worker.Worker._claim_loop`: pop up to the free slots; under a backlog let a quarter
        of the slots free up (up to `CLAIM_GATHER`) before the next claim."""
        backlog, gathered = False, 0.0
        while not stop.is_set():
            free = self.concurrency - self.busy
            if free <= 0 or (backlog and free < self.concurrency // 4 and gathered < CLAIM_GATHER):
                self.slot_free.clear()
                waited = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.slot_free.wait(), CLAIM_GATHER if free else None)
                gathered += time.monotonic() - waited
                continue
            gathered = 0.0
            ids = await self.pop(free, 0 if backlog else POLL_SECONDS)
            backlog = len(ids) == free
            if ids:
                await self.claim(ids)

    async def pop(self, n: int, block: float) -> list[str]:
        """Up to `n` ids; idle, a blocking pop of one waits for the next push."""
        async with self.redis.pipeline(transaction=False) as pipe:
            if block:
                pipe.bzpopmin([self.key], timeout=block)
            pipe.zpopmin(self.key, n - 1 if block else n)
            replies = await pipe.execute()
        ids = [member.decode() for member, _ in replies[-1]]
        if block and replies[0]:
            ids.insert(0, replies[0][1].decode())
        return ids

    async def claim(self, ids: list[str]) -> None:
        oids, now, token = [ObjectId(i) for i in ids], clock.now(), lease_token()
        runs = self.db.job_runs
        if self.variant == "lean":
            lease: Doc = {"status": "running", "lockedBy": self.id, "leaseToken": token}
            lease |= {"lockedUntil": now + LEASE, "updateAt": now}
            await runs.update_many({"_id": {"$in": oids}, "status": "queued"}, {"$set": lease})
            docs = await runs.find({"_id": {"$in": oids}, "leaseToken": token}).to_list()
        else:
            event_ids = [ObjectId() for _ in oids]
            claim = TRANSITIONS["claim"]
            q, u = rows.claiming(claim, oids, event_ids, self.id, token, now + LEASE, now)
            await runs.update_many(q, u)
            cursor = await runs.aggregate(read_back(oids, self.id, token, event_ids))
            docs = await cursor.to_list()
            if self.copy:
                await self.copier.hand([e for d in docs for e in d["trail"]])
        self.busy += len(docs)
        for doc in docs:
            task = asyncio.create_task(self.run(doc))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def run(self, doc: Doc) -> None:
        try:
            started = clock.now()  # the no-op step
            now = clock.now()
            if self.variant == "lean":
                fence = {"_id": doc["_id"], "leaseToken": doc["leaseToken"]}
                ended = {"status": "succeeded", "completedAt": now, "updateAt": now}
                unset = {"leaseToken": "", "lockedUntil": ""}
                await self.completes.submit(UpdateOne(fence, {"$set": ended, "$unset": unset}))
                return
            ids = [ObjectId() for _ in range(3)]
            write = self.shapes.completion(doc, self.id, started, now, ids)
            await self.completes.submit(UpdateOne(write["q"], write["u"], array_filters=None))
            if self.copy:
                await self.copier.hand(write["u"]["$push"]["trail"]["$each"])
        finally:
            self.busy -= 1
            self.slot_free.set()

    async def _complete_many(self, ops: list[UpdateOne]) -> list[None]:
        result = await self.db.job_runs.bulk_write(ops, ordered=False)
        if result.matched_count != len(ops):
            print(f"{len(ops) - result.matched_count} completions matched nothing", flush=True)
        return [None] * len(ops)

    async def _copy(self, events: list[Doc]) -> None:
        await self.db.job_events.insert_many(events, ordered=False)


async def worker_main(args: argparse.Namespace) -> None:
    """A floor worker process: works until SIGTERM, then ends its runs and copies."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    shapes = Shapes(**bson.decode(load(Path(args.shapes)), CODEC))
    db, rds = connect(args.mongodb_url, args.redis_url, args.db)
    [variant] = args.variant
    worker = Worker(db, rds, args.prefix, variant, shapes, args.concurrency)
    try:
        await db.command("ping")
        await rds.ping()
        print("ready", flush=True)
        await worker.claim_loop(stop)
        while worker.tasks:
            await asyncio.wait(set(worker.tasks))
        await worker.copier.drain()
    finally:
        await rds.aclose()
        await db.client.close()


# -- the workloads ---------------------------------------------------------------------------------


@dataclass
class JobplaneBench(throughput.Bench):
    """throughput.py's workloads, keeping the end-to-end workload's readings for the table."""

    readings: list[tuple[throughput.Counters, throughput.Counters]] = field(default_factory=list)

    def spent(
        self, name: str, before: throughput.Counters, after: throughput.Counters, runs: int
    ) -> None:
        if name == throughput.E2E:
            self.readings.append((before, after))


@dataclass
class Floor:
    args: argparse.Namespace
    mongo_url: str
    redis_url: str
    procs: throughput.Processes
    shapes: Shapes | None = None
    # Per variant, each round's figures per run (rate in runs/s, CPU in ms, counts per run).
    figures: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def settings(self) -> Settings:
        return Settings(mongodb_url=self.mongo_url, redis_url=self.redis_url, db="floor_versions")

    async def capture(self) -> list[str]:
        out = self.procs.log_dir / "capture.bson"
        command = [sys.executable, __file__, "--role", "capture", "--out", str(out)]
        command += ["--mongodb-url", self.mongo_url, "--redis-url", self.redis_url]
        command += ["--concurrency", str(self.args.concurrency)]
        proc = await asyncio.create_subprocess_exec(*command)
        if await proc.wait():
            raise SystemExit(f"floor: the capture of jobplane's writes failed ({proc.returncode})")
        self.shapes, report = shapes_of(bson.decode(load(out), CODEC))
        return report

    async def workload(self, variant: str) -> None:
        if variant == "jobplane":
            bench = JobplaneBench(self.args, self.mongo_url, self.redis_url, self.procs)
            await bench.end_to_end()
            counted = bench.readings[-1]
            rate = bench.figures[throughput.E2E][-1]
            self.record(variant, rate, flat(counted[0]), flat(counted[1]))
            return
        assert self.shapes is not None
        tag = os.urandom(4).hex()
        name, prefix = f"floor_{tag}", f"floor:{tag}:"
        db, rds = connect(self.mongo_url, self.redis_url, name)
        try:
            if variant == "lean":
                await db.create_collection("job_runs")
            else:
                await ensure_indexes(db)
            await self.start_workers(variant, name, prefix)
            await asyncio.sleep(0.5)  # as throughput.py: start-up settled, the workers idle
            before = await self.read(db, rds)
            started = datetime.now(UTC)
            producer = Producer(db, rds, prefix, variant, self.shapes)
            n = self.args.runs
            created = await throughput.closed_loop(producer.create, n, throughput.CALLERS)
            await self.wait(db, "job_runs", {"status": "succeeded"}, n, 30)
            if variant == "same":
                await producer.copier.drain()
                await self.wait(db, "job_events", {}, 5 * n, 10)
            after = await self.read(db, rds)
            last = await db.job_runs.find_one({}, sort=[("completedAt", -1)])
            assert last is not None
            window = (last["completedAt"] - started).total_seconds()
            print(f"  {variant}: {n} runs in {window:.2f} s; the creates took {created:.2f} s")
            self.record(variant, n / window, before, after)
        finally:
            self.procs.stop()
            await db.client.drop_database(name)
            keys = [k async for k in rds.scan_iter(f"{prefix}*")]
            if keys:
                await rds.delete(*keys)
            await rds.aclose()
            await db.client.close()

    async def start_workers(self, variant: str, db: str, prefix: str) -> None:
        assert self.shapes is not None
        shapes = self.procs.log_dir / "shapes.bson"
        save(shapes, bson.encode({"run": self.shapes.run, "complete": self.shapes.complete}))
        command = [sys.executable, __file__, "--role", "worker", "--variant", variant]
        command += ["--mongodb-url", self.mongo_url, "--redis-url", self.redis_url, "--db", db]
        command += ["--prefix", prefix, "--concurrency", str(self.args.concurrency)]
        command += ["--shapes", str(shapes)]
        started = []
        for _ in range(self.args.workers):
            log = self.procs.log_dir / f"floor-worker-{len(self.procs.children)}.log"
            proc = spawn(command, log)
            self.procs.children.append(throughput.Child("floor-worker", proc, log))
            started.append(log)
        async with asyncio.timeout(60):
            for log in started:
                while not logged(log, b"ready"):
                    self.procs.check()
                    await asyncio.sleep(0.02)

    async def wait(
        self, db: AsyncDatabase[Doc], collection: str, query: Doc, n: int, stall: float
    ) -> None:
        """Poll (as throughput.py, every 0.2 s) until `n` documents match; give up after
        `stall` seconds without progress."""
        done, moved = 0, time.monotonic()
        while done < n:
            await asyncio.sleep(0.2)
            self.procs.check()
            count = await db[collection].count_documents(query)
            if count > done:
                done, moved = count, time.monotonic()
            elif time.monotonic() - moved > stall:
                logs = "".join(c.log.read_text()[-2000:] for c in self.procs.children)
                raise RuntimeError(f"stalled at {done} of {n} in {collection}:\n{logs}")

    async def read(self, db: AsyncDatabase[Doc], rds: aioredis.Redis) -> dict[str, float]:
        """Server-wide counters and every process's CPU seconds, now."""
        status = await db.client.admin.command("serverStatus")
        mongo: dict[str, float] = {"requests": status["network"]["numRequests"]}
        mongo |= {k: v for k, v in status["opcounters"].items() if isinstance(v, int)}
        mongo["journal syncs"] = status["wiredTiger"]["log"]["log sync operations"]
        document = status["metrics"]["document"]
        mongo |= {"docs inserted": document["inserted"], "docs updated": document["updated"]}
        stats = await rds.info("commandstats")
        mongo["redis calls"] = sum(float(v["calls"]) for v in stats.values())
        return mongo | {f"cpu {k}": v for k, v in self.procs.cpu().items()}

    def record(
        self, variant: str, rate: float, before: dict[str, float], after: dict[str, float]
    ) -> None:
        n = self.args.runs
        per = {k: (after[k] - before.get(k, 0)) / n for k in after}
        cpu = {k.removeprefix("cpu "): 1000 * v for k, v in per.items() if k.startswith("cpu ")}
        machine = cpu.pop("machine")
        ours = sum(v for v in cpu.values() if v > 0)
        row = {k: v for k, v in per.items() if not k.startswith("cpu ")} | {"runs/s": rate}
        row |= {
            "producer": cpu.pop("bench", 0),
            "workers": cpu.pop("workers", 0) + cpu.pop("floor-workers", 0),
            "scheduler": cpu.pop("schedulers", 0),
            "mongod": cpu.pop("mongod", 0),
            "redis": cpu.pop("redis", 0),
            "total": ours,
            "others": max(0.0, machine - ours),
        }
        self.figures.setdefault(variant, []).append(row)
        print(
            f"  {variant}: {rate:,.0f} runs/s; cpu ms per run: "
            + ", ".join(f"{k} {row[k]:.2f}" for k in CPU_COLUMNS)
            + "; per run: "
            + ", ".join(f"{k} {row.get(k, 0):.2f}" for k in MONGO_COLUMNS),
            flush=True,
        )


def flat(c: throughput.Counters) -> dict[str, float]:
    """throughput.py's reading in the floor's terms."""
    cpu = {f"cpu {k}": v for k, v in c.cpu.items()}
    documents = {k: c.volume[k] for k in ("docs inserted", "docs updated")}
    return c.mongo | documents | {"redis calls": sum(c.redis.values())} | cpu


CPU_COLUMNS = ("producer", "workers", "scheduler", "mongod", "redis", "total", "others")
MONGO_COLUMNS = (
    "requests",
    "insert",
    "update",
    "query",
    "getmore",
    "command",
    "docs inserted",
    "docs updated",
    "journal syncs",
    "redis calls",
)


def table(floor: Floor) -> dict[str, dict[str, float]]:
    medians = {
        variant: {k: statistics.median(r.get(k, 0) for r in rounds) for k in rounds[0]}
        for variant, rounds in floor.figures.items()
    }
    rounds = floor.args.repeat
    print(f"\nmedians of {rounds} round(s), {floor.args.runs} runs each; cpu ms per run")
    print(f"{'variant':10} {'runs/s':>7} " + " ".join(f"{c:>9}" for c in CPU_COLUMNS))
    for variant, m in medians.items():
        print(f"{variant:10} {m['runs/s']:7,.0f} " + " ".join(f"{m[c]:9.2f}" for c in CPU_COLUMNS))
    print("\nper run: mongod opcounters, documents (metrics.document), journal syncs, redis calls")
    print(f"{'variant':10} " + " ".join(f"{c.split()[-1][:8]:>8}" for c in MONGO_COLUMNS))
    for variant, m in medians.items():
        cells = [f"{m[c]:8.2f}" if c in m else f"{'-':>8}" for c in MONGO_COLUMNS]
        print(f"{variant:10} " + " ".join(cells))
    return medians


async def main_async(floor: Floor) -> None:
    variants = ", ".join(floor.args.variant)
    await throughput.begin(
        floor,
        f"runs {floor.args.runs}, callers {throughput.CALLERS}, workers {floor.args.workers}, "
        f"worker concurrency {floor.args.concurrency}, variants {variants}, "
        f"repeat {floor.args.repeat}",
    )
    for line in await floor.capture():
        print(line)
    for i in range(floor.args.repeat):
        print(f"round {i + 1} of {floor.args.repeat}", flush=True)
        for variant in floor.args.variant:
            await floor.workload(variant)
    medians = table(floor)
    if floor.args.json:
        print(json.dumps(medians))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs per workload")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="runs each worker holds")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every variant")
    parser.add_argument(
        "--variant",
        type=lambda s: [v for v in s.split(",") if v],
        default=list(VARIANTS),
        help="comma-separated, run in this order each round: " + ",".join(VARIANTS),
    )
    parser.add_argument("--json", action="store_true", help="end with the medians as JSON")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    # The processes this script starts of itself.
    parser.add_argument(
        "--role",
        choices=["main", "worker", "capture", "capture-worker"],
        default="main",
        help=argparse.SUPPRESS,
    )
    for internal in ("--db", "--prefix", "--shapes", "--out"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if unknown := set(args.variant) - set(VARIANTS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if min(args.runs, args.workers, args.concurrency, args.repeat) < 1:
        parser.error("--runs, --workers, --concurrency and --repeat must be >= 1")
    # What throughput.Bench reads of its arguments, for the `jobplane` variant.
    args.write_concern, args.sequential_runs, args.tracing = "majority", 0, False
    args.workloads = ["e2e"]
    return args


def main() -> None:
    args = parse()
    if args.role == "worker":
        run_process(worker_main(args))
    elif args.role == "capture":
        run_process(capture(args))
    elif args.role == "capture-worker":
        capture_worker(Path(args.out))
    else:
        throughput.run_main(
            args, lambda mongo, redis, procs: main_async(Floor(args, mongo, redis, procs))
        )


if __name__ == "__main__":
    main()
