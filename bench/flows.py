"""What a flow beyond a line costs: four steps as a line against the same four as a diamond
(a, then b and c side by side, then d), and the diamond whose branches' handlers live on
different workers ("lent": b's only on the first worker, c's only on the second, so every run
lends one branch), with the end-to-end and latency workloads of bench/throughput.py and
bench/latency.py.

Every step's handler is `bench.started` (bench/latency.py), which returns the time it began,
so the latency workload times, from the create call, the start of the flow's last step `d`:
the line's fourth step, or the diamond's fan-in. Rounds interleave the two.

    .venv/bin/python bench/flows.py [--runs N] [--rate R] [--seconds S] [--repeat K]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

import latency
import throughput
from jobplane.model import TemplateSpec
from jobplane.runs.service import RunRequest
from throughput import run_main

DIAMOND: dict[str, list[str] | None] = {"a": None, "b": ["a"], "c": ["a"], "d": ["b", "c"]}
NEEDS: dict[str, dict[str, list[str] | None]] = {
    "line": {"a": None, "b": None, "c": None, "d": None},
    "diamond": DIAMOND,
    "lent": DIAMOND,
}
# The "lent" shape's branch handlers, each offered by one of the two workers.
BRANCHES = {"b": "branch_near", "c": "branch_far"}


def spec(type_: str, shape: str) -> TemplateSpec:
    steps: list[dict[str, Any]] = []
    for step, needs in NEEDS[shape].items():
        handler = "bench.started"
        if shape == "lent" and step in BRANCHES:
            handler = f"{BRANCHES[step]}:started"
        steps.append({"id": step, "handler": handler} | ({"needs": needs} if needs else {}))
    return TemplateSpec.model_validate({"type": type_, "steps": steps})


def start_workers(bench: throughput.Bench, settings: Any, shape: str) -> None:
    """The workers; for "lent", half offer b's handler and half c's."""
    if shape != "lent":
        bench.procs.start(settings, "worker", bench.args.workers)
        return
    for i in range(bench.args.workers):
        module = list(BRANCHES.values())[i % 2]
        mine = settings.model_copy(update={"handlers": [*settings.handlers, module]})
        bench.procs.start(mine, "worker")


@dataclass
class EndToEnd(throughput.Bench):
    shape: str = "line"

    def __post_init__(self) -> None:
        self.template = spec("bench_noop", self.shape)

    def settings(self) -> Any:
        return super().settings().model_copy(update={"handlers": [latency.HANDLER_MODULE]})

    def start_workers(self, settings: Any) -> None:
        start_workers(self, settings, self.shape)


@dataclass
class Latency(latency.Bench):
    shape: str = "line"
    timed_step: ClassVar[str] = "d"

    def __post_init__(self) -> None:
        self.template = spec("bench_latency", self.shape)

    def timed_request(self, i: int, sent: float) -> RunRequest:
        return latency.request(i, sent)

    def start_workers(self, settings: Any) -> None:
        start_workers(self, settings, self.shape)


async def main_async(args: argparse.Namespace, mongo: str, redis: str, procs: Any) -> None:
    first = EndToEnd(args, mongo, redis, procs)
    await throughput.begin(
        first,
        f"line against diamond, 4 steps; e2e {args.runs} runs, latency {args.rate:g}/s for "
        f"{args.seconds:g} s (+{args.warmup:g} s warm-up); workers {args.workers} x "
        f"concurrency {args.concurrency}; repeat {args.repeat}",
    )
    figures: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.repeat):
        print(f"round {round_ + 1} of {args.repeat}", flush=True)
        for shape in NEEDS:
            print(f"[{shape}] end to end", flush=True)
            bench = EndToEnd(args, mongo, redis, procs, shape=shape)
            await bench.end_to_end()
            figures.setdefault(("e2e runs/s", shape), []).append(bench.figures[throughput.E2E][0])
            print(f"[{shape}] latency to the last step's start", flush=True)
            measured = await Latency(args, mongo, redis, procs, shape=shape).measure()
            for name in ("latency_p50_ms", "latency_p99_ms"):
                figures.setdefault((name, shape), []).append(measured[name])
    print(f"\n{'figure':16} {'shape':8} {'median':>9} {'vs line':>8}  each")
    for (figure, shape), values in figures.items():
        median = statistics.median(values)
        line = statistics.median(figures[(figure, "line")])
        each = " ".join(f"{v:,.1f}" for v in values)
        print(f"{figure:16} {shape:8} {median:9,.1f} {median / line - 1:+8.0%}  {each}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs of the e2e workload")
    parser.add_argument("--rate", type=float, default=100, help="latency: runs created a second")
    parser.add_argument("--seconds", type=float, default=10, help="latency: measured seconds")
    parser.add_argument("--warmup", type=float, default=2, help="latency: seconds not measured")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    args = parser.parse_args()
    args.sequential_runs = 0
    args.json = False
    return args


def main() -> None:
    args = parse()
    latency.let_workers_import_this()
    run_main(args, lambda mongo, redis, procs: main_async(args, mongo, redis, procs))


if __name__ == "__main__":
    main()
