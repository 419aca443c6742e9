"""A real webhook receiver for tests: an HTTP server on 127.0.0.1 that records each request and
answers as the test says, and a notifier run on the test's event loop."""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import uvicorn
from standardwebhooks.webhooks import Webhook as Verifier
from starlette.types import Receive, Scope, Send

from jobplane.backends import Backends
from jobplane.devstack import free_port
from jobplane.process import HTTPServer, serve_http
from jobplane.settings import Settings
from jobplane.webhooks.notifier import Notifier
from tests.integration.flow import until


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def message(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed

    def verified(self, secret: str) -> dict[str, Any]:
        """The body, if its signature verifies with `secret` (raises otherwise)."""
        parsed: dict[str, Any] = Verifier(secret).verify(self.body, self.headers)
        return parsed


# An answer: a status, headers, and how long to wait before answering.
Answer = tuple[int, dict[str, str], float]
Answering = Callable[[Request, list[Request]], Answer]


def ok(request: Request, earlier: list[Request]) -> Answer:
    return 200, {}, 0.0


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    answer: Answering = ok
    received: list[Request] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def of_type(self, *types: str) -> list[Request]:
        """The requests of these types (of any type if none is named)."""
        return [r for r in self.received if not types or r.message["type"] in types]

    def ids(self, *types: str) -> set[str]:
        return {r.headers["webhook-id"] for r in self.of_type(*types)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = await body_of(receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        request = Request(scope["path"], headers, body, asyncio.get_running_loop().time())
        earlier = [r for r in self.received if r.headers["webhook-id"] == headers["webhook-id"]]
        self.received.append(request)
        status, extra, delay = self.answer(request, earlier)
        await asyncio.sleep(delay)
        raw = [(k.encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": b""})


async def body_of(receive: Receive) -> bytes:
    """A request's whole body, as ASGI hands it over in parts."""
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


class Listener(Protocol):
    """An ASGI app that knows its port."""

    port: int

    async def __call__(self, scope: Scope, receive: Receive, send: Send, /) -> None: ...


L = TypeVar("L", bound=Listener)


@asynccontextmanager
async def serving(receiver: L) -> AsyncIterator[L]:
    """`receiver` listening on its port until the block ends."""
    config = uvicorn.Config(
        receiver,
        host="127.0.0.1",
        port=receiver.port,
        log_config=None,
        access_log=False,
        ws="none",
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server, stop = HTTPServer(config), asyncio.Event()
    task = asyncio.create_task(serve_http(server, stop))
    async with asyncio.timeout(30):
        while not server.started:  # uvicorn exposes readiness only as a flag
            if task.done():
                task.result()
                raise RuntimeError("the receiver stopped before it started")
            await asyncio.sleep(0.02)
    try:
        yield receiver
    finally:
        stop.set()
        await task


def hook_settings(settings: Settings, **fields: Any) -> Settings:
    """Settings for webhook tests: a receiver on 127.0.0.1 allowed, tries seconds apart."""
    values: dict[str, Any] = {
        "webhook_allow_private": True,
        "webhook_retry_seconds": [0, 0.2, 0.4, 0.6, 0.8, 1.0],
        "webhook_timeout_seconds": 1.0,
        "scheduler_lock_seconds": 3,
    }
    return settings.model_copy(update=values | fields)


@asynccontextmanager
async def notifying(backends: Backends, settings: Settings) -> AsyncIterator[Notifier]:
    """A notifier on this event loop until the block ends. With a webhook enabled, from when it
    follows the trail."""
    stop = asyncio.Event()
    notifier = Notifier(backends.store, backends.queue, settings)
    task = asyncio.create_task(notifier.run(stop))
    try:
        if await backends.store.webhooks.enabled():
            await until(lambda: _following(backends))
        yield notifier
    finally:
        stop.set()
        await task


async def received(
    receiver: Receiver, holds: Callable[[Receiver], bool], within: float = 30
) -> None:
    """Wait until `holds(receiver)`; fails the test after `within` seconds."""

    async def check() -> bool:
        return holds(receiver)

    await until(check, within)


async def _following(backends: Backends) -> bool:
    return (await backends.store.feed.position()).token is not None
