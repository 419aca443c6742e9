"""The HTTP API as `Client` reaches it: requests with an API key over a pool of keep-alive
connections, live streams on connections of their own, and the API's answers read back into
models and `jobplane.errors`."""

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from jobplane import tracing
from jobplane.client.request import CreateRequest
from jobplane.errors import JobplaneError, ServerError, Unavailable, ValidationFailed, answered
from jobplane.model import Run

M = TypeVar("M", bound=BaseModel)


class HTTPTransport:
    """The HTTP API with an API key: `POST /v1/runs`, `/v1/runs/batch`, `GET /v1/runs/{id}`, ..."""

    def __init__(self, url: str, api_key: str | None, timeout: float, connections: int) -> None:
        self.url = url.rstrip("/")
        self._options: dict[str, Any] = {
            "base_url": self.url,
            "headers": {"authorization": f"Bearer {api_key}"} if api_key else {},
            "timeout": timeout,
            # One connection per httpx client: httpcore's pool looks at each connection it
            # holds for every request, which at 32 connections costs a few ms of CPU each.
            "limits": httpx.Limits(max_connections=1, max_keepalive_connections=1),
            "verify": httpx.create_ssl_context(),  # made once: it reads the CA bundle
        }
        # HTTP/1.1 keep-alive connections, each used by one call at a time; the last one
        # freed is the next one used, so connections kept are warm.
        self._slots = asyncio.Semaphore(connections)
        self._clients: list[httpx.AsyncClient] = []
        self._idle = [self._connection()]  # an invalid url fails here, not at the first call

    async def open(self) -> None:
        pass  # connections open as calls need them

    async def create(self, request: CreateRequest) -> Run:
        return _run(await self.call("POST", "/v1/runs", json=request.body()))

    async def create_batch(self, requests: Sequence[CreateRequest]) -> list[Run | JobplaneError]:
        body = {"runs": [r.body() for r in requests]}
        try:
            response = await self.call("POST", "/v1/runs/batch", json=body)
        except ValidationFailed as refused:
            # The API refuses the whole batch if an item breaks its schema (a wrong type, a
            # priority out of range): those items get that error, the others are sent again.
            bad = _problems_by_item(refused)
            if not bad:
                raise
            rest = [i for i in range(len(requests)) if i not in bad]
            created = iter(await self.create_batch([requests[i] for i in rest]) if rest else [])
            return [
                ValidationFailed("invalid request", bad[i]) if i in bad else next(created)
                for i in range(len(requests))
            ]
        items = read(_Batch, response).items
        if len(items) != len(requests):
            raise ServerError(f"{response.url} answered {len(items)} items for {len(requests)}")
        return [item.outcome(i) for i, item in enumerate(items)]

    async def get(self, run_id: str) -> Run:
        return _run(await self.call("GET", f"/v1/runs/{quote(run_id, safe='')}"))

    async def cancel(self, run_id: str, reason: str | None) -> Run:
        path = f"/v1/runs/{quote(run_id, safe='')}/cancel"
        return _run(await self.call("POST", path, json={"reason": reason} if reason else {}))

    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request (httpx's keyword arguments); an answer of 400 or more is raised as the
        API's error, no answer as `Unavailable`. Sent inside a trace, it carries its context
        (`traceparent`): the runs it creates continue the caller's trace."""
        if (context := tracing.carrier()) is not None:
            kwargs["headers"] = {**kwargs.get("headers", {}), **context}
        async with self._slots:
            http = self._idle.pop() if self._idle else self._connection()
            try:
                response = await http.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise Unavailable(f"cannot reach {self.url} ({_reason(exc)})") from exc
            finally:
                self._idle.append(http)
        return checked(response)

    @asynccontextmanager
    async def follow(self, path: str) -> AsyncIterator[AsyncIterator[str]]:
        """The Server-Sent Events stream at `path`, open (the server answered), as the data
        of each message until the server ends it. A refusal is the API's error; a stream that
        cannot open or breaks is `Unavailable`. It has a connection of its own for as long as
        it lasts, outside the pool's count: a stream holds one for minutes."""
        http = httpx.AsyncClient(**self._options)
        try:
            headers = {"accept": "text/event-stream"}
            async with http.stream("GET", path, headers=headers) as response:
                if response.status_code >= 400:
                    await response.aread()
                    checked(response)
                yield _messages(response, path)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the stream {path} broke ({_reason(exc)})") from exc
        finally:
            await http.aclose()

    async def close(self) -> None:
        for http in self._clients:
            await http.aclose()

    def _connection(self) -> httpx.AsyncClient:
        http = httpx.AsyncClient(**self._options)
        self._clients.append(http)
        return http


async def _messages(response: httpx.Response, path: str) -> AsyncIterator[str]:
    data: list[str] = []
    try:
        async for line in response.aiter_lines():
            if line == "":  # a message ends
                if data:
                    yield "\n".join(data)
                data = []
            elif line.startswith("data:"):  # the other fields `Client` does not need
                data.append(line.removeprefix("data:").removeprefix(" "))
    except httpx.HTTPError as exc:
        raise Unavailable(f"the stream {path} broke ({_reason(exc)})") from exc


def _reason(exc: httpx.HTTPError) -> str:
    # A timeout's text is often empty: its class name is then the only clue.
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def checked(response: httpx.Response) -> httpx.Response:
    """The response, if it is not an error; else the API's error it carries, raised."""
    if response.status_code >= 400:
        raise error_of(response)
    return response


def read(model: type[M], response: httpx.Response) -> M:
    """The body as `model`; a body that is not one is the server's fault."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise ServerError(f"{response.url} answered {response.status_code}: {exc}") from None


def error_of(response: httpx.Response) -> JobplaneError:
    try:
        error = _ErrorBody.model_validate(response.json()["error"])
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        text = response.text[:200] or "(no body)"
        return ServerError(
            f"{response.url} answered {response.status_code} without a jobplane error: {text}",
            {"status": response.status_code},
        )
    return answered(error.code, error.message, error.details, response.status_code)


def _run(response: httpx.Response) -> Run:
    return read(Run, response)


# A batch item's error points into the batch (`/runs/3/payload/x`); a result into its run.
_ITEM_POINTER = re.compile(r"^/runs/(\d+)(?=/|$)")


class _ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}


class _Item(BaseModel):
    status: int
    run: Run | None = None
    error: _ErrorBody | None = None

    def outcome(self, index: int) -> Run | JobplaneError:
        if self.run is not None:
            return self.run
        if self.error is None:
            return ServerError(f"batch item {index} has neither a run nor an error")
        details = dict(self.error.details)
        if isinstance(problems := details.get("errors"), list):
            details["errors"] = [
                {**p, "pointer": _ITEM_POINTER.sub("", str(p.get("pointer", "")))}
                for p in problems
                if isinstance(p, dict)
            ]
        return answered(self.error.code, self.error.message, details, self.status)


class _Batch(BaseModel):
    items: list[_Item]


def _problems_by_item(refused: ValidationFailed) -> dict[int, list[dict[str, Any]]]:
    """A refused batch's problems by item, pointers made the item's own; empty if any problem
    is not about one item (a list too long, a body that is not JSON)."""
    bad: dict[int, list[dict[str, Any]]] = {}
    for problem in refused.details.get("errors", []):
        found = _ITEM_POINTER.match(str(problem.get("pointer", "")))
        if found is None:
            return {}
        pointer = problem["pointer"][found.end() :]
        bad.setdefault(int(found[1]), []).append({**problem, "pointer": pointer})
    return bad
