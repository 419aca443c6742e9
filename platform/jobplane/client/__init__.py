"""The producer API: applications register templates, create, list, cancel and wait for runs,
keep schedules, read the trail and manage keys, from Python.

`Client` talks to `jobplane api` over HTTP with an API key, or, for producers inside the trusted
network, to MongoDB and Redis directly (`client/direct.py`): one interface, two transports, the
same answers and the same `jobplane.errors`. `SyncClient` has the same names, blocking.

    async with Client("http://jobplane:8000", api_key=key) as client:
        await client.templates.apply(report)
        run = await client.runs.create("report", scope="account", scope_id="acme")
        done = await client.runs.wait(run.id, timeout=60)
"""

import asyncio
import os
import socket
from types import TracebackType
from typing import Any, Self

from pydantic import ValidationError

from jobplane.client.direct import DirectTransport
from jobplane.client.http import HTTPTransport
from jobplane.client.request import CreateRequest
from jobplane.client.resources import Events, Keys, Schedules, Templates
from jobplane.client.runs import Runs
from jobplane.client.sync import SyncClient
from jobplane.client.transport import Transport
from jobplane.errors import ServerError
from jobplane.settings import Settings, refusal

__all__ = ["Client", "CreateRequest", "ServerError", "SyncClient"]


class Client:
    """The API from Python, over HTTP or (given `mongodb_url` and `redis_url`) directly.

    HTTP: `url` (default `JOBPLANE_URL`, else http://127.0.0.1:8000) and `api_key` (default
    `JOBPLANE_API_KEY`), whose role and scopes decide what it may do; up to `connections`
    HTTP/1.1 keep-alive connections, shared by calls, and a connection per live stream.
    Direct: MongoDB and Redis as the platform's processes use them (`db`, `redis_prefix` and
    every other setting default to the `JOBPLANE_*` variables), acting as an admin named
    `actor` in the audit trail (default `client:<hostname>`); no API key, so trusted
    producers only.

    Namespaces: `runs`, `templates`, `schedules`, `events`, `keys`; `create`, `create_many`,
    `get`, `cancel` and `wait` are `runs`'. Many concurrent `create` calls are cheap in both
    modes: direct ones share MongoDB and Redis writes (the store's group commit), HTTP ones
    share the pool. Every created run is durable in MongoDB before its call returns.
    Connections open on first use or on `async with`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        mongodb_url: str | None = None,
        redis_url: str | None = None,
        db: str | None = None,
        redis_prefix: str | None = None,
        actor: str | None = None,
        timeout: float = 30.0,
        connections: int = 100,
    ) -> None:
        self._transport: Transport
        if mongodb_url is None and redis_url is None:
            url = url or os.environ.get("JOBPLANE_URL") or "http://127.0.0.1:8000"
            api_key = api_key or os.environ.get("JOBPLANE_API_KEY")
            self._transport = HTTPTransport(url, api_key, timeout, connections)
        elif url is not None or mongodb_url is None or redis_url is None:
            raise ValueError("give either url, or both mongodb_url and redis_url")
        elif api_key is not None:
            raise ValueError(
                "an api_key acts as its key's role and scopes, which only the HTTP API "
                "applies: give url for that; direct mode (mongodb_url, redis_url) acts as admin"
            )
        else:
            given: dict[str, Any] = {"mongodb_url": mongodb_url, "redis_url": redis_url}
            given |= {"db": db, "redis_prefix": redis_prefix}
            try:
                settings = Settings(**{k: v for k, v in given.items() if v is not None})
            except ValidationError as exc:
                raise ValueError(refusal(exc)) from None
            actor = actor or f"client:{socket.gethostname()}"
            self._transport = DirectTransport(settings, actor)
        self._opened = self._closed = False
        self._opening = asyncio.Lock()
        self.runs = Runs(self._open)
        self.templates = Templates(self._open)
        self.schedules = Schedules(self._open)
        self.events = Events(self._open)
        self.keys = Keys(self._open)
        # The calls of the first `Client`, kept: the same as `runs`'.
        self.create = self.runs.create
        self.create_many = self.runs.create_many
        self.get = self.runs.get
        self.cancel = self.runs.cancel
        self.wait = self.runs.wait

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections; calling it again does nothing."""
        if not self._closed:
            self._closed = True
            await self._transport.close()

    async def _open(self) -> Transport:
        if self._closed:
            raise RuntimeError("this Client is closed")
        if not self._opened:
            async with self._opening:  # concurrent first calls open once
                if not self._opened:
                    await self._transport.open()
                    self._opened = True
        return self._transport
