"""What flow control costs: the end-to-end and latency workloads of bench/throughput.py and
bench/latency.py with the template given each limit in turn, and a drain of a large backlog
taken plainly and in round-robin turns.

Variants of the template (each limit set where it does not bind, so that what is measured is
its price, not the limit doing its job):

plain               no limit
concurrency_limit   queue_same_scope with a dedupe key per run and concurrencyLimit 2
max_running         maxRunning 100,000: every claim is admitted by the template's gate
                    (`claim_limited`), and every end gives its place back
rate_limit          rateLimit of a million a second: every start checks the window in Redis
lock                the step holds a lock keyed by the run (`payload.i`): taken beside the
                    run's claim, renewed with the heartbeat, let go after the step
round_robin         fairness round_robin: the runs wait in their scope's group of the lane

Runs are spread over 50 scope ids in every variant, so round robin has groups to take turns
between. Workloads (each as its source script describes it, with W worker processes of
concurrency C and a scheduler):

e2e         a producer creates N runs from 32 concurrent callers while the workers drain them
latency     runs arrive at R a second (open loop); create call -> step handler started
drain       a backlog of B runs (100,000 by default) created first, then drained: `plain`
            against `round_robin` (the price of taking groups in turns under a backlog)

Rounds interleave the variants (variant by variant within a round), so a machine that speeds
up or slows down moves them all, and their order turns (A B, B A, B A, A B, ...), so that each
runs first as often as the others: this VM runs slower later in a round. The summary gives each
variant's median, and against plain the median of its rounds each paired with plain's.

    .venv/bin/python bench/flow_control.py [--runs N] [--rate R] [--backlog B] [--repeat K]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import latency
import throughput
from jobplane.model import TemplateSpec
from jobplane.runs.service import RunRequest
from throughput import ACTOR, Counters, run_main

SCOPES = 50
LIMITS: dict[str, dict[str, Any]] = {
    "plain": {},
    "concurrency_limit": {
        "concurrencyPolicy": "queue_same_scope",
        "dedupeKeys": ["payload.i"],
        "concurrencyLimit": 2,
    },
    "max_running": {"maxRunning": 100_000},
    "rate_limit": {"rateLimit": {"limit": 1_000_000, "periodSeconds": 1}},
    "lock": {},  # on the step: see `spec`
    "round_robin": {"fairness": "round_robin"},
}
WORKLOADS = ("e2e", "latency", "drain")
DRAINED = ("plain", "round_robin")


def spec(base: TemplateSpec, variant: str) -> TemplateSpec:
    """`base` with the variant's limit."""
    doc = base.model_dump(by_alias=True, exclude_defaults=True)
    doc |= LIMITS[variant]
    if variant == "lock":
        lock = {"name": "bench", "key": ["payload.i"]}
        doc["steps"] = [{**step, "locks": [lock]} for step in doc["steps"]]
    return TemplateSpec.model_validate(doc)


def counted() -> Iterator[int]:
    return itertools.count()


@dataclass
class EndToEnd(throughput.Bench):
    variant: str = "plain"
    numbers: Iterator[int] = field(default_factory=counted)

    def __post_init__(self) -> None:
        self.template = spec(throughput.TEMPLATE, self.variant)

    def request(self) -> RunRequest:
        i = next(self.numbers)
        return RunRequest("bench_noop", "system", f"s{i % SCOPES}", {"i": i})


@dataclass
class Latency(latency.Bench):
    variant: str = "plain"

    def __post_init__(self) -> None:
        self.template = spec(latency.TEMPLATE, self.variant)

    def timed_request(self, i: int, sent: float) -> RunRequest:
        return RunRequest("bench_latency", "system", f"s{i % SCOPES}", {"i": i, "t": sent})


@dataclass
class Drain(EndToEnd):
    async def drain(self) -> None:
        """A backlog of `--backlog` runs, created in batches, then drained."""
        n = self.args.backlog
        async with self.fresh() as (settings, backends, service):
            for start in range(0, n, 1000):
                batch = [self.request() for _ in range(min(1000, n - start))]
                await service.create_many(batch, ACTOR)
            await backends.store.trail.flush()
            self.procs.start(settings, "worker", self.args.workers)
            await self.procs.workers_ready()
            before = await Counters.read(backends, settings, self.procs)
            started = datetime.now(UTC)
            await self.wait_succeeded(backends, settings, n)
            after = await Counters.read(backends, settings, self.procs)
            last = await self.last_completed(backends)
            window = (last - started).total_seconds()
            self.record(
                f"drain {n:,}",
                n / window,
                f"{n} runs in {window:.2f} s",
                before.per_run(after, n, window),
            )


async def main_async(args: argparse.Namespace, mongo: str, redis: str, procs: Any) -> None:
    first = EndToEnd(args, mongo, redis, procs)
    await throughput.begin(
        first,
        f"variants {', '.join(args.variants)}; e2e {args.runs} runs, latency {args.rate:g}/s for "
        f"{args.seconds:g} s (+{args.warmup:g} s warm-up), drain of {args.backlog:,}; workers "
        f"{args.workers} x concurrency {args.concurrency}; repeat {args.repeat}",
    )
    rates: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.repeat):
        print(f"round {round_ + 1} of {args.repeat}", flush=True)
        # Later in a round runs slower on a VM that slows as it heats: the order goes A B, B A,
        # B A, A B, ... so each variant runs first as often as the others.
        ahead = round_ % 4 in (0, 3)
        for variant in args.variants if ahead else args.variants[::-1]:
            if "e2e" in args.workloads:
                print(f"[{variant}] end to end", flush=True)
                bench = EndToEnd(args, mongo, redis, procs, variant=variant)
                await bench.end_to_end()
                e2e = bench.figures[throughput.E2E][0]
                rates.setdefault(("e2e runs/s", variant), []).append(e2e)
            if "latency" in args.workloads:
                print(f"[{variant}] latency", flush=True)
                timed = Latency(args, mongo, redis, procs, variant=variant)
                figures = await timed.measure()
                for name in ("latency_p50_ms", "latency_p99_ms"):
                    rates.setdefault((name, variant), []).append(figures[name])
            if "drain" in args.workloads and variant in DRAINED:
                print(f"[{variant}] drain of {args.backlog:,}", flush=True)
                drain = Drain(args, mongo, redis, procs, variant=variant)
                began = time.perf_counter()
                await drain.drain()
                print(f"  ({time.perf_counter() - began:.0f} s with the backlog's creation)")
                rates.setdefault((f"drain {args.backlog:,} runs/s", variant), []).append(
                    next(iter(drain.figures.values()))[0]
                )
    summary(rates)


def summary(rates: dict[tuple[str, str], list[float]]) -> None:
    print(f"\n{'figure':26} {'variant':18} {'median':>9} {'vs plain':>9}  each")
    for (figure, variant), values in rates.items():
        median = statistics.median(values)
        plain = rates.get((figure, "plain"))
        # Each round against plain's in the same round, then the median of those.
        paired = [v / p - 1 for v, p in zip(values, plain, strict=True)] if plain else []
        versus = f"{statistics.median(paired):+.0%}" if paired else "-"
        each = " ".join(f"{v:,.1f}" for v in values)
        print(f"{figure:26} {variant:18} {median:9,.1f} {versus:>9}  {each}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs of the e2e workload")
    parser.add_argument("--rate", type=float, default=200, help="latency: runs created a second")
    parser.add_argument("--seconds", type=float, default=10, help="latency: measured seconds")
    parser.add_argument("--warmup", type=float, default=2, help="latency: seconds not measured")
    parser.add_argument("--backlog", type=int, default=100_000, help="runs of the drain")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument(
        "--variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=list(LIMITS),
        help="comma-separated subset of: " + ",".join(LIMITS),
    )
    parser.add_argument(
        "--workloads",
        type=lambda s: [w for w in s.split(",") if w],
        default=list(WORKLOADS),
        help="comma-separated subset of: " + ",".join(WORKLOADS),
    )
    args = parser.parse_args()
    if unknown := set(args.variants) - set(LIMITS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    args.sequential_runs = 0
    args.json = False
    return args


def main() -> None:
    args = parse()
    latency.let_workers_import_this()
    run_main(args, lambda mongo, redis, procs: main_async(args, mongo, redis, procs))


if __name__ == "__main__":
    main()
