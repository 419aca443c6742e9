"""Throughput on a database that already holds 1,000,000 finished runs and 5,000,000 events,
against the same on an empty database. The goal (the issue's "scale"): within 10%.

shapes      A few real runs of a handful of templates, made by `RunService` and a real
            `python -m jobplane worker` process in a database of their own: multi-step
            successes, fatal failures, failures after a retry, cancels while queued and while
            running, deadline expiries. Their documents are what the seeded runs copy.
seeding     `MongoStore.ensure_indexes()` on the seeded database first, so that the time
            includes index maintenance. Then N runs (1,000,000) copied from the shapes, with new
            ObjectIds that carry their creation time, statuses by --mix (succeeded, failed,
            cancelled, expired), `createAt` uniform over the 30 days before the benchmark less
            --margin-hours (6) at both ends (so that no run passes the default 30-day retention
            while the benchmark runs: the scheduler's archiving stays idle), every date of the
            document and its trail moved by the same offset, scope ids drawn from 10,000 users
            and 500 accounts, worker ids from 8 workers. E events (5,000,000) go to `job_events`:
            each run's own trail events with their ids, E/N per run (its first and last, and
            middle ones trimmed or repeated under new ids). Batches of --batch (10,000) documents
            from --seed-tasks concurrent tasks; write concern w=1 (no journal wait) for the
            seeding only, the platform keeps its own (`majority`). The trail sweep's mark is set
            as a running scheduler would have left it. An `fsync` then writes the seeding out,
            so that no round pays for flushing it.
rounds      `throughput.py`'s drain and end-to-end workloads (N runs, W worker processes, C
            concurrency, a scheduler for end-to-end), interleaved: empty, full, empty, full...
            "full" is the seeded database, "empty" one with the same collections and indexes
            and no documents; after each workload its runs and events are deleted from either,
            so both sides differ only in what was there before. (--fresh-empty: a new database
            per workload on the empty side, as throughput.py does; creating its collections and
            indexes, and the first writes to them, then count against it.) Both sides count and
            time only the workload's own runs (ObjectIds from its start), so the big database
            costs the benchmark's polling nothing.
plans       Then, with MongoDB's profiler on, the platform's list, reaper and overview reads
            against the full database: per call, time, plans and what they examined.

    .venv/bin/python bench/scale.py [--seed-runs N] [--seed-events E] [--runs N] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import shutil
import statistics
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bson import ObjectId
from pymongo.write_concern import WriteConcern

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's process registry, throwaway servers, counters and workloads are importable.
import throughput
from jobplane.backends import Backends, open_backends
from jobplane.model import TERMINAL, RunStatus, TemplateSpec
from jobplane.runs import RunService
from jobplane.runs.service import RunRequest
from jobplane.store import EventQuery, MongoStore, RunQuery
from jobplane.store.database import Collections
from throughput import DRAIN, E2E, Counters, Processes, forget_redis, run_main

Doc = dict[str, Any]
S = RunStatus

# A round pair whose neighbours took more CPU per run than this is left out of the quiet medians.
QUIET_OTHERS_MS = 1.0
SPAN = timedelta(days=30)
SEED_DB = "scale_seeded"
EMPTY_DB = "scale_empty"
USERS, ACCOUNTS, WORKERS = 10_000, 500, 8
ACTOR = "user:scale"


# -- shapes: real runs whose documents the seeding copies --------------------------------------


def spec(type_: str, steps: list[Doc], **fields: Any) -> TemplateSpec:
    return TemplateSpec.model_validate({"type": type_, "steps": steps, **fields})


SHAPE_TEMPLATES = [
    spec(
        "report_export",
        [
            {"id": "fetch", "name": "Fetch rows", "handler": "builtin.echo"},
            {"id": "render", "name": "Render", "handler": "builtin.sleep"},
            {"id": "upload", "name": "Upload", "handler": "builtin.noop"},
        ],
        description="Export a report as a file",
        timeoutSeconds=600,
    ),
    spec("send_email", [{"id": "send", "handler": "builtin.echo"}]),
    spec(
        "nightly_sync",
        [{"id": "pull", "handler": "builtin.noop"}, {"id": "push", "handler": "builtin.noop"}],
    ),
    spec("bad_input", [{"id": "parse", "handler": "builtin.fail"}]),
    spec(
        "flaky_import",
        [{"id": "import", "handler": "builtin.fail"}],
        retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]},
    ),
    spec("long_task", [{"id": "work", "handler": "builtin.sleep"}]),
    spec("slow_job", [{"id": "crawl", "handler": "builtin.sleep"}], timeoutSeconds=1),
]
# (template, payload, how many, what to do with it): the finished runs to copy.
SHAPE_RUNS: list[tuple[str, Doc, int, str]] = [
    ("report_export", {"reportId": "rep-20231", "format": "pdf", "sleepSeconds": 0.2}, 3, ""),
    ("send_email", {"to": "someone@example.com", "subject": "Your report is ready"}, 3, ""),
    ("nightly_sync", {"source": "crm", "since": "2026-01-01T00:00:00Z"}, 2, ""),
    ("bad_input", {"fatal": True, "file": "upload-77.csv"}, 2, ""),
    ("flaky_import", {"failTimes": 5, "file": "feed.xml"}, 2, ""),
    ("long_task", {"sleepSeconds": 30}, 2, "cancel running"),
    ("send_email", {"to": "later@example.com", "subject": "Reminder"}, 2, "cancel queued"),
    ("slow_job", {"sleepSeconds": 5, "url": "https://example.com"}, 2, ""),
]


async def make_shapes(bench: ScaleBench) -> dict[RunStatus, list[Doc]]:
    """Real finished runs by status, made in a throwaway database by a real worker."""
    settings = replace(bench, db=None).settings()  # a new database, whatever `bench.db` is
    async with open_backends(settings) as backends:
        store, service = backends.store, RunService(backends.store, backends.queue)
        try:
            for template in SHAPE_TEMPLATES:
                await store.templates.register(template)
            bench.procs.start(settings, "worker")
            await bench.procs.workers_ready()
            made: list[tuple[str, str]] = []
            for i, (type_, payload, n, then) in enumerate(SHAPE_RUNS):
                for k in range(n):
                    delay = 3600 if then == "cancel queued" else None
                    request = RunRequest(
                        type_, "user", f"user_{i}{k}", payload, delay_seconds=delay
                    )
                    run, _ = await service.create(request, ACTOR)
                    made.append((run.id, then))
            async with asyncio.timeout(60):
                for run_id, then in made:
                    if then == "cancel queued":
                        await service.cancel(run_id, ACTOR, "not needed any more")
                    elif then == "cancel running":
                        while (await service.get(run_id)).status != S.RUNNING:  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                        await asyncio.sleep(0.3)  # into the step, so it is cut short
                        await service.cancel(run_id, ACTOR, "stopped by the user")
                for run_id, _ in made:
                    while (await service.get(run_id)).status not in TERMINAL:  # noqa: ASYNC110
                        await asyncio.sleep(0.1)
            await store.trail.flush()
            docs = await Collections.of(store.db).runs.find({}).to_list()
        finally:
            bench.procs.stop()
            await store.client.drop_database(settings.db)
            await forget_redis(backends, settings)
    shapes: dict[RunStatus, list[Doc]] = {s: [] for s in TERMINAL}
    for doc in docs:
        shapes[RunStatus(doc["status"])].append(doc)
    return shapes


# -- seeding ---------------------------------------------------------------------------------------


def shifted(value: Any, delta: timedelta) -> Any:
    """A copy of `value` with every date moved by `delta`."""
    if isinstance(value, datetime):
        return value + delta
    if isinstance(value, dict):
        return {k: shifted(v, delta) for k, v in value.items()}
    if isinstance(value, list):
        return [shifted(v, delta) for v in value]
    return value


class Ids:
    """ObjectIds whose time is the document's own (as if made then), unique in this process."""

    def __init__(self, rng: random.Random) -> None:
        self.tail = rng.randbytes(5)
        self.counter = itertools.count(rng.randrange(2**20))

    def at(self, when: datetime) -> ObjectId:
        count = next(self.counter) % 2**24
        return ObjectId(struct.pack(">I", int(when.timestamp())) + self.tail + count.to_bytes(3))


@dataclass
class Copier:
    """Makes run documents and their `job_events` from the shapes."""

    shapes: dict[RunStatus, list[Doc]]
    mix: dict[RunStatus, float]
    runs: int
    events: int
    oldest: datetime
    newest: datetime
    rng: random.Random
    ids: Ids = field(init=False)
    workers: list[str] = field(init=False)
    times: list[datetime] = field(init=False)
    statuses: list[RunStatus] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = Ids(self.rng)
        self.workers = [f"worker-{k}-{self.rng.randrange(10**6):06d}" for k in range(WORKERS)]
        # Creation times, oldest first: the seeding writes in time order, as a live system does.
        seconds = (self.newest - self.oldest).total_seconds()
        self.times = sorted(
            self.oldest + timedelta(seconds=self.rng.random() * seconds) for _ in range(self.runs)
        )
        self.statuses = self.rng.choices(list(self.mix), list(self.mix.values()), k=self.runs)

    def batch(self, start: int, stop: int) -> tuple[list[Doc], list[Doc]]:
        """Runs number `start` to `stop`, and their events."""
        runs: list[Doc] = []
        events: list[Doc] = []
        for i in range(start, stop):
            run, trail = self.run(i)
            runs.append(run)
            # Exactly `self.events` in all: run i gets its share of the total.
            share = self.events * (i + 1) // self.runs - self.events * i // self.runs
            events += self.share(trail, share)
        return runs, events

    def run(self, i: int) -> tuple[Doc, list[Doc]]:
        shape = self.rng.choice(self.shapes[self.statuses[i]])
        created = self.times[i]
        doc: Doc = shifted(shape, created - shape["createAt"])
        run_id = self.ids.at(created)
        doc["_id"] = run_id
        if self.rng.random() < 0.9:
            scope, scope_id = "user", f"user_{self.rng.randrange(USERS)}"
        else:
            scope, scope_id = "account", f"acct_{self.rng.randrange(ACCOUNTS)}"
        worker = self.rng.choice(self.workers)
        doc |= {"scope": scope, "scopeId": scope_id}
        if "lockedBy" in doc:
            doc["lockedBy"] = worker
        # A finished run holds no key (a non-repeatable template's success aside: none here).
        for key in ("dedupeKey", "dedupeWait", "idempotencyKey"):
            doc.pop(key, None)
        for event in doc["trail"]:
            event |= {"_id": self.ids.at(event["createAt"]), "jobId": str(run_id)}
            event |= {"scope": scope, "scopeId": scope_id}
            if event["actor"].startswith("worker:"):
                event["actor"] = f"worker:{worker}"
        return doc, doc["trail"]

    def share(self, trail: list[Doc], n: int) -> list[Doc]:
        """`n` of the run's events: its first and last always, the middle ones trimmed, or
        repeated under new ids when the trail is shorter than `n`."""
        if n <= 0:
            return []
        if n >= len(trail):
            middle = trail[1:-1] or trail
            extra = [
                {**event, "_id": self.ids.at(event["createAt"])}
                for event in itertools.islice(itertools.cycle(middle), n - len(trail))
            ]
            return [*trail, *extra]
        if n == 1:
            return [trail[-1]]
        return [trail[0], *trail[1 : n - 1], trail[-1]]


async def seed(backends: Backends, db: str, copier: Copier, batch: int, tasks: int) -> float:
    """Write the copier's runs and events into `db` (indexes first); returns the seconds."""
    store = MongoStore(backends.store.client, db)
    await store.ensure_indexes()
    # w=1 without the journal: the seeding only, whose figure is not what is measured.
    fast = backends.store.client.get_database(db, write_concern=WriteConcern(w=1))
    runs, events = fast["job_runs"], fast["job_events"]
    starts = iter(range(0, copier.runs, batch))
    written = [0, 0]
    started = time.perf_counter()
    last_report = started

    async def worker() -> None:
        nonlocal last_report
        for start in starts:
            docs, trail = copier.batch(start, min(start + batch, copier.runs))
            await runs.insert_many(docs, ordered=False)
            for k in range(0, len(trail), batch):
                await events.insert_many(trail[k : k + batch], ordered=False)
            written[0] += len(docs)
            written[1] += len(trail)
            if time.perf_counter() - last_report > 30:
                last_report = time.perf_counter()
                elapsed = last_report - started
                print(
                    f"  seeded {written[0]:,} runs, {written[1]:,} events in {elapsed:.0f} s",
                    flush=True,
                )

    await asyncio.gather(*(worker() for _ in range(tasks)))
    # What a scheduler that ran all along would have left: its trail sweep's mark.
    await Collections.of(store.db).meta.update_one(
        {"_id": "trail_sweep"}, {"$set": {"through": copier.newest}}, upsert=True
    )
    seconds = time.perf_counter() - started
    flushing = time.perf_counter()
    await backends.store.client.admin.command("fsync")
    print(f"  fsync after seeding: {time.perf_counter() - flushing:.1f} s", flush=True)
    return seconds


async def sizes(store: MongoStore) -> list[str]:
    """What the database holds: documents, data, storage and index sizes."""
    mb = 2**20
    stats = await store.db.command("dbStats")
    lines = [
        f"db {store.db.name}: {stats['objects']:,} documents, data "
        f"{stats['dataSize'] / mb:,.0f} MB, storage {stats['storageSize'] / mb:,.0f} MB, "
        f"indexes {stats['indexSize'] / mb:,.0f} MB"
    ]
    for name in ("job_runs", "job_events"):
        coll = await store.db.command("collStats", name)
        indexes = ", ".join(f"{k} {v / mb:,.0f}" for k, v in coll["indexSizes"].items())
        lines.append(
            f"  {name}: {coll['count']:,} documents of {coll.get('avgObjSize', 0):,.0f} B on "
            f"average, data {coll['size'] / mb:,.0f} MB, storage {coll['storageSize'] / mb:,.0f} "
            f"MB, indexes {coll['totalIndexSize'] / mb:,.0f} MB ({indexes})"
        )
    return lines


# -- the workloads on a given database -------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """CPU per run over a workload's window, in ms: what other processes of the machine took
    (a busy neighbour makes a round's rate worthless), mongod, and the worker processes."""

    others: float
    mongod: float
    workers: float

    @staticmethod
    def between(before: Counters, after: Counters, runs: int) -> Cost:
        ms = {k: 1000 * (v - before.cpu.get(k, 0)) / runs for k, v in after.cpu.items()}
        ours = sum(v for k, v in ms.items() if k != "machine")
        return Cost(max(0.0, ms["machine"] - ours), ms.get("mongod", 0), ms.get("workers", 0))


@dataclass
class ScaleBench(throughput.Bench):
    """`throughput.Bench` on a database it keeps (`db`: the seeded one, or one left empty), or on
    a fresh one per workload (`db` None, as throughput.py does), keeping each workload's CPU per
    run for the table."""

    costs: dict[str, list[Cost]] = field(default_factory=dict)

    def spent(self, name: str, before: Counters, after: Counters, runs: int) -> None:
        self.costs.setdefault(name, []).append(Cost.between(before, after, runs))


# -- plans at scale --------------------------------------------------------------------------------


async def plans(store: MongoStore, template_type: str, scope: tuple[str, str], job_id: str) -> None:
    """Time and work of the platform's reads on the seeded database, from MongoDB's profiler."""
    now = store.clock.now()
    within = [scope, ("account", "acct_1")]
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "list_runs (first page)": lambda: store.runs.page(RunQuery(), None, 51),
        "list_runs status=failed": lambda: store.runs.page(RunQuery(status=S.FAILED), None, 51),
        f"list_runs templateType={template_type}": lambda: store.runs.page(
            RunQuery(template_type=template_type), None, 51
        ),
        f"list_runs status=succeeded, templateType={template_type}": lambda: store.runs.page(
            RunQuery(status=S.SUCCEEDED, template_type=template_type), None, 51
        ),
        # No report_export run ever fails: nothing matches, what is read is the walk.
        "list_runs status=failed, templateType=report_export": lambda: store.runs.page(
            RunQuery(status=S.FAILED, template_type="report_export"), None, 51
        ),
        "list_runs scope+scopeId": lambda: store.runs.page(
            RunQuery(scope=scope[0], scope_id=scope[1]), None, 51
        ),
        "list_runs status=expired, scope+scopeId": lambda: store.runs.page(
            RunQuery(status=S.EXPIRED, scope=scope[0], scope_id=scope[1]), None, 51
        ),
        "list_runs status=cancelled, user key (2 scopes)": lambda: store.runs.page(
            RunQuery(status=S.CANCELLED), within, 51
        ),
        "list_events (first page)": lambda: store.trail.page(EventQuery(), None, 101),
        "list_events jobId": lambda: store.trail.page(EventQuery(job_id=job_id), None, 101),
        "list_events type=status_changed, last day": lambda: store.trail.page(
            EventQuery(type="status_changed", since=now - timedelta(days=1)), None, 101
        ),
        "list_events scope+scopeId": lambda: store.trail.page(
            EventQuery(scope=scope[0], scope_id=scope[1]), None, 101
        ),
        "list_events actor=reaper": lambda: store.trail.page(EventQuery(actor="reaper"), None, 101),
        "list_events user key (2 scopes), a week": lambda: store.trail.page(
            EventQuery(since=now - timedelta(days=8), until=now - timedelta(days=1)), within, 101
        ),
        "events_of": lambda: store.trail.events_of(job_id),
        "expired_leases": lambda: store.maintenance.expired_leases(500),
        "overdue": lambda: store.maintenance.overdue(500),
        "claimable": lambda: store.maintenance.to_reconcile(None, 500, now),
        "waited_keys": lambda: store.maintenance.waited_keys(500),
        "overview, all scopes": lambda: store.overview.run_figures(None, now),
        "overview, user key (2 scopes)": lambda: store.overview.run_figures(within, now),
    }
    print(f"\n{'call':55} {'ms':>8} {'docs':>9} {'keys':>9} {'returned':>8}  plans")
    for name, call in calls.items():
        await store.db.command("profile", 0)
        await store.db.drop_collection("system.profile")
        await store.db.create_collection("system.profile", capped=True, size=64 * 2**20)
        await store.db.command("profile", 2)
        try:
            await call()
        finally:
            await store.db.command("profile", 0)
        ours = {"ns": {"$regex": r"\.job_(runs|events)$"}}
        entries = await store.db["system.profile"].find(ours).to_list()
        millis = sum(e.get("millis", 0) for e in entries)
        docs = sum(e.get("docsExamined", 0) for e in entries)
        keys = sum(e.get("keysExamined", 0) for e in entries)
        returned = sum(e.get("nreturned", 0) for e in entries)
        summaries = ", ".join(dict.fromkeys(e.get("planSummary", "-")[:48] for e in entries))
        print(f"{name[:55]:55} {millis:8,} {docs:9,} {keys:9,} {returned:8,}  {summaries}")


# -- report ----------------------------------------------------------------------------------------


def table(empty: ScaleBench, full: ScaleBench) -> None:
    """Each round's pair, then medians over all rounds and over the quiet ones."""
    print("\nround by round: runs/s (CPU ms per run of other processes, of mongod), full/empty")
    for name in (DRAIN, E2E):
        pairs = list(
            zip(
                empty.figures.get(name, []),
                empty.costs.get(name, []),
                full.figures.get(name, []),
                full.costs.get(name, []),
                strict=False,
            )
        )
        for i, (e, ec, f, fc) in enumerate(pairs):
            print(
                f"  {name:38} {i + 1}: empty {e:6,.0f} ({ec.others:5.2f}, {ec.mongod:4.2f})  "
                f"full {f:6,.0f} ({fc.others:5.2f}, {fc.mongod:4.2f})  {f / e:5.3f}"
            )
    print(
        f"\n{'workload (runs/s)':40} {'empty median':>12} {'min-max':>13} {'full median':>12} "
        f"{'min-max':>13} {'full/empty':>10} {'round by round':>15}"
    )
    for name, rates in empty.figures.items():
        other = full.figures.get(name, [])
        if not other:
            continue
        ratios = [f / e for e, f in zip(rates, other, strict=False)]
        ratio = statistics.median(other) / statistics.median(rates)
        print(
            f"{name:40} {statistics.median(rates):12,.0f} {min(rates):6,.0f}-{max(rates):<6,.0f} "
            f"{statistics.median(other):12,.0f} {min(other):6,.0f}-{max(other):<6,.0f} "
            f"{ratio:10.3f} {min(ratios):7.3f}-{max(ratios):.3f}"
        )
    print(
        f"\nrounds whose neighbours took under {QUIET_OTHERS_MS:g} ms of CPU per run in both "
        "halves, and mongod's CPU per run over all rounds (a cost, less sensitive to them):"
    )
    for name in (DRAIN, E2E):
        if not empty.costs.get(name) or not full.costs.get(name):
            continue  # not among --workloads
        rows = zip(
            empty.figures.get(name, []),
            empty.costs.get(name, []),
            full.figures.get(name, []),
            full.costs.get(name, []),
            strict=False,
        )
        quiet = [(e, f) for e, ec, f, fc in rows if max(ec.others, fc.others) < QUIET_OTHERS_MS]
        mongod_e = statistics.median(c.mongod for c in empty.costs.get(name, []))
        mongod_f = statistics.median(c.mongod for c in full.costs.get(name, []))
        if quiet:
            e_med = statistics.median(e for e, _ in quiet)
            f_med = statistics.median(f for _, f in quiet)
            line = f"{len(quiet)} quiet: empty {e_med:,.0f}, full {f_med:,.0f}, {f_med / e_med:.3f}"
        else:
            line = "no quiet round"
        if mongod_e:
            line += f"; mongod ms per run: empty {mongod_e:.2f}, full {mongod_f:.2f}"
            line += f" ({mongod_f / mongod_e:.3f})"
        else:  # a mongod named by URL: its CPU is not this benchmark's to read
            line += "; mongod CPU not read"
        print(f"  {name:38} {line}")


def disk(path: Path) -> str:
    usage = shutil.disk_usage(path)
    return f"{usage.free / 2**30:,.1f} GiB free of {usage.total / 2**30:,.0f} GiB on {path}"


def du(path: Path) -> float:
    """GiB under `path` (files mongod removes meanwhile aside)."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            total += p.stat().st_size if p.is_file() else 0
    return total / 2**30


def parse_mix(text: str) -> dict[RunStatus, float]:
    mix = {RunStatus(k): float(v) for k, v in (part.split("=") for part in text.split(","))}
    if not set(mix) <= TERMINAL or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("statuses must be terminal, weights positive")
    return mix


async def main_async(empty: ScaleBench, full: ScaleBench) -> None:
    a = empty.args
    await throughput.begin(
        empty,
        throughput.configuration(empty),
        f"seeded: {a.seed_runs:,} runs, {a.seed_events:,} events, mix "
        + ", ".join(f"{s.value} {w:g}" for s, w in a.mix.items())
        + f", batches of {a.batch:,} from {a.seed_tasks} tasks, write concern 1 for seeding",
    )
    # Opening the backends creates the empty side's collections and indexes (when it keeps one).
    async with open_backends(empty.settings()) as backends:
        opts = await backends.store.client.admin.command("getCmdLineOpts")
        dbpath = Path(opts["parsed"].get("storage", {}).get("dbPath", "/"))
        print("before seeding:", disk(dbpath), flush=True)
        started = time.perf_counter()
        shapes = await make_shapes(empty)
        counts = ", ".join(f"{s.value} {len(d)}" for s, d in shapes.items())
        trails = [len(d["trail"]) for docs in shapes.values() for d in docs]
        print(
            f"shapes: {sum(map(len, shapes.values()))} real runs ({counts}) in "
            f"{time.perf_counter() - started:.1f} s, trails of {min(trails)}-{max(trails)} "
            f"events",
            flush=True,
        )
        missing = [s.value for s in a.mix if not shapes[s]]
        if missing:
            raise RuntimeError(f"no real run ended {missing}")
        await backends.store.client.drop_database(SEED_DB)
        now, margin = datetime.now(UTC), timedelta(hours=a.margin_hours)
        copier = Copier(
            shapes,
            a.mix,
            a.seed_runs,
            a.seed_events,
            now - SPAN + margin,
            now - margin,
            random.Random(a.seed),
        )
        seconds = await seed(backends, SEED_DB, copier, a.batch, a.seed_tasks)
        seeded = MongoStore(backends.store.client, SEED_DB)
        print(
            f"seeded {a.seed_runs:,} runs and {a.seed_events:,} events in {seconds:,.0f} s "
            f"({(a.seed_runs + a.seed_events) / seconds:,.0f} documents/s), indexes included",
            flush=True,
        )
        for line in await sizes(seeded):
            print(line)
        # Only when mongod is local to this machine, as the throwaway one is.
        if dbpath.is_dir():  # noqa: ASYNC240
            print(f"mongod files {du(dbpath):,.1f} GiB; {disk(dbpath)}", flush=True)
        sample = await Collections.of(seeded.db).runs.find_one(
            {"templateType": "nightly_sync"}, {"scope": 1, "scopeId": 1}
        )
        assert sample is not None
        scope = (sample["scope"], sample["scopeId"])
        job_id = str(sample["_id"])

        try:
            for i in range(a.repeat):
                for bench, label in ((empty, "empty"), (full, "full")):
                    print(f"\nround {i + 1} of {a.repeat}, {label} database", flush=True)
                    for name in a.workloads:
                        await {"drain": bench.drain, "e2e": bench.end_to_end}[name]()
            if a.workloads and a.repeat:
                table(empty, full)
            for bench, label in ((empty, "empty"), (full, "full")):
                if bench.stranded:
                    stranded = ", ".join(f"{x} / {y}" for x, y in bench.stranded)
                    print(f"{label}: stranded / reconciler pushes per end-to-end round: {stranded}")
            await plans(seeded, "nightly_sync", scope, job_id)
        finally:
            await backends.store.client.drop_database(EMPTY_DB)
            if not a.keep:
                await backends.store.client.drop_database(SEED_DB)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed-runs", type=int, default=1_000_000)
    parser.add_argument("--seed-events", type=int, default=5_000_000)
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=parse_mix("succeeded=0.7,failed=0.15,cancelled=0.1,expired=0.05"),
        help="terminal statuses of the seeded runs, with weights",
    )
    parser.add_argument("--batch", type=int, default=10_000, help="documents per insert_many")
    parser.add_argument("--seed-tasks", type=int, default=4, help="concurrent seeding tasks")
    parser.add_argument(
        "--margin-hours",
        type=float,
        default=6,
        help="the seeded runs' times keep this far from now and from the 30-day retention",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the seeding")
    parser.add_argument("--keep", action="store_true", help="keep the seeded database")
    parser.add_argument(
        "--fresh-empty",
        action="store_true",
        help="the empty side on a new database per workload, as throughput.py (creating its "
        "collections and 20 indexes is then part of its figure)",
    )
    parser.add_argument("--runs", type=int, default=5000, help="runs per workload")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of empty, then full")
    parser.add_argument(
        "--workloads",
        type=lambda s: [w for w in s.split(",") if w],
        default=["drain", "e2e"],
        help="comma-separated subset of: drain,e2e (none: seed and show the plans only)",
    )
    args = parser.parse_args(argv)
    if unknown := set(args.workloads) - {"drain", "e2e"}:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    if min(args.seed_runs, args.batch, args.seed_tasks, args.runs, args.repeat) < 1:
        parser.error("--seed-runs, --batch, --seed-tasks, --runs and --repeat must be >= 1")
    # What throughput.Bench reads of its arguments.
    args.sequential_runs, args.json = 0, False
    return args


def main() -> None:
    args = parse()

    def start(mongo: str, redis: str, procs: Processes) -> Coroutine[Any, Any, None]:
        empty = ScaleBench(args, mongo, redis, procs, db=None if args.fresh_empty else EMPTY_DB)
        full = ScaleBench(args, mongo, redis, procs, db=SEED_DB)
        return main_async(empty, full)

    run_main(args, start)


if __name__ == "__main__":
    main()
