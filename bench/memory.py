"""One worker process holding 1,000 concurrent runs: its memory, and whether its heartbeats
still renew every lease in time. The goal (the issue's "memory"): under 200 MB RSS, and no
lease lost.

The work. One template, `bench_sleep`, with one `builtin.sleep` step; every run's payload is
`{"sleepSeconds": 60}` (`--sleep-seconds`). `builtin.sleep` sleeps in 0.1 s slices and reports
progress after each, which the worker writes at most every 0.25 s per run: 1,000 runs ask for
up to 4,000 progress writes a second, so the worker and mongod are as busy as such a worker
would make them.

The worker. One `python -m jobplane worker` with JOBPLANE_WORKER_CONCURRENCY=1000
(`--concurrency`), JOBPLANE_LEASE_SECONDS=10 and JOBPLANE_HEARTBEAT_SECONDS=3 (`--lease-seconds`,
`--heartbeat-seconds`), a fresh database and Redis prefix, defaults otherwise (write concern
`majority`). No scheduler runs: a lease that ran out would show as a run past its
`lockedUntil`, not be taken away.

The measurement. 1,000 runs (`--runs`) are created at once (`RunService.create_many`, the
batch API's path), then every second (`--sample`) the benchmark reads the worker's RSS (VmRSS in
/proc/<pid>/status) and, with one `find`, every run's status, `lockedUntil` and `heartbeatAt`.
"Held" is the span from the moment all runs are `running` to the moment the first one could
end (its claim plus the sleep, less 2 s). Over it: the smallest lease margin (`lockedUntil`
minus the time of the read), the gaps between two consecutive `heartbeatAt` values of a run
(p50, p90, largest), how many renewals each run saw, and every read that found a run
past its `lockedUntil`. Afterwards: how the runs ended (all should succeed), how many the
worker gave up because it could not renew their lease in time (its log), `lease_expired` and
`stale_write_rejected` events in `job_events`, and what MongoDB's profiler saw of the
heartbeats: how long each renewal's `update_many` and read-back took, and how many progress
writes missed because a heartbeat had moved the run's `version`. Peak RSS is the largest
sample and the kernel's VmHWM. Figures are printed, not judged: the exit status is non-zero
only when the benchmark itself could not run.

    .venv/bin/python bench/memory.py [--runs N] [--sleep-seconds S] [--lease-seconds L]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

from bson import ObjectId

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's process registry, throwaway servers, counters and machine line are importable.
import throughput
from jobplane.backends import Backends
from jobplane.model import RunStatus, TemplateSpec
from jobplane.runs.service import RunRequest
from jobplane.settings import Settings
from jobplane.store.database import Collections
from throughput import Counters, run_main

TEMPLATE = TemplateSpec.model_validate(
    {"type": "bench_sleep", "steps": [{"id": "nap", "handler": "builtin.sleep"}]}
)
ACTOR = "user:bench"
GOAL_MB = 200.0
# Read of each run every sample: enough to tell held, renewed and ended.
WATCHED = {"status": 1, "lockedUntil": 1, "heartbeatAt": 1}
BAD_EVENTS = ["lease_expired", "stale_write_rejected"]
MB = 1024.0
Doc = dict[str, Any]


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a live process, in kB, from /proc."""
    figures = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            figures[name] = int(value.split()[0])
    return figures


@dataclass
class Watch:
    """What the samples saw."""

    rss_kb: list[tuple[float, int]] = field(default_factory=list)
    read_seconds: list[float] = field(default_factory=list)
    # Per run: the last `heartbeatAt` seen and renewals seen; the gaps between two, of all runs.
    last_beat: dict[ObjectId, datetime] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    renewals: dict[ObjectId, int] = field(default_factory=dict)
    smallest_margin: timedelta | None = None
    # Runs seen past their `lockedUntil`, over all reads, and the reads that saw any.
    past_lease: int = 0
    past_reads: int = 0
    held_reads: int = 0

    def beat(self, doc: Doc, now: datetime, held: bool) -> None:
        beat: datetime | None = doc.get("heartbeatAt")
        if beat is None:
            return
        last = self.last_beat.get(doc["_id"])
        if last is not None and beat != last:
            self.renewals[doc["_id"]] = self.renewals.get(doc["_id"], 0) + 1
            if held:
                self.gaps.append((beat - last).total_seconds())
        self.last_beat[doc["_id"]] = beat
        until: datetime | None = doc.get("lockedUntil")
        if held and until is not None and doc["status"] == RunStatus.RUNNING:
            margin = until - now
            if self.smallest_margin is None or margin < self.smallest_margin:
                self.smallest_margin = margin
            if margin < timedelta(0):
                self.past_lease += 1


async def profile_heartbeats(backends: Backends) -> None:
    """Have MongoDB's profiler record the heartbeat's writes (the only `update_many` once the
    runs are claimed) and reads (a find on `lockedBy`), and the reads of writers whose next
    write missed: a heartbeat moves each run's `version`, which a writer's next conditional
    write names (it then checks the bulk result with an aggregate and reads the run again)."""
    db = backends.store.db
    await db.command("profile", 0)
    await db.drop_collection("system.profile")
    await db.create_collection("system.profile", capped=True, size=64 * 2**20)
    only = {
        "$or": [
            {"op": "update", "command.multi": True},
            {"op": "query", "command.filter.lockedBy": {"$exists": True}},
            {"op": "command", "command.aggregate": "job_runs"},
        ]
    }
    await db.command("profile", 1, filter=only)


async def heartbeat_times(backends: Backends, since: datetime, held_for: float) -> list[str]:
    """What MongoDB saw of the heartbeats while the runs were held: how long each write and
    read-back took (the rest of a renewal is the worker's: Python, Redis), and the writes
    they made miss."""
    db = backends.store.db
    await db.command("profile", 0)
    fields = {"op": 1, "millis": 1, "command.limit": 1}
    entries = await db["system.profile"].find({"ts": {"$gte": since}}, fields).to_list()
    kinds = {
        "update_many of the leases": [e for e in entries if e["op"] == "update"],
        "read-back find": [
            e for e in entries if e["op"] == "query" and "limit" not in e.get("command", {})
        ],
    }
    lines = []
    for what, found in kinds.items():
        millis = sorted(e["millis"] for e in found) or [0]
        lines.append(
            f"heartbeat {what} in MongoDB: {len(found)} of them, p50 "
            f"{millis[len(millis) // 2]} ms, max {millis[-1]} ms"
        )
    missed = sum(e["op"] == "query" and "limit" in e.get("command", {}) for e in entries)
    checks = sum(e["op"] == "command" for e in entries)
    lines.append(
        f"writes that missed because a heartbeat had moved the run's version: {checks} bulk "
        f"result checks (aggregate) and {missed} reads of the run again, {missed / held_for:.0f}"
        " a second"
    )
    return lines


@dataclass
class Bench(throughput.Bench):
    template: ClassVar[TemplateSpec] = TEMPLATE

    def settings(self) -> Settings:
        a = self.args
        return (
            super()
            .settings()
            .model_copy(
                update={"lease_seconds": a.lease_seconds, "heartbeat_seconds": a.heartbeat_seconds}
            )
        )

    async def measure(self) -> None:
        a = self.args
        async with self.fresh() as (settings, backends, service):
            self.procs.start(settings, "worker")
            await self.procs.workers_ready()
            pid = self.procs.children[0].proc.pid
            await asyncio.sleep(1)  # let start-up settle
            idle = memory_kb(pid)
            print(f"  worker {pid} idle: RSS {idle['VmRSS'] / MB:.1f} MB", flush=True)

            request = RunRequest(
                "bench_sleep", "system", "bench", {"sleepSeconds": a.sleep_seconds}
            )
            began = time.perf_counter()
            created = await service.create_many([request] * a.runs, ACTOR)
            ids = [ObjectId(c[0].id) for c in created if isinstance(c, tuple)]
            if len(ids) != a.runs:
                raise RuntimeError(f"created {len(ids)} of {a.runs} runs: {created[:3]}")
            print(f"  {a.runs} runs created in {time.perf_counter() - began:.2f} s", flush=True)

            watch = Watch()
            await profile_heartbeats(backends)
            await self.until_held(backends, ids, pid, watch, began)
            first = await Collections.of(backends.store.db).runs.find_one(
                {"_id": {"$in": ids}}, {"startedAt": 1}, sort=[("startedAt", 1)]
            )
            assert first is not None
            # The first run may end this long after its claim: stop watching 2 s before.
            ends = first["startedAt"] + timedelta(seconds=a.sleep_seconds - 2)
            before = await Counters.read(backends, settings, self.procs)
            held_from = time.perf_counter()
            while datetime.now(UTC) < ends:
                await self.sample(backends, ids, pid, watch, held=True)
                await asyncio.sleep(max(0.0, a.sample - watch.read_seconds[-1]))
            held_for = time.perf_counter() - held_from
            after = await Counters.read(backends, settings, self.procs)
            renewals_timed = await heartbeat_times(
                backends, ends - timedelta(seconds=held_for), held_for
            )
            peak_held = max(kb for _, kb in watch.rss_kb)

            await self.until_done(backends, ids, pid, watch)
            await asyncio.sleep(1)  # the worker copies its last events just after its writes
            bad = await Collections.of(backends.store.db).events.count_documents(
                {"type": {"$in": BAD_EVENTS}}
            )
            trailed = await Collections.of(backends.store.db).runs.count_documents(
                {"trail.type": {"$in": BAD_EVENTS}}
            )
            final = memory_kb(pid)
            log = self.procs.children[0].log.read_text()
            gave_up = log.count("lease not renewed in time")
            lost = log.count("lease lost")
            print(
                f"  worker log: {gave_up} runs stopped because their lease was not renewed in "
                f"time, {lost} lines about lost leases",
                flush=True,
            )
            self.report(
                watch,
                idle,
                final,
                peak_held,
                held_for,
                before,
                after,
                bad + trailed,
                renewals_timed,
            )

    async def sample(
        self, backends: Backends, ids: list[ObjectId], pid: int, watch: Watch, held: bool
    ) -> list[Doc]:
        self.procs.check()
        watch.rss_kb.append((time.perf_counter(), memory_kb(pid)["VmRSS"]))
        started = time.perf_counter()
        docs = (
            await Collections.of(backends.store.db)
            .runs.find({"_id": {"$in": ids}}, WATCHED)
            .to_list()
        )
        now = datetime.now(UTC)
        watch.read_seconds.append(time.perf_counter() - started)
        watch.held_reads += held
        past = watch.past_lease
        for doc in docs:
            watch.beat(doc, now, held)
        watch.past_reads += watch.past_lease > past
        return docs

    async def until_held(
        self, backends: Backends, ids: list[ObjectId], pid: int, watch: Watch, began: float
    ) -> None:
        """Sample until every run is `running`."""
        async with asyncio.timeout(120):
            while True:
                docs = await self.sample(backends, ids, pid, watch, held=False)
                running = sum(d["status"] == RunStatus.RUNNING for d in docs)
                if running == len(ids):
                    break
                if any(d["status"] not in (RunStatus.QUEUED, RunStatus.RUNNING) for d in docs):
                    raise RuntimeError("a run left `running` before all were held")
                await asyncio.sleep(self.args.sample)
        held = time.perf_counter() - began
        print(f"  all {len(ids)} runs running {held:.2f} s after the first create", flush=True)

    async def until_done(
        self, backends: Backends, ids: list[ObjectId], pid: int, watch: Watch
    ) -> None:
        """Sample until every run ended, or for a minute after the last one should have: a run
        its worker gave up (its lease not renewed in time) stays `running` with no scheduler
        to reap it. Says how the runs ended."""
        statuses: list[str] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.args.sleep_seconds + 60):
                while True:
                    docs = await self.sample(backends, ids, pid, watch, held=False)
                    statuses = [d["status"] for d in docs]
                    if all(s not in (RunStatus.QUEUED, RunStatus.RUNNING) for s in statuses):
                        break
                    await asyncio.sleep(self.args.sample)
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        print(f"  runs by status at the end: {counts}", flush=True)

    def report(
        self,
        watch: Watch,
        idle: dict[str, int],
        final: dict[str, int],
        peak_held: int,
        held_for: float,
        before: Counters,
        after: Counters,
        bad_events: int,
        renewals_timed: list[str],
    ) -> None:
        a = self.args
        peak = max(kb for _, kb in watch.rss_kb)
        verdict = "under" if max(peak, final["VmHWM"]) / MB < GOAL_MB else "NOT under"
        print(
            f"\n  RSS: idle {idle['VmRSS'] / MB:.1f} MB, peak while all {a.runs} were held "
            f"{peak_held / MB:.1f} MB, peak sampled {peak / MB:.1f} MB, kernel peak (VmHWM) "
            f"{final['VmHWM'] / MB:.1f} MB, after they ended {final['VmRSS'] / MB:.1f} MB: "
            f"{verdict} {GOAL_MB:.0f} MB"
        )
        print(
            f"  per held run: {(peak_held - idle['VmRSS']) / a.runs:.1f} kB above the idle worker"
        )
        renewals = [watch.renewals.get(i, 0) for i in watch.last_beat]
        margin = watch.smallest_margin.total_seconds() if watch.smallest_margin else float("nan")
        print(
            f"  held {held_for:.1f} s, {watch.held_reads} reads of all runs (each took "
            f"{min(watch.read_seconds):.2f}-{max(watch.read_seconds):.2f} s)"
        )
        gaps = sorted(watch.gaps) or [float("nan")]
        p50, p90 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.9)]
        print(
            f"  heartbeats (every {a.heartbeat_seconds:g} s, lease {a.lease_seconds:g} s): gaps "
            f"between two heartbeatAt of a run while held: p50 {p50:.2f} s, p90 {p90:.2f} s, "
            f"largest {gaps[-1]:.2f} s ({len(watch.gaps)} gaps); smallest lease margin seen "
            f"{margin:.2f} s; renewals per run over the whole run {min(renewals)}-{max(renewals)}"
        )
        print(
            f"  reads that found running runs past their lockedUntil: {watch.past_reads} "
            f"({watch.past_lease} runs in all); lease_expired / stale_write_rejected events: "
            f"{bad_events} (no scheduler ran, so nobody took a lapsed lease away)"
        )
        for line in renewals_timed:
            print(f"  {line}")
        cores = {
            k: (after.cpu.get(k, 0) - before.cpu.get(k, 0)) / held_for
            for k in ("workers", "mongod", "bench", "redis")
        }
        machine = (after.cpu["machine"] - before.cpu["machine"]) / held_for
        cores["others"] = max(0.0, machine - sum(cores.values()))
        ops = {
            k: (after.mongo.get(k, 0) - before.mongo.get(k, 0)) / held_for
            for k in ("update", "query", "requests")
        }
        print(
            "  while held, per second: "
            + ", ".join(f"{k} {v:,.0f}" for k, v in ops.items())
            + " MongoDB ops; CPU cores: "
            + ", ".join(f"{k} {v:.2f}" for k, v in cores.items())
        )


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs held at once")
    parser.add_argument("--concurrency", type=int, default=1000, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--sleep-seconds", type=float, default=60, help="payload.sleepSeconds")
    parser.add_argument("--lease-seconds", type=float, default=10)
    parser.add_argument("--heartbeat-seconds", type=float, default=3)
    parser.add_argument("--sample", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    args = parser.parse_args(argv)
    if args.runs > args.concurrency:
        parser.error("--runs may not exceed --concurrency: the runs beyond would wait")
    if args.sleep_seconds < 10:
        parser.error("--sleep-seconds must leave time to hold the runs (>= 10)")
    return args


async def main_async(bench: Bench) -> None:
    a = bench.args
    await throughput.begin(
        bench,
        f"runs {a.runs}, worker concurrency {a.concurrency}, sleepSeconds {a.sleep_seconds:g}, "
        f"lease {a.lease_seconds:g}s, heartbeat {a.heartbeat_seconds:g}s, sample every "
        f"{a.sample:g}s, write concern {a.write_concern}, pid {os.getpid()}",
    )
    await bench.measure()


def main() -> None:
    args = parse()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
