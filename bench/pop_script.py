"""The pop script of this tree against the one of a git revision, in one Redis, pop by pop.

A change to the pop's Lua is measured here rather than by `bench/lanes.py` run on two clones:
this VM's speed moves within seconds, and a script's time moves with it. Each round pushes 16
runs of one lane under fresh keys and pops them with each version in turn (the order turning
round by round), and reads the time Redis spent in the script (`INFO commandstats`). Printed
per variant of the runs: the median and the 10th and 90th percentiles of each version's time
per pop, in µs. `rated` runs have a rate limit that never binds; `refused` one of 4 a second,
so that 12 of the 16 are sent back.

    .venv/bin/python bench/pop_script.py [--against HEAD] [--rounds 60]
"""

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import tempfile
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from jobplane.devstack import RedisServer, free_port
from jobplane.model import RunRate, StartLimits
from jobplane.queue.connect import RedisClient, open_redis, parse_redis_url
from jobplane.queue.entry import QueueEntry
from jobplane.queue.keys import Keys
from jobplane.queue.redis import RedisQueue
from lanes import script_us

PARTS = ("fair", "rate", "pop")  # as `Popper` loads them: the preludes, then the pop
LUA = "platform/jobplane/queue/lua"
WINDOW = '["bench"]'
# Each variant's limits, and how many of the 16 a pop takes.
VARIANTS: dict[str, tuple[StartLimits | None, int]] = {
    "plain": (None, 16),
    "rated": (StartLimits("bench", rate=RunRate(key=WINDOW, limit=10**9, period_seconds=1)), 16),
    "refused": (StartLimits("bench", rate=RunRate(key=WINDOW, limit=4, period_seconds=1)), 4),
}


def _source(texts: list[str]) -> str:
    """The script as `queue.calls.script` sends it: its comment lines left out."""
    lines = "\n".join(texts).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("--"))


def this_tree() -> str:
    lua = resources.files("jobplane.queue") / "lua"
    return _source([(lua / f"{part}.lua").read_text() for part in PARTS])


def at_revision(revision: str) -> str:
    def show(part: str) -> str:
        return subprocess.run(
            ["git", "show", f"{revision}:{LUA}/{part}.lua"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    return _source([show(part) for part in PARTS])


async def one_pop(redis: RedisClient, prefix: str, source: str, variant: str) -> float:
    limits, taken = VARIANTS[variant]
    queue = RedisQueue(redis, Keys(prefix))
    queue._popper._pop_script = redis.register_script(source)
    await queue.mirror_pauses([], complete=True)
    now = datetime.now(UTC)
    await queue.push([QueueEntry(f"{i:024x}", "q", 0, limits=limits) for i in range(16)], now)
    before = await script_us(redis)
    popped = await queue.pop(["q"], 16, now)
    spent = await script_us(redis) - before
    assert len(popped.run_ids) == taken, popped
    return spent


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    versions = {args.against: at_revision(args.against), "this tree": this_tree()}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        server = RedisServer(Path(tmp), free_port(), Path(tmp) / "redis.log")
        server.start()
        stack.callback(server.stop)
        async with open_redis(parse_redis_url(server.url)) as redis:
            print(f"µs of Redis in the pop script, a pop of 16 runs, {args.rounds} rounds")
            for variant in VARIANTS:
                times: dict[str, list[float]] = {name: [] for name in versions}
                for r in range(args.rounds):
                    order = list(versions) if r % 2 == 0 else list(versions)[::-1]
                    for i, name in enumerate(order):
                        prefix = f"pop{variant}{r}.{i}:"
                        times[name].append(await one_pop(redis, prefix, versions[name], variant))
                for name, spent in times.items():
                    deciles = statistics.quantiles(spent, n=10)
                    print(
                        f"{variant:8} {name:>12}: median {statistics.median(spent):6.0f}"
                        f"  p10 {deciles[0]:6.0f}  p90 {deciles[-1]:6.0f}"
                    )


if __name__ == "__main__":
    asyncio.run(main())
