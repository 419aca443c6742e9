"""What each kind of write of a run costs mongod, in CPU µs a document, and what changes it.

A run's life on the hot path is a handful of writes: its insert, the claim, the completion (a
lease holder's conditional update), and five event copies into `job_events`. This benchmark
makes each alone against a fresh `mongod` (a one-node replica set, as the dev stack starts it,
with jobplane's indexes), in blocks of `--block` documents sent as jobplane's group commit sends
them (bulk writes of 16, four at a time; event copies of 75), with majority write concern and
retryable writes. It reads mongod's CPU time from `/proc` around each block. The variants of a
kind alternate block by block in rotating order, so a slow minute of the machine falls on all
of them, and the median over `--rounds` blocks is printed.

    completion            the completion as jobplane writes it: filter on `_id` plus its guards
                          (scope, scope id, status, version), $set / $unset / $inc, $push of
                          three events
      id only             the same update with the filter `{_id}` alone (MongoDB's fast path
                          for a lookup by `_id`, which skips query planning): no fencing
      hinted              guarded, with `hint` on the `_id` index
      no retryable writes guarded, from a client with retryable writes off
      pipeline, id only   the update as an aggregation pipeline that checks the guards itself
      fewer indexes       guarded, on a collection with only the four indexes every run is in
    insert                a run's insert, with every index / with the four
    event copy            an event's insert into `job_events`, with its six indexes / `_id` only

Figures are server CPU only (no client, no network) and depend on the machine's speed that
minute: read them against each other, not as absolutes. docs/benchmarks.md ("Issue 31") has
them.

    .venv/bin/python bench/write_costs.py [--rounds K] [--block N] [--mongodb-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bson import ObjectId
from pymongo import AsyncMongoClient, InsertOne, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection

from jobplane.devstack.servers import MongoServer, free_port
from jobplane.store.indexes import index_models
from throughput import cpu_seconds

Doc = dict[str, Any]
BATCH, AT_ONCE, EVENT_BATCH = 16, 4, 75
GUARDS = {"scope": "system", "scopeId": "bench", "status": "running", "version": 2}


def run_document(now: datetime) -> Doc:
    """A run as a worker finds it: running, leased, with its first two events."""
    oid = ObjectId()
    event = {"jobId": str(oid), "actor": "user:bench", "scope": "system", "scopeId": "bench"}
    return {
        "_id": oid,
        "templateType": "bench_noop",
        "templateVersion": 1,
        "scope": "system",
        "scopeId": "bench",
        "status": "running",
        "payload": {},
        "priority": 0,
        "queue": "default",
        "progress": {
            "summary": "",
            "percentage": 0,
            "steps": [{"id": "only", "status": "pending", "needs": [], "attempt": 0}],
        },
        "outputs": {},
        "attempts": [],
        "attempt": 1,
        "maxAttempts": 1,
        "handler": "builtin.noop",
        "createAt": now,
        "updateAt": now,
        "version": 2,
        "lockedBy": "w1",
        "leaseToken": "lease",
        "lockedUntil": now,
        "trail": [
            {**event, "_id": ObjectId(), "type": "created", "createAt": now, "to": "queued"},
            {**event, "_id": ObjectId(), "type": "status_changed", "createAt": now},
        ],
    }


def event_document(now: datetime) -> Doc:
    return {
        "_id": ObjectId(),
        "jobId": str(ObjectId()),
        "type": "status_changed",
        "actor": "worker:bench",
        "scope": "system",
        "scopeId": "bench",
        "metadata": {"transition": "complete"},
        "runVersion": 3,
        "createAt": now,
        "from": "running",
        "to": "succeeded",
    }


def completion(doc: Doc, now: datetime, variant: str) -> UpdateOne:
    events = [{"_id": ObjectId(), "type": t, "createAt": now} for t in ("a", "b", "c")]
    query = {"_id": doc["_id"]} if variant.endswith("id only") else {"_id": doc["_id"], **GUARDS}
    if variant.startswith("pipeline"):
        guarded = {"$and": [{"$eq": [f"${k}", v]} for k, v in GUARDS.items()]}

        def when(value: Any, field: str) -> Doc:
            return {"$cond": [guarded, value, f"${field}"]}

        update: Any = [
            {
                "$set": {
                    "status": when("succeeded", "status"),
                    "completedAt": when(now, "completedAt"),
                    "updateAt": when(now, "updateAt"),
                    "leaseToken": when("$$REMOVE", "leaseToken"),
                    "lockedUntil": when("$$REMOVE", "lockedUntil"),
                    "version": when({"$add": ["$version", 1]}, "version"),
                    "trail": when({"$concatArrays": ["$trail", {"$literal": events}]}, "trail"),
                }
            }
        ]
    else:
        update = {
            "$set": {
                "status": "succeeded",
                "completedAt": now,
                "updateAt": now,
                "progress.steps.0.status": "succeeded",
            },
            "$unset": {"leaseToken": "", "lockedUntil": ""},
            "$inc": {"version": 1},
            "$push": {"trail": {"$each": events}},
        }
    return UpdateOne(query, update, hint="_id_" if variant == "hinted" else None)


async def in_batches(collection: AsyncCollection[Doc], ops: list[Any], size: int) -> None:
    """`ops` as unordered bulk writes of `size`, `AT_ONCE` in flight."""
    batches = [ops[i : i + size] for i in range(0, len(ops), size)]
    for i in range(0, len(batches), AT_ONCE):
        await asyncio.gather(
            *(collection.bulk_write(b, ordered=False) for b in batches[i : i + AT_ONCE])
        )


async def measure(args: argparse.Namespace, url: str, pid: int) -> None:
    client: AsyncMongoClient[Doc] = AsyncMongoClient(url, w="majority")
    plain: AsyncMongoClient[Doc] = AsyncMongoClient(url, w="majority", retryWrites=False)
    db = client["write_costs"]
    await client.drop_database(db.name)
    every = index_models()["job_runs"]
    four = [m for m in every if "partialFilterExpression" not in m.document]
    runs = {"every": db["runs"], "four": db["runs_four"]}
    await runs["every"].create_indexes(every)
    await runs["four"].create_indexes(four)
    events = {"six": db["events"], "_id": db["events_id"]}
    await events["six"].create_indexes(index_models()["job_events"])

    def completing(variant: str) -> Callable[[], Awaitable[float]]:
        collection = runs["four" if variant == "fewer indexes" else "every"]
        if variant == "no retryable writes":
            collection = plain[db.name][collection.name]

        async def block() -> float:
            now = datetime.now(UTC)
            docs = [run_document(now) for _ in range(args.block)]
            await collection.insert_many(docs)
            ops = [completion(d, now, variant) for d in docs]
            return await timed(pid, in_batches(collection, ops, BATCH))

        return block

    def inserting(
        collection: AsyncCollection[Doc], document: Callable[[datetime], Doc], size: int
    ) -> Callable[[], Awaitable[float]]:
        async def block() -> float:
            now = datetime.now(UTC)
            ops = [InsertOne(document(now)) for _ in range(args.block)]
            return await timed(pid, in_batches(collection, ops, size))

        return block

    kinds: dict[str, dict[str, Callable[[], Awaitable[float]]]] = {
        "completion": {
            v: completing(v)
            for v in (
                "guarded",
                "id only",
                "hinted",
                "no retryable writes",
                "pipeline, id only",
                "fewer indexes",
            )
        },
        "insert": {
            "every index": inserting(runs["every"], run_document, BATCH),
            "four indexes": inserting(runs["four"], run_document, BATCH),
        },
        "event copy": {
            "six indexes": inserting(events["six"], event_document, EVENT_BATCH),
            "_id only": inserting(events["_id"], event_document, EVENT_BATCH),
        },
    }
    for kind, variants in kinds.items():
        names = list(variants)
        spent: dict[str, list[float]] = {v: [] for v in names}
        for k in range(args.rounds):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                spent[name].append(1e6 * await variants[name]() / args.block)
        print(f"{kind}, mongod CPU µs a document (median of {args.rounds} blocks of {args.block}):")
        base = statistics.median(spent[names[0]])
        for name in names:
            mid = statistics.median(spent[name])
            print(f"  {name:22} {mid:6.0f}  ({mid / base:.2f}x)")
    await client.drop_database(db.name)
    await client.close()
    await plain.close()


async def timed(pid: int, work: Awaitable[None]) -> float:
    """mongod's CPU seconds while `work` ran."""
    await asyncio.sleep(0.1)  # the previous block's journal and eviction settle
    before = cpu_seconds(pid)
    await work
    return cpu_seconds(pid) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=1600, help="documents a block")
    parser.add_argument("--mongodb-url", help="a mongod of its own: its CPU is read by --pid")
    parser.add_argument("--pid", type=int, help="the pid of that mongod")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.mongodb_url:
            url, pid = args.mongodb_url, args.pid
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jobplane-")))
            mongo = MongoServer(root / "mongo", free_port(), root / "mongod.log")
            mongo.start()
            stack.callback(mongo.stop)
            url, pid = mongo.url, mongo.pid
        if not pid:
            parser.error("--pid is needed with --mongodb-url")
        asyncio.run(measure(args, url, pid))


if __name__ == "__main__":
    main()
