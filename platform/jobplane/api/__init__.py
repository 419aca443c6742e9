"""The HTTP API (FastAPI), under /v1."""

import asyncio
import contextlib
import math

import uvicorn

from jobplane.api.app import create_app
from jobplane.backends import open_backends
from jobplane.process import HTTPServer, Stopped, serve_http, stop_on_signals
from jobplane.settings import Settings

__all__ = ["create_app", "serve"]


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    # Requests in flight, then closing the connections: each gets the close budget.
    stop_on_signals(stop, 2 * settings.close_seconds)
    # The backends are opened here rather than in the app's lifespan, so that a stop during
    # start-up (MongoDB not answering yet) need not wait for uvicorn's.
    with contextlib.suppress(Stopped):
        async with open_backends(settings, stop=stop) as backends:
            config = uvicorn.Config(
                create_app(settings, backends, stop),
                host=settings.host,
                port=settings.port,
                timeout_graceful_shutdown=math.ceil(settings.close_seconds),
            )
            await serve_http(HTTPServer(config), stop)
