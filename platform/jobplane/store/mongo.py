"""The MongoDB store: the connection, and one store per aggregate over its collections.

`MongoStore` only composes: each aggregate store owns its queries and writes, and services
see them through the interfaces of `store/abc.py`. `client` and `db` are for operations
(indexes, sharding) and for tests (`tests/integration/db.py`); no service touches them.
"""

import asyncio
import logging

import pymongo
from pymongo import AsyncMongoClient
from pymongo.write_concern import WriteConcern

from jobplane.clock import Clock, SystemClock
from jobplane.store import abc, indexes
from jobplane.store.children import MongoChildStore
from jobplane.store.convert import Doc
from jobplane.store.database import Collections
from jobplane.store.feed import MongoFeedStore
from jobplane.store.gates import MongoGateStore
from jobplane.store.keys import MongoKeyStore
from jobplane.store.leases import MongoLeaseStore
from jobplane.store.lending import MongoLendingStore
from jobplane.store.locks import MongoLockStore
from jobplane.store.maintenance import MongoMaintenanceStore
from jobplane.store.overview import MongoOverviewStore
from jobplane.store.queues import MongoQueueStore
from jobplane.store.runs import MongoRunStore
from jobplane.store.schedules import MongoScheduleStore
from jobplane.store.templates import MongoTemplateStore
from jobplane.store.trail import MongoTrailStore
from jobplane.store.transitions import MongoTransitionStore
from jobplane.store.webhooks import MongoWebhookStore
from jobplane.store.writes import RunWrites

log = logging.getLogger("jobplane.store")


class MongoStore:
    def __init__(
        self,
        client: AsyncMongoClient[Doc],
        db_name: str,
        write_concern: str = "majority",
        clock: Clock | None = None,
    ) -> None:
        self.client = client
        w: int | str = int(write_concern) if write_concern.isdigit() else write_concern
        self.db = client.get_database(db_name, write_concern=WriteConcern(w=w))
        self.clock: Clock = clock or SystemClock()
        db = Collections.of(self.db)
        trail = MongoTrailStore(db, self.clock)
        # One write machinery for every writer of runs, so that all share its group commit.
        writes = RunWrites(db, self.clock, trail)
        self.trail: abc.TrailStore = trail
        self.templates: abc.TemplateStore = MongoTemplateStore(db, self.clock)
        self.schedules: abc.ScheduleStore = MongoScheduleStore(db, self.clock)
        self.keys: abc.KeyStore = MongoKeyStore(client, db, self.clock, trail)
        self.queues: abc.QueueStore = MongoQueueStore(client, db, self.clock, trail)
        self.locks: abc.LockStore = MongoLockStore(db)
        self.runs: abc.RunStore = MongoRunStore(writes)
        self.children: abc.ChildStore = MongoChildStore(writes)
        gates = MongoGateStore(db)
        self.gates: abc.GateStore = gates
        self.transitions: abc.TransitionStore = MongoTransitionStore(writes, gates)
        self.leases: abc.LeaseStore = MongoLeaseStore(writes)
        self.lending: abc.LendingStore = MongoLendingStore(writes)
        self.maintenance: abc.MaintenanceStore = MongoMaintenanceStore(db, self.clock)
        self.overview: abc.OverviewStore = MongoOverviewStore(db)
        self.webhooks: abc.WebhookStore = MongoWebhookStore(client, db, self.clock, trail)
        self.feed: abc.FeedStore = MongoFeedStore(db)

    @classmethod
    def connect(
        cls,
        url: str,
        db_name: str,
        write_concern: str = "majority",
        clock: Clock | None = None,
        connect_timeout_seconds: float = 20,
    ) -> "MongoStore":
        client: AsyncMongoClient[Doc] = AsyncMongoClient(
            url,
            tz_aware=True,
            retryWrites=True,
            connectTimeoutMS=int(connect_timeout_seconds * 1000),
        )
        return cls(client, db_name, write_concern, clock)

    async def close(self, within: float | None = None) -> None:
        """Copy the events still waiting to `job_events`, then disconnect; with `within`, a
        MongoDB that does not answer is given up on after that many seconds. The events stay in
        their runs' trails, where the scheduler's sweep finds them."""
        loop = asyncio.get_running_loop()
        by = None if within is None else loop.time() + within
        try:
            async with asyncio.timeout_at(by):
                await self.trail.flush()
        except TimeoutError:
            log.warning("events not copied to job_events within %.1f s; the sweep will", within)
        # Closing ends the client's sessions with a command that waits for a server as any
        # other does (30 s). It only spares the server memory (it drops idle sessions after 30
        # minutes), so it gets a second at most; PyMongo then closes the sockets anyway.
        ending = 1.0 if by is None else min(1.0, max(by - loop.time(), 0.1))
        with pymongo.timeout(ending):
            await self.client.close()

    async def ping(self) -> None:
        await self.db.command("ping")

    async def ensure_indexes(self) -> None:
        """Create every index (`indexes.index_models`) and drop the ones they replaced."""
        await indexes.ensure_indexes(self.db)

    async def shard(self) -> list[str]:
        """Shard the large collections (`indexes.shard`); a mongos only."""
        return await indexes.shard(self.client, self.db)


async def shard_database(url: str, db_name: str) -> list[str]:
    """`MongoStore.shard` for `jobplane db shard`: connects, shards, closes."""
    store = MongoStore.connect(url, db_name)
    try:
        return await store.shard()
    finally:
        await store.close()
