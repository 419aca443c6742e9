"""The singleton scheduler: reaper and reconciler now; cron schedules build on the same tick."""

import asyncio

from jobplane.backends import open_backends
from jobplane.process import stop_on_signals
from jobplane.scheduler.tick import Scheduler
from jobplane.settings import Settings

__all__ = ["Scheduler", "serve"]


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    stop_on_signals(stop)
    async with open_backends(settings) as backends:
        await Scheduler(backends.store, backends.queue, settings).run(stop)
