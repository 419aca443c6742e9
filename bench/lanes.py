"""What a worker's handler count costs a pop: a queue has one lane per handler, and a worker
pops its queue's own lane plus one lane per handler it offers (`queue/keys.py`).

For each handler count H, a worker offering H handlers pops a backlog that waits in one of
its lanes, in batches (`--batch`), and then pops an empty queue (what an idle worker's
non-blocking pop costs); printed are microseconds per pop call and per run, Redis's own CPU
per pop call, and of that the time in the pop's script (`INFO commandstats`, without the
network's share). `--limits` repeats it for runs of a template with a limit that never binds:
`capped` (`maxRunning`) or `rated` (`rateLimit`, whose window the pop takes). To compare two
versions of the pop's script, `bench/pop_script.py` is steadier.

    python bench/lanes.py [--runs 20000] [--batch 16] [--handlers 0,1,10,50,200]
        [--limits plain,capped,rated]
"""

import argparse
import asyncio
import contextlib
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from jobplane.devstack import RedisServer, free_port
from jobplane.model import RunRate, StartLimits
from jobplane.queue.connect import RedisClient, open_redis, parse_redis_url
from jobplane.queue.entry import QueueEntry
from jobplane.queue.keys import Keys
from jobplane.queue.redis import RedisQueue


async def _redis_cpu(queue: RedisQueue) -> float:
    info = await queue.redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def script_us(redis: RedisClient) -> float:
    """The time Redis has spent in scripts, µs: the pop's own, without its network work, and
    much steadier than its CPU on a VM (bench/pop_script.py reads it too)."""
    info = await redis.info("commandstats")
    return float(info.get("cmdstat_eval", {}).get("usec", 0))


LIMITS: dict[str, StartLimits | None] = {
    "plain": None,
    "capped": StartLimits("bench", 10**9),
    "rated": StartLimits("bench", rate=RunRate(key='["bench"]', limit=10**9, period_seconds=1)),
}


async def measure(url: str, handlers: int, runs: int, batch: int, variant: str) -> dict[str, float]:
    offered = [f"bench.h{i:03d}" for i in range(handlers)]
    lane = offered[-1] if offered else None
    limits = LIMITS[variant]
    async with open_redis(parse_redis_url(url)) as redis:
        queue = RedisQueue(redis, Keys(f"lanes{handlers}{variant}:"))
        # A Redis without the copy of the queues' pauses pops nothing (`RedisQueue.pop`).
        await queue.mirror_pauses([], complete=True)
        now = datetime.now(UTC)
        entries = [
            QueueEntry(f"{i:024x}", "q", 0, handler=lane, limits=limits) for i in range(runs)
        ]
        for i in range(0, runs, 1000):
            await queue.push(entries[i : i + 1000], now)
        script, cpu = await script_us(redis), await _redis_cpu(queue)
        began, calls, popped = time.perf_counter(), 0, 0
        while popped < runs:
            popped += len((await queue.pop(["q"], batch, now, handlers=offered)).run_ids)
            calls += 1
        busy = time.perf_counter() - began
        busy_cpu = await _redis_cpu(queue) - cpu
        busy_script = await script_us(redis) - script
        idle_calls = 2000
        cpu, began = await _redis_cpu(queue), time.perf_counter()
        for _ in range(idle_calls):
            await queue.pop(["q"], batch, now, handlers=offered)
        idle = time.perf_counter() - began
        idle_cpu = await _redis_cpu(queue) - cpu
    return {
        "us_per_pop": 1e6 * busy / calls,
        "us_per_run": 1e6 * busy / runs,
        "redis_us_per_pop": 1e6 * busy_cpu / calls,
        "script_us_per_pop": busy_script / calls,
        "idle_us_per_pop": 1e6 * idle / idle_calls,
        "idle_redis_us_per_pop": 1e6 * idle_cpu / idle_calls,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--handlers", default="0,1,10,50,200")
    parser.add_argument("--limits", default="plain", help="of plain, capped, rated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        server = RedisServer(Path(tmp), free_port(), Path(tmp) / "redis.log")
        server.start()
        stack.callback(server.stop)
        print(f"runs {args.runs}, pops of {args.batch}; one Redis, one connection")
        print(
            "limits  handlers  us/pop  us/run  redis us/pop  script us/pop  idle us/pop"
            "  idle redis us/pop"
        )
        for variant in args.limits.split(","):
            for h in map(int, args.handlers.split(",")):
                m = await measure(server.url, h, args.runs, args.batch, variant)
                print(
                    f"{variant:<6}  {h:8d}  {m['us_per_pop']:6.0f}  {m['us_per_run']:6.1f}  "
                    f"{m['redis_us_per_pop']:12.0f}  {m['script_us_per_pop']:13.0f}  "
                    f"{m['idle_us_per_pop']:11.0f}  {m['idle_redis_us_per_pop']:17.0f}"
                )


if __name__ == "__main__":
    asyncio.run(main())
