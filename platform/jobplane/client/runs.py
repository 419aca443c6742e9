"""`client.runs`: create runs (one or many), read, list, cancel and wait for them."""

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote

from jobplane.client.request import CreateRequest
from jobplane.client.transport import Opened, every
from jobplane.errors import JobplaneError, Unavailable
from jobplane.model import TERMINAL, Run, RunStatus, Scope

# The API's MAX_BATCH; named again here so that an HTTP producer need not import FastAPI.
BATCH = 1000
# Chunks of one `create_many` in flight at once: one chunk's MongoDB and Redis round trips
# overlap another's JSON and validation work.
CHUNKS_IN_FLIGHT = 4
# A run waited for is read at most this often once its first reads found it going.
MAX_POLL_SECONDS = 1.0
# Live streams one `wait_many` holds open at once; the other runs wait for a place, unread.
MAX_STREAMS = 100
# A stream that broke, or ended before its run did, is opened again this much later; the run
# is polled meanwhile.
STREAM_RETRY_SECONDS = 5.0


class Runs:
    def __init__(self, opened: Opened) -> None:
        self._opened = opened

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
        return await (await self._opened()).create(request)

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
        transport = await self._opened()
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
        return await (await self._opened()).get(run_id)

    async def cancel(self, run_id: str, reason: str | None = None) -> Run:
        """A pending or queued run ends `cancelled` at once; a running one goes
        `cancel_requested` until its worker stops; a finished one: `ResourceInvalidState`."""
        return await (await self._opened()).cancel(run_id, reason)

    # `timeout` rather than `asyncio.timeout` around the call: SyncClient.wait has the same.
    async def wait(
        self,
        run_id: str,
        timeout: float | None = None,  # noqa: ASYNC109
        poll: float = 0.02,
    ) -> Run:
        """The run once it is terminal (succeeded, failed, cancelled or expired); see
        `wait_many`."""
        [run] = await self.wait_many([run_id], timeout, poll)
        return run

    async def wait_many(
        self,
        run_ids: Iterable[str],
        timeout: float | None = None,  # noqa: ASYNC109
        poll: float = 0.02,
    ) -> list[Run]:
        """The runs, in the order given, once each is terminal.

        Over HTTP each run's live stream (`GET /v1/runs/{id}/stream`, one request for the
        run's whole life) says when it ends, up to MAX_STREAMS at once. Without one (direct
        mode, or a stream that broke, opened again STREAM_RETRY_SECONDS later) a run is read
        after `poll` seconds and then less and less often, up to once a second. Raises
        `TimeoutError` naming the runs still going after `timeout` seconds; `NotFound` if a
        run does not exist (or is not yours).
        """
        ids = list(dict.fromkeys(run_ids))
        await self._opened()  # once, before the runs' tasks
        streams = asyncio.Semaphore(MAX_STREAMS)
        seen: dict[str, Run] = {}
        following = [asyncio.create_task(self._ended(i, poll, streams, seen)) for i in ids]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*following)
        except TimeoutError:
            going = [i for i in ids if i not in seen or seen[i].status not in TERMINAL]
            said = [f"{i} ({seen[i].status.value})" if i in seen else i for i in going[:5]]
            more = f" and {len(going) - 5} more" if len(going) > 5 else ""
            raise TimeoutError(f"still going after {timeout} s: {', '.join(said)}{more}") from None
        finally:  # one failed (NotFound, say), or the time is up: the others stop, and close
            for task in following:
                task.cancel()
            await asyncio.gather(*following, return_exceptions=True)
        return [seen[i] for i in ids]

    async def list(
        self,
        *,
        status: RunStatus | str | None = None,
        template_type: str | None = None,
        scope: Scope | None = None,
        scope_id: str | None = None,
        schedule_id: str | None = None,
        parent_run_id: str | None = None,
    ) -> AsyncIterator[Run]:
        """Every run under the filters, newest first, a page at a time (a user key's: its
        own scopes only)."""
        params = {
            "status": status,
            "templateType": template_type,
            "scope": scope,
            "scopeId": scope_id,
            "scheduleId": schedule_id,
            "parentRunId": parent_run_id,
        }
        async for run in every(self._opened, "/v1/runs", params, Run):
            yield run

    async def _ended(
        self,
        run_id: str,
        poll: float,
        streams: asyncio.Semaphore,
        seen: dict[str, Run],
    ) -> None:
        """Follow one run until it is terminal, as `seen[run_id]`."""
        transport = await self._opened()
        delay, stream_at = poll, 0.0
        while True:
            if time.monotonic() >= stream_at:
                async with streams:
                    try:
                        path = f"/v1/runs/{quote(run_id, safe='')}/stream"
                        async with transport.follow(path) as messages:
                            async for data in messages:
                                seen[run_id] = Run.model_validate_json(data)
                                if seen[run_id].status in TERMINAL:
                                    return
                    except Unavailable:  # none, or it broke: a read says if the API is there
                        pass
                stream_at = time.monotonic() + STREAM_RETRY_SECONDS
            seen[run_id] = await transport.get(run_id)
            if seen[run_id].status in TERMINAL:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, MAX_POLL_SECONDS)
