"""How close to its fire time a schedule's run is created, with a real `jobplane scheduler`.

The scheduler sleeps until the earliest `nextRunAt` of any enabled schedule, so how late a fire
is does not depend on a fixed poll interval. The goal (issue 5): a run created within 100 ms of
its fire time at p99.

Each case registers one schedulable template (one `builtin.noop` step) and S schedules of it
that fire every second (`* * * * * *`, UTC), then starts one `python -m jobplane scheduler`
process, the real deployment, with its settings in `JOBPLANE_*` and defaults otherwise. W
`python -m jobplane worker` processes (1 by default; `--workers 0` for none) drain the fired
runs, so that the database holds what a deployment's would and the scheduler's CPU is shared as
it would be. After `--warmup` seconds (the first fires come late: the scheduler is still
starting), the fires of the next `--seconds` seconds are measured: S x seconds runs.

The figure is, per run, `createAt` minus `scheduledFor`, both from the run document:
`scheduledFor` is the cron's exact fire time and `createAt` the scheduler's clock just before it
inserted the run (both clocks are this machine's; MongoDB keeps milliseconds, so a figure may be
up to 1 ms short). Also shown, within each fire second: the first run created (how late the
scheduler woke up), the last (how long the whole batch of due schedules took), and the gaps
between consecutive creates. Percentiles are nearest-rank.

Before and after the measured window the benchmark reads the same counters as `throughput.py`
and prints the cost of one fire (and of its drain, with workers); "others" is CPU that processes
this benchmark did not start took meanwhile.

MongoDB and Redis are started from the `local` extra's binaries in a temporary directory unless
URLs are given; counters are server-wide, so give URLs only of servers nothing else uses.

    .venv/bin/python bench/fire_precision.py [--schedules 20,1] [--seconds 60] [--workers W]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

# bench/ is not a package: Python puts a script's own folder first on sys.path, so the sibling
# benchmark's process registry, throwaway servers, counters and machine line are importable.
import throughput
from jobplane.model import ScheduleSpec, TemplateSpec
from jobplane.schedules import ScheduleService
from jobplane.store.database import Collections
from throughput import Counters, run_main

TEMPLATE = TemplateSpec.model_validate(
    {
        "type": "bench_fire",
        "schedulable": True,
        "steps": [{"id": "only", "handler": "builtin.noop"}],
    }
)
EVERY_SECOND = "* * * * * *"
GOAL_P99_MS = 100.0
# How long after the window's last fire time its runs may take to appear before it is a failure.
SETTLE_SECONDS = 10.0
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
Doc = dict[str, Any]


# -- figures ---------------------------------------------------------------------------------------


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    """Nearest rank of sorted `values`; 1.0 is the maximum."""
    return values[max(1, math.ceil(quantile * len(values))) - 1]


def line(values: Sequence[float]) -> str:
    ranked = sorted(values)
    figures = ", ".join(f"{label} {nearest_rank(ranked, q):7.1f}" for label, q in QUANTILES)
    return f"{figures}, mean {sum(ranked) / len(ranked):7.1f} ms  (n {len(ranked)})"


def ms(later: datetime, earlier: datetime) -> float:
    return 1000 * (later - earlier).total_seconds()


@dataclass
class Fires:
    """The measured runs of one case, as lateness in ms against their fire times."""

    created: list[float] = field(default_factory=list)  # scheduledFor -> createAt
    first: list[float] = field(default_factory=list)  # per fire second, the earliest create
    last: list[float] = field(default_factory=list)  # per fire second, the latest create
    gaps: list[float] = field(default_factory=list)  # between consecutive creates of a second

    @staticmethod
    def of(docs: list[Doc]) -> Fires:
        fires = Fires()
        by_second: dict[datetime, list[float]] = defaultdict(list)
        for doc in docs:
            late = ms(doc["createAt"], doc["scheduledFor"])
            fires.created.append(late)
            by_second[doc["scheduledFor"]].append(late)
        for lates in by_second.values():
            lates.sort()
            fires.first.append(lates[0])
            fires.last.append(lates[-1])
            fires.gaps += [b - a for a, b in itertools.pairwise(lates)]
        return fires

    def print(self) -> None:
        print(f"  fire -> createAt               {line(self.created)}")
        print(f"  first create of each second    {line(self.first)}")
        print(f"  last create of each second     {line(self.last)}")
        if self.gaps:
            print(f"  gap between creates            {line(self.gaps)}")


# -- the benchmark ---------------------------------------------------------------------------------


@dataclass
class Bench(throughput.Bench):
    template: ClassVar[TemplateSpec] = TEMPLATE

    async def case(self, schedules: int) -> Fires:
        """S schedules firing every second, measured for `--seconds` after the warm-up."""
        a = self.args
        async with self.fresh() as (settings, backends, _):
            service = ScheduleService(backends.store, backends.queue)
            spec = ScheduleSpec.model_validate(
                {
                    "templateType": TEMPLATE.type,
                    "scope": "system",
                    "scopeId": "bench",
                    "cron": EVERY_SECOND,
                }
            )
            for _ in range(schedules):
                await service.create(spec, "user:bench")
            if a.workers:
                self.procs.start(settings, "worker", a.workers)
                await self.procs.workers_ready()
            self.procs.start(settings, "scheduler")
            # The window starts on a whole second, `--warmup` seconds from now.
            start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1 + a.warmup)
            end = start + timedelta(seconds=a.seconds)
            await asyncio.sleep(max(0.0, (start - datetime.now(UTC)).total_seconds() - 0.3))
            self.procs.check()
            before = await Counters.read(backends, settings, self.procs)
            read_before = datetime.now(UTC)
            window = {"scheduledFor": {"$gte": start, "$lt": end}}
            expected = schedules * a.seconds
            await asyncio.sleep((end - datetime.now(UTC)).total_seconds())
            deadline = time.monotonic() + SETTLE_SECONDS
            while (
                got := await Collections.of(backends.store.db).runs.count_documents(window)
            ) < expected:
                self.procs.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{got} of {expected} fires after {SETTLE_SECONDS:g} s")
                await asyncio.sleep(0.05)
            after = await Counters.read(backends, settings, self.procs)
            read_after = datetime.now(UTC)
            self.procs.check()
            created = {"createAt": {"$gte": read_before, "$lt": read_after}}
            made = await Collections.of(backends.store.db).runs.count_documents(created)
            projection = {"scheduledFor": 1, "createAt": 1}
            docs = await Collections.of(backends.store.db).runs.find(window, projection).to_list()
            skipped = await Collections.of(backends.store.db).events.count_documents(
                {"type": "fire_skipped"}
            )
            fires = Fires.of(docs)
            seconds = (read_after - read_before).total_seconds()
            print(
                f"  {len(docs)} fires of {schedules} schedules over {a.seconds} s "
                f"({start:%H:%M:%S} to {end:%H:%M:%S} UTC); fire_skipped events {skipped}",
                flush=True,
            )
            fires.print()
            print(f"      costs over {seconds:.1f} s, per run created ({made}):")
            for detail in before.per_run(after, made, seconds):
                print(f"      {detail}", flush=True)
            return fires


def configuration(bench: Bench) -> str:
    a, settings = bench.args, bench.settings()
    return (
        f"schedules {','.join(map(str, a.schedules))} (cron '{EVERY_SECOND}'), {a.seconds} s "
        f"measured after {a.warmup} s warm-up, 1 scheduler, workers {a.workers} x concurrency "
        f"{a.concurrency}, write concern {a.write_concern}, reconcile "
        f"{settings.reconcile_seconds:g}s, scheduler lock {settings.scheduler_lock_seconds:g}s, "
        f"misfire grace {settings.misfire_grace_seconds:g}s, repeat {a.repeat}"
    )


async def main_async(bench: Bench) -> None:
    await throughput.begin(bench, configuration(bench))
    cases: dict[int, list[Fires]] = defaultdict(list)
    for i in range(bench.args.repeat):
        for schedules in bench.args.schedules:
            print(f"round {i + 1} of {bench.args.repeat}, {schedules} schedules", flush=True)
            cases[schedules].append(await bench.case(schedules))
    print()
    for schedules, rounds in cases.items():
        created = [late for fires in rounds for late in fires.created]
        p99 = nearest_rank(sorted(created), 0.99)
        verdict = "met" if p99 <= GOAL_P99_MS else "NOT met"
        print(f"{schedules} schedules, all rounds, fire -> createAt: {line(created)}")
        print(f"  goal p99 <= {GOAL_P99_MS:.0f} ms: {verdict} (p99 {p99:.1f} ms)")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--schedules",
        type=lambda s: [int(n) for n in s.split(",") if n],
        default=[20, 1],
        help="comma-separated schedule counts, one case each (default 20,1)",
    )
    parser.add_argument("--seconds", type=int, default=60, help="measured seconds per case")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured seconds first")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (0: none)")
    parser.add_argument("--concurrency", type=int, default=8, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    if not args.schedules or min(args.schedules) < 1:
        parser.error("--schedules must list counts >= 1")
    if min(args.seconds, args.concurrency, args.repeat) < 1:
        parser.error("--seconds, --concurrency and --repeat must be >= 1")
    if min(args.warmup, args.workers) < 0:
        parser.error("--warmup and --workers must be >= 0")
    return args


def main() -> None:
    args = parse()
    run_main(args, lambda mongo, redis, procs: main_async(Bench(args, mongo, redis, procs)))


if __name__ == "__main__":
    main()
