"""`jobplane notifier`: the fan-out of new events to webhooks, and the sending of deliveries.

Every notifier sends; one at a time follows the trail, under the owner-checked `notifier` lock
in Redis. That lock saves work, not correctness: a second notifier following the trail at once
(a lock lost to a Redis failover, say) stores the same deliveries, which are no-ops.
"""

import asyncio
import contextlib
import logging
import os

from jobplane.backends import open_backends
from jobplane.clock import Clock, SystemClock
from jobplane.process import Stopped, finish_within, stop_on_signals
from jobplane.queue.redis import RedisQueue
from jobplane.settings import Settings
from jobplane.store import Store
from jobplane.webhooks.fanout import Fanout
from jobplane.webhooks.sender import Sender

log = logging.getLogger("jobplane.notifier")


class Notifier:
    def __init__(
        self,
        store: Store,
        queue: RedisQueue,
        settings: Settings,
        clock: Clock | None = None,
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.settings = settings
        self.clock = clock or SystemClock()
        self.owner = owner or f"notifier-{os.getpid()}-{os.urandom(4).hex()}"
        self.sender = Sender(store, settings, self.clock, asyncio.Event())
        self.fanout = Fanout(store, settings, self.clock, self.sender)

    async def run(self, stop: asyncio.Event) -> None:
        log.info("notifier %s started", self.owner)
        await asyncio.gather(self.sender.run(stop), self._lead(stop))

    async def _lead(self, stop: asyncio.Event) -> None:
        """Follow the trail while this notifier holds the lock; stand by while another does."""
        ttl = self.settings.scheduler_lock_seconds
        following: asyncio.Task[None] | None = None
        try:
            while not stop.is_set():
                try:
                    holds = await self.queue.locks.take_singleton("notifier", self.owner, ttl)
                except Exception:
                    log.warning("the notifier lock could not be renewed", exc_info=True)
                    holds = False
                if holds and following is None:
                    log.info("notifier %s follows the trail", self.owner)
                    following = asyncio.create_task(self.fanout.run(stop))
                elif not holds and following is not None:
                    log.info("notifier %s stands by", self.owner)
                    following.cancel()
                    await asyncio.wait([following])
                    following = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ttl / 3)
        finally:
            if following is not None:
                await finish_within(following, self.settings.close_seconds, "the fan-out")
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.close_seconds):
                    await self.queue.locks.release_singleton("notifier", self.owner)


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    stop_on_signals(stop, 2 * settings.close_seconds)
    with contextlib.suppress(Stopped):
        async with open_backends(settings, stop=stop) as backends:
            await Notifier(backends.store, backends.queue, settings).run(stop)
