"""procrastinate's side of the comparison: a no-op task, its worker, and the driver of a workload.

Runs inside `.bench-venvs/procrastinate` (never imports jobplane):

    python bench/peers/procrastinate_jobs.py --workload drain --postgres-url URL ...
    python bench/peers/procrastinate_jobs.py worker ...   (what the driver starts, P of them)

procrastinate keeps everything in PostgreSQL: a job is a row of `procrastinate_jobs`, deferred
by an INSERT (a trigger sends NOTIFY to the listening workers), taken by `procrastinate_fetch_job`
(status `doing`) and ended by `procrastinate_finish_job` (status `succeeded`); triggers add a row
to `procrastinate_events` for each transition. Each statement is its own committed transaction,
and the server runs with fsync and synchronous_commit on (its defaults), so each is on disk
when the call returns. Jobs are kept after they finish (`delete_jobs` never, the default).

Each worker process runs one procrastinate worker (`App.run_worker_async`) with concurrency C
(procrastinate's default is 1: one job at a time per worker), on every queue. The app talks
to PostgreSQL through `PsycopgConnector`, whose pool (psycopg_pool, 4 connections by default)
holds one connection per concurrent caller here: C in a worker when C is over 4, and as many as
the producer has callers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

import common  # bench/peers/common.py: the script's own folder is first on sys.path
import procrastinate
import psycopg
from procrastinate.jobs import Job, Status

# Each job's start, by job index, until its finish is recorded and its ledger line written.
STARTED: dict[int, float] = {}
POOL_DEFAULT = 4  # psycopg_pool's min_size, which PsycopgConnector keeps
# procrastinate warns when its app is made in the __main__ module, as here: a task named after
# its module would then be named differently by the producer and the workers. The one task here
# is named explicitly, so the warning does not apply.
logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)


async def noop(*, i: int, enqueued: float) -> None:
    STARTED[i] = time.time()


def make_app(url: str, connections: int) -> tuple[procrastinate.App, Any]:
    """The app and its one task, on a pool of `connections` connections, all opened first."""
    connector = procrastinate.PsycopgConnector(
        conninfo=url, min_size=connections, max_size=connections
    )
    app = procrastinate.App(connector=connector)
    return app, app.task(name="noop")(noop)


def hook_ledger(app: procrastinate.App, ledger: common.LedgerWriter) -> None:
    """Say the worker is ready once it registered itself in the database (it starts listening
    for new jobs right after; the driver waits 0.5 s more, as for every peer), and write a job's
    ledger line once the worker's `finish_job` call has returned.

    procrastinate has no hook that runs after a job's end is recorded (its middlewares wrap the
    task, before the worker stores the outcome), so the job manager's `finish_job`, which the
    worker awaits to store it, is wrapped: when it returns, the UPDATE to `succeeded` is
    committed, and with synchronous_commit on, flushed to disk."""
    register, finish = app.job_manager.register_worker, app.job_manager.finish_job

    async def register_worker() -> int:
        worker_id = await register()
        ledger.ready()
        return worker_id

    async def finish_job(job: Job, status: Status, delete_job: bool) -> None:
        await finish(job=job, status=status, delete_job=delete_job)
        now = time.time()
        i = job.task_kwargs["i"]
        started = STARTED.pop(i)
        if status == Status.SUCCEEDED:
            ledger.record(i, job.task_kwargs["enqueued"], started, now)

    app.job_manager.register_worker = register_worker  # type: ignore[method-assign]
    app.job_manager.finish_job = finish_job  # type: ignore[method-assign]


class ProcrastinatePeer:
    name = "procrastinate"
    default_concurrency = 1  # procrastinate's default (procrastinate.worker.WORKER_CONCURRENCY)
    default_callers = 32  # as bench/throughput.py's producer

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def start_workers(self, workers: common.Workers, processes: int, concurrency: int) -> int:
        argv = [sys.executable, __file__, "worker", "--postgres-url", self.args.postgres_url]
        argv += ["--ledger", str(workers.folder), "--concurrency", str(concurrency)]
        for _ in range(processes):
            workers.start(argv)
        return processes

    def enqueue_many(self, n: int, callers: int) -> tuple[float, float]:
        async def run() -> tuple[float, float]:
            app, task = make_app(self.args.postgres_url, min(callers, n))
            async with app.open_async():
                todo = iter(range(n))

                async def caller() -> None:
                    for i in todo:
                        await task.defer_async(i=i, enqueued=time.time())

                first, began = time.time(), time.perf_counter()
                await asyncio.gather(*(caller() for _ in range(min(callers, n))))
                seconds = time.perf_counter() - began
            return first, seconds

        return asyncio.run(run())

    def enqueue_open_loop(self, rate: float, count: int) -> list[float]:
        async def run() -> list[float]:
            app, task = make_app(self.args.postgres_url, self.args.callers)
            async with app.open_async():
                lags = [0.0] * count

                async def send(i: int, due: float) -> None:
                    lags[i] = time.perf_counter() - due
                    await task.defer_async(i=i, enqueued=time.time())

                sends = []
                for i, due in common.arrivals(rate, count):
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    sends.append(asyncio.create_task(send(i, due)))
                await asyncio.gather(*sends)
            return lags

        return asyncio.run(run())

    def verify(self, n: int) -> str:
        with psycopg.connect(self.args.postgres_url) as conn:
            rows = conn.execute(
                "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY status"
            ).fetchall()
        by_status = dict(rows)
        if by_status != {"succeeded": n}:
            raise RuntimeError(f"procrastinate_jobs holds {by_status} for {n} jobs")
        return f"{n} jobs in the ledger, {n} succeeded rows in procrastinate_jobs and no other"

    def describe(self, processes: int, concurrency: int) -> str:
        with psycopg.connect(self.args.postgres_url) as conn:
            settings = conn.execute(
                "SELECT current_setting('server_version'), current_setting('fsync'), "
                "current_setting('synchronous_commit')"
            ).fetchone()
        version, fsync, synchronous_commit = settings or ("?", "?", "?")
        return (
            f"procrastinate {procrastinate.__version__}, psycopg {psycopg.__version__}, "
            f"postgres {version.split()[0]} (fsync {fsync}, synchronous_commit "
            f"{synchronous_commit}), {processes} worker processes with concurrency {concurrency}"
        )


def apply_schema(url: str) -> None:
    """procrastinate's tables, functions and triggers, in the empty database the runner made."""

    async def run() -> None:
        app, _ = make_app(url, 1)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(run())


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="procrastinate_jobs.py worker")
    parser.add_argument("--postgres-url", required=True)
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    args = parser.parse_args(argv)

    async def run() -> None:
        app, _ = make_app(args.postgres_url, max(POOL_DEFAULT, args.concurrency))
        hook_ledger(app, common.LedgerWriter(args.ledger))
        async with app.open_async():
            # until SIGTERM, which procrastinate handles itself (a graceful stop)
            await app.run_worker_async(concurrency=args.concurrency)

    asyncio.run(run())


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--postgres-url", required=True)


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
        return
    args = common.parse(sys.argv[1:], options)
    apply_schema(args.postgres_url)
    common.drive(ProcrastinatePeer(args), args)


if __name__ == "__main__":
    main()
