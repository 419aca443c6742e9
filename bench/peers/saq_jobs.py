"""SAQ's side of the comparison: a no-op job function, its worker, and the driver of a workload.

Runs inside `.bench-venvs/saq` (never imports jobplane):

    python bench/peers/saq_jobs.py --workload drain --redis-url URL [--workers P] ...
    python bench/peers/saq_jobs.py worker ...   (what the driver starts, P of them)

Each worker process is one `saq.Worker` on the queue `bench` with `concurrency` C (SAQ's default
is 10; its own benchmark uses 10 too), built and run as `saq.worker.start` does. SAQ keeps
everything in Redis: the job (its status, result and timestamps) is a key that outlives the job
by `ttl` (600 s by default), so a finished job's result is stored, like Celery's with a result
backend.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import common  # bench/peers/common.py: the script's own folder is first on sys.path
import redis
import saq
from saq import Queue, Worker
from saq.job import Status
from saq.types import Context

QUEUE = "bench"
# Each job's start, by job index, until the after_process hook writes its ledger line.
STARTED: dict[int, float] = {}


async def noop(ctx: Context, *, i: int, enqueued: float) -> None:
    STARTED[i] = time.time()


class Hooks:
    """The worker's startup and after_process hooks, which write the ledger."""

    def __init__(self, ledger: common.LedgerWriter) -> None:
        self.ledger = ledger

    async def startup(self, ctx: Context) -> None:
        self.ledger.ready()

    async def after_process(self, ctx: Context) -> None:
        # SAQ calls this after `job.finish(COMPLETE)` wrote the job's end to Redis.
        now = time.time()
        job = ctx.get("job")
        if job is not None and job.kwargs is not None:
            i = job.kwargs["i"]
            started = STARTED.pop(i)
            if job.status == Status.COMPLETE:
                self.ledger.record(i, job.kwargs["enqueued"], started, now)


class SaqPeer:
    name = "saq"
    default_concurrency = 10  # SAQ's default, and what its own benchmark uses
    default_callers = 32  # as bench/throughput.py's producer; SAQ runs 20 of them at once

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def start_workers(self, workers: common.Workers, processes: int, concurrency: int) -> int:
        argv = [sys.executable, __file__, "worker", "--redis-url", self.args.redis_url]
        argv += ["--ledger", str(workers.folder), "--concurrency", str(concurrency)]
        for _ in range(processes):
            workers.start(argv)
        return processes

    def enqueue_many(self, n: int, callers: int) -> tuple[float, float]:
        async def run() -> tuple[float, float]:
            queue = Queue.from_url(self.args.redis_url, name=QUEUE)
            await queue.connect()
            todo = iter(range(n))

            async def caller() -> None:
                for i in todo:
                    await queue.enqueue("noop", i=i, enqueued=time.time())

            first, began = time.time(), time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(min(callers, n))))
            seconds = time.perf_counter() - began
            await queue.disconnect()
            return first, seconds

        return asyncio.run(run())

    def enqueue_open_loop(self, rate: float, count: int) -> list[float]:
        async def run() -> list[float]:
            queue = Queue.from_url(self.args.redis_url, name=QUEUE)
            await queue.connect()
            lags = [0.0] * count

            async def send(i: int, due: float) -> None:
                lags[i] = time.perf_counter() - due
                await queue.enqueue("noop", i=i, enqueued=time.time())

            sends = []
            for i, due in common.arrivals(rate, count):
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                sends.append(asyncio.create_task(send(i, due)))
            await asyncio.gather(*sends)
            await queue.disconnect()
            return lags

        return asyncio.run(run())

    def verify(self, n: int) -> str:
        client = redis.Redis.from_url(self.args.redis_url)
        jobs = sum(1 for _ in client.scan_iter(f"saq:job:{QUEUE}:*", count=1000))
        incomplete = client.zcard(f"saq:{QUEUE}:incomplete")
        if jobs != n or incomplete:
            raise RuntimeError(f"redis holds {jobs} jobs for {n}, {incomplete} incomplete")
        return f"{n} jobs in the ledger, {jobs} job records in redis, none incomplete"

    def describe(self, processes: int, concurrency: int) -> str:
        return (
            f"saq {saq.__version__}, redis-py {redis.__version__}, {processes} worker "
            f"processes with concurrency {concurrency}"
        )


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="saq_jobs.py worker")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    args = parser.parse_args(argv)
    hooks = Hooks(common.LedgerWriter(args.ledger))

    async def run() -> None:
        queue = Queue.from_url(args.redis_url, name=QUEUE)
        worker = Worker(
            queue,
            functions=[noop],
            concurrency=args.concurrency,
            startup=hooks.startup,
            after_process=hooks.after_process,
        )
        try:
            await queue.connect()
            await worker.start()  # until SIGTERM, which SAQ handles itself
        finally:
            await queue.disconnect()

    asyncio.run(run())


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
        return
    args = common.parse(sys.argv[1:], lambda parser: None)
    common.drive(SaqPeer(args), args)


if __name__ == "__main__":
    main()
