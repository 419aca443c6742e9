"""Opening MongoDB and Redis from settings, the same way for every process."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from jobplane.clock import Clock
from jobplane.process import unless_stopped
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
async def open_backends(
    settings: Settings, clock: Clock | None = None, stop: asyncio.Event | None = None
) -> AsyncIterator[Backends]:
    """Connect to both and make sure the indexes exist; close both on exit, within
    `settings.close_seconds` however the engines answer.

    With `stop`, a stop during start-up (MongoDB may not answer yet) raises `Stopped`.
    """
    if not settings.mongodb_url or not settings.redis_url:
        raise RuntimeError(settings.unset("mongodb_url", "redis_url"))
    target = parse_redis_url(settings.redis_url)
    store = MongoStore.connect(
        settings.mongodb_url,
        settings.db,
        settings.write_concern,
        clock,
        connect_timeout_seconds=settings.connect_timeout_seconds,
    )
    # Defaults a URL's own options override.
    options = {
        "health_check_interval": 30,
        "socket_connect_timeout": settings.connect_timeout_seconds,
        # A blocking pop waits up to `poll_seconds` for its reply by design.
        "socket_timeout": settings.poll_seconds + settings.connect_timeout_seconds,
        # redis-py's default, ten retries of a call, would hold a heartbeat for a minute against
        # a Redis that does not answer; jobplane's loops retry at their own pace anyway.
        "retry": Retry(ExponentialWithJitterBackoff(base=0.01, cap=1), retries=2),
    }
    redis_closing = contextlib.AsyncExitStack()
    try:
        redis = await redis_closing.enter_async_context(open_redis(target, **options))
        indexed = store.ensure_indexes()
        await (indexed if stop is None else unless_stopped(indexed, stop))
        # Three connect timeouts, about what a call and its two retries take against a Redis
        # that refuses or drops connections; one that takes longer waits on something no
        # driver timeout bounds (see `RedisQueue`).
        bound = 3 * settings.connect_timeout_seconds
        yield Backends(store, RedisQueue(redis, Keys(settings.redis_prefix), bound))
    finally:
        closing = asyncio.get_running_loop().time() + settings.close_seconds
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(closing):
                await redis_closing.aclose()
        await store.close(closing - asyncio.get_running_loop().time())
