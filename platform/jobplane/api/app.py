"""The FastAPI application."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobplane import tracing
from jobplane.api import errors
from jobplane.api.auth import Caller
from jobplane.api.live import RunChanges
from jobplane.api.routes import (
    events,
    external,
    health,
    keys,
    metrics,
    overview,
    queues,
    runs,
    schedules,
    templates,
    webhooks,
)
from jobplane.backends import Backends, open_backends
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings
from jobplane.templates.loader import MAX_TEMPLATE_BYTES
from jobplane.ui import Dashboard


def create_app(
    settings: Settings,
    backends: Backends | None = None,
    stop: asyncio.Event | None = None,
    trusted: Caller | None = None,
) -> FastAPI:
    """Build the app; it opens its own backends unless given some (tests, `jobplane dev`).
    Its live streams end when `stop` is set (a process's stop), before the server waits for
    the requests in flight. With `trusted`, every request acts as that caller, without a key:
    only for an app that a direct `Client` calls in its own process, never one served."""

    def attach(app: FastAPI, opened: Backends) -> None:
        app.state.store, app.state.queue = opened.store, opened.queue
        app.state.waiting = Waiting(opened.store, opened.queue)
        app.state.run_changes = RunChanges(opened.store)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_backends(settings) as opened:
            attach(app, opened)
            yield

    # FastAPI makes a SERVER span for each request while a tracer provider is installed; not
    # three more for its dependencies, endpoint and serialization, which a run's trace does
    # not need and each request would pay for.
    app = FastAPI(
        title="jobplane",
        version="1",
        lifespan=None if backends else lifespan,
        telemetry={"operation_spans": False},
    )
    app.state.settings = settings
    app.state.trusted = trusted
    app.state.stop = stop or asyncio.Event()
    if backends is not None:
        attach(app, backends)
    errors.install(app)
    routers = (
        health,
        metrics,
        keys,
        templates,
        runs,
        schedules,
        events,
        external,
        overview,
        queues,
        webhooks,
    )
    for module in routers:
        app.include_router(module.router)
    # The web dashboard: static files that call the API above like any other client.
    app.mount("/ui", Dashboard(), name="ui")
    # Room for the largest payload and its envelope, and for the largest template.
    limit = max(settings.max_payload_bytes + 64 * 1024, MAX_TEMPLATE_BYTES)
    app.add_middleware(BodyLimit, limit=limit, paths={runs.BATCH_PATH: settings.max_batch_bytes})
    app.add_middleware(WrittenPaths)
    app.add_middleware(TraceContext)
    return app


class TraceContext:
    """A request that carries a `traceparent` is served in the caller's trace: the runs and
    schedules it creates continue it (`jobplane/tracing.py`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            carried = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in scope["headers"]
                if name in _TRACE_HEADERS
            }
            if carried:
                with tracing.continued(carried):
                    await self.app(scope, receive, send)
                return
        await self.app(scope, receive, send)


_TRACE_HEADERS = (b"traceparent", b"tracestate")


class WrittenPaths:
    """A method a path written out lacks (`GET /v1/runs/batch`) is a 405, as the document
    says, rather than a templated route's (`GET /v1/runs/{run_id}`, a run named "batch")."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            written = errors.written_methods(scope["app"], scope["path"])
            if written and scope["method"] not in written:
                refusal = errors.method_not_allowed(scope["app"], scope)
                await errors.http_error(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a request body over `limit` bytes (413) before it is read into memory; `paths`
    give some paths a cap of their own (the batch endpoint takes a thousand runs in one body).

    Starlette's own limiter answers in plain text, not in the error shape of docs/contract.md.
    This one raises an `HTTPException` from `receive`, which FastAPI passes on to the error
    handlers.
    """

    def __init__(self, app: ASGIApp, limit: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.paths = dict(paths or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.limit)
        too_large = HTTPException(413, f"request body over {limit} bytes")
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await errors.http_error(too_large)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
            return message

        await self.app(scope, counted, send)
