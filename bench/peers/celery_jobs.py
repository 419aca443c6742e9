"""Celery's side of the comparison: a no-op task, its worker, and the driver of one workload.

Runs inside `.bench-venvs/celery` (never imports jobplane):

    python bench/peers/celery_jobs.py --workload drain --redis-url URL [--backend mongodb ...]
    python bench/peers/celery_jobs.py worker ...   (what the driver starts, P or 1 of them)

The broker is Redis. `--backend` picks where results go: `mongodb` (Celery's MongoDB result
backend, one document per task), `redis` (Celery's Redis result backend) or `none` (no result
backend, `task_ignore_result`). `--pool prefork` (the default, Celery's recommendation for work
that does no I/O) runs one `celery worker` with P child processes that execute the tasks, and
the parent consumes from the broker for them; `solo` runs P `celery worker` processes that each
execute one task at a time themselves; `threads` runs P of them with C threads each.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import celery
import common  # bench/peers/common.py: the script's own folder is first on sys.path
import redis
from celery import Celery
from celery.signals import task_postrun, worker_ready

app = Celery("peers")
# Set when the worker process starts (inherited by prefork children, which fork).
LEDGER: common.LedgerWriter | None = None
# Each task's start, by job index, until its postrun hook writes the ledger line; a dict, not a
# global, because the threads pool runs several tasks at once in one process.
STARTED: dict[int, float] = {}


@app.task(name="bench.noop")  # type: ignore[untyped-decorator]
def noop(i: int, enqueued: float) -> None:
    STARTED[i] = time.time()


@task_postrun.connect  # type: ignore[untyped-decorator]
def finished(args: tuple[int, float], state: str, **_: Any) -> None:
    # Celery sends task_postrun after it stored the result (trace.py: mark_as_done, then the
    # signal): the job is done as far as anyone reading results can tell.
    now = time.time()
    i, enqueued = args
    started = STARTED.pop(i)
    if state == "SUCCESS" and LEDGER is not None:
        LEDGER.record(i, enqueued, started, now)


@worker_ready.connect  # type: ignore[untyped-decorator]
def ready(**_: Any) -> None:
    if LEDGER is not None:
        LEDGER.ready()


def configure(redis_url: str, backend: str, mongodb_url: str | None) -> None:
    result_backend = {"none": None, "redis": redis_url, "mongodb": mongodb_url}[backend]
    if backend == "mongodb" and not mongodb_url:
        raise SystemExit("--backend mongodb needs --mongodb-url")
    app.conf.update(
        broker_url=redis_url,
        result_backend=result_backend,
        task_ignore_result=result_backend is None,
        broker_connection_retry_on_startup=True,
    )


class CeleryPeer:
    name = "celery"
    default_concurrency = 1  # prefork and solo run one task at a time per process
    # One thread calling apply_async is Celery's fastest producer: more threads only contend
    # for the GIL and its producer pool (measured: 32 threads enqueue about 30% slower).
    default_callers = 1

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def start_workers(self, workers: common.Workers, processes: int, concurrency: int) -> int:
        a = self.args
        base = [sys.executable, __file__, "worker", "--redis-url", a.redis_url]
        base += ["--backend", a.backend, "--ledger", str(workers.folder)]
        if a.mongodb_url:
            base += ["--mongodb-url", a.mongodb_url]
        # Gossip, mingle and heartbeat are worker-to-worker chatter over the broker, not part of
        # running a task; Redis deployments commonly turn them off.
        options = ["--loglevel=WARNING", "--without-gossip", "--without-mingle"]
        options += ["--without-heartbeat"]
        if a.pool == "prefork":
            workers.start([*base, "--", "--pool=prefork", f"--concurrency={processes}", *options])
            return 1
        for k in range(processes):
            per_process = 1 if a.pool == "solo" else concurrency
            pool = [f"--pool={a.pool}", f"--concurrency={per_process}", f"--hostname=w{k}@%h"]
            workers.start([*base, "--", *pool, *options])
        return processes

    def enqueue_many(self, n: int, callers: int) -> tuple[float, float]:
        todo = iter(range(n))  # shared by the callers; next() on it is atomic under the GIL

        def caller() -> None:
            for i in todo:
                noop.apply_async((i, time.time()))

        first, began = time.time(), time.perf_counter()
        if callers == 1:
            caller()
        else:
            threads = [threading.Thread(target=caller) for _ in range(callers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        return first, time.perf_counter() - began

    def enqueue_open_loop(self, rate: float, count: int) -> list[float]:
        lags = [0.0] * count

        def send(i: int, due: float) -> None:
            lags[i] = time.perf_counter() - due
            noop.apply_async((i, time.time()))

        # A few threads, so that one slow call does not hold back the arrivals after it.
        with ThreadPoolExecutor(max_workers=4) as pool:
            for i, due in common.arrivals(rate, count):
                time.sleep(max(0.0, due - time.perf_counter()))
                pool.submit(send, i, due)
        return lags

    def verify(self, n: int) -> str:
        a = self.args
        if a.backend == "mongodb":
            import pymongo

            mongo: pymongo.MongoClient[dict[str, Any]]
            results: pymongo.collection.Collection[dict[str, Any]]
            with pymongo.MongoClient(a.mongodb_url) as mongo:
                results = mongo.get_default_database()["celery_taskmeta"]
                stored = results.count_documents({"status": "SUCCESS"})
        elif a.backend == "redis":
            keys = redis.Redis.from_url(a.redis_url).scan_iter("celery-task-meta-*", count=1000)
            stored = sum(1 for _ in keys)
        else:
            return f"{n} jobs in the ledger (no result backend)"
        if stored != n:
            raise RuntimeError(f"the result backend holds {stored} results for {n} jobs")
        return f"{n} jobs in the ledger, {stored} SUCCESS results in {a.backend}"

    def describe(self, processes: int, concurrency: int) -> str:
        a = self.args
        if a.pool == "prefork":
            shape = f"one worker with {processes} prefork children"
        elif a.pool == "solo":
            shape = f"{processes} solo workers"
        else:
            shape = f"{processes} workers with {concurrency} threads each"
        return (
            f"celery {celery.__version__}, redis-py {redis.__version__}, broker redis, backend "
            f"{a.backend}, {shape}, prefetch multiplier {app.conf.worker_prefetch_multiplier}"
        )


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["mongodb", "redis", "none"], default="mongodb")
    parser.add_argument("--pool", choices=["prefork", "solo", "threads"], default="prefork")


def worker(argv: list[str]) -> None:
    """`worker --redis-url U --backend B --ledger DIR [--mongodb-url M] -- CELERY-OPTIONS`"""
    global LEDGER
    split = argv.index("--")
    ours, celery_options = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="celery_jobs.py worker")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ledger", type=Path, required=True)
    args = parser.parse_args(ours)
    configure(args.redis_url, args.backend, args.mongodb_url)
    LEDGER = common.LedgerWriter(args.ledger)
    app.worker_main(["worker", *celery_options])


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
        return
    args = common.parse(sys.argv[1:], options)
    configure(args.redis_url, args.backend, args.mongodb_url)
    common.drive(CeleryPeer(args), args)


if __name__ == "__main__":
    main()
