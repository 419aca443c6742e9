"""Where a lone run's start goes, phase by phase: the create, the pop (which takes a rate
window too, for a template with `rateLimit`), the claim's write, its read-back, and the
handler's start.

Runs are created one at a time, `--gap` seconds apart, so each arrives alone, as at a low rate.
The producer and one worker share this process and its event loop (unlike bench/latency.py's
worker processes), so that one clock times every phase. The loop they share makes the phases
slower than in a deployment, so compare them with each other, not with latency.py's figures.
Each phase is timed by wrapping the call that makes it: `RunService.create`,
`RedisQueue.pop`, and the claim's update and read-back
(`MongoTransitionStore._take` and `_read`).

    .venv/bin/python bench/phases.py [--runs N] [--gap S] [--template '{"rateLimit": ...}']
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

# bench/ is not a package: Python puts a script's own folder first on sys.path.
import throughput
from jobplane.backends import open_backends
from jobplane.model import TemplateSpec
from jobplane.queue.redis import RedisQueue
from jobplane.runs.service import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.store.transitions import MongoTransitionStore
from jobplane.worker import StepContext, Worker, handler

# run id -> phase mark -> perf_counter seconds
marks: dict[str, dict[str, float]] = {}
PHASES = [
    ("create", "created", "the create call"),
    ("popped", "claim", "pop returned -> claim sent"),
    ("claim", "claimed", "the claim's write (majority)"),
    ("read", "read_back", "the claim's read-back"),
    ("read_back", "started", "read-back -> handler started"),
    ("create", "started", "create call -> handler started"),
]


@handler("bench.phase")
async def started(ctx: StepContext) -> None:
    marks.setdefault(ctx.run.id, {})["started"] = time.perf_counter()


def timed(
    owner: type, name: str, begin: str, end: str, ids: Callable[[tuple[Any, ...], Any], list[str]]
) -> None:
    """Mark `begin` and `end` around `owner.name` for the run ids `ids(args, result)` names."""
    call: Callable[..., Awaitable[Any]] = getattr(owner, name)

    async def wrapped(self: object, *args: Any, **kwargs: Any) -> Any:
        before = time.perf_counter()
        result = await call(self, *args, **kwargs)
        after = time.perf_counter()
        for run_id in ids(args, result):
            marks.setdefault(run_id, {}).update({begin: before, end: after})
        return result

    setattr(owner, name, wrapped)


timed(RedisQueue, "pop", "pop", "popped", lambda _, popped: popped.run_ids)
timed(MongoTransitionStore, "_take", "claim", "claimed", lambda _, c: [str(o) for o in c.oids])
timed(MongoTransitionStore, "_read", "read", "read_back", lambda _, d: [str(x["_id"]) for x in d])


async def measure(mongo_url: str, redis_url: str, args: argparse.Namespace) -> None:
    settings = Settings(mongodb_url=mongo_url, redis_url=redis_url, db="bench_phases")
    spec = {"type": "bench_phases", "steps": [{"id": "only", "handler": "bench.phase"}]}
    async with open_backends(settings) as backends:
        await backends.store.templates.register(
            TemplateSpec.model_validate({**spec, **json.loads(args.template)})
        )
        service = RunService(backends.store, backends.queue)
        stop = asyncio.Event()
        working = asyncio.create_task(Worker(backends.store, backends.queue, settings).run(stop))
        await asyncio.sleep(1)  # the worker's first pop, and its blocking one after
        for i in range(args.warmup + args.runs):
            before = time.perf_counter()
            run, _ = await service.create(RunRequest("bench_phases", "user", "u", {"i": i}), "b")
            marks.setdefault(run.id, {}).update(create=before, created=time.perf_counter())
            await asyncio.sleep(args.gap)
        await asyncio.sleep(1)
        stop.set()
        await working
    runs = [m for m in marks.values() if "create" in m and "started" in m][args.warmup :]
    print(f"{len(runs)} lone runs, {args.gap * 1000:.0f} ms apart; template extra {args.template}")
    for begin, end, label in PHASES:
        spans = sorted(1000 * (m[end] - m[begin]) for m in runs if begin in m and end in m)
        if spans:
            p50, p90 = spans[len(spans) // 2], spans[int(len(spans) * 0.9)]
            print(f"  {label:<34} p50 {p50:6.2f}  p90 {p90:6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between two creates")
    parser.add_argument("--template", default="{}", help="template fields to add, as JSON")
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    with throughput.servers(args) as (mongo_url, redis_url, _):
        asyncio.run(measure(mongo_url, redis_url, args))


if __name__ == "__main__":
    main()
