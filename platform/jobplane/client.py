"""The producer API: applications create runs, read them, cancel them and wait for them.

`Client` talks to `jobplane api` over HTTP with an API key, or, for producers inside the trusted
network, to MongoDB and Redis directly through the `RunService` the API itself uses: one
interface, two transports. Both refuse the same requests with the same `jobplane.errors`.
`SyncClient` has the same methods, blocking, for scripts and sync web apps.

    async with Client("http://jobplane:8000", api_key=key) as client:
        run = await client.create("reports.render", scope="account", scope_id="acme")
        done = await client.wait(run.id, timeout=60)
"""

import asyncio
import os
import re
import socket
import threading
import time
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError
from pymongo.errors import ConnectionFailure

from jobplane.backends import open_backends
from jobplane.errors import JobplaneError, ServerError, Unavailable, ValidationFailed, answered
from jobplane.model import TERMINAL, Run, Scope
from jobplane.queue.connect import REDIS_DOWN
from jobplane.runs import RunRequest, RunService
from jobplane.runs.request import read_request
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings, refusal

__all__ = ["Client", "CreateRequest", "ServerError", "SyncClient"]

# The API's MAX_BATCH; named again here so that an HTTP producer need not import FastAPI.
BATCH = 1000
# Chunks of one `create_many` in flight at once: one chunk's MongoDB and Redis round trips
# overlap another's JSON and validation work.
CHUNKS_IN_FLIGHT = 4
MAX_POLL_SECONDS = 1.0
T = TypeVar("T")


@dataclass(frozen=True)
class CreateRequest:
    """One run to create: the arguments of `Client.create`, as an item of `create_many`."""

    template_type: str
    scope: Scope
    scope_id: str
    payload: dict[str, Any] | None = None
    template_version: int | None = None
    priority: int | None = None
    delay_seconds: float | None = None
    not_before: datetime | None = None
    idempotency_key: str | None = None

    def body(self) -> dict[str, Any]:
        """The body of `POST /v1/runs`: camelCase, JSON-ready, without the fields left unset."""
        fields = {
            "templateType": self.template_type,
            "templateVersion": self.template_version,
            "scope": self.scope,
            "scopeId": self.scope_id,
            "payload": self.payload,
            "priority": self.priority,
            "delaySeconds": self.delay_seconds,
            "notBefore": self.not_before.isoformat() if self.not_before else None,
            "idempotencyKey": self.idempotency_key,
        }
        return {name: value for name, value in fields.items() if value is not None}


class Transport(Protocol):
    """What `Client` needs from a way of reaching jobplane."""

    async def open(self) -> None: ...
    async def create(self, request: CreateRequest) -> Run: ...
    async def create_batch(self, requests: Sequence[CreateRequest]) -> list[Run | JobplaneError]:
        """At most BATCH runs; each item gets its run or the error `create` would raise."""
        ...

    async def get(self, run_id: str) -> Run: ...
    async def cancel(self, run_id: str, reason: str | None) -> Run: ...
    async def close(self) -> None: ...


class Client:
    """Creates and follows runs, over HTTP or (given `mongodb_url` and `redis_url`) directly.

    HTTP: `url` (default `JOBPLANE_URL`, else http://127.0.0.1:8000) and `api_key` (default
    `JOBPLANE_API_KEY`); up to `connections` HTTP/1.1 keep-alive connections, shared by calls.
    Direct: MongoDB and Redis as the platform's processes use them (`db`, `redis_prefix` and
    every other setting default to the `JOBPLANE_*` variables), acting as `actor` in the audit
    trail (default `client:<hostname>`); no API key, so trusted producers only.

    Many concurrent `create` calls are cheap in both modes: direct ones share MongoDB and Redis
    writes (the store's group commit), HTTP ones share the pool. Every created run is durable
    in MongoDB before its call returns. Connections open on first use or on `async with`.
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

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def create(
        self,
        template_type: str,
        *,
        scope: Scope,
        scope_id: str,
        payload: dict[str, Any] | None = None,
        template_version: int | None = None,
        priority: int | None = None,
        delay_seconds: float | None = None,
        not_before: datetime | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """Create a run of the template's latest (or the given) version.

        A repeated `idempotency_key` in the same scope returns the run it created first.
        Raises what the API answers: `NotFound` (no such template), `TemplateDisabled`,
        `ValidationFailed` (with `details["errors"]`), `ConcurrencyConflict`, `Forbidden`, ...
        """
        request = CreateRequest(
            template_type,
            scope,
            scope_id,
            payload,
            template_version,
            priority,
            delay_seconds,
            not_before,
            idempotency_key,
        )
        return await (await self._open()).create(request)

    async def create_many(
        self, requests: Iterable[CreateRequest | Mapping[str, Any]]
    ) -> list[Run | JobplaneError]:
        """Create many runs; in request order, each item's run or the error `create` would
        have raised for it (not raised: one bad item does not stop the others).

        A mapping holds `create`'s arguments by name. Runs go in chunks of 1,000 (one
        `POST /v1/runs/batch` each, or one `RunService.create_many`). A failure of a whole
        chunk (the server unreachable, say) is raised once every chunk has been answered; the
        runs of the other chunks exist then, so give runs an `idempotency_key` to retry safely.
        """
        items = [r if isinstance(r, CreateRequest) else CreateRequest(**r) for r in requests]
        transport = await self._open()
        gate = asyncio.Semaphore(CHUNKS_IN_FLIGHT)

        async def chunk(start: int) -> list[Run | JobplaneError]:
            async with gate:
                return await transport.create_batch(items[start : start + BATCH])

        answers = await asyncio.gather(
            *(chunk(start) for start in range(0, len(items), BATCH)), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return [result for answer in answers if isinstance(answer, list) for result in answer]

    async def get(self, run_id: str) -> Run:
        """The run with its progress; `NotFound` if it does not exist (or is not yours)."""
        return await (await self._open()).get(run_id)

    async def cancel(self, run_id: str, reason: str | None = None) -> Run:
        """A pending or queued run ends `cancelled` at once; a running one goes
        `cancel_requested` until its worker stops; a finished one: `ResourceInvalidState`."""
        return await (await self._open()).cancel(run_id, reason)

    # `timeout` rather than `asyncio.timeout` around the call: SyncClient.wait has the same.
    async def wait(
        self,
        run_id: str,
        timeout: float | None = None,  # noqa: ASYNC109
        poll: float = 0.02,
    ) -> Run:
        """The run once it is terminal (succeeded, failed, cancelled or expired).

        Polls, first after `poll` seconds and then less and less often (up to once a second),
        so a quick run is seen quickly and a long one costs few requests. Raises `TimeoutError`
        if it is still going after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = poll
        while True:
            run = await self.get(run_id)
            if run.status in TERMINAL:
                return run
            pause = delay
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"run {run_id} is {run.status.value} after {timeout} s")
                pause = min(delay, left)
            await asyncio.sleep(pause)
            delay = min(delay * 1.5, MAX_POLL_SECONDS)

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
        return _run(await self._send("POST", "/v1/runs", json=request.body()))

    async def create_batch(self, requests: Sequence[CreateRequest]) -> list[Run | JobplaneError]:
        body = {"runs": [r.body() for r in requests]}
        try:
            response = await self._send("POST", "/v1/runs/batch", json=body)
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
        try:
            items = _Batch.model_validate_json(response.content).items
        except ValidationError as exc:
            raise ServerError(f"{response.url} answered {response.status_code}: {exc}") from None
        if len(items) != len(requests):
            raise ServerError(f"{response.url} answered {len(items)} items for {len(requests)}")
        return [item.outcome(i) for i, item in enumerate(items)]

    async def get(self, run_id: str) -> Run:
        return _run(await self._send("GET", f"/v1/runs/{quote(run_id, safe='')}"))

    async def cancel(self, run_id: str, reason: str | None) -> Run:
        path = f"/v1/runs/{quote(run_id, safe='')}/cancel"
        return _run(await self._send("POST", path, json={"reason": reason} if reason else {}))

    async def close(self) -> None:
        for http in self._clients:
            await http.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async with self._slots:
            http = self._idle.pop() if self._idle else self._connection()
            try:
                response = await http.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                # A timeout's text is often empty: its class name is then the only clue.
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                raise Unavailable(f"cannot reach {self.url} ({reason})") from exc
            finally:
                self._idle.append(http)
        if response.status_code >= 400:
            raise _error_of(response)
        return response

    def _connection(self) -> httpx.AsyncClient:
        http = httpx.AsyncClient(**self._options)
        self._clients.append(http)
        return http


class DirectTransport:
    """MongoDB and Redis through `RunService`, as the API process uses them (no HTTP); requests
    are checked as the API checks them, so both transports refuse the same ones."""

    def __init__(self, settings: Settings, actor: str) -> None:
        self.settings = settings
        self.actor = actor
        self._stack = AsyncExitStack()
        self._service: RunService | None = None

    async def open(self) -> None:
        with _reachable():
            backends = await self._stack.enter_async_context(open_backends(self.settings))
        self._service = RunService(backends.store, backends.queue)
        self._waiting = Waiting(backends.store, backends.queue)

    async def create(self, request: CreateRequest) -> Run:
        checked = read_request(request.body(), self.settings.max_payload_bytes)
        with _reachable():
            run, _ = await self.service.create(checked, self.actor)
            [run] = await self._waiting.explain([run])
        return run

    async def create_batch(self, requests: Sequence[CreateRequest]) -> list[Run | JobplaneError]:
        checked = [self._item_request(r) for r in requests]
        with _reachable():
            created = await self.service.create_many(checked, self.actor)
            outcomes = await self._waiting.explain_created(created)
        return [o if isinstance(o, JobplaneError) else o[0] for o in outcomes]

    async def get(self, run_id: str) -> Run:
        with _reachable():
            [run] = await self._waiting.explain([await self.service.get(run_id)])
        return run

    async def cancel(self, run_id: str, reason: str | None) -> Run:
        with _reachable():
            return await self.service.cancel(run_id, self.actor, reason)

    async def close(self) -> None:
        await self._stack.aclose()

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


class SyncClient:
    """`Client`'s methods, blocking, for scripts and sync web apps; takes `Client`'s arguments.

    One private event loop, in a daemon thread, runs every call: a SyncClient may be shared by
    many threads, and their concurrent calls share connections (and, direct, MongoDB writes).
    """

    def __init__(self, url: str | None = None, **options: Any) -> None:
        self._client = Client(url, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="jobplane-client", daemon=True
        )
        self._thread.start()
        self._closing = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def create(
        self,
        template_type: str,
        *,
        scope: Scope,
        scope_id: str,
        payload: dict[str, Any] | None = None,
        template_version: int | None = None,
        priority: int | None = None,
        delay_seconds: float | None = None,
        not_before: datetime | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """See `Client.create`."""
        return self._call(
            self._client.create(
                template_type,
                scope=scope,
                scope_id=scope_id,
                payload=payload,
                template_version=template_version,
                priority=priority,
                delay_seconds=delay_seconds,
                not_before=not_before,
                idempotency_key=idempotency_key,
            )
        )

    def create_many(
        self, requests: Iterable[CreateRequest | Mapping[str, Any]]
    ) -> list[Run | JobplaneError]:
        """See `Client.create_many`."""
        return self._call(self._client.create_many(list(requests)))

    def get(self, run_id: str) -> Run:
        """See `Client.get`."""
        return self._call(self._client.get(run_id))

    def cancel(self, run_id: str, reason: str | None = None) -> Run:
        """See `Client.cancel`."""
        return self._call(self._client.cancel(run_id, reason))

    def wait(self, run_id: str, timeout: float | None = None, poll: float = 0.02) -> Run:
        """See `Client.wait`."""
        return self._call(self._client.wait(run_id, timeout, poll))

    def close(self) -> None:
        """Close the connections and stop the loop's thread; calling it again does nothing."""
        with self._closing:
            if self._loop.is_closed():
                return
            try:
                self._call(self._client.close())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()

    def _call(self, call: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            call.close()  # never started: without this Python warns it was never awaited
            raise RuntimeError("this SyncClient is closed")
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): do not leave the call running
            raise


# -- answers of the HTTP API -----------------------------------------------------------------------

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


def _run(response: httpx.Response) -> Run:
    try:
        return Run.model_validate_json(response.content)
    except ValidationError as exc:
        raise ServerError(f"{response.url} answered {response.status_code}: {exc}") from None


def _error_of(response: httpx.Response) -> JobplaneError:
    try:
        error = _ErrorBody.model_validate(response.json()["error"])
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        text = response.text[:200] or "(no body)"
        return ServerError(
            f"{response.url} answered {response.status_code} without a jobplane error: {text}",
            {"status": response.status_code},
        )
    return answered(error.code, error.message, error.details, response.status_code)


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
