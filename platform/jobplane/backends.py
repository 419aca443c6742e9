"""Opening MongoDB and Redis from settings, the same way for every process."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from jobplane.clock import Clock
from jobplane.queue.connect import open_redis, parse_redis_url
from jobplane.queue.keys import Keys
from jobplane.queue.redis import RedisQueue
from jobplane.settings import Settings
from jobplane.store import MongoStore


@dataclass(frozen=True)
class Backends:
    store: MongoStore
    queue: RedisQueue


@asynccontextmanager
async def open_backends(settings: Settings, clock: Clock | None = None) -> AsyncIterator[Backends]:
    """Connect to both and make sure the indexes exist; close both on exit."""
    if not settings.mongodb_url or not settings.redis_url:
        raise RuntimeError("JOBPLANE_MONGODB_URL and JOBPLANE_REDIS_URL must be set")
    target = parse_redis_url(settings.redis_url)
    store = MongoStore.connect(settings.mongodb_url, settings.db, settings.write_concern, clock)
    try:
        async with open_redis(target, health_check_interval=30) as redis:
            await store.ensure_indexes()
            yield Backends(store, RedisQueue(redis, Keys(settings.redis_prefix)))
    finally:
        await store.close()
