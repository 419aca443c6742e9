"""`Client`'s direct mode: MongoDB and Redis reached as the platform's processes reach them.

Creating, reading and cancelling runs (the hot path) go through the `RunService` the API
itself uses; everything else goes to the API's own routes, served in this process without a
socket and acting for the client (no key), so that both modes answer every call alike.
"""

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from typing import Any

import httpx
from pymongo.errors import ConnectionFailure

from jobplane.backends import open_backends
from jobplane.client.http import checked
from jobplane.client.request import CreateRequest
from jobplane.errors import JobplaneError, Unavailable
from jobplane.model import Run
from jobplane.queue.connect import REDIS_DOWN
from jobplane.runs import RunRequest, RunService
from jobplane.runs.request import read_request
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings


class DirectTransport:
    """Requests are checked as the API checks them, so both transports refuse the same ones."""

    def __init__(self, settings: Settings, actor: str) -> None:
        self.settings = settings
        self.actor = actor
        self._stack = AsyncExitStack()
        self._service: RunService | None = None
        self._api: httpx.AsyncClient | None = None

    async def open(self) -> None:
        with _reachable():
            self._backends = await self._stack.enter_async_context(open_backends(self.settings))
        self._service = RunService(self._backends.store, self._backends.queue)
        self._waiting = Waiting(self._backends.store, self._backends.queue)

    async def create(self, request: CreateRequest) -> Run:
        checked_request = read_request(request.body(), self.settings.max_payload_bytes)
        with _reachable():
            run, _ = await self.service.create(checked_request, self.actor)
            [run] = await self._waiting.explain([run])
        return run

    async def create_batch(self, requests: Sequence[CreateRequest]) -> list[Run | JobplaneError]:
        items = [self._item_request(r) for r in requests]
        with _reachable():
            created = await self.service.create_many(items, self.actor)
            outcomes = await self._waiting.explain_created(created)
        return [o if isinstance(o, JobplaneError) else o[0] for o in outcomes]

    async def get(self, run_id: str) -> Run:
        with _reachable():
            [run] = await self._waiting.explain([await self.service.get(run_id)])
        return run

    async def cancel(self, run_id: str, reason: str | None) -> Run:
        with _reachable():
            return await self.service.cancel(run_id, self.actor, reason)

    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        with _reachable():
            return checked(await self._app().request(method, path, **kwargs))

    def follow(self, path: str) -> AbstractAsyncContextManager[AsyncIterator[str]]:
        # An in-process call answers once it has ended: waiting polls instead.
        raise Unavailable("live streams need the HTTP API")

    async def close(self) -> None:
        if self._api is not None:
            await self._api.aclose()
        await self._stack.aclose()

    def _app(self) -> httpx.AsyncClient:
        """The API's app in this process, made at the first call that needs it: a producer
        that only creates and reads runs never loads FastAPI, in either mode."""
        if self._api is None:
            from jobplane.api.app import create_app
            from jobplane.api.auth import Caller

            kind, _, name = self.actor.partition(":")
            caller = Caller(name or kind, "admin", acting_as=self.actor)
            app = create_app(self.settings, self._backends, trusted=caller)
            transport = httpx.ASGITransport(app)
            self._api = httpx.AsyncClient(transport=transport, base_url="http://direct")
        return self._api

    @property
    def service(self) -> RunService:
        assert self._service is not None, "opened by Client before any call"
        return self._service

    def _item_request(self, request: CreateRequest) -> RunRequest | JobplaneError:
        """The service's request for a batch item, or why it is refused."""
        try:
            return read_request(request.body(), self.settings.max_payload_bytes)
        except JobplaneError as error:
            return error


@contextmanager
def _reachable() -> Iterator[None]:
    """MongoDB or Redis not answering is `Unavailable`, as the API's 503 says over HTTP."""
    try:
        yield
    except ConnectionFailure as exc:
        raise Unavailable(f"MongoDB unavailable: {exc}") from exc
    except REDIS_DOWN as exc:
        raise Unavailable(f"Redis unavailable: {exc}") from exc
