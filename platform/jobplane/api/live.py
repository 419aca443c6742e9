"""Live streams (Server-Sent Events): a run as it changes, and the audit trail as it grows.

A run's stream sends the run as `GET /v1/runs/{id}` shows it each time it changes, and ends
after a terminal status. One MongoDB change stream per API process serves every open run
stream (`RunChanges`): it names only which run changed, and each stream reads its run again.
A change stream per client would hold a connection of the pool for each, and read the oplog
once per client.

The trail's stream is a change stream of `job_events` inserts under the same filters and scope
rules as `GET /v1/events`. Each SSE `id` is the change's resume token, which orders the trail
as entries arrive; a client that reconnects with it (`Last-Event-ID`) gets every entry after
it, including those written while it was away, as far back as MongoDB's oplog reaches.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from pymongo.asynchronous.change_stream import AsyncChangeStream
from pymongo.errors import OperationFailure, PyMongoError

from jobplane.errors import ResourceInvalidState
from jobplane.model import CLAIMABLE, TERMINAL, Run
from jobplane.runs.waiting import Waiting
from jobplane.store import EventQuery, Store

log = logging.getLogger("jobplane.api")

# The OpenAPI description of a stream's answer: SSE text, each message's data a JSON document.
SSE_SCHEMA = {"schema": {"type": "string", "description": "Server-Sent Events, data in JSON"}}
# A failed change stream is opened again after this long.
RETRY_SECONDS = 0.5
# How often an idle stream sends a comment, so that proxies keep it open.
KEEP_ALIVE_SECONDS = 15
# How often a stream of a run waiting to start looks at why it waits.
WAITING_SECONDS = 1.0


class RunChanges:
    """Wakes this process's run streams when their runs change, through one change stream."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._woken: dict[str, set[asyncio.Event]] = {}
        # Set when a run joins: the change stream is opened again to include it.
        self._joined = asyncio.Event()
        # The runs that joined since the stream was last opened.
        self._new: set[str] = set()
        self._follower: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def watch(self, run_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever the run may have changed, until the block ends. It is set
        once more when the change stream starts to include the run: what changed before
        that, a reader reads then."""
        woken = asyncio.Event()
        if run_id not in self._woken:
            self._new.add(run_id)
            self._joined.set()
        self._woken.setdefault(run_id, set()).add(woken)
        if self._follower is None or self._follower.done():
            self._follower = asyncio.create_task(self._follow())
        try:
            yield woken
        finally:
            watchers = self._woken.get(run_id, set())
            watchers.discard(woken)
            if not watchers:
                self._woken.pop(run_id, None)

    async def _follow(self) -> None:
        token: Any = None
        while self._woken:
            self._joined.clear()
            run_ids, new = list(self._woken), list(self._new)
            self._new.clear()
            try:
                async with await self._store.runs.watch(run_ids, token) as stream:
                    # The stream resumes where the last one ended for the runs it had; a run
                    # new to it may have changed before it began: its readers read it again.
                    self._wake(new if token is not None else run_ids)
                    while self._woken and not self._joined.is_set():
                        change = await stream.try_next()
                        token = stream.resume_token
                        if change is not None:
                            self._wake([str(change["documentKey"]["_id"])])
            except Exception as exc:
                log.warning("the runs' change stream failed (%s); opening it again", exc)
                self._new.update(new)
                if isinstance(exc, OperationFailure):
                    token = None  # a token it cannot resume from; readers read afresh
                await asyncio.sleep(RETRY_SECONDS)

    def _wake(self, run_ids: Sequence[str]) -> None:
        for run_id in run_ids:
            for woken in self._woken.get(run_id, ()):
                woken.set()


async def run_changes(
    run: Run, store: Store, changes: RunChanges, waiting: Waiting, stop: asyncio.Event
) -> AsyncIterator[dict[str, str]]:
    """SSE events of `run` (as read, visible to the caller): now, then at each change, until a
    terminal status or `stop`. While the run waits to start, why it waits (`waitingFor`) can
    change without the run (a queue paused, a worker gone): it is looked at every second."""
    async with changes.watch(run.id) as woken:
        sent: Run | None = None
        while not stop.is_set():
            woken.clear()
            if sent is not None:
                found = await store.runs.get(run.id)
                if found is None:  # a run is never deleted; say so if one was
                    return
                run = found
            [shown] = await waiting.explain([run])
            if sent is None or (shown.version, shown.waiting_for) != (
                sent.version,
                sent.waiting_for,
            ):
                sent = shown
                yield {"event": "run", "id": str(run.version), "data": _json(shown)}
            if run.status in TERMINAL:
                return
            await _either(woken, stop, WAITING_SECONDS if run.status in CLAIMABLE else None)


async def open_trail(
    store: Store,
    query: EventQuery,
    within: Sequence[tuple[str, str]] | None,
    after: str | None,
) -> AsyncChangeStream[dict[str, Any]]:
    """The change stream of a trail stream, opened before the answer starts so that a position
    MongoDB cannot resume from is refused plainly (409) rather than mid-stream."""
    token = {"_data": after} if after else None
    try:
        return await store.trail.watch_audit(query, within, token)
    except OperationFailure as exc:
        if token is None:
            raise
        raise ResourceInvalidState(
            "this Last-Event-ID is older than MongoDB's oplog reaches, or is no position of "
            "the trail: read what you missed from GET /v1/events, then stream from now"
        ) from exc


async def trail_changes(
    store: Store,
    query: EventQuery,
    within: Sequence[tuple[str, str]] | None,
    stream: AsyncChangeStream[dict[str, Any]],
    stop: asyncio.Event,
) -> AsyncIterator[dict[str, str]]:
    """SSE events of the trail entries `stream` (from `open_trail`) brings, until `stop`; a
    stream that fails is resumed after the last entry sent."""
    try:
        while not stop.is_set():
            try:
                change = await stream.try_next()
            except PyMongoError as exc:
                log.warning("an events stream's change stream failed (%s); resuming it", exc)
                await asyncio.sleep(RETRY_SECONDS)
                await stream.close()
                stream = await store.trail.watch_audit(query, within, stream.resume_token)
                continue
            if change is not None:
                event = store.trail.event_of(change["fullDocument"])
                yield {"event": "event", "id": change["_id"]["_data"], "data": _json(event)}
    finally:
        await stream.close()


async def _either(woken: asyncio.Event, stop: asyncio.Event, at_most: float | None) -> None:
    waits = [asyncio.create_task(woken.wait()), asyncio.create_task(stop.wait())]
    try:
        await asyncio.wait(waits, timeout=at_most, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waits, return_exceptions=True)


def _json(model: Any) -> str:
    text: str = model.model_dump_json(by_alias=True)
    return text
