"""What `Client` needs from a way of reaching jobplane: `http.HTTPTransport` or
`direct.DirectTransport`."""

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

import httpx
from pydantic import BaseModel

from jobplane.client.http import read
from jobplane.client.request import CreateRequest
from jobplane.errors import JobplaneError
from jobplane.model import Run
from jobplane.model.answers import Page

M = TypeVar("M", bound=BaseModel)


class Transport(Protocol):
    async def open(self) -> None: ...
    async def create(self, request: CreateRequest) -> Run: ...
    async def create_batch(self, requests: Sequence[CreateRequest]) -> list[Run | JobplaneError]:
        """At most BATCH runs; each item gets its run or the error `create` would raise."""
        ...

    async def get(self, run_id: str) -> Run: ...
    async def cancel(self, run_id: str, reason: str | None) -> Run: ...
    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Any request of the HTTP API (httpx's keyword arguments); its error raised."""
        ...

    def follow(self, path: str) -> AbstractAsyncContextManager[AsyncIterator[str]]:
        """A live stream's messages; `Unavailable` if it cannot open or breaks (or, direct,
        has none)."""
        ...

    async def close(self) -> None: ...


# The transport, opened on first use.
Opened = Callable[[], Awaitable[Transport]]


async def every(
    opened: Opened, path: str, params: dict[str, Any], model: type[M]
) -> AsyncIterator[M]:
    """Each item of a list the API answers in pages, one page read at a time."""
    transport = await opened()
    query = {k: v for k, v in params.items() if v is not None}
    while True:
        page = read(Page[model], await transport.call("GET", path, params=query))  # type: ignore[valid-type]
        for item in page.items:
            yield item
        if page.next_cursor is None:
            return
        query = {**query, "cursor": page.next_cursor}
