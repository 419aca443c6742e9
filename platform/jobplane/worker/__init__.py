"""Workers: claim runs and execute their steps."""

import asyncio
import contextlib

from jobplane.backends import open_backends
from jobplane.process import Stopped, stop_on_signals
from jobplane.settings import Settings
from jobplane.worker.context import (
    CancelRequested,
    FatalError,
    LockTimeout,
    RetryableError,
    StepContext,
    StepInterrupted,
    StepTimeout,
)
from jobplane.worker.handlers import handler, load_modules, registry
from jobplane.worker.worker import Worker

__all__ = [
    "CancelRequested",
    "FatalError",
    "LockTimeout",
    "RetryableError",
    "StepContext",
    "StepInterrupted",
    "StepTimeout",
    "Worker",
    "handler",
    "registry",
    "serve",
]


async def serve(settings: Settings, drain_seconds: float = 30) -> None:
    """Run one worker until SIGTERM/SIGINT, then drain (docs/operations.md, "Stopping")."""
    load_modules(settings.handlers)
    stop = asyncio.Event()
    drain = max(drain_seconds, settings.poll_seconds)  # a pop in flight is let finish
    stop_on_signals(stop, drain + 2 * settings.close_seconds)
    with contextlib.suppress(Stopped):
        async with open_backends(settings, stop=stop) as backends:
            await Worker(backends.store, backends.queue, settings).run(stop, drain_seconds)
