"""What one durable MongoDB write costs on this machine: the floor under enqueue-to-start.

docs/contract.md puts two durable writes before a run's step may start: its insert before its push
(rule 7) and the claim that fences it (rule 2). This times single inserts, one at a time, with
write concern `w: 1`, `w: 1, j: true` and `majority`, against a throwaway one-node replica set
started as the tests and benchmarks start theirs (or `--mongodb-url`), and an `fdatasync` of
4 KB in the temporary directory the throwaway mongod keeps its files in (a temporary directory
of this machine with `--mongodb-url`), so the disk's share of a durable write shows.
Percentiles are nearest-rank.

    .venv/bin/python bench/durable_write.py [--writes N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from pymongo import AsyncMongoClient, WriteConcern

from jobplane.devstack.servers import MongoServer, free_port
from latency import line
from throughput import machine

CONCERNS = {
    "w: 1": WriteConcern(w=1),
    "w: 1, j: true": WriteConcern(w=1, j=True),
    "w: majority": WriteConcern(w="majority"),
}


async def inserts(url: str, writes: int) -> None:
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(url)
    try:
        db = client["jobplane_bench_durable"]
        await db.writes.insert_one({"warm": True})
        for label, concern in CONCERNS.items():
            collection = db.get_collection("writes", write_concern=concern)
            ms = []
            for i in range(writes):
                began = time.perf_counter()
                await collection.insert_one({"i": i, "payload": "x" * 500})
                ms.append(1000 * (time.perf_counter() - began))
            print(f"  insert, {label:14} {line(ms)}")
        await client.drop_database(db.name)
    finally:
        await client.close()


def fdatasyncs(directory: Path, writes: int) -> None:
    path = directory / "fdatasync.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        ms = []
        for _ in range(writes):
            began = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fdatasync(fd)
            ms.append(1000 * (time.perf_counter() - began))
    finally:
        os.close(fd)
        path.unlink()
    print(f"  fdatasync of 4 KB      {line(ms)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=400, help="writes timed per kind")
    parser.add_argument("--mongodb-url", help="a MongoDB of your own (default: a throwaway one)")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="jobplane-bench-") as tmp:
        root = Path(tmp)
        url = args.mongodb_url
        mongo = None
        if not url:
            mongo = MongoServer(root / "mongo", free_port(), root / "mongod.log")
            mongo.start()
            url = mongo.url
        try:
            print(f"mongodb {url}, {args.writes} writes of each kind, one at a time\n")
            asyncio.run(inserts(url, args.writes))
            fdatasyncs(root, args.writes)
        finally:
            if mongo is not None:
                mongo.stop()


if __name__ == "__main__":
    main()
