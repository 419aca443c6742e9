"""Backends and helpers for tests against the real MongoDB and Redis of the session."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp

from jobplane import Client as Producer
from jobplane.api import create_app
from jobplane.backends import Backends, open_backends
from jobplane.clock import ManualClock
from jobplane.devstack import free_port
from jobplane.model import Template, TemplateSpec
from jobplane.process import HTTPServer, serve_http
from jobplane.queue.redis import RedisQueue
from jobplane.settings import Settings
from jobplane.store import MongoStore

Register = Callable[..., Awaitable[Template]]
Client = Callable[[str], httpx.AsyncClient]


@pytest.fixture
def settings(mongo_url: str, redis_url: str, db_name: str, redis_prefix: str) -> Settings:
    return Settings(
        mongodb_url=mongo_url,
        redis_url=redis_url,
        db=db_name,
        redis_prefix=redis_prefix,
        admin_key="test-admin-key",
        lease_seconds=5,
        heartbeat_seconds=1,
        poll_seconds=0.2,
        reconcile_seconds=0.5,
    )


@pytest.fixture
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    async with open_backends(settings) as opened:
        # Redis holds the queues' pauses (none yet), as after a worker's first pop, so that a
        # test may pop without a worker.
        await opened.queue.mirror_pauses([], complete=True)
        yield opened


@pytest.fixture
async def timed(
    backends: Backends, settings: Settings, clock: ManualClock
) -> AsyncIterator[MongoStore]:
    """A store of the test's database on the module's `clock` fixture, which moves only when
    the test says."""
    store = MongoStore(backends.store.client, settings.db, clock=clock)
    yield store
    await store.trail.flush()  # before the test's database is dropped


@pytest.fixture
def store(backends: Backends) -> MongoStore:
    return backends.store


@pytest.fixture
def queue(backends: Backends) -> RedisQueue:
    return backends.queue


def template_spec(type_: str = "t_noop", **fields: Any) -> TemplateSpec:
    """A template spec with one `builtin.noop` step unless `steps` is given."""
    doc: dict[str, Any] = {"type": type_, "steps": [{"id": "only", "handler": "builtin.noop"}]}
    doc.update(fields)
    return TemplateSpec.model_validate(doc)


@pytest.fixture
def register(store: MongoStore) -> Register:
    async def register(type_: str = "t_noop", **fields: Any) -> Template:
        template, _ = await store.templates.register(template_spec(type_, **fields))
        return template

    return register


@pytest.fixture
async def client_for(backends: Backends, settings: Settings) -> AsyncIterator[Client]:
    """`client_for(key)`: a client of one ASGI app that sends `key` as its bearer key."""
    transport = httpx.ASGITransport(app=create_app(settings, backends))
    async with AsyncExitStack() as stack:

        def client(key: str) -> httpx.AsyncClient:
            headers = {"authorization": f"Bearer {key}"}
            made = httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers)
            stack.push_async_callback(made.aclose)
            return made

        yield client


@pytest.fixture
def api(client_for: Client, settings: Settings) -> httpx.AsyncClient:
    """A client of the app that sends the admin key."""
    assert settings.admin_key is not None
    return client_for(settings.admin_key)


@pytest.fixture
async def url(settings: Settings, backends: Backends) -> AsyncIterator[str]:
    """The API served by uvicorn on a free port of 127.0.0.1."""
    async with served(create_app(settings, backends)) as at:
        yield at


@asynccontextmanager
async def served(app: ASGIApp) -> AsyncIterator[str]:
    """`app` served by uvicorn on a free port of 127.0.0.1, at the URL given, until the block
    ends."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_config=None,
        access_log=False,
        ws="none",
        lifespan="off",
    )
    server, stop = HTTPServer(config), asyncio.Event()
    task = asyncio.create_task(serve_http(server, stop))
    try:
        async with asyncio.timeout(30):
            while not server.started:  # uvicorn exposes readiness only as a flag
                if task.done():
                    task.result()  # raises why it stopped
                    pytest.fail("the API server stopped before it started")
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await task


# -- jobplane.Client in each of its modes ------------------------------------------------------


def options(mode: str, url: str, settings: Settings) -> dict[str, Any]:
    """`Client` arguments for one transport, against this test's database and Redis prefix."""
    if mode == "http":
        return {"url": url, "api_key": settings.admin_key}
    return {
        "mongodb_url": settings.mongodb_url,
        "redis_url": settings.redis_url,
        "db": settings.db,
        "redis_prefix": settings.redis_prefix,
        "actor": "client:test",
    }


@pytest.fixture(params=["http", "direct"])
def mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


@pytest.fixture
async def client(mode: str, url: str, settings: Settings) -> AsyncIterator[Producer]:
    async with Producer(**options(mode, url, settings)) as made:
        yield made
