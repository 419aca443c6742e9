"""Redis's own time for one pop that takes a lone run: plain, capped (`maxRunning`) and rated
(`rateLimit`), as a worker offering 16 handlers pops them (17 lanes, the run in one).

Every client waits behind a script Redis runs, so a pop's time is taken off every other push's
and claim's answer under load. The figure is Redis's own count (`INFO commandstats`, the
pop script being the only script called): its time per call, the commands inside it included.
A private `redis-server` is started on a free port.

    .venv/bin/python bench/pop_cost.py [--pops N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
from datetime import UTC, datetime

from bson import ObjectId
from redis.asyncio import Redis

from jobplane.devstack.servers import free_port, redis_binary
from jobplane.model import RunRate, StartLimits
from jobplane.queue.entry import QueueEntry
from jobplane.queue.keys import Keys
from jobplane.queue.redis import RedisQueue

HANDLERS = [f"h{i}" for i in range(16)]
RATE = RunRate(key='["t"]', limit=10**6, period_seconds=1)
VARIANTS: dict[str, StartLimits | None] = {
    "plain": None,
    "capped": StartLimits("t", 100_000),
    "rated": StartLimits("t", rate=RATE),
}


async def pop_time(queue: RedisQueue, limits: StartLimits | None, pops: int) -> float:
    """Microseconds per pop script, each taking a run pushed alone."""
    redis = queue.redis
    await redis.config_resetstat()
    for _ in range(pops):
        entry = QueueEntry(str(ObjectId()), "q", 0, handler="h3", limits=limits)
        await queue.push([entry], datetime.now(UTC))
        popped = await queue.pop(["q"], 32, datetime.now(UTC), 0, HANDLERS)
        assert popped.run_ids == [entry.run_id], popped
    stats = await redis.info("commandstats")
    evals = stats["cmdstat_eval"]
    assert evals["calls"] == pops, evals
    return float(evals["usec_per_call"])


async def measure(port: int, args: argparse.Namespace) -> None:
    queue = RedisQueue(Redis(port=port), Keys())
    await queue.mirror_pauses([], complete=True)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, limits in VARIANTS.items():
            times[name].append(await pop_time(queue, limits, args.pops))
    for name, each in times.items():
        rounds = ", ".join(f"{t:.0f}" for t in each)
        print(f"{name:<7} µs a pop script: median {statistics.median(each):.0f} ({rounds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        command = [str(redis_binary()), "--port", str(port), "--save", "", "--dir", folder]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            asyncio.run(wait_then_measure(port, args))
        finally:
            server.terminate()
            server.wait()


async def wait_then_measure(port: int, args: argparse.Namespace) -> None:
    redis = Redis(port=port)
    for _ in range(100):
        try:
            await redis.ping()
            break
        except ConnectionError:
            await asyncio.sleep(0.05)
    await measure(port, args)


if __name__ == "__main__":
    main()
