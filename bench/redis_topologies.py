"""End-to-end throughput on one Redis server against a Redis Cluster (and Sentinel), in one run.

One mongod serves every round; each topology has its own throwaway Redis servers, all started
before the first round. The rounds alternate topologies (single, cluster, sentinel, single, ...)
so that a machine that slows down or speeds up meanwhile weighs on each alike. Each round is
throughput.py's end-to-end workload: two `jobplane worker` processes and a scheduler started
idle, then 32 concurrent callers of `RunService.create` in this process while the workers
drain. Printed: each round's figures as throughput.py prints them, then per topology the
median, the spread, and the median's ratio to the single server's.

    .venv/bin/python bench/redis_topologies.py [--runs N] [--repeat K] [--topologies a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import tempfile
from pathlib import Path

import jobplane.process
from jobplane.devstack.servers import MongoServer, free_port
from throughput import (
    E2E,
    Bench,
    Processes,
    begin,
    configuration,
    interrupt,
    parse,
    start_redis,
)

TOPOLOGIES = ("single", "cluster", "sentinel")


async def rounds(
    args: argparse.Namespace, mongo_url: str, urls: dict[str, str], procs: Processes
) -> None:
    benches = {name: Bench(args, mongo_url, url, procs) for name, url in urls.items()}
    await begin(benches["single"], configuration(benches["single"]))
    for name, url in urls.items():
        print(f"{name}: {url}")
    for i in range(args.repeat):
        for name, bench in benches.items():
            print(f"\nround {i + 1} of {args.repeat}: {name}", flush=True)
            await bench.end_to_end()
    base = statistics.median(benches["single"].figures[E2E])
    print(f"\n{'redis':10} {'median':>9} {'min':>9} {'max':>9} {'vs single':>10}  each (runs/s)")
    for name, bench in benches.items():
        rates = bench.figures[E2E]
        median = statistics.median(rates)
        each = " ".join(f"{r:,.0f}" for r in rates)
        print(
            f"{name:10} {median:9,.0f} {min(rates):9,.0f} {max(rates):9,.0f} "
            f"{median / base:10.2f}  {each}"
        )


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "--topologies",
        type=lambda s: [t for t in s.split(",") if t],
        default=list(TOPOLOGIES),
    )
    known, rest = extra.parse_known_args()
    args = parse([*rest, "--workloads", "e2e"])
    topologies = ["single", *[t for t in known.topologies if t != "single"]]
    signal.signal(signal.SIGTERM, interrupt)
    with tempfile.TemporaryDirectory(prefix="jobplane-bench-") as tmp, contextlib.ExitStack() as st:
        root = Path(tmp)
        procs = Processes(root)
        st.callback(procs.stop)
        mongo = MongoServer(root / "mongo", free_port(), root / "mongod.log")
        mongo.start()
        st.callback(mongo.stop)
        procs.servers["mongod"] = mongo.pid or 0
        urls = {t: start_redis(t, root / t, procs, st) for t in topologies}
        try:
            jobplane.process.run(rounds(args, mongo.url, urls, procs))
        except KeyboardInterrupt:
            raise SystemExit(130) from None


if __name__ == "__main__":
    main()
