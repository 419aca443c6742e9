"""The round trips of one run, counted by the servers: MongoDB commands by name and Redis
commands, for runs created one at a time, each left to finish before the next.

One `jobplane worker` (no scheduler, so no tick runs) waits idle, polling every 30 s so that
its idle polls stay out of the counts. For each of K runs this
process reads the servers' counters, creates the run (`RunService.create`, the API's path
without HTTP), waits until the run has succeeded and its events are copied, and reads the
counters again. What the waiting itself sends (one `find` by `_id` a poll) and what the
servers saw in a span as long with no run (drivers' monitoring) are taken off, so what is left
is what one run costs: the producer's create, the worker's pop, claim, read back
and completion, and the copy of its events into `job_events`.

    .venv/bin/python bench/round_trips.py [--runs K]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

from bson import ObjectId

import throughput
from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.runs import RunService
from jobplane.store.database import Collections

POLL_SECONDS = 0.005
# The copier lingers 50 ms for more events: wait for it, with room.
COPY_SECONDS = 0.3


async def counts(backends: Backends) -> Counter[str]:
    """MongoDB commands by name (`mongo:<name>`) and Redis commands (`redis:<name>`)."""
    status = await backends.store.client.admin.command("serverStatus")
    found: Counter[str] = Counter()
    for name, c in status["metrics"]["commands"].items():
        if isinstance(c, dict) and isinstance(c.get("total"), int):
            found[f"mongo:{name}"] = c["total"]
    for stats in await throughput.redis_info(backends.queue.redis, "commandstats"):
        for k, v in stats.items():
            found[f"redis:{k.removeprefix('cmdstat_')}"] += int(v["calls"])
    return found


def minus(later: Counter[str], earlier: Counter[str]) -> Counter[str]:
    return Counter({k: later[k] - earlier[k] for k in later if later[k] != earlier[k]})


async def measure(backends: Backends, runs: int) -> None:
    service = RunService(backends.store, backends.queue)
    collection = Collections.of(backends.store.db).runs
    per_run: Counter[str] = Counter()
    idle_span = 0.0
    idle: Counter[str] = Counter()
    polls = 0
    for i in range(runs + 1):
        before = await counts(backends)
        started = time.monotonic()
        if i == 0:  # the idle span: as long as a run takes, with no run
            await asyncio.sleep(0.05 + COPY_SECONDS)
        else:
            run, _new = await service.create(throughput.REQUEST, throughput.ACTOR)
            while True:
                polls += 1
                doc = await collection.find_one({"_id": ObjectId(run.id)}, {"status": 1})
                if doc is not None and doc["status"] == RunStatus.SUCCEEDED:
                    break
                await asyncio.sleep(POLL_SECONDS)
            await asyncio.sleep(COPY_SECONDS)
        spent = minus(await counts(backends), before)
        span = time.monotonic() - started
        if i == 0:
            idle, idle_span = spent, span
        else:
            # What the servers saw with no run (drivers' monitoring), scaled to this span.
            for k, v in idle.items():
                spent[k] -= v * span / idle_span
            per_run.update(spent)
    per_run["mongo:find"] -= polls
    # Reading the counters: not the run's.
    for k in ("mongo:serverStatus", "redis:info"):
        per_run.pop(k, None)
    print(f"per run, over {runs} runs created one at a time (background taken off):")
    for k, v in sorted(per_run.items()):
        if abs(v / runs) >= 0.05:
            print(f"  {k:32} {v / runs:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    args.workers, args.concurrency, args.write_concern = 1, 32, "majority"

    async def start(mongo_url: str, redis_url: str, procs: throughput.Processes) -> None:
        bench = throughput.Bench(args, mongo_url, redis_url, procs)
        async with bench.fresh() as (settings, backends, _service):
            bench.start_workers(settings.model_copy(update={"poll_seconds": 30.0}))
            await procs.workers_ready()
            await asyncio.sleep(1)  # start-up's own commands settle
            await measure(backends, args.runs)

    throughput.run_main(args, start)


if __name__ == "__main__":
    main()
