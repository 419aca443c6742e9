"""The singleton scheduler: reaper and reconciler now; cron schedules build on the same tick."""

import asyncio
import contextlib

from jobplane.backends import open_backends
from jobplane.process import Stopped, stop_on_signals
from jobplane.scheduler.tick import Scheduler
from jobplane.settings import Settings

__all__ = ["Scheduler", "serve"]


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    # A tick in flight, then closing the connections: each gets the close budget.
    stop_on_signals(stop, 2 * settings.close_seconds)
    with contextlib.suppress(Stopped):
        async with open_backends(settings, stop=stop) as backends:
            await Scheduler(backends.store, backends.queue, settings).run(stop)
