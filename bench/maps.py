"""What a map step costs: 1,000 no-op runs created at once against one run whose map step
makes 1,000 no-op children (and the same map under `maxConcurrency`), each timed from the
create call to the end of the last run (the parent's, for a map). Rounds interleave them.

    .venv/bin/python bench/maps.py [--items N] [--cap C] [--workers W] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import throughput
from jobplane.model import TERMINAL, RunStatus, TemplateSpec
from jobplane.runs.service import RunRequest
from jobplane.store.database import Collections
from throughput import run_main

CHILD = TemplateSpec.model_validate(
    {"type": "bench_child", "steps": [{"id": "a", "handler": "builtin.noop"}]}
)


def parent(cap: int | None) -> TemplateSpec:
    fan: dict[str, Any] = {"items": "payload.items", "template": "bench_child"}
    fan |= {"payload": "{'n': item}"} | ({"maxConcurrency": cap} if cap else {})
    return TemplateSpec.model_validate(
        {"type": "bench_map", "steps": [{"id": "fan", "workerType": "map", "map": fan}]}
    )


@dataclass
class Maps(throughput.Bench):
    async def timed(self, shape: str) -> float:
        """Seconds from the create call to the end of the workload's last run."""
        n, cap = self.args.items, self.args.cap
        async with self.fresh() as (settings, backends, service):
            await backends.store.templates.register(CHILD)
            await backends.store.templates.register(parent(cap if shape == "capped map" else None))
            self.procs.start(settings, "scheduler")
            self.procs.start(settings, "worker", self.args.workers)
            await self.procs.workers_ready()
            await asyncio.sleep(0.5)
            runs = Collections.of(backends.store.db).runs
            began = time.monotonic()
            if shape == "runs":
                request = RunRequest("bench_child", "account", "bench", {"n": 0})
                made = await service.create_many([request] * n, "user:bench")
                assert all(isinstance(m, tuple) for m in made), made[:3]
                ended: dict[str, Any] = {"templateType": "bench_child"}
                want = n
            else:
                payload = {"items": list(range(n))}
                request = RunRequest("bench_map", "account", "bench", payload)
                await service.create(request, "user:bench")
                ended = {"templateType": "bench_map"}
                want = 1
            ended["status"] = {"$in": sorted(TERMINAL)}
            async with asyncio.timeout(600):
                while await runs.count_documents(ended) < want:
                    self.procs.check()
                    await asyncio.sleep(0.02)
            took = time.monotonic() - began
            bad = await runs.count_documents({"status": {"$ne": RunStatus.SUCCEEDED}})
            assert bad == 0, f"{bad} runs did not succeed"
            return took


async def main_async(args: argparse.Namespace, mongo: str, redis: str, procs: Any) -> None:
    first = Maps(args, mongo, redis, procs)
    await throughput.begin(
        first,
        f"{args.items} no-op runs against a map of {args.items} no-op children (and capped at "
        f"{args.cap}); workers {args.workers} x concurrency {args.concurrency}; "
        f"repeat {args.repeat}",
    )
    shapes = ("runs", "map", "capped map")
    seconds: dict[str, list[float]] = {s: [] for s in shapes}
    for round_ in range(args.repeat):
        print(f"round {round_ + 1} of {args.repeat}", flush=True)
        for shape in shapes:
            took = await Maps(args, mongo, redis, procs).timed(shape)
            seconds[shape].append(took)
            print(f"  {shape:10} {took:6.2f} s", flush=True)
    runs = statistics.median(seconds["runs"])
    print(f"\n{'workload':12} {'median s':>9} {'vs runs':>8}  each")
    for shape, values in seconds.items():
        median = statistics.median(values)
        each = " ".join(f"{v:.2f}" for v in values)
        print(f"{shape:12} {median:9.2f} {median / runs:7.2f}x  {each}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000, help="children (and plain runs)")
    parser.add_argument("--cap", type=int, default=20, help="maxConcurrency of the capped map")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    args = parser.parse_args()
    args.runs = args.items
    args.sequential_runs = 0
    args.json = False
    return args


def main() -> None:
    args = parse()
    run_main(args, lambda mongo, redis, procs: main_async(args, mongo, redis, procs))


if __name__ == "__main__":
    main()
