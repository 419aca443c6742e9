"""Workers: claim runs and execute their steps."""

import asyncio

from jobplane.backends import open_backends
from jobplane.process import stop_on_signals
from jobplane.settings import Settings
from jobplane.worker.context import (
    CancelRequested,
    FatalError,
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
    """Run one worker until SIGTERM/SIGINT, then drain."""
    load_modules(settings.handlers)
    stop = asyncio.Event()
    stop_on_signals(stop)
    async with open_backends(settings) as backends:
        await Worker(backends.store, backends.queue, settings).run(stop, drain_seconds)
