"""What every peer's driver shares: the ledger, worker processes, the four workloads, the figures.

Standard library only: this module runs inside each peer's own virtual environment (and is
imported by the runner for its percentiles), so it must not import jobplane or a peer.

The ledger is how a peer's tasks report back without adding a network round trip per job: each
worker process appends one line per finished job to its own file in a directory, `i enqueued
started done` (wall-clock seconds, `time.time()`). `i` is the job's index, carried in its
arguments with `enqueued` (the producer's clock just before the enqueue call); `started` is
read first thing in the task body; `done` is read in the peer's hook that runs after the job's
completion was recorded (Celery's `task_postrun`, after the result is stored; SAQ's
`after_process`, after the job's `complete` write; for procrastinate, which has no such hook,
when the worker's `finish_job` call returns). One `write()` per job, a few microseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

WORKLOADS = ("drain", "e2e", "enqueue", "latency")
# No job finished for this long while some were missing: something is broken, stop.
STALL_SECONDS = 30.0
POLL_SECONDS = 0.1  # only to notice the end: the windows come from the timestamps


# -- the ledger ----------------------------------------------------------------------------------


class LedgerWriter:
    """One worker process's ledger file, opened on first use (prefork children fork first)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file: TextIO | None = None
        self._pid = 0

    def record(self, i: int, enqueued: float, started: float, done: float) -> None:
        if self._file is None or self._pid != os.getpid():  # a forked child needs its own file
            self._pid = os.getpid()
            # Line-buffered: each line is one write(), so the driver never sees half a line.
            self._file = open(self.folder / f"{self._pid}.log", "a", buffering=1)
        self._file.write(f"{i} {enqueued!r} {started!r} {done!r}\n")

    def ready(self) -> None:
        """Say that this worker process is up and waiting for jobs."""
        (self.folder / f"ready-{os.getpid()}").touch()


@dataclass(frozen=True)
class Entry:
    i: int
    enqueued: float
    started: float
    done: float


def ledger_lines(folder: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in folder.glob("*.log"))


def ledger_entries(folder: Path) -> list[Entry]:
    entries = []
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            i, enqueued, started, done = line.split()
            entries.append(Entry(int(i), float(enqueued), float(started), float(done)))
    return entries


def check_once(entries: Sequence[Entry], n: int) -> None:
    """Every job 0..n-1 ran, and exactly once."""
    seen = sorted(e.i for e in entries)
    if seen != list(range(n)):
        dupes = len(seen) - len(set(seen))
        missing = n - len(set(seen) & set(range(n)))
        raise RuntimeError(f"{len(seen)} jobs ran for {n} enqueued: {dupes} twice, {missing} never")


# -- worker processes ----------------------------------------------------------------------------


@dataclass
class Workers:
    """The worker processes a driver started, with their logs, so they are stopped on any exit."""

    folder: Path
    procs: list[tuple[subprocess.Popen[bytes], Path]]

    def start(self, argv: list[str]) -> None:
        log = self.folder / f"worker-{len(self.procs)}.out"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs.append((proc, log))

    def check(self) -> None:
        for proc, log in self.procs:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"worker {proc.pid} exited with {proc.returncode}:\n{tail}")

    def wait_ready(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.folder.glob("ready-*"))) < count:
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready after {timeout} s")
            time.sleep(POLL_SECONDS)

    def wait_done(self, n: int) -> None:
        """Until the ledger holds `n` jobs; fails when nothing moves for `STALL_SECONDS`."""
        done, moved = 0, time.monotonic()
        while done < n:
            time.sleep(POLL_SECONDS)
            self.check()
            count = ledger_lines(self.folder)
            if count > done:
                done, moved = count, time.monotonic()
            elif time.monotonic() - moved > STALL_SECONDS:
                raise RuntimeError(f"stalled at {done} of {n} jobs done")

    def stop(self, timeout: float = 30) -> None:
        # SIGTERM is each peer's graceful shutdown (Celery's warm shutdown stops its children).
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


@contextlib.contextmanager
def workers_folder() -> Iterator[Workers]:
    with tempfile.TemporaryDirectory(prefix="peer-ledger-") as tmp:
        workers = Workers(Path(tmp), [])
        try:
            yield workers
        finally:
            workers.stop()


# -- percentiles and open-loop pacing ------------------------------------------------------------


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]


def median_range(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def arrivals(rate: float, count: int) -> Iterator[tuple[int, float]]:
    """Open loop: (index, perf_counter deadline) of each arrival on a fixed clock from now.

    The caller sleeps until each deadline and then fires without waiting for the previous
    enqueue to return, so a slow system never slows the arrivals down."""
    start = time.perf_counter()
    for i in range(count):
        yield i, start + i / rate


# -- the driver ----------------------------------------------------------------------------------


class Peer(Protocol):
    """What one peer supplies; `drive` does the rest."""

    name: str
    default_concurrency: int
    default_callers: int

    def start_workers(self, workers: Workers, processes: int, concurrency: int) -> int:
        """Start the worker processes; returns how many will say they are ready."""
        ...

    def enqueue_many(self, n: int, callers: int) -> tuple[float, float]:
        """Enqueue jobs 0..n-1 from `callers` concurrent callers, as fast as they go.

        Returns the wall-clock time just before the first enqueue and the seconds it took."""
        ...

    def enqueue_open_loop(self, rate: float, count: int) -> list[float]:
        """Enqueue jobs 0..count-1 at `rate` a second on a fixed clock; returns by job how
        late its enqueue call began after its arrival time, in seconds."""
        ...

    def verify(self, n: int) -> str:
        """Check the peer's own record of the jobs (its result backend, if any)."""
        ...

    def describe(self, processes: int, concurrency: int) -> str: ...


def drain(peer: Peer, args: argparse.Namespace) -> dict[str, float]:
    """N jobs enqueued first, then P workers start: first job started -> last job done."""
    n = args.runs
    peer.enqueue_many(n, args.callers)
    with workers_folder() as workers:
        spawned = time.time()
        peer.start_workers(workers, args.workers, args.concurrency)
        workers.wait_done(n)
        entries = ledger_entries(workers.folder)
    check_once(entries, n)
    first = min(e.started for e in entries)
    last = max(e.done for e in entries)
    print(f"drain: {n} jobs in {last - first:.2f} s ({last - spawned:.2f} s from spawn)")
    print(f"check: {peer.verify(n)}")
    return {"drain": n / (last - first), "drain_from_spawn": n / (last - spawned)}


def idle_workers(peer: Peer, workers: Workers, args: argparse.Namespace) -> None:
    workers.wait_ready(peer.start_workers(workers, args.workers, args.concurrency))
    time.sleep(0.5)  # as bench/throughput.py: let start-up settle so the workers are idle


def end_to_end(peer: Peer, args: argparse.Namespace) -> dict[str, float]:
    """Workers idle first; a producer enqueues N: first enqueue -> last job done."""
    n = args.runs
    with workers_folder() as workers:
        idle_workers(peer, workers, args)
        first, seconds = peer.enqueue_many(n, args.callers)
        workers.wait_done(n)
        entries = ledger_entries(workers.folder)
    check_once(entries, n)
    last = max(e.done for e in entries)
    print(f"e2e: {n} jobs in {last - first:.2f} s; the enqueues took {seconds:.2f} s")
    print(f"check: {peer.verify(n)}")
    return {"e2e": n / (last - first)}


def enqueue(peer: Peer, args: argparse.Namespace) -> dict[str, float]:
    """One producer process, no workers: N enqueues from C concurrent callers."""
    _, seconds = peer.enqueue_many(args.runs, args.callers)
    print(f"enqueue: {args.runs} jobs in {seconds:.2f} s from {args.callers} callers")
    return {"enqueue": args.runs / seconds}


def latency(peer: Peer, args: argparse.Namespace) -> dict[str, float]:
    """Open loop at a fixed rate: enqueue call -> task body started, after a warm-up."""
    warm = round(args.rate * args.warmup)
    count = warm + round(args.rate * args.seconds)
    with workers_folder() as workers:
        idle_workers(peer, workers, args)
        lags = peer.enqueue_open_loop(args.rate, count)
        workers.wait_done(count)
        entries = ledger_entries(workers.folder)
    check_once(entries, count)
    ms = [1000 * (e.started - e.enqueued) for e in entries if e.i >= warm]
    lag = 1000 * max(lags[warm:])
    figures = {
        "latency_p50_ms": nearest_rank(ms, 0.50),
        "latency_p90_ms": nearest_rank(ms, 0.90),
        "latency_p99_ms": nearest_rank(ms, 0.99),
        "latency_max_ms": max(ms),
        "producer_lag_max_ms": lag,
    }
    print(
        f"latency: {len(ms)} jobs at {args.rate:g}/s after {warm} warm-up jobs, ms: "
        + ", ".join(f"{k.split('_')[1]} {v:.2f}" for k, v in figures.items() if "latency" in k)
        + f"; enqueue calls began at most {lag:.2f} ms after their arrival time"
    )
    return figures


STEPS: dict[str, Callable[[Peer, argparse.Namespace], dict[str, float]]] = {
    "drain": drain,
    "e2e": end_to_end,
    "enqueue": enqueue,
    "latency": latency,
}


def parse(
    argv: Sequence[str] | None, peer_options: Callable[[argparse.ArgumentParser], None]
) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--mongodb-url")
    parser.add_argument("--runs", type=int, default=10_000, help="jobs for drain, e2e, enqueue")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, help="jobs at once per worker process")
    parser.add_argument("--callers", type=int, help="concurrent producer callers")
    parser.add_argument("--rate", type=float, default=200, help="latency: jobs a second")
    parser.add_argument("--seconds", type=float, default=10, help="latency: measured seconds")
    parser.add_argument("--warmup", type=float, default=2, help="latency: seconds not measured")
    peer_options(parser)
    return parser.parse_args(argv)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def drive(peer: Peer, args: argparse.Namespace) -> None:
    """Run one workload; its figures are the last stdout line, one JSON object (what the
    runner reads, as from bench/throughput.py --json)."""
    # SIGTERM (the runner's stop) unwinds like Ctrl-C, so the workers are stopped on the way out.
    signal.signal(signal.SIGTERM, interrupt)
    if args.concurrency is None:
        args.concurrency = peer.default_concurrency
    if args.callers is None:
        args.callers = peer.default_callers
    print(peer.describe(args.workers, args.concurrency), flush=True)
    figures = STEPS[args.workload](peer, args)
    print(json.dumps(figures), flush=True)
