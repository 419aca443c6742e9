"""The FastAPI application."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from jobplane.api import errors
from jobplane.api.routes import events, health, keys, runs, templates
from jobplane.backends import Backends, open_backends
from jobplane.settings import Settings
from jobplane.templates.loader import MAX_TEMPLATE_BYTES


def create_app(settings: Settings, backends: Backends | None = None) -> FastAPI:
    """Build the app; it opens its own backends unless given some (tests, `jobplane dev`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_backends(settings) as opened:
            app.state.store, app.state.queue = opened.store, opened.queue
            yield

    # Room for the largest payload and its envelope, and for the largest template: a bigger
    # body is refused (413) before it is read into memory.
    limit = max(settings.max_payload_bytes + 64 * 1024, MAX_TEMPLATE_BYTES)
    app = FastAPI(
        title="jobplane",
        version="1",
        lifespan=None if backends else lifespan,
        max_body_size=limit,
    )
    app.state.settings = settings
    if backends is not None:
        app.state.store, app.state.queue = backends.store, backends.queue
    errors.install(app)
    for module in (health, keys, templates, runs, events):
        app.include_router(module.router)
    return app
