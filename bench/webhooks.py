"""What signed webhooks cost end to end: bench/throughput.py's end-to-end workload with no
notifier, with a notifier and no webhook, and with one webhook subscribed to every run event.

Variants (within each round one after another, each on a fresh database and Redis prefix, so a
machine that speeds up or slows down moves them all):

none            no notifier, no webhook: throughput.py's end-to-end workload as it is
idle_notifier   a `jobplane notifier` runs, no webhook: with none enabled it follows nothing, so
                this is the price of the process looking once a second whether one appeared
webhook         one webhook subscribed to `*` of the runs' scope, a notifier, and a receiver on
                127.0.0.1 answering 204: 4 signed deliveries per no-op run (run.created,
                run.started, step.succeeded, run.succeeded)
webhook_niced   the same, the notifier at nice 19: it takes only CPU the runs leave, as a
                notifier on a core of its own would, so the runs' pace shows what the
                deliveries cost them apart from CPU (the deliveries trail further)

Workload: W `jobplane worker` processes (concurrency C) and a `jobplane scheduler` are started
and idle (and the notifier, once it follows the trail); a producer in this process then creates
N runs from 32 concurrent callers while they drain. Runs/s is throughput.py's end-to-end
figure: just before the first create to the last `completedAt`.

All runs are in one scope (`system`/`bench`, throughput.py's request), so one webhook gets every
event: the issue's "1 webhook subscribed to every run event". Spreading the runs over scope ids
(as flow_control.py does) needs a webhook per scope id, and the sender keeps at most 16 tries in
flight per webhook and `JOBPLANE_WEBHOOK_CONCURRENCY` (64) per notifier: that is another
workload (more tries in flight), which `--scopes K` gives (K scope ids, one webhook each).

The receiver is a process of its own (`bench/webhooks.py --serve-receiver PORT`), so its CPU is
counted apart and it takes nothing from the producer's event loop: HTTP/1.1 with keep-alive on
uvloop's transports and a minimal parser (not uvicorn: without httptools it parses with h11, in
pure Python, which takes CPU the other processes need), every POST answered 204 at once,
signatures not checked. It counts deliveries, distinct `webhook-id`s and types, and for each the
time from its event's `timestamp` to its arrival.

For `webhook` each round also prints: the deliveries received of those expected (4 per run),
deliveries/s (first create to the last delivery), the lag of the last delivery behind the last
run's `completedAt`, runs/s counted to the last delivery, event -> receipt p50/p99/max, and what
the notifier stored in MongoDB (deliveries by status, tries). A round whose deliveries do not
all arrive within `--delivery-wait` seconds (120) of the runs' end says so. Then, for every
variant, per run: MongoDB's operations and time per collection, Redis commands, and the CPU ms
of each process from /proc (bench = the producer; workers, schedulers, notifiers, receivers,
mongod, redis; others = what the benchmark did not start). For `webhook` these are read after
the last delivery arrived, so they hold all the notifier's work.

The summary gives the medians over rounds per variant, beside `none`'s.

    .venv/bin/python bench/webhooks.py [--runs N] [--repeat K] [--variants none,webhook]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import httpx
from bson import ObjectId

import jobplane.process
import throughput
from jobplane.backends import Backends
from jobplane.devstack.servers import free_port
from jobplane.model.webhooks import Secret, SignedWebhook
from jobplane.runs.service import RunRequest
from jobplane.settings import Settings
from jobplane.store.database import Collections
from throughput import ACTOR, CALLERS, Child, Counters, Processes, closed_loop, run_main

# How nice the `webhook_niced` variant's notifier is.
NICE = 19
VARIANTS = ("none", "idle_notifier", "webhook", "webhook_niced")
SCOPE = "system"
# A no-op run's events a webhook of `*` receives: run.created, run.started, step.succeeded,
# run.succeeded.
PER_RUN = 4
# The `job_meta` document where the fan-out saves its position in the trail (store/webhooks.py):
# once it exists the notifier's change stream is open, and no event after it is missed.
FEED = "webhook_feed"
POLL_SECONDS = 0.2
# CPU per run of these processes (`Processes.cpu`'s names), in the summary.
CPU_KINDS = {
    "bench": "producer",
    "workers": "workers",
    "schedulers": "scheduler",
    "notifiers": "notifier",
    "receivers": "receiver",
    "mongod": "mongod",
    "redis": "redis",
}


# -- the receiver (a process of its own) -----------------------------------------------------------

NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
CHUNKED = b"HTTP/1.1 501 Not Implemented\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class Arrivals:
    """What the receiver got: deliveries, distinct `webhook-id`s, types, event -> receipt."""

    def __init__(self) -> None:
        self.received = 0
        self.ids: set[bytes] = set()
        self.types: Counter[str] = Counter()
        self.first: float | None = None
        self.last: float | None = None
        self.delays: list[float] = []

    def add(self, message_id: bytes, body: bytes) -> None:
        now = time.time()
        self.received += 1
        self.ids.add(message_id)
        self.first = self.first or now
        self.last = now
        # The body begins {"id":..,"type":..,"timestamp":..}: no need to parse all of it.
        self.types[_value(body, b'"type":"')] += 1
        if stamp := _value(body, b'"timestamp":"'):
            self.delays.append(now - datetime.fromisoformat(stamp).timestamp())

    def stats(self, full: bool) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "received": self.received,
            "distinct": len(self.ids),
            "first": self.first,
            "last": self.last,
        }
        if full:
            delays = sorted(self.delays)
            doc["types"] = dict(self.types)
            if delays:
                doc["delay_ms"] = {
                    "p50": 1000 * delays[len(delays) // 2],
                    "p99": 1000 * delays[min(len(delays) - 1, len(delays) * 99 // 100)],
                    "max": 1000 * delays[-1],
                }
        return doc


def _value(body: bytes, key: bytes) -> str:
    """The string after `key` in `body` (the first one), or ""."""
    start = body.find(key)
    if start < 0:
        return ""
    start += len(key)
    return body[start : body.find(b'"', start)].decode()


class ReceiverProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, bodies by Content-Length (as httpx sends them): every POST
    answered 204; `GET /stats` (`/stats?full`) the arrivals as JSON."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not `asyncio.Transport`s, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            if b"transfer-encoding" in headers:
                self.transport.write(CHUNKED)
                self.transport.close()
                return
            start = end + 4
            stop = start + int(headers.get(b"content-length", b"0"))
            if len(self.buffer) < stop:
                return  # the rest of the body is still on its way
            body = bytes(self.buffer[start:stop])
            del self.buffer[:stop]
            method, target, _ = lines[0].split(b" ", 2)
            self.transport.write(self.answer(method, target, headers, body))

    def answer(
        self, method: bytes, target: bytes, headers: dict[bytes, bytes], body: bytes
    ) -> bytes:
        if method == b"POST":
            self.arrivals.add(headers.get(b"webhook-id", b""), body)
            return NO_CONTENT
        if method == b"GET" and target.startswith(b"/stats"):
            doc = json.dumps(self.arrivals.stats(full=target.endswith(b"?full"))).encode()
            return (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(doc)}\r\n\r\n".encode()
                + doc
            )
        return NOT_FOUND


def serve_receiver(port: int) -> None:
    """Receive deliveries on 127.0.0.1:`port` until killed (SIGTERM)."""

    async def serve() -> None:
        arrivals = Arrivals()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: ReceiverProtocol(arrivals), "127.0.0.1", port, backlog=1024
        )
        print(f"receiver listening on 127.0.0.1:{port}", flush=True)
        async with server:
            await server.serve_forever()

    jobplane.process.run(serve())


@dataclass
class Receiver:
    """The benchmark's handle on a receiver process."""

    url: str
    http: httpx.AsyncClient
    procs: Processes

    async def stats(self, full: bool = False) -> dict[str, Any]:
        got: dict[str, Any] = (await self.http.get("/stats?full" if full else "/stats")).json()
        return got

    async def wait(self, expected: int, seconds: float) -> dict[str, Any]:
        """Poll until `expected` distinct deliveries arrived, or `seconds` passed."""
        deadline = time.monotonic() + seconds
        while True:
            self.procs.check()
            stats = await self.stats()
            if stats["distinct"] >= expected or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(POLL_SECONDS)


def start_receiver(procs: Processes, port: int) -> None:
    """A receiver process, as one of `procs`: its CPU counts as `receivers`, and it is stopped
    with the workload's other processes."""
    path = procs.log_dir / f"receiver-{len(procs.children)}.log"
    with path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-receiver", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    procs.children.append(Child("receiver", proc, path))


@contextlib.asynccontextmanager
async def receiver(procs: Processes) -> AsyncIterator[Receiver]:
    """A receiver process started, once it answers."""
    port = free_port()
    start_receiver(procs, port)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, trust_env=False) as http:
        async with asyncio.timeout(60):
            while True:
                procs.check()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/stats")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        yield Receiver(f"{base}/hook", http, procs)


# -- the workload ----------------------------------------------------------------------------------


async def subscribe(backends: Backends, url: str, scope_id: str) -> None:
    """A webhook of `url` to every event of the scope, stored as `POST /v1/webhooks` does."""
    now = backends.store.clock.now()
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    hook = SignedWebhook(
        id=str(ObjectId()),
        url=url,
        events=["*"],
        scope=SCOPE,
        scope_id=scope_id,
        description="bench/webhooks.py",
        created_by=ACTOR,
        create_at=now,
        update_at=now,
        secrets=[Secret(secret=secret)],
    )
    await backends.store.webhooks.insert(hook)


async def stored(backends: Backends) -> dict[str, Any]:
    """The deliveries the notifier stored, by status, and their tries."""
    pipeline = [{"$group": {"_id": "$status", "n": {"$sum": 1}, "tries": {"$sum": "$attempts"}}}]
    deliveries = Collections.of(backends.store.db).deliveries
    found = {d["_id"]: d async for d in await deliveries.aggregate(pipeline)}
    return {
        "by status": {status: d["n"] for status, d in found.items()},
        "count": sum(d["n"] for d in found.values()),
        "tries": sum(d["tries"] for d in found.values()),
    }


@dataclass
class EndToEnd(throughput.Bench):
    variant: str = "none"
    numbers: Iterator[int] = field(default_factory=itertools.count)

    def settings(self) -> Settings:
        # The receiver is on 127.0.0.1, which deliveries reach only with this (the notifier
        # inherits it; nothing else reads it).
        return super().settings().model_copy(update={"webhook_allow_private": True})

    def scope_ids(self) -> list[str]:
        k = self.args.scopes
        return [throughput.REQUEST.scope_id] if k == 1 else [f"bench{j}" for j in range(k)]

    def request(self) -> RunRequest:
        if self.args.scopes == 1:
            return throughput.REQUEST
        i = next(self.numbers)
        return RunRequest("bench_noop", SCOPE, f"bench{i % self.args.scopes}")

    async def notifier_ready(self, backends: Backends) -> None:
        """Return once the notifier's fan-out follows the trail (it saved its first position
        after opening its change stream): runs created before that would not be seen."""
        meta = Collections.of(backends.store.db).meta
        async with asyncio.timeout(60):
            while await meta.find_one({"_id": FEED}) is None:
                self.procs.check()
                await asyncio.sleep(0.05)

    async def measure(self) -> dict[str, float]:
        """One round of the variant: its figures (runs/s, CPU ms per run by process, and for
        `webhook` the deliveries'), printed as they come."""
        n, a = self.args.runs, self.args
        figures: dict[str, float] = {}
        async with (
            self.fresh() as (settings, backends, service),
            self.producer(settings, service) as create,
            contextlib.AsyncExitStack() as stack,
        ):
            hooks = None
            if self.variant.startswith("webhook"):
                hooks = await stack.enter_async_context(receiver(self.procs))
                for scope_id in self.scope_ids():
                    await subscribe(backends, hooks.url, scope_id)
            if self.variant != "none":
                nice = NICE if self.variant == "webhook_niced" else 0
                self.procs.start(settings, "notifier", nice=nice)
            self.procs.start(settings, "scheduler")
            self.start_workers(settings)
            await self.procs.workers_ready()
            if self.variant != "none":
                await self.notifier_ready(backends)
            await asyncio.sleep(0.5)  # let start-up settle so that everything is idle
            before = await Counters.read(backends, settings, self.procs)
            started = datetime.now(UTC)
            created = await closed_loop(lambda: create(self.request()), n, CALLERS)
            quiet = await self.wait_succeeded(backends, settings, n)
            last = await self.last_completed(backends)
            window = (last - started).total_seconds()
            figures["e2e runs/s"] = n / window
            line = f"{n} runs in {window:.2f} s; the creates took {created:.2f} s"
            if quiet is not None:
                line += f"; {n - quiet.done} runs waited in `queued` for the reconciler"
            details: list[str] = []
            measured = window
            if hooks is not None:
                expected = n * PER_RUN
                got = await hooks.wait(expected, a.delivery_wait)
                after = await Counters.read(backends, settings, self.procs)
                full = await hooks.stats(full=True)
                notes = await stored(backends)
                details += self.deliveries(figures, full, notes, expected, started, last)
                if got["distinct"] >= expected:
                    measured = full["last"] - started.timestamp()
                else:
                    measured = (datetime.now(UTC) - started).total_seconds()
            else:
                after = await Counters.read(backends, settings, self.procs)
            details += before.per_run(after, n, measured)
            if self.variant != "none":
                details.append(notifier_collections(before, after, n))
            cpu = {k: v - before.cpu.get(k, 0) for k, v in after.cpu.items()}
            total = 0.0
            for kind, name in CPU_KINDS.items():
                if kind in cpu:
                    figures[f"cpu ms/run {name}"] = 1000 * cpu[kind] / n
                    total += 1000 * cpu[kind] / n
            figures["cpu ms/run others"] = others = before.others_ms(after, n)
            figures["cpu ms/run total"] = total + others
            self.record(f"[{self.variant}] end-to-end", figures["e2e runs/s"], line, details)
        return figures

    def deliveries(
        self,
        figures: dict[str, float],
        full: dict[str, Any],
        notes: dict[str, Any],
        expected: int,
        started: datetime,
        last: datetime,
    ) -> list[str]:
        """The lines about the round's deliveries; their figures added to `figures`."""
        n, distinct = self.args.runs, full["distinct"]
        figures["delivered %"] = 100 * distinct / expected
        lines = []
        if distinct < expected:
            lines.append(
                f"NOT ALL DELIVERED: {distinct} of {expected} deliveries received within "
                f"{self.args.delivery_wait:g} s of the last run's end"
            )
        else:
            to_last = full["last"] - started.timestamp()
            lag = full["last"] - last.timestamp()
            figures["deliveries/s"] = distinct / to_last
            figures["lag s (last done -> last delivery)"] = lag
            figures["runs/s to last delivery"] = n / to_last
            lines.append(
                f"deliveries: all {expected} received; the last {to_last:.2f} s after the first "
                f"create, {lag:.2f} s after the last run ended: {distinct / to_last:,.0f} "
                f"deliveries/s, {n / to_last:,.0f} runs/s counted to the last delivery"
            )
        if full["received"] != distinct:
            lines.append(f"{full['received'] - distinct} deliveries arrived more than once")
        if delay := full.get("delay_ms"):
            figures["event -> receipt p50 ms"] = delay["p50"]
            figures["event -> receipt p99 ms"] = delay["p99"]
            lines.append(
                f"event -> receipt: p50 {delay['p50']:,.0f} ms, p99 {delay['p99']:,.0f} ms, "
                f"max {delay['max']:,.0f} ms; types {full.get('types')}"
            )
        tries = notes["tries"] / notes["count"] if notes["count"] else 0
        lines.append(
            f"the notifier stored {notes['count']} deliveries, by status {notes['by status']}, "
            f"with {notes['tries']} tries ({tries:.2f} each)"
        )
        return lines


def notifier_collections(before: Counters, after: Counters, n: int) -> str:
    """MongoDB's `top` per run for the collections only the notifier writes, and `job_meta`
    (its position in the trail): operations, and the µs they took."""
    parts = []
    for key, count in sorted(after.top_count.items()):
        if key.startswith(("job_webhook", "job_meta.")):
            ops = (count - before.top_count.get(key, 0)) / n
            micros = (after.top_time[key] - before.top_time.get(key, 0)) / n
            if ops > 0:
                parts.append(f"{key} {ops:.2f}x {micros:.0f}")
    return "notifier's collections per run (count, µs): " + (", ".join(parts) or "-")


# -- report ----------------------------------------------------------------------------------------


def summary(figures: dict[tuple[str, str], list[float]]) -> None:
    print(f"\n{'figure':36} {'variant':14} {'median':>9} {'vs none':>9}  each")
    for (figure, variant), values in sorted(figures.items(), key=lambda kv: _order(kv[0])):
        median = statistics.median(values)
        none = figures.get((figure, "none"))
        versus = "-"
        if none and variant != "none":
            if figure.startswith("cpu"):
                versus = f"{median - statistics.median(none):+.2f}"
            else:
                versus = f"{median / statistics.median(none) - 1:+.0%}"
        each = " ".join(f"{v:,.2f}" if figure.startswith("cpu") else f"{v:,.1f}" for v in values)
        number = f"{median:9,.2f}" if figure.startswith("cpu") else f"{median:9,.1f}"
        print(f"{figure:36} {variant:14} {number} {versus:>9}  {each}")


def _order(key: tuple[str, str]) -> tuple[int, str, int]:
    figure, variant = key
    return (0 if not figure.startswith("cpu") else 1, figure, VARIANTS.index(variant))


async def main_async(args: argparse.Namespace, mongo: str, redis: str, procs: Processes) -> None:
    first = EndToEnd(args, mongo, redis, procs)
    settings = first.settings()
    await throughput.begin(
        first,
        f"variants {', '.join(args.variants)}; {args.runs} runs from {CALLERS} callers; workers "
        f"{args.workers} x concurrency {args.concurrency}; scope ids {args.scopes} (a webhook "
        f"each); notifier: {settings.webhook_concurrency} tries in flight, 16 per webhook; "
        f"delivery wait {args.delivery_wait:g} s; write concern {args.write_concern}; "
        f"repeat {args.repeat}",
    )
    figures: dict[tuple[str, str], list[float]] = {}
    incomplete: list[str] = []
    for round_ in range(args.repeat):
        print(f"round {round_ + 1} of {args.repeat}", flush=True)
        for variant in args.variants:
            got = await EndToEnd(args, mongo, redis, procs, variant=variant).measure()
            for name, value in got.items():
                figures.setdefault((name, variant), []).append(value)
            if got.get("delivered %", 100) < 100:
                incomplete.append(f"round {round_ + 1}: {got['delivered %']:.1f}% delivered")
    summary(figures)
    if incomplete:
        print("rounds whose deliveries did not all arrive: " + "; ".join(incomplete))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:-1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=5000, help="runs per variant and round")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="JOBPLANE_WORKER_CONCURRENCY")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each runs every variant)")
    parser.add_argument(
        "--scopes",
        type=int,
        default=1,
        help="scope ids the runs are spread over, with a webhook each (default 1: one webhook)",
    )
    parser.add_argument(
        "--delivery-wait",
        type=float,
        default=120,
        help="seconds after the last run ended to wait for every delivery (default 120)",
    )
    parser.add_argument("--mongodb-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--write-concern", choices=["majority", "1"], default="majority")
    parser.add_argument(
        "--variants",
        type=lambda s: [v for v in s.split(",") if v],
        default=list(VARIANTS),
        help="comma-separated subset of: " + ",".join(VARIANTS),
    )
    parser.add_argument(
        "--serve-receiver",
        type=int,
        metavar="PORT",
        help="(what the benchmark starts) be the webhook receiver on 127.0.0.1:PORT",
    )
    args = parser.parse_args()
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if args.scopes < 1:
        parser.error("--scopes must be at least 1")
    args.sequential_runs = 0
    args.json = False
    return args


def main() -> None:
    args = parse()
    if args.serve_receiver is not None:
        serve_receiver(args.serve_receiver)
        return
    run_main(args, lambda mongo, redis, procs: main_async(args, mongo, redis, procs))


if __name__ == "__main__":
    main()
