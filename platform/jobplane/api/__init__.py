"""The HTTP API (FastAPI), under /v1."""

import asyncio

import uvicorn

from jobplane.api.app import create_app
from jobplane.process import HTTPServer, serve_http, stop_on_signals
from jobplane.settings import Settings

__all__ = ["create_app", "serve"]


async def serve(settings: Settings) -> None:
    stop = asyncio.Event()
    stop_on_signals(stop)
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port)
    await serve_http(HTTPServer(config), stop)
